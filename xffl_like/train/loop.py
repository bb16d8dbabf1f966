"""The worker's entry point: ``train_worker(cfg, run_dir)`` runs in every process.

``cfg`` is the typed :class:`~xffl_like.schema.JobConfig` the launcher validated (workers never start
Hydra); ``run_dir`` is the job's one run directory. The worker builds its
:class:`~xffl_like.distributed.state.DistributedState`, then the :class:`~.trainer.Trainer` (one
skeleton for every job: local steps, evaluations, logging, rounds through a :class:`~.sync.Sync`,
the final evaluation, divergence, export and summary) and trains. Rank 0 returns the summary (and
writes ``summary.json``); other ranks return ``None``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from ..distributed.layout import plan_layout
from ..distributed.state import build_state, read_env
from ..federation import plan_phases
from ..schema import JobConfig
from .trainer import STOP_GRACE_S, build_trainer

__all__ = ["STOP_GRACE_S", "train_worker"]


def train_worker(cfg: JobConfig, run_dir: str, started_at: float | None = None) -> dict | None:
    env = read_env()
    dcfg = cfg.distributed
    layout = plan_layout(env.world_size, dcfg.federated, dcfg.hsdp, env.local_world_size)
    # Exchanges overlapping local steps run on groups of their own (federation.overlap_steps in any phase).
    overlap = cfg.parallel.name == "fsdp" and any(
        phase.config.overlap_steps > 0 for phase in plan_phases(cfg.federation, cfg.train.steps)
    )
    state = build_state(
        layout, env, backend=dcfg.backend, num_streams=cfg.strategy.streams, timeout_s=dcfg.timeout_s, overlap=overlap
    )
    try:
        return build_trainer(cfg, state, Path(run_dir), started_at or time.time()).train()
    finally:
        dist.destroy_process_group()
