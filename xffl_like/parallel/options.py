"""The main job's ``parallel`` section: the names its keys take and its field checks.

The config type is :class:`xffl_like.schema.ParallelConfig`; :func:`validate_parallel` checks
its keys (the launcher calls it once, from :func:`xffl_like.config.validate_config`, which
also checks the section's relations to the other sections). The worker side is
:class:`xffl_like.train.dataparallel.DataParallelSync`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from ..checks import is_int, is_number
from ..schema import ParallelConfig
from . import Algorithm, AsyncModelAverage, ByteGrad, Decentralized, GradientAllReduce, LowPrecisionDecentralized
from .topology import TOPOLOGIES

__all__ = ["DP_ALGORITHMS", "DP_OPTIMIZERS", "PARALLEL_MODES", "dp_algorithm", "validate_parallel"]

#: ``parallel.name``: FSDP with federation rounds, or a full copy per rank kept in step by Decent-DP or Bagua.
PARALLEL_MODES = ("fsdp", "decentralized", "bagua")
#: ``parallel.optimizer`` (decentralized): ``optim`` (the optim group per bucket) or one of Decent-DP's.
DP_OPTIMIZERS = ("optim", "adam", "adamw", "accum_adam", "accum_adamw")
#: ``parallel.algorithm`` (bagua): the Bagua-style algorithm classes by config name.
DP_ALGORITHMS: dict[str, type[Algorithm]] = {
    "gradient_allreduce": GradientAllReduce,
    "bytegrad": ByteGrad,
    "decentralized": Decentralized,
    "low_precision_decentralized": LowPrecisionDecentralized,
    "async_model_average": AsyncModelAverage,
}
# The keys each mode reads; the others keep the schema's defaults (those of conf/parallel/fsdp.yaml).
_USED = {
    "fsdp": (),
    "decentralized": ("topology", "optimizer", "accum_iter", "bucket_mb"),
    "bagua": ("bucket_mb", "algorithm", "options", "switch"),
}
_OWNER = {
    "topology": "decentralized",
    "optimizer": "decentralized",
    "accum_iter": "decentralized",
    "bucket_mb": "decentralized or parallel=bagua",
    "algorithm": "bagua",
    "options": "bagua",
    "switch": "bagua",
}


def dp_algorithm(name: Any, options: Any, where: str = "parallel.") -> Algorithm:
    """``DP_ALGORITHMS[name](**options)``; one ``ValueError`` line naming ``where`` for a bad name or option."""
    if name not in DP_ALGORITHMS:
        raise ValueError(f"{where}algorithm={name!r}: use one of {', '.join(DP_ALGORITHMS)}")
    if not isinstance(options, Mapping):
        raise ValueError(
            f"{where}options={options!r}: must be a mapping of {name}'s keyword arguments, e.g. {{hierarchical: true}}"
        )
    try:
        return DP_ALGORITHMS[name](**options)
    except TypeError:
        takes = ", ".join(list(inspect.signature(DP_ALGORITHMS[name]).parameters))
        raise ValueError(f"{where}options={dict(options)!r}: {name} takes {takes}") from None
    except ValueError as exc:
        raise ValueError(f"{where}options={dict(options)!r}: {exc}") from None


def validate_parallel(cfg: ParallelConfig) -> None:
    """Check the ``parallel`` section's keys; one ``ValueError`` line naming the key and the fix."""
    name = cfg.name
    if name not in PARALLEL_MODES:
        raise ValueError(f"parallel.name={name!r}: use parallel=fsdp, parallel=decentralized or parallel=bagua")
    defaults = ParallelConfig()
    for f in fields(ParallelConfig):
        key = f.name
        if key != "name" and key not in _USED[name] and getattr(cfg, key) != getattr(defaults, key):
            raise ValueError(
                f"parallel.{key}={getattr(cfg, key)!r} applies to parallel={_OWNER[key]}, "
                f"not parallel={name}: drop it or select that mode"
            )
    if cfg.topology not in TOPOLOGIES:
        raise ValueError(f"parallel.topology={cfg.topology!r}: use one of {', '.join(TOPOLOGIES)}")
    if cfg.optimizer not in DP_OPTIMIZERS:
        raise ValueError(f"parallel.optimizer={cfg.optimizer!r}: use one of {', '.join(DP_OPTIMIZERS)}")
    if not is_int(cfg.accum_iter) or cfg.accum_iter < 1:
        raise ValueError(
            f"parallel.accum_iter={cfg.accum_iter!r}: must be an integer >= 1 (e.g. parallel.accum_iter=4)"
        )
    if not is_number(cfg.bucket_mb) or not 0 < cfg.bucket_mb < float("inf"):  # inf: no bucket size, a crash in workers
        raise ValueError(
            f"parallel.bucket_mb={cfg.bucket_mb!r}: must be a positive number of MiB (e.g. parallel.bucket_mb=25)"
        )
    dp_algorithm(cfg.algorithm, cfg.options or {}, "parallel.")
    raw = cfg.switch or []
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"parallel.switch={raw!r}: must be a list such as [{{at_step: 20, algorithm: decentralized}}]")
    last = 0
    for i, entry in enumerate(raw):
        where = f"parallel.switch[{i}]."
        if not isinstance(entry, Mapping) or set(entry) - {"at_step", "algorithm", "options"}:
            raise ValueError(f"parallel.switch[{i}]={entry!r}: each entry has at_step, algorithm and optional options")
        at = entry.get("at_step")
        if not is_int(at) or at <= last:
            raise ValueError(f"{where}at_step={at!r}: must be an integer > {last} (steps are 1-based and increasing)")
        dp_algorithm(entry.get("algorithm"), entry.get("options") or {}, where)
        last = at
