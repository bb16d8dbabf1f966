"""Validation of the resolved config in the launching process, before any worker starts.

Every check raises :class:`ConfigError` with one sentence that names the key, the bad
value and how to fix it. Hydra itself rejects unknown keys and groups at compose time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from .distributed.layout import Layout, plan_layout

__all__ = ["ConfigError", "validate_config"]


class ConfigError(ValueError):
    """A config value that cannot work; the message is the one line shown to the user."""


def _get(cfg: dict, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"{dotted} is missing from the config")
        node = node[part]
    return node


def _positive_int(cfg: dict, dotted: str) -> int:
    value = _get(cfg, dotted)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{dotted}={value!r}: must be a positive integer (e.g. {dotted}=1)")
    return value


def _positive_float(cfg: dict, dotted: str, allow_zero: bool = False) -> float:
    value = _get(cfg, dotted)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
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
    if logger != "wandb":
        return
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
    the files the user named wherever they run. ``choices`` (Hydra's group -> option of
    this composition) enables the unknown-key check of :mod:`.config_keys`. Returns the
    planned layout.
    """
    from .aggregation import validate_strategy_options
    from .config_keys import check_known_keys
    from .data import check_layout_fits, resolve_paths, validate_data
    from .data.tokenizer import tokenizer_path
    from .models import LlamaConfig, build_model
    from .train.optim import OptimConfig
    from .train.step import TrainConfig

    if choices is not None:
        try:
            check_known_keys(cfg, choices, Path(__file__).resolve().parents[1] / "conf")
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
        num_tokens = validate_data(cfg["data"], vocab_size=model_cfg.vocab_size, seq_len=cfg["train"]["seq_len"],
                                   base_dir=str(base_dir))
        if num_tokens is not None:
            check_layout_fits(num_tokens, cfg["data"], layout, batch_size=cfg["train"]["batch_size"],
                              seq_len=cfg["train"]["seq_len"])
        if "path" in cfg["data"]:
            paths = [str(p) for p in resolve_paths(cfg["data"], str(base_dir))]
            cfg["data"]["path"] = paths if isinstance(cfg["data"]["path"], list) else paths[0]
        meta_model = build_model(cfg["model"], device="meta")  # names and module types, no memory
        names = [name for name, _ in meta_model.named_parameters()]
        validate_strategy_options(cfg["strategy"], names, model=meta_model)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return layout
