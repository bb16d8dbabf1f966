"""SparseLoCo's outer step, written from the published code (QErywan/RobustDiLoCo ``src/tplr/sparseloco.py``,
its sweep ``hparams/512M/sweeps/sparseloco.yaml``) in numpy, with no call into ``xffl_like``: what the tests
compare ``federation/topk=sparseloco`` with.

Per facility ``f`` and tensor ``p`` (fp32): ``e <- beta e + (theta_global - theta_f)``; ``e`` cut into tiles
(each side the largest divisor of the dimension <= 64) of a 2-D tensor or runs of a 1-D one; per tile the
``k = max(1, round(len x 128 / 64^2))`` largest magnitudes; their values quantized per tensor into 4 bins
(shift by the mean, scale 6 sigma / 4 with the unbiased sigma, code ``round(c / scale + 2)`` clamped to
0..3, each code decoded to its bin's mean plus the shift); ``e <- e - decoded`` at the sent indices. The
global step: per index the mean over the facilities that sent it (``scatter_reduce(mean,
include_self=False)``), then SGD at lr 1 without momentum: ``theta_global <- theta_global - mean``.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

TILE, TOP_K, BINS, RANGE, BETA = 64, 128, 4, 6, 0.95
DENSITY = TOP_K / TILE**2  # 0.03125


def smaller_split(n: int, close_to: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    below = [d for d in divisors if d <= close_to]
    return below[-1] if below else divisors[0]


def tile_positions(shape: tuple[int, ...], tile: int = TILE) -> np.ndarray:
    """``[chunks, len]``: the flat positions (inside the tensor) of each tile's values, row-major in the tile."""
    n = int(np.prod(shape))
    if len(shape) == 1:
        w = smaller_split(n, tile)
        return np.arange(n).reshape(n // w, w)
    rows, cols = shape
    h, w = smaller_split(rows, tile), smaller_split(cols, tile)
    pos = np.arange(n).reshape(rows // h, h, cols // w, w).transpose(0, 2, 1, 3)
    return pos.reshape(-1, h * w)


def bins_of(values: np.ndarray, bins: int = BINS) -> tuple[np.float32, np.ndarray, np.ndarray]:
    """SparseLoCo's quantization of a tensor's kept ``values`` (fp32) into ``bins`` bins: (shift, lookup, codes).
    Its statistics are summed in float64 and rounded to float32 once."""
    v = values.astype(np.float32)
    shift = np.float32(v.astype(np.float64).mean())
    centred = (v - shift).astype(np.float32)
    n = centred.size
    std = np.float32(np.sqrt((centred.astype(np.float64) ** 2).sum()) / np.sqrt(n - 1)) if n > 1 else np.float32(0)
    scale = np.float32(np.float32(RANGE) * std / np.float32(bins))
    if scale == 0 or not np.isfinite(scale):
        scale = np.float32(1)
    codes = np.clip(np.rint(centred / scale + np.float32(bins // 2)), 0, bins - 1).astype(np.int64)
    lookup = np.zeros(bins, dtype=np.float32)
    for b in range(bins):
        if (codes == b).any():
            lookup[b] = np.float32(centred[codes == b].astype(np.float64).mean())
    return shift, lookup, codes


def quantize(values: np.ndarray, bins: int = BINS) -> np.ndarray:
    """The decoded values of a tensor's kept ``values`` (fp32) after SparseLoCo's ``bins``-bin quantization."""
    shift, lookup, codes = bins_of(values, bins)
    return (lookup[codes] + shift).astype(np.float32)


def keep(length: int, density: float = DENSITY) -> int:
    """Values kept of a tile of ``length`` (SparseLoCo: ``round(length x top_k / tile^2)``, at least one)."""
    return int(max(1, round(Fraction(str(density)) * length)))


def top(e: np.ndarray, shape: tuple[int, ...], density: float = DENSITY, tile: int = TILE) -> np.ndarray:
    """``[chunks, k]``: per tile of the tensor's ``e`` (flat) the flat positions of its ``k`` largest magnitudes
    (ties: the lowest position), ascending."""
    pos = tile_positions(shape, tile)
    k = keep(pos.shape[1], density)
    order = np.sort(np.argsort(-np.abs(e[pos]), axis=1, kind="stable")[:, :k], axis=1)  # per tile, as one array
    return np.take_along_axis(pos, order, axis=1)


def compress(e: np.ndarray, shape: tuple[int, ...], density: float = DENSITY, tile: int = TILE, bits: int = 2):
    """A tensor's accumulator ``e`` (flat fp32) -> (flat positions sent, their decoded values)."""
    sent = top(e, shape, density, tile).reshape(-1)
    return sent, quantize(e[sent], 1 << bits)


# ------------------------------------------------------------------ the bytes (the codec's documented format)
def _pack(values, width: int) -> bytes:
    acc = 0
    for j, v in enumerate(values):
        assert 0 <= int(v) < 1 << width
        acc |= int(v) << (j * width)
    return acc.to_bytes(-(-len(values) * width // 8), "little")


def _unpack(data: bytes, n: int, width: int) -> list[int]:
    acc = int.from_bytes(data, "little")
    return [(acc >> (j * width)) & ((1 << width) - 1) for j in range(n)]


def _width(length: int) -> int:
    return max(1, (length - 1).bit_length())


def ref_encode(x: np.ndarray, shapes, density: float = DENSITY, tile: int = TILE, bits: int = 2) -> bytes:
    """The message of the flat ``x`` (fp32) cut into tensors of ``shapes``: per tensor the float32 header (shift, then
    the ``2**bits`` bin values), then per tile its indices inside the tile (``ceil(log2(tile length))`` bits each),
    then per tile its codes (``bits`` each), every tile's section padded to a byte; little-endian throughout."""
    out, offset = bytearray(), 0
    for shape in shapes:
        n = int(np.prod(shape))
        e = np.asarray(x[offset : offset + n], dtype=np.float32)
        offset += n
        if n == 0:
            continue
        pos = tile_positions(tuple(shape), tile)
        sent = top(e, tuple(shape), density, tile)
        shift, lookup, codes = bins_of(e[sent.reshape(-1)], 1 << bits)
        codes = codes.reshape(sent.shape)
        out += np.concatenate([[shift], lookup]).astype("<f4").tobytes()
        for row, chosen in zip(pos, sent):
            out += _pack(np.argmax(row[None, :] == chosen[:, None], axis=1), _width(pos.shape[1]))  # where in the tile
        for c in codes:
            out += _pack(c, bits)
    return bytes(out)


def ref_decode(data: bytes, shapes, density: float = DENSITY, tile: int = TILE, bits: int = 2):
    """(the flat fp32 values :func:`ref_encode`'s ``data`` carries, zero where nothing was sent; a mask of the values
    sent)."""
    total = sum(int(np.prod(s)) for s in shapes)
    out, offset, at, bins = np.zeros(total, dtype=np.float32), 0, 0, 1 << bits
    sent = np.zeros(total, dtype=bool)
    for shape in shapes:
        n = int(np.prod(shape))
        if n == 0:
            continue
        pos = tile_positions(tuple(shape), tile)
        chunks, length = pos.shape
        k, w = keep(length, density), _width(length)
        head = np.frombuffer(data[at : at + 4 * (1 + bins)], dtype="<f4")
        at += 4 * (1 + bins)
        index = []
        for _ in range(chunks):
            index.append(_unpack(data[at : at + -(-k * w // 8)], k, w))
            at += -(-k * w // 8)
        for c in range(chunks):
            codes = _unpack(data[at : at + -(-k * bits // 8)], k, bits)
            at += -(-k * bits // 8)
            assert all(b > a for a, b in zip(index[c], index[c][1:])) and max(index[c]) < length
            out[offset + pos[c][index[c]]] = (head[1:][codes] + head[0]).astype(np.float32)
            sent[offset + pos[c][index[c]]] = True
        offset += n
    assert at == len(data), f"{len(data) - at} bytes left"
    return out, sent


def sender_mean(decoded: list[np.ndarray], sent: list[np.ndarray], weights: list[float]) -> np.ndarray:
    """Per index the weighted mean over the facilities that sent it (0 where none did), in float64."""
    num = sum(np.float64(w) * d.astype(np.float64) * s for d, s, w in zip(decoded, sent, weights))
    den = sum(np.float64(w) * s for s, w in zip(sent, weights))
    return np.where(den > 0, num / np.where(den > 0, den, 1), 0.0)


def topk_overrides(density: float, bits: int, decay: float, tile: int = TILE) -> list[str]:
    """A job's overrides for ``compression=topk`` with these settings."""
    return ["federation.compression=topk", f"federation.topk.density={density}", f"federation.topk.bits={bits}",
            f"federation.topk.decay={decay}", f"federation.topk.tile={tile}"]  # fmt: skip


def outer_round(theta: list[np.ndarray], local: list[list[np.ndarray]], errors: list[list[np.ndarray]]):
    """One round: ``theta`` (per tensor, fp32), each facility's ``local`` tensors and its ``errors``
    (updated in place). Returns the new ``theta``."""
    out = []
    for t, g in enumerate(theta):
        flat = g.reshape(-1)
        total = np.zeros(flat.size, dtype=np.float32)
        count = np.zeros(flat.size, dtype=np.float32)
        for f in range(len(local)):
            e = errors[f][t]
            e *= np.float32(BETA)
            e += flat - local[f][t].reshape(-1)
            sent, decoded = compress(e, g.shape)
            e[sent] -= decoded
            total[sent] += decoded
            count[sent] += 1
        mean = np.where(count > 0, total / np.where(count > 0, count, 1), np.float32(0)).astype(np.float32)
        out.append((flat - np.float32(1.0) * mean).reshape(g.shape))
    return out
