"""Validation of the resolved config in the launching process, before any worker starts.

:func:`validate_config` is the one place that checks a job. It walks :data:`VALIDATORS`, one
ordered table of checks that all take ``(job, ctx)`` and return None: each section once (here
or in the module that owns the section's meaning), then the relations between sections. Every
check raises :class:`~xffl_like.config.errors.ConfigError` with one sentence that names the key, the bad
value and how to fix it. The checks never rewrite the job: :func:`normalise`, run once after the
last of them, is the one step that does (the job that workers receive). A check that has to
resolve something to check it (the layout, the federation's phases, the Hugging Face model's
shape, the data files) leaves it in the :class:`ValidationContext` for the checks after it and
for :func:`normalise`.

Hydra rejects unknown keys and wrong primitive types at compose time against the schema
(:mod:`.schema`); :func:`~xffl_like.config.hydra_errors.compose_error` turns its multi-line report
into one such sentence.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..distributed.layout import Layout, plan_layout
from .checks import is_int, is_number
from .context import ValidationContext, Validator
from .errors import ConfigError
from .hydra_errors import as_override, compose_error
from .schema import JobConfig, ModelConfig, job_config

__all__ = [
    "MAX_ROPE_BYTES",
    "MAX_TIMEOUT_S",
    "VALIDATORS",
    "ConfigError",
    "ValidationContext",
    "Validator",
    "compose_error",
    "normalise",
    "resolve_model",
    "validate_config",
    "validate_distributed",
    "validate_export",
    "validate_logger",
    "validate_optim",
    "validate_train",
]


def _positive_int(value: Any, dotted: str) -> int:
    if not is_int(value) or value <= 0:
        raise ConfigError(f"{dotted}={value!r}: must be a positive integer (e.g. {dotted}=1)")
    return value


def _positive_float(value: Any, dotted: str) -> float:
    if not (is_number(value) and 0 < value < float("inf")):  # inf passes `> 0`, then int() of it fails in a worker
        raise ConfigError(f"{dotted}={value!r}: must be a positive number")
    return float(value)


# ----------------------------------------------------------------------------- one check per section
#: Longest collective timeout: a week. Longer is no timeout at all for a job, and past ~2.7e12 s
#: ``datetime.timedelta`` overflows in every worker.
MAX_TIMEOUT_S = 7 * 24 * 3600


def validate_distributed(job: JobConfig, ctx: ValidationContext) -> None:
    """``distributed.*`` values (the layout they describe is the ``layout`` check's); under ``backend=nccl``
    each of ``ctx.local_world_size`` processes on this node needs its own GPU
    (:func:`~xffl_like.distributed.device.choose_backend`)."""
    cfg = job.distributed
    _positive_int(cfg.nproc_per_node, "distributed.nproc_per_node")
    _positive_int(cfg.timeout_s, "distributed.timeout_s")
    if cfg.timeout_s > MAX_TIMEOUT_S:
        raise ConfigError(
            f"distributed.timeout_s={cfg.timeout_s}: at most {MAX_TIMEOUT_S} (a week); "
            f"use e.g. distributed.timeout_s=1800"
        )
    if cfg.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"distributed.backend={cfg.backend!r}: use auto, gloo or nccl")
    from ..distributed.device import choose_backend

    # nccl needs one GPU per process (or per srun task that Slurm bound its GPU to); auto chooses (device.py)
    choose_backend(cfg.backend, ctx.local_world_size if ctx.local_world_size is not None else cfg.nproc_per_node)


def validate_train(job: JobConfig, ctx: ValidationContext) -> None:
    """``train.*`` (:meth:`TrainConfig.check <xffl_like.config.schema.TrainConfig.check>`)."""
    for key in ("batch_size", "seq_len", "log_every"):
        _positive_int(getattr(job.train, key), f"train.{key}")
    job.train.check()


def validate_optim(job: JobConfig, ctx: ValidationContext) -> None:
    """``optim.*`` (:meth:`OptimConfig.check <xffl_like.config.schema.OptimConfig.check>`; :func:`normalise` makes
    the numbers floats and the betas a pair)."""
    job.optim.check()


def validate_seed(job: JobConfig, ctx: ValidationContext) -> None:
    """``seed``: an integer in ``torch.manual_seed``'s range (past it every worker fails)."""
    if not is_int(job.seed):
        raise ConfigError(f"seed={job.seed!r}: must be an integer")
    if not -(1 << 63) <= job.seed < 1 << 64:
        raise ConfigError(f"seed={job.seed}: must be in [-2**63, 2**64) (torch.manual_seed's range); e.g. seed=0")


_WANDB_MODES = (None, "offline", "online", "disabled")


def validate_logger(job: JobConfig, ctx: ValidationContext) -> None:
    """``logger.*``: the W&B keys are checked whatever the logger (the schema gives every job all of them)."""
    from ..observe.observer import LOGGERS

    cfg = job.logger
    if cfg.name not in LOGGERS:
        raise ConfigError(f"logger.name={cfg.name!r}: use one of {', '.join(LOGGERS)} (e.g. logger=none)")
    if cfg.mode not in _WANDB_MODES:
        raise ConfigError(
            f"logger.mode={cfg.mode!r}: use null ($WANDB_MODE, else offline), offline, online or disabled"
        )
    for key in ("project", "entity", "group"):
        value = getattr(cfg, key)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"logger.{key}={value!r}: must be a string{'' if key == 'project' else ' or null'}")
    if not isinstance(cfg.tags, list) or not all(isinstance(t, str) for t in cfg.tags):
        raise ConfigError(f"logger.tags={cfg.tags!r}: must be a list of strings (e.g. logger.tags=[a,b])")


