"""Weights & Biases: one run per facility, all runs of a job in one group.

Only the first rank of each facility holds a :class:`WandbLogger`; ``wandb`` is imported
when one is built (``logger=wandb``), never otherwise. Runs are written under
``<run_dir>/wandb``; the mode is ``logger.mode``, else ``WANDB_MODE``, else ``offline``,
so a job needs neither network nor API key (upload later with ``wandb sync``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..config.schema import LoggerConfig

__all__ = ["WandbLogger", "load_summary", "wandb_group", "wandb_mode", "wandb_run_ids", "wandb_run_name"]

# Quiet by default: no banner, no git or code capture, no console capture (rank 0 draws
# its own progress). A user's own settings of these variables win.
_QUIET_ENV = {
    "WANDB_SILENT": "true",
    "WANDB_DISABLE_GIT": "true",
    "WANDB_DISABLE_CODE": "true",
    "WANDB_CONSOLE": "off",
}


def wandb_mode(logger: LoggerConfig, environ=os.environ) -> str:
    return logger.mode or environ.get("WANDB_MODE") or "offline"


def wandb_group(logger: LoggerConfig, experiment: str, run_dir: Path) -> str:
    """``logger.group``, else experiment + run-dir name (+ the sweep's dir name for a sweep job).

    A sweep job's directory (``<sweep>/<num>_<strategy>``) is named only within its sweep,
    so the sweep directory's name (its time stamp) is prefixed to keep groups unique.
    """
    if logger.group:
        return str(logger.group)
    run_dir = Path(run_dir)
    in_sweep = (run_dir.parent / "multirun.yaml").exists()
    name = f"{run_dir.parent.name}-{run_dir.name}" if in_sweep else run_dir.name
    return f"{experiment}-{name}"


def wandb_run_ids(run_dir: Path, num_facilities: int) -> list[str]:
    """One W&B run id per facility, derived from the run directory: a resumed or restarted
    job (same run directory; the ids are also kept in its checkpoints) logs to the same runs."""
    digest = hashlib.sha1(str(Path(run_dir).absolute()).encode()).hexdigest()[:12]
    return [f"{digest}-f{f}" for f in range(num_facilities)]


def wandb_run_name(experiment: str, strategy: str, facility: int) -> str:
    return f"{experiment}-{strategy}-f{facility}"


def load_summary(phases: dict) -> dict:
    """W&B summary keys of the load-imbalance report: ``load/<phase>/useful_s`` and
    ``load/<phase>/waiting_s`` per phase and for ``total``, ``load/rank<r>/total_s`` and
    ``load/rank<r>/average_s`` (seconds per step) per rank over all phases."""
    from .timing import ROWS

    out = {
        f"load/{row}/{k}": phases[row][k]
        for row in ROWS
        if row in phases
        for k in ("useful_s", "waiting_s")
        if k in phases[row]
    }
    for rank, by_phase in (phases.get("per_rank") or {}).items():
        out[f"load/rank{rank}/total_s"] = sum(v["total_s"] for v in by_phase.values())
        out[f"load/rank{rank}/average_s"] = sum((phases["per_rank_seconds_per_step"][rank]).values())
    return out


class WandbLogger:
    """The W&B run of one facility (built on that facility's first rank).

    ``logger``: the ``logger`` section; ``experiment`` and ``strategy`` (its name) name the run and group;
    ``config``: the resolved job config as plain dicts (``schema.as_plain``), recorded whole as the run's
    W&B config so that runs can be filtered and compared by any key.
    """

    def __init__(
        self,
        logger: LoggerConfig,
        state,
        run_dir: Path,
        run_id: str | None = None,
        *,
        experiment: str,
        strategy: str,
        config: dict,
    ):
        for key, value in _QUIET_ENV.items():
            os.environ.setdefault(key, value)
        import wandb  # lazy: only jobs with logger=wandb pay for it

        self.mode = wandb_mode(logger)
        self.dir = Path(run_dir)
        config = dict(config)
        config["job"] = {
            "facility": state.facility,
            "num_facilities": state.num_facilities,
            "facility_size": state.facility_size,
            "world_size": state.world_size,
            "run_dir": str(run_dir),
        }
        self.run = wandb.init(
            project=logger.project or "xffl_like",
            entity=logger.entity,
            group=wandb_group(logger, experiment, run_dir),
            name=wandb_run_name(experiment, strategy, state.facility),
            job_type="train",
            tags=list(logger.tags or []) + [f"facility{state.facility}", strategy],
            config=config,
            dir=str(self.dir),
            mode=self.mode,
            id=run_id or wandb_run_ids(run_dir, state.num_facilities)[state.facility],
            resume="allow",  # a resumed job continues its facility's run
            settings=wandb.Settings(silent=True, disable_git=True, disable_code=True, save_code=False, console="off"),
        )

    def step(self, step: int, loss: float, lr: float, tokens_per_s: float, extra: dict | None = None) -> None:
        """``extra``: further keys of this step, e.g. ``eval/loss_local`` and ``eval/loss_global``."""
        self.run.log(
            {"train/loss": loss, "train/lr": lr, "train/tokens_per_s": tokens_per_s, **(extra or {})}, step=step
        )

    def round(
        self,
        record: dict,
        steps_taken: int | None = None,
        waited: float | None = None,
        status: str | None = None,
        reason: str | None = None,
    ) -> None:
        """One round's row; ``steps_taken``: this facility's steps in the round (per-facility paces);
        ``waited``: this rank's wait there for the other facilities; ``status`` and ``reason``: what the hub
        made of this facility's contribution (``round/status``, ``round/accepted`` 1 or 0 for charts, and
        ``round/reason``: why it was rejected, healed or missed)."""
        keys = (
            "round",
            "seconds",
            "bytes_per_rank",
            "cross_facility_bytes",
            "algbw_gbps",
            "busbw_gbps",
            "strategy",
            "streams",
        )
        row = {f"aggregation/{k}": record[k] for k in keys}
        if steps_taken is not None:
            row["round/steps_taken"] = steps_taken
        if waited is not None:
            row["round/waited_s"] = waited
        if status is not None:
            row["round/status"], row["round/accepted"] = status, int(status == "accepted")
            if reason:
                row["round/reason"] = reason
        self.run.log(row, step=record["step"])

    def finish(self, summary: dict | None) -> None:
        if summary is not None:  # rank 0: the job's results, on facility 0's run
            keys = (
                "final_loss",
                "eval_loss",
                "tokens_per_second",
                "train_seconds",
                "wall_seconds",
                "max_param_divergence_after_last_round",
                "aggregation_seconds_median",
                "aggregation_busbw_gbps_median",
                "final_consensus_distance",
            )
            self.run.summary.update({f"job/{k}": summary[k] for k in keys if k in summary})
            self.run.summary.update(load_summary(summary.get("phases") or {}))
        self.run.finish()
