"""The end of a run, shared by both worker loops: the per-facility loss table and ``summary.json``.

:mod:`.loop` (FSDP/HSDP with federated rounds) and :mod:`.dataparallel_loop`
(``parallel=decentralized|bagua``) end the same way; their summaries carry the same keys
(docs/outputs.md), so that sweeps, ``bench.wan`` and W&B read either one alike.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..distributed.state import DistributedState

__all__ = ["gather_facility_losses", "job_summary"]


def gather_facility_losses(losses: torch.Tensor, state: DistributedState) -> torch.Tensor:
    """Every rank's ``[facilities, steps]`` table, in place, from rows each rank filled for its
    own facility only: the other rows are zeroed and the sum over ranks / facility size restores
    each row (a collective: every rank calls it)."""
    for f in range(state.num_facilities):
        if f != state.facility:
            losses[f].zero_()
    losses /= state.facility_size
    dist.all_reduce(losses)
    return losses


def job_summary(cfg, state: DistributedState, *, losses: torch.Tensor, steps: int, trained_steps: int,
                tokens_per_step: int, train_seconds: float, train_started_at: float, started_at: float,
                eval_loss: float, evals: list[dict], divergence: float, phases: dict, setup_rss: torch.Tensor,
                rounds: list[dict] | None = None, strategy: dict | None = None, federation: dict | None = None,
                checkpoints=None, extra: dict | None = None) -> dict:
    """The summary (rank 0): ``losses`` from :func:`gather_facility_losses`, ``trained_steps`` the
    steps this process ran (fewer than ``steps`` after a resume), ``rounds`` the round records
    (none without federated rounds), ``extra`` keys of one loop only (e.g. ``parallel``)."""
    rounds = rounds or []
    per_step = losses.mean(dim=0)
    return {
        "experiment": cfg["experiment"],
        "world_size": state.world_size,
        "layout": {
            "facility_sizes": list(state.layout.facility_sizes),
            "shard_size": state.layout.shard_size,
            "replicas_per_facility": list(state.layout.replicas),
        },
        "strategy": strategy,
        "federation": federation,
        **(extra or {}),
        "steps": steps,
        "rounds": len(rounds),
        "first_loss": float(per_step[0]) if steps else None,
        "final_loss": float(per_step[-1]) if steps else None,
        "eval_loss": eval_loss,
        "eval_history": evals,
        "max_param_divergence_after_last_round": divergence,
        "aggregation_seconds": [r["seconds"] for r in rounds],
        "aggregation_bytes_per_rank": [r["bytes_per_rank"] for r in rounds],
        "cross_facility_bytes_per_round": [r["cross_facility_bytes"] for r in rounds],
        "facility_losses": losses.tolist(),
        "skipped_facilities": [r["skipped_facilities"] for r in rounds],
        "round_records": [{"step": r["step"], "phase": r.get("phase", 0), "fragment": r.get("fragment"),
                           "switch": bool(r.get("switch", False)), "started_step": r.get("started_step", r["step"])}
                          for r in rounds],
        "checkpoints": checkpoints,
        "tokens_per_second": tokens_per_step * trained_steps / train_seconds if trained_steps else 0.0,
        "train_seconds": train_seconds,
        "train_started_at": train_started_at,
        "phases": phases,
        "setup_peak_rss_mb": float(setup_rss),
        "wall_seconds": time.time() - started_at,
    }