def validate_export(job: JobConfig, ctx: ValidationContext) -> None:
    """``export.*``."""
    if not isinstance(job.export.hf, bool):
        raise ConfigError(f"export.hf={job.export.hf!r}: use true or false")
    _positive_float(job.export.max_shard_mb, "export.max_shard_mb")


def resolve_model(cfg: ModelConfig, base_dir: Path) -> ModelConfig:
    """Check ``model.init``, and for ``model.path`` (a Hugging Face directory) return the section with
    the path absolute and the shape keys from its ``config.json``, checking the safetensors headers
    (workers then build the same shape and read the weights)."""
    if cfg.init not in ("meta", "full"):
        raise ConfigError(f"model.init={cfg.init!r}: use meta (shard first, then materialise) or full")
    if cfg.name == "hf" and not cfg.path:
        raise ConfigError("model.path is not set: model=hf needs model.path=<local Hugging Face model directory>")
    if not cfg.path:
        return cfg
    from ..checkpoint.hf import check_hf_weights, read_hf_config
    from ..models import LlamaConfig

    path = Path(cfg.path).expanduser()
    path = (path if path.is_absolute() else base_dir / path).absolute()
    shape = read_hf_config(path)
    # The shape comes from config.json alone: a shape key set beside it (model.dim=..., or a shape
    # preset such as model=llama_tiny) would otherwise be replaced without a word.
    default = ModelConfig()
    given = [f"model.{k}={as_override(getattr(cfg, k))}" for k in shape if getattr(cfg, k) != getattr(default, k)]
    if given:
        raise ConfigError(
            f"{', '.join(given)} set together with model.path={cfg.path}: the shape keys come from its "
            f"config.json; drop {'them' if len(given) > 1 else 'it'} (model=hf leaves them unset)"
        )
    cfg = replace(cfg, **shape, path=str(path))
    check_hf_weights(path, LlamaConfig.from_model(cfg))
    return cfg


def validate_model(job: JobConfig, ctx: ValidationContext) -> None:
    """``model.*``: :func:`resolve_model` (into ``ctx.model``), then the shape it gives (``ctx.shape``)."""
    from ..models import LlamaConfig

    ctx.model = resolve_model(job.model, ctx.base_dir)
    try:
        ctx.shape = LlamaConfig.from_model(ctx.model)
    except ValueError as exc:  # the shape's own line, with the section
        raise ConfigError(f"model: {exc}") from None


# ----------------------------------------------------------------------------- the owners' checks, by (job, ctx)
def _parallel(job: JobConfig, ctx: ValidationContext) -> None:
    from ..parallel.options import validate_parallel

    validate_parallel(job.parallel)


def _parallel_job(job: JobConfig, ctx: ValidationContext) -> None:
    from ..parallel.options import check_parallel_job

    check_parallel_job(job, ctx)


def plan_job_layout(job: JobConfig, ctx: ValidationContext) -> None:
    """The layout (``ctx.layout``) of ``distributed.*`` over ``ctx.world_size`` processes, with the shard
    size the parallel mode implies (:func:`~xffl_like.parallel.options.job_hsdp`)."""
    from ..parallel.options import job_hsdp

    ctx.layout = plan_layout(ctx.world_size, job.distributed.federated, job_hsdp(job), ctx.local_world_size)


