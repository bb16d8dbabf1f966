"""What the training side and the federation say to each other, declared.

- :class:`Boundary`: what a step is (eval, rounds to finish, a phase switch, exchanges to start, the end,
  the job's step): the one answer of the clock, asked once per step;
- :class:`RoundClock`: the one object that gives it (:mod:`.clock`, chosen once);
- :class:`RoundHooks`: what the training side does at a round (the non-finite guard's weights, the
  tests' record of the values around it), given to the federation at construction;
- :class:`Rounds`: what the training side calls of the federation:
  :class:`~.phases.FederationSchedule` (one world, phases) and
  :class:`~.elastic.exchange.ElasticFederation` (this job is one facility);
- :class:`FederationPhase`: what :class:`~.phases.FederationSchedule` calls of the federation of a
  phase (:class:`~.federation.Federation`, :class:`~.streaming.StreamingFederation`,
  :class:`~.delayed.DelayedFederation`).

Every step the sync calls :meth:`Rounds.trained` (per micro-batch) and :meth:`Rounds.after_backward`;
then, with the step's :class:`Boundary`, :meth:`Rounds.finish` (the rounds that end there, before the
trainer settles the step) and :meth:`Rounds.start` (the exchanges that start there, after it). One way:
the federation never calls back into the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..config.schema import FederationConfig
from .record import RoundRecord

__all__ = ["Boundary", "FederationPhase", "NoHooks", "RoundClock", "RoundHooks", "Rounds"]


@dataclass(frozen=True)
class Boundary:
    """What the step after which ``step`` steps are done is: the clock's one answer, asked once per step."""

    step: int  # this facility's steps done
    eval_due: bool = False  # a boundary: the loop evaluates the local model here
    finish: tuple[int, ...] = ()  # the fragments whose rounds end here ((0,): the whole model's round)
    switch: bool = False  # the phase ends here: the average, then the next phase (federation.schedule)
    start: tuple[int, ...] = ()  # the fragments whose exchanges start here, after the step is settled
    end: bool = False  # training ends after this step (as known before its rounds)
    job_step: int = 0  # the job's step: what a checkpoint of this step is named by
    checkpoint: bool = False  # a checkpoint here is exact (a boundary, not a phase switch)
    taken: tuple[int, ...] | None = None  # paced rounds: the steps each facility took since the last one
    rounds: bool = field(init=False)  # whether rounds (or a phase switch) end here

    def __post_init__(self) -> None:
        object.__setattr__(self, "rounds", bool(self.finish) or self.switch)


class RoundClock(Protocol):
    """What each step is (:class:`Boundary`), over the steps of the job."""

    steps: int  # this facility's steps in the job

    def start(self, done: int) -> Boundary:
        """Training starts now, after ``done`` steps (a time-paced round counts from here): what starts
        before the first step (an exchange overlapping the first steps)."""

    def step_taken(self) -> None:
        """A local step was taken (its backward passes are done)."""

    def at(self, done: int) -> Boundary:
        """What the step just taken (``done`` steps) is; asked once per step (a paced clock's round meets
        the other facilities here: collective over the world)."""

    def plan(self, done: int) -> Boundary:
        """The same, known ahead, without collectives (the progress line, a stop's next boundary); a paced
        clock's end and job step as known now."""

    @property
    def facility_steps(self) -> list[int] | None:
        """Every facility's steps so far when facilities take different steps per round (known at a
        round), else None."""

    def round_done(self, done: int) -> None:
        """The round after ``done`` steps is made: the next one begins now."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps (``facility_steps``, beside the federation's own keys)."""

    def load_state_dict(self, sd: dict) -> None:
        """Restore from the federation's state dict (only the clock's keys are read)."""


class RoundHooks(Protocol):
    """What the training side does at each round, given to the federation at construction."""

    def weights_for_round(
        self, weights: list[float] | None, index: int, done: int
    ) -> tuple[list[float] | None, list[int]]:
        """The weights of round ``index`` (after ``done`` steps) and the facilities left out of it
        (the non-finite guard: collective over the world)."""

    def save(self, round_: int, phase: str, **extra: int | float) -> None:
        """Record the values around round ``round_`` (``phase``: ``before``, ``after``, ``start``; tests)."""


class NoHooks:
    """:class:`RoundHooks` that change nothing and record nothing (a federation built without hooks)."""

    def weights_for_round(
        self, weights: list[float] | None, index: int, done: int
    ) -> tuple[list[float] | None, list[int]]:
        return weights, []

    def save(self, round_: int, phase: str, **extra: int | float) -> None:
        pass


class Rounds(Protocol):
    """What the training side calls of the federation (see the module)."""

    def trained(self, tokens: int) -> None:
        """Count ``tokens`` this rank trained on (``federation.weights=tokens``)."""

    def after_backward(self) -> int:
        """After each step's backward passes: ``synchronous`` averages the gradients. The bytes this rank
        sent across facilities."""

    def finish(self, boundary: Boundary, index: int) -> list[RoundRecord]:
        """End the rounds of ``boundary`` (a phase switch too): their records, numbered from ``index``."""

    def start(self, boundary: Boundary, index: int) -> None:
        """Start the exchanges of ``boundary`` that overlap the next steps (numbered by the round that
        applies them, from ``index``)."""

    def describe(self) -> dict:
        """The summary's ``federation``."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...


class FederationPhase(Rounds, Protocol):
    """The federation of one phase, as :class:`~.phases.FederationSchedule` drives it."""

    options: FederationConfig  # the phase's settings

    def wait(self) -> None:
        """Block until no exchange is in flight."""
