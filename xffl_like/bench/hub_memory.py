"""``python -m xffl_like.bench.hub_memory``: the peak resident memory of a hub and of a facility
leader, per parameter, for ``model=llama_bench`` (or ``--model``).

Three runs on this machine, one after the other:

1. the facility alone (``distributed.federated=null``, no federation): its leader's peak;
2. two facilities (one process each) through an ``--insecure`` hub on loopback, Nesterov outer
   optimizer (one state buffer), ``--compression`` as given (``topk``: its defaults, SparseLoCo's tiles and
   bins, with error feedback; ``--set KEY=VALUE ...``: more overrides of the facilities):
   the leader's peak (its ``summary.json``'s ``peak_rss_mb``) and the hub's: the peak of its anonymous
   resident memory (``RssAnon`` of ``/proc/PID/status``, sampled every 20 ms while the facilities run; its
   idle value is read after it starts serving). Not ``VmRSS``/``VmHWM``: those count the pages of the state
   files the hub maps and reads (file-backed page cache, which the kernel drops and reads again under
   pressure: no memory the hub needs); ``VmHWM`` is reported beside, as ``hub_hwm_mb``.

The leader's peak is measured two ways, in both runs alike: ``VmHWM`` (its ``summary.json``'s
``peak_rss_mb``) and the peak of its anonymous resident memory (``RssAnon`` of the job's processes, the
launcher and its one worker, sampled every 20 ms, the largest of them: the worker). Every process of the
three runs (the jobs and the hub) runs with glibc's threshold for mapped buffers fixed,
``MALLOC_MMAP_THRESHOLD_=4194304`` (unless the environment sets it): by default glibc raises that threshold
to the size of each large buffer freed, so that later buffers of that size come from its arenas, where freed
memory stays resident and fragmented, and a peak then moves by hundreds of MB with the order of allocations
(seen from run to run with identical jobs). Fixed, every buffer of 4 MiB or more is its own mapping, returned
to the kernel when freed, and a peak is what the process held at once.

Both are run for ``--large`` (``llama_bench`` with 24 layers, 109.8 M parameters) and for ``--model``
(``llama_bench``, 58.5 M); the bytes per parameter are the slope between the two,
``(extra(large) - extra(model)) / (parameters(large) - parameters(model))``, so what does not grow with the
model is left out: torch's and gRPC's own start-up, and the buffers of the frames in flight (a few 16 MB
frames per facility, whatever the model's size; a model smaller than a frame would count them per
parameter). These are the figures that extrapolate to 8B and 70B (printed), beside each process's peak for
``--model`` itself. Leader's extra: federated peak minus alone peak, with the same rounds and synchronous
checkpoints (an asynchronous one would stage a copy of the state in the window); hub's: its anonymous peak
minus its anonymous idle memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .children import kill_all
from .hub_jobs import insecure_hub, start_job, wait_job

__all__ = ["main"]

_RUN = [
    "+experiment=llama_fed",
    "logger=none",
    "train.steps=4",
    "train.seq_len=32",
    "train.batch_size=2",
    "optim.warmup_steps=1",
    "distributed.nproc_per_node=1",
    "train.log_every=100",
    "federation.every=2",
    "checkpoint.async=false",
]  # fmt: skip (the same rounds and checkpoints with and without the hub)


MMAP_THRESHOLD = "4194304"  # glibc's MALLOC_MMAP_THRESHOLD_ in every process measured (the docstring: why)


def _status(pid: int, key: str) -> float:
    """``VmRSS``/``VmHWM``/``RssAnon`` of ``pid`` in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} for pid {pid}")


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, now."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo.extend(int(c) for c in task.read_text().split())
            except OSError:  # the task ended
                pass
    return out


def _anon(pid: int, tree: bool) -> float:
    """``RssAnon`` of ``pid`` (MiB), or with ``tree`` the largest over ``pid`` and its descendants (0 if gone)."""
    best = 0.0
    for p in _tree(pid) if tree else [pid]:
        try:
            best = max(best, _status(p, "RssAnon"))
        except (OSError, RuntimeError):  # ended
            pass
    return best


class _Peak:
    """The greatest ``RssAnon`` of ``pid`` (MiB; with ``tree``, of its largest process), sampled every 20 ms from a
    thread until :meth:`stop`."""

    def __init__(self, pid: int, tree: bool = False):
        self.pid, self.tree, self.done = pid, tree, threading.Event()
        self.peak = _anon(pid, tree)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.02):
            self.peak = max(self.peak, _anon(self.pid, self.tree))

    def stop(self) -> float:
        self.peak = max(self.peak, _anon(self.pid, self.tree))
        self.done.set()
        self.thread.join()
        return self.peak


def _watched(proc: subprocess.Popen, run_dir: Path, timeout: float, peak: _Peak) -> dict:
    """The job's summary, with its largest process's ``RssAnon`` peak as ``peak_anon_mb``."""
    try:
        summary = wait_job(proc, run_dir, timeout)
    finally:
        anon = peak.stop()
    return {**summary, "peak_anon_mb": anon}


