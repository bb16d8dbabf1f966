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


def compress(e: np.ndarray, shape: tuple[int, ...], density: float = DENSITY, tile: int = TILE, bits: int = 2):
    """A tensor's accumulator ``e`` (flat fp32) -> (flat positions sent, their decoded values): SparseLoCo's tiles
    and bins (:func:`compress_all` of one tensor)."""
    return compress_all(e, [shape], density, tile, bits)


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


def pieces(shapes, tile: int = TILE, chunks: str = "tiles", chunk: int = 4096) -> list[np.ndarray]:
    """The "tensors" the codec quantizes on their own, each as ``[chunks, len]``: every chunk's flat positions in the
    whole vector. ``tiles``: per tensor of ``shapes`` its tiles; ``flat`` (``federation.topk.chunks=flat``): chunks
    of ``chunk`` values of the whole vector, in runs of ``max(1, 2**20 // chunk)`` full chunks, then the last,
    shorter chunk alone."""
    numel = sum(int(np.prod(s)) for s in shapes)
    if chunks == "flat":
        full, tail = divmod(numel, chunk)
        run = max(1, (1 << 20) // chunk)
        out = [np.arange(a * chunk, min(a + run, full) * chunk).reshape(-1, chunk) for a in range(0, full, run)]
        return out + ([np.arange(full * chunk, numel).reshape(1, tail)] if tail else [])
    out, offset = [], 0
    for shape in shapes:
        n = int(np.prod(shape))
        if n:
            out.append(offset + tile_positions(tuple(shape), tile))
        offset += n
    return out


def kept(length: int, density: float, chunks: str) -> int:
    """Values kept of a chunk: SparseLoCo's rounding with tiles, ``ceil(density x length)`` with flat chunks."""
    exact = Fraction(str(density)) * length
    return int(max(1, min(length, -(-exact.numerator // exact.denominator) if chunks == "flat" else round(exact))))


def levels_of(v: np.ndarray, bits: int) -> tuple[np.float32, np.ndarray]:
    """``quantizer=levels`` of one chunk's kept ``v`` (fp32): (scale, codes); a code ``c`` decodes to
    ``(c - Q) * scale``, ``Q = 2**(bits-1) - 1``. 2 bits: ``scale = max(lower median |v|, max |v| / 2)``; else
    ``max |v| / Q``; a zero scale of non-zero values is the smallest subnormal."""
    q_max = 2 ** (bits - 1) - 1
    mag = np.abs(v)
    top = mag.max()
    scale = max(np.sort(mag)[(v.size - 1) // 2], top / np.float32(2)) if bits == 2 else top / np.float32(q_max)
    scale = np.float32(2.0**-149) if scale == 0 and top > 0 else np.float32(scale)
    q = np.clip(np.rint(v / scale), -q_max, q_max) if scale > 0 else np.zeros(v.size)
    return scale, (q + q_max).astype(np.int64)


def _levels(codes: np.ndarray, scale: np.float32, bits: int) -> np.ndarray:
    return ((codes - (2 ** (bits - 1) - 1)).astype(np.float32) * np.float32(scale)).astype(np.float32)


def _choose(x: np.ndarray, pos: np.ndarray, density: float, chunks: str) -> np.ndarray:
    """``[chunks, k]``: per chunk (row of ``pos``) the flat positions of its ``k`` largest magnitudes of ``x`` (ties:
    the lowest position), ascending."""
    k = kept(pos.shape[1], density, chunks)
    order = np.sort(np.argsort(-np.abs(x[pos]), axis=1, kind="stable")[:, :k], axis=1)  # per chunk, as one array
    return np.take_along_axis(pos, order, axis=1)


def compress_all(
    x: np.ndarray, shapes, density=DENSITY, tile=TILE, bits=2, chunks="tiles", quantizer="bins", chunk=4096
):
    """The whole flat accumulator ``x`` (fp32) -> (flat positions sent, their decoded values)."""
    sent, values = [], []
    for pos in pieces(shapes, tile, chunks, chunk):
        chosen = _choose(x, pos, density, chunks)
        sent.append(chosen.reshape(-1))
        if quantizer == "bins":
            values.append(quantize(x[chosen.reshape(-1)], 1 << bits))
        else:
            for row in chosen:
                scale, codes = levels_of(x[row], bits)
                values.append(_levels(codes, scale, bits))
    return np.concatenate(sent), np.concatenate(values).astype(np.float32)


def ref_encode(x: np.ndarray, shapes, density=DENSITY, tile=TILE, bits=2, chunks="tiles", quantizer="bins", chunk=4096):
    """The message of the flat ``x`` (fp32) cut into :func:`pieces`: per piece the float32 header (``bins``: the shift,
    then the ``2**bits`` bin values; ``levels``: every chunk's scale), then per chunk its indices inside the chunk
    (``ceil(log2(chunk length))`` bits each), then per chunk its codes (``bits`` each), every chunk's section padded
    to a byte; little-endian throughout."""
    out = bytearray()
    x = np.asarray(x, dtype=np.float32)
    for pos in pieces(shapes, tile, chunks, chunk):
        sent = _choose(x, pos, density, chunks)
        if quantizer == "bins":
            shift, lookup, codes = bins_of(x[sent.reshape(-1)], 1 << bits)
            codes = codes.reshape(sent.shape)
            out += np.concatenate([[shift], lookup]).astype("<f4").tobytes()
        else:
            scales, codes = zip(*[levels_of(x[row], bits) for row in sent])
            out += np.array(scales, dtype="<f4").tobytes()
        for row, chosen in zip(pos, sent):
            out += _pack(np.argmax(row[None, :] == chosen[:, None], axis=1), _width(pos.shape[1]))  # where in the chunk
        for c in codes:
            out += _pack(c, bits)
    return bytes(out)


def ref_decode(data: bytes, shapes, density=DENSITY, tile=TILE, bits=2, chunks="tiles", quantizer="bins", chunk=4096):
    """(the flat fp32 values :func:`ref_encode`'s ``data`` carries, zero where nothing was sent; a mask of the values
    sent)."""
    total = sum(int(np.prod(s)) for s in shapes)
    out, at, bins = np.zeros(total, dtype=np.float32), 0, 1 << bits
    sent = np.zeros(total, dtype=bool)
    for pos in pieces(shapes, tile, chunks, chunk):
        rows, length = pos.shape
        k, w = kept(length, density, chunks), _width(length)
        size = 4 * (1 + bins) if quantizer == "bins" else 4 * rows
        head = np.frombuffer(data[at : at + size], dtype="<f4")
        at += size
        index = []
        for _ in range(rows):
            index.append(_unpack(data[at : at + -(-k * w // 8)], k, w))
            at += -(-k * w // 8)
        for c in range(rows):
            codes = np.array(_unpack(data[at : at + -(-k * bits // 8)], k, bits))
            at += -(-k * bits // 8)
            assert all(b > a for a, b in zip(index[c], index[c][1:])) and max(index[c]) < length
            where = pos[c][index[c]]
            if quantizer == "bins":
                out[where] = (head[1:][codes] + head[0]).astype(np.float32)
            else:
                out[where] = _levels(codes, head[c], bits)
            sent[where] = True
    assert at == len(data), f"{len(data) - at} bytes left"
    return out, sent


def sender_mean(decoded: list[np.ndarray], sent: list[np.ndarray], weights: list[float]) -> np.ndarray:
    """Per index the weighted mean over the facilities that sent it (0 where none did), in float64."""
    num = sum(np.float64(w) * d.astype(np.float64) * s for d, s, w in zip(decoded, sent, weights))
    den = sum(np.float64(w) * s for s, w in zip(sent, weights))
    return np.where(den > 0, num / np.where(den > 0, den, 1), 0.0)


def topk_overrides(density: float, bits: int, decay: float, tile: int = TILE, chunks="tiles", quantizer="bins",
                   chunk: int = 4096) -> list[str]:  # fmt: skip
    """A job's overrides for ``compression=topk`` with these settings."""
    return ["federation.compression=topk", f"federation.topk.density={density}", f"federation.topk.bits={bits}",
            f"federation.topk.decay={decay}", f"federation.topk.tile={tile}", f"federation.topk.chunks={chunks}",
            f"federation.topk.quantizer={quantizer}", f"federation.chunk_size={chunk}"]  # fmt: skip


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
