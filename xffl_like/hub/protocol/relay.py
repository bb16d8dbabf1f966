"""A compressed round, applied the same way by the hub and by every facility: the relay downlink.

With ``federation.compression`` a round's result does not travel as θ_global in full. The hub decides the
round, applies it and saves the new version, then sends each accepted facility a header (the new version, the
accepted facilities in the hub's fold order, the weight each had, the outer optimizer's steps, the message
sizes: :class:`~.messages.Relay`) and the other accepted facilities' messages (its own it has). Both ends then
run :func:`apply_round` over their copy of θ_global and the outer state: the round's combination of the decoded
messages (:func:`fold`: the weighted mean, or ``median`` / ``trimmed_mean``), then the outer step, a window of
:data:`WINDOW` values at a time, the same operations in the same order, so every copy is bitwise the hub's.
The mean multiplies each decoded value by its weight and then adds it (two roundings, as numpy computes it), never a
fused multiply-add, whose rounding would depend on the CPU's instructions.

A facility checks every claim of the header before its state changes (:func:`check`: each failure one line),
and a decoded value that is not finite stops the apply (:class:`RelayError`); either way it downloads θ_global
and the outer state in full instead (it heals).

What it reveals: each accepted facility receives every other accepted facility's sparse update (its indices
and quantized values) and weight, which the mean alone would hide. That is what SparseLoCo's peers (Templar)
exchange, and it keeps one algorithm at the hub and in one world: no second compression error, no residual held
at the hub; a facility downloads (F-1) messages per round.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

import torch
from torch import Tensor

from ...config.schema import OuterConfig
from ...federation.outer import OuterOptimizer, outer_step
from ...federation.topk import TopkFold, fold_weights
from .spec import AGGREGATES
from .update_codec import UpdateCodec

__all__ = [
    "SLICE",
    "WINDOW",
    "MemoryState",
    "Reader",
    "RelayError",
    "State",
    "apply_round",
    "rounds",
    "buffer_names",
    "check",
    "combine",
    "outer_of",
    "cut",
    "fold",
]

#: Values of θ_global (and of each outer buffer) folded and stepped at a time, at the hub and at every facility.
WINDOW = 1 << 20
#: About the values held at a time when every member's window is stacked (``median``, ``trimmed_mean``).
SLICE = 1 << 22
#: How far the weights a relay claims may sum from 1.
WEIGHT_SUM_TOLERANCE = 1e-9


class RelayError(ValueError):
    """A relay that does not match what the facility holds (one line naming what)."""


def buffer_names(options: OuterConfig) -> tuple[str, ...]:
    """The outer optimizer's buffers, in the order they are saved and sent (:class:`OuterOptimizer`'s)."""
    return tuple(OuterOptimizer(options, torch.empty(0)).buffers)


def outer_of(spec: dict) -> OuterConfig:
    """The outer optimizer a federation's description names (a facility's own description: it is not checked)."""
    o = spec["outer"]
    return OuterConfig(**{k: o[k] for k in ("name", "lr", "momentum", "betas", "eps", "offload")})


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
    raise ValueError(f"aggregate {rule!r}: the hub takes {', '.join(AGGREGATES)}")


class Reader:
    """One message (or fp32 parameters when ``codec`` is None), read in order ``n`` values at a time from the file
    ``source`` (a path, or a binary file open at its first byte, which is closed with the reader). With top-k
    (:attr:`senders`: the per-index mean over the senders) :meth:`take_sent` gives only what was sent."""

    def __init__(self, source: Path | BinaryIO, codec: UpdateCodec | None):
        self.fh = open(source, "rb") if isinstance(source, (str, Path)) else source
        self.senders = codec is not None and codec.senders
        if self.senders:
            self.pieces: Iterator | None = codec.decode_sent_stream(self.fh.read)
        else:
            self.pieces = codec.decode_stream(self.fh.read) if codec is not None else None
        self.left, self.at = torch.empty(0), 0  # values not taken yet; the next value's place
        self.sent: tuple[Tensor, Tensor] | None = None  # top-k: the piece's indices sent and values, from ``self.i``
        self.i, self.end = 0, 0  # top-k: the next index of ``sent`` to take; the piece's end

    def take(self, out: Tensor) -> None:
        """Fill ``out`` with the next ``out.numel()`` values."""
        n = out.numel()
        if self.pieces is None:
            got = self.fh.readinto(memoryview(out.numpy()).cast("B"))
            if got != 4 * n:
                raise ValueError(f"a spooled upload ended after {got} of {4 * n} bytes")
            return
        if self.senders:
            index, values = self.take_sent(n)
            out.zero_().index_put_((index,), values)
            return
        filled = 0
        while filled < n:
            if not self.left.numel():
                start, self.left = next(self.pieces)
                self._check(start)
                self.at += self.left.numel()
            k = min(n - filled, self.left.numel())
            out[filled : filled + k].copy_(self.left[:k])
            self.left, filled = self.left[k:], filled + k

    def take_sent(self, n: int) -> tuple[Tensor, Tensor]:
        """Top-k: the next ``n`` values as the indices of those sent (from the first of them, ascending) and their
        values; every other value is 0."""
        first, stop = self.at, self.at + n
        index, values = [], []
        while self.at < stop:
            if self.sent is None or self.at >= self.end:
                start, numel, *self.sent = next(self.pieces)
                self._check(start)
                self.i, self.end = 0, start + numel
            sent, kept = self.sent
            upto = min(stop, self.end)
            j = int(torch.searchsorted(sent, torch.tensor(upto)))
            index.append(sent[self.i : j] - first)
            values.append(kept[self.i : j])
            self.i, self.at = j, upto
        if len(index) == 1:
            return index[0], values[0]
        return torch.cat(index), torch.cat(values)

    def _check(self, start: int) -> None:
        if start != self.at:
            raise ValueError(f"a spooled update decodes value {start} where {self.at} was next")

    def close(self) -> None:
        self.fh.close()


def fold(out: Tensor, readers: list[Reader], scales: list[float], rule: str, trim: float,
         checked: bool = False) -> None:  # fmt: skip
    """``out`` becomes the round's combination of the next ``out.numel()`` values of each reader (in fold order):
    ``sum_f scales[f] x values_f`` for ``mean`` (each product rounded, then added, in order), or with
    top-k messages per value the weighted mean over the readers that sent it (SparseLoCo's;
    equal weights count 1 each: :func:`~xffl_like.federation.topk.fold_weights`), else the coordinate-wise
    ``rule`` (unweighted). A value that is not finite raises :class:`RelayError`, unless ``checked``: the messages
    are known finite (the hub's accepted ones: each one's norm, summed over every decoded value, was finite). A
    top-k message is finite by its decoding (:meth:`.update_codec.UpdateCodec.decode_sent_stream`)."""
    check = (lambda values: None) if checked else _finite
    if rule == "mean" and readers and readers[0].senders:
        return _fold_senders(out, readers, fold_weights(list(scales)))
    if rule == "mean":
        out.zero_()
        part = torch.empty_like(out)
        for reader, scale in zip(readers, scales, strict=True):
            reader.take(part)
            check(part)
            out.add_(part.mul_(scale))
        return
    stack = torch.empty(len(readers), out.numel(), dtype=torch.float32)
    for i, reader in enumerate(readers):
        reader.take(stack[i])
    check(stack)
    out.copy_(combine(stack, rule, trim))


def _fold_senders(out: Tensor, readers: list[Reader], weights: list[float]) -> None:
    """``out``: the :class:`~xffl_like.federation.topk.TopkFold` of the readers' next ``out.numel()`` values, in
    the readers' order (only the values each one sent)."""
    out.zero_()
    mean = TopkFold(out)
    for reader, weight in zip(readers, weights, strict=True):
        mean.add(*reader.take_sent(out.numel()), weight)
    mean.finish()


