"""Validation of the resolved config in the launching process, before any worker starts.

Every check raises :class:`ConfigError` with one sentence that names the key, the bad
value and how to fix it. Hydra rejects unknown keys and wrong primitive types at compose
time against the schema (:mod:`.schema`); :func:`compose_error` turns its multi-line
report into one such sentence.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from .distributed.layout import Layout, plan_layout
from .checks import is_int, is_number

__all__ = ["ConfigError", "compose_error", "validate_config"]


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
    if typing.get_origin(hint) in (list, typing.List):
        return f"a list of {_describe(args[0]).split(' ', 1)[1]}s" if args else "a list"
    if typing.get_origin(hint) in (dict, typing.Dict):
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


def compose_error(exc: BaseException) -> str | None:
    """One line for an error Hydra or OmegaConf raised while composing the job's config
    (unknown key, wrong type, missing option, unparsable override); None for any other error."""
    import typing
    from dataclasses import MISSING, is_dataclass

    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

    from .schema import section_of, unknown_key_message

    if isinstance(exc, MissingConfigException) and exc.options is not None and exc.missing_cfg_file:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        return (f"{group.replace('/', '.')}={option}: no such option (conf/{exc.missing_cfg_file}.yaml); "
                f"available: {', '.join(exc.options)}")
    if isinstance(exc, OverrideParseException):
        return f"cannot parse an override ({str(exc).splitlines()[0]}): see `python -m xffl_like.run --help`"
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
    if isinstance(exc, HydraException) or isinstance(cause, OmegaConfBaseException):
        lines = [line.strip() for text in (str(exc), str(cause or "")) for line in text.splitlines()]
        return "; ".join(line for line in lines if line and not line.startswith(("full_key", "object_type",
                                                                                  "reference_type")))
    return None


def _get(cfg: dict, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"{dotted} is missing from the config")
        node = node[part]
    return node


def _positive_int(cfg: dict, dotted: str) -> int:
    value = _get(cfg, dotted)
    if not is_int(value) or value <= 0:
        raise ConfigError(f"{dotted}={value!r}: must be a positive integer (e.g. {dotted}=1)")
    return value


def _positive_float(cfg: dict, dotted: str, allow_zero: bool = False) -> float:
    value = _get(cfg, dotted)
    ok = is_number(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ConfigError(f"{dotted}={value!r}: must be a {'non-negative' if allow_zero else 'positive'} number")
    return float(value)


def resolve_model(cfg: dict, base_dir: Path) -> None:
    """Check ``model.init``, and for ``model.path`` (a Hugging Face directory) make the
    path absolute and fill the shape keys from its ``config.json``, checking the safetensors headers
    (in place; workers then build the same shape and read the weights)."""
    model = cfg["model"]
    if model.get("init", "full") not in ("meta", "full"):
        raise ValueError(f"model.init={model.get('init')!r}: use meta (shard first, then materialise) or full")
    path = model.get("path")
    if model.get("name") == "hf" and not path:
        raise ValueError("model.path is not set: model=hf needs model.path=<local Hugging Face model directory>")
    if not path:
        return
    from .checkpoint.hf import check_hf_weights, read_hf_config
    from .models import LlamaConfig

    path = Path(path).expanduser()
    path = (path if path.is_absolute() else base_dir / path).absolute()
    model.update(read_hf_config(path), path=str(path))
    check_hf_weights(path, LlamaConfig.from_mapping(model))


_WANDB_MODES = (None, "offline", "online", "disabled")


def _check_logger(cfg: dict) -> None:
    from .observe.observer import LOGGERS

    lcfg = cfg.get("logger") or {}
    logger = lcfg.get("name", "none")
    if logger not in LOGGERS:
        raise ConfigError(f"logger.name={logger!r}: use one of {', '.join(LOGGERS)} (e.g. logger=none)")
    # The W&B keys are checked whatever the logger: the schema gives every job all of them.
    if lcfg.get("mode") not in _WANDB_MODES:
        raise ConfigError(f"logger.mode={lcfg.get('mode')!r}: use null ($WANDB_MODE, else offline), offline, online or disabled")
    for key in ("project", "entity", "group"):
        if lcfg.get(key) is not None and not isinstance(lcfg.get(key), str):
            raise ConfigError(f"logger.{key}={lcfg.get(key)!r}: must be a string{'' if key == 'project' else ' or null'}")
    tags = lcfg.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ConfigError(f"logger.tags={tags!r}: must be a list of strings (e.g. logger.tags=[a,b])")


def validate_config(
    cfg: dict, world_size: int, local_world_size: int | None, base_dir: Path, choices: Mapping[str, Any] | None = None
) -> Layout:
    """Check ``cfg`` (a resolved plain dict) for a job of ``world_size`` processes.

    Resolves relative data paths against ``base_dir`` in place, so that workers read
    the files the user named wherever they run. Keys the schema lacks (added with ``+``)
    are refused first; ``choices`` (Hydra's group -> option of this composition) lets that
    message name the option's file. Returns the planned layout; :func:`.schema.job_config`
    then gives the typed config that workers receive.
    """
    from .aggregation import validate_strategy_options
    from .data import check_layout_fits, resolve_paths, validate_data
    from .data.tokenizer import tokenizer_path
    from .models import LlamaConfig, build_model
    from .schema import DataConfig, OptimConfig, TrainConfig, check_keys

    try:
        check_keys(cfg, choices)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _positive_int(cfg, "distributed.nproc_per_node")
    _positive_int(cfg, "distributed.timeout_s")
    for key in ("federation.every", "train.batch_size", "train.seq_len", "train.log_every"):
        _positive_int(cfg, key)
    try:
        OptimConfig.from_mapping(_get(cfg, "optim"))
        TrainConfig.from_mapping(_get(cfg, "train"))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if _get(cfg, "distributed.backend") not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"distributed.backend={cfg['distributed']['backend']!r}: use auto, gloo or nccl")
    if not isinstance(cfg.get("seed"), int) or isinstance(cfg.get("seed"), bool):
        raise ConfigError(f"seed={cfg.get('seed')!r}: must be an integer")
    _check_logger(cfg)
    dist_cfg = cfg["distributed"]
    from .train.dataparallel import validate_parallel

    try:
        validate_parallel(cfg, world_size)  # parallel=decentralized|bagua: full copies (sets distributed.hsdp=1)
        layout = plan_layout(world_size, dist_cfg["federated"], dist_cfg["hsdp"], local_world_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    from .checkpoint.resume import validate_durability
    from .federation import validate_federation

    try:
        validate_federation(_get(cfg, "federation"), layout, steps=_get(cfg, "train.steps"))
        validate_durability(cfg, world_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None

    if not isinstance(_get(cfg, "export.hf"), bool):
        raise ConfigError(f"export.hf={cfg['export']['hf']!r}: use true or false")
    _positive_float(cfg, "export.max_shard_mb")
    try:
        resolve_model(cfg, base_dir)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        model_cfg = LlamaConfig.from_mapping(cfg["model"])
    except ValueError as exc:
        raise ConfigError(f"model: {exc}") from None
    try:  # fragments are groups of the model's blocks
        validate_federation(cfg["federation"], layout, steps=cfg["train"]["steps"], num_layers=model_cfg.n_layers)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg["train"]["seq_len"] > model_cfg.max_seq_len:
        raise ConfigError(
            f"train.seq_len={cfg['train']['seq_len']} exceeds model.max_seq_len={model_cfg.max_seq_len}: "
            f"lower train.seq_len or raise model.max_seq_len"
        )
    try:
        if cfg["data"].get("tokenizer") not in (None, "byte"):  # workers and the export read it wherever they run
            cfg["data"]["tokenizer"] = str(tokenizer_path(cfg["data"]["tokenizer"], base_dir))
        data = DataConfig(**cfg["data"])
        num_tokens = validate_data(data, vocab_size=model_cfg.vocab_size, seq_len=cfg["train"]["seq_len"],
                                   base_dir=str(base_dir))
        if num_tokens is not None:
            check_layout_fits(num_tokens, data, layout, batch_size=cfg["train"]["batch_size"],
                              seq_len=cfg["train"]["seq_len"])
        if data.path is not None:
            paths = [str(p) for p in resolve_paths(data, str(base_dir))]
            cfg["data"]["path"] = paths if isinstance(cfg["data"]["path"], list) else paths[0]
        meta_model = build_model(cfg["model"], device="meta")  # names and module types, no memory
        names = [name for name, _ in meta_model.named_parameters()]
        validate_strategy_options(cfg["strategy"], names, model=meta_model)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return layout
