"""One window of a round's commit: the accepted uploads' values there folded into the next version's values.

The hub holds neither θ_global nor the outer state in memory: a commit reads the saved version ``v`` a window
at a time (θ_v's and each outer buffer's values there, and each accepted upload's, from its spool file),
:func:`fold` computes the window of version ``v + 1`` (the round's mean or robust aggregate, then the outer
step on it), and the window goes straight into the next version's file (:func:`.store.save`). The outer step
is elementwise (:func:`...federation.outer.outer_step`, with the round's one step number), so the window's
values are bitwise those of a step on the whole tensors; windows are a multiple of :data:`UNIT` values (the
vectorised kernels' tails fall where the whole tensor's do). The hub's memory for a commit is one window per
upload plus one per saved tensor (:func:`window`), whatever the model's size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...config.schema import OuterConfig
from ...federation.outer import outer_step
from .aggregate import combine
from .checks import SLICE

__all__ = ["UNIT", "Plan", "fold", "next_window", "window"]

UNIT = 1 << 16  # values: a window's size is a multiple of it


def window(uploads: int) -> int:
    """Values per window with ``uploads`` read side by side: about :data:`.checks.SLICE` in all (a few MB),
    a multiple of :data:`UNIT`, at least one unit."""
    return max(UNIT, SLICE // max(uploads, 1) // UNIT * UNIT)


@dataclass(frozen=True)
class Plan:
    """What a round does with every window: ``rule`` (``mean``, ``median``, ``trimmed_mean``), the uploads'
    ``scales`` (each one's weight over their sum, in name order; ``mean`` only), ``trim``, the outer optimizer and
    its step's number this round (``steps``: the saved count plus one). The uploads are parameters ``θ_f``; a
    compressed round's updates go through :func:`..protocol.relay.rounds`, as at every facility."""

    rule: str
    scales: tuple[float, ...]
    trim: float
    options: OuterConfig
    steps: int


@torch.no_grad()
def fold(plan: Plan, theta: Tensor, buffers: dict[str, Tensor], stack: Tensor) -> None:
    """``theta`` (θ_global's window of version v) and ``buffers`` (the outer state's, same window) become version
    v + 1's, in place, from ``stack`` (the accepted uploads' values there, uploads x window, in name order)."""
    if plan.rule == "mean":  # the weighted mean, summed in name order from zero
        acc = torch.zeros_like(theta)
        for row, scale in zip(stack, plan.scales, strict=True):
            acc.add_(row, alpha=scale)
    else:
        acc = combine(stack, plan.rule, plan.trim).clone()
    if plan.options.is_plain_mean:
        theta.copy_(acc)
    else:
        outer_step(plan.options, plan.steps, theta, buffers, torch.sub(theta, acc, out=acc))


@torch.no_grad()
def next_window(plan: Plan, saved, readers: list, start: int, stack: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Version v + 1's θ_global and outer buffers over ``stack.shape[1]`` values from ``start``: version v's
    (``saved``, a :class:`.store.Snapshot` mapped from its file) folded (:func:`fold`) with the next values of
    each reader (the accepted uploads' spool files, in name order), read into ``stack``."""
    stop = start + stack.shape[1]
    theta, buffers = saved.theta[start:stop].clone(), {b: t[start:stop].clone() for b, t in saved.buffers.items()}
    for i, reader in enumerate(readers):
        reader.take(stack[i])
    fold(plan, theta, buffers, stack)
    return theta, buffers
