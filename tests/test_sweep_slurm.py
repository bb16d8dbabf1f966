"""Sweeps as one job per point (hydra/launcher=slurm | local_submitit, the slurm extra): a real sweep
through submitit's local executor (one point trains, one fails), the Slurm parameters and sbatch
lines of a federated point, the partition limit, and the one line without the extra."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import CONF, PYTHONPATH, REPO
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from xffl_like.distributed.allocation import num_nodes, partition_node_limit

try:
    from hydra_plugins.xffl_like_launcher._submitit_sweep import SlurmSweepLauncher, SweepRefused, executor_parameters
except ImportError:  # without the slurm extra only the test of its missing-extra line runs
    SlurmSweepLauncher = None
needs_extra = pytest.mark.skipif(SlurmSweepLauncher is None, reason="the slurm extra: pip install -e '.[slurm]'")

TINY = [
    "train.steps=4",
    "optim.warmup_steps=2",
    "federation.every=2",
    "train.batch_size=2",
    "distributed.federated=1",
    "logger=none",
]


def _env(**extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": PYTHONPATH, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", **extra}


def _fake_bin(tmp_path: Path, **scripts: str) -> str:
    """A folder of shell scripts (``srun``, ``sbatch``, ``sinfo``) first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def _launcher(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    return OmegaConf.to_container(cfg.hydra.launcher, resolve=True)


@needs_extra
@pytest.mark.cli
@pytest.mark.multiprocess
@pytest.mark.slow
def test_local_submitit_sweep_one_job_per_point_with_a_failed_point(tmp_path):
    sweep_dir = tmp_path / "sweep"
    # Point 0: 2 processes = 2 facilities of 1, weighted 1:3. Point 1: 1 process = 1 facility, for which two
    # weights are one too many: it fails in rank 0's validation under torchrun (and costs one worker).
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "xffl_like.run",
            "-m",
            "+experiment=llama_fed",
            "hydra/launcher=local_submitit",
            *TINY,
            "train.seq_len=32",
            "federation.weights=[1,3]",
            "distributed.nproc_per_node=2,1",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # both points ran; one failed -> exit 1
    with open(sweep_dir / "sweep_summary.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["job"], r["status"], r["overrides"]) for r in rows] == [
        ("0_fused", "ok", "distributed.nproc_per_node=2"),
        ("1_fused", "failed", "distributed.nproc_per_node=1"),
    ]
    summary = json.loads((sweep_dir / "0_fused" / "summary.json").read_text())
    assert float(rows[0]["final_loss"]) == pytest.approx(summary["final_loss"])
    assert float(rows[0]["aggregation_seconds_median"]) > 0 and float(rows[0]["cross_facility_bytes_per_round"]) > 0
    assert rows[1]["error"].startswith("federation.weights=[1, 3]: use uniform, tokens, or a list of 1 ")
    assert (sweep_dir / "1_fused" / ".hydra" / "overrides.yaml").exists()
    # Each point was its own submitit job, sized from its own distributed.*, its node running it under torchrun.
    logs = {p.parent.name: p.read_text() for p in (sweep_dir / ".submitit").glob("*/*_0_log.out")}
    assert len(logs) == 2
    sizes = [
        re.search(r"-m torch\.distributed\.run --nnodes=1 --nproc-per-node=(\d) --node-rank=0 ", text)
        for text in logs.values()
    ]
    assert sorted(found[1] for found in sizes if found) == ["1", "2"]
    assert "job 1_fused failed: federation.weights=[1, 3]" in proc.stderr
    # The summary command reads the sweep directory unchanged.
    rebuilt = subprocess.run(
        [sys.executable, "-m", "xffl_like.observe.sweep", str(sweep_dir)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rebuilt.returncode == 1 and "2 jobs, 1 ok, 1 failed" in rebuilt.stdout
    assert "`1_fused`: federation.weights=[1, 3]" in rebuilt.stdout


@needs_extra
def test_slurm_parameters_of_a_federated_point(tmp_path, monkeypatch):
    launcher = _launcher(
        [
            "+experiment=llama_fed",
            "hydra/launcher=slurm",
            "distributed.federated=[8,4]",
            "hydra.launcher.partition=gpu",
            "hydra.launcher.account=proj",
            "hydra.launcher.timeout_min=90",
            "hydra.sweep.dir=/sweeps/s",
        ]
    )
    params = executor_parameters(launcher, "slurm")
    # Two facilities of 8 and 4 processes = 12 processes = 3 nodes x 4 (one torchrun per node, one process per GPU).
    expected = {
        "nodes": 3,
        "tasks_per_node": 1,
        "gpus_per_node": 4,
        "timeout_min": 90,
        "slurm_partition": "gpu",
        "slurm_account": "proj",
        "name": "xffl_llama_fed",
        "cpus_per_task": None,
        "mem_gb": None,
    }
    assert {k: params[k] for k in expected} == expected
    assert not set(params) & {"processes_per_node", "max_nodes", "submitit_folder", "_target_"}
    # The sbatch lines submitit writes for it (srun only has to exist for submitit's Slurm executor).
    import submitit

    monkeypatch.setenv("PATH", _fake_bin(tmp_path, srun="exit 0"))
    executor = submitit.AutoExecutor(cluster="slurm", folder=tmp_path / "submitit")
    executor.update_parameters(**params)
    text = executor._executor._make_submission_file_text("python -u -m submitit.core._submit", "uid")
    lines = {line for line in text.splitlines() if line.startswith("#SBATCH")}
    assert {
        "#SBATCH --nodes=3",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --time=90",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj",
        "#SBATCH --job-name=xffl_llama_fed",
    } <= lines


@needs_extra
def test_sizes_from_distributed(tmp_path):
    assert num_nodes(2, 8, 4) == 2  # facilities of 2, 8 processes: 2 nodes of 4
    assert num_nodes([8, 4], 4, 4) == 3  # a list: its sum, whatever nproc_per_node says
    assert (
        _launcher(
            [
                "+experiment=llama_fed",
                "hydra/launcher=local_submitit",
                "distributed.nproc_per_node=6",
                "distributed.federated=[4,2]",
            ]
        )["processes_per_node"]
        == 6
    )
    with pytest.raises(ValueError, match=r"makes 10 processes, not a multiple of hydra.launcher.processes_per_node=4"):
        num_nodes([8, 2], 4, 4)


_SINFO = 'echo "gpu*|1-4|6"; echo "gpu*|1-4|2"; echo "big|infinite|64"'


@needs_extra
def test_partition_limit_from_sinfo(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_bin(tmp_path, sinfo=_SINFO))
    assert partition_node_limit(None) == (4, "partition gpu allows at most 4 nodes per job (sinfo)")
    # A named partition: sinfo --partition=big lists that partition only.
    monkeypatch.setenv("PATH", _fake_bin(tmp_path, sinfo='echo "big|infinite|64"'))
    assert partition_node_limit("big") == (64, "partition big has 64 nodes (sinfo)")
    monkeypatch.setenv("PATH", _fake_bin(tmp_path, sinfo="exit 1", sbatch="exit 0"))  # a cluster: sbatch is there
    assert partition_node_limit("gpu") is None  # sinfo cannot tell: no check
    points = [(0, ["distributed.federated=[8,4]"], {"nodes": 3, "partition": None, "max_nodes": 2})]
    with pytest.raises(
        SweepRefused, match=r"hydra.launcher.max_nodes=2: #0 \(distributed.federated=\[8,4\]: 3 nodes\)"
    ):
        SlurmSweepLauncher().check(points)


def _batch(cases: list[dict], root: Path, env: dict) -> list[dict]:
    """``workers.cli_batch``: these command lines in one process (one import of torch and Hydra, not one each), each
    with its own ``env`` on top of the process's ``env``: ``[{"rc", "stdout", "stderr"}]``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "cases.json").write_text(json.dumps(cases))
    cmd = [sys.executable, "-m", "workers.cli_batch", str(root / "cases.json"), str(root / "results.json")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120 + 20 * len(cases))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((root / "results.json").read_text())


@pytest.fixture(scope="module")
def slurm_refusals(tmp_path_factory):
    """Two ``hydra/launcher=slurm`` sweeps refused before anything is submitted, in one batch: ``big`` (a fake
    sinfo's partition gpu allows 4 nodes; a fake sbatch records a call) and ``no_slurm`` (no sbatch on PATH).
    Each: (its folder, its result)."""
    tmp = tmp_path_factory.mktemp("refusals")
    big, no_slurm = tmp / "big", tmp / "no_slurm"
    big.mkdir(), no_slurm.mkdir()
    marker = big / "sbatch-called"
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "sbatch").exists())
    cases = [
        {"args": ["-m", "+experiment=llama_fed", "hydra/launcher=slurm", "distributed.federated=[8,4],[16,16]",
                  f"hydra.sweep.dir={big / 'sweep'}"], "run_dir": str(big / "run"),
         "env": {"PATH": _fake_bin(big, srun="exit 0", sbatch=f"touch {marker}; exit 1", sinfo=_SINFO)}},
        {"args": ["-m", "+experiment=llama_fed", "hydra/launcher=slurm", "strategy=fused,layer_by_layer",
                  f"hydra.sweep.dir={no_slurm / 'sweep'}"], "run_dir": str(no_slurm / "run"), "env": {"PATH": path}},
    ]  # fmt: skip
    results = _batch(cases, tmp, _env())
    return {"big": (big, results[0]), "no_slurm": (no_slurm, results[1])}


@needs_extra
@pytest.mark.cli
def test_a_sweep_too_big_for_the_partition_is_refused_before_submitting(slurm_refusals):
    where, proc = slurm_refusals["big"]
    assert proc["rc"] == 2, proc["stdout"] + proc["stderr"]
    assert proc["stderr"].strip().splitlines() == [
        "error: 1 sweep point(s) ask for more nodes than partition gpu allows at most 4 nodes per job (sinfo): "
        "#1 (distributed.federated=[16,16]: 8 nodes); nothing was submitted: make their distributed.federated "
        "smaller, raise hydra.launcher.processes_per_node, or choose another hydra.launcher.partition"
    ]
    assert not (where / "sbatch-called").exists()


@pytest.mark.cli
def test_without_the_extra_one_line_names_it(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    # The extra looks uninstalled: both imports fail, and Hydra's plugin scan skips a module set to None.
    (hide / "sitecustomize.py").write_text(
        "import sys\nsys.modules['hydra_plugins.hydra_submitit_launcher'] = None\nsys.modules['submitit'] = None\n"
    )
    launchers = ["slurm", "local_submitit"]  # one process runs both command lines, one after the other
    cases = [
        {
            "args": ["-m", "+experiment=llama_fed", f"hydra/launcher={launcher}", "strategy=fused,layer_by_layer",
                     f"hydra.sweep.dir={tmp_path / launcher / 'sweep'}"],
            "run_dir": str(tmp_path / launcher / "run"),
        }
        for launcher in launchers
    ]  # fmt: skip
    results = _batch(cases, tmp_path, _env(PYTHONPATH=f"{hide}{os.pathsep}{PYTHONPATH}"))
    for launcher, proc in zip(launchers, results, strict=True):
        assert proc["rc"] == 2, (launcher, proc)
        assert proc["stderr"].strip().splitlines() == [
            f"error: hydra/launcher={launcher} needs the slurm extra (hydra-submitit-launcher): "
            f"pip install -c constraints.txt -e '.[slurm]'"
        ], launcher
        assert not (tmp_path / launcher / "sweep").exists()


def _tree(pid: int) -> set[int]:
    """``pid``'s descendants now (a point's torchrun runs in a session of its own, still below it)."""
    from hydra_plugins.xffl_like_launcher._submitit_sweep import _descendants

    return _descendants(pid)


def _gone(pids: set[int], within: float) -> list[int]:
    """The processes of ``pids`` still alive after ``within`` seconds (zombies count as gone)."""
    deadline = time.monotonic() + within
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _sweep(sweep_dir: Path) -> subprocess.Popen:
    """Three points of one process each: 4 steps, then two of 5000 (their own session: a terminal's group)."""
    tiny = [o for o in TINY if not o.startswith("train.steps=")]
    cmd = [sys.executable, "-m", "xffl_like.run", "-m", "+experiment=llama_fed", "hydra/launcher=local_submitit",
           *tiny, "train.seq_len=32", "distributed.federated=null", "distributed.nproc_per_node=1",
           "train.steps=4,5000,5000", f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    # A terminal's Ctrl-C reaches a process that has SIGINT at its default, whatever this process inherited.
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_sigint)  # fmt: skip


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@needs_extra
@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="walks /proc")
def test_ctrl_c_stops_every_point_in_seconds_and_summarises_those_that_finished(tmp_path):
    """Ctrl-C (SIGINT to the foreground process group) of a local_submitit sweep: one line, 130, no process
    of any point alive 10 s later, and the summary of the point that had finished. Then the same during the
    points' start-up: no error of a half-imported module, the same line."""
    sweep_dir = tmp_path / "sweep"

    def running(d: Path) -> bool:  # point 0 finished (its submitit job's result), points 1 and 2 training
        rows = [m for i in (1, 2) for m in d.glob(f"{i}_*/metrics.jsonl")]  # a point's directory: <num>_<strategy>
        return bool(list(d.glob(".submitit/*/*_result.pkl"))) and len(rows) == 2 and all(r.stat().st_size for r in rows)

    rc, err, left = _ctrl_c(sweep_dir, running)
    assert rc == 130, err
    assert not left, f"processes of the sweep's points alive 10 s after Ctrl-C: {left}"
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and "1 of 3 point(s) had finished" in lines[0], err
    with open(sweep_dir / "sweep_summary.csv", newline="") as fh:
        rows = {r["job"]: r["status"] for r in csv.DictReader(fh)}
    assert rows["0_fused"] == "ok" and all(rows.get(j) != "ok" for j in ("1_fused", "2_fused")), rows

    rc, err, left = _ctrl_c(tmp_path / "early", lambda d: bool(list(d.glob(".submitit/*/*"))), after=1.0)
    assert rc == 130, err
    assert not left, left
    assert "Traceback" not in err and "Error locating target" not in err, err
    assert len([line for line in err.splitlines() if "interrupted" in line]) == 1, err


def _ctrl_c(sweep_dir: Path, ready, after: float = 0.0) -> tuple[int, str, list[int]]:
    """Start the sweep, wait until ``ready(sweep_dir)`` (and ``after`` s more), send SIGINT to its process group as
    a terminal's Ctrl-C does: (exit status, stderr, processes of its points alive 10 s later)."""
    proc = _sweep(sweep_dir)
    try:
        deadline = time.monotonic() + 240
        while not ready(sweep_dir):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the sweep's points did not start"
            time.sleep(0.05)
        time.sleep(after)
        points = _tree(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        return proc.returncode, err, _gone(points, 10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@needs_extra
@pytest.mark.cli
def test_the_slurm_launcher_without_slurm_is_one_line(slurm_refusals):
    _, proc = slurm_refusals["no_slurm"]
    assert proc["rc"] == 2, proc["stderr"]
    assert proc["stderr"].strip().splitlines() == [
        "error: hydra/launcher=slurm needs Slurm, and sbatch is not on PATH here: run the sweep on the cluster's "
        "login node, or hydra/launcher=local_submitit to run its points on this machine; nothing was submitted"
    ], proc["stderr"]