def _finite(values: Tensor) -> None:
    if not torch.isfinite(values).all():
        raise RelayError("a relayed message decodes to values that are not finite")


class State(Protocol):
    """θ_global and the outer buffers, a window at a time (in memory at the hub, in files at a facility)."""

    numel: int

    def read(self, start: int, stop: int) -> tuple[Tensor, dict[str, Tensor]]:
        """θ_global's values ``start:stop`` and each buffer's, as tensors the step may change in place."""

    def write(self, start: int, theta: Tensor, buffers: dict[str, Tensor]) -> None:
        """Keep the window :meth:`read` gave, as the step changed it."""


class MemoryState:
    """θ_global and the outer buffers held whole in memory (the hub's): windows are views, written in place."""

    def __init__(self, theta: Tensor, buffers: dict[str, Tensor]):
        self.theta, self.buffers, self.numel = theta, buffers, theta.numel()

    def read(self, start: int, stop: int) -> tuple[Tensor, dict[str, Tensor]]:
        return self.theta[start:stop], {k: v[start:stop] for k, v in self.buffers.items()}

    def write(self, start: int, theta: Tensor, buffers: dict[str, Tensor]) -> None:
        pass  # the views were changed in place


@torch.no_grad()
def rounds(read, numel: int, options: OuterConfig, steps: int, readers: list[Reader], scales: list[float],
           rule: str = "mean", trim: float = 0.0, checked: bool = False,
           ) -> Iterator[tuple[int, Tensor, dict[str, Tensor]]]:  # fmt: skip
    """One compressed round, a window at a time: per window of :data:`WINDOW` values (fewer with a robust rule),
    ``read(start, stop)`` gives θ_global's and the outer buffers' values there (changed in place), the combination
    of the messages (:func:`fold`, ``readers`` in the hub's fold order, ``scales`` their weights) is the update
    ``θ_global - mean``, and the outer step number ``steps + 1`` (:func:`~xffl_like.federation.outer.outer_step`)
    moves them; yields ``(start, θ_global's window, the buffers' windows)``. The hub and every facility step
    through these same windows, so their copies stay bitwise equal. ``checked``: as :func:`fold`'s (the hub)."""
    window = WINDOW if rule == "mean" else max(1 << 16, min(WINDOW, SLICE // max(1, len(readers))) >> 16 << 16)
    acc = torch.empty(min(window, numel), dtype=torch.float32)
    for start in range(0, numel, window):
        stop = min(start + window, numel)
        theta, buffers = read(start, stop)
        update = acc[: stop - start]
        fold(update, readers, scales, rule, trim, checked)
        outer_step(options, steps + 1, theta, buffers, update)
        yield start, theta, buffers


def apply_round(state: State, options: OuterConfig, steps: int, readers: list[Reader], scales: list[float],
                rule: str = "mean", trim: float = 0.0) -> int:  # fmt: skip
    """:func:`rounds` on ``state`` (each window written back); returns the steps after."""
    for start, theta, buffers in rounds(state.read, state.numel, options, steps, readers, scales, rule, trim):
        state.write(start, theta, buffers)
    return steps + 1


def check(relay, *, me: str, version: int, new_version: int, steps: int, accepted: dict[str, float] | None,
          message_bytes: int, nbytes: int) -> None:  # fmt: skip
    """Every claim of a relay header against what the facility ``me`` holds (θ_global at ``version``, the outer
    optimizer after ``steps``), before anything changes; :class:`RelayError` (one line) on the first mismatch.
    ``relay``: a :class:`~.messages.Relay`; ``new_version``: the version the result announces; ``accepted``: the
    weights the result announces; ``message_bytes``: one message's size; ``nbytes``: the bytes that follow."""
    order, weights, sizes = list(relay.order), list(relay.weights), list(relay.sizes)
    if relay.base != version or new_version != version + 1:
        raise RelayError(f"relay of version {relay.base} -> {new_version}, but this facility holds version {version}")
    if not (len(order) == len(weights) == len(sizes)):
        raise RelayError(f"relay lists {len(order)} facilities, {len(weights)} weights and {len(sizes)} sizes")
    if len(set(order)) != len(order) or order != sorted(order) or me not in order:
        raise RelayError(f"relay order {order[:8]} is not the hub's fold order (sorted, unique names, {me} among them)")
    if accepted is not None and (set(accepted) != set(order) or weights != [accepted[n] for n in order]):
        raise RelayError(f"relay order {order[:8]} or its weights differ from the round's accepted facilities")
    if not all(math.isfinite(w) and w > 0 for w in weights) or abs(math.fsum(weights) - 1) > WEIGHT_SUM_TOLERANCE:
        raise RelayError(f"relay weights {weights[:8]} are not finite, positive and summing to 1")
    for name, size in zip(order, sizes, strict=True):
        if size != (0 if name == me else message_bytes):
            raise RelayError(f"relay message of {name} is {size} bytes, expected {0 if name == me else message_bytes}")
    if nbytes != sum(sizes):
        raise RelayError(f"relay carries {nbytes} bytes, its sizes sum to {sum(sizes)}")
    if relay.outer_steps != steps + 1:
        raise RelayError(f"relay claims outer step {relay.outer_steps}, this facility is at step {steps}")