def _federation(job: JobConfig, ctx: ValidationContext) -> None:
    from ..federation import validate_federation

    ctx.phases = validate_federation(job.federation, ctx.layout, steps=job.train.steps)


def check_warmup(job: JobConfig, ctx: ValidationContext) -> None:
    """``optim.warmup_steps`` within the steps of the facility with the fewest (``federation.every`` as a list)."""
    from ..federation.pace import facility_steps

    steps = min(facility_steps(job.federation, f, job.train.steps) for f in range(ctx.layout.num_facilities))
    warmup, which = job.optim.warmup_steps, "train.steps" if steps == job.train.steps else "its fewest steps"
    if steps > 0 and warmup > steps:  # the peak lr would never be reached (steps=0: nothing runs)
        raise ConfigError(
            f"optim.warmup_steps={warmup} exceeds {which}={steps}: the learning rate would never "
            f"reach optim.lr; use optim.warmup_steps<={steps}"
        )


def _elastic(job: JobConfig, ctx: ValidationContext) -> None:
    from ..federation.elastic import validate_elastic

    validate_elastic(job, ctx.layout)


def _durability(job: JobConfig, ctx: ValidationContext) -> None:
    from ..checkpoint.resume import validate_durability

    validate_durability(job, ctx.world_size)


def _fragments(job: JobConfig, ctx: ValidationContext) -> None:
    """Every phase's ``federation.fragments``: groups of the model's blocks."""
    from ..federation import check_fragments

    check_fragments(ctx.phases, ctx.shape.n_layers)


def _pace_job(job: JobConfig, ctx: ValidationContext) -> None:
    from ..federation.pace import check_pace_job

    check_pace_job(job.federation, parallel=job.parallel.name, eval_every=job.train.eval_every)


def check_slow_fault(job: JobConfig, ctx: ValidationContext) -> None:
    """``fault.slow_facility`` / ``slow_factor`` against the layout (a facility of this job, a factor >= 1)."""
    fault, layout = job.fault, ctx.layout
    if not is_number(fault.slow_factor) or not 1.0 <= fault.slow_factor <= 1000.0:
        raise ConfigError(
            f"fault.slow_factor={fault.slow_factor!r}: must be a number in [1, 1000] (how many times as "
            f"long the slow facility's steps take, e.g. fault.slow_factor=2.0)"
        )
    if fault.slow_facility is None:
        if fault.slow_factor != 1.0:
            raise ConfigError(
                f"fault.slow_factor={fault.slow_factor} slows no facility: set fault.slow_facility too "
                f"(e.g. fault.slow_facility=1)"
            )
        return
    if not is_int(fault.slow_facility) or not 0 <= fault.slow_facility < layout.num_facilities:
        raise ConfigError(
            f"fault.slow_facility={fault.slow_facility!r}: must be a facility of this job, 0.."
            f"{layout.num_facilities - 1}"
        )


#: The RoPE cos/sin tables are built whole on every rank (``max_seq_len x head_dim/2`` each, fp32): 1 GiB
#: holds 2M positions at head_dim 128, sixteen times Llama 3.1's 131,072.
MAX_ROPE_BYTES = 1 << 30


def check_sequence(job: JobConfig, ctx: ValidationContext) -> None:
    """``model.max_seq_len`` (its RoPE tables on every rank) and ``train.seq_len`` within it."""
    shape = ctx.shape
    rope_bytes = shape.max_seq_len * shape.head_dim * 4  # cos and sin tables, fp32, on every rank
    if rope_bytes > MAX_ROPE_BYTES:
        most = MAX_ROPE_BYTES // (shape.head_dim * 4)
        raise ConfigError(
            f"model.max_seq_len={shape.max_seq_len}: its RoPE tables would take "
            f"{rope_bytes / 2**30:.1f} GiB on every rank; at most {most} positions for head_dim="
            f"{shape.head_dim} (use model.max_seq_len<={most})"
        )
    if job.train.seq_len > shape.max_seq_len:
        raise ConfigError(
            f"train.seq_len={job.train.seq_len} exceeds model.max_seq_len={shape.max_seq_len}: "
            f"lower train.seq_len or raise model.max_seq_len"
        )


