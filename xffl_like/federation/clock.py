"""The round clock: where this facility's rounds end, one object chosen once (:func:`round_clock`).

- :class:`FixedClock`: ``federation.every=H`` (a number): rounds every ``H`` steps of the phase and at
  its end (the job's end, or a phase switch); with ``fragments`` a boundary at each fragment's sync; for
  ``algorithm=synchronous`` (no rounds) the boundaries where the loop evaluates and checkpoints; an elastic
  facility's with ``every``; :func:`end_clock`'s (``parallel=decentralized|bagua``): one boundary, the end.
- :class:`ListClock`: ``federation.every=[H_0, ...]``: facility ``f`` takes ``H_f`` steps per round.
- :class:`TimedClock`: ``federation.every_s``: a facility's round ends by its own step time.
- :class:`ElasticTimedClock`: ``federation.every_s`` for an elastic facility (its own job): the job ends
  after the first round in which a facility reached ``train.steps``, as the round's quorum says.

The paces themselves (``RoundPace``) and their reasons are :mod:`.pace`'s. Facilities that take
different steps per round (:class:`ListClock`, :class:`TimedClock`) tell each other at every round the
steps they took and, with ``every_s``, when they would reach ``train.steps`` (:meth:`PacedClock.meet`,
one collective over the world); every facility's steps so far are the clock's ``facility_steps``,
checkpointed under the federation's key ``facility_steps``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..config.schema import FederationConfig
from .pace import RoundPace
from .protocol import RoundClock

__all__ = [
    "ElasticTimedClock",
    "FixedClock",
    "ListClock",
    "PacedClock",
    "RoundClock",
    "TimedClock",
    "end_clock",
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
    ended: Callable[[], bool] | None = None,
) -> RoundClock:
    """The clock of ``cfg`` (validated) for this rank's facility (``state.facility``) in a job of
    ``train.steps=steps``, over the phase ``begin < step <= end`` (``last``: the job ends at ``end``).
    ``ended``: an elastic facility's (its own job): whether the federation's last round ended the job."""
    if ended is not None:  # an elastic facility: its own steps, one phase
        if cfg.every_s is not None:
            return ElasticTimedClock(cfg, state, steps, ended)
        return FixedClock(cfg.every, 0, steps, True, steps)
    if cfg.every_s is not None:  # no schedule, no streaming (refused before launch): the job's steps
        return TimedClock(cfg, state, steps)
    if isinstance(cfg.every, (list, tuple)):
        return ListClock(cfg, state, steps)
    rounds = cfg.algorithm == "federated"
    return FixedClock(cfg.every, begin, end, last, steps, fragments=cfg.fragments, rounds=rounds)


def end_clock(steps: int) -> FixedClock:
    """No rounds, one boundary: the end after ``steps`` (full copies kept in step every step:
    ``parallel=decentralized|bagua``)."""
    return FixedClock(None, 0, steps, True, steps, rounds=False)


class FixedClock:
    """Every facility takes ``every`` steps per round (each fragment at its own offset; ``None``: no
    boundary but the end), over ``begin < step <= end``; a boundary at ``end`` (the job's end, or a phase
    switch). ``rounds``: its boundaries are rounds (``algorithm=federated``); else only a switch is."""

    facility_steps = None  # every facility takes the same steps

    def __init__(
        self,
        every: int | None,
        begin: int,
        end: int | None,
        last: bool,
        steps: int | None,
        fragments: int = 1,
        rounds: bool = True,
    ):
        self.every, self.begin, self.end, self.last, self.fragments = every, begin, end, last, fragments
        self.steps = end if steps is None else steps
        self.rounds = rounds

    def start(self, done: int) -> None:
        pass

    def step_taken(self) -> None:
        pass

    def due(self, done: int) -> bool:
        if done <= self.begin or (self.end is not None and done > self.end):
            return False
        if done == self.end:
            return True
        return self.every is not None and bool(synced_at(done - self.begin, self.every, self.fragments))

    def rounds_at(self, done: int) -> bool:
        return self.due(done) and (self.rounds or (done == self.end and not self.last))

    def ends_at(self, done: int) -> bool:
        return self.last and done == self.end

    def job_step(self, done: int) -> int:
        return done

    def meet(self, done: int) -> None:
        return None

    def round_done(self, done: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


class _Paced:
    """A clock whose rounds end where its :class:`~.pace.RoundPace` (``self.pace``) says."""

    def start(self, done: int) -> None:
        self.pace.start(done)

    def step_taken(self) -> None:
        self.pace.step_taken()

    def due(self, done: int) -> bool:
        return self.pace.due(done)

    def rounds_at(self, done: int) -> bool:
        return self.pace.due(done)


class PacedClock(_Paced):
    """Facilities take different steps per round (``federation.every`` a list, or ``every_s``):
    :class:`~.pace.RoundPace` says where this facility's round ends; at each round every facility
    learns the others' steps (:meth:`meet`). Checkpoints are named by the most steps any took."""

    def __init__(self, cfg: FederationConfig, state, steps: int):
        self.state = state
        self.pace = RoundPace(cfg, state, steps)
        self.steps = self.pace.steps  # this facility's steps in the job
        self._steps = torch.zeros(state.num_facilities, dtype=torch.int64)  # every facility's so far
        self._to_cap: list[float] | None = None

    @property
    def facility_steps(self) -> list[int]:
        return self._steps.tolist()

    def job_step(self, done: int) -> int:
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

    def ends_at(self, done: int) -> bool:
        return done == self.steps


class TimedClock(PacedClock):
    """``federation.every_s``: the job ends after the first round in which a facility reached ``train.steps``."""

    def ends_at(self, done: int) -> bool:
        return self.pace.due(done) and int(self._steps.max()) >= self.pace.cap


class ElasticTimedClock(_Paced):
    """``federation.every_s`` for an elastic facility: rounds by its own step time; the job ends at
    ``train.steps``, or after the first round in which a facility reached it (``ended()``: the last
    round's quorum says so)."""

    facility_steps = None  # this world is one facility

    def __init__(self, cfg: FederationConfig, state, steps: int, ended: Callable[[], bool]):
        self.pace = RoundPace(cfg, state, steps)
        self.steps, self.ended = steps, ended

    def ends_at(self, done: int) -> bool:
        return done >= self.steps or (self.pace.due(done) and self.ended())

    def job_step(self, done: int) -> int:
        return done

    def meet(self, done: int) -> None:
        return None

    def round_done(self, done: int) -> None:
        self.pace.round_done(done)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass
