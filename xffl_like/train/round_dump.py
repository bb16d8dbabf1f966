"""Test-only record of the values around every aggregation (``XFFL_TEST_DUMP_ROUNDS=<dir>``).

The end-to-end tests must check the *values* a job's aggregation produces, not only that
all copies agree (a job that broadcast facility 0's weights would agree too). With the
variable set, every rank saves its local shard of every parameter right before and right
after each round's aggregation, with where it sits (facility, replica, shard) and the
parameter's global shape and placements; the test reassembles each facility's full
tensors and computes the weighted mean itself. Unset (always, outside tests), nothing
is recorded and nothing is read: no config key, no cost.

One file per rank, round and phase: ``round<R>_<phase>_rank<K>.pt`` (``phase`` is
``before`` or ``after``; also ``init`` once before the first step, and ``start`` where an
overlapped fragment exchange takes its snapshot, numbered by the round that applies it),
a dict of plain values and tensors that ``torch.load(..., weights_only=True)`` reads. With compression,
``after`` also holds this rank's ``message`` (the bytes it sent) and its error-feedback ``residual``
after the round, so a test can decode what every facility sent.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..distributed.state import DistributedState, to_local

__all__ = ["ENV", "RoundDump", "dump_path", "round_observers"]

ENV = "XFFL_TEST_DUMP_ROUNDS"


def dump_path(directory: str | Path, round_: int, phase: str, rank: int) -> Path:
    """Where rank ``rank`` records ``phase`` (``before``/``after``) of round ``round_``."""
    return Path(directory) / f"round{round_:03d}_{phase}_rank{rank:03d}.pt"


def round_observers(model: nn.Module, state: DistributedState) -> list[RoundDump]:
    """The observers of a job's rounds: a :class:`RoundDump` when ``$XFFL_TEST_DUMP_ROUNDS`` names a
    directory (tests), else none. Production signatures never take a dump."""
    return [RoundDump(model, state)] if os.environ.get(ENV) else []


class RoundDump:
    """Saves this rank's local shards around each aggregation when ``$XFFL_TEST_DUMP_ROUNDS``
    names a directory; otherwise :meth:`save` does nothing."""

    def __init__(self, model: nn.Module, state: DistributedState, directory: str | None = None):
        directory = os.environ.get(ENV) if directory is None else directory
        self.directory = Path(directory) if directory else None
        self.model, self.state = model, state
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    @torch.no_grad()
    def save(self, round_: int, phase: str, **extra: int | float | torch.Tensor) -> None:
        """Record this rank's local shards (``phase``: ``before`` or ``after`` the aggregation, ``init``, ``start``)
        and ``extra`` (tensors copied to the CPU)."""
        if self.directory is None:
            return
        state, params, shapes, placements = self.state, {}, {}, {}
        for name, param in self.model.named_parameters():
            local = to_local(param)
            params[name] = local.detach().to("cpu", copy=True)
            shapes[name] = list(param.shape)  # a DTensor's shape is the global one
            placements[name] = [repr(p) for p in getattr(param, "placements", ())]
        record = {
            "rank": state.rank,
            "facility": state.facility,
            "replica": state.replica,
            "shard": state.shard,
            "shard_size": state.shard_size,
            "round": round_,
            "phase": phase,
            "params": params,
            "shapes": shapes,
            "placements": placements,
            **{k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v for k, v in extra.items()},
        }
        torch.save(record, dump_path(self.directory, round_, phase, state.rank))
