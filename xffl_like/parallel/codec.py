"""Min-max uint8 quantization: the one codec shared by ByteGrad, low-precision gossip and
the federation's compression.

A flat float tensor is cut into ``chunks`` contiguous pieces of equal length (the
last one padded); each piece is sent as its minimum and maximum (two float32) and
one byte per value, ``q = round((x - min) / (max - min) * 255)``. Decoding gives
``min + q * (max - min) / 255``, so the error of every value is at most half a
step, ``(max - min) / 510``, of its chunk (see :func:`error_bound`).

A packed message is one uint8 tensor ``[chunks, 8 + chunk_len]``: the two float32
are stored as their raw bytes (a bit-cast, not a value cast), then the codes, so a
single collective moves a whole chunk and any row can go to a different rank.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["HEADER_BYTES", "chunk_length", "compress", "decompress", "error_bound", "packed_bytes"]

HEADER_BYTES = 8  # float32 min and max, as raw bytes
LEVELS = 255


def chunk_length(numel: int, chunks: int) -> int:
    """Values per chunk when ``numel`` values are cut into ``chunks`` equal pieces."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    return max(1, math.ceil(numel / chunks))


def packed_bytes(numel: int, chunks: int = 1) -> int:
    """Size in bytes of the packed message of ``numel`` values in ``chunks`` chunks."""
    return chunks * (HEADER_BYTES + chunk_length(numel, chunks))


def _rows(x: Tensor, chunks: int) -> Tensor:
    flat = x.detach().reshape(-1).float()
    length = chunk_length(flat.numel(), chunks)
    pad = chunks * length - flat.numel()
    if pad:  # repeat the last value so padding never widens a chunk's range
        fill = flat[-1:] if flat.numel() else flat.new_zeros(1)
        flat = torch.cat([flat, fill.expand(pad)])
    return flat.view(chunks, length)


def compress(x: Tensor, chunks: int = 1) -> Tensor:
    """Quantize ``x`` (any shape, any float dtype) to a packed uint8 ``[chunks, 8 + len]`` message."""
    rows = _rows(x, chunks)
    lo, hi = torch.aminmax(rows, dim=1, keepdim=True)
    scale = (hi - lo) / LEVELS
    # A constant chunk has scale 0: every code is 0 and decodes to the minimum exactly.
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    out = torch.empty((chunks, HEADER_BYTES + rows.shape[1]), dtype=torch.uint8, device=rows.device)
    out[:, :HEADER_BYTES] = torch.cat([lo, hi], dim=1).view(torch.uint8)  # bit-cast: 8 raw bytes per row
    # Codes are whole numbers in [0, 255] here, so the float -> uint8 copy is exact.
    out[:, HEADER_BYTES:] = (rows - lo).mul_(inv).round_().clamp_(0, LEVELS)
    return out


def decompress(packed: Tensor, numel: int, out: Tensor | None = None) -> Tensor:
    """Decode a packed message into ``numel`` float values (into ``out``'s dtype/shape if given)."""
    packed = packed.view(-1, packed.shape[-1]) if packed.dim() != 2 else packed
    # A fresh copy: a view's offset or stride may not be float-aligned.
    header = packed[:, :HEADER_BYTES].flatten().clone().view(torch.float32).view(-1, 2)
    lo, hi = header[:, :1], header[:, 1:2]
    values = packed[:, HEADER_BYTES:].float().mul_((hi - lo) / LEVELS).add_(lo).reshape(-1)[:numel]
    if out is None:
        return values
    out.view(-1).copy_(values)
    return out


def error_bound(x: Tensor, chunks: int = 1) -> Tensor:
    """Largest decoding error of each value of ``x`` (half a quantization step of its chunk), flat."""
    rows = _rows(x, chunks)
    step = (rows.amax(dim=1, keepdim=True) - rows.amin(dim=1, keepdim=True)) / LEVELS
    return (step / 2).expand_as(rows).reshape(-1)[: x.numel()]
