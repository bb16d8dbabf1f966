"""Switching algorithms mid-run: ``federation.schedule``, a list of phases.

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
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..aggregation import aggregate
from ..schema import as_plain
from .round import _KEYS, Federation
from ..checks import is_int

__all__ = ["PHASE_KEYS", "Phase", "FederationSchedule", "plan_phases"]

PHASE_KEYS = frozenset(_KEYS - {"schedule", "on_nonfinite"})


@dataclass(frozen=True)
class Phase:
    """One phase: steps ``from_step < step <= until_step`` (``None``: to the end) with ``spec``
    (the top-level federation keys overridden by the phase's own, without ``schedule``)."""

    index: int
    from_step: int
    until_step: int | None
    spec: dict
    scheduled: bool = True

    @property
    def where(self) -> str:
        return f"federation.schedule[{self.index}]" if self.scheduled else "federation"


def _merge(base: dict, override: Mapping) -> dict:
    out = dict(base)
    for key, value in override.items():
        if key == "outer" and isinstance(value, Mapping):
            out["outer"] = {**(base.get("outer") or {}), **value}
        else:
            out[key] = value
    return out


def plan_phases(spec: Mapping[str, Any], steps: int | None = None) -> list[Phase]:
    """The phases of ``federation`` (one, without ``schedule``); one ``ValueError`` line for a
    malformed schedule (``steps``: ``train.steps``, to check the last phase reaches it)."""
    base = {k: v for k, v in as_plain(spec).items() if k != "schedule"}  # plain: the summary records it
    schedule = spec.get("schedule")
    if schedule is None:
        return [Phase(0, 0, None, base, scheduled=False)]
    example = "e.g. [{until_step: 50, algorithm: synchronous}, {until_step: null, every: 16}]"
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ValueError(f"federation.schedule={schedule!r}: must be a non-empty list of phases ({example}) or null")
    phases, previous = [], 0
    for i, entry in enumerate(schedule):
        where = f"federation.schedule[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}={entry!r}: a phase is a mapping of until_step and federation keys ({example})")
        if "until_step" not in entry:
            raise ValueError(f"{where}: until_step is missing (the step the phase ends after; null: the end of training)")
        unknown = sorted(set(entry) - PHASE_KEYS - {"until_step"})
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}: a phase takes until_step and {sorted(PHASE_KEYS)}")
        if "outer" in entry and not isinstance(entry["outer"], Mapping):
            raise ValueError(f"{where}.outer={entry['outer']!r}: must be a mapping of outer keys (e.g. {{name: nesterov}})")
        until, last = entry["until_step"], i == len(schedule) - 1
        if until is None:
            if not last:
                raise ValueError(f"{where}.until_step=null: only the last phase may run to the end of training")
        elif not is_int(until) or until <= previous:
            raise ValueError(f"{where}.until_step={until!r}: must be an integer > {previous} (phases end at "
                             f"increasing steps; null for the last)")
        elif last and steps is not None and until < steps:
            raise ValueError(f"{where}.until_step={until}: the last phase ends before train.steps={steps}; "
                             f"make it null (the end of training)")
        phases.append(Phase(i, previous, until, _merge(base, {k: v for k, v in entry.items() if k != "until_step"})))
        previous = until
    return phases


class FederationSchedule:
    """What the training loop talks to: the federation of the current phase, and the switches.

    Collective: every rank constructs it (and switches) at the same point.
    """

    def __init__(self, spec: dict, model: torch.nn.Module, strategy, state, steps: int):
        self.phases = plan_phases(spec, steps)
        self.model, self.strategy, self.state, self.steps = model, strategy, state, steps
        self.index = -1
        self.current: Federation = None  # type: ignore[assignment]
        self._enter(0)

    def _end(self, i: int) -> tuple[int, bool]:
        """Phase ``i``'s last step and whether the job ends there."""
        until = self.phases[i].until_step
        if until is None or until >= self.steps or i == len(self.phases) - 1:
            return self.steps, True
        return until, False

    def _enter(self, i: int) -> None:
        phase = self.phases[i]
        end, last = self._end(i)
        self.index = i
        self.current = Federation.build(phase.spec, self.model, self.strategy, self.state,
                                        begin=phase.from_step, end=end, last=last)

    def resume_at(self, step: int) -> None:
        """Enter the phase that runs the step after ``step`` (a restored checkpoint's), so that
        its state dict can be loaded."""
        i = 0
        while i < len(self.phases) - 1 and not self._end(i)[1] and step >= self._end(i)[0]:
            i += 1
        if i != self.index:
            self._enter(i)

    @property
    def federated(self) -> bool:
        return self.current.federated

    def describe(self) -> dict:
        """The summary's ``federation``: the (last) phase's algorithm and, with a schedule, the phases."""
        if not self.phases[0].scheduled:
            return self.current.describe()
        return {**self.current.describe(), "phases": self.phases_run()}

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

    def _switch_at(self, done: int) -> bool:
        end, last = self._end(self.index)
        return not last and done == end

    def applies_at(self, done: int) -> bool:
        return self._switch_at(done) or self.current.applies_at(done)

    def boundary_at(self, done: int) -> bool:
        return self._switch_at(done) or self.current.boundary_at(done)

    def finish_due(self, done: int, adjust=None, dump=None, index: int = 0) -> list[dict]:
        """The records of the rounds after ``done`` steps (each with its ``phase``); at a switch the
        average, then the next phase."""
        phase = self.index
        if self._switch_at(done):
            records = [self._switch(done, adjust, dump, index)]
            self._enter(self.index + 1)
        else:
            records = self.current.finish_due(done, adjust, dump, index)
        return [{**r, "phase": phase} for r in records]

    def starts_at(self, done: int) -> bool:
        return self.current.starts_at(done)

    def start_due(self, done: int, adjust=None, dump=None, index: int = 0) -> None:
        self.current.start_due(done, adjust, dump, index)

    @torch.no_grad()
    def _switch(self, done: int, adjust, dump, index: int) -> dict:
        self.current.wait()  # nothing is in flight at a phase's end; made sure
        spec = self.current.options.weights
        weights = list(spec) if isinstance(spec, tuple) else None
        skipped: list[int] = []
        if adjust is not None:
            weights, skipped = adjust(weights, index)
        if dump is not None:
            dump.save(index, "before")
        start = time.perf_counter()
        result = aggregate(self.strategy, self.state, weights)
        if dump is not None:
            dump.save(index, "after", bytes_per_rank=result.bytes_per_rank)
        return {"round": index, "step": done, "fragment": None, "switch": True,
                "seconds": time.perf_counter() - start, "bytes_per_rank": int(result.bytes_per_rank),
                "cross_facility_bytes": int(result.cross_facility_bytes), "skipped_facilities": skipped}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {**self.current.state_dict(), "phase": torch.tensor(self.index)}

    def load_state_dict(self, sd: dict) -> None:
        if int(sd["phase"]) != self.index:
            raise RuntimeError(f"checkpoint of federation phase {int(sd['phase'])}, but phase {self.index} runs")
        self.current.load_state_dict({k: v for k, v in sd.items() if k != "phase"})
