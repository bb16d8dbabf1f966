"""``data=tokens``: a corpus pre-tokenized by ``python -m xffl_like.data.prepare``, memory-mapped.

``data.path`` is the directory holding ``tokens.bin`` and ``meta.json``. The token array is
mapped read-only (``numpy.memmap``); a rank touches only the pages of the windows it samples,
all inside its own slice. The split is the one of ``data=text`` (see :mod:`.text`), in tokens
instead of bytes: held-out tail, then per-facility contiguous (non-IID) or interleaved blocks,
then one contiguous piece per rank. :func:`check_layout_fits` runs in the launcher and names
the shortfall when some rank of the layout would not get one batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..config.checks import is_int, not_regular
from ..config.errors import ConfigError
from ..config.schema import DataConfig
from .corpus_format import FORMAT, META, TOKENS, output_for
from .source import check_num_eval_batches, resolve_paths
from .text import (
    TextByteSource,
    _check_block_size,
    _check_eval_fraction,
    _check_partition,
    facility_segments,
    rank_segments,
    split_sizes,
)

__all__ = ["build_tokens", "check_layout_fits", "read_meta", "validate_tokens"]


def _directory(cfg_data: DataConfig, base_dir) -> Path:
    paths = resolve_paths(cfg_data, base_dir)
    if len(paths) != 1:
        raise ConfigError(
            f"data.path: data=tokens takes one directory written by xffl_like.data.prepare, got {len(paths)}"
        )
    directory = paths[0]
    if directory.exists() and not directory.is_dir():
        kind = not_regular(directory)
        what = (
            f"is not a directory ({kind})" if kind else "is a file, not the directory written by xffl_like.data.prepare"
        )
        raise ConfigError(
            f"data.path={directory}: {what}; data=tokens takes that directory ({_fix(directory)}), "
            f"or train on a text file with data=text"
        )
    return directory


def _fix(directory: Path) -> str:
    """How to make the corpus ``data.path`` names; never suggests writing it over a file
    (a corpus ``a.txt`` -> ``a-tokens``)."""
    if directory.exists() and not directory.is_dir():
        return (
            f"run python -m xffl_like.data.prepare --tokenizer <path|byte> --output {output_for(directory)} "
            f"{directory}, then data.path={output_for(directory)}"
        )
    return f"run python -m xffl_like.data.prepare --tokenizer <path|byte> --output {directory} <files...>"


def read_meta(directory: Path) -> dict:
    """``meta.json`` of a prepared corpus, checked against the size of ``tokens.bin``."""
    fix = _fix(directory)
    for name in (META, TOKENS):  # before reading: a device or /proc file never ends or changes
        kind = not_regular(directory / name)
        if kind is not None:
            raise ConfigError(f"data.path={directory}: {name} is not a regular file ({kind}; {fix})")
    try:
        meta = json.loads((directory / META).read_text())
    except FileNotFoundError:
        raise ConfigError(f"data.path={directory}: no {META} ({fix})") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data.path={directory}: {META} is unreadable ({exc}; {fix})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("dtype") not in ("uint16", "uint32"):
        raise ConfigError(f"data.path={directory}: {META} is not a {FORMAT} description ({fix})")
    for key in ("vocab_size", "num_tokens"):
        value = meta.get(key)
        if not is_int(value) or value < (1 if key == "vocab_size" else 0):
            raise ConfigError(
                f"data.path={directory}: {META} has {key}={value!r}, not a "
                f"{'positive integer' if key == 'vocab_size' else 'count'} ({fix})"
            )
    if meta["vocab_size"] > np.iinfo(meta["dtype"]).max + 1:
        raise ConfigError(
            f"data.path={directory}: {META} has vocab_size={meta['vocab_size']}, more ids than "
            f"dtype={meta['dtype']} holds ({fix})"
        )
    tokens = directory / TOKENS
    expected = int(meta["num_tokens"]) * np.dtype(meta["dtype"]).itemsize
    if not tokens.is_file() or tokens.stat().st_size != expected:
        size = tokens.stat().st_size if tokens.is_file() else "missing"
        raise ConfigError(
            f"data.path={directory}: {TOKENS} is {size} bytes, {META} promises {expected} "
            f"(truncated or from another run; {fix})"
        )
    return meta


def validate_tokens(cfg_data: DataConfig, *, vocab_size: int, seq_len: int, base_dir=None) -> dict:
    """Check the prepared corpus and the model's vocabulary; return the metadata."""
    check_num_eval_batches(cfg_data)
    _check_partition(cfg_data)
    _check_block_size(cfg_data)
    frac = _check_eval_fraction(cfg_data)
    directory = _directory(cfg_data, base_dir)
    meta = read_meta(directory)
    if vocab_size < int(meta["vocab_size"]):
        raise ConfigError(
            f"model.vocab_size={vocab_size} is smaller than the vocabulary of the corpus's tokenizer "
            f"({meta['vocab_size']}, {meta['tokenizer']}): raise model.vocab_size or prepare with "
            "the model's own tokenizer"
        )
    n_train, _ = split_sizes(int(meta["num_tokens"]), frac, seq_len)
    if n_train < seq_len + 1:
        raise ConfigError(
            f"data.path={directory}: {meta['num_tokens']} tokens are too few for seq_len={seq_len} with "
            f"eval_fraction={frac}; prepare more text or lower train.seq_len"
        )
    return meta


