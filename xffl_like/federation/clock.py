"""The round clock: the one object that says what a step is (:class:`Boundary`), chosen once (:func:`round_clock`).

Once per step the trainer asks :meth:`~.protocol.RoundClock.at` and gets a frozen :class:`Boundary`: whether
to evaluate, which rounds finish, whether a phase switches, which exchanges start, whether training ends and
what a checkpoint is named by. :meth:`~.protocol.RoundClock.plan` answers the same ahead of time, without
collectives (the progress line, a stop request's next boundary).

- :class:`FixedClock`: ``federation.every=H`` (a number): rounds every ``H`` steps of each phase
  (:class:`Span`) and at its end (the job's end, or a phase switch); with ``fragments`` a boundary at each
  fragment's sync; for ``algorithm=synchronous`` (no rounds) the boundaries where the loop evaluates and
  checkpoints; an elastic facility's with ``every``; :func:`end_clock`'s (``parallel=decentralized|bagua``):
  one boundary, the end. :func:`phase_clock` spans the phases of ``federation.schedule``.
- :class:`ListClock`: ``federation.every=[H_0, ...]``: facility ``f`` takes ``H_f`` steps per round.
- :class:`TimedClock`: ``federation.every_s``: a facility's round ends by its own step time.
- :class:`ElasticTimedClock`: ``federation.every_s`` for an elastic facility (its own job): the job also
  ends after the first round in which a facility reached ``train.steps``, as the round's quorum says (the
  sync reports it: :attr:`xffl_like.train.sync.StepEnd.ended`).

The paces themselves (``RoundPace``) and their reasons are :mod:`.pace`'s. Facilities that take
different steps per round (:class:`ListClock`, :class:`TimedClock`) tell each other at every round the
steps they took and, with ``every_s``, when they would reach ``train.steps`` (:meth:`PacedClock.meet`,
one collective over the world, made by :meth:`~PacedClock.at`); every facility's steps so far are the
clock's ``facility_steps``, checkpointed under the federation's key ``facility_steps``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config.schema import FederationConfig
from .pace import RoundPace
from .protocol import Boundary, RoundClock

__all__ = [
    "Boundary",
    "ElasticTimedClock",
    "FixedClock",
    "ListClock",
    "PacedClock",
    "RoundClock",
    "Span",
    "TimedClock",
    "end_clock",
    "phase_clock",
    "round_clock",
    "sync_offsets",
    "synced_at",
]


def sync_offsets(every: int, fragments: int) -> list[int]:
    """Step (in ``1..every``) of the round at which each fragment is synced."""
    return [(k + 1) * every // fragments for k in range(fragments)]


def synced_at(step: int, every: int, fragments: int) -> list[int]:
    """Fragments synced after ``step`` (>= 1) steps of the phase: ``(step - o_k) % every == 0``."""
    return [k for k, o in enumerate(sync_offsets(every, fragments)) if step >= o and (step - o) % every == 0]


def round_clock(
    cfg: FederationConfig,
    state,
    steps: int | None,
    *,
    begin: int = 0,
    end: int | None = None,
    last: bool = True,
    elastic: bool = False,
) -> RoundClock:
    """The clock of ``cfg`` (validated) for this rank's facility (``state.facility``) in a job of
    ``train.steps=steps``, over the phase ``begin < step <= end`` (``last``: the job ends at ``end``).
    ``elastic``: an elastic facility's (its own job, one phase)."""
    if elastic:
        if cfg.every_s is not None:
            return ElasticTimedClock(cfg, state, steps)
        return FixedClock([Span(0, steps, True, cfg.every, delay=bool(cfg.delay))], steps)
    if cfg.every_s is not None:  # no schedule, no streaming (refused before launch): the job's steps
        return TimedClock(cfg, state, steps)
    if isinstance(cfg.every, (list, tuple)):
        return ListClock(cfg, state, steps)
    return FixedClock([Span.of(cfg, begin, end, last)], steps)


def phase_clock(phases: list[tuple[FederationConfig, int, int, bool]], state, steps: int) -> RoundClock:
    """The clock of the job's phases ``(settings, begin, end, last)`` (``federation.schedule``; one phase
    without): paced settings allow one phase only (refused before launch otherwise)."""
    if len(phases) == 1:
        cfg, begin, end, last = phases[0]
        return round_clock(cfg, state, steps, begin=begin, end=end, last=last)
    return FixedClock([Span.of(cfg, begin, end, last) for cfg, begin, end, last in phases], steps)


