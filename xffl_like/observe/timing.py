"""Per-phase timers, and their comparison across ranks at the end of a job."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

__all__ = ["PHASES", "PhaseTimer", "gather_phase_table", "format_phase_table"]

PHASES = ("data", "forward", "backward", "optimizer", "aggregation")


class PhaseTimer:
    """Accumulates wall seconds per phase; on CUDA it synchronises at phase edges so
    that asynchronous kernels are charged to the phase that launched them."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def __call__(self, phase: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[phase] += time.perf_counter() - start


def gather_phase_table(timer: PhaseTimer, state, steps: int) -> dict:
    """Gather every rank's phase totals; per phase the mean, max and imbalance over ranks.

    ``imbalance`` is (max - mean) as a share of the mean step time, so 0.1 means the
    slowest rank spends a tenth of a step more in that phase than the average rank.
    """
    mine = torch.tensor([timer.seconds[p] for p in PHASES], dtype=torch.float64)
    table = [torch.zeros_like(mine) for _ in range(state.world_size)]
    dist.all_gather(table, mine)
    per_rank = torch.stack(table) / max(steps, 1)  # seconds per step, [ranks, phases]
    step_mean = float(per_rank.sum(dim=1).mean()) or 1.0
    out = {"per_rank_seconds_per_step": {str(r): dict(zip(PHASES, row.tolist())) for r, row in enumerate(per_rank)}}
    for i, phase in enumerate(PHASES):
        mean, worst = float(per_rank[:, i].mean()), float(per_rank[:, i].max())
        out[phase] = {"mean_s": mean, "max_s": worst, "imbalance": (worst - mean) / step_mean}
    return out


def format_phase_table(phases: dict) -> str:
    lines = [f"{'phase':<12}{'mean ms/step':>14}{'max ms/step':>13}{'imbalance':>11}"]
    for phase in PHASES:
        row = phases[phase]
        lines.append(f"{phase:<12}{row['mean_s'] * 1e3:>14.2f}{row['max_s'] * 1e3:>13.2f}{row['imbalance']:>10.1%}")
    return "\n".join(lines)
