"""Robust aggregation over the spooled uploads (``federation.elastic.aggregate=median|trimmed_mean``).

The hub never holds the members' contributions whole: each accepted upload's file is read a window of
values at a time (:class:`Reader`), the window's values of every member stacked (members x window), and the
coordinate-wise median or trimmed mean over members folded into the next version (:mod:`.fold`). The hub's
extra memory is one window per member (the window shrinks as members grow: about :data:`.checks.SLICE`
values in all).

* ``median``: per coordinate, the middle value over members (the mean of the two middle ones when they are
  even in number, as ``numpy.median``);
* ``trimmed_mean``: per coordinate, the values sorted over members, ``k = ceil(trim x members)`` cut from
  each end (at most ``(members - 1) // 2``, so at least one is kept), the rest averaged.

Both are unweighted, as Flower's ``FedMedian`` and ``FedTrimmedAvg``: a member's token weight would let it
outvote the others, which is what a robust rule is for. ``mean`` (the default) stays the weighted mean
(:func:`.fold.fold`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from ..protocol.spec import AGGREGATES as RULES
from ..protocol.update_codec import UpdateCodec

__all__ = ["RULES", "Reader", "combine", "cut"]


def cut(trim: float, members: int) -> int:
    """Members cut from each end by ``trimmed_mean``: ``ceil(trim x members)``, keeping at least one."""
    return min(math.ceil(trim * members - 1e-9), (members - 1) // 2)


def combine(stack: Tensor, rule: str, trim: float) -> Tensor:
    """The coordinate-wise ``rule`` over ``stack``'s rows (members x values), fp32."""
    m = stack.shape[0]
    ordered = stack.sort(dim=0).values
    if rule == "median":
        mid = ordered[(m - 1) // 2]
        return mid if m % 2 else (mid + ordered[m // 2]) / 2
    if rule == "trimmed_mean":
        k = cut(trim, m)
        return ordered[k : m - k].mean(dim=0)
    raise ValueError(f"aggregate {rule!r}: the hub takes {', '.join(RULES)}")


class Reader:
    """One spooled upload, read in order ``n`` values at a time (fp32 parameters, or decoded by ``codec``)."""

    def __init__(self, path: Path, codec: UpdateCodec | None):
        self.fh = open(path, "rb")
        self.pieces: Iterator[tuple[int, Tensor]] | None = codec.decode_stream(self.fh.read) if codec else None
        self.left, self.at = torch.empty(0), 0  # values decoded and not taken yet; the next piece's first value

    def take(self, out: Tensor) -> None:
        """Fill ``out`` with the next ``out.numel()`` values."""
        n = out.numel()
        if self.pieces is None:
            got = self.fh.readinto(memoryview(out.numpy()).cast("B"))
            if got != 4 * n:
                raise ValueError(f"a spooled upload ended after {got} of {4 * n} bytes")
            return
        filled = 0
        while filled < n:
            if not self.left.numel():
                start, self.left = next(self.pieces)
                if start != self.at:
                    raise ValueError(f"a spooled update decodes value {start} where {self.at} was next")
                self.at += self.left.numel()
            k = min(n - filled, self.left.numel())
            out[filled : filled + k].copy_(self.left[:k])
            self.left, filled = self.left[k:], filled + k

    def close(self) -> None:
        self.fh.close()