def end_clock(steps: int) -> FixedClock:
    """No rounds, one boundary: the end after ``steps`` (full copies kept in step every step:
    ``parallel=decentralized|bagua``)."""
    return FixedClock([Span(0, steps, True, None, rounds=False)], steps)


@dataclass(frozen=True)
class Span:
    """One phase's rounds over ``begin < step <= end`` (``last``: the job ends at ``end``): every ``every``
    steps (each fragment at its own offset; ``None``: no boundary but the end) and at ``end``. ``rounds``:
    its boundaries are rounds (``algorithm=federated``), else only a switch at ``end`` is; ``overlap``: a
    fragment's exchange starts that many steps before its sync; ``delay``: a round's exchange starts at it
    (``federation.delay=1``, after the boundary's checkpoint) and lands at the next."""

    begin: int
    end: int | None
    last: bool = True
    every: int | None = None
    fragments: int = 1
    rounds: bool = True
    overlap: int = 0
    delay: bool = False

    @classmethod
    def of(cls, cfg: FederationConfig, begin: int, end: int | None, last: bool) -> Span:
        rounds, delay = cfg.algorithm == "federated", bool(cfg.delay) and not cfg.streaming
        return cls(begin, end, last, cfg.every, cfg.fragments, rounds, cfg.overlap_steps, delay)

    def holds(self, done: int) -> bool:
        """Whether step ``done`` is one of this span's (it may end there)."""
        return done > self.begin and (self.end is None or done <= self.end)

    def runs_after(self, done: int) -> bool:
        """Whether the step after ``done`` is one of this span's."""
        return done >= self.begin and (self.end is None or done < self.end)

    def due(self, done: int) -> bool:
        """A boundary after ``done`` steps (one of the span's): a round, a fragment's sync or the end."""
        if done == self.end:
            return True
        return self.every is not None and bool(synced_at(done - self.begin, self.every, self.fragments))

    def finish(self, done: int) -> tuple[int, ...]:
        """The fragments whose rounds end after ``done`` steps (``(0,)``: the whole model's round); none at a
        switch (``end`` of a span that is not the last) or without rounds."""
        if self.fragments > 1 or self.overlap > 0:  # streaming: fragments at staggered steps, all at the end
            if done <= self.begin:
                return ()
            if self.end is not None and done >= self.end:
                return tuple(range(self.fragments)) if done == self.end and self.last else ()
            return tuple(synced_at(done - self.begin, self.every, self.fragments))
        due = self.rounds and self.holds(done) and self.due(done)
        return (0,) if due and (self.last or done != self.end) else ()

    def start(self, done: int) -> tuple[int, ...]:
        """The fragments whose exchanges start after ``done`` steps and overlap the next ones (never at the
        end: the last step syncs without overlap)."""
        if self.overlap > 0:
            if self.end is not None and done + self.overlap >= self.end:
                return ()
            return self.finish(done + self.overlap)
        if self.delay and not (self.last and done == self.end):
            return self.finish(done)
        return ()


