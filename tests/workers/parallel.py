"""Functions run inside spawned workers by tests/test_parallel_*.py (importable by name).

Workers only run the code under test and report raw tensors; the expected values
are computed in the tests.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

SHAPES = [(5, 3), (7,), (2, 2)]


class Fixed(nn.Module):
    """loss = sum_k <p_k, c_k>: the gradient of p_k is exactly the input c_k."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES])
        self.register_buffer("running", torch.full((3,), float(seed)))

    def forward(self, coefs, reverse: bool = False):
        order = range(len(self.ps) - 1, -1, -1) if reverse else range(len(self.ps))
        return sum((self.ps[k] * coefs[k]).sum() for k in order)


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward takes 20 ms: keeps a backward open while other threads run."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.02)
        return g


class _Slow(nn.Module):
    def forward(self, x):
        return _SlowBackward.apply(x)


def mlp(seed: int, slow: bool = False) -> nn.Module:
    """A model whose backward needs its weights (a hook changing them too early breaks autograd)."""
    torch.manual_seed(seed)
    layers = [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)]
    return nn.Sequential(*(layers[:2] + [_Slow()] + layers[2:] if slow else layers))


def mlp_batch(rank: int, it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(20_000 + 100 * rank + it)
    return torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)


def coefs(rank: int, it: int, micro: int = 0) -> list[torch.Tensor]:
    """The gradient rank ``rank`` gets at iteration ``it`` (micro-batch ``micro``)."""
    g = torch.Generator().manual_seed(10_000 + 100 * rank + 10 * it + micro)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def run(calls):
    """Run ``[(function name, args), ...]`` of this module in one process group; return their results."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a mismatched exchange fails, not hangs
    try:
        return [globals()[name](*args) for name, args in calls]
    finally:
        dist.destroy_process_group()


def _init():
    torch.manual_seed(0)
    return dist.get_rank(), dist.get_world_size()


def topology_groups(cases):
    """For each (name, ranks, local): per iteration, this rank's edge, weight and the sum of ranks over its group."""
    from xffl_like.parallel.topology import Topology

    rank, _ = _init()
    out = []
    for name, ranks, local in cases:
        topo = Topology(name, ranks, local)
        rows = []
        if rank in topo.ranks:
            for step in range(topo.period):
                e = topo.get_edge(step)
                t = torch.tensor([float(rank)])
                if e.group is not None:
                    dist.all_reduce(t, group=e.group)
                rows.append((list(e.ranks), e.weight, t.item()))
        out.append(rows)
    return out


def ddp_cases(cases, iterations=3, lr=0.1):
    """Train DecentralizedDataParallel (SGD, fixed gradients) per case; report params and global_avg."""
    from xffl_like import parallel as P
    from xffl_like.parallel import DecentralizedDataParallel

    rank, _ = _init()
    out = []
    for case in cases:
        model = mlp(rank) if case.get("mlp") else Fixed(seed=rank)  # different per rank: rank 0's must win
        ddp = DecentralizedDataParallel(
            model,
            lambda named: torch.optim.SGD([p for _, p in named], lr=lr),
            topology=case["topology"],
            param_as_bucket_view=case["view"],
            bucket_size_in_mb=case["bucket_mb"],
            local_world_size=case.get("local", 1),
        )
        for it in range(1, iterations + 1):
            if case.get("mlp"):
                x, y = mlp_batch(rank, it)
                torch.nn.functional.mse_loss(ddp(x), y).backward()
                continue
            if case["accum"]:
                ddp.set_accumulate_grad(True)
                ddp(coefs(rank, it, 1)).backward()
                ddp.set_accumulate_grad(False)
            ddp(coefs(rank, it)).backward()
        ddp.wait_pending()  # waits only: "trained" (checked against the simulation) is still before the mix
        trained = _params(model)
        import xffl_like.parallel.runtime as pcomm

        pcomm.CONSENSUS_CHUNK, chunk = 3, pcomm.CONSENSUS_CHUNK  # parameters cut across several all-reduces
        distance = P.consensus_distance(model)
        pcomm.CONSENSUS_CHUNK = chunk
        ddp.global_avg()
        out.append(
            {
                "trained": trained,
                "avg": _params(model),
                "buckets": len(ddp.optimizers),
                "hierarchical": ddp._thread is not None,
                "consensus": distance,
                "consensus_after": P.consensus_distance(ddp),
            }
        )
    # Every rank must trace the same parameter order: rank 1 runs the sum in reverse.
    ddp = DecentralizedDataParallel(
        Fixed(0), lambda named: torch.optim.SGD([p for _, p in named], lr=lr), bucket_size_in_mb=1
    )
    try:
        for it in range(2):
            ddp(coefs(rank, it), reverse=rank == 1).backward()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    out.append(error)
    # alternating-exp-ring over nodes of unequal size (3 + 1): the same error on every rank, no hang.
    try:
        DecentralizedDataParallel(
            Fixed(0),
            lambda named: torch.optim.SGD([p for _, p in named], lr=lr),
            topology="alternating-exp-ring",
            local_world_size=[3, 3, 3, 1][rank],
        )
        error = None
    except ValueError as exc:
        error = str(exc)
    out.append(error)
    return out


