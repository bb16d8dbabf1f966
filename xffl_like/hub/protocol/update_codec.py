"""A facility's update ``θ_global - θ_f`` as it travels to the hub, compressed (``federation.compression``).

One flat message per facility: ``bf16`` (two bytes a value), ``uint8`` (min-max chunks of about
``federation.chunk_size`` values, :mod:`xffl_like.parallel.codec`) or ``topk`` (SparseLoCo's top-k of each tile
of each tensor in a few bits, :mod:`xffl_like.federation.topk_tensors`). The facility encodes it window by
window; the hub decodes it chunk by chunk (top-k: tensor by tensor) as it reads it back
(:meth:`UpdateCodec.decode_stream`), so it never holds a decoded copy beside its accumulator. Both ends size the
message from the federation's description alone, so the hub checks every byte count before it reads one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from ...federation.topk_tensors import TensorCodec, TopkOptions
from ...parallel import codec

__all__ = ["CODECS", "UpdateCodec"]

CODECS = ("bf16", "uint8", "topk")
_ROWS = 1024  # uint8 chunks decoded at a time by the hub


class UpdateCodec:
    """The ``kind`` message of ``numel`` values (``chunk_size``: values per uint8 chunk, about); ``topk``:
    ``federation.topk``'s :class:`~xffl_like.federation.topk_tensors.TopkOptions`; ``shapes``: the parameters'
    shapes in the flat order (top-k cuts each tensor on its own)."""

    def __init__(
        self,
        kind: str,
        numel: int,
        chunk_size: int,
        topk: TopkOptions | None = None,
        shapes: list[list[int]] | None = None,
    ):
        if kind not in CODECS:
            raise ValueError(f"compression {kind!r}: the hub decodes {', '.join(CODECS)}")
        if not 1 <= chunk_size <= 1 << 24:
            raise ValueError(f"chunk_size {chunk_size} out of range")
        self.kind, self.numel, self.chunk_size = kind, numel, chunk_size
        self.chunks = max(1, math.ceil(numel / chunk_size))
        self.length = codec.chunk_length(numel, self.chunks)  # values per chunk (the last one padded)
        self.topk: TensorCodec | None = None
        if kind == "topk":
            if topk is None:
                raise ValueError("compression topk needs federation.topk's options")
            self.topk = TensorCodec(numel, topk, shapes)

    @property
    def nbytes(self) -> int:
        if self.kind == "bf16":
            return 2 * self.numel
        if self.topk is not None:
            return self.topk.nbytes
        return codec.packed_bytes(self.numel, self.chunks)

    def encode(self, update: Tensor) -> Tensor:
        """The message's bytes (flat uint8)."""
        if self.kind == "bf16":
            return update.reshape(-1).to(torch.bfloat16).view(torch.uint8)
        if self.topk is not None:
            return self.topk.encode(update)
        return codec.compress(update.reshape(-1), self.chunks).view(-1)

    def windows(self, about: int) -> list[tuple[int, int]]:
        """``(start, numel)`` of the windows of :meth:`encode_window`, in order, covering the values: about ``about``
        values each, in whole chunks (at least one); top-k: whole tensors
        (:meth:`.topk_tensors.TensorCodec.windows`: a tensor larger than ``about`` alone)."""
        if self.topk is not None:
            return self.topk.windows(about)
        unit = 1 if self.kind == "bf16" else self.length
        step = max(unit, about // unit * unit)
        return [(start, min(step, self.numel - start)) for start in range(0, self.numel, step)]

    def encode_window(self, values: Tensor, start: int) -> Tensor:
        """The bytes of the message that encode ``values``, the values of a window from ``start`` (of
        :meth:`windows`): the same bytes as :meth:`encode` of the whole gives there."""
        if self.kind == "bf16":
            return values.reshape(-1).to(torch.bfloat16).view(torch.uint8)
        if self.topk is not None:
            return self.topk.part(start, values.numel()).encode(values.reshape(-1).contiguous())
        rows = math.ceil(values.numel() / self.length)
        padded = values.new_empty(rows * self.length)
        padded[: values.numel()].copy_(values.reshape(-1))
        padded[values.numel() :] = values.reshape(-1)[-1]  # as the whole message pads its last chunk
        return codec.compress(padded, rows).view(-1)

    def decode_window(self, message: Tensor, start: int, numel: int) -> Tensor:
        """The ``numel`` values that :meth:`encode_window`'s ``message`` carries (flat fp32)."""
        if self.kind == "bf16":
            return message.view(torch.bfloat16).float()
        if self.topk is not None:
            return self.topk.part(start, numel).decode(message)
        return codec.decompress(message.view(-1, codec.HEADER_BYTES + self.length), numel)

    def take_sent(self, update: Tensor, message: Tensor, start: int) -> Tensor:
        """``update`` (a window of :meth:`windows`) less what its window's ``message`` carries, in place: the residual
        of error feedback (top-k: only the values sent change, never a dense copy of the decoded window)."""
        if self.topk is not None:
            index, values = self.topk.part(start, update.numel()).decode_sparse(message)
            return update.index_put_((index,), update[index] - values)
        return update.sub_(self.decode_window(message, start, update.numel()))

    def decode(self, message: Tensor) -> Tensor:
        """The update the message carries (flat fp32, ``numel`` values)."""
        if self.kind == "bf16":
            return message.view(torch.bfloat16).float()
        if self.topk is not None:
            return self.topk.decode(message)
        return codec.decompress(message.view(self.chunks, -1), self.numel)

    @property
    def senders(self) -> bool:
        """Whether messages are averaged per index over the facilities that sent them (top-k)."""
        return self.topk is not None

    def decode_sent_stream(self, read: Callable[[int], bytes]) -> Iterator[tuple[int, int, Tensor, Tensor]]:
        """``topk``: per tensor in order from ``read(n)``, its first value, its values, and the flat indices
        (ascending) and values of what it sent (:meth:`.topk_tensors.TensorCodec.decode_sent_stream`; all finite)."""
        yield from self.topk.decode_sent_stream(read)

    def decode_stream(self, read: Callable[[int], bytes]) -> Iterator[tuple[int, Tensor]]:
        """(first value, values) decoded in order from ``read(n)`` (the message's bytes, as a file gives them)."""
        if self.topk is not None:
            yield from self.topk.decode_stream(read)
            return
        if self.kind == "bf16":
            step = 1 << 22
            for start in range(0, self.numel, step):
                n = min(step, self.numel - start)
                yield start, _exact(read(2 * n), 2 * n).view(torch.bfloat16).float()
            return
        row = codec.HEADER_BYTES + self.length
        for first in range(0, self.chunks, _ROWS):
            rows = min(_ROWS, self.chunks - first)
            start = first * self.length
            n = min(rows * self.length, self.numel - start)
            packed = _exact(read(rows * row), rows * row).view(rows, row)
            yield start, codec.decompress(packed, n)


def _exact(data: bytes, n: int) -> Tensor:
    if len(data) != n:
        raise ValueError(f"{len(data)} bytes where the message has {n}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
