"""Every console script of pyproject's ``[project.scripts]``, run as pip's wrapper runs it, from a directory
outside the checkout: ``--help``, and one real tiny invocation where one exists. And a wheel installed
without the checkout composes the configs it ships (``xffl_like.CONF_DIR``: package data).

pip's wrapper imports the script's module by name (``from xffl_like.run import cli``), unlike ``python -m``,
which runs it as ``__main__``: Hydra resolves a relative ``config_path`` against the module then (``../conf``
became the module ``conf``, found nowhere), so ``python -m`` alone would not see the difference.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from helpers import PYTHONPATH, REPO

pytestmark = pytest.mark.cli

SCRIPTS: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
WRAPPER = "import sys\nfrom {module} import {attr}\nsys.argv[0] = {name!r}\nsys.exit({attr}())\n"
ENV = {**os.environ, "PYTHONPATH": PYTHONPATH, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}


def run_script(name: str, args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """``name`` as its console script runs it (pip's wrapper, verbatim but for argv[0]), in ``cwd``."""
    module, _, attr = SCRIPTS[name].partition(":")
    code = WRAPPER.format(module=module, attr=attr, name=name)
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def _sweep(where: Path) -> None:
    """A made-up sweep of one finished job (what ``xffl-sweep-summary`` reads)."""
    job = where / "sweep" / "0_fused"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "config.yaml").write_text("strategy: {name: fused, streams: 2}\n")
    (job / ".hydra" / "hydra.yaml").write_text("hydra: {job: {num: 0}}\n")
    (job / ".hydra" / "overrides.yaml").write_text("- strategy=fused\n")
    summary = {"strategy": {"name": "fused"}, "aggregation_seconds": [0.1], "final_loss": 2.0, "eval_loss": 2.5}
    (job / "summary.json").write_text(json.dumps(summary))


#: Per script: (setup, arguments, what its run must leave behind or print). None: no tiny real run (why).
TINY = {
    "xffl-run": (
        None,
        [
            "distributed.nproc_per_node=1",
            "distributed.federated=null",
            "train.steps=2",
            "optim.warmup_steps=1",
            "logger=none",
            "train.seq_len=16",
            "train.batch_size=2",
            "hydra.run.dir=run",
        ],
        lambda d, out: json.loads((d / "run" / "summary.json").read_text())["steps"] == 2,
    ),
    "xffl-prepare": (
        lambda d: (d / "a.txt").write_text("hello world\n"),
        ["--output", "out", "a.txt"],
        lambda d, out: (d / "out" / "tokens.bin").stat().st_size > 0,
    ),
    "xffl-bench": (
        None,
        ["model=llama_tiny", "bench.strategies=[fused]", "bench.repeats=1", "bench.warmup=0", "hydra.run.dir=b"],
        lambda d, out: "fused" in json.loads((d / "b" / "bench.json").read_text())["results"],
    ),
    # Its runs need root and network namespaces: the configuration it composes (conf/bench_wan.yaml) instead.
    "xffl-bench-wan": (None, ["--cfg", "job"], lambda d, out: "bench:" in out),
    "xffl-bench-parallel": (
        None,
        [
            "--nproc",
            "2",
            "--local-world-size",
            "2",
            "--steps",
            "6",
            "--warmup",
            "0",
            "--block",
            "2",
            "--methods",
            "local",
            "--batch",
            "2",
            "--seq",
            "16",
            "--eval-batches",
            "1",
            "--out",
            "p.json",
        ],
        lambda d, out: (d / "p.json").exists(),
    ),
    "xffl-bench-data": (
        None,
        ["--repeats", "1", "--seq-len", "16", "--batch-size", "2"],
        lambda d, out: "synthetic" in out,
    ),
    "xffl-bench-gpu": (None, ["--list"], lambda d, out: "throughput_llama_bench" in out),
    "xffl-slurm": (None, ["--nodes", "1", "--gpus-per-node", "1", "--dry-run"], lambda d, out: "#SBATCH" in out),
    "xffl-sweep-summary": (_sweep, ["sweep"], lambda d, out: (d / "sweep" / "sweep_summary.csv").exists()),
    "xffl-hub": (
        None,
        ["init", "certs", "--facilities", "a,b", "--host", "localhost"],
        lambda d, out: (d / "certs" / "ca.crt").exists(),
    ),
}


def test_every_console_script_is_covered():
    assert set(TINY) == set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_console_script_help_outside_the_checkout(name, tmp_path):
    proc = run_script(name, ["--help"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout.lower() or "powered by Hydra" in proc.stdout, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr and "error" not in proc.stderr.lower(), proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_console_script_runs_outside_the_checkout(name, tmp_path):
    setup, args, made = TINY[name]
    if setup is not None:
        setup(tmp_path)
    proc = run_script(name, args, tmp_path)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert made(tmp_path, proc.stdout), (proc.stdout[-2000:], proc.stderr[-2000:])


@pytest.mark.slow
def test_installed_wheel_composes_its_own_configs(tmp_path):
    """A non-editable install, without the checkout on the path: xffl-run finds the configs it ships."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("xffl_like", "hydra_plugins"):
        shutil.copytree(REPO / part, src / part, ignore=ignore)
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / part, src / part)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    wheel = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wh"), str(src)],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert wheel.returncode == 0, wheel.stderr[-2000:]
    site = tmp_path / "site"
    (whl,) = (tmp_path / "wh").glob("*.whl")
    install = subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(whl)],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert install.returncode == 0, install.stderr[-2000:]
    shutil.rmtree(src)  # nothing of the copy's tree is left to find
    env = {**ENV, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import xffl_like; print(xffl_like.CONF_DIR)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(site), (where.stdout, where.stderr)
    run = tmp_path / "work"
    run.mkdir()
    for args in (["--help"], ["+experiment=llama_fed", "--cfg", "job"]):
        proc = subprocess.run([str(site / "bin" / "xffl-run"), *args], cwd=run, env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert "experiment: llama_fed" in proc.stdout and "model:" in proc.stdout, proc.stdout[-2000:]
