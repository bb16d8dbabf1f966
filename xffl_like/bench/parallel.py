"""Benchmark: step time and final loss of the data-parallel libraries against DDP, side by side.

    python -m xffl_like.bench.parallel                       # 4 local processes, 2 "nodes" of 2, loopback
    python -m xffl_like.bench.parallel --nproc 8 --local-world-size 4 --steps 40 --out bench_parallel.json
    python -m xffl_like.bench.parallel --link-mbit 100        # 2 nodes in 2 network namespaces, a shaped link (root)

Every method trains the same model (``conf/model/<model>.yaml``, seed 0) on the same
per-rank batches (a fixed random bigram language, different samples per rank) with
AdamW for ``--steps`` steps, in the same processes: PyTorch
``DistributedDataParallel``, ``local`` (no communication at all: every rank trains
its own copy; the floor of any method's step time on this machine, and what
communication buys in loss), :class:`DecentralizedDataParallel` on ring,
one-peer-exp and alternating-exp-ring, and each Bagua-style algorithm, every bucketed
method with the same bucket size (``--bucket-mb``). It reports
the median step time after ``--warmup`` steps (methods take turns every ``--block`` steps,
so load changes on a shared machine hit all of them alike; a method's communication is
finished before another's turn, so none runs under another's steps, and the first step
of a turn, with nothing pending from before, is not timed) and its ratio to DDP's; the
final training loss (each rank's loss on its own copy, mean over ranks and the last 5
steps); the consensus distance of the copies at the end; and the evaluation loss of
the model each method produces, with its ratio to DDP's. That model is the exact mean
of the copies, as users evaluate it: ``global_avg()`` for DecentralizedDataParallel,
``allreduce_parameters`` for the Bagua algorithms (a no-op up to rounding where the
copies already agree) and ``local``, DDP's model as it is. It is evaluated on the same held-out
batches for every method (``--eval-batches`` per rank, samples of the same language
that no method trained on).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from .. import CONF_DIR

METHODS = [
    "ddp",
    "local",
    "decent:ring",
    "decent:one-peer-exp",
    "decent:alternating-exp-ring",
    "bagua:gradient_allreduce",
    "bagua:bytegrad",
    "bagua:decentralized",
    "bagua:low_precision_decentralized",
    "bagua:async",
]
HELD_OUT_SEED = 10_000  # held-out batches come from generators no training rank uses


def _batches(rank: int, steps: int, batch: int, seq: int, vocab: int):
    """Samples of one fixed bigram language (same for all ranks), different samples per rank."""
    import torch

    lang = torch.Generator().manual_seed(1234)
    probs = torch.softmax(torch.randn(vocab, vocab, generator=lang) * 3, dim=1)
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(steps):
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (batch,), generator=gen)
        for t in range(seq):
            tokens[:, t + 1] = torch.multinomial(probs[tokens[:, t]], 1, generator=gen).squeeze(1)
        out.append(tokens)
    return out


def _bagua_algorithm(name: str):
    from xffl_like import parallel as P

    return {
        "gradient_allreduce": lambda: P.GradientAllReduce(),
        "bytegrad": lambda: P.ByteGrad(hierarchical=True),
        "decentralized": lambda: P.Decentralized(hierarchical=True),
        "low_precision_decentralized": lambda: P.LowPrecisionDecentralized(hierarchical=True),
        "async": lambda: P.AsyncModelAverage(sync_interval_ms=50),
    }[name]()


def kind_of(method: str) -> str:
    """``ddp``, ``decent`` or ``bagua``."""
    return method.partition(":")[0]


def _eval_loss(model, batches) -> float:
    """Mean next-token cross-entropy of ``model`` on ``batches`` (no gradient; training mode restored)."""
    import torch
    import torch.nn.functional as F

    model.eval()
    with torch.no_grad():
        losses = [F.cross_entropy(model(t[:, :-1]).flatten(0, 1), t[:, 1:].reshape(-1)).item() for t in batches]
    model.train()
    return statistics.fmean(losses)


def _method_run(method: str, cfg, args: dict) -> dict:
    """A fresh copy of the model (same seed for every method) wrapped as ``method`` trains it, with its optimizer
    (``None`` where the wrapper steps its own)."""
    import torch

    from xffl_like import parallel as P
    from xffl_like.models.llama import Llama

    torch.manual_seed(0)
    model = Llama(cfg)
    kind, _, name = method.partition(":")
    if kind == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args["bucket_mb"])
        opt = torch.optim.AdamW(model.parameters(), lr=args["lr"], weight_decay=0.0)
    elif kind == "local":  # the floor: every rank trains its own copy, nothing is communicated
        net = model
        opt = torch.optim.AdamW(model.parameters(), lr=args["lr"], weight_decay=0.0)
    elif kind == "decent":
        net = P.DecentralizedDataParallel(
            model,
            lambda named: P.optim_fn_adamw(named, lr=args["lr"], weight_decay=0.0),
            topology=name,
            local_world_size=args["local_world_size"],
            bucket_size_in_mb=args["bucket_mb"],
        )
        opt = None
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args["lr"], weight_decay=0.0)
        net = P.with_algorithm(
            model,
            opt,
            _bagua_algorithm(name),
            bucket_mb=args["bucket_mb"],
            local_world_size=args["local_world_size"],
        )
    return {"net": net, "opt": opt, "model": model, "times": [], "losses": []}


def _train_block(run: dict, data, first: int, block: int, warmup: int) -> None:
    """Train ``run``'s steps ``first`` to ``first + block`` (at most), timing each but the block's first and
    the warm-up; then finish the method's communication (untimed)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from xffl_like import parallel as P

    net, opt = run["net"], run["opt"]
    asynchronous = isinstance(getattr(net, "algorithm", None), P.AsyncModelAverage)
    if asynchronous and first > 0:
        net.algorithm.resume()
    for step in range(first, min(first + block, len(data))):
        tokens = data[step]
        dist.barrier()
        start = time.perf_counter()
        logits = net(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        dist.barrier()
        if step >= warmup and step > first:
            run["times"].append(time.perf_counter() - start)
        run["losses"].append(loss.item())
    if asynchronous:
        net.algorithm.abort()  # collective: every rank stops after the same exchange, its result applied
    elif isinstance(net, P.DecentralizedDataParallel):
        net.wait_pending()  # the next hook applies the mix, as in training


def _method_result(method: str, run: dict, held_out, world: int) -> dict:
    """``method``'s median step time, and the final and held-out losses and consensus distance of the model it
    produces (the exact mean of the copies; DDP's copies are that already), averaged over ranks."""
    import torch
    import torch.distributed as dist

    from xffl_like import parallel as P

    net, model = run["net"], run["model"]
    consensus = P.consensus_distance(model)
    if isinstance(net, P.DecentralizedDataParallel):
        net.global_avg()
    elif kind_of(method) in ("bagua", "local"):
        P.allreduce_parameters(model)
    final = torch.tensor([statistics.fmean(run["losses"][-5:]), _eval_loss(model, held_out)])
    dist.all_reduce(final)
    return {
        "step_s": statistics.median(run["times"]),
        "final_loss": final[0].item() / world,
        "eval_loss": final[1].item() / world,
        "consensus_distance": consensus,
    }


def _worker(args: dict) -> dict:
    import torch.distributed as dist
    import yaml

    from xffl_like.models.llama import LlamaConfig

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = LlamaConfig.from_mapping(yaml.safe_load((CONF_DIR / "model" / f"{args['model']}.yaml").read_text()))
    data = _batches(rank, args["steps"], args["batch"], args["seq"], cfg.vocab_size)
    held_out = _batches(HELD_OUT_SEED + rank, args["eval_batches"], args["batch"], args["seq"], cfg.vocab_size)
    runs = {method: _method_run(method, cfg, args) for method in args["methods"]}  # every copy side by side
    # Interleaved in blocks of --block steps: every method's block t, then every method's block t + 1,
    # so load changes hit all methods alike. Within a block a method's communication overlaps its own
    # next step, as in training; between blocks it is finished (untimed: DecentralizedDataParallel's
    # pending mixing, AsyncModelAverage's thread paused), so no method's traffic runs during another's
    # steps, and the first step of a block (nothing pending from before) is not timed.
    for first in range(0, len(data), args["block"]):
        for run in runs.values():
            _train_block(run, data, first, args["block"], args["warmup"])
    results = {method: _method_result(method, run, held_out, world) for method, run in runs.items()}
    dist.destroy_process_group()
    return results


def _shaped(args: dict, nodes: int, per_node: int, link_mbit: float, timeout_s: float) -> tuple[dict | None, str]:
    """The same run with every node in its own network namespace (one torchrun per node),
    the nodes joined by links of ``link_mbit`` each way; ``(None, why)`` when namespaces
    cannot be made here (printed; not an error)."""
    import tempfile

    from .netns import (
        CounterSampler,
        NetnsError,
        Network,
        cleanup_on_signals,
        launch_torchrun,
        unavailable,
        wait_launchers,
    )

    why = unavailable()
    if why:
        print(f"--link-mbit skipped: {why}")
        return None, why
    with tempfile.TemporaryDirectory(prefix="xffl-bench-parallel-") as tmp, cleanup_on_signals():
        work = Path(tmp)
        (work / "args.json").write_text(json.dumps({**args, "result_path": str(work / "results.json")}))
        try:
            network = Network(nodes, link_mbit)
        except NetnsError as exc:
            print(f"--link-mbit skipped: cannot build network namespaces here: {exc}")
            return None, str(exc)
        with network, CounterSampler(network) as sampler:
            started = time.time()
            procs = launch_torchrun(
                network,
                per_node,
                ["-m", "xffl_like.bench.parallel", "--worker", str(work / "args.json")],
                {"OMP_NUM_THREADS": "1"},
                work,
                29500,
            )
            failed = wait_launchers(procs, network, timeout_s)
            crossed = sum(sampler.tx_between(started, time.time()))
        if failed:
            logs = "".join(p.read_text(errors="replace") for p in sorted(work.glob("facility*.log")))
            last = [ln for ln in logs.splitlines() if "Error" in ln or ln.startswith("error")][-1:]
            print(f"error: {failed}{': ' + last[0] if last else ''}", file=sys.stderr)
            raise SystemExit(1)
        results = json.loads((work / "results.json").read_text())
    return results, (
        f"{nodes} network namespaces joined by {link_mbit:g} Mbit/s links (tbf), {crossed / 1e6:.1f} MB crossed in all"
    )


def _shaped_or_interrupted(*args) -> tuple[dict | None, str]:
    try:
        return _shaped(*args)
    except KeyboardInterrupt:
        print("interrupted: the run was stopped and the namespaces removed", file=sys.stderr)
        raise SystemExit(130) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m xffl_like.bench.parallel", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--local-world-size", type=int, default=2, help="processes per emulated node")
    p.add_argument("--model", default="llama_tiny")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--block",
        type=int,
        default=5,
        help="methods take turns every this many steps (the first step of a turn is not timed)",
    )
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=0.5,
        help="bucket size of every bucketed method (DDP's bucket_cap_mb, bucket_size_in_mb, bucket_mb): "
        "the libraries' defaults (25, 25, 10 MB) hold all of llama_tiny's 3.4 MB in one bucket, "
        "so nothing would overlap the backward pass",
    )
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches per rank for the evaluation loss")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument(
        "--link-mbit",
        type=float,
        default=None,
        help="put each node (--local-world-size processes) in its own network namespace, the nodes "
        "joined by links of this many Mbit/s each way (tc tbf; needs root)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before a shaped-link run is stopped")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)  # internal: one torchrun worker
    return p


def _problems(a: argparse.Namespace, methods: list[str]) -> list[str]:
    """What is wrong with the command line, one phrase each."""
    unknown = [m for m in methods if m not in METHODS]
    problems = [f"unknown method(s) {unknown}: choose from {', '.join(METHODS)}"] if unknown else []
    if a.nproc < 2 or a.nproc % a.local_world_size or a.local_world_size < 1:
        problems.append(f"--local-world-size {a.local_world_size} must divide --nproc {a.nproc} (>= 2)")
    if not (0 <= a.warmup < a.steps - 1) or a.steps < 6:
        problems.append(f"--steps {a.steps} must be >= 6 and exceed --warmup {a.warmup} by 2")
    if a.block < 2 or a.block > a.steps - a.warmup:
        problems.append(
            f"--block {a.block} must be >= 2 and at most --steps - --warmup ({a.steps - a.warmup}): "
            "the first step of every turn is not timed"
        )
    if not a.bucket_mb > 0:
        problems.append(f"--bucket-mb {a.bucket_mb} must be > 0")
    if a.eval_batches < 1:
        problems.append(f"--eval-batches {a.eval_batches} must be >= 1")
    if a.link_mbit is not None and not a.link_mbit > 0:
        problems.append(f"--link-mbit {a.link_mbit}: must be a positive number of Mbit/s")
    if a.link_mbit is not None and a.nproc // max(1, a.local_world_size) < 2:
        problems.append(
            f"--link-mbit needs at least 2 nodes: --nproc {a.nproc} / --local-world-size {a.local_world_size}"
        )
    if not (CONF_DIR / "model" / f"{a.model}.yaml").exists():
        problems.append(f"--model {a.model}: no conf/model/{a.model}.yaml")
    return problems


def _run(a: argparse.Namespace, args: dict) -> tuple[dict | None, str]:
    """The workers' results and where they ran (loopback, or shaped links; ``None`` when interrupted)."""
    from xffl_like.distributed.launch import WorkerFailure, launch_local

    if a.link_mbit is not None:
        return _shaped_or_interrupted(args, a.nproc // a.local_world_size, a.local_world_size, a.link_mbit, a.timeout)
    from xffl_like.bench.parallel import _worker as worker  # by module name: spawned workers import it

    try:
        return launch_local(worker, (args,), a.nproc)[0], "loopback"
    except WorkerFailure as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def _print_table(a: argparse.Namespace, results: dict, where: str) -> None:
    """Every method's step time, losses and consensus, each beside its ratio to DDP's."""
    base = results.get("ddp")
    print(
        f"{a.nproc} processes ({a.nproc // a.local_world_size} nodes of {a.local_world_size}), {where}, "
        f"model={a.model}, {a.steps} steps"
    )
    print(
        f"{'method':36s} {'step ms':>8s} {'x DDP':>6s} {'train loss':>10s} {'x DDP':>6s} {'consensus':>9s} "
        f"{'eval loss':>9s} {'x DDP':>6s}"
    )
    for m, r in results.items():

        def ratio(key, r=r):
            return f"{r[key] / base[key]:.3f}" if base else "-"

        print(
            f"{m:36s} {1000 * r['step_s']:8.1f} {ratio('step_s')[:-1]:>6s} {r['final_loss']:10.4f} "
            f"{ratio('final_loss'):>6s} {r['consensus_distance']:9.2e} {r['eval_loss']:9.4f} {ratio('eval_loss'):>6s}"
        )
    print(
        "train loss: each rank's training loss on its own copy (last 5 steps); consensus: before averaging; "
        "eval loss: the mean of the copies on held-out batches"
    )


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark in ``--nproc`` local processes; print the table, optionally write JSON."""
    a = _parser().parse_args(argv)
    if a.worker is not None:  # started by torchrun inside a namespace (--link-mbit): train, rank 0 reports
        args = json.loads(a.worker.read_text())
        results = _worker(args)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args["result_path"]).write_text(json.dumps(results))
        return results
    methods = [m for m in a.methods.split(",") if m]
    problems = _problems(a, methods)
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        raise SystemExit(2)
    args = {k: v for k, v in vars(a).items() if k not in ("out", "worker")}
    args["methods"] = methods
    results, where = _run(a, args)
    if results is None:
        return {}
    _print_table(a, results, where)
    report = {
        "config": {k: v for k, v in vars(a).items() if k not in ("out", "worker")},
        "network": where,
        "results": results,
    }
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=2, default=str))
    return report


def cli() -> None:
    """The ``xffl-bench-parallel`` command: :func:`main`, whose report is not an exit status."""
    main()


if __name__ == "__main__":
    cli()
