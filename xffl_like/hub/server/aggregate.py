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
(:func:`.fold.fold`). The reader and the rules live in :mod:`..protocol.relay`, which facilities applying a
relayed round share.
"""

from __future__ import annotations

from ..protocol.relay import Reader, combine, cut
from ..protocol.spec import AGGREGATES as RULES

__all__ = ["RULES", "Reader", "combine", "cut"]
