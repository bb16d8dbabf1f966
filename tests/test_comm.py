"""xffl_like.comm over torch (gloo), launcher variables, the mpirun recipe, and bad input.

The MPI backend, MPI launch and ``strategy.transport=mpi`` are in tests/test_comm_mpi.py.
Expected values are computed by ``workers.comm.check_results`` (tests/workers/comm.py) from the workers' inputs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO
from workers import comm as cw

from xffl_like import comm
from xffl_like.config.schema import StrategyConfig
from xffl_like.distributed.env import read_env
from xffl_like.distributed.launch import launch_local


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torch_backend_collectives_and_transport():
    cw.check_results(launch_local(cw.torch_cases, (), cw.WORLD))


# ----------------------------------------------------------------------------- bad input
def test_unknown_backend_and_op():
    t = torch.ones(2)
    for call in (
        lambda: comm.all_reduce(t, backend="nccl"),
        lambda: comm.send(t, 1, backend="gloo"),
        lambda: comm.get_rank(backend="MPI"),
    ):
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
    assert str(err.value) == (
        "the MPI backend needs mpi4py and an MPI runtime, but mpi4py is not installed: "
        "install the mpi extra (pip install -e '.[mpi]')"
    )
    monkeypatch.setattr(comm, "mpi_installed", lambda: False)
    with pytest.raises(
        ValueError,
        match=r"strategy.transport=mpi needs mpi4py and an MPI runtime: "
        r"install the mpi extra \(pip install -e '.\[mpi\]'\)",
    ):
        validate_strategy_options(StrategyConfig(name="fused", transport="mpi"))


def test_transport_values():
    from xffl_like.aggregation import validate_strategy_options

    assert validate_strategy_options(StrategyConfig(name="fused")).transport == "torch"
    with pytest.raises(ValueError, match=r"strategy.transport='tcp': valid transports are \['torch', 'mpi'\]"):
        validate_strategy_options(StrategyConfig(name="fused", transport="tcp"))


@pytest.mark.parametrize(
    "env, message",
    [
        ({"PMI_RANK": "4", "PMI_SIZE": "4"}, "PMI_RANK=4 but PMI_SIZE=4: a rank must be below the number of processes"),
        (
            {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "PMIX_RANK": "2"},
            "mismatched launcher variables: OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=4 but PMIX_RANK=2",
        ),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "PMI_RANK": "3", "PMI_SIZE": "4"},
            "mismatched launcher variables: SLURM_PROCID=0 SLURM_NTASKS=2 but PMI_RANK=3 PMI_SIZE=4: "
            "inside a Slurm allocation",
        ),
        ({"PMIX_RANK": "1"}, "PMIX_RANK=1 is set but no variable gives the number of processes"),
        ({"RANK": "1"}, "RANK is set but WORLD_SIZE is not"),
        (
            {"MV2_COMM_WORLD_RANK": "x", "MV2_COMM_WORLD_SIZE": "2"},
            "MV2_COMM_WORLD_RANK='x': a launcher variable must be a non-negative integer",
        ),
        (
            {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "2"},
            "MPI_LOCALRANKID=2, MPI_LOCALNRANKS=2 and PMI_SIZE=4 do not fit",
        ),
    ],
)
def test_mismatched_launcher_variables(env, message):
    with pytest.raises(ValueError) as err:
        read_env(env)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "env, speaks",
    [
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "PMI_RANK": "3", "PMI_SIZE": "4"}, False),  # mpirun in sbatch
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "PMI_RANK": "0", "PMI_SIZE": "4"}, True),
        ({"RANK": "2", "WORLD_SIZE": "4", "PMI_RANK": "0", "PMI_SIZE": "2"}, False),  # torchrun's rank is innermost
        ({"RANK": "1"}, True),  # no count: there may be no rank 0
        ({"PMI_RANK": "7", "PMI_SIZE": "4"}, True),  # out of range: likewise
        ({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"}, True),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, False),
        (
            {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "PMIX_RANK": "0"},
            True,
        ),  # srun --mpi=pmix: PMIx's rank, srun's count
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "PMIX_RANK": "1"}, False),
        ({}, True),
    ],
)
def test_launcher_errors_are_reported_by_one_process(env, speaks):
    from xffl_like.distributed.env import reports_launcher_errors

    assert reports_launcher_errors(env) is speaks


def test_read_env_mpi_launchers():
    ompi = read_env(
        {
            "OMPI_COMM_WORLD_RANK": "5",
            "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            "PMIX_RANK": "5",
        }
    )
    assert (ompi.rank, ompi.world_size, ompi.local_rank, ompi.local_world_size, ompi.launcher) == (5, 8, 1, 4, "mpi")
    mpich = read_env(
        {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3", "MASTER_PORT": "99"}
    )
    assert (mpich.rank, mpich.world_size, mpich.local_rank, mpich.master_port, mpich.master_addr) == (2, 3, 2, 99, None)
    mv2 = read_env({"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "2"})
    assert (mv2.rank, mv2.world_size, mv2.local_rank, mv2.local_world_size) == (0, 2, 0, 2)
    # srun --mpi=pmix: Slurm's variables come first, PMIx's rank agrees with them.
    srun = read_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "PMIX_RANK": "3"})
    assert (srun.rank, srun.world_size, srun.local_rank, srun.launcher) == (3, 4, 1, "slurm")
    # torchrun's variables win over an MPI launcher's (one torchrun per node started by mpirun).
    tr = read_env({"RANK": "6", "WORLD_SIZE": "8", "PMI_RANK": "1", "PMI_SIZE": "2"})
    assert (tr.rank, tr.world_size, tr.launcher) == (6, 8, "torchrun")


@pytest.mark.cli
def test_mismatched_launcher_variables_cli(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
    env.update(PMI_RANK="7", PMI_SIZE="4", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "xffl_like.run", "+experiment=llama_fed"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "error: PMI_RANK=7 but PMI_SIZE=4: a rank must be below the number of processes"


@pytest.mark.cli
def test_mpirun_recipe_places_ranks_host_by_host(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("f0-a\nf0-b\n# facility 1\nf1-a\n")
    env = {**os.environ, "DRY_RUN": "1", "HOSTFILE": str(hosts), "PPN": "4", "MPIEXEC": "mpiexec-of-hydra"}
    proc = subprocess.run(
        [
            "bash",
            str(REPO / "workflows" / "mpirun" / "mpirun.sh"),
            "+experiment=llama_fed",
            "distributed.federated=[8,4]",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    # 3 hosts x 4: ranks 0-7 on facility 0's hosts, 8-11 on facility 1's.
    assert proc.stdout.split() == [
        "mpiexec-of-hydra",
        "-n",
        "12",
        "-f",
        str(hosts),
        "-ppn",
        "4",
        "python",
        "-m",
        "xffl_like.run",
        "+experiment=llama_fed",
        r"distributed.federated=\[8\,4\]",
    ]


def test_cpu_point_to_point_waits_in_a_thread_on_a_mixed_group(monkeypatch):
    """gloo completes a CPU send or receive only inside wait(): the handle's thread must wait, also
    when the group is ``cpu:gloo,cuda:nccl`` (dist.get_backend names both there)."""
    import threading

    from xffl_like.comm import transport

    class Work:  # a gloo point-to-point work: is_completed() stays False until wait() returns
        def __init__(self):
            self.released = threading.Event()

        def is_completed(self):
            return False

        def wait(self):
            self.released.wait(10)
            return True

    monkeypatch.setattr(transport.dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    work = Work()
    requests = transport._Requests("torch", [work], torch.device("cpu"))
    assert not requests.done()
    work.released.set()
    requests.thread.join(10)
    assert requests.done()


@pytest.mark.parametrize("backend, cpu", [("gloo", True), ("cpu:gloo,cuda:nccl", True), ("mpi", True), ("nccl", False)])
def test_which_groups_move_cpu_tensors(monkeypatch, backend, cpu):
    from xffl_like.comm import backends

    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    assert backends.handles_cpu() is cpu
