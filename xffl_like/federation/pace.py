"""When a facility's round ends: facilities of different speeds (``federation.every`` as a list,
``federation.every_s``).

Three paces, one per setting:

- ``federation.every=H`` (a number): every facility takes ``H`` local steps per round (the
  default; rounds and steps are the job's, as always).
- ``federation.every=[H_0, ..., H_{F-1}]``: facility ``f`` takes ``H_f`` local steps per round.
  Rounds stay aligned: every facility aggregates at the same round index, ``train.steps /
  max(H)`` rounds in all, so facility ``f`` trains ``rounds * H_f`` steps (``train.steps`` are
  those of the facility with the largest entry). Deterministic: a resume is exact.
- ``federation.every_s=T`` (``every=null``): after each local step a facility decides whether
  another one, at its mean step time in this round, would still end within ``T`` seconds of the
  round's start; if not, it aggregates. Every facility therefore reaches the round within about
  one of its own steps of ``T`` and nobody idles longer than that. No facility trains past
  ``train.steps``; the job ends after the first round in which one of them reached it. So that the
  others do not train on for the rest of ``T`` while it waits, each facility tells the others at every
  round when, at this round's pace, it would reach ``train.steps`` in the next one
  (:meth:`RoundPace.seconds_to_cap`); a round ends at the earliest of ``T`` and the other facilities'
  times (:meth:`RoundPace.round_done`).

With different numbers of steps per round the default weighting (``federation.weights=null``) is
``tokens``: each facility counts by the tokens it trained in the round. The pseudo-gradient of an
outer optimizer is formed exactly as with equal steps, ``theta_global - mean`` of the facilities'
weights (weighted as above), so a facility that took more steps moves the mean further in its
direction in proportion to its tokens; compression with error feedback encodes each facility's own
update and is unchanged.

Facilities that take different steps between rounds cannot meet at a collective of every rank in
between: per step they agree within the facility only (a time-paced facility on the steps it
takes), and a stop request (SIGINT/SIGTERM) takes effect at the next round, where every facility is.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..config.checks import is_int, is_number
from ..config.errors import ConfigError
from ..config.schema import FederationConfig

__all__ = ["MAX_EVERY_S", "RoundPace", "check_pace_job", "facility_steps", "validate_pace"]

#: ``federation.every_s`` at most a day: longer rounds are a typo or a job with a single round.
MAX_EVERY_S = 86400.0


def validate_pace(fed: FederationConfig, num_facilities: int, steps: int) -> None:
    """``federation.every`` / ``every_s`` (launching process, once; from ``validate_federation``): one
    ``ConfigError`` line naming the key and the fix. The relations with other sections
    (:func:`check_pace_job`) are checked beside the others in :func:`xffl_like.config.validate.validate_config`."""
    every, every_s = fed.every, fed.every_s
    if every_s is not None:
        if not is_number(every_s) or not 0 < every_s <= MAX_EVERY_S or not math.isfinite(every_s):
            raise ConfigError(
                f"federation.every_s={every_s!r}: must be a number of seconds in (0, {MAX_EVERY_S:.0f}] "
                f"(e.g. federation.every_s=30)"
            )
        if every is not None:
            raise ConfigError(
                f"federation.every_s={every_s} with federation.every={every!r}: a round ends by time or "
                f"after a number of steps, not both; set federation.every=null"
            )
        return
    if every is None:
        raise ConfigError(
            "federation.every=null: give the local steps per round (e.g. federation.every=10), one per "
            "facility (federation.every=[32,16]), or rounds by time (federation.every_s=30)"
        )
    if isinstance(every, (list, tuple)):
        if fed.elastic.enabled:
            raise ConfigError(
                f"federation.every as a list ({list(every)!r}) with federation.elastic.hub: each "
                f"facility is its own job: give each its own federation.every (a number) and train.steps "
                f"= the federation's rounds x that number, or use federation.every_s"
            )
        if len(every) != num_facilities:
            raise ConfigError(
                f"federation.every={list(every)!r}: {len(every)} entries for {num_facilities} "
                f"facilities; give one per facility (e.g. federation.every={[10] * num_facilities})"
            )
        bad = next((h for h in every if not is_int(h) or h < 1), None)
        if bad is not None:
            raise ConfigError(
                f"federation.every={list(every)!r}: entry {bad!r} is not a positive integer (each "
                f"facility's local steps per round)"
            )
        if steps > 0 and steps % max(every) != 0:
            raise ConfigError(
                f"federation.every={list(every)!r} with train.steps={steps}: the rounds must be whole "
                f"for the facility with the most steps per round; use a multiple of {max(every)} "
                f"(e.g. train.steps={max(every) * max(1, steps // max(every))})"
            )
        return
    if not is_int(every) or every < 1:
        raise ConfigError(
            f"federation.every={every!r}: must be a positive integer, one per facility "
            f"(e.g. federation.every=[32,16]), or null with federation.every_s"
        )


def check_pace_job(fed: FederationConfig, *, parallel: str, eval_every: int) -> None:
    """Per-facility paces against the rest of the federation and the job: what makes no sense with
    facilities that take different numbers of steps between rounds (one ``ConfigError`` line)."""
    if not fed.paced:
        return
    key = f"federation.every={list(fed.every)!r}" if fed.every_s is None else f"federation.every_s={fed.every_s}"
    clash = next(
        (
            reason
            for bad, reason in (
                (parallel != "fsdp", f"parallel={parallel} has no federation rounds; use parallel=fsdp"),
                (
                    fed.algorithm != "federated",
                    "algorithm=synchronous averages gradients at every step of every facility; use algorithm=federated",
                ),
                (
                    fed.schedule is not None,
                    "federation.schedule switches phases at a step, which facilities reach at "
                    "different rounds; drop the schedule",
                ),
                (
                    fed.streaming,
                    "federation.fragments / overlap_steps stagger exchanges by step; use fragments=1 overlap_steps=0",
                ),
                (
                    eval_every > 0,
                    f"train.eval_every={eval_every} evaluates at steps the facilities reach at different "
                    f"times; use train.eval_every=0 (each round is evaluated before and after)",
                ),
            )
            if bad
        ),
        None,
    )
    if clash:
        raise ConfigError(f"{key}: {clash}")


def facility_steps(cfg: FederationConfig, facility: int, steps: int) -> int:
    """Facility ``facility``'s local steps in a job of ``train.steps=steps`` (pure): with
    ``federation.every`` a list, ``steps / max(every)`` rounds of its own entry; else ``steps`` (with
    ``every_s``: at most that many)."""
    every = cfg.every
    if cfg.every_s is None and isinstance(every, (list, tuple)):
        return (steps // max(every)) * int(every[facility]) if steps else 0
    return steps


class RoundPace:
    """Where this facility's rounds end, for ``federation.every`` (a number or a list) or
    ``federation.every_s``. :meth:`step_taken` after each step's backward passes; :meth:`due` asked after
    it (with ``every_s`` the first ask for a step agrees inside the facility: collective over the facility's
    ranks); :meth:`round_done` after each round restarts the clock.
    """

    def __init__(self, cfg: FederationConfig, state, steps: int, now: Callable[[], float] = time.perf_counter):
        """``now``: the clock ``every_s`` reads, in seconds (a test gives one that advances by its steps)."""
        self.state, self.cap = state, steps
        self.now = now
        self.every_s = cfg.every_s
        every = cfg.every
        self.every: int | None = int(every[state.facility]) if isinstance(every, (list, tuple)) else every
        self.steps = facility_steps(cfg, state.facility, steps)  # this facility's steps in the job
        self.paced = cfg.paced
        self._asked: tuple[int, bool] | None = None
        self.started_at = self.now()
        self.first = 0  # this facility's steps when the round in progress began
        self.taken = 0  # this facility's steps so far
        self._first_done_at = self.started_at  # when the round's first step ended
        # every_s: this round's end (every_s, or earlier when another facility reaches train.steps in it), and
        # this facility's last measured first step (it carries the round's evaluation) and mean step, in seconds.
        self.limit = self.every_s
        self._first_s: float | None = None
        self._step_s: float | None = None

    def start(self, done: int) -> None:
        """Training begins now, after ``done`` steps."""
        self.started_at, self.first, self.taken = self.now(), done, done

    def round_done(self, done: int, to_cap: list[float] | None = None) -> None:
        """The round after ``done`` steps is made: the next one begins now. ``to_cap``: every facility's
        :meth:`seconds_to_cap` (the same list on every rank); with ``every_s`` the round ends when another
        step would end past ``every_s`` or past the earliest time at which another facility reaches
        ``train.steps``, whichever is first (a facility that reaches it stops there and waits)."""
        self.started_at, self.first = self.now(), done
        self.limit = self.every_s
        if self.every_s is not None and to_cap:
            others = [t for f, t in enumerate(to_cap) if f != self.state.facility]
            self.limit = min([self.every_s, *others])

    def seconds_to_cap(self, done: int) -> float:
        """With ``every_s``: seconds from the start of the next round until this facility, after ``done``
        steps, would end step ``train.steps`` at this round's pace (its first step, with the evaluation, then
        its mean step); ``inf`` with ``every`` or before a step was timed."""
        if self.every_s is None or self._step_s is None or self._first_s is None:
            return math.inf
        left = self.cap - done
        return 0.0 if left <= 0 else self._first_s + (left - 1) * self._step_s

    def step_taken(self) -> None:
        """A local step was taken (its backward passes are done)."""
        self.taken += 1

    def due(self, done: int) -> bool:
        """Whether this facility's round ends after its ``done`` steps (the same answer however often
        it is asked for one ``done``; with ``every_s`` the first ask agrees inside the facility)."""
        if self.every is not None:
            return done > 0 and (done % self.every == 0 or done == self.steps)
        if done != self.taken:  # a step not taken yet (the progress line looks ahead): unknown until then
            return False
        if self._asked is not None and self._asked[0] == done:
            return self._asked[1]
        value = done >= self.cap or self._out_of_time(done)
        self._asked = (done, value)
        return value

    def _out_of_time(self, done: int) -> bool:
        """Whether another step would end past ``every_s`` seconds after the round began. A step's time
        is the mean of this round's steps after its first (the first also carries the round's evaluation
        and checkpoint); the slowest rank of the facility decides for all of them."""
        now = self.now()
        taken = done - self.first
        if taken <= 1:
            self._first_done_at = now
            step_s = now - self.started_at
        else:
            step_s = (now - self._first_done_at) / (taken - 1)
        seen = torch.tensor([now - self.started_at, step_s], dtype=torch.float64)
        if self.state.facility_size > 1:
            dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.state.group("facility"))
        elapsed, step_s = seen.tolist()
        if taken <= 1:
            self._first_s = elapsed
        self._step_s = step_s
        return elapsed + step_s > self.limit
