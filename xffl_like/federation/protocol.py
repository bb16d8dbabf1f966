"""What the training side and the federation say to each other, declared.

- :class:`RoundClock`: where this facility's rounds end (:mod:`.clock`; one object per phase, chosen once);
- :class:`RoundHooks`: what the training side does at a round (the non-finite guard's weights, the
  tests' record of the values around it), given to the federation at construction;
- :class:`Rounds`: what the training side calls of the federation, every step:
  :class:`~.schedule.FederationSchedule` (one world, phases) and
  :class:`~.elastic.exchange.ElasticFederation` (this job is one facility);
- :class:`FederationPhase`: what :class:`~.schedule.FederationSchedule` calls of the federation of a
  phase (:class:`~.round.Federation`, :class:`~.streaming.StreamingFederation`).

Every step the loop calls :meth:`Rounds.trained` (per micro-batch) and :meth:`Rounds.after_backward`,
then where :meth:`Rounds.applies_at` :meth:`Rounds.finish_due`, and where :meth:`Rounds.starts_at`
:meth:`Rounds.start_due`; it asks :attr:`Rounds.clock` where to evaluate and checkpoint
(:meth:`RoundClock.due`), where training ends and what a checkpoint is named by.
"""

from __future__ import annotations

from typing import Protocol

from ..config.schema import FederationConfig

__all__ = ["FederationPhase", "NoHooks", "RoundClock", "RoundHooks", "Rounds"]


class RoundClock(Protocol):
    """Where this facility's rounds end, over the steps of one phase (or the whole job)."""

    steps: int  # this facility's steps in the job

    def start(self, done: int) -> None:
        """Training starts now, after ``done`` steps (a time-paced round counts from here)."""

    def step_taken(self) -> None:
        """A local step was taken (its backward passes are done)."""

    def due(self, done: int) -> bool:
        """A boundary after ``done`` steps: a round (or a phase switch; for ``synchronous`` every ``every``
        steps and at the end), where the loop evaluates the local model and may checkpoint."""

    def rounds_at(self, done: int) -> bool:
        """Whether rounds (or a phase switch) end after ``done`` steps: :meth:`Rounds.applies_at`, known
        ahead where the clock is fixed (the progress line looks ahead)."""

    def ends_at(self, done: int) -> bool:
        """Whether this facility's training ends after its ``done`` steps."""

    def job_step(self, done: int) -> int:
        """The job's step (what a checkpoint is named by) after this facility's ``done`` steps."""

    @property
    def facility_steps(self) -> list[int] | None:
        """Every facility's steps so far when facilities take different steps per round (known at a
        round), else None."""

    def meet(self, done: int) -> list[int] | None:
        """At a round after ``done`` steps, before it: the steps each facility took since the last one
        (collective over the world), or None when they all take the same."""

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

    @property
    def clock(self) -> RoundClock:
        """The clock of the steps running now (a phase's, with its switch step due)."""

    def trained(self, tokens: int) -> None:
        """Count ``tokens`` this rank trained on (``federation.weights=tokens``)."""

    def after_backward(self) -> int:
        """After each step's backward passes (tells the clock a step was taken); ``synchronous``
        averages the gradients. The bytes this rank sent across facilities."""

    def applies_at(self, done: int) -> bool:
        """Whether rounds (or a phase switch) end after ``done`` steps."""

    def finish_due(self, done: int, index: int) -> list[dict]:
        """End the rounds due after ``done`` steps: their records, numbered from ``index``."""

    def starts_at(self, done: int) -> bool:
        """Whether exchanges that overlap the next steps start after ``done`` steps."""

    def start_due(self, done: int, index: int) -> None:
        """Start them (numbered by the round that applies them, from ``index``)."""

    def describe(self) -> dict:
        """The summary's ``federation``."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...


class FederationPhase(Rounds, Protocol):
    """The federation of one phase, as :class:`~.schedule.FederationSchedule` drives it."""

    options: FederationConfig  # the phase's settings

    def wait(self) -> None:
        """Block until no exchange is in flight."""
