"""Per-phase timers, and their comparison across ranks at the end of a job."""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager

import torch
import torch.distributed as dist

__all__ = ["PHASES", "PhaseTimer", "gather_phase_table", "format_phase_table"]

PHASES = ("data", "forward", "backward", "optimizer", "aggregation")
#: Rows of the table: the phases, then their sum (a rank's whole step).
ROWS = (*PHASES, "total")
#: Above this many ranks the per-rank table lists only the slowest ones.
MAX_RANK_ROWS = 16


class PhaseTimer:
    """Accumulates seconds per phase.

    On CPU: wall seconds (``clock``). On CUDA: a pair of timing events recorded on the
    current stream at each phase's edges, so kernels are charged to the phase that launched
    them without stalling the host at every edge (a synchronise per phase would serialise
    the CPU's run-ahead with the GPU and itself slow the step). Finished pairs are folded
    in without blocking as later phases end; :attr:`seconds` waits for the rest.
    ``event`` (a factory of objects with CUDA events' ``record``, ``query``,
    ``synchronize`` and ``elapsed_time``) is for tests.
    """

    def __init__(self, device: torch.device, *, clock=time.perf_counter, event=None):
        self.device = torch.device(device)
        self._clock = clock
        self._event = None
        if self.device.type == "cuda":
            self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._seconds = dict.fromkeys(PHASES, 0.0)
        self._pending: deque = deque()  # (phase, start event, end event), oldest first

    @contextmanager
    def __call__(self, phase: str):
        if self._event is None:
            start = self._clock()
            try:
                yield
            finally:
                self._seconds[phase] += self._clock() - start
            return
        begin, end = self._event(), self._event()
        begin.record()
        try:
            yield
        finally:
            end.record()
            self._pending.append((phase, begin, end))
            self._fold(block=False)

    def _fold(self, block: bool) -> None:
        while self._pending:
            phase, begin, end = self._pending[0]
            if block:
                end.synchronize()
            elif not end.query():
                return
            self._seconds[phase] += begin.elapsed_time(end) / 1e3  # ms -> s
            self._pending.popleft()

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds per phase so far (on CUDA: waits for the phases still in flight)."""
        self._fold(block=True)
        return dict(self._seconds)


def phase_stats(per_rank: dict[str, dict[str, float]]) -> dict:
    """Per row of :data:`ROWS`: mean and max over ranks, the slowest rank, and the imbalance.

    ``per_rank`` maps rank (as a string) to seconds per step per phase. ``imbalance`` is
    (max - mean) as a share of the mean step time, so 0.1 means the slowest rank spends a
    tenth of a step more in that row than the average rank.
    """
    ranks = sorted(per_rank, key=int)
    rows = {r: {**{p: per_rank[r][p] for p in PHASES}, "total": sum(per_rank[r][p] for p in PHASES)} for r in ranks}
    step_mean = sum(rows[r]["total"] for r in ranks) / len(ranks) or 1.0
    out = {}
    for row in ROWS:
        values = [rows[r][row] for r in ranks]
        mean, worst = sum(values) / len(values), max(values)
        out[row] = {"mean_s": mean, "max_s": worst, "max_rank": int(ranks[values.index(worst)]),
                    "imbalance": (worst - mean) / step_mean}
    return out


def gather_phase_table(timer: PhaseTimer, state, steps: int) -> dict:
    """Gather every rank's phase totals (a collective: every rank calls it).

    Returns ``per_rank_seconds_per_step`` (rank -> phase -> seconds per step) and, per
    phase and for ``total``, the statistics of :func:`phase_stats`.
    """
    seconds = timer.seconds
    mine = torch.tensor([seconds[p] for p in PHASES], dtype=torch.float64)
    table = [torch.zeros_like(mine) for _ in range(state.world_size)]
    dist.all_gather(table, mine)
    per_rank = torch.stack(table) / max(steps, 1)  # seconds per step, [ranks, phases]
    out = {"per_rank_seconds_per_step": {str(r): dict(zip(PHASES, row.tolist())) for r, row in enumerate(per_rank)}}
    out.update(phase_stats(out["per_rank_seconds_per_step"]))
    return out


def format_phase_table(phases: dict) -> str:
    """Two tables: per phase across ranks (mean, max, slowest rank, imbalance), then per rank.

    Beyond :data:`MAX_RANK_ROWS` ranks the second table keeps the slowest ranks by total.
    """
    per_rank = phases["per_rank_seconds_per_step"]
    stats = phase_stats(per_rank)  # recomputed: tolerates summaries written before "total"
    lines = [f"{'phase':<12}{'mean ms/step':>14}{'max ms/step':>13}{'slowest rank':>14}{'imbalance':>11}"]
    for row in ROWS:
        s = stats[row]
        lines.append(f"{row:<12}{s['mean_s'] * 1e3:>14.2f}{s['max_s'] * 1e3:>13.2f}{s['max_rank']:>14}{s['imbalance']:>10.1%}")
    ranks = sorted(per_rank, key=int)
    totals = {r: sum(per_rank[r].values()) for r in ranks}
    shown = ranks if len(ranks) <= MAX_RANK_ROWS else sorted(
        sorted(ranks, key=lambda r: -totals[r])[:MAX_RANK_ROWS], key=int)
    title = "ms/step per rank" + ("" if shown == ranks else f" (the {len(shown)} slowest of {len(ranks)} ranks)")
    lines += ["", title, f"{'rank':<6}" + "".join(f"{p:>12}" for p in ROWS)]
    for r in shown:
        lines.append(f"{r:<6}" + "".join(f"{per_rank[r][p] * 1e3:>12.2f}" for p in PHASES) + f"{totals[r] * 1e3:>12.2f}")
    return "\n".join(lines)
