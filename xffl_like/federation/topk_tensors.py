"""The top-k message (``federation.compression=topk``): :class:`TensorCodec`, as SparseLoCo cuts and quantizes it by
default, or by flat chunks and symmetric levels (``federation.topk.chunks=flat``, ``quantizer=levels``).

SparseLoCo (``src/tplr/sparseloco.py``; Templar's ``src/tplr/compress.py``):

- **chunks** (``chunks=tiles``): a 2-D tensor ``[R, C]`` is cut into tiles of ``h x w`` values, a 1-D tensor of ``n``
  into runs of ``w``, where a side is the largest divisor of the dimension that is at most ``federation.topk.tile`` (64:
  64 x 64 tiles wherever the dimensions are multiples of 64). A tensor of more dimensions is read as ``[shape[0], the
  rest]``; a chunk never spans two tensors. In one world a tensor is this rank's shard of it (FSDP splits the rows), at
  the hub the whole tensor.
- **kept values**: ``k = max(1, round(density x length))`` of a chunk of ``length`` values (round half to even, as
  SparseLoCo's ``round(chunk_len * top_k / chunk_size**2)``: 128 of a 64 x 64 tile at density 0.03125; ``density``
  read as the decimal it is written as); the largest magnitudes, ties to the lowest index, sent in ascending order.
- **quantizer**: ``2**bits`` bins per tensor (4 at 2 bits) over all its kept values ``v``: ``shift = mean(v)``,
  ``s = 6 sigma / bins`` (sigma the unbiased standard deviation of ``v - shift``; ``s = 1`` where that is 0 or not
  finite), code ``c = clamp(round((v - shift) / s + bins // 2), 0, bins-1)`` (half to even); code ``c`` decodes to
  ``shift + lookup[c]``, ``lookup[c]`` the mean of the centred values of bin ``c`` (0 for an empty bin). ``shift``,
  sigma and ``lookup`` are summed in float64, then rounded to float32 once (so they do not depend on the order of
  the sums).

The other choices (issue 39 measured them better with 2 facilities at 960 steps, worse at 192 steps and with 4
facilities: docs/running.md, Top-k):

- ``chunks=flat``: chunks of ``federation.chunk_size`` values of the flat vector (the last one shorter), whatever
  the tensors; ``k = ceil(density x length)``. A "tensor" below is then a run of ``max(1, 2**20 // chunk_size)``
  full chunks (256 of 4096 values), the last run shorter, and the last chunk alone.
- ``quantizer=levels``: symmetric levels, one scale ``s`` per chunk (the header: every chunk's ``s``). A code ``c``
  stands for ``(c - Q) * s``, ``Q = 2**(bits-1) - 1`` (the code ``2**bits - 1`` is never written); at 2 bits the
  levels ``-s, 0, s`` with ``s = max(median |v|, max |v| / 2)`` over the chunk's kept values (the lower median),
  at 4 and 8 bits ``s = max |v| / Q``; ``c - Q = clamp(round(v / s), -Q, Q)`` (half to even). A decoded value is 0 or
  within a factor of two of ``v`` with its sign, so ``v - decoded`` is exact in float32 (Sterbenz) and the error
  feedback loses nothing.

A tensor's bytes (tensors in order): the header (``bins``: ``shift`` and the ``bins`` lookup values; ``levels``: every
chunk's scale; float32, little-endian), then per chunk its ``k`` indices inside the chunk (``ceil(log2(h x w))`` bits
each, 12 in a 64 x 64 tile), then per chunk its ``k`` codes (``bits`` each), each chunk's section a little-endian bit
stream (value ``j``'s bit ``b`` is bit ``(j * w + b) % 8`` of byte ``(j * w + b) // 8``) padded to a whole byte. A 64 x
64 tile at density 0.03125 and 2 bits: 128 values in 192 + 32 = 224 bytes against 16,384 in fp32 (73x smaller, plus 20
bytes per tensor). A flat chunk of 4096 values at density 0.02, levels and 2 bits: 82 values in 4 + 123 + 21 = 148 bytes
(110.7x smaller).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "BITS", "CHUNKS", "MAX_TILE", "QUANTIZERS", "TensorCodec", "TopkOptions", "level_codes", "options_of", "side"
]  # fmt: skip

BITS = (2, 4, 8)
CHUNKS = ("tiles", "flat")
QUANTIZERS = ("bins", "levels")
_BAND = 1 << 20  # values of a tensor cut into tiles and ranked at a time (bounds the working memory)
MAX_TILE = 4096  # a tile of at most 2**24 values: its indices in at most 24 bits
RANGE_SIGMAS = 6  # SparseLoCo's quantization_range


@dataclass(frozen=True)
class TopkOptions:
    """What a top-k message is (``federation.topk`` less the decay); both ends build the codec from it."""

    density: float
    bits: int
    tile: int = 64
    chunks: str = "tiles"
    quantizer: str = "bins"
    chunk_size: int = 4096  # chunks=flat: values per chunk (federation.chunk_size)

    def __post_init__(self):
        if self.bits not in BITS or not 0.0 < self.density <= 1.0 or not 1 <= self.tile <= MAX_TILE:
            raise ValueError(f"top-k options {self}: bits 2|4|8, density in (0, 1], tile in 1..{MAX_TILE}")
        if self.chunks not in CHUNKS or self.quantizer not in QUANTIZERS or not 1 <= self.chunk_size <= 1 << 24:
            raise ValueError(f"top-k options {self}: chunks tiles|flat, quantizer bins|levels, chunk_size 1..2**24")


def options_of(topk, chunk_size: int) -> TopkOptions:
    """The :class:`TopkOptions` of the ``federation.topk`` section (``chunk_size``: ``federation.chunk_size``)."""
    return TopkOptions(
        float(topk.density), int(topk.bits), int(topk.tile), topk.chunks, topk.quantizer, int(chunk_size)
    )


_ROWS = 1024  # rows packed or unpacked at a time (their bits are 64-bit integers while they are)


def _pack(values: Tensor, width: int) -> Tensor:
    """``[rows, n]`` non-negative integers below ``2**width`` -> ``[rows, ceil(n * width / 8)]`` uint8 (each row
    padded to a byte on its own)."""
    return torch.cat([_pack_rows(values[r : r + _ROWS], width) for r in range(0, max(1, len(values)), _ROWS)])


def _unpack(data: Tensor, n: int, width: int) -> Tensor:
    """The inverse of :func:`_pack`: ``[rows, nbytes]`` uint8 -> ``[rows, n]`` int64."""
    return torch.cat([_unpack_rows(data[r : r + _ROWS], n, width) for r in range(0, max(1, len(data)), _ROWS)])


def _pack_rows(values: Tensor, width: int) -> Tensor:
    rows, n = values.shape
    if values.device.type == "cpu":  # numpy's packbits: bits as bytes, not 64-bit integers
        v = values.numpy()
        bits = np.zeros((rows, -(-n * width // 8) * 8), dtype=np.uint8)
        for b in range(width):
            bits[:, b : n * width : width] = (v >> b) & 1
        return torch.from_numpy(np.packbits(bits, axis=1, bitorder="little"))
    shifts = torch.arange(width, device=values.device)
    bits = ((values.unsqueeze(-1) >> shifts) & 1).to(torch.uint8).view(rows, n * width)
    nbytes = -(-n * width // 8)
    padded = bits.new_zeros(rows, nbytes * 8)
    padded[:, : n * width] = bits
    weights = (1 << torch.arange(8, device=values.device)).to(torch.uint8)
    return (padded.view(rows, nbytes, 8) * weights).sum(-1, dtype=torch.uint8)


def _unpack_rows(data: Tensor, n: int, width: int) -> Tensor:
    rows = data.shape[0]
    if data.device.type == "cpu":
        bits = np.unpackbits(data.numpy(), axis=1, bitorder="little")
        out = np.zeros((rows, n), dtype=np.int64)
        for b in range(width):
            out |= bits[:, b : n * width : width].astype(np.int64) << b
        return torch.from_numpy(out)
    bits = (data.unsqueeze(-1).long() >> torch.arange(8, device=data.device)) & 1
    bits = bits.view(rows, -1)[:, : n * width].view(rows, n, width)
    return (bits << torch.arange(width, device=data.device)).sum(-1)


def _top_index(mag: Tensor, k: int) -> Tensor:
    """``[rows, k]``: per row of ``mag`` the indices of its ``k`` largest values, ascending (ties: the lowest
    indices)."""
    rows, length = mag.shape
    if k == length:
        return torch.arange(length, device=mag.device).expand(rows, length)
    # The k-th largest magnitude; every larger one is kept, then equal ones from the lowest index.
    kth = torch.topk(mag, k, dim=1, sorted=False).values.amin(1, keepdim=True)
    above = mag > kth
    tied = mag == kth
    need = k - above.sum(1, keepdim=True)
    if bool((tied.sum(1, keepdim=True) > need).any()):  # more ties than room somewhere: the lowest indices
        keep = above | (tied & (tied.cumsum(1) <= need))
    else:
        keep = above | tied
    return keep.nonzero()[:, 1].view(rows, k)  # row-major: ascending inside each chunk


def side(n: int, tile: int) -> int:
    """The largest divisor of ``n`` that is at most ``tile`` (SparseLoCo's ``_get_smaller_split``)."""
    return max(d for d in range(1, min(n, tile) + 1) if n % d == 0)


@dataclass(frozen=True)
class Block:
    """``rows x cols`` values from ``offset`` of the flat vector, cut into ``h x w`` tiles (row-major)."""

    offset: int
    rows: int
    cols: int
    h: int
    w: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def chunks(self) -> int:
        return (self.rows // self.h) * (self.cols // self.w)

    @property
    def length(self) -> int:
        return self.h * self.w

    def bands(self, flat: Tensor) -> Iterator[Tensor]:
        """This block's values of ``flat`` (the whole vector) as ``[chunks, length]`` tiles, in order, a band of
        whole rows of tiles (about :data:`_BAND` values) at a time."""
        y, xs, row = self.rows // self.h, self.cols // self.w, self.h * self.cols
        per = max(1, _BAND // row)
        for first in range(0, y, per):
            n = min(per, y - first)
            x = flat[self.offset + first * row : self.offset + (first + n) * row]
            yield x.view(n, self.h, xs, self.w).permute(0, 2, 1, 3).reshape(n * xs, self.length)

    def flat_index(self, index: Tensor) -> Tensor:
        """``[chunks, k]`` indices inside the chunks -> flat indices into the whole vector."""
        xs = self.cols // self.w
        c = torch.arange(self.chunks, device=index.device).unsqueeze(1)
        row = (c // xs) * self.h + index // self.w
        col = (c % xs) * self.w + index % self.w
        return self.offset + row * self.cols + col


def _flat_blocks(numel: int, chunk: int) -> list[Block]:
    """``chunks=flat``: runs of full chunks of ``chunk`` values (about :data:`_BAND` values each), then the last
    chunk, shorter, alone."""
    full, tail = divmod(numel, chunk)
    run = max(1, _BAND // chunk)
    out = [Block(first * chunk, min(run, full - first), chunk, 1, chunk) for first in range(0, full, run)]
    return out + ([Block(full * chunk, 1, tail, 1, tail)] if tail else [])


def _blocks(numel: int, opts: TopkOptions, shapes: Sequence[Sequence[int]] | None) -> list[Block]:
    if opts.chunks == "flat":
        return _flat_blocks(numel, opts.chunk_size)
    shapes = shapes or []
    if sum(math.prod(s) for s in shapes) != numel:
        raise ValueError(f"top-k: the tensors' shapes must cover the {numel} values")
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        if n:
            rows = shape[0] if len(shape) > 1 else 1
            out.append(Block(offset, rows, n // rows, side(rows, opts.tile), side(n // rows, opts.tile)))
        offset += n
    return out


def _bins_encode(values: Tensor, bins: int) -> tuple[Tensor, Tensor]:
    """The quantizer over all of a tensor's kept ``values``: (header ``[shift, lookup...]``, codes). The
    statistics are summed in float64 and rounded once to float32, so they do not depend on the order of the sums
    (a reference in numpy finds the same bits)."""
    v = values.reshape(-1)
    shift = v.double().mean().float()
    centred = v - shift
    n = v.numel()
    std = (centred.double().square().sum().sqrt() / math.sqrt(n - 1)).float() if n > 1 else centred.new_zeros(())
    scale = RANGE_SIGMAS * std / bins
    if not (torch.isfinite(scale) and scale != 0):
        scale = torch.ones((), dtype=v.dtype, device=v.device)
    codes = (centred / scale + bins // 2).round().clamp(0, bins - 1).long()
    sums = torch.zeros(bins, dtype=torch.float64, device=v.device).scatter_add_(0, codes, centred.double())
    counts = torch.bincount(codes, minlength=bins).double()
    lookup = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0).float()
    return torch.cat([shift.view(1), lookup]), codes.view(values.shape)


def level_codes(values: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """``quantizer=levels``: per row (chunk) of the kept ``values`` ``[rows, k]``, the scale ``s`` (0 for a row of
    zeros) and the codes ``c`` (``[rows, k]``, ``0..2Q``) of the levels ``(c - Q) * s`` (the module's docstring)."""
    levels = (1 << (bits - 1)) - 1
    mag = values.abs()
    top = mag.amax(1)
    if bits == 2:
        median = mag.sort(dim=1).values[:, (mag.shape[1] - 1) // 2]
        scale = torch.maximum(median, top / 2)
    else:
        scale = top / levels
    # A subnormal top can make the division underflow: the smallest subnormal keeps the levels exact.
    tiny = torch.full_like(scale, torch.finfo(torch.float32).smallest_normal * 2.0**-23)
    scale = torch.where((scale == 0) & (top > 0), tiny, scale)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)
    q = torch.round(values / safe).clamp_(-levels, levels)
    return scale, q.long() + levels  # a chunk of zeros: scale 0, every code Q (the level 0)


class TensorCodec:
    """The top-k message of ``numel`` fp32 values by tensor (``shapes``, in order; see the module's docstring for the
    bytes)."""

    def __init__(
        self,
        numel: int,
        opts: TopkOptions,
        shapes: Sequence[Sequence[int]] | None = None,
        blocks: list[Block] | None = None,
    ):
        """``blocks``: the blocks themselves (:meth:`part`), instead of cutting them from ``shapes``."""
        self.numel, self.opts, self.bits = numel, opts, opts.bits
        self.blocks = blocks if blocks is not None else _blocks(numel, opts, shapes)
        self.bins = 1 << opts.bits if opts.quantizer == "bins" else 0
        self.levels = (1 << (opts.bits - 1)) - 1  # quantizer=levels: Q
        self.nbytes = sum(self._sizes(b)[3] for b in self.blocks)

    def keep(self, length: int) -> int:
        """Values kept of a chunk of ``length`` values."""
        kept = Fraction(repr(float(self.opts.density))) * length
        return max(1, min(length, math.ceil(kept) if self.opts.chunks == "flat" else round(kept)))

    def _sizes(self, b: Block) -> tuple[int, int, int, int]:
        """(k, header bytes, index bytes per chunk, block bytes) of block ``b``."""
        k = self.keep(b.length)
        head = 4 * (1 + self.bins) if self.bins else 4 * b.chunks
        ib, cb = -(-k * _width(b.length) // 8), -(-k * self.bits // 8)
        return k, head, ib, head + b.chunks * (ib + cb)

    # ------------------------------------------------------------------ windows
    def windows(self, about: int) -> list[tuple[int, int]]:
        """``(start, numel)`` of consecutive windows of whole tensors (blocks) covering the ``numel`` values: as many
        tensors as fit in ``about`` values, a larger tensor alone. A tensor's bytes depend on its values alone (its
        tiles, its bins), so the message is the concatenation of its windows' messages (:meth:`part`)."""
        out, start, end = [], 0, 0
        for b in self.blocks:
            stop = b.offset + b.numel
            if end > start and stop - start > about:
                out.append((start, end - start))
                start = end
            end = stop
        out.append((start, self.numel - start))  # the last one, through the empty tensors after it
        return [w for w in out if w[1] > 0]

    def part(self, start: int, numel: int) -> TensorCodec:
        """The codec of ``numel`` values from ``start``, a run of whole tensors (a window of :meth:`windows`): its
        message is the whole message's bytes there."""
        stop = start + numel
        if any(b.offset < start < b.offset + b.numel or b.offset < stop < b.offset + b.numel for b in self.blocks):
            raise ValueError(f"top-k window of {numel} values from {start} cuts a tensor: use the codec's windows")
        inside = [replace(b, offset=b.offset - start) for b in self.blocks if start <= b.offset < stop]
        return TensorCodec(numel, self.opts, blocks=inside)

    # ------------------------------------------------------------------ encode
    def encode(self, update: Tensor) -> Tensor:
        """The message's bytes (flat uint8) of ``update`` (``numel`` fp32 values, finite)."""
        flat = update.reshape(-1)
        if flat.numel() != self.numel or flat.dtype != torch.float32:
            raise ValueError(
                f"top-k encode: {flat.numel()} {flat.dtype} values where the codec takes {self.numel} fp32"
            )
        out = [self._encode_block(flat, b) for b in self.blocks]
        return torch.cat(out) if out else flat.new_empty(0, dtype=torch.uint8)

    def _encode_block(self, flat: Tensor, b: Block) -> Tensor:
        """Block ``b``'s bytes: its tiles ranked a band at a time, then its kept values quantized."""
        k, indices, kept = self._sizes(b)[0], [], []
        for x in b.bands(flat):
            if not torch.isfinite(x).all():
                bad = int((~torch.isfinite(flat[b.offset : b.offset + b.numel])).nonzero()[0, 0]) + b.offset
                raise ValueError(f"top-k encode: value {bad} is not finite; the update must be finite")
            indices.append(_top_index(x.abs(), k))
            kept.append(x.gather(1, indices[-1]))
        index, kept = torch.cat(indices), torch.cat(kept)
        header, codes = _bins_encode(kept, self.bins) if self.bins else level_codes(kept, self.bits)
        head = header.contiguous().view(torch.uint8).view(-1)
        return torch.cat([head, _pack(index, _width(b.length)).view(-1), _pack(codes, self.bits).view(-1)])

    # ------------------------------------------------------------------ decode
    def _decode_block(self, data: Tensor, b: Block, t: int) -> tuple[Tensor, Tensor]:
        """Block ``t``'s bytes -> (flat indices, fp32 values); checked before use."""
        k, head, ib, _ = self._sizes(b)
        header = data[:head].clone().view(torch.float32)
        if self.bins:
            levels = header[1:] + header[0]  # every value the tensor decodes to: all finite, or the message is refused
            if not (torch.isfinite(header).all() and torch.isfinite(levels).all()):
                raise ValueError(f"top-k message: tensor {t}'s header holds a non-finite value")
        elif not (torch.isfinite(header) & (header >= 0)).all():
            raise ValueError(f"top-k message: tensor {t}'s header holds a scale that is negative or not finite")
        index = _unpack(data[head : head + b.chunks * ib].view(b.chunks, ib), k, _width(b.length))
        codes = _unpack(data[head + b.chunks * ib :].view(b.chunks, -1), k, self.bits)
        wrong = (index >= b.length).any() or (k > 1 and bool((index[:, 1:] <= index[:, :-1]).any()))
        if wrong:
            raise ValueError(
                f"top-k message: tensor {t} has indices out of range (its {b.length}-value chunks) or not strictly "
                f"increasing (duplicated)"
            )
        if self.bins:
            return b.flat_index(index).view(-1), levels[codes].view(-1)
        if (codes > 2 * self.levels).any():
            raise ValueError(f"top-k message: tensor {t} has a value code above {2 * self.levels} ({self.bits} bits)")
        values = (codes - self.levels).to(torch.float32) * header.unsqueeze(1)
        return b.flat_index(index).view(-1), values.view(-1)

    def _read(self, read: Callable[[int], bytes]) -> Iterator[tuple[Block, Tensor, Tensor]]:
        for t, b in enumerate(self.blocks):
            size = self._sizes(b)[3]
            data = read(size)
            if len(data) != size:
                raise ValueError(f"top-k message: {len(data)} bytes where tensor {t} has {size}")
            yield (b, *self._decode_block(torch.frombuffer(bytearray(data), dtype=torch.uint8), b, t))

    def decode_sparse_stream(self, read: Callable[[int], bytes]) -> Iterator[tuple[Tensor, Tensor]]:
        """(flat indices, values) of the values sent, a tensor at a time from ``read(n)``."""
        for _, index, values in self._read(read):
            yield index, values

    def decode_stream(self, read: Callable[[int], bytes]) -> Iterator[tuple[int, Tensor]]:
        """(first value, values) decoded in order from ``read(n)``, a tensor at a time."""
        for b, index, values in self._read(read):
            dense = torch.zeros(b.numel, dtype=torch.float32)
            yield b.offset, dense.index_put_((index - b.offset,), values)

    def decode_sent_stream(self, read: Callable[[int], bytes]) -> Iterator[tuple[int, int, Tensor, Tensor]]:
        """A tensor at a time from ``read(n)``: its first value, its values, and the flat indices of the values sent
        (ascending) with their values (the per-index mean over the senders folds only these). Every value is
        finite: a message whose header decodes to one that is not is refused (ValueError)."""
        for b, index, values in self._read(read):
            index, order = index.sort()
            yield b.offset, b.numel, index, values[order]

    def decode_sparse(self, message: Tensor) -> tuple[Tensor, Tensor]:
        """The message as (flat indices into the ``numel`` values; their fp32 values)."""
        flat = message.reshape(-1)
        if flat.dtype != torch.uint8 or flat.numel() != self.nbytes:
            raise ValueError(f"top-k message: {flat.numel()} {flat.dtype} bytes where the message has {self.nbytes}")
        data = bytes(flat.cpu().numpy())
        at = [0]

        def read(n: int) -> bytes:
            at[0] += n
            return data[at[0] - n : at[0]]

        pieces = list(self.decode_sparse_stream(read))
        if not pieces:
            return message.new_empty(0, dtype=torch.long), message.new_empty(0, dtype=torch.float32)
        device = message.device
        return torch.cat([i for i, _ in pieces]).to(device), torch.cat([v for _, v in pieces]).to(device)

    def decode(self, message: Tensor) -> Tensor:
        """The values the message carries (flat fp32, ``numel`` values; zero where nothing was sent)."""
        index, values = self.decode_sparse(message)
        out = torch.zeros(self.numel, dtype=torch.float32, device=message.device)
        return out.index_put_((index,), values)


def _width(length: int) -> int:
    return max(1, (length - 1).bit_length())
