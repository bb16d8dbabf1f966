"""A facility's side of the relay downlink (:mod:`xffl_like.hub.protocol.relay`): a compressed round applied here.

The leader holds θ_global (``theta_global.f32``) and the outer optimizer's buffers (``outer.f32``: each buffer's
values in turn, in :func:`~xffl_like.hub.protocol.relay.buffer_names`' order) in its spool, and their step count
in memory. An accepted member's result is the other accepted members' messages (``relay.bin``); with its own
message (``update.bin``) it runs :func:`~xffl_like.hub.protocol.relay.apply_round`, the function the hub ran, a
window at a time: the new values go to files beside the old ones, which they replace only once the whole round
applied. A claim that does not hold, or a message that decodes to values that are not finite, changes nothing
(:class:`~xffl_like.hub.protocol.relay.RelayError`): the facility then heals.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

from ...config.schema import OuterConfig
from ...hub.protocol import relay
from ...hub.protocol.messages import Relay
from ...hub.protocol.update_codec import UpdateCodec

__all__ = ["FileState", "apply_relay", "zero_outer"]


class FileState:
    """θ_global in the file ``theta`` and the outer buffers ``names`` in the file ``outer`` (``numel`` values each),
    read a window at a time; what :meth:`write` gets goes to ``<file>.next``, moved over the files by
    :meth:`commit` (:meth:`discard`: left as they were)."""

    def __init__(self, theta: Path, outer: Path, names: tuple[str, ...], numel: int):
        self.numel, self.names = numel, names
        self.paths = [theta] + ([outer] if names else [])
        self.src = [open(p, "rb") for p in self.paths]
        self.dst = [open(p.with_name(f"{p.name}.next"), "wb") for p in self.paths]

    def _read(self, fh, offset: int, n: int) -> Tensor:
        out = torch.empty(n, dtype=torch.float32)
        fh.seek(4 * offset)
        if fh.readinto(memoryview(out.numpy()).cast("B")) != 4 * n:
            raise OSError(f"{fh.name} is shorter than the federation's parameters (the spool file is damaged)")
        return out

    def read(self, start: int, stop: int) -> tuple[Tensor, dict[str, Tensor]]:
        theta = self._read(self.src[0], start, stop - start)
        buffers = {k: self._read(self.src[1], i * self.numel + start, stop - start) for i, k in enumerate(self.names)}
        return theta, buffers

    def write(self, start: int, theta: Tensor, buffers: dict[str, Tensor]) -> None:
        self.dst[0].seek(4 * start)
        theta.numpy().tofile(self.dst[0])
        for i, k in enumerate(self.names):
            self.dst[1].seek(4 * (i * self.numel + start))
            buffers[k].numpy().tofile(self.dst[1])

    def _close(self) -> None:
        for fh in self.src + self.dst:
            fh.close()

    def commit(self) -> None:
        self._close()
        for p in self.paths:
            os.replace(p.with_name(f"{p.name}.next"), p)

    def discard(self) -> None:
        self._close()
        for p in self.paths:
            p.with_name(f"{p.name}.next").unlink(missing_ok=True)


def zero_outer(path: Path, names: tuple[str, ...], numel: int) -> None:
    """The outer buffers of a new federation (zeros, as the hub's): ``numel`` values per buffer."""
    with open(path, "wb") as fh:
        fh.truncate(4 * numel * len(names))


def apply_relay(theta: Path, outer: Path, own: Path, received: Path, *, me: str, header: Relay, codec: UpdateCodec,
                options: OuterConfig, steps: int, rule: str, trim: float) -> int:  # fmt: skip
    """Apply the relayed round ``header`` (checked already, :func:`relay.check`) to the files ``theta`` and
    ``outer``: the messages in fold order, ``me``'s from the file ``own``, the others' one after another from the
    file ``received``. Returns the outer optimizer's steps after it."""
    readers, offset = [], 0
    state = FileState(theta, outer, relay.buffer_names(options), codec.numel)
    try:
        for name, size in zip(header.order, header.sizes, strict=True):
            if name == me:
                readers.append(relay.Reader(own, codec))
                continue
            fh = open(received, "rb")
            fh.seek(offset)
            readers.append(relay.Reader(fh, codec))
            offset += size
        steps = relay.apply_round(state, options, steps, readers, list(header.weights), rule, trim)
        state.commit()
    except BaseException:
        state.discard()
        raise
    finally:
        for reader in readers:
            reader.close()
    return steps
