"""Validation of the resolved config in the launching process, before any worker starts.

:func:`validate_config` is the one place that checks a job: each section once (its
``validate_*`` function, here or in the module that owns the section's meaning), then the
relations between sections. Every check raises :class:`ConfigError` with one sentence that names the key, the bad
value and how to fix it. Hydra rejects unknown keys and wrong primitive types at compose
time against the schema (:mod:`.schema`); :func:`compose_error` turns its multi-line
report into one such sentence.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from .checks import is_int, is_number
from .distributed.layout import Layout, plan_layout
from .schema import (
    DistributedConfig,
    ExportConfig,
    FederationConfig,
    JobConfig,
    LoggerConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    as_plain,
    job_config,
)

__all__ = [
    "ConfigError",
    "compose_error",
    "resolve_model",
    "validate_config",
    "validate_distributed",
    "validate_export",
    "validate_logger",
    "validate_optim",
    "validate_train",
]


class ConfigError(ValueError):
    """A config value that cannot work; the message is the one line shown to the user."""


def _describe(hint: Any) -> str:
    """A schema type in words: ``Optional[int]`` -> 'an integer or null'."""
    import typing

    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint):
        return f"{_describe(args[0] if len(args) == 1 else typing.Union[tuple(args)])} or null"
    if typing.get_origin(hint) is typing.Union:
        return "a number"  # Union[int, float]
    if typing.get_origin(hint) in (list, list):
        return f"a list of {_describe(args[0]).split(' ', 1)[1]}s" if args else "a list"
    if typing.get_origin(hint) in (dict, dict):
        return "a mapping"
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return words.get(hint, "a value")


def _override(value: Any) -> str:
    """``value`` as a command-line override writes it: null, true, [0.9,0.95]."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    if isinstance(value, (list, tuple)):
        return f"[{','.join(_override(v) for v in value)}]"
    return str(value)


def _quoting_hint(exc: BaseException) -> str:
    """How to quote the override Hydra's lexer refused (a path with spaces, non-ASCII letters or brackets).

    Hydra accepts such a value inside quotes of its own, which the shell must pass through: the
    whole argument in double quotes, the value in single quotes (``"data.path='my file.txt'"``),
    checked with Hydra 1.3 for spaces, accented letters and parentheses.
    """
    override = str(getattr(exc, "override", "") or "")
    key, eq, value = override.partition("=")
    if not eq:  # the shell split a value with spaces: its tail arrived as an override of its own
        return (
            f"{override!r} is not key=value: a value with spaces was split by the shell; quote the whole "
            f"argument and the value, e.g. \"data.path='my file.txt'\"; "
        )
    value = value.strip().strip("'\"")
    return f"quote the value for Hydra and the argument for the shell: \"{key.strip()}='{value}'\"; "


def compose_error(exc: BaseException) -> str | None:
    """One line for an error Hydra or OmegaConf raised while composing the job's config
    (unknown key, wrong type, missing option, unparsable override); None for any other error."""
    import typing
    from dataclasses import MISSING, is_dataclass

    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

    from .schema import section_of, unknown_key_message

    extra = _missing_launcher_extra(exc)
    if extra:
        return extra
    if isinstance(exc, MissingConfigException) and exc.options is not None and exc.missing_cfg_file:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        return (
            f"{group.replace('/', '.')}={option}: no such option (conf/{exc.missing_cfg_file}.yaml); "
            f"available: {', '.join(exc.options)}"
        )
    if isinstance(exc, OverrideParseException):
        return (
            f"cannot parse an override ({str(exc).splitlines()[0]}): "
            f"{_quoting_hint(exc)}see `python -m xffl_like.run --help`"
        )
    cause = exc if isinstance(exc, OmegaConfBaseException) else exc.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        return unknown_key_message(cause.full_key)
    if isinstance(cause, ValidationError) and cause.full_key:
        key = cause.full_key.split("[")[0]
        found = section_of(key)
        if found is None:
            return f"{cause.full_key}={cause.value!r}: {str(cause).splitlines()[0]}"
        cls, field = found
        hint = typing.get_type_hints(cls)[field.name]
        what = _describe(hint) if not is_dataclass(hint) else f"a mapping of {key}.* keys"
        default = field.default
        if default is MISSING and field.default_factory is not MISSING and not is_dataclass(field.default_factory):
            default = field.default_factory()
        example = "" if default in (MISSING, "???") or is_dataclass(hint) else f" (e.g. {key}={_override(default)})"
        if key != cause.full_key:  # an element of a list
            return f"{cause.full_key}={cause.value!r}: {key} must be {what}{example}"
        return f"{key}={cause.value!r}: must be {what}{', not null' if cause.value is None else ''}{example}"
    # A YAML file (an experiment, a group option) with a key or value the schema refuses: Hydra
    # reports "In 'experiment/x': ConfigKeyError raised ...\n<message>\n    full_key: <key>".
    found = re.match(r"In '([^']+)': (\w+) raised while composing config:\n(.*)\n\s*full_key: (\S+)", str(exc))
    if isinstance(exc, HydraException) and found:
        file, kind, message, key = found.groups()
        if kind in ("ConfigKeyError", "ConfigAttributeError"):
            return f"conf/{file}.yaml sets {key}, which is not a config key: check the spelling (xffl_like/schema.py)"
        return f"conf/{file}.yaml sets {key}: {message.strip()}"
    resolver = re.search(r"\w+ raised while resolving interpolation: (.*)", str(exc))
    if resolver:  # a resolver's ValueError (conf/hydra/launcher's ${xffl.nodes:...}): its own line
        return resolver[1]
    if isinstance(exc, HydraException) or isinstance(cause, OmegaConfBaseException):
        lines = [line.strip() for text in (str(exc), str(cause or "")) for line in text.splitlines()]
        return "; ".join(
            line for line in lines if line and not line.startswith(("full_key", "object_type", "reference_type"))
        )
    return None


