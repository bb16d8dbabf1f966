"""Shared protocol and helpers of the data layer.

Every data source yields CPU ``torch.long`` tensors ``(inputs [B, T], targets [B, T])``
where ``targets`` is ``inputs`` shifted left by one token.  Everything is a pure
function of ``(seed, facility, facility_rank, step)``; no state is carried between
calls, so a resumed run reproduces the exact batches of the original one.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from ..config.checks import is_number
from ..config.errors import ConfigError

if TYPE_CHECKING:
    from ..config.schema import DataConfig

__all__ = [
    "DataSource",
    "mix_seed",
    "make_generator",
    "resolve_paths",
    "default_base_dir",
    "check_positive_int",
    "check_num_eval_batches",
]

_MASK64 = (1 << 64) - 1


@runtime_checkable
class DataSource(Protocol):
    """What the trainer consumes."""

    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs [B, T], targets [B, T])`` for optimizer step ``step``; deterministic."""
        ...

    def eval_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Held-out batches, identical on every call of the run, never seen in training."""
        ...


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mix_seed(*parts: int) -> int:
    """Hash integers into a 63-bit seed (order-sensitive, well mixed, platform independent)."""
    h = 0x6A09E667F3BCC909
    for p in parts:
        h = _splitmix64(h ^ (int(p) & _MASK64))
    return h & ((1 << 63) - 1)


def make_generator(*parts: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded by ``mix_seed(*parts)``."""
    g = torch.Generator(device="cpu")
    g.manual_seed(mix_seed(*parts))
    return g


def default_base_dir() -> Path:
    """Directory the user launched from: Hydra's original cwd when Hydra runs, else the cwd."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            from hydra.utils import get_original_cwd

            return Path(get_original_cwd())
    except Exception:  # pragma: no cover - hydra missing / not initialised
        pass
    return Path(os.getcwd())


def resolve_paths(cfg_data: DataConfig, base_dir: str | os.PathLike | None = None) -> list[Path]:
    """``data.path`` (a string or a list of strings) as absolute paths.

    Relative paths resolve against ``base_dir`` (the launch directory); ``~`` is
    expanded.  ``base_dir=None`` means :func:`default_base_dir`.  Raises
    ``ConfigError`` when ``data.path`` is missing or empty.
    """
    raw = cfg_data.path
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        raise ConfigError(
            "data.path: no text file given (pass data.path=<existing UTF-8 text file> or a list of files)"
        )
    if isinstance(raw, (str, os.PathLike)):
        items = [raw]
    else:
        try:
            items = list(raw)  # list / tuple / ListConfig
        except TypeError:
            raise ConfigError(
                f"data.path: expected a file path or a list of file paths, got {raw!r} "
                "(pass data.path=<existing UTF-8 text file>)"
            ) from None
        if not items:
            raise ConfigError("data.path: the list of files is empty (pass data.path=<existing UTF-8 text file>)")
    base = Path(base_dir) if base_dir is not None else default_base_dir()
    out: list[Path] = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)) or not str(item).strip():
            raise ConfigError(f"data.path: invalid entry {item!r} (pass data.path=<existing UTF-8 text file>)")
        p = Path(item).expanduser()
        if not p.is_absolute():
            p = base / p
        out.append(Path(os.path.normpath(p.absolute())))
    return out


def check_positive_int(value: Any, what: str, fix: str) -> int:
    """``int(value)`` if it is a positive integer, else a one-sentence ConfigError naming ``what``."""
    if not is_number(value) or isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
        raise ConfigError(f"{what}: must be a positive integer, got {value!r} ({fix})")
    if int(value) <= 0:
        raise ConfigError(f"{what}: must be a positive integer, got {value!r} ({fix})")
    return int(value)


def check_num_eval_batches(cfg_data: DataConfig) -> int:
    return check_positive_int(
        cfg_data.num_eval_batches,
        "data.num_eval_batches",
        "pass e.g. data.num_eval_batches=4",
    )