def bagua_cases(cases, lr=0.1):
    """Run the Bagua-style algorithms per case; report what the tests check."""
    from xffl_like import parallel as P

    rank, world = _init()
    out = []
    for case in cases:
        kind = case["kind"]
        model = mlp(rank, slow=True) if kind == "async_mlp" else Fixed(seed=rank)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        algo = case["algorithm"]
        local = case.get("local")
        if isinstance(local, list):  # nodes of unequal size: each rank declares its own node's size
            local = local[rank]
        if kind == "error":
            try:
                P.with_algorithm(model, opt, algo, local_world_size=local)
                out.append({"error": None})
            except ValueError as exc:
                out.append({"error": str(exc)})
            continue
        wrapped = P.with_algorithm(model, opt, algo, bucket_mb=case.get("bucket_mb", 10), local_world_size=local)
        res = {"init": _params(model)}
        if kind == "grads":  # one backward: the synchronized gradients
            wrapped(coefs(rank, 1)).backward()
            res["grads"] = [p.grad.clone() for p in model.parameters()]
        elif kind == "steps":
            res["steps"] = []
            for it in range(1, case["steps"] + 1):
                wrapped(coefs(rank, it)).backward()
                opt.step()
                opt.zero_grad()
                res["steps"].append(_params(model))
            if isinstance(algo, P.LowPrecisionDecentralized):
                left, right = algo.peer_copies
                res["left"], res["right"] = [t.clone() for t in left], [t.clone() for t in right]
        elif kind == "async_mlp":  # the thread averages continuously while autograd holds the weights
            for it in range(1, case["steps"] + 1):
                x, y = mlp_batch(rank, it)
                torch.nn.functional.mse_loss(wrapped(x), y).backward()
                opt.step()
                opt.zero_grad()
            algo.abort()
            res["rounds"] = algo.rounds
        elif kind == "async":
            for it in range(1, case["steps"] + 1):
                wrapped(coefs(rank, it)).backward()
                if it == case["steps"]:
                    # An exchange ends inside the last step (its result must be applied although no forward
                    # follows; it once waited for one, and every rank's thread stalled until abort).
                    time.sleep(0.3)
                opt.step()
                opt.zero_grad()
                time.sleep(0.01)
            # No more local steps: wait (same target on every rank) for two exchanges that start after
            # every rank stopped training; they bring the copies together.
            dist.barrier()
            seen = torch.tensor([float(algo.rounds)])
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
            deadline = time.time() + case["settle"]
            while algo.rounds < int(seen.item()) + 2 and time.time() < deadline:
                time.sleep(0.005)
            algo.abort()
            res["alive"] = algo._thread is not None
            res["rounds"] = algo.rounds
            res["final"] = _params(model)
            algo.resume()
            time.sleep(0.05)
            algo.abort()
            res["alive_after_resume"] = algo._thread is not None
        out.append(res)
    return out


def switch(lr=0.05):
    """GradientAllReduce -> Decentralized(shift_one) -> LowPrecisionDecentralized -> GradientAllReduce, with Adam."""
    from xffl_like import parallel as P

    rank, _ = _init()
    model = Fixed(seed=rank)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    wrapped = P.with_algorithm(model, opt, P.GradientAllReduce(), local_world_size=2)
    phases = [
        P.Decentralized(hierarchical=False, peer_selection_mode="shift_one"),
        P.LowPrecisionDecentralized(hierarchical=True),
        P.GradientAllReduce(hierarchical=True),
    ]
    it, report = 0, []
    for nxt in [None] + phases:
        if nxt is not None:
            before = _params(model)
            wrapped.switch_to(nxt)
            state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
            report.append({"before": before, "after": _params(model), "state": state})
        for _ in range(2):
            it += 1
            wrapped(coefs(rank, it)).backward()
            opt.step()
            opt.zero_grad()
    return report
