"""Per-phase timers, and their comparison across ranks at the end of a job.

Besides each rank's totals, every occurrence of a phase is kept (one per step; one per
round for ``aggregation``), so that the end-of-job table can split each phase's time the
way torchgfn's load-imbalance report does: per iteration, the mean over ranks is *useful
work* and the slowest rank's excess over it (max - mean) is *waiting* (the time the other
ranks spend at the next synchronisation); both summed over iterations. Two ranks with
equal totals can still wait on each other every iteration: totals hide that, this does not.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager

import torch
import torch.distributed as dist

__all__ = ["PHASES", "PhaseTimer", "load_imbalance", "gather_phase_table", "format_phase_table"]

#: Every second of a rank's training loop is in one of them: ``aggregation`` (rounds, their wait for the other
#: facilities included), ``eval`` (local and global evaluations), ``checkpoint`` (saves, or their staging when
#: asynchronous), ``wait`` (the step's loss reduced over the facility and the stop agreement: the time spent
#: waiting for the slowest rank between rounds), ``log`` (every ``train.log_every`` steps, the rows' host sync and
#: their writes: metrics.jsonl, W&B, the progress line).
PHASES = ("data", "forward", "backward", "optimizer", "aggregation", "eval", "checkpoint", "wait", "log")
#: Rows of the table: the phases, then their sum (a rank's whole step).
ROWS = (*PHASES, "total")
#: Above this many ranks the per-rank table lists only the slowest ones.
MAX_RANK_ROWS = 16


class PhaseTimer:
    """Accumulates seconds per phase, and keeps every occurrence's seconds (:attr:`samples`).

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
        # Every occurrence's seconds, per phase: the iterations of the load-imbalance report.
        self._samples: dict[str, list[float]] = {p: [] for p in PHASES}
        self._pending: deque = deque()  # (phase, start event, end event), oldest first

    @contextmanager
    def __call__(self, phase: str, join: bool = False):
        """Time a block as ``phase``; ``join``: the rest of the phase's previous occurrence (one iteration
        in the load-imbalance report: a round's wait for the others, then its exchange)."""
        if self._event is None:
            start = self._clock()
            try:
                yield
            finally:
                self._add(phase, self._clock() - start, join)
            return
        begin, end = self._event(), self._event()
        begin.record()
        try:
            yield
        finally:
            end.record()
            self._pending.append((phase, begin, end, join))
            self._fold(block=False)

    def _add(self, phase: str, seconds: float, join: bool = False) -> None:
        self._seconds[phase] += seconds
        if join and self._samples[phase]:
            self._samples[phase][-1] += seconds
        else:
            self._samples[phase].append(seconds)

    def _fold(self, block: bool) -> None:
        while self._pending:
            phase, begin, end, join = self._pending[0]
            if block:
                end.synchronize()
            elif not end.query():
                return
            self._add(phase, begin.elapsed_time(end) / 1e3, join)  # ms -> s
            self._pending.popleft()

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds per phase so far (on CUDA: waits for the phases still in flight)."""
        self._fold(block=True)
        return dict(self._seconds)

    @property
    def samples(self) -> dict[str, list[float]]:
        """Seconds of every occurrence of each phase so far, in order (on CUDA: waits as above)."""
        self._fold(block=True)
        return {p: list(v) for p, v in self._samples.items()}


def load_imbalance(per_iteration: torch.Tensor) -> tuple[float, float]:
    """(useful, waiting) seconds of one phase from its ``[ranks, iterations]`` times:
    useful = sum over iterations of the mean over ranks, waiting = sum of (max - mean)."""
    if per_iteration.numel() == 0:
        return 0.0, 0.0
    mean = per_iteration.mean(dim=0)
    return float(mean.sum()), float((per_iteration.max(dim=0).values - mean).sum())


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
        out[row] = {
            "mean_s": mean,
            "max_s": worst,
            "max_rank": int(ranks[values.index(worst)]),
            "imbalance": (worst - mean) / step_mean,
        }
    return out


def gather_phase_table(timer: PhaseTimer, state, steps: int) -> dict:
    """Gather every rank's phase times (a collective: every rank calls it); ``steps``: this rank's steps.

    Returns ``per_rank_seconds_per_step`` (rank -> phase -> seconds per step), ``per_rank``
    (rank -> phase -> ``total_s`` and ``average_s`` per occurrence) and, per phase and for
    ``total``, the statistics of :func:`phase_stats` plus ``useful_s``, ``waiting_s`` and
    ``iterations`` from :func:`load_imbalance` (``total``: the phases' sums).
    """
    # One row per phase: [occurrences, seconds of each occurrence..., zero padding].
    samples = timer.samples
    width = torch.tensor([max(len(v) for v in samples.values())], dtype=torch.int64)
    dist.all_reduce(width, op=dist.ReduceOp.MAX)
    # A last row holds the rank's steps (facilities of different paces take different numbers).
    mine = torch.zeros(len(PHASES) + 1, 1 + int(width), dtype=torch.float64)
    for i, phase in enumerate(PHASES):
        mine[i, 0] = len(samples[phase])
        mine[i, 1 : 1 + len(samples[phase])] = torch.tensor(samples[phase], dtype=torch.float64)
    mine[-1, 0] = steps
    table = [torch.zeros_like(mine) for _ in range(state.world_size)]
    dist.all_gather(table, mine)
    everyone, rank_steps = torch.stack(table)[:, :-1], torch.stack(table)[:, -1, 0]  # [ranks, phases, 1 + width]
    totals = everyone[:, :, 1:].sum(dim=2)  # [ranks, phases]
    per_step = totals / rank_steps.clamp(min=1).unsqueeze(1)
    steps = int(rank_steps.max())
    ranks = [str(r) for r in range(state.world_size)]
    out = {"per_rank_seconds_per_step": {r: dict(zip(PHASES, row.tolist())) for r, row in zip(ranks, per_step)}}
    out["per_rank"] = {
        r: {
            p: {"total_s": float(totals[k, i]), "average_s": float(totals[k, i] / max(float(everyone[k, i, 0]), 1.0))}
            for i, p in enumerate(PHASES)
        }
        for k, r in enumerate(ranks)
    }
    out.update(phase_stats(out["per_rank_seconds_per_step"]))
    for i, phase in enumerate(PHASES):
        n = int(everyone[:, i, 0].max())  # every rank runs the same rounds (and steps, but with per-facility paces)
        useful, waiting = load_imbalance(everyone[:, i, 1 : 1 + n])
        out[phase].update(useful_s=useful, waiting_s=waiting, iterations=n)
    out["total"].update(
        useful_s=sum(out[p]["useful_s"] for p in PHASES),
        waiting_s=sum(out[p]["waiting_s"] for p in PHASES),
        iterations=steps,
    )
    return out


def format_phase_table(phases: dict) -> str:
    """Two tables: per phase across ranks (mean, max, slowest rank, imbalance, and the job's
    useful and waiting seconds), then per rank.

    Beyond :data:`MAX_RANK_ROWS` ranks the second table keeps the slowest ranks by total.
    """
    per_rank = phases["per_rank_seconds_per_step"]
    stats = phase_stats(per_rank)  # recomputed: tolerates summaries written before "total"
    lines = [
        f"{'phase':<12}{'mean ms/step':>14}{'max ms/step':>13}{'slowest rank':>14}{'imbalance':>11}"
        f"{'useful s':>11}{'waiting s':>11}"
    ]
    for row in ROWS:
        s = stats[row]
        useful, waiting = (phases.get(row) or {}).get("useful_s"), (phases.get(row) or {}).get("waiting_s")
        split = f"{useful:>11.3f}{waiting:>11.3f}" if useful is not None else f"{'-':>11}{'-':>11}"
        lines.append(
            f"{row:<12}{s['mean_s'] * 1e3:>14.2f}{s['max_s'] * 1e3:>13.2f}{s['max_rank']:>14}{s['imbalance']:>10.1%}"
            + split
        )
    ranks = sorted(per_rank, key=int)
    totals = {r: sum(per_rank[r].values()) for r in ranks}
    shown = (
        ranks
        if len(ranks) <= MAX_RANK_ROWS
        else sorted(sorted(ranks, key=lambda r: -totals[r])[:MAX_RANK_ROWS], key=int)
    )
    title = "ms/step per rank, then the rank's seconds in all phases" + (
        "" if shown == ranks else f" (the {len(shown)} slowest of {len(ranks)} ranks)"
    )
    whole = phases.get("per_rank") or {}
    lines += ["", title, f"{'rank':<6}" + "".join(f"{p:>12}" for p in ROWS) + f"{'seconds':>10}"]
    for r in shown:
        seconds = sum(v["total_s"] for v in whole[r].values()) if r in whole else None
        lines.append(
            f"{r:<6}"
            + "".join(f"{per_rank[r][p] * 1e3:>12.2f}" for p in PHASES)
            + f"{totals[r] * 1e3:>12.2f}"
            + (f"{seconds:>10.3f}" if seconds is not None else f"{'-':>10}")
        )
    return "\n".join(lines)
