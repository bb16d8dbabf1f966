"""Tier 2: DistributedState group membership on 4 and 6 gloo processes."""

import math

import pytest
from workers import state as workers

from xffl_like.distributed.launch import launch_local
from xffl_like.distributed.state import read_env


def expected_coords(sizes, shard):
    """Rank -> (facility, facility rank, replica, shard), from the documented formula."""
    out, offset = {}, 0
    for f, size in enumerate(sizes):
        for local in range(size):
            out[offset + local] = (f, local, local // shard, local % shard)
        offset += size
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "world, federated, hsdp, sizes, shard",
    [
        (4, 2, None, [2, 2], 2),  # 2 facilities x FSDP(2): 1-D meshes
        (4, None, 2, [4], 2),  # 1 facility, HSDP 2 replicas x 2 shards: 2-D mesh
        (6, [4, 2], 2, [4, 2], 2),  # unequal facilities: 2-D mesh and 1-D mesh
    ],
)
def test_group_membership(world, federated, hsdp, sizes, shard):
    results = launch_local(workers.state_membership, (federated, hsdp, 2), world)
    coords = expected_coords(sizes, shard)
    for rank, res in enumerate(results):
        f, local, replica, s = coords[rank]
        assert tuple(res["coords"]) == (f, local, replica, s)
        facility = [r for r, c in coords.items() if c[0] == f]
        replicas = [r for r, c in coords.items() if c[0] == f and c[3] == s]
        assert res["mesh"] == (
            [[r for r in facility if coords[r][2] == k] for k in range(len(replicas))]
            if len(replicas) > 1
            else [r for r in facility if coords[r][2] == replica]
        )
        assert res["mesh_dims"] == (("replicate", "shard") if len(replicas) > 1 else ("shard",))
        for ranks, total in res["facility"]:  # one handle per stream, same members
            assert list(ranks) == facility and total == sum(facility)
        for ranks, total in res["replica"]:
            assert list(ranks) == replicas and total == sum(replicas)
        # The named groups, members from the coordinates (both streams where a group has one per stream).
        everyone = list(range(len(coords)))
        shard_ranks = [r for r, c in coords.items() if c[0] == f and c[2] == replica]
        peers = [r for r, c in coords.items() if c[3] == s]
        first = [r for r, c in coords.items() if c[3] == s and c[2] == 0]
        want = {
            "world": everyone,
            "facility": facility,
            "replica": replicas,
            "shard": shard_ranks,
            "peers": peers,
            "background": everyone,
            "overlap_replicas": replicas,
            "senders": first if replica == 0 and len(sizes) > 1 else None,
            "overlap_peers": first if replica == 0 else None,
        }
        for name, members in want.items():
            for got in res["named"][name]:
                assert (got is None) if members is None else got == (tuple(members), sum(members)), (rank, name, got)
        if len(sizes) == 1:
            assert res["split"] == [] and res["sender"] == []
            continue
        # split mode: chunk c is reduced by replica c % R_g of every facility g
        for chunk, handles in res["split"]:
            members = [r for r, c in coords.items() if c[3] == s and c[2] == chunk % (sizes[c[0]] // shard)]
            assert rank in members
            for ranks, total in handles:
                assert list(ranks) == members and total == sum(members)
        r_f = sizes[f] // shard
        n_chunks = math.lcm(*[size // shard for size in sizes])
        assert sorted(c for c, _ in res["split"]) == [c for c in range(n_chunks) if c % r_f == replica]
        if replica == 0:
            senders = [r for r, c in coords.items() if c[3] == s and c[2] == 0]
            assert [list(ranks) for ranks, _ in res["sender"][0]] == [senders, senders]
        else:
            assert res["sender"] == []
    assert "facility" in results[0]["describe"]


def test_unknown_group_name_is_one_line():
    from xffl_like.distributed.state import DistributedState

    state = DistributedState.__new__(DistributedState)
    object.__setattr__(state, "groups", {"world": (None,)})
    with pytest.raises(KeyError, match="no process group 'facilty': the names are world, facility"):
        state.group("facilty")
    with pytest.raises(KeyError, match="overlap=True"):
        state.group("overlap_peers")


def test_read_env_prefers_torchrun_then_slurm():
    env = read_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "123",
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "9",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.master_port) == (3, 4, 1, 2, 123)
    env = read_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert read_env({}) is None


@pytest.mark.parametrize("visible, local_rank, index", [(4, 3, 3), (1, 3, 0), (2, 3, 1)])
def test_cuda_device_is_the_local_rank_among_the_visible_gpus(monkeypatch, visible, local_rank, index):
    """srun --gpus-per-task=1 shows each task one GPU (cuda:0) whatever its SLURM_LOCALID."""
    import torch

    from xffl_like.distributed.device import cuda_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    assert cuda_device(local_rank) == torch.device("cuda", index)


def test_cuda_device_without_a_gpu_is_one_line(monkeypatch):
    import torch

    from xffl_like.distributed.device import cuda_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="sees no GPU"):
        cuda_device(0)


def test_a_gpu_process_gets_tf32_unless_a_precision_was_chosen(monkeypatch):
    import torch

    from xffl_like.distributed.device import cuda_defaults

    picked = []
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")  # torch's default
        cuda_defaults(torch.device("cuda", 1))
        assert picked == [torch.device("cuda", 1)] and torch.get_float32_matmul_precision() == "high"
        torch.set_float32_matmul_precision("medium")  # the user's choice stays
        cuda_defaults(torch.device("cuda", 0))
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)


def test_a_forked_worker_refuses_an_initialised_cuda(monkeypatch):
    import torch

    from xffl_like.distributed.launch import check_cuda_fresh

    check_cuda_fresh()  # this process never touched CUDA
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA was initialised in the fork server"):
        check_cuda_fresh()


def test_mpi_ranks_bind_their_gpu_before_mpi_starts(monkeypatch):
    """Under mpirun without MASTER_ADDR/PORT the rank's GPU is made current before mpi4py is imported."""
    import torch

    from xffl_like.distributed import env as envmod

    order = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: order.append(("device", d)))

    def no_mpi():
        order.append(("mpi", None))
        raise ImportError("stop here")

    import xffl_like.comm.backends as backends

    monkeypatch.setattr(backends, "get_mpi", no_mpi)
    env = envmod.read_env(
        {
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "3",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        }
    )
    with pytest.raises(ImportError):
        envmod.agree_rendezvous(env)
    assert order == [("device", torch.device("cuda", 1)), ("mpi", None)]
