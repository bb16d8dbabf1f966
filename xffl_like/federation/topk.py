"""Top-k with low-bit values and SparseLoCo's error feedback (``federation.compression=topk``).

SparseLoCo (Sarfi et al., arXiv 2508.15706) replaces DiLoCo's global outer momentum by a local
error-feedback accumulator per facility and sends only the largest entries of it:

    e <- decay * e + u          (u = theta_global - theta_f, this round's update; decay = beta)
    m  = C(e)                   (per chunk: the top-k entries by magnitude, quantized)
    e <- e - decode(m)          (what was not sent stays for later rounds)
    theta_global <- theta_global - outer.lr * sum_f w_f decode(m_f) / sum_f w_f

The accumulator plays the outer momentum's part, so the paper's outer rule is plain averaging of the
decoded messages at the outer learning rate (``federation.outer.name=average``); another outer rule
still runs on that mean, momentum on top of momentum.

The message (:class:`TopkCodec`) of a flat fp32 vector of ``numel`` values, cut into chunks of
``chunk_size`` values (the last one shorter), each chunk one row of bytes:

- ``k = ceil(density * length)`` values kept (``density`` read as the decimal it is written as, so
  ``0.3 * 10`` keeps 3, not 4): the ``k`` largest magnitudes, ties broken by the lowest index;
- a 4-byte header: the chunk's scale ``s`` (float32, little-endian, finite, >= 0);
- the ``k`` indices inside the chunk, ascending, ``ceil(log2(chunk_size))`` bits each (12 for 4096);
- the ``k`` value codes, ``bits`` each: a code ``c`` stands for ``(c - Q) * s`` with ``Q = 2**(bits-1) - 1``
  (levels ``-Q..Q``; the code ``2**bits - 1`` is never written). ``bits=2``: the levels ``-s, 0, s`` with
  ``s = max(median |v|, max |v| / 2)`` over the kept values (the lower median); ``bits=4, 8``:
  ``s = max |v| / Q``. A value's code is ``round(v / s)`` (half to even), clamped to ``-Q..Q``.

Both sections are little-endian bit streams (value ``j``'s bit ``b`` is bit ``(j * w + b) % 8`` of byte
``(j * w + b) // 8``), each padded to a whole byte. A full chunk of 4096 values at density 0.02 and 2 bits:
82 values, 4 + 123 + 21 = 148 bytes against 16384 in fp32 (110.7x smaller).

**Exact error feedback.** The level a kept value ``v`` is sent as is ``0`` or within a factor of two of
``v`` with its sign (that is what the floors on ``s`` guarantee: a clamped value is at most twice its
level), so ``v - level`` is exact in float32 (Sterbenz), and ``residual + decoded == accumulated`` holds
exactly for every value; the values not kept are left in the residual as they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from fractions import Fraction

import torch
from torch import Tensor

from ..distributed.compat import all_gather_single

__all__ = ["BITS", "MEANS", "TopkCodec", "TopkFold", "TopkMean", "fold_weights", "level_codes", "zero_code_shares"]

BITS = (2, 4, 8)
HEADER_BYTES = 4
_ROWS = 1024  # chunks encoded or decoded at a time (bounds the working memory)


def _keep(density: float, length: int) -> int:
    return min(length, math.ceil(Fraction(repr(float(density))) * length))


def _pack(values: Tensor, width: int) -> Tensor:
    """``[rows, n]`` non-negative integers below ``2**width`` -> ``[rows, ceil(n * width / 8)]`` uint8."""
    rows, n = values.shape
    shifts = torch.arange(width, device=values.device)
    bits = ((values.unsqueeze(-1) >> shifts) & 1).to(torch.uint8).view(rows, n * width)
    nbytes = -(-n * width // 8)
    padded = bits.new_zeros(rows, nbytes * 8)
    padded[:, : n * width] = bits
    weights = (1 << torch.arange(8, device=values.device)).to(torch.uint8)
    return (padded.view(rows, nbytes, 8) * weights).sum(-1, dtype=torch.uint8)


def _unpack(data: Tensor, n: int, width: int) -> Tensor:
    """The inverse of :func:`_pack`: ``[rows, nbytes]`` uint8 -> ``[rows, n]`` int64."""
    rows = data.shape[0]
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
    keep = above | (tied & (tied.cumsum(1) <= need))
    return keep.nonzero()[:, 1].view(rows, k)  # row-major: ascending inside each chunk


def level_codes(values: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """``quantizer=levels``: per row of the kept ``values`` ``[rows, k]``, the scale ``s`` (0 for a row of zeros)
    and the codes ``c`` (``[rows, k]``, ``0..2Q``) of the levels ``(c - Q) * s`` (the module's docstring)."""
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


class TopkCodec:
    """The top-k message of ``numel`` fp32 values: chunks of ``chunk_size`` values (the last one shorter),
    ``density`` of each kept, their values in ``bits`` bits (see the module's docstring for the bytes)."""

    def __init__(self, numel: int, chunk_size: int, density: float, bits: int):
        if numel < 0:
            raise ValueError(f"numel {numel} must be >= 0")
        if not 1 <= chunk_size <= 1 << 24:
            raise ValueError(f"chunk_size {chunk_size} out of range (1 .. 2**24)")
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density {density!r} must be in (0, 1]")
        if bits not in BITS:
            raise ValueError(f"bits {bits!r}: use 2, 4 or 8")
        self.numel, self.chunk_size, self.density, self.bits = numel, chunk_size, float(density), bits
        self.chunks = -(-numel // chunk_size)
        self.tail = numel - (self.chunks - 1) * chunk_size if self.chunks else 0  # the last chunk's length
        self.index_bits = max(1, (chunk_size - 1).bit_length())
        self.levels = (1 << (bits - 1)) - 1  # Q: the codes stand for -Q..Q times the scale

    # ------------------------------------------------------------------ sizes
    def keep(self, length: int) -> int:
        """Values kept of a chunk of ``length`` values."""
        return _keep(self.density, length)

    def row_bytes(self, length: int) -> int:
        """Bytes of a chunk of ``length`` values."""
        k = self.keep(length)
        return HEADER_BYTES + -(-k * self.index_bits // 8) + -(-k * self.bits // 8)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole message."""
        if not self.chunks:
            return 0
        return (self.chunks - 1) * self.row_bytes(self.chunk_size) + self.row_bytes(self.tail)

    def _blocks(self) -> Iterator[tuple[int, int, int]]:
        """``(first chunk, chunks, length)``: runs of chunks of the same length, at most ``_ROWS`` each."""
        full = self.chunks - 1 if self.tail < self.chunk_size else self.chunks
        for first in range(0, full, _ROWS):
            yield first, min(_ROWS, full - first), self.chunk_size
        if full < self.chunks:
            yield full, 1, self.tail

    # ------------------------------------------------------------------ encode
    def encode(self, update: Tensor) -> Tensor:
        """The message's bytes (flat uint8) of ``update`` (``numel`` fp32 values, finite)."""
        flat = update.reshape(-1)
        if flat.numel() != self.numel or flat.dtype != torch.float32:
            raise ValueError(
                f"top-k encode: {flat.numel()} {flat.dtype} values where the codec takes {self.numel} fp32"
            )
        out = []
        for first, rows, length in self._blocks():
            start = first * self.chunk_size
            out.append(self._encode_rows(flat[start : start + rows * length].view(rows, length), first))
        return torch.cat(out) if out else flat.new_empty(0, dtype=torch.uint8)

    def _encode_rows(self, x: Tensor, first: int) -> Tensor:
        rows, length = x.shape
        k = self.keep(length)
        mag = x.abs()
        finite = torch.isfinite(mag).all(1)
        if not finite.all():
            bad = first + int((~finite).nonzero()[0, 0])
            raise ValueError(f"top-k encode: chunk {bad} holds a non-finite value; the update must be finite")
        index = _top_index(mag, k)
        values = x.gather(1, index)
        scale, codes = level_codes(values, self.bits)
        header = scale.contiguous().view(torch.uint8).view(rows, HEADER_BYTES)
        return torch.cat([header, _pack(index, self.index_bits), _pack(codes, self.bits)], dim=1).view(-1)

    # ------------------------------------------------------------------ decode
    def _decode_rows(self, packed: Tensor, length: int, first: int) -> tuple[Tensor, Tensor]:
        """``[rows, row_bytes]`` -> (indices inside the chunk, values), both ``[rows, k]``; checked."""
        k = self.keep(length)
        index_bytes = -(-k * self.index_bits // 8)
        scale = packed[:, :HEADER_BYTES].reshape(-1).clone().view(torch.float32)
        if not (torch.isfinite(scale) & (scale >= 0)).all():
            bad = int((~(torch.isfinite(scale) & (scale >= 0))).nonzero()[0, 0])
            raise ValueError(
                f"top-k message: chunk {first + bad} has scale {float(scale[bad])!r}; a scale is finite and >= 0"
            )
        index = _unpack(packed[:, HEADER_BYTES : HEADER_BYTES + index_bytes], k, self.index_bits)
        codes = _unpack(packed[:, HEADER_BYTES + index_bytes :], k, self.bits)
        wrong = (index >= length).any(1)
        if k > 1:
            wrong |= (index[:, 1:] <= index[:, :-1]).any(1)
        if wrong.any():
            bad = first + int(wrong.nonzero()[0, 0])
            raise ValueError(
                f"top-k message: chunk {bad} has indices out of range (its {length} values) or not strictly "
                f"increasing (duplicated)"
            )
        if (codes > 2 * self.levels).any():
            bad = first + int((codes > 2 * self.levels).any(1).nonzero()[0, 0])
            raise ValueError(f"top-k message: chunk {bad} has a value code above {2 * self.levels} ({self.bits} bits)")
        values = (codes - self.levels).to(torch.float32) * scale.unsqueeze(1)
        return index, values

    def _rows(self, message: Tensor) -> Iterator[tuple[int, int, Tensor, Tensor]]:
        """``(start, length, indices, values)`` per block of chunks of ``message`` (flat uint8)."""
        flat = message.reshape(-1)
        if flat.dtype != torch.uint8 or flat.numel() != self.nbytes:
            raise ValueError(f"top-k message: {flat.numel()} {flat.dtype} bytes where the message has {self.nbytes}")
        offset = 0
        for first, rows, length in self._blocks():
            row = self.row_bytes(length)
            packed = flat[offset : offset + rows * row].view(rows, row)
            offset += rows * row
            index, values = self._decode_rows(packed, length, first)
            yield first * self.chunk_size, length, index, values

    def decode_sparse(self, message: Tensor) -> tuple[Tensor, Tensor]:
        """The message as (flat indices into the ``numel`` values, ascending; their fp32 values)."""
        indices, values = [], []
        for start, length, index, vals in self._rows(message):
            offsets = start + length * torch.arange(index.shape[0], device=index.device).unsqueeze(1)
            indices.append((index + offsets).view(-1))
            values.append(vals.view(-1))
        if not indices:
            return message.new_empty(0, dtype=torch.long), message.new_empty(0, dtype=torch.float32)
        return torch.cat(indices), torch.cat(values)

    def decode(self, message: Tensor) -> Tensor:
        """The values the message carries (flat fp32, ``numel`` values; zero where nothing was sent)."""
        index, values = self.decode_sparse(message)
        out = torch.zeros(self.numel, dtype=torch.float32, device=message.device)
        return out.index_put_((index,), values)

    def _read_rows(self, read: Callable[[int], bytes]) -> Iterator[tuple[int, int, Tensor, Tensor]]:
        """``(first chunk, length, indices, values)`` per block of chunks read from ``read(n)``; checked."""
        for first, rows, length in self._blocks():
            row = self.row_bytes(length)
            data = read(rows * row)
            if len(data) != rows * row:
                raise ValueError(f"top-k message: {len(data)} bytes where chunks {first}.. have {rows * row}")
            packed = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(rows, row)
            yield (first, length, *self._decode_rows(packed, length, first))

    def decode_stream(self, read: Callable[[int], bytes]) -> Iterator[tuple[int, Tensor]]:
        """(first value, values) decoded in order from ``read(n)`` (the message's bytes, as a file gives them)."""
        for first, length, index, values in self._read_rows(read):
            dense = torch.zeros(index.shape[0], length, dtype=torch.float32).scatter_(1, index, values)
            yield first * self.chunk_size, dense.view(-1)

    def decode_sent_stream(self, read: Callable[[int], bytes]) -> Iterator[tuple[int, Tensor, Tensor]]:
        """As :meth:`decode_stream`, with a mask of the values sent (``federation.topk.mean=senders``)."""
        for first, length, index, values in self._read_rows(read):
            dense = torch.zeros(index.shape[0], length, dtype=torch.float32).scatter_(1, index, values)
            sent = torch.zeros(index.shape[0], length, dtype=torch.bool).scatter_(1, index, True)
            yield first * self.chunk_size, dense.view(-1), sent.view(-1)

    def decode_sparse_stream(self, read: Callable[[int], bytes]) -> Iterator[tuple[Tensor, Tensor]]:
        """(flat indices, values) of the values sent, a block at a time from ``read(n)`` (for :class:`TopkFold`)."""
        for first, length, index, values in self._read_rows(read):
            start = first * self.chunk_size
            offsets = start + length * torch.arange(index.shape[0]).unsqueeze(1)
            yield (index + offsets).view(-1), values.view(-1)


MEANS = ("weighted", "senders")


def fold_weights(weights: list[float], mean: str) -> list[float]:
    """The weights :class:`TopkFold` takes: as given, except ``senders`` with equal weights, where every
    facility weighs 1 (the same mean, computed as SparseLoCo does: the sum over the senders over their count)."""
    if mean == "senders" and len({w for w in weights if w != 0}) == 1:
        return [1.0 if w != 0 else 0.0 for w in weights]
    return list(weights)


class TopkFold:
    """The mean over facilities of their top-k messages, one facility at a time (``federation.topk.mean``):
    the one function the one-world exchange and the hub both fold messages with.

    - ``weighted``: ``out = sum_f (w_f / total) decode(m_f)`` (a value not sent counts as 0);
    - ``senders`` (SparseLoCo): per index, the weighted mean over the facilities that sent it,
      ``sum_f w_f v_f / sum_f w_f`` over those ``f``; with equal weights ``w_f = 1`` it is
      ``(v_1 + ... + v_m) / m`` in facility order, as SparseLoCo's ``scatter_reduce(mean, include_self=False)``;
      an index nobody sent stays 0.

    ``out`` (flat fp32, zeroed by the caller) receives the mean; a facility of weight 0 is left out.
    """

    def __init__(self, out: Tensor, mean: str, total: float):
        if mean not in MEANS:
            raise ValueError(f"federation.topk.mean={mean!r}: use {' or '.join(MEANS)}")
        self.out, self.mean, self.total = out, mean, float(total)
        self.den = torch.zeros_like(out) if mean == "senders" else None

    @torch.no_grad()
    def add(self, index: Tensor, values: Tensor, weight: float) -> None:
        """Fold one facility's sent ``values`` at the flat ``index`` (unique), of weight ``weight``."""
        if weight == 0:
            return
        if self.den is None:
            self.out.index_add_(0, index, values, alpha=weight / self.total)
            return
        self.out.index_add_(0, index, values, alpha=weight)
        self.den.index_add_(0, index, torch.full_like(values, weight))

    @torch.no_grad()
    def finish(self) -> Tensor:
        """The mean (``out``)."""
        if self.den is not None:
            self.out.div_(torch.where(self.den > 0, self.den, torch.ones_like(self.den)))
            self.den = None
        return self.out


class TopkMean:
    """Weighted mean over ``n`` peers of their top-k messages, with SparseLoCo's error feedback.

    The exchange (one world): every peer all-gathers the others' fixed-size messages and decodes them
    all, summing ``scales[j] * decoded_j`` in peer order, so every facility holds the same fp32 mean.
    ``residual`` is the error-feedback accumulator ``e`` (checkpointed by the federation).
    """

    def __init__(
        self,
        numel: int,
        n: int,
        chunk_size: int,
        density: float,
        bits: int,
        decay: float,
        device: torch.device | str = "cpu",
        codec=None,
        mean: str = "weighted",
    ):
        """``codec``: the message's codec (:func:`.topk_tensors.make_codec`; None: :class:`TopkCodec` of
        ``chunk_size``, ``density``, ``bits``); ``mean``: :class:`TopkFold`'s rule."""
        self.codec = codec if codec is not None else TopkCodec(numel, chunk_size, density, bits)
        self.numel, self.n, self.decay, self.mean = numel, n, float(decay), mean
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device)
        #: Per message this rank encoded, in order: ``(kept values sent as a zero code, kept values)``.
        self.zero_codes: list[tuple[int, int]] = []

    @torch.no_grad()
    def prepare(self, update: Tensor) -> Tensor:
        """``e <- decay * e + update``; encode ``e``; ``e <- e - decoded``. Returns the message (flat uint8).
        Every copy of a facility may call it (same bytes and accumulator)."""
        acc = self.residual.mul_(self.decay).add_(update)
        message = self.codec.encode(acc)
        index, values = self.codec.decode_sparse(message)
        acc.index_put_((index,), acc[index] - values)  # exact: see the module's docstring
        self.zero_codes.append((int(values.numel() - torch.count_nonzero(values)), int(values.numel())))
        return message

    @torch.no_grad()
    def reduce(self, message: Tensor, group, me: int, scales: list[float]) -> tuple[Tensor, int]:
        """All-gather ``message`` among the peers of ``group`` (this peer is number ``me``) and return the
        :class:`TopkFold` of the decoded messages, peer ``j`` of weight ``scales[j]`` (flat fp32, identical on
        every peer) and the bytes this rank sent. A peer of weight 0 is left out."""
        if self.n == 1:
            gathered = message.view(1, -1)
        else:
            gathered = torch.empty(self.n * message.numel(), dtype=torch.uint8, device=message.device)
            all_gather_single(gathered, message.contiguous(), group=group)
            gathered = gathered.view(self.n, -1)
        fold = TopkFold(torch.zeros(self.numel, dtype=torch.float32, device=message.device), self.mean, 1.0)
        weights = fold_weights(scales, self.mean)
        for j in range(self.n):
            if weights[j] != 0:
                fold.add(*self.codec.decode_sparse(gathered[j]), weights[j])
        return fold.finish(), (self.n - 1) * message.nbytes


def zero_code_shares(counts: list[tuple[int, int]], state) -> list[list[float | None]]:
    """Per message (in the order this job encoded them) and per facility, the share of the kept values that
    were sent as a zero code (a slot that carries nothing), over every rank's shard of the facility's message.
    ``counts``: this rank's :attr:`TopkMean.zero_codes`; collective over the world (every rank encodes the same
    number of messages). A facility that sent no value has None."""
    import torch.distributed as dist

    table = torch.zeros(len(counts), state.num_facilities, 2, dtype=torch.float64, device=state.device)
    if counts:
        table[:, state.facility] = torch.tensor(counts, dtype=torch.float64, device=state.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table)
    return [[None if kept == 0 else zeros / kept for zeros, kept in row] for row in table.tolist()]
