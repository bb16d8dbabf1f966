"""tools/gpu_run.sh (xffl_like/bench/gpu_run.py): the one prepared GPU command, its CPU dry run end to end, its
steps against bench.gpu's checks, a step's timeout, the offline install, and its two bad inputs as one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO
from xffl_like.bench import gpu_run
from xffl_like.bench.gpu import CHECKS

pytestmark = pytest.mark.cli
SCRIPT = REPO / "tools" / "gpu_run.sh"


def _script(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run([str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_steps_in_priority_order_cover_every_check_once(tmp_path):
    """main, mfu, bf16, checkpoint, hub, the rest; with the rest, every bench.gpu check runs once (mfu's check is
    the mfu step itself, compiled)."""
    gpu = gpu_run.steps(False, "py", tmp_path)
    assert [s.name for s in gpu] == ["main", "mfu", "bf16", "checkpoint", "hub", "rest"]
    assert sorted([*gpu_run.REST, "bf16", "checkpoint", "hub", "mfu_llama3_2_1b"]) == sorted(CHECKS)
    main, mfu = gpu[0].argv, gpu[1].argv
    assert {"+experiment=llama_fed", "distributed.nproc_per_node=1", "distributed.backend=nccl"} <= set(main)
    assert " ".join(mfu).endswith("--model llama3_2_1b --seq 2048 --batch 4 --dtype bfloat16 --compile true")
    cpu = gpu_run.steps(True, "py", tmp_path)
    assert "distributed.backend=gloo" in cpu[0].argv and "llama_tiny" in cpu[1].argv
    assert [s.argv for s in cpu[2:]] == [s.argv for s in gpu[2:]]


def test_steps_picks_a_rerun_in_priority_order_and_names_an_unknown_step(tmp_path):
    every = gpu_run.steps(False, "py", tmp_path)
    assert [s.name for s in gpu_run.chosen("rest, checkpoint", every)] == ["checkpoint", "rest"]
    assert gpu_run.chosen(None, every) == every
    with pytest.raises(gpu_run.Stop, match="no step named chekpoint: --steps takes main,mfu,bf16"):
        gpu_run.chosen("chekpoint", every)


def test_a_step_past_its_timeout_is_killed_and_one_past_the_budget_skipped(tmp_path):
    # SIGINT ends it at once (its own handler: an ignored SIGINT, as in a pytest-xdist worker, would be inherited,
    # and the step would wait out stop()'s 20 s grace before its SIGKILL).
    code = "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); time.sleep(120)"
    slow = gpu_run.Step("slow", [sys.executable, "-c", code], 1)
    line = gpu_run.run_step(slow, dict(os.environ), tmp_path, 1, left=100)
    assert line == "FAIL slow: timed out after 1 s (log 1_slow.log)"
    assert gpu_run.run_step(slow, dict(os.environ), tmp_path, 2, left=5).startswith("SKIP slow: no time left")


def test_a_step_that_ignores_sigint_is_killed_after_its_grace():
    code = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print(flush=True); time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE)
    proc.stdout.readline()  # its handler is in place
    gpu_run.stop(proc, grace=0.5)
    assert proc.returncode == -9


def _wheel(folder: Path, name: str) -> Path:
    """A minimal pure-Python wheel of one module ``name`` (what pip's offline install takes)."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", "VALUE = 42\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_the_wheelhouse_installs_offline_into_its_target(tmp_path):
    (tmp_path / "wheels").mkdir()
    _wheel(tmp_path / "wheels", "xffl_probe_pkg")
    line = gpu_run.install(tmp_path / "wheels", tmp_path / "site", sys.executable)
    assert line.endswith(f"1 wheels installed into {tmp_path / 'site'}")
    assert (tmp_path / "site" / "xffl_probe_pkg.py").read_text() == "VALUE = 42\n"
    assert gpu_run.install(tmp_path / "none", tmp_path / "site", sys.executable).endswith("own packages only)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_no_gpu_and_no_cpu_flag_is_one_line():
    done = _script("--out", "/nonexistent-never-written", timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        "error: no CUDA device on this machine (torch.cuda.is_available() is False): run tools/gpu_run.sh on the "
        "GPU machine, or tools/gpu_run.sh --cpu for the dry run on this CPU"
    ]


def test_a_wheelhouse_missing_what_the_import_needs_names_it(tmp_path):
    """hydra hidden from the steps' path (a package that fails to import shadows it) and an empty wheelhouse:
    one line naming the distribution, before any step runs."""
    shadow = tmp_path / "shadow" / "hydra"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not in this image')\n")
    (tmp_path / "wheels").mkdir()
    out = tmp_path / "out"
    done = _script(
        "--cpu", "--wheels", str(tmp_path / "wheels"), "--out", str(out), "--scratch", str(tmp_path / "scratch"),
        env={"PYTHONPATH": str(tmp_path / "shadow")},
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        f"error: missing on this machine and in the wheelhouse {tmp_path / 'wheels'}: hydra-core (import hydra); "
        "run tools/gpu_run.sh --prepare on a machine with pip and carry .gpu"
    ]
    assert not list(out.glob("*.log"))


@pytest.mark.slow  # six processes (a job, bench.mfu, four bench.gpu); the parts above are its fast cases
def test_the_cpu_dry_run_runs_every_step_end_to_end(tmp_path):
    """``tools/gpu_run.sh --cpu``: every step in order, each passing, a log each and ``gpu_run.txt``; the main job
    ran its 4 steps on one rank and wrote its summary."""
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    done = _script("--cpu", "--out", str(out), "--scratch", str(scratch))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = (out / "gpu_run.txt").read_text().splitlines()
    assert lines[0] == "device: cpu (dry run)"
    steps = [x.split(":")[0] for x in lines[2:]]
    assert steps == [f"PASS {n}" for n in ("main", "mfu", "bf16", "checkpoint", "hub", "rest")]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["gpu_run.txt", "1_main.log", "2_mfu.log", "3_bf16.log", "4_checkpoint.log", "5_hub.log", "6_rest.log"]
    )
    (summary_path,) = scratch.glob("runs-*/main/summary.json")  # this run's own folder of run dirs
    summary = json.loads(summary_path.read_text())
    assert summary["world_size"] == 1 and summary["steps"] == 4
    assert "llama_tiny float32 seq 32" in (out / "2_mfu.log").read_text()