def _missing_launcher_extra(exc: BaseException) -> str | None:
    """The line for ``hydra/launcher=slurm|local_submitit`` without the ``slurm`` extra: their schemas
    (``hydra_plugins/xffl_like_launcher``) are registered only when hydra-submitit-launcher imports."""
    import importlib.util

    found = re.search(
        r"In 'hydra/launcher/([^']+)': Could not (?:load|find) 'hydra/launcher/xffl_\w+_schema'", str(exc)
    )
    if not found:
        return None
    try:
        plugin = importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except (ImportError, ValueError):
        plugin = False
    if plugin:  # the extra is there, xffl_like's own launchers are not: an install of xffl_like without them
        return (
            f"hydra/launcher={found[1]}: hydra_plugins.xffl_like_launcher is not importable; reinstall xffl_like "
            f"(pip install -c constraints.txt -e '.[slurm]')"
        )
    return (
        f"hydra/launcher={found[1]} needs the slurm extra (hydra-submitit-launcher): "
        f"pip install -c constraints.txt -e '.[slurm]'"
    )


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


def validate_distributed(cfg: DistributedConfig, local_world_size: int | None = None) -> None:
    """``distributed.*`` values (the layout they describe is :func:`plan_layout`'s); ``local_world_size``:
    the processes on this node, each of which needs its own GPU under ``backend=nccl``."""
    _positive_int(cfg.nproc_per_node, "distributed.nproc_per_node")
    _positive_int(cfg.timeout_s, "distributed.timeout_s")
    if cfg.timeout_s > MAX_TIMEOUT_S:
        raise ConfigError(
            f"distributed.timeout_s={cfg.timeout_s}: at most {MAX_TIMEOUT_S} (a week); "
            f"use e.g. distributed.timeout_s=1800"
        )
    if cfg.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"distributed.backend={cfg.backend!r}: use auto, gloo or nccl")
    if cfg.backend == "nccl":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        local = local_world_size if local_world_size is not None else cfg.nproc_per_node
        if gpus == 0:
            raise ConfigError(
                "distributed.backend=nccl needs CUDA GPUs, and torch sees none on this machine: "
                "use distributed.backend=auto (gloo on CPU)"
            )
        if gpus < local:
            raise ConfigError(
                f"distributed.backend=nccl needs one GPU per process: {local} processes on this node, "
                f"{gpus} GPU(s): lower distributed.nproc_per_node to {gpus} or use distributed.backend=gloo"
            )


def validate_train(cfg: TrainConfig) -> TrainConfig:
    """``train.*``; the normalised section (:meth:`TrainConfig.from_mapping`)."""
    for key in ("batch_size", "seq_len", "log_every"):
        _positive_int(getattr(cfg, key), f"train.{key}")
    return TrainConfig.from_mapping(as_plain(cfg))


def validate_optim(cfg: OptimConfig) -> OptimConfig:
    """``optim.*``; the normalised section (:meth:`OptimConfig.from_mapping`: floats, a betas pair)."""
    return OptimConfig.from_mapping(as_plain(cfg))


_WANDB_MODES = (None, "offline", "online", "disabled")


