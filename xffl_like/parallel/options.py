"""The main job's ``parallel`` section: the names its keys take, its field checks and its relations.

The config type is :class:`xffl_like.config.schema.ParallelConfig`; :func:`validate_parallel` checks
its keys and :func:`check_parallel_job` its relations to the other sections (the launcher runs
each once, from :func:`xffl_like.config.validate.validate_config`). :func:`job_hsdp` is the shard size the
mode implies, which :func:`xffl_like.config.validate.normalise` writes into the job. The worker side is
:class:`xffl_like.train.dataparallel.DataParallelSync`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from ..config.checks import is_int, is_number
from ..config.errors import ConfigError
from ..config.schema import FederationConfig, JobConfig, ParallelConfig
from ..distributed.layout import plan_layout
from . import Algorithm, AsyncModelAverage, ByteGrad, Decentralized, GradientAllReduce, LowPrecisionDecentralized
from .topology import TOPOLOGIES, topology_edges

if TYPE_CHECKING:
    from ..config.context import ValidationContext

__all__ = [
    "DP_ALGORITHMS",
    "DP_OPTIMIZERS",
    "PARALLEL_MODES",
    "check_parallel_job",
    "dp_algorithm",
    "job_hsdp",
    "validate_parallel",
]

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
    "fsdp": ("cpu_offload",),
    "decentralized": ("topology", "optimizer", "accum_iter", "bucket_mb"),
    "bagua": ("bucket_mb", "algorithm", "options", "switch"),
}
_OWNER = {
    "cpu_offload": "fsdp",
    "topology": "decentralized",
    "optimizer": "decentralized",
    "accum_iter": "decentralized",
    "bucket_mb": "decentralized or parallel=bagua",
    "algorithm": "bagua",
    "options": "bagua",
    "switch": "bagua",
}


def dp_algorithm(name: Any, options: Any, where: str = "parallel.") -> Algorithm:
    """``DP_ALGORITHMS[name](**options)``; one ``ConfigError`` line naming ``where`` for a bad name or option."""
    if name not in DP_ALGORITHMS:
        raise ConfigError(f"{where}algorithm={name!r}: use one of {', '.join(DP_ALGORITHMS)}")
    if not isinstance(options, Mapping):
        raise ConfigError(
            f"{where}options={options!r}: must be a mapping of {name}'s keyword arguments, e.g. {{hierarchical: true}}"
        )
    try:
        return DP_ALGORITHMS[name](**options)
    except TypeError:
        takes = ", ".join(list(inspect.signature(DP_ALGORITHMS[name]).parameters))
        raise ConfigError(f"{where}options={dict(options)!r}: {name} takes {takes}") from None
    except ValueError as exc:
        raise ConfigError(f"{where}options={dict(options)!r}: {exc}") from None


def validate_parallel(cfg: ParallelConfig) -> None:
    """Check the ``parallel`` section's keys; one ``ConfigError`` line naming the key and the fix."""
    name = cfg.name
    if name not in PARALLEL_MODES:
        raise ConfigError(f"parallel.name={name!r}: use parallel=fsdp, parallel=decentralized or parallel=bagua")
    defaults = ParallelConfig()
    for f in fields(ParallelConfig):
        key = f.name
        if key != "name" and key not in _USED[name] and getattr(cfg, key) != getattr(defaults, key):
            raise ConfigError(
                f"parallel.{key}={getattr(cfg, key)!r} applies to parallel={_OWNER[key]}, "
                f"not parallel={name}: drop it or select that mode"
            )
    if not isinstance(cfg.cpu_offload, bool):
        raise ConfigError(f"parallel.cpu_offload={cfg.cpu_offload!r}: use true or false")
    if cfg.topology not in TOPOLOGIES:
        raise ConfigError(f"parallel.topology={cfg.topology!r}: use one of {', '.join(TOPOLOGIES)}")
    if cfg.optimizer not in DP_OPTIMIZERS:
        raise ConfigError(f"parallel.optimizer={cfg.optimizer!r}: use one of {', '.join(DP_OPTIMIZERS)}")
    if not is_int(cfg.accum_iter) or cfg.accum_iter < 1:
        raise ConfigError(
            f"parallel.accum_iter={cfg.accum_iter!r}: must be an integer >= 1 (e.g. parallel.accum_iter=4)"
        )
    if not is_number(cfg.bucket_mb) or not 0 < cfg.bucket_mb < float("inf"):  # inf: no bucket size, a crash in workers
        raise ConfigError(
            f"parallel.bucket_mb={cfg.bucket_mb!r}: must be a positive number of MiB (e.g. parallel.bucket_mb=25)"
        )
    dp_algorithm(cfg.algorithm, cfg.options or {}, "parallel.")
    raw = cfg.switch or []
    if not isinstance(raw, (list, tuple)):
        raise ConfigError(
            f"parallel.switch={raw!r}: must be a list such as [{{at_step: 20, algorithm: decentralized}}]"
        )
    last = 0
    for i, entry in enumerate(raw):
        where = f"parallel.switch[{i}]."
        if not isinstance(entry, Mapping) or set(entry) - {"at_step", "algorithm", "options"}:
            raise ConfigError(f"parallel.switch[{i}]={entry!r}: each entry has at_step, algorithm and optional options")
        at = entry.get("at_step")
        if not is_int(at) or at <= last:
            raise ConfigError(f"{where}at_step={at!r}: must be an integer > {last} (steps are 1-based and increasing)")
        dp_algorithm(entry.get("algorithm"), entry.get("options") or {}, where)
        last = at


