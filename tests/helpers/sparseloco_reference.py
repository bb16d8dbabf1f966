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

import numpy as np

TILE, TOP_K, BINS, RANGE, BETA = 64, 128, 4, 6, 0.95


def smaller_split(n: int, close_to: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    below = [d for d in divisors if d <= close_to]
    return below[-1] if below else divisors[0]


def tile_positions(shape: tuple[int, ...]) -> np.ndarray:
    """``[chunks, len]``: the flat positions (inside the tensor) of each tile's values, row-major in the tile."""
    n = int(np.prod(shape))
    if len(shape) == 1:
        w = smaller_split(n, TILE)
        return np.arange(n).reshape(n // w, w)
    rows, cols = shape
    h, w = smaller_split(rows, TILE), smaller_split(cols, TILE)
    pos = np.arange(n).reshape(rows // h, h, cols // w, w).transpose(0, 2, 1, 3)
    return pos.reshape(-1, h * w)


def quantize(values: np.ndarray) -> np.ndarray:
    """The decoded values of a tensor's kept ``values`` (fp32) after SparseLoCo's 4-bin quantization."""
    v = values.astype(np.float32)
    shift = np.float32(v.astype(np.float64).mean())
    centred = (v - shift).astype(np.float32)
    n = centred.size
    std = np.float32(np.sqrt((centred.astype(np.float64) ** 2).sum()) / np.sqrt(n - 1)) if n > 1 else np.float32(0)
    scale = np.float32(RANGE * std / BINS)
    if scale == 0 or not np.isfinite(scale):
        scale = np.float32(1)
    codes = np.clip(np.rint(centred / scale + BINS // 2), 0, BINS - 1).astype(np.int64)
    lookup = np.zeros(BINS, dtype=np.float32)
    for b in range(BINS):
        if (codes == b).any():
            lookup[b] = np.float32(centred[codes == b].astype(np.float64).mean())
    return (lookup[codes] + shift).astype(np.float32)


def compress(e: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A tensor's accumulator ``e`` (flat fp32) -> (flat positions sent, their decoded values)."""
    pos = tile_positions(shape)
    k = int(max(1, round(pos.shape[1] * TOP_K / TILE**2)))
    idx = []
    for row in pos:
        mag = np.abs(e[row])
        order = np.argsort(-mag, kind="stable")[:k]  # the largest magnitudes (ties: the lowest position)
        idx.append(row[np.sort(order)])
    sent = np.concatenate(idx)
    return sent, quantize(e[sent])


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
