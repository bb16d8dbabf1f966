"""Workers for tests/test_comm.py: the same cases over torch (``launch_local``) and over MPI
(``mpiexec -n 4 python -m workers.comm OUT_DIR`` with tests/ on ``PYTHONPATH``, which also checks the MPI
rendezvous and ``strategy.transport=mpi``).

Workers only run the operations and return what they got; :func:`check_results`, run by
the tests, computes every expected value itself from :func:`values` and :func:`payload`.
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from xffl_like import comm

WORLD = 4
#: Rows each rank contributes to gather_varlen: rank 0 none at all.
ROWS = (0, 2, 1, 3)
#: Subgroup used for the group cases (global ranks).
SUBGROUP = (1, 3)


def values(rank: int, dtype: torch.dtype, shape=(2, 3)) -> torch.Tensor:
    """Deterministic per-rank input of the collectives (exact in bf16 and int64)."""
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float64).view(shape) * (rank + 1) + rank * 4 - 3).to(dtype)


def payload(kind: str, src: int, tag: int) -> torch.Tensor:
    """What ``src`` sends on ``tag``: fp32 with bit patterns a cast would destroy (NaN, -0.0,
    inf, a subnormal), bf16, int64 beyond 2**53, or nothing."""
    gen = torch.Generator().manual_seed(100 * src + tag)
    if kind == "fp32":
        t = torch.randn(5, 3, generator=gen)
        t[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
        t[1, 0] = 1e-42
        return t
    if kind == "bf16":
        return torch.randn(7, generator=gen).to(torch.bfloat16)
    if kind == "int64":
        return torch.randint(-(2**62), 2**62, (4,), generator=gen, dtype=torch.int64)
    return torch.empty(0)


def _subgroup(backend: str):
    if backend == "torch":
        return dist.new_group(list(SUBGROUP))  # every rank creates it
    MPI = comm.get_mpi()
    rank = MPI.COMM_WORLD.Get_rank()
    return MPI.COMM_WORLD.Split(0 if rank in SUBGROUP else MPI.UNDEFINED, rank)


def collective_cases(backend: str) -> dict:
    rank = comm.get_rank(backend)
    out: dict = {"rank": rank, "size": comm.get_world_size(backend)}
    for op in comm.OPS:
        t = values(rank, torch.float32)
        out[f"all_reduce/{op}/float32"] = comm.all_reduce(t, op=op, backend=backend)
    for dtype, op in ((torch.bfloat16, "SUM"), (torch.bfloat16, "MAX"), (torch.int64, "SUM"), (torch.int64, "MIN")):
        out[f"all_reduce/{op}/{dtype}"] = comm.all_reduce(values(rank, dtype), op=op, backend=backend)
    strided = values(rank, torch.float32, (3, 2)).t()  # not contiguous: reduced in place all the same
    comm.all_reduce(strided, op="SUM", backend=backend)
    out["all_reduce/SUM/strided"] = strided
    for dtype in (torch.float32, torch.bfloat16):
        gathered = [torch.full((2, 3), -1.0, dtype=dtype) for _ in range(WORLD)]
        comm.all_gather(gathered, values(rank, dtype), backend=backend)
        out[f"all_gather/{dtype}"] = torch.stack(gathered)
        out[f"broadcast/{dtype}"] = comm.broadcast(values(rank, dtype), src=2, backend=backend)
    rows = values(rank, torch.float32, (ROWS[rank], 3))
    out["gather_varlen"] = comm.gather_varlen(rows, dst=1, backend=backend)
    group = _subgroup(backend)
    if rank in SUBGROUP:
        out["group/rank"] = comm.get_rank(backend, group)
        out["group/size"] = comm.get_world_size(backend, group)
        out["group/all_reduce"] = comm.all_reduce(values(rank, torch.float32), backend=backend, group=group)
        out["group/broadcast"] = comm.broadcast(values(rank, torch.float32), src=1, backend=backend, group=group)
        out["group/gather_varlen"] = comm.gather_varlen(
            values(rank, torch.int64, (rank, 2)), dst=0, backend=backend, group=group
        )
    comm.barrier(backend)
    return out, group


def transport_cases(backend: str, group) -> dict:
    rank = comm.get_rank(backend)
    out: dict = {}
    # Known source, tags interleaved: 0 posts four sends, 1 receives them in another order.
    kinds = {1: "fp32", 2: "bf16", 3: "int64", 4: "empty"}
    if rank == 0:
        handles = [comm.isend(payload(kind, 0, tag), 1, backend=backend, tag=tag) for tag, kind in kinds.items()]
        for h in handles:
            h.wait()
    elif rank == 1:
        for tag in (4, 2, 3, 1):
            out[f"known/{tag}"] = comm.recv(0, backend=backend, tag=tag)
    # Any source: 2 and 3 both send to 0 on tag 5.
    if rank in (2, 3):
        comm.send(payload("fp32", rank, 5), 0, backend=backend, tag=5)
    elif rank == 0:
        out["any"] = [comm.recv(None, backend=backend, tag=5) for _ in range(2)]
    # isend polled until complete: 3 -> 2 on tag 7 while 2 is still busy.
    if rank == 3:
        handle = comm.isend(payload("bf16", 3, 7), 2, backend=backend, tag=7)
        polls = 0
        while not handle.is_complete():
            polls += 1
            time.sleep(0.001)
        handle.wait()  # a no-op now
        out["isend_completed_after_polls"] = polls
    elif rank == 2:
        time.sleep(0.05)
        out["isend"] = comm.recv(3, backend=backend, tag=7)
    # Interop: a plain receive of the documented wire protocol reads what send wrote.
    if rank == 1:
        comm.send(payload("fp32", 1, 6), 2, backend=backend, tag=6)
    elif rank == 2:
        expected_bytes = payload("fp32", 1, 6).numel() * 4
        if backend == "torch":
            length = torch.zeros(1, dtype=torch.int64)
            dist.recv(length, src=1, tag=12)
            data = torch.empty(int(length), dtype=torch.uint8)
            dist.recv(data, src=1, tag=13)
        else:
            data = torch.empty(expected_bytes, dtype=torch.uint8)
            comm.get_mpi().COMM_WORLD.Recv(data.numpy(), source=1, tag=6)
        out["interop"] = data
    # Inside a subgroup, ranks are the group's: global 3 is group rank 1.
    if rank == 3:
        comm.send(payload("int64", 3, 8), 0, backend=backend, tag=8, group=group)
    elif rank == 1:
        out["group/recv"] = comm.recv(None, backend=backend, tag=8, group=group)
    comm.barrier(backend)
    return out


def torch_cases() -> dict:
    """Entry of the torch-backend test (under launch_local: torchrun's environment)."""
    dist.init_process_group("gloo")
    try:
        out, group = collective_cases("torch")
        out.update(transport_cases("torch", group))
        return out
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- expected values
def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def check_results(results: list[dict]) -> None:
    """What every rank got, against values computed from the workers' inputs."""
    world = WORLD
    assert [r["rank"] for r in results] == list(range(world)) and {r["size"] for r in results} == {world}
    ins = {dt: [values(r, dt).double() for r in range(world)] for dt in (torch.float32, torch.bfloat16, torch.int64)}
    total = {dt: sum(v) for dt, v in ins.items()}
    want = {
        "all_reduce/SUM/float32": total[torch.float32].float(),
        "all_reduce/AVG/float32": (total[torch.float32] / world).float(),
        "all_reduce/MAX/float32": torch.stack(ins[torch.float32]).amax(0).float(),
        "all_reduce/MIN/float32": torch.stack(ins[torch.float32]).amin(0).float(),
        "all_reduce/SUM/torch.bfloat16": total[torch.bfloat16].bfloat16(),
        "all_reduce/MAX/torch.bfloat16": torch.stack(ins[torch.bfloat16]).amax(0).bfloat16(),
        "all_reduce/SUM/torch.int64": total[torch.int64].long(),
        "all_reduce/MIN/torch.int64": torch.stack(ins[torch.int64]).amin(0).long(),
        "all_reduce/SUM/strided": sum(values(r, torch.float64, (3, 2)) for r in range(world)).t().float(),
    }
    for dt in (torch.float32, torch.bfloat16):
        want[f"all_gather/{dt}"] = torch.stack([values(r, dt) for r in range(world)])
        want[f"broadcast/{dt}"] = values(2, dt)
    varlen = torch.cat([values(r, torch.float32, (ROWS[r], 3)) for r in range(world)])
    for rank, got in enumerate(results):
        for key, value in want.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), (rank, key, got[key], value)
        if rank == 1:
            assert torch.equal(got["gather_varlen"], varlen) and got["gather_varlen"].shape == (6, 3)
        else:
            assert got["gather_varlen"] is None
    # The subgroup {1, 3}: its own ranks, sum, broadcast source and gather destination.
    a, b = SUBGROUP
    for k, rank in enumerate(SUBGROUP):
        got = results[rank]
        assert (got["group/rank"], got["group/size"]) == (k, 2)
        assert torch.equal(got["group/all_reduce"], values(a, torch.float32) + values(b, torch.float32))
        assert torch.equal(got["group/broadcast"], values(b, torch.float32))
    rows = torch.cat([values(r, torch.int64, (r, 2)) for r in SUBGROUP])
    assert torch.equal(results[a]["group/gather_varlen"], rows) and results[b]["group/gather_varlen"] is None
    assert all("group/rank" not in results[r] for r in range(world) if r not in SUBGROUP)

    # Transport: exact bytes (NaN, -0.0, subnormals, int64 beyond 2**53 included), sources.
    kinds = {1: "fp32", 2: "bf16", 3: "int64", 4: "empty"}
    for tag, kind in kinds.items():
        source, data = results[1][f"known/{tag}"]
        assert source == 0 and data.dtype == torch.uint8 and torch.equal(data, raw(payload(kind, 0, tag))), tag
    fp32 = results[1]["known/1"][1].view(torch.float32).view(5, 3)
    assert torch.equal(raw(fp32), raw(payload("fp32", 0, 1))) and torch.isnan(fp32[0, 0]) and fp32[0, 1].item() == 0.0
    assert results[1]["known/4"][1].numel() == 0
    assert sorted(s for s, _ in results[0]["any"]) == [2, 3]
    for source, data in results[0]["any"]:
        assert torch.equal(data, raw(payload("fp32", source, 5))), source
    assert results[2]["isend"][0] == 3 and torch.equal(results[2]["isend"][1], raw(payload("bf16", 3, 7)))
    assert results[3]["isend_completed_after_polls"] >= 0
    assert torch.equal(results[2]["interop"], raw(payload("fp32", 1, 6)))
    source, data = results[1]["group/recv"]
    assert source == 1 and torch.equal(data, raw(payload("int64", 3, 8)))  # global 3 is group rank 1