def validate_logger(cfg: LoggerConfig) -> None:
    """``logger.*``: the W&B keys are checked whatever the logger (the schema gives every job all of them)."""
    from .observe.observer import LOGGERS

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


def validate_export(cfg: ExportConfig) -> None:
    """``export.*``."""
    if not isinstance(cfg.hf, bool):
        raise ConfigError(f"export.hf={cfg.hf!r}: use true or false")
    _positive_float(cfg.max_shard_mb, "export.max_shard_mb")


def resolve_model(cfg: ModelConfig, base_dir: Path) -> ModelConfig:
    """Check ``model.init``, and for ``model.path`` (a Hugging Face directory) return the section with
    the path absolute and the shape keys from its ``config.json``, checking the safetensors headers
    (workers then build the same shape and read the weights)."""
    if cfg.init not in ("meta", "full"):
        raise ValueError(f"model.init={cfg.init!r}: use meta (shard first, then materialise) or full")
    if cfg.name == "hf" and not cfg.path:
        raise ValueError("model.path is not set: model=hf needs model.path=<local Hugging Face model directory>")
    if not cfg.path:
        return cfg
    from .checkpoint.hf import check_hf_weights, read_hf_config
    from .models import LlamaConfig

    path = Path(cfg.path).expanduser()
    path = (path if path.is_absolute() else base_dir / path).absolute()
    shape = read_hf_config(path)
    # The shape comes from config.json alone: a shape key set beside it (model.dim=..., or a shape
    # preset such as model=llama_tiny) would otherwise be replaced without a word.
    default = ModelConfig()
    given = [f"model.{k}={_override(getattr(cfg, k))}" for k in shape if getattr(cfg, k) != getattr(default, k)]
    if given:
        raise ConfigError(
            f"{', '.join(given)} set together with model.path={cfg.path}: the shape keys come from its "
            f"config.json; drop {'them' if len(given) > 1 else 'it'} (model=hf leaves them unset)"
        )
    cfg = replace(cfg, **shape, path=str(path))
    check_hf_weights(path, LlamaConfig.from_model(cfg))
    return cfg


# ----------------------------------------------------------------------------- relations between sections
def _check_slow_fault(job: JobConfig, layout) -> None:
    """``fault.slow_facility`` / ``slow_factor`` against the layout (a facility of this job, a factor >= 1)."""
    fault = job.fault
    if not is_number(fault.slow_factor) or not 1.0 <= fault.slow_factor <= 1000.0:
        raise ValueError(
            f"fault.slow_factor={fault.slow_factor!r}: must be a number in [1, 1000] (how many times as "
            f"long the slow facility's steps take, e.g. fault.slow_factor=2.0)"
        )
    if fault.slow_facility is None:
        if fault.slow_factor != 1.0:
            raise ValueError(
                f"fault.slow_factor={fault.slow_factor} slows no facility: set fault.slow_facility too "
                f"(e.g. fault.slow_facility=1)"
            )
        return
    if not is_int(fault.slow_facility) or not 0 <= fault.slow_facility < layout.num_facilities:
        raise ValueError(
            f"fault.slow_facility={fault.slow_facility!r}: must be a facility of this job, 0.."
            f"{layout.num_facilities - 1}"
        )


#: The RoPE cos/sin tables are built whole on every rank (``max_seq_len x head_dim/2`` each, fp32): 1 GiB
#: holds 2M positions at head_dim 128, sixteen times Llama 3.1's 131,072.
MAX_ROPE_BYTES = 1 << 30


