"""``$XFFL_TEST_PACE_STEP_S=S`` (or ``S_0,S_1,...``, one per facility): the ``every_s`` pace reads a clock
that advances exactly ``S`` seconds at each step the facility takes, not the wall clock, so that rounds by
time are decided the same on a loaded machine (the rule under test, not a race).

The seam: :class:`xffl_like.federation.pace.RoundPace` takes its clock (``now``) at construction; this
hook gives each ``every_s`` pace a :class:`StepClock` and advances it at each :meth:`~RoundPace.step_taken`.
"""

from __future__ import annotations

import os

from patch_on_import import after_import

ENV = "XFFL_TEST_PACE_STEP_S"


class StepClock:
    """A clock that reads ``seconds`` times the steps taken so far."""

    def __init__(self, seconds: float):
        self.seconds, self.now = seconds, 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self) -> None:
        self.now += self.seconds


def step_seconds(facility: int) -> float:
    """Facility ``facility``'s seconds per step (the last entry for the facilities past the list)."""
    values = [float(v) for v in os.environ[ENV].split(",")]
    return values[min(facility, len(values) - 1)]


def _clock_by_steps(pace) -> None:
    init, step_taken = pace.RoundPace.__init__, pace.RoundPace.step_taken

    def __init__(self, cfg, state, steps, **kwargs):
        self._step_clock = StepClock(step_seconds(state.facility)) if cfg.every_s is not None else None
        if self._step_clock is not None:
            kwargs["now"] = self._step_clock
        init(self, cfg, state, steps, **kwargs)

    def _step_taken(self) -> None:
        step_taken(self)
        if self._step_clock is not None:
            self._step_clock.advance()

    pace.RoundPace.__init__, pace.RoundPace.step_taken = __init__, _step_taken


if os.environ.get(ENV):
    after_import("xffl_like.federation.pace", _clock_by_steps)