def check_layout_fits(num_tokens: int, cfg_data: DataConfig, layout, *, batch_size: int, seq_len: int) -> None:
    """Every rank of ``layout`` gets at least ``batch_size`` disjoint windows of ``seq_len + 1``.

    Pure arithmetic on the corpus length (no data is read): run in the launcher, before workers,
    after :func:`validate_tokens` (or ``validate_text``) accepted ``cfg_data``.
    """
    partition, block = cfg_data.partition, cfg_data.block_size
    n_train, n_eval = split_sizes(num_tokens, cfg_data.eval_fraction, seq_len)
    window = seq_len + 1
    for f, size in enumerate(layout.facility_sizes):
        segments = facility_segments(n_train, layout.num_facilities, f, partition, block)
        for r in range(size):
            mine = rank_segments(segments, size, r)
            windows = sum((b - a) // window for a, b in mine)
            if windows < batch_size:
                share = sum(b - a for a, b in mine)
                need = batch_size * window * layout.world_size
                raise ConfigError(
                    f"data.path: the {n_train:,}-token training part of the corpus gives facility {f} rank {r} "
                    f"{share:,} tokens, {windows} windows of seq_len+1={window}, fewer than train.batch_size="
                    f"{batch_size}; the layout of {layout.world_size} ranks needs about {need:,} tokens: add "
                    "data, or lower train.seq_len, train.batch_size or the number of processes"
                )
    # Held-out windows: num_eval_batches * batch_size start offsets spread evenly over the held-out tail
    # (a rank's share, or the whole tail when it is short: windows may then repeat, by design). More
    # windows than the tail has tokens only evaluates the same windows again, and a huge count fills
    # every worker's memory with offsets.
    wanted = cfg_data.num_eval_batches * batch_size
    if wanted > n_eval:
        raise ConfigError(
            f"data.num_eval_batches={cfg_data.num_eval_batches}: {wanted:,} held-out windows per rank (times "
            f"train.batch_size={batch_size}), more than the {n_eval:,} tokens of the held-out tail; use "
            f"data.num_eval_batches<={max(n_eval // batch_size, 1)} or raise data.eval_fraction"
        )


def build_tokens(
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
    base_dir=None,
) -> TextByteSource:
    """The rank's source over the memory-mapped corpus (only its windows are ever read), from a config
    :func:`validate_tokens` accepted in the launcher."""
    directory = _directory(cfg_data, base_dir)
    meta = read_meta(directory)
    # Copy-on-write mapping: writable for torch (no warning), nothing is read until indexed.
    array = np.memmap(directory / TOKENS, dtype=meta["dtype"], mode="c", shape=(int(meta["num_tokens"]),))
    source = TextByteSource(
        torch.from_numpy(array),
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
        paths=[directory],
    )
    source.vocab_size = int(meta["vocab_size"])
    return source