def _check_parallel_job(job: JobConfig, world_size: int) -> JobConfig:
    """``parallel`` against the other sections; decentralized/bagua: ``distributed.hsdp=1`` (every rank holds a
    full copy: a shard group of one) in the returned job."""
    from . import parallel as P
    from .parallel.options import DP_ALGORITHMS

    pcfg, mode = job.parallel, job.parallel.name
    if mode == "fsdp":
        return job
    dcfg, tcfg, fed = job.distributed, job.train, job.federation
    if dcfg.hsdp not in (None, 1):
        raise ValueError(
            f"distributed.hsdp={dcfg.hsdp!r} shards the model, but parallel={mode} keeps a full copy on "
            f"every rank: drop distributed.hsdp (null) or use parallel=fsdp"
        )
    for key in ("algorithm", "topology", "compression", "weights", "error_feedback", "on_nonfinite"):
        value, default = getattr(fed, key), getattr(FederationConfig(), key)
        if value != default:
            raise ValueError(
                f"federation.{key}={value!r} does not apply to parallel={mode} (the copies are kept in "
                f"step by the {mode} algorithm, no federation rounds): drop it or use parallel=fsdp"
            )
    if fed.outer.name != "average" or fed.outer.lr != 1.0:
        raise ValueError(
            f"federation.outer (name={fed.outer.name!r}, lr={fed.outer.lr!r}) does not apply to "
            f"parallel={mode} (no federation rounds): use federation=default or parallel=fsdp"
        )
    if tcfg.dtype != "float32":  # a full copy per rank, no FSDP mixed-precision policy: nothing would compute in bf16
        raise ValueError(
            f"train.dtype={tcfg.dtype} with parallel={mode}: the full copies train in float32 (no "
            f"mixed precision there); use train.dtype=float32, or parallel=fsdp for bfloat16"
        )
    # Checkpoints would need every rank's own copy (DCP keeps one copy of replicated tensors).
    if job.resume is not None:
        raise ValueError(
            f"resume={job.resume!r}: parallel={mode} writes no checkpoints and cannot resume; "
            f"use parallel=fsdp to resume"
        )
    if job.checkpoint.dir is not None:
        raise ValueError(f"checkpoint.dir={job.checkpoint.dir!r}: parallel={mode} writes no checkpoints; drop it")
    if dcfg.max_restarts:
        raise ValueError(
            f"distributed.max_restarts={dcfg.max_restarts}: restarts resume from a checkpoint, and "
            f"parallel={mode} writes none; use 0"
        )
    if job.fault.nan_rank is not None:
        raise ValueError(
            f"fault.nan_rank: the non-finite guard protects federation rounds, which parallel={mode} "
            f"does not have; drop it"
        )
    facilities = plan_layout(world_size, dcfg.federated, 1).facility_sizes  # an impossible layout: its line
    if mode == "decentralized":
        if tcfg.steps == 1:
            raise ValueError(
                "train.steps=1: parallel=decentralized applies a step's update in the next step's backward "
                "pass (Decent-DP), so one step never updates; use train.steps >= 2"
            )
        if pcfg.topology == "alternating-exp-ring" and len(set(facilities)) > 1:
            raise ValueError(
                f"parallel.topology=alternating-exp-ring needs facilities (its nodes) of equal size, got "
                f"{list(facilities)}: use equal distributed.federated or another topology"
            )
        try:
            P.topology_edges(pcfg.topology, world_size, facilities[0])
        except ValueError as exc:  # impossible sizes: the topology's own line, with the key
            raise ValueError(f"parallel.topology={pcfg.topology}: {exc}") from None
        if pcfg.optimizer.startswith("accum_") or pcfg.optimizer in ("adam", "adamw"):
            if job.optim.name != "adamw":
                raise ValueError(
                    f"parallel.optimizer={pcfg.optimizer} takes lr, betas, eps and weight_decay from "
                    f"optim=adamw, got optim={job.optim.name}: select optim=adamw"
                )
    else:
        if tcfg.grad_accum != 1:
            raise ValueError(
                f"train.grad_accum={tcfg.grad_accum}: parallel=bagua synchronises every backward pass "
                f"(Bagua has no gradient accumulation); use train.grad_accum=1"
            )
        for at, name, options in pcfg.algorithms():
            where = "parallel." if at == 0 else f"parallel.switch (at_step={at}): "
            if at >= tcfg.steps and at > 0:
                raise ValueError(
                    f"{where}at_step={at} is not before the last step (train.steps={tcfg.steps}): "
                    f"switch earlier or drop it"
                )
            algo = DP_ALGORITHMS[name](**options)
            members = len(facilities) if algo.hierarchical else world_size
            if name == "decentralized" and algo.peer_selection_mode == "shift_one" and members > 1 and members % 2:
                what = "facilities (hierarchical: the nodes)" if algo.hierarchical else "processes"
                raise ValueError(
                    f"{where}decentralized with peer_selection_mode=shift_one needs an even number of "
                    f"{what}, got {members}: use peer_selection_mode=all or change the layout"
                )
    return replace(job, distributed=replace(dcfg, hsdp=1))


