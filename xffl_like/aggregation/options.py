"""The ``strategy`` section's checks and the parameters it selects.

:func:`validate_strategy_options` runs once, in the launcher (``validate_config``); workers build
their strategy from the validated section. :func:`strategy_config` builds the section from a plain
mapping (a YAML spec) with the one-line message for an unknown key; :func:`select_parameters` maps
``strategy.only`` to parameter indices.
No process group is touched (``transport=mpi`` is checked without initialising MPI).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from ..config.checks import is_int, is_number
from ..config.errors import ConfigError
from ..config.schema import StrategyConfig
from .backend import check_mpi_transport
from .planners import BUILDERS, STRATEGIES
from .strategy import AGGREGATION_MODES, TRANSPORTS

__all__ = ["normalise_strategy", "select_parameters", "strategy_config", "validate_strategy_options"]

_KEYS = tuple(f.name for f in dataclasses.fields(StrategyConfig))


def _looks_like_class_name(pattern: str) -> bool:
    return pattern.isidentifier() and pattern[0].isupper()


def strategy_config(options: Mapping[str, Any]) -> StrategyConfig:
    """The section from a plain mapping (``conf/strategy/*.yaml`` as a dict); one-line ``ConfigError``
    for an unknown key. Values are not checked here (:func:`validate_strategy_options` does)."""
    if not isinstance(options, Mapping):
        raise ConfigError(f"strategy options must be a mapping with keys {list(_KEYS)}, got {type(options).__name__}")
    unknown = [k for k in options if k not in _KEYS]
    if unknown:
        raise ConfigError(f"unknown strategy option(s) {unknown}: valid keys are {list(_KEYS)}")
    return StrategyConfig(**options)


#: Most communication streams. Each stream multiplies the process groups build_state creates (one per
#: facility, replica group and exchange: with 500 streams thousands of gloo groups, each a rendezvous
#: through the store and a mesh of connections, and the job sat silent for minutes before its first step),
#: while overlap stops paying long before: a round has a few collectives in flight per link.
MAX_STREAMS = 16


def normalise_strategy(cfg: StrategyConfig) -> StrategyConfig:
    """``bucket_mb`` a float, ``only`` a tuple (a single glob wrapped) or None; nothing checked."""
    only = cfg.only
    if only is not None:
        only = (only,) if isinstance(only, str) else tuple(only)
    return dataclasses.replace(cfg, bucket_mb=float(cfg.bucket_mb), only=only)


def validate_strategy_options(
    options: StrategyConfig,
    param_names: Sequence[str] | None = None,
    *,
    model: nn.Module | None = None,
) -> StrategyConfig:
    """Check the ``strategy`` section and return it normalised (``bucket_mb`` a float, ``only``
    a tuple or None).

    Raises ``ConfigError`` with one sentence naming the bad value and the valid ones. With
    ``param_names``, every ``only`` pattern must match a parameter name (a bare capitalised
    identifier is taken for a module class name and only checked when ``model`` is given).
    Build the section from a plain mapping with :func:`strategy_config` first.
    """
    if not isinstance(options, StrategyConfig):
        raise TypeError(
            f"validate_strategy_options takes a StrategyConfig (strategy_config(mapping) builds one), "
            f"got {type(options).__name__}"
        )
    cfg = options
    if cfg.name not in BUILDERS:
        raise ConfigError(f"unknown strategy name {cfg.name!r}: valid names are {list(STRATEGIES)}")
    if not is_int(cfg.streams) or cfg.streams < 1:
        raise ConfigError(f"strategy.streams={cfg.streams!r}: need an integer of at least 1")
    if cfg.streams > MAX_STREAMS:
        raise ConfigError(
            f"strategy.streams={cfg.streams}: at most {MAX_STREAMS} (every stream is one more process group "
            f"per facility, replica group and exchange, each created by every rank before training); "
            f"use strategy.streams<={MAX_STREAMS}"
        )
    if not is_number(cfg.bucket_mb) or not cfg.bucket_mb > 0 or not math.isfinite(cfg.bucket_mb):
        raise ConfigError(f"strategy.bucket_mb={cfg.bucket_mb!r}: need a positive number of megabytes")
    if cfg.mode not in AGGREGATION_MODES:
        raise ConfigError(f"strategy.mode={cfg.mode!r}: valid modes are {list(AGGREGATION_MODES)}")
    only = _checked_only(cfg.only)
    if cfg.transport not in TRANSPORTS:
        raise ConfigError(f"strategy.transport={cfg.transport!r}: valid transports are {list(TRANSPORTS)}")
    if cfg.transport == "mpi":
        check_mpi_transport()
    cfg = normalise_strategy(dataclasses.replace(cfg, only=only))

    if only is not None and (param_names is not None or model is not None):
        _check_only_matches(only, param_names, model)
    return cfg


def _checked_only(only) -> tuple[str, ...] | None:
    """``strategy.only`` as a tuple (a single glob wrapped) or None, checked to be non-empty strings."""
    if only is None:
        return None
    only = tuple([only] if isinstance(only, str) else only)
    if not only or not all(isinstance(p, str) and p for p in only):
        raise ConfigError(
            f"strategy.only={list(only)}: need a non-empty list of parameter-name globs or module class names, or null"
        )
    return only


def _check_only_matches(only: tuple[str, ...], param_names: Sequence[str] | None, model: nn.Module | None) -> None:
    """Every ``only`` pattern matches a parameter name, or (with ``model``) a module class name; without
    ``model`` a bare capitalised identifier is taken for a class name."""
    named = list(model.named_parameters()) if model is not None else None
    names = [n for n, _ in named] if named is not None else list(param_names)
    classes = _owner_classes(model) if model is not None else None
    for pattern in only:
        if any(fnmatch.fnmatchcase(n, pattern) for n in names):
            continue
        if classes is None and _looks_like_class_name(pattern):
            continue
        if classes is not None and any(pattern in c for c in classes.values()):
            continue
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise ConfigError(
            f"strategy.only pattern {pattern!r} matches no parameter name"
            + ("" if classes is None else " nor module class")
            + f": parameters look like {shown}"
        )


def _owner_classes(model: nn.Module) -> dict[str, set[str]]:
    """Parameter name -> class names of every module containing it (FSDP2 wraps classes
    as ``FSDP<Name>``: the MRO keeps the original name)."""
    out: dict[str, set[str]] = {}
    for mod_name, module in model.named_modules():
        names = {cls.__name__ for cls in type(module).__mro__}
        prefix = f"{mod_name}." if mod_name else ""
        for p_name, _ in module.named_parameters():
            out.setdefault(prefix + p_name, set()).update(names)
    return out


def select_parameters(model: nn.Module, only: Sequence[str] | None) -> tuple[int, ...]:
    """Indices (in ``named_parameters()`` order) of the parameters to aggregate."""
    names = [n for n, _ in model.named_parameters()]
    if only is None:
        return tuple(range(len(names)))
    classes = _owner_classes(model)
    return tuple(
        i for i, n in enumerate(names) if any(fnmatch.fnmatchcase(n, p) or p in classes.get(n, ()) for p in only)
    )
