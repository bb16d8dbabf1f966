"""Robust aggregation over the spooled uploads (``federation.elastic.aggregate=median|trimmed_mean``).

The hub never holds the members' contributions whole: each accepted upload's file is read a window of
values at a time (:class:`Reader`), the window's values of every member stacked (members x window), and the
coordinate-wise median or trimmed mean over members written into the accumulator. The hub's extra memory is
one window per member (the window shrinks as members grow: about :data:`.checks.SLICE` values in all).

* ``median``: per coordinate, the middle value over members (the mean of the two middle ones when they are
  even in number, as ``numpy.median``);
* ``trimmed_mean``: per coordinate, the values sorted over members, ``k = ceil(trim x members)`` cut from
  each end (at most ``(members - 1) // 2``, so at least one is kept), the rest averaged.

Both are unweighted, as Flower's ``FedMedian`` and ``FedTrimmedAvg``: a member's token weight would let it
outvote the others, which is what a robust rule is for. ``mean`` (the default) stays the weighted mean of
:meth:`.spool.Spool.accumulate`. The reader and the rules live in :mod:`..protocol.relay`, which
facilities applying a relayed round share.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from ..protocol.relay import Reader, combine, cut
from ..protocol.spec import AGGREGATES as RULES
from ..protocol.update_codec import UpdateCodec
from .checks import SLICE

__all__ = ["RULES", "Reader", "combine", "cut", "robust"]


def robust(acc: Tensor, paths: list[Path], rule: str, trim: float, codec: UpdateCodec | None) -> None:
    """``acc`` becomes the coordinate-wise ``rule`` over the uploads in ``paths`` (which are then removed)."""
    window = max(1 << 12, SLICE // len(paths))
    stack = torch.empty(len(paths), window, dtype=torch.float32)
    readers = [Reader(p, codec) for p in paths]
    try:
        for start in range(0, acc.numel(), window):
            n = min(window, acc.numel() - start)
            for i, reader in enumerate(readers):
                reader.take(stack[i, :n])
            acc[start : start + n].copy_(combine(stack[:, :n], rule, trim))
    finally:
        for reader in readers:
            reader.close()
        for p in paths:
            p.unlink(missing_ok=True)