def validate_config(
    job: JobConfig | Mapping[str, Any],
    world_size: int,
    local_world_size: int | None,
    base_dir: Path,
    choices: Mapping[str, Any] | None = None,
) -> tuple[JobConfig, Layout]:
    """Check ``job`` (built once by :func:`.schema.job_config`) for a job of ``world_size`` processes:
    each section's check once, then the relations between sections, here and nowhere else.

    Returns the validated job that workers receive (normalised ``optim``/``train``, relative data
    and model paths resolved against ``base_dir``, a Hugging Face model's shape, ``distributed.hsdp=1``
    for parallel=decentralized|bagua; via ``dataclasses.replace``) and the planned layout. A plain
    dict is accepted too (it is built with :func:`.schema.job_config` first); ``choices`` (Hydra's
    group -> option of this composition) lets the message for a key the schema lacks name the file.
    """
    from .aggregation import validate_strategy_options
    from .checkpoint.resume import validate_durability
    from .data import check_layout_fits, resolve_paths, validate_data
    from .data.tokenizer import tokenizer_path
    from .federation import check_fragments, validate_federation
    from .federation.elastic import validate_elastic
    from .federation.pace import check_pace_job, facility_steps
    from .models import LlamaConfig, build_model
    from .parallel.options import validate_parallel

    try:
        if not isinstance(job, JobConfig):
            job = job_config(job, choices)
        validate_distributed(job.distributed, local_world_size)
        job = replace(job, train=validate_train(job.train), optim=validate_optim(job.optim))
        if not is_int(job.seed):
            raise ConfigError(f"seed={job.seed!r}: must be an integer")
        if not -(1 << 63) <= job.seed < 1 << 64:  # torch.manual_seed's range: past it every worker fails
            raise ConfigError(f"seed={job.seed}: must be in [-2**63, 2**64) (torch.manual_seed's range); e.g. seed=0")

        validate_logger(job.logger)
        validate_parallel(job.parallel)
        job = _check_parallel_job(job, world_size)
        layout = plan_layout(world_size, job.distributed.federated, job.distributed.hsdp, local_world_size)
        phases = validate_federation(job.federation, layout, steps=job.train.steps)
        # The facility with the fewest steps (federation.every as a list) must finish its warm-up too.
        steps = min(facility_steps(job.federation, f, job.train.steps) for f in range(layout.num_facilities))
        warmup, which = job.optim.warmup_steps, "train.steps" if steps == job.train.steps else "its fewest steps"
        if steps > 0 and warmup > steps:  # the peak lr would never be reached (steps=0: nothing runs)
            raise ConfigError(
                f"optim.warmup_steps={warmup} exceeds {which}={steps}: the learning rate would never "
                f"reach optim.lr; use optim.warmup_steps<={steps}"
            )
        validate_elastic(job, layout)
        validate_durability(job, world_size)
        validate_export(job.export)
        job = replace(job, model=resolve_model(job.model, base_dir))
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        model_cfg = LlamaConfig.from_model(job.model)
    except ValueError as exc:
        raise ConfigError(f"model: {exc}") from None
    train = job.train
    try:
        check_fragments(phases, model_cfg.n_layers)  # fragments are groups of the model's blocks
        check_pace_job(job.federation, parallel=job.parallel.name, eval_every=train.eval_every)
        _check_slow_fault(job, layout)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    rope_bytes = model_cfg.max_seq_len * model_cfg.head_dim * 4  # cos and sin tables, fp32, on every rank
    if rope_bytes > MAX_ROPE_BYTES:
        most = MAX_ROPE_BYTES // (model_cfg.head_dim * 4)
        raise ConfigError(
            f"model.max_seq_len={model_cfg.max_seq_len}: its RoPE tables would take "
            f"{rope_bytes / 2**30:.1f} GiB on every rank; at most {most} positions for head_dim="
            f"{model_cfg.head_dim} (use model.max_seq_len<={most})"
        )
    if train.seq_len > model_cfg.max_seq_len:
        raise ConfigError(
            f"train.seq_len={train.seq_len} exceeds model.max_seq_len={model_cfg.max_seq_len}: "
            f"lower train.seq_len or raise model.max_seq_len"
        )
    try:
        data = job.data
        if data.tokenizer not in (None, "byte"):  # workers and the export read it wherever they run
            data = replace(data, tokenizer=str(tokenizer_path(data.tokenizer, base_dir)))
        num_tokens = validate_data(data, vocab_size=model_cfg.vocab_size, seq_len=train.seq_len, base_dir=str(base_dir))
        if num_tokens is not None:
            check_layout_fits(num_tokens, data, layout, batch_size=train.batch_size, seq_len=train.seq_len)
        if data.path is not None:
            paths = [str(p) for p in resolve_paths(data, str(base_dir))]
            data = replace(data, path=paths if isinstance(data.path, list) else paths[0])
        job = replace(job, data=data)
        meta_model = build_model(job.model, device="meta")  # names and module types, no memory
        names = [name for name, _ in meta_model.named_parameters()]
        validate_strategy_options(job.strategy, names, model=meta_model)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return job, layout
