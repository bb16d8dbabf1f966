"""``python -m xffl_like.bench``: time aggregation strategies against the all-reduce limit.

For every strategy, in the same run and on the same groups, it times ``aggregate`` and
the *limit*: one all-reduce of one pre-flattened buffer holding the same bytes per rank
over the same peer group. Each repeat's time is the slowest rank's. Results go to
``bench.json`` in the run directory and a table sorted by ``ratio_to_limit``.

Like the main job: the config is composed and validated once, here, before any worker
starts; workers receive the resolved plain dict and the run directory.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

__all__ = ["BenchFailed", "run_bench", "bench_worker", "format_table"]

STRATEGY_DIR = Path(__file__).resolve().parents[1] / "conf" / "strategy"
DTYPES = ("float32", "bfloat16")


class BenchFailed(RuntimeError):
    """The bench could not run; ``str(exc)`` is the one line to show."""


# ----------------------------------------------------------------------------- launcher side
def _strategy_specs(plain: dict) -> list[dict]:
    """The options of every strategy to time: ``strategy`` when selected, else ``bench.strategies``
    from their yaml with the bench's non-null overrides."""
    from .aggregation import STRATEGIES

    if plain.get("strategy"):
        return [dict(plain["strategy"])]
    bench = plain["bench"]
    names = bench["strategies"]
    if isinstance(names, str):
        names = [names]
    if not names:
        raise BenchFailed(f"bench.strategies is empty: name some of {list(STRATEGIES)}")
    specs = []
    for name in names:
        if name not in STRATEGIES:
            raise BenchFailed(f"bench.strategies: unknown strategy name {name!r}: valid names are {list(STRATEGIES)}")
        spec = OmegaConf.to_container(OmegaConf.load(STRATEGY_DIR / f"{name}.yaml"), resolve=True)
        for key in ("streams", "bucket_mb", "mode"):
            if bench.get(key) is not None:
                spec[key] = bench[key]
        specs.append(spec)
    return specs


def _validate(plain: dict) -> list[dict]:
    from .aggregation import validate_strategy_options
    from .distributed.layout import plan_layout
    from .models import LlamaConfig, build_model

    bench, dcfg = plain["bench"], plain["distributed"]
    for key, low in (("warmup", 0), ("repeats", 1)):
        value = bench.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise BenchFailed(f"bench.{key}={value!r}: must be an integer >= {low}")
    from .aggregation.strategy import COLLECTIVES

    if bench.get("collective") not in (None, *COLLECTIVES):
        raise BenchFailed(f"bench.collective={bench.get('collective')!r}: use null or one of {list(COLLECTIVES)}")
    from .aggregation import check_collective
    from .distributed.state import resolve_backend

    try:
        check_collective(bench.get("collective"), resolve_backend(dcfg.get("backend", "auto")), "bench.collective")
    except ValueError as exc:
        raise BenchFailed(str(exc)) from None
    if bench.get("dtype") not in DTYPES:
        raise BenchFailed(f"bench.dtype={bench.get('dtype')!r}: use one of {list(DTYPES)}")
    nproc = dcfg.get("nproc_per_node")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc <= 0:
        raise BenchFailed(f"distributed.nproc_per_node={nproc!r}: must be a positive integer")
    try:
        layout = plan_layout(nproc, dcfg["federated"], dcfg["hsdp"], nproc)
    except ValueError as exc:
        raise BenchFailed(str(exc)) from None
    if layout.num_facilities < 2:
        raise BenchFailed(
            f"the bench needs at least 2 facilities to aggregate across, got {layout.num_facilities}: "
            f"set distributed.federated (e.g. distributed.federated={max(1, nproc // 2)})"
        )
    weights = bench.get("weights")
    if weights is not None and (
        not isinstance(weights, list) or len(weights) != layout.num_facilities
        or any(isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0 for w in weights) or sum(weights) <= 0
    ):
        raise BenchFailed(f"bench.weights={weights!r}: null or {layout.num_facilities} non-negative numbers with a positive sum")
    try:
        LlamaConfig.from_mapping(plain["model"])
        names = [n for n, _ in build_model(plain["model"], device="meta").named_parameters()]
        specs = _strategy_specs(plain)
        for spec in specs:
            validate_strategy_options(spec, names)
    except ValueError as exc:
        raise BenchFailed(str(exc)) from None
    return specs


