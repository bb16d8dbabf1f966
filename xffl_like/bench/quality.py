"""``python -m xffl_like.bench.quality``: what top-k costs in quality (issue 29's goal, a benchmark, not a test).

For each seed (default 0, 1, 2), the same job twice on this machine, one after the other:
``+experiment=diloco`` (2 non-IID facilities x FSDP over 2 ranks, tiny Llama, 192 steps) with
``federation.compression=none`` and with ``--compression`` (default ``topk`` with error feedback and the
default ``federation.topk``: density 0.02, 2 bits, decay 0.95), plus ``--extra`` overrides on both. It reads
each run's final eval loss (``summary.json``'s ``eval_loss``) and reports, per seed and on the mean, how far the
compressed run's is above the uncompressed one's, against the goal: within 1%. Writes ``quality.json`` and
prints a table; exits 1 when a run fails (its last ``error`` line shown).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["GOAL", "main", "quality_report"]

#: The compressed run's final eval loss over the uncompressed one's, at most ``1 + GOAL``.
GOAL = 0.01
_COMPRESSED = {
    "topk": ["federation.compression=topk", "federation.error_feedback=true"],
    "uint8": ["federation.compression=uint8", "federation.error_feedback=true"],
    "bf16": ["federation.compression=bf16"],
}


def _run(overrides: list[str], run_dir: Path, timeout: float) -> float:
    """One job to the end; its final eval loss."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "xffl_like.run", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")] or proc.stderr.splitlines()[-1:]
        raise RuntimeError(f"{' '.join(overrides)}: exit {proc.returncode}: {errors[0] if errors else ''}")
    return float(json.loads((run_dir / "summary.json").read_text())["eval_loss"])


def quality_report(losses: dict[int, dict[str, float]], compression: str) -> dict:
    """Per seed and on the mean: the compressed run's final eval loss over the uncompressed one's, less 1."""
    per_seed = {
        seed: {**pair, "excess": pair[compression] / pair["none"] - 1.0} for seed, pair in sorted(losses.items())
    }
    mean_none = statistics.fmean(p["none"] for p in per_seed.values())
    mean_comp = statistics.fmean(p[compression] for p in per_seed.values())
    excess = mean_comp / mean_none - 1.0
    return {
        "compression": compression,
        "seeds": per_seed,
        "mean": {"none": mean_none, compression: mean_comp, "excess": excess},
        "goal": GOAL,
        "met": excess <= GOAL and all(p["excess"] <= GOAL for p in per_seed.values()),
    }


def _table(report: dict) -> str:
    c = report["compression"]
    lines = [f"| seed | eval loss, none | eval loss, {c} | {c} over none |", "|---|---|---|---|"]
    rows = [*report["seeds"].items(), ("mean", report["mean"])]
    for seed, p in rows:
        lines.append(f"| {seed} | {p['none']:.4f} | {p[c]:.4f} | {100 * p['excess']:+.2f}% |")
    verdict = "met" if report["met"] else "not met"
    lines.append(f"goal: {c} within {100 * report['goal']:.0f}% of none at every seed and on the mean: {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xffl_like.bench.quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=192, help="train.steps of every run")
    p.add_argument("--compression", default="topk", choices=sorted(_COMPRESSED))
    p.add_argument("--extra", nargs="*", default=[], help="more overrides of both runs (e.g. federation.delay=1)")
    p.add_argument("--out", default=None, help="the directory of the runs and quality.json")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    args = p.parse_args(argv)
    out = Path(args.out or f"outputs/bench_quality/{time.strftime('%Y-%m-%d_%H-%M-%S')}").absolute()
    base = ["+experiment=diloco", "logger=none", f"train.steps={args.steps}", *args.extra]
    losses: dict[int, dict[str, float]] = {}
    started = time.time()
    try:
        for seed in args.seeds:
            losses[seed] = {}
            for name, more in (("none", []), (args.compression, _COMPRESSED[args.compression])):
                loss = _run([*base, f"seed={seed}", *more], out / f"{name}-seed{seed}", args.timeout)
                losses[seed][name] = loss
                print(f"seed {seed}, {name}: eval loss {loss:.4f}", flush=True)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report = {**quality_report(losses, args.compression), "overrides": base, "seconds": time.time() - started}
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps(report, indent=2) + "\n")
    print(_table(report))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
