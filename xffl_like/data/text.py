"""Byte-level text corpus split across facilities and ranks.

Layout of the concatenated corpus (``N`` bytes, files joined in the order given)::

    [0, n_train)   training part, split across facilities (``partition``), then each
                   facility's share into ``facility_size`` contiguous sub-slices (one per rank)
    [n_train, N)   held-out tail, ``n_eval = max(floor(N * eval_fraction), seq_len + 1)`` bytes

``contiguous``: facility ``f`` owns ``[f * n_train // F, (f + 1) * n_train // F)``.
``interleaved``: the training part is cut into ``block_size`` (64 KiB) blocks and block ``j``
goes to facility ``j % F``; the facility's blocks, in corpus order, form its share.
The share (a list of corpus segments) is then cut into ``facility_size`` contiguous
pieces of (almost) equal byte count, piece ``r`` for ``facility_rank`` ``r``.

A training window is ``seq_len + 1`` consecutive corpus bytes that lie inside a single
segment of the rank's share (never across a block junction, never outside the share);
the start is uniform over all such windows, drawn with a generator seeded by
``(seed, facility, facility_rank, step)``.

Eval windows are evenly spaced, deterministic windows of the held-out tail.  When the
tail holds at least one window per rank it is cut into ``facility_size`` disjoint
pieces (piece ``r`` for rank ``r``); otherwise every rank uses the whole tail.  The eval
set does not depend on the facility, so losses are comparable across facilities.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..config.checks import is_int, is_number, not_regular
from ..config.errors import ConfigError
from ..config.schema import DataConfig
from .source import (
    check_num_eval_batches,
    check_positive_int,
    make_generator,
    resolve_paths,
)

__all__ = [
    "BYTE_VOCAB_SIZE",
    "DEFAULT_BLOCK_SIZE",
    "PARTITIONS",
    "TextByteSource",
    "encode",
    "decode",
    "load_corpus",
    "split_sizes",
    "facility_segments",
    "rank_segments",
    "eval_range",
    "validate_text",
    "build_text",
]

BYTE_VOCAB_SIZE = 256
DEFAULT_BLOCK_SIZE = 64 * 1024
PARTITIONS = ("contiguous", "interleaved")
_TAG_TRAIN = 0x5458

Segment = tuple[int, int]


# --------------------------------------------------------------------------- tokenizer
def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-D LongTensor of values in 0..255."""
    data = text.encode("utf-8")
    if not data:
        return torch.zeros(0, dtype=torch.long)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)