class FixedClock:
    """Every facility takes ``every`` steps per round, over the :class:`Span` of each phase (one without
    ``federation.schedule``); its answers are pure, the same however often asked."""

    facility_steps = None  # every facility takes the same steps

    def __init__(self, spans: list[Span], steps: int | None):
        self.spans = list(spans)
        self.steps = spans[-1].end if steps is None else steps
        self._plans: dict[int, Boundary] = {}  # each step's, once computed (pure: the same every time)

    def start(self, done: int) -> Boundary:
        running = next((s for s in self.spans if s.runs_after(done)), None)
        return Boundary(done, start=running.start(done) if running else (), job_step=done)

    def step_taken(self) -> None:
        pass

    def at(self, done: int) -> Boundary:
        return self.plan(done)

    def plan(self, done: int) -> Boundary:
        boundary = self._plans.get(done)
        if boundary is None:
            boundary = self._plans[done] = self._plan(done)
        return boundary

    def _plan(self, done: int) -> Boundary:
        ending = next((s for s in self.spans if s.holds(done)), None)
        running = next((s for s in self.spans if s.runs_after(done)), None)
        due = ending is not None and ending.due(done)
        switch = ending is not None and done == ending.end and not ending.last
        return Boundary(
            done,
            eval_due=due,
            finish=ending.finish(done) if ending is not None else (),
            switch=switch,
            start=running.start(done) if running is not None else (),
            end=ending is not None and ending.last and done == ending.end,
            job_step=done,
            checkpoint=due and not switch,  # the next phase's state starts at a switch: no checkpoint there
        )

    def round_done(self, done: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


class _Paced:
    """A clock whose rounds end where its :class:`~.pace.RoundPace` (``self.pace``) says: one phase, a
    round at each of its boundaries. ``delay``: a round's exchange starts at it (``federation.delay=1``)."""

    delay = False

    def start(self, done: int) -> Boundary:
        # A resumed job starts at a round's checkpoint: with delay=1 that round's exchange starts first.
        self.pace.start(done)
        return Boundary(done, start=(0,) if self.delay and done > 0 else (), job_step=self._job_step(done))

    def step_taken(self) -> None:
        self.pace.step_taken()

    def at(self, done: int) -> Boundary:
        """After this facility's ``done`` steps (with ``every_s`` the first ask agrees inside the facility);
        at a round every facility meets first (:meth:`meet`), so the end and the job's step are known."""
        return self._boundary(done, self.meet(done) if self.pace.due(done) else None)

    def plan(self, done: int) -> Boundary:
        return self._boundary(done, None)

    def _boundary(self, done: int, taken: list[int] | None) -> Boundary:
        due, end = self.pace.due(done), self._ends(done)
        return Boundary(
            done,
            eval_due=due,
            finish=(0,) if due else (),
            start=(0,) if due and self.delay and not end else (),
            end=end,
            job_step=self._job_step(done),
            checkpoint=due,
            taken=None if taken is None else tuple(taken),
        )


class PacedClock(_Paced):
    """Facilities take different steps per round (``federation.every`` a list, or ``every_s``):
    :class:`~.pace.RoundPace` says where this facility's round ends; at each round every facility
    learns the others' steps (:meth:`meet`). Checkpoints are named by the most steps any took."""

    def __init__(self, cfg: FederationConfig, state, steps: int):
        self.state, self.delay = state, bool(cfg.delay)
        self.pace = RoundPace(cfg, state, steps)
        self.steps = self.pace.steps  # this facility's steps in the job
        self._steps = torch.zeros(state.num_facilities, dtype=torch.int64)  # every facility's so far
        self._to_cap: list[float] | None = None

    @property
    def facility_steps(self) -> list[int]:
        return self._steps.tolist()

    def _job_step(self, done: int) -> int:
        """The most steps any facility has taken (known at a round: what checkpoints are named by)."""
        return int(self._steps.max())

    def meet(self, done: int) -> list[int]:
        """The steps every facility took in this round, from which :attr:`facility_steps` and, with
        ``every_s``, the end of the job follow, and every facility's :meth:`~.pace.RoundPace.seconds_to_cap`
        (one collective over the world; step counts are exact in float64)."""
        state = self.state
        met = torch.zeros(2, state.num_facilities, dtype=torch.float64)
        if state.facility_rank == 0:
            met[0, state.facility] = done - self.pace.first
            met[1, state.facility] = self.pace.seconds_to_cap(done)
        dist.all_reduce(met)
        taken = met[0].round().to(torch.int64)
        self._steps += taken
        self._to_cap = met[1].tolist()
        return taken.tolist()

    def round_done(self, done: int) -> None:
        self.pace.round_done(done, self._to_cap)

    def state_dict(self) -> dict:
        # Each facility's own step: where it resumes (checkpoints carry the job's).
        return {"facility_steps": self._steps.clone()}

    def load_state_dict(self, sd: dict) -> None:
        self._steps.copy_(sd["facility_steps"])


class ListClock(PacedClock):
    """``federation.every=[H_0, ...]``: this facility's rounds every ``H_f`` of its steps; it ends at its own steps."""

    def _ends(self, done: int) -> bool:
        return done == self.steps


class TimedClock(PacedClock):
    """``federation.every_s``: the job ends after the first round in which a facility reached ``train.steps``."""

    def _ends(self, done: int) -> bool:
        return self.pace.due(done) and int(self._steps.max()) >= self.pace.cap


class ElasticTimedClock(_Paced):
    """``federation.every_s`` for an elastic facility: rounds by its own step time; the job ends at
    ``train.steps``, or after the first round in which a facility reached it (the round's quorum says so:
    the sync's :attr:`~xffl_like.train.sync.StepEnd.ended`)."""

    facility_steps = None  # this world is one facility

    def __init__(self, cfg: FederationConfig, state, steps: int):
        self.pace = RoundPace(cfg, state, steps)
        self.steps = steps

    def _ends(self, done: int) -> bool:
        return done >= self.steps

    def _job_step(self, done: int) -> int:
        return done

    def meet(self, done: int) -> None:
        return None

    def round_done(self, done: int) -> None:
        self.pace.round_done(done)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass
