"""``python -m xffl_like.bench``: time aggregation strategies against what the transport allows.

For every strategy, in the same processes, on the same peer groups and with the same bytes
per rank, each repeat times ``aggregate`` and then, over one flat buffer (no model, no
buckets): (a) one ring all-reduce, (b) the point-to-point exchange (reduce-scatter and
all-gather as messages; the best over 1..streams connections) and (c) a plain neighbour
transfer of the bytes, the transport's raw rate. The *limit* is the faster of (a) and (b):
``ratio_to_limit`` >= 1 means the strategy is slower than a bare exchange of its bytes.
(c) gives the physical floor, 2 (n - 1) / n transfers for n facilities, and the strategy's
fraction of it. Each repeat's time is the slowest rank's. Results go to ``bench.json`` in
the run directory and a table sorted by ``ratio_to_limit``.

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

from .. import CONF_DIR
from ..config.checks import is_int, is_number

__all__ = ["BenchFailed", "run_bench", "bench_worker", "format_table"]

STRATEGY_DIR = CONF_DIR / "strategy"
DTYPES = ("float32", "bfloat16")


class BenchFailed(RuntimeError):
    """The bench could not run; ``str(exc)`` is the one line to show."""


# ----------------------------------------------------------------------------- launcher side
def _strategy_specs(plain: dict) -> list[dict]:
    """The options of every strategy to time: ``strategy`` when selected, else ``bench.strategies``
    from their yaml with the bench's non-null overrides."""
    from ..aggregation import STRATEGIES

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
    from ..aggregation import strategy_config, validate_strategy_options
    from ..distributed.layout import plan_layout
    from ..models import LlamaConfig, build_model

    bench, dcfg = plain["bench"], plain["distributed"]
    for key, low in (("warmup", 0), ("repeats", 1)):
        value = bench.get(key)
        if not is_int(value) or value < low:
            raise BenchFailed(f"bench.{key}={value!r}: must be an integer >= {low}")
    from ..aggregation.strategy import COLLECTIVES

    if bench.get("collective") not in (None, *COLLECTIVES):
        raise BenchFailed(f"bench.collective={bench.get('collective')!r}: use null or one of {list(COLLECTIVES)}")
    from ..aggregation import check_collective
    from ..distributed.state import resolve_backend

    try:
        check_collective(bench.get("collective"), resolve_backend(dcfg.get("backend", "auto")), "bench.collective")
    except ValueError as exc:
        raise BenchFailed(str(exc)) from None
    if bench.get("dtype") not in DTYPES:
        raise BenchFailed(f"bench.dtype={bench.get('dtype')!r}: use one of {list(DTYPES)}")
    nproc = dcfg.get("nproc_per_node")
    if not is_int(nproc) or nproc <= 0:
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
        not isinstance(weights, list)
        or len(weights) != layout.num_facilities
        or any(not is_number(w) or w < 0 for w in weights)
        or sum(weights) <= 0
    ):
        raise BenchFailed(
            f"bench.weights={weights!r}: null or {layout.num_facilities} non-negative numbers with a positive sum"
        )
    try:
        names = [n for n, _ in build_model(LlamaConfig.from_mapping(plain["model"]), device="meta").named_parameters()]
        specs = _strategy_specs(plain)
        for spec in specs:
            validate_strategy_options(strategy_config(spec), names)  # a YAML mapping (unknown keys: one line)
    except ValueError as exc:
        raise BenchFailed(str(exc)) from None
    return specs


def run_bench(cfg: DictConfig, run_dir: Path) -> dict:
    """Validate, launch the workers, write ``bench.json``; return the report."""
    from ..distributed.launch import WorkerFailure, launch_local

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
    """The report as a table sorted by ``ratio_to_limit``: limit = the faster of one ring
    all-reduce (a) and one p2p exchange (b) of a flat buffer; floor = the raw transfer (c)."""
    rows = sorted(report["results"].items(), key=lambda kv: kv[1]["ratio_to_limit"])
    head = (
        f"{'strategy':<28} {'streams':>7} {'median ms':>10} {'p90 ms':>8} {'limit ms':>9} {'ratio':>6} "
        f"{'(a) ms':>7} {'(b) ms':>7} {'floor ms':>9} {'of floor':>8} "
        f"{'algbw GB/s':>10} {'busbw GB/s':>10} {'peak MB':>8}"
    )
    lines = [report["setup"], head, "-" * len(head)]
    for name, r in rows:
        lines.append(
            f"{name:<28} {r['streams']:>7} {r['median_s'] * 1e3:>10.1f} {r['p90_s'] * 1e3:>8.1f} "
            f"{r['limit_median_s'] * 1e3:>9.1f} {r['ratio_to_limit']:>6.2f} {r['allreduce_median_s'] * 1e3:>7.1f} "
            f"{r['p2p_exchange_median_s'] * 1e3:>7.1f} {r['floor_s'] * 1e3:>9.1f} {r['floor_fraction']:>8.2f} "
            f"{r['algbw_GBps']:>10.2f} {r['busbw_GBps']:>10.2f} {r['peak_memory_mb']:>8.1f}"
        )
    if rows:
        bw = statistics.median(r["p2p_bandwidth_GBps"] for _, r in rows)
        lines.append(
            f"limit: the faster of (a) one ring all-reduce and (b) one p2p exchange "
            f"of a flat buffer of the same bytes; "
            f"floor: 2(n-1)/n x bytes at the measured p2p rate ({bw:.2f} GB/s per direction, median over strategies); "
            f"'of floor': floor / median (1 = at the floor)"
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


# ----------------------------------------------------------------------------- limits
class _FlatExchange:
    """Reduce-scatter + all-gather of one flat buffer among the peers (one rank per facility)
    by point-to-point messages: the least any exchange can do (no model, no buckets, no
    copies), with the uniform mean as its reduction. Buffers are allocated once."""

    def __init__(self, flat, group, ranks, me: int):
        import torch

        from ..aggregation.strategy import parts

        order = sorted(ranks)  # group ranks follow the sorted global ranks
        self.group, self.me, self.n = group, me, len(ranks)
        self.group_ranks = [order.index(r) for r in ranks]
        self.parts = [flat[a:b] for a, b in parts(flat.numel(), self.n)]
        self.peers = [j for j in range(self.n) if j != me]
        mine = self.parts[me]
        self.inbox = [torch.empty_like(mine) for _ in self.peers]

    def start(self):
        import torch.distributed as dist

        g, gr = self.group, self.group_ranks
        return (
            [dist.isend(self.parts[j], group=g, group_dst=gr[j]) for j in self.peers if self.parts[j].numel()]
            + [dist.irecv(t, group=g, group_src=gr[j]) for t, j in zip(self.inbox, self.peers) if t.numel()],
            [dist.irecv(self.parts[j], group=g, group_src=gr[j], tag=1) for j in self.peers if self.parts[j].numel()],
        )

    def reduce_and_return(self, arriving) -> list:
        import torch
        import torch.distributed as dist

        for work in arriving:
            work.wait()
        mine = self.parts[self.me]
        if not mine.numel():
            return []
        if self.n == 2:
            torch.lerp(mine, self.inbox[0], 0.5, out=mine)
        else:
            for t in self.inbox:
                mine.add_(t)
            mine.mul_(1.0 / self.n)
        return [dist.isend(mine, group=self.group, group_dst=self.group_ranks[j], tag=1) for j in self.peers]


class _Limits:
    """What a strategy is measured against, over the same peer groups and bytes per rank:

    (a) ``all_reduce``: one ring all-reduce of one flat buffer (the backend's collective);
    (b) ``p2p_exchange``: the exchange of one flat buffer by point-to-point messages, cut
        over 1..``streams`` connections (the stream groups), the best of them;
    (c) the transport's raw rate: every peer sends the same bytes to its neighbour while
        receiving as many (loopback p2p bandwidth, the best repeat over 1..``streams``
        connections).
        An exchange must send and receive 2 (n - 1) / n of its bytes in two dependent
        phases, so 2 (n - 1) / n times that transfer's time is the physical floor.
    """

    def __init__(self, strategy, state):
        import torch

        exchanges = state.split_exchanges if strategy.mode == "split" else state.sender_exchanges
        by_chunk = {pe.exchange.chunk: pe for pe in exchanges}
        comms = strategy.communications
        self.items = []
        for chunk in sorted({c.chunk for c in comms if c.reduce}):
            nbytes = sum(c.nbytes for c in comms if c.reduce and c.chunk == chunk)
            flat = torch.ones(nbytes // comms[0].dtype.itemsize, dtype=comms[0].dtype, device=state.device)
            self.items.append((flat, by_chunk[chunk]))
        self.connections = range(1, state.num_streams + 1)
        self.me, self.n, self.device = state.facility, state.num_facilities, state.device
        self.exchanges = {k: self._exchanges(k) for k in self.connections}
        self.scratch = [torch.empty_like(flat) for flat, _ in self.items]

    def _exchanges(self, k: int) -> list[_FlatExchange]:
        from ..aggregation.strategy import parts

        return [
            _FlatExchange(flat[a:b], pe.groups[i], pe.exchange.ranks, self.me)
            for flat, pe in self.items
            for i, (a, b) in enumerate(parts(flat.numel(), k))
        ]

    @property
    def nbytes(self) -> int:
        """Bytes these buffers hold (excluded from the strategy's peak memory)."""
        flats = sum(f.numel() * f.element_size() for f, _ in self.items)
        inboxes = sum(t.numel() * t.element_size() for ex in self.exchanges.values() for e in ex for t in e.inbox)
        return 2 * flats + inboxes

    def _timed(self, fn) -> float:
        import torch

        start = time.perf_counter()
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def all_reduce(self) -> float:
        import torch.distributed as dist

        def run():
            for work in [dist.all_reduce(flat, group=pe.groups[0], async_op=True) for flat, pe in self.items]:
                work.wait()

        seconds = self._timed(run)
        for flat, _ in self.items:
            flat.fill_(1.0)  # sums would grow without bound over the repeats
        return seconds

    def p2p_exchange(self, k: int) -> float:
        def run():
            started = [ex.start() for ex in self.exchanges[k]]
            back = [ex.reduce_and_return(arriving) for ex, (arriving, _) in zip(self.exchanges[k], started)]
            for (_, results), sends in zip(started, back):
                for work in (*results, *sends):
                    work.wait()

        return self._timed(run)

    def transfer(self, k: int) -> float:
        """Send this rank's bytes to the next peer while receiving as many from the previous."""
        import torch.distributed as dist

        from ..aggregation.strategy import parts

        def run():
            works = []
            for (flat, pe), scratch in zip(self.items, self.scratch):
                order = sorted(pe.exchange.ranks)
                ranks = [order.index(r) for r in pe.exchange.ranks]
                nxt, prv = ranks[(self.me + 1) % self.n], ranks[(self.me - 1) % self.n]
                for i, (a, b) in enumerate(parts(flat.numel(), k)):
                    if b > a:
                        works.append(dist.isend(flat[a:b], group=pe.groups[i], group_dst=nxt))
                        works.append(dist.irecv(scratch[a:b], group=pe.groups[i], group_src=prv))
            for work in works:
                work.wait()

        return self._timed(run)

    def measure(self) -> dict[str, float]:
        """One repeat of every reference, each after a barrier."""
        import torch.distributed as dist

        out = {}
        dist.barrier()
        out["all_reduce"] = self.all_reduce()
        for k in self.connections:
            dist.barrier()
            out[f"p2p_exchange/{k}"] = self.p2p_exchange(k)
        for k in self.connections:
            dist.barrier()
            out[f"transfer/{k}"] = self.transfer(k)
        return out


def _time_rank(model, state, spec: dict, bench: dict) -> tuple[dict, int, str]:
    """This rank's timings of ``spec``'s aggregation and of its limits after the warm-up, its bytes and peak
    memory; with the strategy's cross-facility bytes and collective."""
    import torch.distributed as dist

    from ..aggregation import aggregate, build_strategy, strategy_config

    weights = bench.get("weights")
    base = _memory_mark(state.device)
    strategy = build_strategy(model, state, strategy_config(spec), collective=bench.get("collective"))
    limits = _Limits(strategy, state)
    times, refs = [], []
    for i in range(bench["warmup"] + bench["repeats"]):
        dist.barrier()
        seconds = aggregate(strategy, state, weights).seconds
        measured = limits.measure()
        if i >= bench["warmup"]:
            times.append(seconds)
            refs.append(measured)
    peak = _memory_peak(state.device) - base - limits.nbytes
    limit_bytes = sum(f.numel() * f.element_size() for f, _ in limits.items)
    mine = {
        "times": times,
        "refs": refs,
        "bytes": strategy.bytes_per_rank,
        "limit_bytes": limit_bytes,
        "peak": max(0, peak),
    }
    return mine, strategy.cross_facility_bytes, strategy.collective


def _p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))]


def _time_strategy(model, state, spec: dict, bench: dict) -> dict:
    import torch.distributed as dist

    mine, cross_facility_bytes, collective = _time_rank(model, state, spec, bench)
    everyone: list = [None] * state.world_size
    dist.all_gather_object(everyone, mine)
    gc.collect()  # the strategy and its limits' buffers
    return _row(spec, state, everyone, collective, cross_facility_bytes)


def _row(spec: dict, state, everyone: list[dict], collective: str, cross_facility_bytes: int) -> dict:
    """The table's row for ``spec`` from every rank's timings: a repeat takes as long as its slowest rank."""
    repeats = len(everyone[0]["times"])
    t = [max(r["times"][i] for r in everyone) for i in range(repeats)]

    def ref(key):
        return [max(r["refs"][i][key] for r in everyone) for i in range(repeats)]

    n = state.num_facilities  # peer group size: one rank per facility
    connections = range(1, state.num_streams + 1)
    allreduce = ref("all_reduce")
    exchange = {k: ref(f"p2p_exchange/{k}") for k in connections}
    best_k = min(connections, key=lambda k: statistics.median(exchange[k]))
    transfer = {k: min(ref(f"transfer/{k}")) for k in connections}  # the fastest seen: a floor
    fastest_k = min(connections, key=lambda k: transfer[k])
    limit_kind, lim = min(
        (("all_reduce", allreduce), ("p2p_exchange", exchange[best_k])), key=lambda kv: statistics.median(kv[1])
    )
    median, limit_median = statistics.median(t), statistics.median(lim)
    nbytes = max(r["bytes"] for r in everyone)
    limit_bytes = max(r["limit_bytes"] for r in everyone)
    floor = 2 * (n - 1) / n * transfer[fastest_k]
    algbw = nbytes / median / 1e9
    return {
        "streams": spec["streams"],
        "collective": collective,
        "bucket_mb": spec["bucket_mb"],
        "mode": spec["mode"],
        "median_s": median,
        "p90_s": _p90(t),
        "limit_median_s": limit_median,
        "limit_p90_s": _p90(lim),
        "ratio_to_limit": median / limit_median,
        "limit_kind": limit_kind,
        "allreduce_median_s": statistics.median(allreduce),
        "ratio_to_allreduce": median / statistics.median(allreduce),
        "p2p_exchange_median_s": statistics.median(exchange[best_k]),
        "p2p_exchange_connections": best_k,
        "p2p_bandwidth_GBps": limit_bytes / transfer[fastest_k] / 1e9,
        "floor_s": floor,
        "floor_fraction": floor / median,
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

    from ..distributed.layout import plan_layout
    from ..distributed.state import build_state, read_env
    from ..models import LlamaConfig, build_model
    from ..train.parallelize import contiguous_shards

    env = read_env()
    dcfg, bench = plain["distributed"], plain["bench"]
    layout = plan_layout(env.world_size, dcfg["federated"], dcfg["hsdp"], env.local_world_size)
    state = build_state(
        layout, env, backend=dcfg["backend"], num_streams=max(s["streams"] for s in specs), timeout_s=dcfg["timeout_s"]
    )
    try:
        dtype = getattr(torch, bench["dtype"])
        model = build_model(LlamaConfig.from_mapping(plain["model"]), device="meta", dtype=dtype)
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
@hydra.main(config_path=str(CONF_DIR), config_name="bench", version_base=None)
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
