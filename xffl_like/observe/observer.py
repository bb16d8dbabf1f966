"""What a run leaves behind: local metric files, progress lines, the summary.

Every rank holds an Observer; only the ranks with something to say write:
the first rank of each facility writes that facility's lines of ``metrics.jsonl``,
rank 0 writes ``aggregation.csv``, ``summary.json`` and prints progress.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from .timing import format_phase_table

__all__ = ["Observer"]

AGG_FIELDS = ("round", "step", "seconds", "bytes_per_rank", "cross_facility_bytes")


class Observer:
    def __init__(self, cfg: dict, state, run_dir: Path):
        self.cfg, self.state, self.run_dir = cfg, state, Path(run_dir)
        self.every = cfg["federation"]["every"]
        self.steps = cfg["train"]["steps"]
        self.log_every = cfg["train"]["log_every"]
        self.facility_lead = state.facility_rank == 0
        self.lead = state.rank == 0
        self._metrics = open(self.run_dir / "metrics.jsonl", "a") if self.facility_lead else None
        self._agg = None
        if self.lead:
            self._agg_file = open(self.run_dir / "aggregation.csv", "w", newline="")
            self._agg = csv.DictWriter(self._agg_file, fieldnames=AGG_FIELDS)
            self._agg.writeheader()
            print(state.layout.describe(), flush=True)

    def step(self, step: int, loss: float, lr: float, tokens_per_step: int, elapsed: float) -> None:
        tokens_per_s = tokens_per_step * (step + 1) / max(elapsed, 1e-9)
        if self._metrics is not None:
            line = {"step": step + 1, "facility": self.state.facility, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_s}
            self._metrics.write(json.dumps(line) + "\n")
        if self.lead and ((step + 1) % self.log_every == 0 or step == 0 or step + 1 == self.steps):
            to_round = self.every - (step + 1) % self.every if (step + 1) % self.every else 0
            print(f"step {step + 1:>5}/{self.steps}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  "
                  f"next aggregation in {to_round} steps", flush=True)

    def round(self, record: dict) -> None:
        if self._agg is not None:
            self._agg.writerow({k: record[k] for k in AGG_FIELDS})
            self._agg_file.flush()

    def finish(self, summary: dict | None) -> None:
        if self._metrics is not None:
            self._metrics.close()
        if not self.lead:
            return
        self._agg_file.close()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(format_phase_table(summary["phases"]), flush=True)
        print(
            f"done: {summary['steps']} steps, {summary['rounds']} rounds; loss {summary['first_loss']:.4f} -> "
            f"{summary['final_loss']:.4f}, eval {summary['eval_loss']:.4f}; max divergence "
            f"{summary['max_param_divergence_after_last_round']:.2e}; {summary['tokens_per_second']:,.0f} tok/s; "
            f"{summary['wall_seconds']:.1f} s\nresults: {self.run_dir}",
            flush=True,
        )
