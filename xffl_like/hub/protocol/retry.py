"""The one retry policy of the hub's protocol: exponential backoff with full jitter, capped.

Every loop of the facility's client that asks the hub again uses it (:mod:`xffl_like.hub.client`): a round
missed because the hub did not answer (the next boundaries are skipped until the backoff ends), a join told
to retry while another facility creates the federation, and the wait for ``min_facilities``. Full jitter
(a delay drawn uniformly in ``[0, min(cap, base x factor^attempt)]``) keeps facilities that lost the hub
together from dialling it again in step (as Flower's ``RetryInvoker`` and torchft's retries do).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = ["LIVE_S", "POLL_RETRY", "ROUND_RETRY", "RetryPolicy"]

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """Delays of ``base x factor^attempt`` seconds at most ``cap``, each drawn with full jitter."""

    base: float
    cap: float
    factor: float = 2.0
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self):
        if not (0 < self.base <= self.cap and self.factor >= 1):
            raise ValueError(f"retry policy base={self.base} cap={self.cap} factor={self.factor}")

    def bound(self, attempt: int) -> float:
        """The longest delay after ``attempt`` failures before (0, 1, ...)."""
        return min(self.cap, self.base * self.factor ** min(attempt, 64))

    def delay(self, attempt: int) -> float:
        """The delay after ``attempt`` failures before: uniform in ``[0, bound(attempt)]``."""
        return self.rng.uniform(0.0, self.bound(attempt))

    def poll(self, call: Callable[[], T], done: Callable[[T], bool], sleep: Callable[[float], None]) -> T:
        """``call()`` until ``done`` of its answer, sleeping ``sleep(delay(attempt))`` between; the answer."""
        attempt = 0
        while True:
            out = call()
            if done(out):
                return out
            sleep(self.delay(attempt))
            attempt += 1


#: A round the hub did not answer: the facility trains on and asks at boundaries after this delay
#: (at most 2 s after one miss, 4 s after two, ... at most 30 s).
ROUND_RETRY = RetryPolicy(base=1.0, cap=30.0)
#: Asking the hub again while a join waits (another facility creating the federation; min_facilities).
POLL_RETRY = RetryPolicy(base=0.25, cap=1.0)
#: A member whose last heartbeat is older than this is not waited for, and its name may be taken by another process
#: of that facility (the hub's :mod:`~..server.membership`); a facility restarted sooner waits for it to lapse.
LIVE_S = 5.0