def _job(args: list[str], run_dir: Path, env: dict) -> subprocess.Popen:
    return start_job([*_RUN, *args], run_dir, env)


def measure(model: str, compression: str, work: Path, timeout: float = 900.0, extra: tuple[str, ...] = ()) -> dict:
    """``extra``: more overrides of the federated facilities (e.g. ``federation.topk.tile=32``)."""
    try:
        return _measure(model, compression, work, timeout, extra)
    finally:  # the jobs run in their own process groups: none outlives a failure (or Ctrl-C) here
        kill_all()


def _measure(model: str, compression: str, work: Path, timeout: float, extra: tuple[str, ...]) -> dict:
    env = {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD, **os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    common = [*model.split(), "distributed.federated=null"]  # "NAME key=value ..."
    common[0] = f"model={common[0]}"
    job = _job(common, work / "alone", env)
    alone = _watched(job, work / "alone", timeout, _Peak(job.pid, tree=True))
    with insecure_hub(work / "state", env) as (hub, port):
        idle, peak = _status(hub.pid, "RssAnon"), _Peak(hub.pid)
        fed = [*common, f"federation.elastic.hub=127.0.0.1:{port}",
               "federation.outer.name=nesterov", "federation.outer.lr=0.7", "federation.outer.momentum=0.9",
               f"federation.compression={compression}",
               *(["federation.error_feedback=true"] if compression != "none" else []), *extra]  # fmt: skip
        procs = {n: _job([*fed, f"federation.elastic.facility={n}"], work / n, env) for n in ("a", "b")}
        peaks = {n: _Peak(p.pid, tree=True) for n, p in procs.items()}
        summaries = {n: _watched(p, work / n, timeout, peaks[n]) for n, p in procs.items()}
        hub_peak, hub_hwm = peak.stop(), _status(hub.pid, "VmHWM")
    from ..hub.server.store import load_latest

    numel = load_latest(work / "state").theta.numel()  # the federation's parameters, as the hub saved them
    return {"alone": alone, "federated": summaries, "hub_idle_mb": idle, "hub_peak_mb": hub_peak,
            "hub_hwm_mb": hub_hwm, "numel": numel, "malloc_mmap_threshold": env["MALLOC_MMAP_THRESHOLD_"]}  # fmt: skip


def _extra(result: dict) -> tuple[float, float, float]:
    """(leader's ``VmHWM``, hub's, leader's ``RssAnon``) memory beyond what the same job needs without the hub, MiB."""
    alone, fed = result["alone"], result["federated"].values()
    leader = max(s["peak_rss_mb"] for s in fed) - alone["peak_rss_mb"]
    anon = max(s["peak_anon_mb"] for s in fed) - alone["peak_anon_mb"]
    return leader, result["hub_peak_mb"] - result["hub_idle_mb"], anon


def report(large: dict, model: dict) -> dict:
    """The slope between ``large`` and ``model`` (bytes per parameter, and at 8B and 70B), and ``model``'s own
    extra memory and peaks."""
    mib = 1 << 20
    (leader, hub, anon), (leader0, hub0, anon0) = _extra(large), _extra(model)
    numel = large["numel"] - model["numel"]
    per = {
        "leader_bytes_per_param": (leader - leader0) * mib / numel,
        "leader_anon_bytes_per_param": (anon - anon0) * mib / numel,
        "hub_bytes_per_param": (hub - hub0) * mib / numel,
    }
    leader_peak = max(s["peak_rss_mb"] for s in model["federated"].values())
    return {"parameters": model["numel"], "large_parameters": large["numel"], "leader_extra_mb": leader0,
            "leader_anon_extra_mb": anon0, "malloc_mmap_threshold": model["malloc_mmap_threshold"],
            "hub_extra_mb": hub0, "leader_peak_mb": leader_peak, "hub_peak_mb": model["hub_peak_mb"],
            "hub_hwm_mb": model["hub_hwm_mb"], "large_hub_hwm_mb": large["hub_hwm_mb"],
            "leader_extra_bytes_per_param": leader0 * mib / model["numel"],
            "hub_extra_bytes_per_param": hub0 * mib / model["numel"], **per,
            **{f"{w}_gb_at_{n}": per[f"{w}_bytes_per_param"] * size / 1e9 for w in ("leader", "leader_anon", "hub")
               for n, size in (("8b", 8e9), ("70b", 70e9))}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xffl_like.bench.hub_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama_bench", help="the model measured: NAME [key=value ...]")
    p.add_argument("--large", default="llama_bench model.n_layers=24", help="the larger model of the slope")
    p.add_argument("--compression", default="none", choices=["none", "bf16", "uint8", "topk"])
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides of the facilities")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="xffl-hub-memory-") as tmp:
        start = time.time()
        small = measure(args.model, args.compression, Path(tmp) / "model", extra=tuple(args.set))
        big = measure(args.large, args.compression, Path(tmp) / "large", extra=tuple(args.set))
        figures = report(big, small)
    figures.update(model=args.model, compression=args.compression, set=args.set, seconds=time.time() - start)
    for key, value in figures.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
