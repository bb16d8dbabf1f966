"""``python -m xffl_like.bench.quality``: what top-k and the delayed step cost in quality (a benchmark, not a test).

A matrix of runs of ``+experiment=diloco`` (non-IID facilities of ``llama_tiny`` on byte-level tinyshakespeare,
rounds of 16 steps, Nesterov lr 0.8 momentum 0.3), one after the other on this machine: for each number of
facilities (``--facilities``, 2: 2 facilities x FSDP over 2 ranks; 4: one rank each) and each seed, every
``--variants`` entry (:data:`VARIANTS`: fp32 DiLoCo, top-k (SparseLoCo's codec) under the experiment's Nesterov,
the ``sparseloco`` preset (the same codec, plain SGD at lr 1 outside), top-k with flat chunks, levels and 2% (the
choices of before issue 39 but the mean, the ``flat`` preset) and with each of SparseLoCo's choices on its own on top
of it, the ``sparseloco`` preset with each of its choices set back,
top-k with ``delay=1`` under both rules). ``--steps 960`` is issue 39's long horizon (60 rounds).

``--pretrained`` fine-tunes instead of training from scratch: a base model is trained first (one facility,
``--pretrain-steps`` steps on the first half of the corpus) and exported in Hugging Face's format
(``export.hf=true``, loadable by ``transformers``); every run then starts from it (``model=hf``) on the second
half, whose last 10% is the held-out split the eval loss is read on.

Each run's final eval loss, its eval curve (the facilities' mean eval loss of their models after each
evaluation, every round) and, with top-k, the share of each facility's kept values sent as a zero code
(``summary.json``'s ``federation.topk_zero_codes``) go into ``quality.json`` after every run. A run whose
``summary.json`` is already in ``--out`` is read, not run again, so a long matrix can be continued. The report,
per number of facilities: each variant's mean final eval over the seeds and its excess over ``fp32``'s, with
issue 39's goals where they apply. Exits 1 when a run fails (its last ``error`` line shown).
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

__all__ = ["GOALS", "VARIANTS", "main", "overrides", "quality_report"]

_TOPK = ("federation.compression=topk",)
#: Top-k's choices before issue 39 but the mean: flat 4096-value chunks, symmetric levels, 2%; the per-index mean
#: over the senders (the weighted mean of before is gone).
_FLAT = (*_TOPK, "federation.topk.chunks=flat", "federation.topk.quantizer=levels", "federation.topk.density=0.02")
_SGD = ("federation.outer.name=average", "federation.outer.lr=1.0", "federation.outer.momentum=0")
#: The runs to compare, by name: overrides on top of ``+experiment=diloco``. ``fp32`` is the reference.
VARIANTS: dict[str, tuple[str, ...]] = {
    "fp32": (),
    "topk": _TOPK,  # SparseLoCo's tiles, bins, per-index mean over the senders, 3.1%, under the experiment's Nesterov
    "sparseloco": ("federation/topk=sparseloco", "federation.outer.lr=1.0", "federation.outer.momentum=0"),  # SGD lr 1
    "topk_flat": _FLAT,  # under the experiment's Nesterov
    # the flat codec with one of SparseLoCo's choices at a time (its outer rule's: ``topk_flat_sgd``)
    "topk_flat_sgd": (*_FLAT, *_SGD),
    "flat_bins": (*_FLAT, "federation.topk.quantizer=bins"),
    "flat_tiles": (*_FLAT, "federation.topk.chunks=tiles", "federation.topk.tile=50"),  # 50 of a 50 x 50 tile
    "flat_3pct": (*_FLAT, "federation.topk.density=0.03125"),
    # SparseLoCo's choices under its plain SGD at lr 1, one set back at a time (the outer rule's: ``topk``)
    "sgd_flat": (*_TOPK, *_SGD, "federation.topk.chunks=flat"),
    "sgd_levels": (*_TOPK, *_SGD, "federation.topk.quantizer=levels"),
    "sgd_2pct": (*_TOPK, *_SGD, "federation.topk.density=0.02", "federation.topk.tile=50"),  # 50 of a 50 x 50 tile
    "topk_delay_eager": (*_TOPK, "federation.delay=1", "federation.delay_rule=eager"),
    "topk_delay_own_full": (*_TOPK, "federation.delay=1", "federation.delay_rule=own_full"),
    "fp32_delay_eager": ("federation.delay=1", "federation.delay_rule=eager"),
    "fp32_delay_own_full": ("federation.delay=1", "federation.delay_rule=own_full"),  # why own_full stays reachable
}
#: Issue 39's goals, as ``(variant, reference, largest excess of the mean final eval, horizon, start)``.
GOALS = (
    ("topk", "fp32", 0.005, 960, "scratch"),
    ("sparseloco", "fp32", 0.005, 960, "scratch"),
    ("topk_flat", "fp32", 0.005, 960, "scratch"),
    ("topk", "fp32", 0.03, 192, "scratch"),
    ("sparseloco", "fp32", 0.03, 192, "scratch"),
    ("fp32_delay_eager", "fp32", 0.01, None, "scratch"),
    ("topk", "fp32", 0.01, None, "pretrained"),
    ("sparseloco", "fp32", 0.01, None, "pretrained"),
)
# distributed.federated is the ranks per facility: 2 facilities x FSDP over 2 ranks, or 4 of one rank
_LAYOUTS = {2: ("distributed.nproc_per_node=4", "distributed.federated=2"),
            4: ("distributed.nproc_per_node=4", "distributed.federated=1")}  # fmt: skip
_FINE_TUNE = ("optim.lr=3e-4", "optim.warmup_steps=10")  # from a trained base: well below from scratch


def overrides(variant: str, facilities: int, seed: int, steps: int, base: Path | None = None) -> list[str]:
    """The command line of one run (``base``: the pretrained start's directory, with its corpus beside it)."""
    if facilities not in _LAYOUTS:
        raise ValueError(f"--facilities {facilities}: use {' or '.join(map(str, _LAYOUTS))}")
    out = ["+experiment=diloco", "logger=none", f"train.steps={steps}", f"seed={seed}", *_LAYOUTS[facilities]]
    if base is not None:
        out += ["model=hf", f"model.path={base / 'run' / 'hf'}", f"data.path={base / 'finetune.txt'}", *_FINE_TUNE]
    return [*out, *VARIANTS[variant]]


def _run(cmd: list[str], run_dir: Path, timeout: float) -> dict:
    """One job to the end (or its summary from an earlier invocation); its ``summary.json``."""
    if (run_dir / "summary.json").is_file():
        return json.loads((run_dir / "summary.json").read_text())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    argv = [sys.executable, "-m", "xffl_like.run", *cmd, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")] or proc.stderr.splitlines()[-1:]
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {errors[0] if errors else ''}")
    return json.loads((run_dir / "summary.json").read_text())


def record(summary: dict) -> dict:
    """What the report keeps of one run: final eval, the eval curve, the zero-code shares per round."""
    curve = []
    for entry in summary.get("eval_history") or []:
        losses = [x for x in entry.get("loss_global") or [] if x is not None]
        if losses:
            curve.append([entry["step"], statistics.fmean(losses)])
    zero = summary.get("federation", {}).get("topk_zero_codes")
    shares = None if zero is None else [statistics.fmean([x for x in row if x is not None] or [0.0]) for row in zero]
    return {"eval_loss": float(summary["eval_loss"]), "curve": curve, "zero_codes": shares,
            "bytes_per_round": (summary.get("cross_facility_bytes_per_round") or [None])[0],
            "seconds": summary.get("wall_seconds")}  # fmt: skip


def quality_report(runs: dict[int, dict[str, dict[int, dict]]], steps: int, pretrained: bool = False) -> dict:
    """``runs[facilities][variant][seed]`` (:func:`record`): per number of facilities and variant, the mean
    final eval over the seeds, its excess over ``fp32``'s (per seed and on the mean), and the goals."""
    out = {}
    for fac, variants in sorted(runs.items()):
        ref = variants.get("fp32", {})
        rows = {}
        for name, seeds in variants.items():
            mean = statistics.fmean(r["eval_loss"] for r in seeds.values())
            per_seed = {s: r["eval_loss"] / ref[s]["eval_loss"] - 1 for s, r in seeds.items() if s in ref}
            both = [s for s in seeds if s in ref]
            excess = None
            if both:
                excess = (
                    statistics.fmean(seeds[s]["eval_loss"] for s in both)
                    / statistics.fmean(ref[s]["eval_loss"] for s in both)
                    - 1
                )
            zero = [r["zero_codes"] for r in seeds.values() if r["zero_codes"]]
            rows[name] = {"mean_eval": mean, "excess": excess, "excess_per_seed": per_seed, "seeds": sorted(seeds),
                          "zero_codes": statistics.fmean(x for z in zero for x in z) if zero else None}  # fmt: skip
        out[fac] = {"variants": rows, "goals": _goals(rows, steps, "pretrained" if pretrained else "scratch")}
    return out


def _goals(rows: dict, steps: int, start: str) -> list[dict]:
    goals = []
    for variant, ref, bound, horizon, start_of in GOALS:
        if start_of != start or horizon not in (None, steps):
            continue
        if variant in rows and ref in rows and rows[variant]["excess"] is not None:
            excess = rows[variant]["excess"]
            goals.append({"variant": variant, "within": bound, "excess": excess, "met": excess <= bound})
    return goals


def _table(report: dict) -> str:
    lines = []
    for fac, part in report.items():
        lines += [f"{fac} facilities:", "| variant | seeds | mean final eval | over fp32 | per seed | zero codes |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for name, row in part["variants"].items():
            excess = "" if row["excess"] is None else f"{100 * row['excess']:+.2f}%"
            seeds = " ".join(f"{100 * v:+.2f}%" for v in row["excess_per_seed"].values())
            zero = "" if row["zero_codes"] is None else f"{100 * row['zero_codes']:.1f}%"
            lines.append(f"| {name} | {len(row['seeds'])} | {row['mean_eval']:.4f} | {excess} | {seeds} | {zero} |")
        for goal in part["goals"]:
            verdict = "met" if goal["met"] else "not met"
            lines.append(f"goal: {goal['variant']} within {100 * goal['within']:.1f}% of fp32: "
                         f"{100 * goal['excess']:+.2f}%, {verdict}")  # fmt: skip
    return "\n".join(lines)


def pretrain(out: Path, steps: int, corpus: Path, timeout: float) -> Path:
    """The pretrained start: ``out/base`` (its corpus halves and ``run/hf``), trained once, reused after."""
    base = out / "base"
    base.mkdir(parents=True, exist_ok=True)
    text = corpus.read_bytes()
    half = len(text) // 2
    for name, part in (("pretrain.txt", text[:half]), ("finetune.txt", text[half:])):
        if not (base / name).is_file():
            (base / name).write_bytes(part)
    cmd = ["+experiment=diloco", "logger=none", f"train.steps={steps}", "seed=0", "distributed.nproc_per_node=2",
           "distributed.federated=null", f"data.path={base / 'pretrain.txt'}", "export.hf=true"]  # fmt: skip
    _run(cmd, base / "run", timeout)
    if not (base / "run" / "hf" / "config.json").is_file():
        raise RuntimeError(f"{base / 'run'}: no hf/ export")
    return base


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m xffl_like.bench.quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="NAME",
                   help=f"runs to compare (fp32 is the reference): {', '.join(VARIANTS)}")  # fmt: skip
    p.add_argument("--facilities", type=int, nargs="+", default=[2], choices=sorted(_LAYOUTS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=192, help="train.steps of every run (960: 60 rounds of 16)")
    p.add_argument("--pretrained", action="store_true", help="fine-tune from a base trained first (see above)")
    p.add_argument("--pretrain-steps", type=int, default=192)
    p.add_argument("--corpus", default="../shared/data/tinyshakespeare.txt", help="--pretrained: the text split")
    p.add_argument("--extra", nargs="*", default=[], help="more overrides of every run")
    p.add_argument("--out", default=None, help="the directory of the runs and quality.json (reused: see above)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out or f"outputs/bench_quality/{time.strftime('%Y-%m-%d_%H-%M-%S')}").absolute()
    variants = ["fp32", *[v for v in args.variants if v != "fp32"]]
    runs: dict[int, dict[str, dict[int, dict]]] = {}
    started = time.time()
    try:
        base = pretrain(out, args.pretrain_steps, Path(args.corpus), args.timeout) if args.pretrained else None
        for fac in args.facilities:
            for seed in args.seeds:
                for name in variants:
                    cmd = [*overrides(name, fac, seed, args.steps, base), *args.extra]
                    rec = record(_run(cmd, out / f"f{fac}-{name}-seed{seed}", args.timeout))
                    runs.setdefault(fac, {}).setdefault(name, {})[seed] = rec
                    print(f"{fac} facilities, seed {seed}, {name}: eval loss {rec['eval_loss']:.4f}", flush=True)
                    _write(out, runs, args, started)
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(_table(quality_report(runs, args.steps, args.pretrained)))
    print(f"results: {out}")
    return 0


def _write(out: Path, runs: dict, args, started: float) -> None:
    report = {"report": quality_report(runs, args.steps, args.pretrained), "runs": runs, "steps": args.steps,
              "pretrained": args.pretrained, "extra": args.extra, "seconds": time.time() - started}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