# ----------------------------------------------------------------------------- relations to the other sections
def job_hsdp(job: JobConfig) -> int | None:
    """``distributed.hsdp`` as ``parallel`` has it: decentralized and bagua keep a full copy of the model on
    every rank, a shard group of one (``1``); fsdp the section's own value. The layout is planned with it,
    and :func:`xffl_like.config.validate.normalise` writes it into the job that workers receive."""
    return job.distributed.hsdp if job.parallel.name == "fsdp" else 1


def check_parallel_job(job: JobConfig, ctx: ValidationContext) -> None:
    """``parallel`` against the other sections (decentralized, bagua: a full copy on every rank, no federation
    rounds, no checkpoints); one :class:`ConfigError` line naming the key and the fix."""
    mode = job.parallel.name
    if mode == "fsdp":
        _check_offload(job, ctx)
        return
    _check_full_copies(job, mode)
    _check_no_checkpoints(job, mode)
    facilities = plan_layout(ctx.world_size, job.distributed.federated, 1).facility_sizes  # an impossible one: its line
    if mode == "decentralized":
        _check_decentralized(job, ctx.world_size, facilities)
    else:
        _check_bagua(job, ctx.world_size, facilities)


def _check_offload(job: JobConfig, ctx: ValidationContext) -> None:
    """``parallel.cpu_offload`` moves the shards from the GPU to the host: a job on CPU has nothing to move."""
    if not job.parallel.cpu_offload:
        return
    from ..distributed.device import choose_backend

    dist_cfg = job.distributed
    local = ctx.local_world_size if ctx.local_world_size is not None else dist_cfg.nproc_per_node
    if choose_backend(dist_cfg.backend, local).device_type != "cuda":
        raise ConfigError(
            "parallel.cpu_offload=true keeps GPU memory for activations by holding the shards on the host, "
            "but this job runs on CPU (no CUDA device per process): drop it (parallel.cpu_offload=false)"
        )


def _check_full_copies(job: JobConfig, mode: str) -> None:
    """A full copy per rank: no sharding, no federation keys, float32."""
    hsdp, fed = job.distributed.hsdp, job.federation
    if hsdp not in (None, 1):
        raise ConfigError(
            f"distributed.hsdp={hsdp!r} shards the model, but parallel={mode} keeps a full copy on "
            f"every rank: drop distributed.hsdp (null) or use parallel=fsdp"
        )
    keys = ("algorithm", "topology", "compression", "weights", "error_feedback", "delay", "delay_rule")
    for key in (*keys, "on_nonfinite"):
        value, default = getattr(fed, key), getattr(FederationConfig(), key)
        if value != default:
            raise ConfigError(
                f"federation.{key}={value!r} does not apply to parallel={mode} (the copies are kept in "
                f"step by the {mode} algorithm, no federation rounds): drop it or use parallel=fsdp"
            )
    if fed.outer.name != "average" or fed.outer.lr != 1.0:
        raise ConfigError(
            f"federation.outer (name={fed.outer.name!r}, lr={fed.outer.lr!r}) does not apply to "
            f"parallel={mode} (no federation rounds): use federation=default or parallel=fsdp"
        )
    # a full copy per rank, no FSDP mixed-precision policy: nothing would be bf16 (auto: float32 here)
    if job.train.dtype not in ("float32", "auto"):
        raise ConfigError(
            f"train.dtype={job.train.dtype} with parallel={mode}: the full copies train in float32 (no "
            f"mixed precision there); use train.dtype=float32, or parallel=fsdp for bfloat16"
        )


