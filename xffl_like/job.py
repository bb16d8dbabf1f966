"""One job, from a composed config to a summary: validate, launch workers, report.

``run_local`` is the plain ``python -m xffl_like.run`` path (the job launches its own
workers); ``run_under_launcher`` is the torchrun/srun path (this process is a worker).
Either way the config is composed and validated once, by one process, and workers
receive the resolved dict and the one run directory.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from .config import ConfigError, validate_config
from .distributed.launch import WorkerFailure, launch_local

__all__ = ["CONF_DIR", "JobFailed", "run_local", "run_under_launcher", "resolve"]

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


class JobFailed(RuntimeError):
    """The job could not run or a worker failed; ``str(exc)`` is the one line to show."""


def resolve(cfg: DictConfig) -> dict:
    """The plain, resolved config that workers receive (no Hydra node)."""
    if "hydra" in cfg:  # composed with return_hydra_config: Hydra's node is not the job's
        cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def choices(cfg: DictConfig) -> dict | None:
    """Hydra's group -> option of this composition (from ``cfg.hydra`` or the running Hydra app)."""
    from hydra.core.hydra_config import HydraConfig

    if "hydra" in cfg:
        return OmegaConf.to_container(cfg.hydra.runtime.choices)
    return dict(HydraConfig.get().runtime.choices) if HydraConfig.initialized() else None


def _save_config(plain: dict, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(plain), run_dir / "config.yaml")


def run_local(cfg: DictConfig, run_dir: Path, worker: Callable | None = None) -> dict:
    """Validate, then run ``nproc_per_node`` local workers; return rank 0's summary."""
    from .train.loop import train_worker

    started = time.time()
    plain = resolve(cfg)
    nproc = plain["distributed"]["nproc_per_node"]
    try:
        validate_config(plain, nproc, nproc, Path.cwd(), choices(cfg))
    except ConfigError as exc:
        raise JobFailed(str(exc)) from None
    _save_config(plain, run_dir)
    try:
        results = launch_local(worker or train_worker, (plain, str(run_dir), started), nproc, error_dir=run_dir / "errors")
    except WorkerFailure as exc:
        where = f" (traceback: {exc.details})" if exc.details else ""
        raise JobFailed(f"{exc}{where}") from None
    return results[0]


def _compose(overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


def run_under_launcher(overrides: list[str]) -> int:
    """torchrun/srun/mpirun path: rank 0 composes and validates, every rank trains."""
    import torch.distributed as dist

    from .distributed.env import agree_rendezvous
    from .distributed.state import init_default_group, read_env
    from .train.loop import train_worker

    started = time.time()
    env = read_env()
    try:
        env = agree_rendezvous(env)  # under mpirun: MPI agrees on MASTER_ADDR/MASTER_PORT
    except (ValueError, ImportError) as exc:  # e.g. no mpi4py: the line names the extra to install
        if env.rank == 0:
            print(f"error: {exc} (or set MASTER_ADDR and MASTER_PORT)", file=sys.stderr)
        return 2
    # The config is not known yet: the device and groups follow ``auto``; build_state applies
    # distributed.timeout_s to this group once rank 0 has shared the config.
    init_default_group(env, "auto")
    payload: list = [None]
    if env.rank == 0:
        try:
            composed = _compose(overrides)
            plain = resolve(composed)
            validate_config(plain, env.world_size, env.local_world_size, Path.cwd(), choices(composed))
            stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
            run_dir = Path(os.environ.get("XFFL_RUN_DIR") or Path("outputs") / plain["experiment"] / f"{stamp}-torchrun")
            _save_config(plain, run_dir.resolve())
            payload = [(plain, str(run_dir.resolve()), None)]
        except Exception as exc:  # noqa: BLE001 - every rank must learn that the job is off
            payload = [(None, None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)]
    dist.broadcast_object_list(payload, src=0)
    plain, run_dir, error = payload[0]
    if error is not None:
        if env.rank == 0:
            print(f"error: {error}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    try:
        train_worker(plain, run_dir, started)
    except Exception as exc:  # noqa: BLE001 - one line per failing rank, not a traceback
        print(f"error: rank {env.rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
