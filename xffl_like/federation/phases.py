"""The federation's phases: ``federation.schedule``, a list of them, switching algorithms mid-run.

Each phase has ``until_step`` (the step it ends after; ``null`` for the last one: the end of
training) and any federation keys (``algorithm``, ``every``, ``weights``, ``topology``,
``outer``, ``compression``, ``chunk_size``, ``error_feedback``, ``fragments``,
``overlap_steps``, ``merge_alpha``), which override the top-level ``federation`` keys for
that phase (``outer`` key by key). Post-local SGD, for example::

    federation:
      schedule:
        - {until_step: 50, algorithm: synchronous}
        - {until_step: null, every: 16, outer: {name: nesterov, lr: 0.7, momentum: 0.9}}

Phase ``i`` covers steps ``from_step < step <= until_step`` (``from_step`` is the previous
phase's ``until_step``); its rounds and fragment offsets count from ``from_step``. At a switch
the copies are replaced by their mean over facilities (the aggregation strategy's mean, with
the ending phase's weights when they are a fixed list, uniform otherwise; a round record with
``switch: true``), so every copy starts the new phase from the same weights; the new phase
starts with fresh federation state: ``theta_global`` = those weights, the outer optimizer's
state, residuals and token counts reset. The inner optimizer keeps its state.
"""

from __future__ import annotations

import time

import torch

from ..aggregation import aggregate
from ..config.schema import FederationConfig
from .clock import phase_clock
from .delayed import delayed_federation
from .federation import Federation
from .options import plan_phases
from .protocol import Boundary, FederationPhase, NoHooks, RoundClock, RoundHooks
from .record import RoundRecord
from .streaming import StreamingFederation

__all__ = ["FederationSchedule", "build_federation"]


def build_federation(
    cfg: FederationConfig, model: torch.nn.Module, strategy, state, hooks: RoundHooks | None = None
) -> Federation:
    """The federation of ``cfg`` (validated): a :class:`~.streaming.StreamingFederation` for ``fragments > 1``
    or ``overlap_steps > 0``, :func:`~.delayed.delayed_federation`'s class for ``delay=1``, else a
    :class:`~.federation.Federation`. Where its rounds fall is the clock's (:func:`~.clock.round_clock`).
    Collective, like their constructors."""
    kind = StreamingFederation if cfg.streaming else delayed_federation(cfg) if cfg.delay else Federation
    return kind(cfg, model, strategy, state, hooks=hooks)


class FederationSchedule:
    """What the training loop talks to: the federation of the current phase, and the switches.

    Collective: every rank constructs it (and switches) at the same point.
    """

    def __init__(
        self,
        cfg: FederationConfig,
        model: torch.nn.Module,
        strategy,
        state,
        steps: int,
        hooks: RoundHooks | None = None,
        phases=None,
    ):
        """``steps``: the job's (``train.steps``); ``hooks``: what the training side does at each round
        (the non-finite guard's weights, the tests' record of the values), by default nothing."""
        # The launcher's plan (workers receive it); planned here only when built on its own (tests, benchmarks).
        self.phases = list(phases) if phases is not None else plan_phases(cfg, steps)
        self.model, self.strategy, self.state, self.steps = model, strategy, state, steps
        self.hooks = hooks if hooks is not None else NoHooks()
        self.index = -1
        self.current: FederationPhase = None  # type: ignore[assignment]
        self._enter(0)
        # What each step is, over every phase (one object: the switches are its boundaries too).
        spans = [(p.config, p.from_step, *self._end(i)) for i, p in enumerate(self.phases[: self._last + 1])]
        self.clock: RoundClock = phase_clock(spans, state, steps)

    @property
    def _last(self) -> int:
        """The index of the phase the job ends in."""
        return next(i for i in range(len(self.phases)) if self._end(i)[1])

    def _end(self, i: int) -> tuple[int, bool]:
        """Phase ``i``'s last step and whether the job ends there."""
        until = self.phases[i].until_step
        if until is None or until >= self.steps or i == len(self.phases) - 1:
            return self.steps, True
        return until, False

    def _enter(self, i: int) -> None:
        phase = self.phases[i]
        self.index = i
        self.current = build_federation(phase.config, self.model, self.strategy, self.state, hooks=self.hooks)

    def resume_at(self, step: int) -> None:
        """Enter the phase that runs the step after ``step`` (a restored checkpoint's), so that
        its state dict can be loaded."""
        i = 0
        while i < len(self.phases) - 1 and not self._end(i)[1] and step >= self._end(i)[0]:
            i += 1
        if i != self.index:
            self._enter(i)

    def describe(self) -> dict:
        """The summary's ``federation``: the (last) phase's algorithm and, with a schedule, the phases."""
        if not self.phases[0].scheduled:
            return self.current.describe()
        return {**self.current.describe(), "phases": self.phases_run()}

    def message_stats(self) -> dict:
        """The current (last) phase's :meth:`.federation.Federation.message_stats` (collective)."""
        return self.current.message_stats()

    def phases_run(self) -> list[dict]:
        """``[{from_step, until_step, config}]`` of the phases that run (``until_step``: where it ends)."""
        out = []
        for i, phase in enumerate(self.phases):
            if i > 0 and phase.from_step >= self.steps:
                break
            out.append({"from_step": phase.from_step, "until_step": self._end(i)[0], "config": phase.spec})
        return out

    # ------------------------------------------------------------------ per step
    def trained(self, tokens: int) -> None:
        self.current.trained(tokens)

    def after_backward(self) -> int:
        return self.current.after_backward()

    def finish(self, boundary: Boundary, index: int) -> list[RoundRecord]:
        """The records of the rounds that end at ``boundary`` (each with its ``phase``), numbered from
        ``index``; at a switch the average, then the next phase."""
        phase = self.index
        if boundary.switch:
            records = [self._switch(boundary.step, index)]
            self._enter(self.index + 1)
        else:
            records = self.current.finish(boundary, index)
        for record in records:
            record.phase = phase
        return records

    def start(self, boundary: Boundary, index: int) -> None:
        self.current.start(boundary, index)

    @torch.no_grad()
    def _switch(self, done: int, index: int) -> RoundRecord:
        self.current.wait()  # nothing is in flight at a phase's end; made sure
        spec = self.current.options.weights
        weights = [float(w) for w in spec] if isinstance(spec, (list, tuple)) else None
        weights, skipped = self.hooks.weights_for_round(weights, index, done)
        self.hooks.save(index, "before")
        start = time.perf_counter()
        result = aggregate(self.strategy, self.state, weights)
        self.hooks.save(index, "after", bytes_per_rank=result.bytes_per_rank)
        return RoundRecord(
            index,
            done,
            None,
            switch=True,
            seconds=time.perf_counter() - start,
            bytes_per_rank=int(result.bytes_per_rank),
            cross_facility_bytes=int(result.cross_facility_bytes),
            skipped_facilities=skipped,
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {**self.current.state_dict(), "phase": torch.tensor(self.index)}

    def load_state_dict(self, sd: dict) -> None:
        if int(sd["phase"]) != self.index:
            raise RuntimeError(f"checkpoint of federation phase {int(sd['phase'])}, but phase {self.index} runs")
        self.current.load_state_dict({k: v for k, v in sd.items() if k != "phase"})