def check_data(job: JobConfig, ctx: ValidationContext) -> None:
    """``data.*`` against the model's vocabulary and the layout (:func:`~xffl_like.data.validate_data`);
    ``ctx.data``: the section with the tokenizer file (workers and the export read it wherever they run)
    and the corpus paths resolved against ``ctx.base_dir``."""
    from ..data import check_layout_fits, resolve_paths, validate_data
    from ..data.tokenizer import tokenizer_path

    data, train, base_dir = job.data, job.train, ctx.base_dir
    if data.tokenizer not in (None, "byte"):
        data = replace(data, tokenizer=str(tokenizer_path(data.tokenizer, base_dir)))
    num_tokens = validate_data(data, vocab_size=ctx.shape.vocab_size, seq_len=train.seq_len, base_dir=str(base_dir))
    if num_tokens is not None:
        check_layout_fits(num_tokens, data, ctx.layout, batch_size=train.batch_size, seq_len=train.seq_len)
    if data.path is not None:
        paths = [str(p) for p in resolve_paths(data, str(base_dir))]
        data = replace(data, path=paths if isinstance(data.path, list) else paths[0])
    ctx.data = data


def _strategy(job: JobConfig, ctx: ValidationContext) -> None:
    """``strategy.*`` against the model's parameter names and module types (built on meta: no memory)."""
    from ..aggregation import validate_strategy_options
    from ..models import build_model

    meta_model = build_model(ctx.model, device="meta")
    names = [name for name, _ in meta_model.named_parameters()]
    validate_strategy_options(job.strategy, names, model=meta_model)


# ----------------------------------------------------------------------------- the table, the rewrite, the walk
#: Every check of a job, in the order :func:`validate_config` runs them (each once): the sections on their
#: own first, then the relations between sections; a check may read what an earlier one left in the context.
VALIDATORS: tuple[tuple[str, Validator], ...] = (
    ("distributed", validate_distributed),
    ("train", validate_train),
    ("optim", validate_optim),
    ("seed", validate_seed),
    ("logger", validate_logger),
    ("parallel", _parallel),  # parallel.options.validate_parallel
    ("parallel_job", _parallel_job),  # parallel.options.check_parallel_job
    ("layout", plan_job_layout),  # -> ctx.layout
    ("federation", _federation),  # federation.options.validate_federation (pace, outer) -> ctx.phases
    ("warmup", check_warmup),
    ("elastic", _elastic),  # federation.elastic.options.validate_elastic
    ("durability", _durability),  # checkpoint.resume.validate_durability
    ("export", validate_export),
    ("model", validate_model),  # -> ctx.model, ctx.shape
    ("fragments", _fragments),  # federation.options.check_fragments
    ("pace_job", _pace_job),  # federation.pace.check_pace_job
    ("slow_fault", check_slow_fault),
    ("sequence", check_sequence),
    ("data", check_data),  # data.validate_data, check_layout_fits -> ctx.data
    ("strategy", _strategy),  # aggregation.validate_strategy_options
)


def normalise(job: JobConfig, ctx: ValidationContext) -> JobConfig:
    """The job as workers receive it: the one step that rewrites a job, run once after every check of
    :data:`VALIDATORS` passed (it needs their values valid and what they resolved in ``ctx``).

    - ``optim``: the numbers floats, adamw's betas a pair (:meth:`~xffl_like.config.schema.OptimConfig.normalised`);
    - ``distributed.hsdp=1`` for parallel=decentralized|bagua, a full copy on every rank
      (:func:`~xffl_like.parallel.options.job_hsdp`);
    - ``model``: a Hugging Face directory's path absolute and its shape (``ctx.model``);
    - ``data``: the tokenizer file and the corpus paths absolute (``ctx.data``).
    """
    from ..parallel.options import job_hsdp

    return replace(
        job,
        distributed=replace(job.distributed, hsdp=job_hsdp(job)),
        optim=job.optim.normalised(),
        model=ctx.model,
        data=ctx.data,
    )


def validate_config(
    job: JobConfig | Mapping[str, Any],
    world_size: int,
    local_world_size: int | None,
    base_dir: Path,
    choices: Mapping[str, Any] | None = None,
) -> tuple[JobConfig, Layout]:
    """Check ``job`` (built once by :func:`.schema.job_config`) for a job of ``world_size`` processes: every
    check of :data:`VALIDATORS` once, in order, then :func:`normalise`. One :class:`ConfigError` line on the
    first problem.

    Returns the job that workers receive (:func:`normalise`) and the planned layout. A plain dict is
    accepted too (it is built with :func:`.schema.job_config` first); ``choices`` (Hydra's group ->
    option of this composition) lets the message for a key the schema lacks name the file.
    """
    if not isinstance(job, JobConfig):
        job = job_config(job, choices)
    ctx = ValidationContext(world_size, local_world_size, base_dir)
    for _, check in VALIDATORS:
        check(job, ctx)
    return normalise(job, ctx), ctx.layout