def decode(tokens: Any) -> str:
    """Inverse of :func:`encode` (any int sequence / tensor); invalid UTF-8 becomes U+FFFD."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.reshape(-1).tolist()
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- config checks
def _fix_path() -> str:
    return "pass data.path=<existing UTF-8 text file>"


def _check_eval_fraction(cfg_data: DataConfig) -> float:
    value = cfg_data.eval_fraction
    ok = is_number(value)
    if ok:
        value = float(value)
        ok = math.isfinite(value) and 0.0 < value < 1.0
    if not ok:
        raise ConfigError(
            f"data.eval_fraction: must be a number strictly between 0 and 1, got {value!r} "
            "(pass e.g. data.eval_fraction=0.1)"
        )
    return value


def _check_partition(cfg_data: DataConfig) -> str:
    value = cfg_data.partition
    if value not in PARTITIONS:
        raise ConfigError(
            f"data.partition: unknown partition {value!r} "
            "(pass data.partition=contiguous or data.partition=interleaved)"
        )
    return str(value)


def _check_block_size(cfg_data: DataConfig) -> int:
    return check_positive_int(
        cfg_data.block_size,
        "data.block_size",
        f"pass e.g. data.block_size={DEFAULT_BLOCK_SIZE} or drop the key",
    )


def _check_vocab(vocab_size: Any) -> None:
    if not is_int(vocab_size) or vocab_size < BYTE_VOCAB_SIZE:
        raise ConfigError(
            f"vocab_size: {vocab_size!r} is smaller than {BYTE_VOCAB_SIZE}, the vocabulary of the byte "
            f"tokenizer used by data.name=text (set the model's vocab_size to at least {BYTE_VOCAB_SIZE})"
        )


def load_corpus(paths: Sequence[Path]) -> bytes:
    """Concatenated bytes of ``paths``; each must exist, be non-empty and be valid UTF-8."""
    chunks: list[bytes] = []
    for p in paths:
        if not p.exists():
            raise ConfigError(f"data.path: file not found: {p} ({_fix_path()})")
        kind = not_regular(p)
        if kind is not None or not p.is_file():
            raise ConfigError(f"data.path: not a regular file: {p} is {kind or 'not a regular file'} ({_fix_path()})")
        try:
            data = p.read_bytes()
        except OSError as exc:
            raise ConfigError(f"data.path: cannot read {p}: {exc.strerror or exc} ({_fix_path()})") from None
        if not data:
            raise ConfigError(f"data.path: file is empty: {p} (pass data.path=<non-empty UTF-8 text file>)")
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"data.path: file is not valid UTF-8 text: {p} (invalid byte at offset {exc.start}; "
                "pass data.path=<UTF-8 text file> or convert it, e.g. with iconv)"
            ) from None
        chunks.append(data)
    return b"".join(chunks)


def split_sizes(num_bytes: int, eval_fraction: float, seq_len: int) -> tuple[int, int]:
    """``(n_train, n_eval)``: the held-out tail has ``max(floor(N * eval_fraction), seq_len + 1)`` bytes."""
    n_eval = max(int(math.floor(num_bytes * eval_fraction)), seq_len + 1)
    return num_bytes - n_eval, n_eval


def _check_length(num_bytes: int, eval_fraction: float, seq_len: int, paths: Sequence[Path]) -> tuple[int, int]:
    n_train, n_eval = split_sizes(num_bytes, eval_fraction, seq_len)
    if n_train < seq_len + 1:
        where = str(paths[0]) if len(paths) == 1 else f"{len(paths)} files"
        raise ConfigError(
            f"data.path: corpus {where} has {num_bytes} bytes, too short for seq_len={seq_len} with "
            f"eval_fraction={eval_fraction} (the training part left after the {n_eval}-byte held-out tail "
            f"has {max(n_train, 0)} bytes, fewer than seq_len+1={seq_len + 1}); pass a longer text file "
            "or a smaller seq_len"
        )
    return n_train, n_eval


def tokenize_corpus(corpus: bytes, spec: Any) -> bytes | torch.Tensor:
    """``corpus`` itself for ``data.tokenizer=byte``, else its token ids (int32) under that tokenizer."""
    if spec in (None, "byte"):
        return corpus
    from .tokenizer import load_tokenizer

    return torch.tensor(load_tokenizer(spec).encode(corpus.decode("utf-8")), dtype=torch.int32)


def _check_tokenizer_vocab(cfg_data: DataConfig, vocab_size: int) -> None:
    spec = cfg_data.tokenizer
    if spec in (None, "byte"):
        _check_vocab(vocab_size)
        return
    from .tokenizer import load_tokenizer

    tok = load_tokenizer(spec)
    if not is_int(vocab_size) or vocab_size < tok.vocab_size:
        raise ConfigError(
            f"model.vocab_size={vocab_size!r} is smaller than the vocabulary of data.tokenizer "
            f"({tok.vocab_size}, {tok.name}): raise model.vocab_size or use the model's own tokenizer"
        )


def validate_text(
    cfg_data: DataConfig, *, vocab_size: int, seq_len: int, base_dir: str | os.PathLike | None = None
) -> int:
    """Check the config and the corpus; return the corpus length in tokens."""
    _check_tokenizer_vocab(cfg_data, vocab_size)
    check_positive_int(seq_len, "seq_len", "set a positive sequence length")
    check_num_eval_batches(cfg_data)
    frac = _check_eval_fraction(cfg_data)
    _check_partition(cfg_data)
    _check_block_size(cfg_data)
    paths = resolve_paths(cfg_data, base_dir)
    corpus = tokenize_corpus(load_corpus(paths), cfg_data.tokenizer)
    _check_length(len(corpus), frac, seq_len, paths)
    return len(corpus)


# --------------------------------------------------------------------------- partitioning
def facility_segments(
    n_train: int, num_facilities: int, facility: int, partition: str, block_size: int = DEFAULT_BLOCK_SIZE
) -> list[Segment]:
    """Corpus byte ranges (in order) owned by ``facility``."""
    if partition == "contiguous":
        lo = facility * n_train // num_facilities
        hi = (facility + 1) * n_train // num_facilities
        return [(lo, hi)] if hi > lo else []
    if partition == "interleaved":
        n_blocks = -(-n_train // block_size)
        return [(j * block_size, min((j + 1) * block_size, n_train)) for j in range(facility, n_blocks, num_facilities)]
    raise ConfigError(
        f"data.partition: unknown partition {partition!r} (pass data.partition=contiguous or interleaved)"
    )


def rank_segments(segments: Sequence[Segment], facility_size: int, facility_rank: int) -> list[Segment]:
    """Piece ``facility_rank`` of ``facility_size`` contiguous pieces of the virtual stream ``segments``."""
    total = sum(b - a for a, b in segments)
    lo = facility_rank * total // facility_size
    hi = (facility_rank + 1) * total // facility_size
    out: list[Segment] = []
    pos = 0  # virtual offset of the current segment's start
    for a, b in segments:
        length = b - a
        s, e = max(lo, pos), min(hi, pos + length)
        if e > s:
            out.append((a + s - pos, a + e - pos))
        pos += length
        if pos >= hi:
            break
    return out


def eval_range(n_train: int, n_eval: int, seq_len: int, facility_size: int, facility_rank: int) -> tuple[Segment, bool]:
    """``((start, end), disjoint)``: the rank's share of the held-out tail, or the whole tail if too small."""
    if n_eval // facility_size >= seq_len + 1:
        lo = n_train + facility_rank * n_eval // facility_size
        hi = n_train + (facility_rank + 1) * n_eval // facility_size
        return (lo, hi), True
    return (n_train, n_train + n_eval), False


