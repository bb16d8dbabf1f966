"""The worker's entry point: ``train_worker(cfg, run_dir, started_at, plan)`` runs in every process.

``cfg`` is the typed :class:`~xffl_like.config.schema.JobConfig` the launcher validated (workers never start
Hydra); ``run_dir`` is the job's one run directory. The worker builds its
:class:`~xffl_like.distributed.state.DistributedState`, then the :class:`~.trainer.Trainer` (one
skeleton for every job: local steps, evaluations, logging, rounds through a :class:`~.sync.Sync`,
the final evaluation, divergence, export and summary) and trains. Rank 0 returns the summary (and
writes ``summary.json``); other ranks return ``None``.
"""

from __future__ import annotations

from pathlib import Path

from ..config.plan import WorkerPlan
from ..config.schema import JobConfig
from ..distributed.state import build_state, read_env
from ..parallel.runtime import finish_communication, release_process_groups
from .trainer import STOP_GRACE_S, build_trainer

__all__ = ["STOP_GRACE_S", "train_worker"]


def train_worker(cfg: JobConfig, run_dir: str, started_at: float, plan: WorkerPlan) -> dict | None:
    """Train on this rank: ``plan`` is the launcher's (the layout and the federation's phases)."""
    env, dcfg = read_env(), cfg.distributed
    state = build_state(
        plan.layout, env, backend=dcfg.backend, num_streams=cfg.strategy.streams, timeout_s=dcfg.timeout_s,
        overlap=plan.overlap,
    )  # fmt: skip
    try:
        result = build_trainer(cfg, state, Path(run_dir), started_at, plan.phases).train()
        finish_communication()  # a data-parallel module's last exchange, on every rank (not after a failure)
        return result
    finally:
        # Destroyed is not gone: gloo joins a group's worker threads only when the group's last reference
        # goes, and a worker still releasing a recent collective's tensors in interpreter teardown aborts
        # the process after its last line (parallel.runtime, "at exit"). So drop this frame's state, destroy
        # every group, drop the package's cached groups and collect the cycles holding the rest, now.
        state = None  # noqa: F841
        release_process_groups()  # dist.destroy_process_group() included