# ----------------------------------------------------------------------------- MPI only
TRANSPORT_LAYOUTS = ((2, None), ([2, 1, 1], 1))  # 2 facilities x FSDP(2); 3 facilities, HSDP 2x1 in the first
TRANSPORT_NAMES = ("fused", "layer_by_layer", "bucket_coalesced", "stacked")


def aggregation_over_mpi(env) -> dict:
    """Every (layout, strategy, mode, dtype, weights): ``transport=mpi`` against the seed-derived
    mean, and bitwise against ``transport=torch`` where that runs the same exchange (gloo)."""
    from workers import strategy as sw
    from xffl_like.aggregation import aggregate, build_strategy
    from xffl_like.aggregation.strategy import AGGREGATION_MODES
    from xffl_like.config.schema import StrategyConfig
    from xffl_like.distributed.layout import plan_layout
    from xffl_like.distributed.state import build_state

    cases = 0
    for federated, hsdp in TRANSPORT_LAYOUTS:
        state = build_state(plan_layout(env.world_size, federated, hsdp), env)
        uneven = tuple(float(f + 1) for f in range(state.num_facilities))
        for dtype, weights in itertools.product((torch.float32, torch.bfloat16), (None, uneven)):
            model = sw.make_model(state, dtype)
            tag = cases
            # Over MPI every strategy takes the exchange: between 2 facilities one lerp (see sw.rounding_bound).
            expected = sw.expected(model, state, dtype, tag, weights, lerp=state.num_facilities == 2)
            for name, mode in itertools.product(TRANSPORT_NAMES, AGGREGATION_MODES):
                got = {}
                for transport in ("torch", "mpi"):
                    sw.set_values(model, state, dtype, tag)
                    options = StrategyConfig(name=name, bucket_mb=sw.BUCKET_MB, mode=mode, transport=transport)
                    strategy = build_strategy(model, state, options)
                    aggregate(strategy, state, weights)
                    got[transport] = sw.locals_of(model)
                what = f"{federated}/{hsdp} {name} {mode} {dtype} weights={weights} transport=mpi"
                sw.check_close(model, expected, what)
                # The same exchange arithmetic over either carrier: the same bits. (Over torch a
                # coalesced list takes the all-reduce instead, equal to rounding: check_close.)
                if name != "bucket_coalesced" and not all(torch.equal(a, b) for a, b in zip(got["torch"], got["mpi"])):
                    raise AssertionError(f"{what}: differs bitwise from transport=torch")
                cases += 1
    return {"aggregation_cases": cases}


def mpi_main(out_dir: str) -> None:
    from xffl_like.distributed.env import agree_rendezvous, read_env

    out, group = collective_cases("mpi")
    out.update(transport_cases("mpi", group))
    # The launcher set no MASTER_ADDR: MPI agrees on one, then torch's process group forms.
    env = read_env()
    out["launcher"] = (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size)
    env = agree_rendezvous(env)
    out["rendezvous"] = (env.master_addr, env.master_port)
    dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size)
    try:
        out.update(aggregation_over_mpi(env))
    finally:
        dist.destroy_process_group()
    torch.save(out, Path(out_dir) / f"rank{env.rank}.pt")


if __name__ == "__main__":
    mpi_main(sys.argv[1])
