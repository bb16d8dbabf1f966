"""The top-k wire format (``xffl_like/federation/topk.py``'s docstring), written again in numpy and Python
integers with no call into the codec: what the tests compare the codec's bytes and values with."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

TINIEST = np.float32(2.0**-149)


def keep(density: float, length: int) -> int:
    return min(length, math.ceil(Fraction(str(density)) * length))


def pack(values, width: int) -> bytes:
    acc = 0
    for j, v in enumerate(values):
        assert 0 <= int(v) < 1 << width
        acc |= int(v) << (j * width)
    return acc.to_bytes(-(-len(values) * width // 8), "little")


def unpack(data: bytes, n: int, width: int) -> list[int]:
    acc = int.from_bytes(data, "little")
    return [(acc >> (j * width)) & ((1 << width) - 1) for j in range(n)]


def ref_layout(numel: int, chunk: int, density: float, bits: int) -> list[tuple[int, int, int]]:
    """``(start, length, row bytes)`` per chunk."""
    ib = max(1, (chunk - 1).bit_length())
    out = []
    for start in range(0, numel, chunk):
        length = min(chunk, numel - start)
        k = keep(density, length)
        out.append((start, length, 4 + -(-k * ib // 8) + -(-k * bits // 8)))
    return out


def ref_encode(x: np.ndarray, chunk: int, density: float, bits: int) -> bytes:
    x = np.asarray(x, dtype=np.float32)
    q_max = 2 ** (bits - 1) - 1
    ib = max(1, (chunk - 1).bit_length())
    out = bytearray()
    for start, length, _ in ref_layout(len(x), chunk, density, bits):
        c = x[start : start + length]
        k = keep(density, length)
        order = np.lexsort((np.arange(length), -np.abs(c)))  # largest magnitude first, then lowest index
        index = np.sort(order[:k])
        v = c[index]
        mag = np.abs(v)
        top = mag.max()
        if bits == 2:
            scale = max(np.sort(mag)[(k - 1) // 2], top / np.float32(2))
        else:
            scale = top / np.float32(q_max)
        scale = np.float32(TINIEST if scale == 0 and top > 0 else scale)
        q = np.clip(np.rint(v / scale), -q_max, q_max) if scale > 0 else np.zeros(k)
        out += np.array([scale], dtype="<f4").tobytes()
        out += pack(index, ib) + pack((q + q_max).astype(np.int64), bits)
    return bytes(out)


def ref_decode(data: bytes, numel: int, chunk: int, density: float, bits: int) -> np.ndarray:
    q_max = 2 ** (bits - 1) - 1
    ib = max(1, (chunk - 1).bit_length())
    out = np.zeros(numel, dtype=np.float32)
    offset = 0
    for start, length, row in ref_layout(numel, chunk, density, bits):
        k = keep(density, length)
        body = data[offset : offset + row]
        offset += row
        scale = np.frombuffer(body[:4], dtype="<f4")[0]
        nidx = -(-k * ib // 8)
        index = unpack(body[4 : 4 + nidx], k, ib)
        codes = unpack(body[4 + nidx :], k, bits)
        out[start + np.array(index)] = (np.array(codes, dtype=np.float32) - np.float32(q_max)) * scale
    assert offset == len(data)
    return out


#: The flat codec this module writes again (flat chunks, symmetric levels, the weighted mean): top-k's choices
#: before SparseLoCo's became its defaults (issue 39), spelled out.
FLAT_LEVELS = ["federation.topk.chunks=flat", "federation.topk.quantizer=levels", "federation.topk.mean=weighted"]


def topk_overrides(chunk: int, density: float, bits: int, decay: float) -> list[str]:
    """A job's overrides for ``compression=topk`` with these settings and this module's codec (:data:`FLAT_LEVELS`;
    error feedback on, as topk needs)."""
    return [
        "federation.compression=topk",
        "federation.error_feedback=true",
        *FLAT_LEVELS,
        f"federation.chunk_size={chunk}",
        f"federation.topk.density={density}",
        f"federation.topk.bits={bits}",
        f"federation.topk.decay={decay}",
    ]
