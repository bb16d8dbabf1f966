"""The observers of a job's rounds: what else sees the values around every aggregation.

A federation calls :meth:`RoundObserver.save` of each observer (through its round hooks) right before
and right after each round's aggregation, and where an overlapped exchange takes its snapshot.
:data:`OBSERVERS` holds how to make one for a job (a callable of the model and the
:class:`~xffl_like.distributed.state.DistributedState`); the package registers none, so a job
observes nothing and pays nothing. The tests register one that records every rank's shards
(``tests/plugins/hook_round_dump.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import nn

from ..distributed.state import DistributedState

__all__ = ["OBSERVERS", "RoundObserver", "round_observers"]


class RoundObserver(Protocol):
    def save(self, round_: int, phase: str, **extra) -> None:
        """The values around round ``round_`` (``phase``: ``before`` or ``after`` the aggregation, ``init``
        once before the first step, ``start`` where an overlapped exchange takes its snapshot)."""


#: How to make each observer of a job's rounds, called once per job with its model and state.
OBSERVERS: list[Callable[[nn.Module, DistributedState], RoundObserver]] = []


def round_observers(model: nn.Module, state: DistributedState) -> list[RoundObserver]:
    """The observers of this job's rounds, one per entry of :data:`OBSERVERS` (none unless registered)."""
    return [make(model, state) for make in OBSERVERS]
