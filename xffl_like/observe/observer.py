"""What a run leaves behind: local metric files, progress, plots, W&B runs, the summary.

Every rank holds an Observer; only the ranks with something to say act on it:

- the first rank of each facility appends that facility's lines to ``metrics.jsonl``
  and, with ``logger=wandb``, holds that facility's W&B run;
- rank 0 writes ``aggregation.csv``, ``summary.json``, ``loss.png`` and
  ``aggregation.png``, and prints the layout, progress and the final tables.

Local files are written whatever the logger. Other ranks print nothing.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..config.schema import LoggerConfig, StrategyConfig, TrainConfig
from .plots import plot_aggregation, plot_losses
from .progress import Progress
from .timing import format_phase_table

if TYPE_CHECKING:
    from ..federation.record import RoundRecord

__all__ = ["AGG_FIELDS", "LOGGERS", "Observer", "bandwidth", "truncate_metrics"]

AGG_FIELDS = (
    "round",
    "step",
    "seconds",
    "bytes_per_rank",
    "cross_facility_bytes",
    "algbw_gbps",
    "busbw_gbps",
    "strategy",
    "streams",
)
LOGGERS = ("none", "wandb")


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"  # None: train.steps=0 trained nothing


def bandwidth(bytes_per_rank: float, seconds: float, num_facilities: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s of one cross-facility all-reduce round, as nccl-tests defines them.

    algbw = bytes reduced per rank / seconds; busbw = algbw * 2(n-1)/n with n the number of
    facilities (the size of the cross-facility group): the per-link traffic of a ring all-reduce.
    """
    if seconds <= 0 or num_facilities < 2:
        return 0.0, 0.0
    algbw = bytes_per_rank / seconds / 1e9
    return algbw, algbw * 2 * (num_facilities - 1) / num_facilities


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the lines of steps after ``step`` (written before a failure, redone after a resume)."""
    if path.is_file():
        keep = [
            line
            for line in path.read_text().splitlines(keepends=True)
            if line.strip() and json.loads(line)["step"] <= step
        ]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(keep))
        tmp.replace(path)


class Observer:
    def __init__(
        self,
        train: TrainConfig,
        strategy: StrategyConfig,
        logger: LoggerConfig,
        state,
        run_dir: Path,
        restored: dict | None = None,
        rounds_at=None,
        *,
        experiment: str,
        config: dict | None = None,
    ):
        """``train`` (``steps``, ``log_every``), ``strategy`` (name and streams, in the round rows) and
        ``logger`` are the job's sections; ``experiment`` names the W&B runs, whose W&B config is ``config``
        (the resolved job config as plain dicts; only read with ``logger=wandb``).
        ``restored``: the ``state.json`` of the checkpoint a resumed job starts from (its
        ``step``, ``rounds`` and ``wandb_ids`` continue the files and W&B runs). ``rounds_at``:
        whether rounds end after a step, as the round clock plans it, for the progress line."""
        self.state, self.run_dir = state, Path(run_dir)
        self.first_step = restored["step"] if restored else 0
        self.steps = train.steps
        self.strategy = strategy.name
        self.streams = strategy.streams
        self.facility_lead = state.facility_rank == 0
        self.lead = state.rank == 0
        if logger.name not in LOGGERS:
            raise ValueError(f"logger.name={logger.name!r}: use one of {', '.join(LOGGERS)}")
        # Facilities may not share a file system: each makes the run directory it writes to.
        if self.facility_lead:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.rounds: list[dict] = [self._complete(r) for r in restored["rounds"]] if restored else []
        if restored or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
            self._drop_redone_steps()
        self.progress = None
        if self.lead:
            self._open_lead_outputs(train.log_every, rounds_at)
        # Line-buffered appends: each line is one write, so facility leads sharing a file
        # system do not cut each other's lines.
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1) if self.facility_lead else None
        self.wandb = None
        if self.facility_lead and logger.name == "wandb":
            self.wandb = self._wandb(logger, restored, experiment, config)

    def _drop_redone_steps(self) -> None:
        """A resumed job, or an elastic restart (even one before any checkpoint), redoes the steps
        after its starting point: their lines from the failed attempt go."""
        if self.lead:
            truncate_metrics(self.run_dir / "metrics.jsonl", self.first_step)
        import torch.distributed as dist

        dist.barrier()  # nobody appends before the file is cut back to the checkpoint's step

    def _open_lead_outputs(self, log_every: int, rounds_at) -> None:
        """Rank 0's progress line (rounds as the federation schedules them; parallel=decentralized|bagua
        have none) and ``aggregation.csv``, rewritten with the rounds so far."""
        self.progress = Progress(self.steps, 0, log_every, facilities=self.state.num_facilities, rounds_at=rounds_at)
        self.progress.print(self.state.layout.describe())
        self._agg_file = open(self.run_dir / "aggregation.csv", "w", newline="")
        self._agg = csv.DictWriter(self._agg_file, fieldnames=AGG_FIELDS)
        self._agg.writeheader()
        self._agg.writerows(self.rounds)

    def _wandb(self, logger: LoggerConfig, restored: dict | None, experiment: str, config: dict | None):
        """This facility's W&B run, continuing the one of ``restored`` (its ``wandb_ids``) if any."""
        from .wandb_logger import WandbLogger

        ids = (restored or {}).get("wandb_ids") or []
        state = self.state
        return WandbLogger(
            logger,
            state,
            self.run_dir,
            ids[state.facility] if state.facility < len(ids) else None,
            experiment=experiment,
            strategy=self.strategy,
            config=config or {},
        )

    def moved(self, by: int) -> None:
        """The step counter moved by ``by`` without training (an elastic facility took the federation's step):
        tokens per second count the steps trained."""
        self.first_step += by

    def step(
        self,
        step: int,
        loss: float,
        lr: float,
        tokens_per_step: int,
        elapsed: float,
        evals: dict | None = None,
        consensus: float | None = None,
    ) -> None:
        """After optimizer step ``step`` (0-based): ``loss`` is this facility's mean loss.

        ``evals`` (when the step evaluated) holds ``loss_local`` and ``loss_global``: per
        facility lists, or ``None``; this facility's values are logged as ``eval/loss_local``
        and ``eval/loss_global``. ``consensus`` (``parallel=decentralized|bagua``, at log steps):
        the mean distance of the copies to their average, logged as ``consensus_distance``
        (``train/consensus_distance`` on W&B).
        """
        done = step + 1
        tokens_per_s = tokens_per_step * (done - self.first_step) / max(elapsed, 1e-9)
        extra = {
            f"eval/{k}": evals[k][self.state.facility]
            for k in ("loss_local", "loss_global")
            if evals is not None and evals.get(k) is not None
        }
        if consensus is not None:
            extra["train/consensus_distance"] = consensus
        if self._metrics is not None:
            line = {"step": done, "facility": self.state.facility, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_s}
            line.update({k.replace("train/", ""): v for k, v in extra.items()})
            self._metrics.write(json.dumps(line) + "\n")
        if self.wandb is not None:
            self.wandb.step(done, loss, lr, tokens_per_s, extra)
        if self.progress is not None:
            self.progress.step(done, loss, tokens_per_s)

    def round(self, record: RoundRecord) -> None:
        """After an aggregation round (its :class:`~xffl_like.federation.record.RoundRecord`)."""
        if not (self.lead or self.wandb is not None):
            return
        row = self._complete({k: getattr(record, k) for k in AGG_FIELDS[:5]})
        if self.wandb is not None:
            taken = record.get("steps_taken")
            self.wandb.round(
                row,
                steps_taken=None if taken is None else taken[self.state.facility],
                waited=record.get("waited"),
                status=record.get("status"),  # a facility of a hub's federation: what the hub made of its update
                reason=record.get("reason"),
            )
        if self.lead:
            self.rounds.append(row)
            self._agg.writerow(row)
            self._agg_file.flush()
            self.progress.round(row)

    def _complete(self, record: dict) -> dict:
        algbw, busbw = bandwidth(record["bytes_per_rank"], record["seconds"], self.state.num_facilities)
        return {
            **{k: record[k] for k in AGG_FIELDS[:5]},
            "algbw_gbps": algbw,
            "busbw_gbps": busbw,
            "strategy": self.strategy,
            "streams": self.streams,
        }

    def abort(self) -> None:
        """The worker is failing: close files and mark the W&B run failed instead of crashed."""
        for f in (self._metrics, getattr(self, "_agg_file", None)):
            if f is not None:
                f.close()
        if self.wandb is not None:
            self.wandb.run.finish(exit_code=1)

    def finish(self, summary: dict | None) -> None:
        """Close the sinks. Rank 0 passes the job's summary; the others ``None``."""
        if self._metrics is not None:
            self._metrics.close()
        if not self.lead:
            if self.wandb is not None:
                self.wandb.finish(None)
            return
        self._final_rounds(summary)
        self.progress.close()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))  # first: the results are safe
        if self.wandb is not None:
            self.wandb.finish(summary)
        notes = []
        try:
            notes.append(
                plot_losses(summary["facility_losses"], [r["step"] for r in self.rounds], self.run_dir / "loss.png")
            )
            notes.append(plot_aggregation(self.rounds, self.run_dir / "aggregation.png"))
        except Exception as exc:  # noqa: BLE001 - a plot must not fail a finished job
            notes.append(f"plots skipped: {type(exc).__name__}: {exc}")
        out = sys.stdout
        print(format_phase_table(summary["phases"]), file=out)
        for note in filter(None, notes):
            print(f"note: {note}", file=out)
        print(
            f"done: {summary['steps']} steps, {summary['rounds']} rounds; loss {_num(summary['first_loss'])} -> "
            f"{_num(summary['final_loss'])}, eval {summary['eval_loss']:.4f}; max divergence "
            f"{summary['max_param_divergence_after_last_round']:.2e}; {summary['tokens_per_second']:,.0f} tok/s; "
            f"aggregation median {summary['aggregation_seconds_median'] * 1e3:.2f} ms, busbw "
            f"{summary['aggregation_busbw_gbps_median']:.3f} GB/s; {summary['wall_seconds']:.1f} s",
            file=out,
        )
        if self.wandb is not None:
            sync = (
                f" (upload: wandb sync {self.run_dir / 'wandb'}/offline-run-*)" if self.wandb.mode == "offline" else ""
            )
            print(f"wandb: {self.wandb.mode} runs in {self.run_dir / 'wandb'}{sync}", file=out)
        print(f"results: {self.run_dir}", file=out, flush=True)

    def _final_rounds(self, summary: dict) -> None:
        """Replace each round's seconds by the slowest rank's (from the summary), recompute the
        bandwidths, rewrite ``aggregation.csv`` and add the per-round bandwidths to the summary."""
        slowest = summary.get("aggregation_seconds", [])
        if len(slowest) == len(self.rounds):
            self.rounds = [self._complete({**r, "seconds": s}) for r, s in zip(self.rounds, slowest)]
        self._agg_file.close()
        with open(self.run_dir / "aggregation.csv", "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=AGG_FIELDS)
            writer.writeheader()
            writer.writerows(self.rounds)
        summary["aggregation_algbw_gbps"] = [r["algbw_gbps"] for r in self.rounds]
        summary["aggregation_busbw_gbps"] = [r["busbw_gbps"] for r in self.rounds]
        seconds = [r["seconds"] for r in self.rounds]
        summary["aggregation_seconds_median"] = statistics.median(seconds) if seconds else 0.0
        busbw = summary["aggregation_busbw_gbps"]
        summary["aggregation_busbw_gbps_median"] = statistics.median(busbw) if busbw else 0.0
