"""The summary of a Hydra sweep: one row per job, written into the sweep directory.

:class:`SweepSummary` is a Hydra callback (``hydra.callbacks.sweep_summary`` in
``conf/config.yaml``). After every job it refreshes ``sweep_summary.csv`` and
``sweep_summary.md``; at the end of the sweep it writes them once more with
``sweep_aggregation.png`` and, when a job failed and ``fail_on_error`` is set, exits 1:
every job has run, the summary names the failure, and scripts and CI see it.

Jobs are found on disk (every directory under the sweep directory holding ``.hydra/``),
so ``python -m xffl_like.observe.sweep SWEEP_DIR`` rebuilds the summary of any sweep.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from .plots import plot_sweep

__all__ = ["FIELDS", "SweepSummary", "collect_jobs", "write_sweep_summary"]

FIELDS = (
    "job",
    "overrides",
    "strategy",
    "streams",
    "status",
    "aggregation_seconds_median",
    "aggregation_seconds_min",
    "aggregation_seconds_max",
    "busbw_gbps_median",
    "cross_facility_bytes_per_round",
    "final_loss",
    "eval_loss",
    "tokens_per_second",
    "error",
)


def _load_yaml(path: Path) -> Any:
    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:  # noqa: BLE001 - a damaged file must not hide the other jobs
        return None


def _median(values: list) -> float | None:
    return statistics.median(values) if values else None


def _job_row(job_dir: Path, sweep_dir: Path) -> dict:
    cfg = _load_yaml(job_dir / ".hydra" / "config.yaml") or {}
    strategy = cfg.get("strategy") or {}
    row: dict[str, Any] = dict.fromkeys(FIELDS)
    row.update(job=str(job_dir.relative_to(sweep_dir)), strategy=strategy.get("name"), streams=strategy.get("streams"))
    summary_path, error_path = job_dir / "summary.json", job_dir / "error.txt"
    if error_path.exists():
        lines = error_path.read_text().strip().splitlines()
        return {**row, "status": "failed", "error": lines[0] if lines else "(empty error.txt)"}
    if not summary_path.exists():
        return {
            **row,
            "status": "failed",
            "error": "no summary.json and no error.txt: the job was killed or is still running",
        }
    try:
        summary = json.loads(summary_path.read_text())
    except ValueError as exc:
        return {**row, "status": "failed", "error": f"unreadable summary.json: {exc}"}
    seconds = summary.get("aggregation_seconds") or _column(job_dir, "seconds")
    busbw = summary.get("aggregation_busbw_gbps") or _column(job_dir, "busbw_gbps")
    cross = summary.get("cross_facility_bytes_per_round") or _column(job_dir, "cross_facility_bytes")
    strat = summary.get("strategy") or {}
    row.update(
        status="ok",
        strategy=strat.get("name", row["strategy"]),
        streams=strat.get("streams", row["streams"]),
        aggregation_seconds_median=_median(seconds),
        aggregation_seconds_min=min(seconds) if seconds else None,
        aggregation_seconds_max=max(seconds) if seconds else None,
        busbw_gbps_median=_median(busbw),
        cross_facility_bytes_per_round=max(cross) if cross else None,  # the same every round
        final_loss=summary.get("final_loss"),
        eval_loss=summary.get("eval_loss"),
        tokens_per_second=summary.get("tokens_per_second"),
    )
    row["_seconds"] = seconds
    return row


def _column(job_dir: Path, name: str) -> list[float]:
    path = job_dir / "aggregation.csv"
    if not path.exists():
        return []
    with open(path, newline="") as fh:
        return [float(r[name]) for r in csv.DictReader(fh) if r.get(name) not in (None, "")]


def _job_num(job_dir: Path) -> tuple:
    hydra_cfg = _load_yaml(job_dir / ".hydra" / "hydra.yaml") or {}
    num = ((hydra_cfg.get("hydra") or {}).get("job") or {}).get("num")
    return (num if isinstance(num, int) else 1 << 30, str(job_dir))


def collect_jobs(sweep_dir: str | Path) -> list[dict]:
    """One row per job directory under ``sweep_dir`` (in job order), with the overrides
    that differ between jobs in ``overrides``."""
    sweep_dir = Path(sweep_dir)
    job_dirs = sorted(
        {p.parent for p in sweep_dir.rglob(".hydra") if p.is_dir() and p.parent != sweep_dir}, key=_job_num
    )
    rows, overrides = [], []
    for job_dir in job_dirs:
        rows.append(_job_row(job_dir, sweep_dir))
        overrides.append(_load_yaml(job_dir / ".hydra" / "overrides.yaml") or [])
    common = set.intersection(*(set(o) for o in overrides)) if overrides else set()
    for row, job_overrides in zip(rows, overrides):
        row["overrides"] = " ".join(o for o in job_overrides if o not in common)
    return rows


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "ms":
        return f"{value * 1e3:.3g} ms"
    if kind == "bytes":
        from .progress import format_bytes

        return format_bytes(value)
    if kind == "float":
        return f"{value:.4g}"
    if kind == "int":
        return f"{value:,.0f}"
    return str(value).replace("|", "\\|")


def _markdown(rows: list[dict], sweep_dir: Path, notes: list[str]) -> str:
    failed = [r for r in rows if r["status"] != "ok"]
    head = [
        f"# Sweep summary: `{sweep_dir}`",
        "",
        f"{len(rows)} jobs, {len(rows) - len(failed)} ok, {len(failed)} failed. Aggregation time is the slowest "
        f"rank's per round (median, min-max over rounds); busbw is the median over rounds.",
        "",
    ]
    cols = [
        ("job", "job", "str"),
        ("strategy", "strategy", "str"),
        ("streams", "streams", "str"),
        ("overrides", "overrides", "str"),
        ("aggregation (median)", "aggregation_seconds_median", "ms"),
        ("min", "aggregation_seconds_min", "ms"),
        ("max", "aggregation_seconds_max", "ms"),
        ("busbw GB/s", "busbw_gbps_median", "float"),
        ("cross-facility / round", "cross_facility_bytes_per_round", "bytes"),
        ("final loss", "final_loss", "float"),
        ("eval loss", "eval_loss", "float"),
        ("tokens/s", "tokens_per_second", "int"),
        ("status", "status", "str"),
    ]
    if all(_label(r) == Path(r["job"]).name for r in rows):  # the job names already say what varies
        cols = [c for c in cols if c[1] != "overrides"]
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r[key], kind) for _, key, kind in cols) + " |")
    tail = []
    if failed:
        tail += ["", "## Failed jobs", ""] + [f"- `{r['job']}`: {r['error']}" for r in failed]
    if notes:
        tail += [""] + [f"Note: {n}" for n in notes]
    return "\n".join(head + lines + tail) + "\n"


def _label(row: dict) -> str:
    """The job's directory name, plus the varying overrides its name does not already say."""
    name = Path(row["job"]).name
    extra = [o for o in row["overrides"].split() if o.partition("=")[2] not in name]
    return "\n".join([name, *extra])