def _corpus_tensor(corpus: bytes | torch.Tensor) -> torch.Tensor:
    """``corpus`` as a tensor: token ids as they are (a tokenizer's output, a memory-mapped corpus), bytes as uint8."""
    if isinstance(corpus, torch.Tensor):
        return corpus
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8) if corpus else torch.zeros(0, dtype=torch.uint8)


# --------------------------------------------------------------------------- the source
class TextByteSource:
    """Rank ``facility_rank`` of facility ``facility``'s view of a byte-tokenized corpus.

    Introspection (all in corpus byte offsets): ``train_segments``, ``eval_segment``,
    ``eval_disjoint``, ``n_train``, ``n_eval``, :meth:`window_offsets`, :meth:`eval_offsets`.
    """

    def __init__(
        self,
        corpus: bytes | torch.Tensor,
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        facility: int,
        num_facilities: int,
        facility_rank: int,
        facility_size: int,
        eval_fraction: float,
        num_eval_batches: int,
        partition: str = "contiguous",
        block_size: int = DEFAULT_BLOCK_SIZE,
        paths: Sequence[Path] = (),
    ) -> None:
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.facility = int(facility)
        self.num_facilities = int(num_facilities)
        self.facility_rank = int(facility_rank)
        self.facility_size = int(facility_size)
        self.partition = partition
        self.block_size = int(block_size)
        self.num_eval_batches = int(num_eval_batches)
        self.paths = list(paths)
        self.vocab_size = BYTE_VOCAB_SIZE

        self.corpus = _corpus_tensor(corpus)
        n = len(self.corpus)
        self.n_train, self.n_eval = _check_length(n, eval_fraction, self.seq_len, self.paths or [Path("<bytes>")])
        fac = facility_segments(self.n_train, self.num_facilities, self.facility, partition, self.block_size)
        self.train_segments = rank_segments(fac, self.facility_size, self.facility_rank)
        self._index_windows()
        self.eval_segment, self.eval_disjoint = eval_range(
            self.n_train, self.n_eval, self.seq_len, self.facility_size, self.facility_rank
        )
        self._eval_cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _index_windows(self) -> None:
        """Index the training windows: the segments that hold at least one, and their number of valid starts."""
        window = self.seq_len + 1
        usable = [(a, b) for a, b in self.train_segments if b - a >= window]
        if not usable:
            share = sum(b - a for a, b in self.train_segments)
            raise ConfigError(
                f"data.path: the {self.n_train}-byte training part split over {self.num_facilities} facilities "
                f"({self.partition}) and {self.facility_size} ranks leaves facility {self.facility} rank "
                f"{self.facility_rank} with {share} bytes and no run of seq_len+1={window} contiguous bytes; "
                "pass a longer text file, a smaller seq_len, fewer facilities/ranks"
                + (" or data.partition=contiguous" if self.partition == "interleaved" else "")
            )
        self._seg_start = torch.tensor([a for a, _ in usable], dtype=torch.long)
        counts = torch.tensor([b - a - window + 1 for a, b in usable], dtype=torch.long)
        self._cum_counts = counts.cumsum(0)
        self._num_windows = int(self._cum_counts[-1])
        self._arange = torch.arange(window, dtype=torch.long)

    # ------------------------------------------------------------------ offsets
    def window_offsets(self, step: int) -> torch.Tensor:
        """Corpus start offsets ``[B]`` of the windows of :meth:`train_batch` ``(step)``."""
        gen = make_generator(self.seed, _TAG_TRAIN, self.facility, self.facility_rank, int(step))
        u = torch.randint(0, self._num_windows, (self.batch_size,), generator=gen, dtype=torch.long)
        seg = torch.searchsorted(self._cum_counts, u, right=True)
        before = torch.where(seg > 0, self._cum_counts[(seg - 1).clamp_min(0)], torch.zeros_like(seg))
        return self._seg_start[seg] + (u - before)

    def eval_offsets(self) -> torch.Tensor:
        """Corpus start offsets ``[num_eval_batches * B]`` of the eval windows (evenly spaced)."""
        lo, hi = self.eval_segment
        last = hi - (self.seq_len + 1)
        n = self.num_eval_batches * self.batch_size
        if n == 1:
            return torch.tensor([lo], dtype=torch.long)
        return lo + (torch.arange(n, dtype=torch.long) * (last - lo)) // (n - 1)

    def _windows(self, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq = self.corpus[offsets[:, None] + self._arange].to(torch.long)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    # ------------------------------------------------------------------ DataSource
    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._windows(self.window_offsets(step))

    def eval_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._eval_cache is None:
            x, y = self._windows(self.eval_offsets())
            b = self.batch_size
            self._eval_cache = [(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b]) for i in range(self.num_eval_batches)]
        return [(x.clone(), y.clone()) for x, y in self._eval_cache]

    def __repr__(self) -> str:
        return (
            f"TextByteSource(bytes={self.corpus.numel()}, n_train={self.n_train}, n_eval={self.n_eval}, "
            f"facility={self.facility}/{self.num_facilities}, rank={self.facility_rank}/{self.facility_size}, "
            f"partition={self.partition}, train_segments={len(self.train_segments)}, eval={self.eval_segment})"
        )


def build_text(
    cfg_data: DataConfig,
    *,
    vocab_size: int,
    seq_len: int,
    batch_size: int,
    seed: int,
    facility: int,
    num_facilities: int,
    facility_rank: int,
    facility_size: int,
    base_dir: str | os.PathLike | None = None,
) -> TextByteSource:
    """The rank's source, from a config :func:`validate_text` accepted in the launcher."""
    paths = resolve_paths(cfg_data, base_dir)
    corpus = tokenize_corpus(load_corpus(paths), cfg_data.tokenizer)
    return TextByteSource(
        corpus,
        seq_len=seq_len,
        batch_size=batch_size,
        seed=seed,
        facility=facility,
        num_facilities=num_facilities,
        facility_rank=facility_rank,
        facility_size=facility_size,
        eval_fraction=cfg_data.eval_fraction,
        num_eval_batches=cfg_data.num_eval_batches,
        partition=cfg_data.partition,
        block_size=cfg_data.block_size,
        paths=paths,
    )