def _check_no_checkpoints(job: JobConfig, mode: str) -> None:
    """Checkpoints would need every rank's own copy (DCP keeps one copy of replicated tensors)."""
    if job.resume is not None:
        raise ConfigError(
            f"resume={job.resume!r}: parallel={mode} writes no checkpoints and cannot resume; "
            f"use parallel=fsdp to resume"
        )
    if job.checkpoint.dir is not None:
        raise ConfigError(f"checkpoint.dir={job.checkpoint.dir!r}: parallel={mode} writes no checkpoints; drop it")
    if job.distributed.max_restarts:
        raise ConfigError(
            f"distributed.max_restarts={job.distributed.max_restarts}: restarts resume from a checkpoint, and "
            f"parallel={mode} writes none; use 0"
        )
    if job.fault.nan_rank is not None:
        raise ConfigError(
            f"fault.nan_rank: the non-finite guard protects federation rounds, which parallel={mode} "
            f"does not have; drop it"
        )


def _check_decentralized(job: JobConfig, world_size: int, facilities: tuple[int, ...]) -> None:
    pcfg = job.parallel
    if job.train.steps == 1:
        raise ConfigError(
            "train.steps=1: parallel=decentralized applies a step's update in the next step's backward "
            "pass (Decent-DP), so one step never updates; use train.steps >= 2"
        )
    if pcfg.topology == "alternating-exp-ring" and len(set(facilities)) > 1:
        raise ConfigError(
            f"parallel.topology=alternating-exp-ring needs facilities (its nodes) of equal size, got "
            f"{list(facilities)}: use equal distributed.federated or another topology"
        )
    try:
        topology_edges(pcfg.topology, world_size, facilities[0])
    except ValueError as exc:  # impossible sizes: the topology's own line, with the key
        raise ConfigError(f"parallel.topology={pcfg.topology}: {exc}") from None
    if pcfg.optimizer.startswith("accum_") or pcfg.optimizer in ("adam", "adamw"):
        if job.optim.name != "adamw":
            raise ConfigError(
                f"parallel.optimizer={pcfg.optimizer} takes lr, betas, eps and weight_decay from "
                f"optim=adamw, got optim={job.optim.name}: select optim=adamw"
            )


def _check_bagua(job: JobConfig, world_size: int, facilities: tuple[int, ...]) -> None:
    steps = job.train.steps
    if job.train.grad_accum != 1:
        raise ConfigError(
            f"train.grad_accum={job.train.grad_accum}: parallel=bagua synchronises every backward pass "
            f"(Bagua has no gradient accumulation); use train.grad_accum=1"
        )
    for at, name, options in job.parallel.algorithms():
        where = "parallel." if at == 0 else f"parallel.switch (at_step={at}): "
        if at >= steps and at > 0:
            raise ConfigError(
                f"{where}at_step={at} is not before the last step (train.steps={steps}): switch earlier or drop it"
            )
        algo = DP_ALGORITHMS[name](**options)
        members = len(facilities) if algo.hierarchical else world_size
        if name == "decentralized" and algo.peer_selection_mode == "shift_one" and members > 1 and members % 2:
            what = "facilities (hierarchical: the nodes)" if algo.hierarchical else "processes"
            raise ConfigError(
                f"{where}decentralized with peer_selection_mode=shift_one needs an even number of "
                f"{what}, got {members}: use peer_selection_mode=all or change the layout"
            )