def write_sweep_summary(sweep_dir: str | Path, plot: bool = True) -> list[dict]:
    """Write ``sweep_summary.csv``, ``sweep_summary.md`` (and ``sweep_aggregation.png``); return the rows."""
    sweep_dir = Path(sweep_dir)
    rows = collect_jobs(sweep_dir)
    notes = []
    if plot:
        labels = [(_label(r), r.get("_seconds") or []) for r in rows if r["status"] == "ok"]
        try:
            note = plot_sweep(labels, sweep_dir / "sweep_aggregation.png")
        except Exception as exc:  # noqa: BLE001 - the tables matter more than the picture
            note = f"sweep_aggregation.png skipped: {type(exc).__name__}: {exc}"
        if note:
            notes.append(note)
    with open(sweep_dir / "sweep_summary.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (sweep_dir / "sweep_summary.md").write_text(_markdown(rows, sweep_dir, notes))
    for note in notes:
        print(f"note: {note}", flush=True)
    return rows


class SweepSummary(Callback):
    """Hydra callback: the sweep summary after every job and at the end of the sweep."""

    def __init__(self, fail_on_error: bool = True):
        self.fail_on_error = fail_on_error

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        if config.hydra.mode != RunMode.MULTIRUN:
            return
        job_dir = Path(config.hydra.runtime.output_dir)
        # A job that raised (rather than returning a failed status) still gets its error line.
        if job_return.status == JobStatus.FAILED and not (job_dir / "error.txt").exists():
            exc = job_return._return_value
            line = f"{type(exc).__name__}: {exc}".splitlines()[0]
            (job_dir / "error.txt").write_text(line + "\n")
        write_sweep_summary(config.hydra.sweep.dir, plot=False)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = write_sweep_summary(sweep_dir)
        failed = [r for r in rows if r["status"] != "ok"]
        print(
            f"sweep: {len(rows) - len(failed)} of {len(rows)} jobs ok; summary: {sweep_dir / 'sweep_summary.md'}",
            flush=True,
        )
        if failed:
            for r in failed:
                print(f"sweep: job {r['job']} failed: {r['error']}", file=sys.stderr, flush=True)
            if self.fail_on_error:
                raise SystemExit(1)


def main() -> None:
    """``xffl-sweep-summary SWEEP_DIR`` (and ``python -m xffl_like.observe.sweep``): write and print the
    sweep's summary; exit status 1 if any job failed."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="xffl-sweep-summary", description="Write and print a sweep's sweep_summary.csv and .md."
    )
    parser.add_argument("sweep_dir", type=Path, help="a multirun's sweep directory (hydra.sweep.dir)")
    sweep_dir = parser.parse_args().sweep_dir
    if not sweep_dir.is_dir():
        print(f"error: {sweep_dir}: no such sweep directory (give a multirun's hydra.sweep.dir)", file=sys.stderr)
        sys.exit(2)
    done = write_sweep_summary(sweep_dir)
    print((sweep_dir / "sweep_summary.md").read_text(), end="")
    sys.exit(1 if any(r["status"] != "ok" for r in done) else 0)


if __name__ == "__main__":
    main()
