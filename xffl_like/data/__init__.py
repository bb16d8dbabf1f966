"""Data layer: deterministic per-(facility, rank) token batches.

``build_data`` returns a :class:`DataSource` for one worker; ``validate_data`` checks a
config in the launching process before any worker starts (one-sentence ``ConfigError``).
Both take the typed :class:`~xffl_like.config.schema.DataConfig`; sources read the values
``validate_data`` accepted and do not check them again.
Sources: ``synthetic`` (non-IID sparse Markov chain, no files), ``text`` (UTF-8 corpus,
e.g. ``../shared/data/tinyshakespeare.txt``, byte-level or tokenized by ``data.tokenizer``) and
``tokens`` (a corpus pre-tokenized by ``python -m xffl_like.data.prepare``, memory-mapped).
"""

from __future__ import annotations

import os

from ..config.checks import is_int
from ..config.errors import ConfigError
from ..config.schema import DataConfig
from .source import DataSource, check_positive_int, mix_seed, resolve_paths
from .synthetic import SyntheticMarkovSource, _check_non_iid, build_synthetic, validate_synthetic
from .text import (
    BYTE_VOCAB_SIZE,
    TextByteSource,
    _check_block_size,
    _check_eval_fraction,
    _check_partition,
    build_text,
    decode,
    encode,
    validate_text,
)
from .tokens import build_tokens, check_layout_fits, validate_tokens

__all__ = [
    "DataSource",
    "SyntheticMarkovSource",
    "TextByteSource",
    "BYTE_VOCAB_SIZE",
    "DATA_SOURCES",
    "build_data",
    "validate_data",
    "check_layout_fits",
    "resolve_paths",
    "encode",
    "decode",
    "mix_seed",
]

DATA_SOURCES = ("synthetic", "text", "tokens")


def _name(cfg_data: DataConfig) -> str:
    if not isinstance(cfg_data, DataConfig):
        raise TypeError(f"the data layer takes a xffl_like.config.schema.DataConfig, got {type(cfg_data).__name__}")
    name = cfg_data.name
    if name not in DATA_SOURCES:
        raise ConfigError(
            f"data.name: unknown data source {name!r} (pass data.name=synthetic, data.name=text or data.name=tokens)"
        )
    return str(name)


def _check_layout(
    *, batch_size: int, facility: int, num_facilities: int, facility_rank: int, facility_size: int
) -> None:
    check_positive_int(batch_size, "batch_size", "set a positive per-rank batch size")
    check_positive_int(num_facilities, "num_facilities", "set at least one facility")
    check_positive_int(facility_size, "facility_size", "give each facility at least one worker")
    if not is_int(facility) or not 0 <= facility < num_facilities:
        raise ConfigError(f"facility: {facility!r} is not in 0..{num_facilities - 1} (num_facilities={num_facilities})")
    if not is_int(facility_rank) or not 0 <= facility_rank < facility_size:
        raise ConfigError(
            f"facility_rank: {facility_rank!r} is not in 0..{facility_size - 1} (facility_size={facility_size})"
        )


def validate_data(
    cfg_data: DataConfig, *, vocab_size: int, seq_len: int, base_dir: str | os.PathLike | None = None
) -> int | None:
    """Check ``cfg_data`` before workers start; raise ``ValueError`` on the first problem.

    Returns the corpus length in tokens (bytes for the byte tokenizer) for the corpus sources, for
    :func:`check_layout_fits`; None for ``synthetic``.

    Relative ``data.path`` entries resolve against ``base_dir`` (default: Hydra's original cwd, else the cwd).
    """
    name = _name(cfg_data)
    # DataConfig holds every source's keys: the ones this source ignores are checked as well, so that
    # no value that could never work waits in the config for a later change of data.name.
    _check_eval_fraction(cfg_data), _check_partition(cfg_data), _check_block_size(cfg_data)
    _check_non_iid(cfg_data)
    if name == "synthetic":
        validate_synthetic(cfg_data, vocab_size=vocab_size, seq_len=seq_len)
        return None
    if name == "tokens":
        return int(validate_tokens(cfg_data, vocab_size=vocab_size, seq_len=seq_len, base_dir=base_dir)["num_tokens"])
    return validate_text(cfg_data, vocab_size=vocab_size, seq_len=seq_len, base_dir=base_dir)


def build_data(
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
) -> DataSource:
    """The data source of rank ``facility_rank`` (of ``facility_size``) in facility ``facility``
    (of ``num_facilities``).

    Batches are CPU LongTensors ``(inputs [batch_size, seq_len], targets [batch_size, seq_len])``.
    ``base_dir`` (optional) is where relative ``data.path`` entries resolve; default as in
    :func:`validate_data` -- pass the launch directory (or absolute paths) when workers run elsewhere.
    """
    name = _name(cfg_data)
    _check_layout(
        batch_size=batch_size,
        facility=facility,
        num_facilities=num_facilities,
        facility_rank=facility_rank,
        facility_size=facility_size,
    )
    mine = dict(
        vocab_size=vocab_size,
        seq_len=seq_len,
        batch_size=batch_size,
        seed=seed,
        facility=facility,
        facility_rank=facility_rank,
    )
    if name == "synthetic":
        return build_synthetic(cfg_data, **mine)
    if name == "tokens":
        return build_tokens(
            cfg_data, **mine, num_facilities=num_facilities, facility_size=facility_size, base_dir=base_dir
        )
    return build_text(cfg_data, **mine, num_facilities=num_facilities, facility_size=facility_size, base_dir=base_dir)
