"""PNG plots of a run and of a sweep (matplotlib, imported lazily, no pyplot state).

Every function returns ``None`` when it wrote its file, else one line saying why not
(matplotlib missing, nothing to plot), for the caller to print.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

__all__ = ["plot_losses", "plot_aggregation", "plot_sweep", "plot_eval_curves"]


def _figure(width: float = 7.0, height: float = 4.0):
    """A matplotlib Figure drawn with Agg, or ``None`` when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


_NO_MPL = "matplotlib is not installed (pip install 'xffl_like[plots]')"


def _integer_ticks():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def plot_losses(facility_losses: Sequence[Sequence[float]], round_steps: Sequence[int], path: Path) -> str | None:
    """Training loss per facility against the step (None: no step taken); dashed lines at aggregation rounds."""
    fig = _figure()
    if fig is None:
        return f"{Path(path).name} skipped: {_NO_MPL}"
    ax = fig.add_subplot()
    for f, losses in enumerate(facility_losses):  # None: a step the facility did not take (a gap)
        values = [float("nan") if v is None else v for v in losses]
        ax.plot(range(1, len(values) + 1), values, label=f"facility {f}", linewidth=1.2)
    for i, step in enumerate(round_steps):
        ax.axvline(
            step, color="grey", linestyle="--", linewidth=0.7, alpha=0.6, label="aggregation" if i == 0 else None
        )
    ax.xaxis.set_major_locator(_integer_ticks())
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (facility mean)")
    ax.set_title("Loss per facility")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return None


def plot_aggregation(rounds: Sequence[dict], path: Path) -> str | None:
    """Seconds of each aggregation round (slowest rank); rounds with no number (an elastic facility's missed
    rounds, a join that only healed) are not plotted."""
    rounds = [r for r in rounds if r.get("round") is not None and r.get("seconds") is not None]
    if not rounds:
        return f"{Path(path).name} skipped: no aggregation round"
    fig = _figure()
    if fig is None:
        return f"{Path(path).name} skipped: {_NO_MPL}"
    ax = fig.add_subplot()
    ms = [r["seconds"] * 1e3 for r in rounds]
    ax.bar([r["round"] for r in rounds], ms, color="tab:blue")
    median = statistics.median(ms)
    ax.axhline(median, color="tab:orange", linewidth=1, label=f"median {median:.3g} ms")
    ax.xaxis.set_major_locator(_integer_ticks())
    ax.legend()
    ax.set_xlabel("round")
    ax.set_ylabel("aggregation time (ms, slowest rank)")
    ax.set_title("Aggregation time per round")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return None


def plot_sweep(jobs: Sequence[tuple[str, Sequence[float]]], path: Path) -> str | None:
    """One box per job (label, per-round aggregation seconds): median, quartiles, min-max whiskers."""
    jobs = [(label, list(seconds)) for label, seconds in jobs if seconds]
    if not jobs:
        return f"{Path(path).name} skipped: no finished job with aggregation rounds"
    fig = _figure(width=max(6.0, 1.0 + 0.9 * len(jobs)), height=4.8)
    if fig is None:
        return f"{Path(path).name} skipped: {_NO_MPL}"
    ax = fig.add_subplot()
    data = [[s * 1e3 for s in seconds] for _, seconds in jobs]
    ax.boxplot(data, whis=(0, 100))  # whiskers at min and max: nothing drawn as an outlier
    ax.set_xticks(range(1, len(jobs) + 1), [label for label, _ in jobs], rotation=30, ha="right", fontsize=8)
    lo, hi = min(min(d) for d in data), max(max(d) for d in data)
    if lo > 0 and hi / lo > 30:
        ax.set_yscale("log")
    ax.set_ylabel("aggregation time per round (ms)")
    ax.set_title("Aggregation time per job (median, quartiles, min-max)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return None


def plot_eval_curves(
    curves: dict[str, Sequence[dict]], target: float | None, link_mbit: float, path: Path
) -> str | None:
    """Eval loss against wall seconds, one line per config (``python -m xffl_like.bench.wan``);
    a dotted line at the target loss."""
    if not any(curves.values()):
        return f"{Path(path).name} skipped: no evaluation to plot"
    fig = _figure()
    if fig is None:
        return f"{Path(path).name} skipped: {_NO_MPL}"
    ax = fig.add_subplot()
    for name, points in curves.items():
        ax.plot([p["seconds"] for p in points], [p["loss"] for p in points], marker=".", linewidth=1.2, label=name)
    if target is not None:
        ax.axhline(target, color="grey", linestyle=":", linewidth=1.0, label="target (reference's final)")
    ax.set_xlabel("wall seconds since the start of training")
    ax.set_ylabel("eval loss")
    ax.set_title(f"Eval loss over a {link_mbit:g} Mbit/s link")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return None
