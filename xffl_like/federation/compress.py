"""Compressed mean across facilities of what crosses their boundary: the facilities' updates.

Each facility sends its update ``u_f = theta_global - theta_f`` (the pseudo-gradient: small
numbers with a narrow range, so 8 bits lose little) rather than its weights. Among the
``n`` peers holding the same shard (one per facility, facility order) the flat update is
cut into ``n`` equal parts and reduced like Bagua's ByteGrad:

1. quantize every part (``uint8``: min-max per chunk of ``chunk_size`` values with the
   shared codec :mod:`xffl_like.parallel.codec`; ``bf16``: a cast);
2. all-to-all: peer ``j`` receives part ``j`` from everyone;
3. peer ``j`` dequantizes them and accumulates the weighted mean in fp32;
4. re-quantizes its part and all-gathers it; everyone dequantizes the same bytes, so every
   facility ends with the identical mean update.

With error feedback, the part of ``u_f`` that the first quantization lost (``u_f`` minus
what the peers decode from this facility's message) is added to the next round's update,
so nothing a facility learned is dropped for good. The second quantization's error is the
same on every facility (all decode the same bytes) and is not fed back.

Bytes are counted from the messages this rank hands to the collectives, without the row
it keeps for itself.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed.compat import all_gather_single
from ..parallel import codec

__all__ = ["COMPRESSIONS", "CompressedMean"]

COMPRESSIONS = ("none", "bf16", "uint8", "topk")  # topk: federation/topk.py


class CompressedMean:
    """Weighted mean over ``n`` peers of a flat fp32 update of ``numel`` values, compressed.

    ``kind``: ``bf16`` or ``uint8``; ``chunk_size``: values per min-max chunk (``uint8``);
    ``error_feedback``: carry the first quantization's residual into the next call.
    """

    def __init__(
        self,
        kind: str,
        numel: int,
        n: int,
        chunk_size: int = 4096,
        error_feedback: bool = False,
        device: torch.device | str = "cpu",
    ):
        if kind not in ("bf16", "uint8"):
            raise ValueError(f"federation.compression={kind!r}: use one of {', '.join(COMPRESSIONS)}")
        if chunk_size < 1:
            raise ValueError(f"federation.chunk_size={chunk_size}: must be a positive integer")
        self.kind, self.numel, self.n, self.chunk_size = kind, numel, n, chunk_size
        self.part = max(1, math.ceil(numel / n))  # values per peer's part (the last one padded)
        self.chunks = max(1, math.ceil(self.part / chunk_size))  # min-max chunks per part
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device) if error_feedback else None

    @property
    def row_bytes(self) -> int:
        """Bytes of one encoded part."""
        if self.kind == "bf16":
            return 2 * self.part
        return codec.packed_bytes(self.part, self.chunks)

    def encode(self, rows: Tensor) -> Tensor:
        """``[k, part]`` fp32 -> ``[k, row]`` message (uint8 bytes or bf16 values)."""
        if self.kind == "bf16":
            return rows.to(torch.bfloat16)
        return torch.stack([codec.compress(r, self.chunks).view(-1) for r in rows])

    def decode(self, rows: Tensor) -> Tensor:
        """``[k, row]`` message -> ``[k, part]`` fp32."""
        if self.kind == "bf16":
            return rows.float()
        return torch.stack([codec.decompress(r.view(self.chunks, -1), self.part) for r in rows])

    def _parts(self, update: Tensor) -> Tensor:
        padded = update.new_zeros(self.n * self.part)
        padded[: self.numel].copy_(update)
        if self.numel < padded.numel():  # repeat the last value: padding never widens a chunk's range
            padded[self.numel :] = update[-1] if self.numel else 0.0
        return padded.view(self.n, self.part)

    @torch.no_grad()
    def prepare(self, update: Tensor) -> Tensor:
        """Add the carried residual to ``update`` (in place), encode it, store the new residual.

        Returns the ``[n, row]`` message. Every copy of a facility may call it (same bytes).
        """
        if self.residual is not None:
            update.add_(self.residual)
        message = self.encode(self._parts(update))
        if self.residual is not None:
            sent = self.decode(message).view(-1)[: self.numel]
            torch.sub(update, sent, out=self.residual)
        return message

    @torch.no_grad()
    def reduce(self, message: Tensor, group, me: int, scales: list[float]) -> tuple[Tensor, int]:
        """Run the exchange of ``message`` among the peers of ``group`` (this peer is number ``me``).

        ``scales[j]``: weight of peer ``j`` (summing to 1). Returns the mean update (flat fp32,
        ``numel`` values, identical on every peer) and the bytes this rank sent.
        """
        n = self.n
        if n == 1:
            return self.decode(message).view(-1)[: self.numel].clone(), 0
        received = torch.empty_like(message)
        dist.all_to_all_single(received, message.contiguous(), group=group)
        decoded = self.decode(received)  # row j: peer j's encoding of my part
        mine = torch.zeros(self.part, dtype=torch.float32, device=message.device)
        for j in range(n):
            mine.add_(decoded[j], alpha=scales[j])
        reduced = self.encode(mine.view(1, -1))
        gathered = torch.empty((n, reduced.shape[1]), dtype=reduced.dtype, device=reduced.device)
        all_gather_single(gathered, reduced, group=group)
        sent = message.nbytes - message[me].nbytes + (n - 1) * reduced.nbytes  # my row stays here
        return self.decode(gathered).view(-1)[: self.numel], sent