def run_bench(cfg: DictConfig, run_dir: Path) -> dict:
    """Validate, launch the workers, write ``bench.json``; return the report."""
    from .distributed.launch import WorkerFailure, launch_local

    plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    plain.pop("hydra", None)
    specs = _validate(plain)
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(plain), run_dir / "config.yaml")
    nproc = plain["distributed"]["nproc_per_node"]
    try:
        results = launch_local(bench_worker, (plain, specs, str(run_dir)), nproc, error_dir=run_dir / "errors")
    except WorkerFailure as exc:
        where = f" (traceback: {exc.details})" if exc.details else ""
        raise BenchFailed(f"{exc}{where}") from None
    report = results[0]
    (run_dir / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def format_table(report: dict) -> str:
    rows = sorted(report["results"].items(), key=lambda kv: kv[1]["ratio_to_limit"])
    head = f"{'strategy':<28} {'streams':>7} {'median ms':>10} {'p90 ms':>8} {'limit ms':>9} {'ratio':>6} {'algbw GB/s':>10} {'busbw GB/s':>10} {'peak MB':>8}"
    lines = [report["setup"], head, "-" * len(head)]
    for name, r in rows:
        lines.append(
            f"{name:<28} {r['streams']:>7} {r['median_s'] * 1e3:>10.1f} {r['p90_s'] * 1e3:>8.1f} "
            f"{r['limit_median_s'] * 1e3:>9.1f} {r['ratio_to_limit']:>6.2f} {r['algbw_GBps']:>10.2f} "
            f"{r['busbw_GBps']:>10.2f} {r['peak_memory_mb']:>8.1f}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- worker side
def _memory_mark(device) -> int:
    """Reset the peak and return the current usage (bytes): CUDA allocator on GPU, RSS on CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    gc.collect()
    _malloc_trim()  # hand freed heap memory back, so that new allocations show in RSS again
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (peak RSS)
    except OSError:
        pass
    return _proc_status("VmRSS")


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _memory_peak(device) -> int:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return _proc_status("VmHWM")


def _proc_status(key: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _limit_buffers(strategy, state):
    """One flat buffer per peer group this rank reduces in, holding the same bytes."""
    import torch

    exchanges = state.split_exchanges if strategy.mode == "split" else state.sender_exchanges
    groups = {pe.exchange.chunk: pe.groups[0] for pe in exchanges}
    out = []
    for chunk in sorted({c.chunk for c in strategy.communications if c.reduce}):
        nbytes = sum(c.nbytes for c in strategy.communications if c.reduce and c.chunk == chunk)
        dtype = strategy.communications[0].dtype
        out.append((torch.ones(nbytes // dtype.itemsize, dtype=dtype, device=state.device), groups[chunk]))
    return out


def _run_limit(buffers, device) -> float:
    import torch
    import torch.distributed as dist

    start = time.perf_counter()
    works = [dist.all_reduce(buf, group=group, async_op=True) for buf, group in buffers]
    for work in works:
        work.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _time_strategy(model, state, spec: dict, bench: dict) -> dict:
    import torch.distributed as dist

    from .aggregation import aggregate, build_strategy

    weights = bench.get("weights")
    base = _memory_mark(state.device)
    strategy = build_strategy(model, state, spec, collective=bench.get("collective"))
    limit = _limit_buffers(strategy, state)
    times, limits = [], []
    for i in range(bench["warmup"] + bench["repeats"]):
        dist.barrier()
        seconds = aggregate(strategy, state, weights).seconds
        dist.barrier()
        limit_seconds = _run_limit(limit, state.device)
        if i >= bench["warmup"]:
            times.append(seconds)
            limits.append(limit_seconds)
    peak = _memory_peak(state.device) - base - sum(b.numel() * b.element_size() for b, _ in limit)
    mine = {"times": times, "limits": limits, "bytes": strategy.bytes_per_rank, "peak": max(0, peak)}
    cross_facility_bytes, collective = strategy.cross_facility_bytes, strategy.collective
    everyone: list = [None] * state.world_size
    dist.all_gather_object(everyone, mine)
    del strategy, limit
    gc.collect()

    def slowest(key):  # a repeat takes as long as its slowest rank
        return [max(r[key][i] for r in everyone) for i in range(len(times))]

    def p90(xs):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))]

    t, lim = slowest("times"), slowest("limits")
    median, limit_median = statistics.median(t), statistics.median(lim)
    nbytes = max(r["bytes"] for r in everyone)
    n = state.num_facilities  # peer group size: one rank per facility
    algbw = nbytes / median / 1e9
    return {
        "streams": spec["streams"],
        "collective": collective,
        "bucket_mb": spec["bucket_mb"],
        "mode": spec["mode"],
        "median_s": median,
        "p90_s": p90(t),
        "limit_median_s": limit_median,
        "limit_p90_s": p90(lim),
        "ratio_to_limit": median / limit_median,
        "bytes_per_rank": nbytes,
        "cross_facility_bytes": cross_facility_bytes,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * 2 * (n - 1) / n,
        "peak_memory_mb": max(r["peak"] for r in everyone) / 2**20,
        "times_s": t,
        "limits_s": lim,
    }


def bench_worker(plain: dict, specs: list[dict], run_dir: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from .distributed.layout import plan_layout
    from .distributed.state import build_state, read_env
    from .models import build_model
    from .train.parallelize import contiguous_shards

    env = read_env()
    dcfg, bench = plain["distributed"], plain["bench"]
    layout = plan_layout(env.world_size, dcfg["federated"], dcfg["hsdp"], env.local_world_size)
    state = build_state(
        layout, env, backend=dcfg["backend"], num_streams=max(s["streams"] for s in specs), timeout_s=dcfg["timeout_s"]
    )
    try:
        dtype = getattr(torch, bench["dtype"])
        model = build_model(plain["model"], device="meta", dtype=dtype)
        for block in model.layers:
            fully_shard(block, mesh=state.mesh)
        fully_shard(model, mesh=state.mesh)
        model.to_empty(device=state.device)
        if bench["contiguous"]:  # as the training loop lays the shards out
            contiguous_shards(model, state.shard_size)
        gen = torch.Generator(device=state.device).manual_seed(bench["seed"] * 1000 + state.rank)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().normal_(0.0, 0.02, generator=gen)
        results = {spec["name"]: _time_strategy(model, state, spec, bench) for spec in specs}
        n_params = sum(p.numel() for p in model.parameters())
        setup = (
            f"{layout.world_size} processes, {layout.num_facilities} facilities {list(layout.facility_sizes)}, "
            f"shards of {layout.shard_size}, replicas {list(layout.replicas)}; model {plain['model']['name']} "
            f"{n_params / 1e6:.1f}M params {bench['dtype']}; {state.backend} on {state.device}; "
            f"warmup {bench['warmup']}, repeats {bench['repeats']}"
        )
        return {"setup": setup, "device": str(state.device), "backend": state.backend, "results": results}
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- entry point
@hydra.main(config_path="../conf", config_name="bench", version_base=None)
def main(cfg: DictConfig) -> dict | None:
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    try:
        report = run_bench(cfg, run_dir)
    except BenchFailed as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        if hc.mode == RunMode.MULTIRUN:
            (run_dir / "error.txt").write_text(f"{exc}\n")
            return None
        sys.exit(2)
    print(format_table(report))
    print(f"wrote {run_dir / 'bench.json'}")
    return report


if __name__ == "__main__":
    main()
