"""Plain constants and functions shared by the test modules (fixtures live in ``tests/conftest.py``).

``from helpers import REPO, run_cli`` works in every test module: ``tests/`` is on ``sys.path``.
Test modules import from here, never from each other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

#: The repository root (where ``conf/`` and ``xffl_like/`` are).
REPO = Path(__file__).resolve().parents[2]
#: The folder with ``helpers/`` and ``workers/``: on ``PYTHONPATH`` for subprocesses that import them.
TESTS = REPO / "tests"
#: The test-only plugins (``tests/plugins/sitecustomize.py``): on ``PYTHONPATH`` of every job a test starts.
PLUGINS = TESTS / "plugins"
#: ``PYTHONPATH`` for a subprocess that runs ``python -m workers.<module>`` (or imports ``xffl_like``).
PYTHONPATH = os.pathsep.join([str(REPO), str(TESTS)])
#: The Hydra config folder.
CONF = REPO / "conf"

#: The shared folder with the data sets (``$XFFL_SHARED``, else beside the repository, else /work/shared).
SHARED = Path(os.environ.get("XFFL_SHARED", REPO.parent / "shared"))
if not SHARED.exists():  # a worktree beside the repository: the shared folder one level up
    SHARED = Path("/work/shared")
CORPUS = SHARED / "data" / "tinyshakespeare.txt"


def load_model_conf(name):
    """``conf/model/<name>.yaml`` as an OmegaConf node."""
    from omegaconf import OmegaConf

    return OmegaConf.load(CONF / "model" / f"{name}.yaml")


#: Small sequences and batches for jobs run through the CLI; one held-out batch per evaluation (a job evaluates
#: before and after every round: four batches made evaluation most of a short test job's compute).
TINY = ["train.seq_len=64", "train.batch_size=4", "train.log_every=5", "data.num_eval_batches=1"]


def model_shapes(overrides=("+experiment=llama_fed",)) -> list[tuple[int, ...]]:
    """The shapes of the job's model's parameters, in order (the order the hub's description lists them)."""
    from omegaconf import OmegaConf

    from xffl_like.job import _compose
    from xffl_like.models import build_model
    from xffl_like.models.llama import LlamaConfig

    model = LlamaConfig.from_mapping(OmegaConf.to_container(_compose(list(overrides)).model))
    return [tuple(p.shape) for p in build_model(model, device="meta").parameters()]


def validated_federation(overrides: list[str]):
    """The ``federation`` section the main job composes from ``overrides``, validated as the launcher does for 4
    processes in facilities of 2 (a :class:`ValueError` of one line when it refuses it)."""
    from omegaconf import OmegaConf

    from xffl_like.config.schema import FederationConfig, build_section
    from xffl_like.distributed.layout import plan_layout
    from xffl_like.federation import validate_federation
    from xffl_like.job import _compose

    cfg = build_section(FederationConfig, OmegaConf.to_container(_compose(overrides).federation))
    validate_federation(cfg, plan_layout(4, 2, None))
    return cfg


def run_cli(args, run_dir, timeout=240, launcher=(), env=None):
    """Run the entry point (plainly, or under ``launcher`` such as torchrun) with ``args``;
    returns (CompletedProcess, seconds)."""
    env = {**os.environ, "WANDB_MODE": "offline", "XFFL_RUN_DIR": str(run_dir), **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGINS), env.get("PYTHONPATH")]))
    cmd = [*launcher, "-m", "xffl_like.run", *args] if launcher else [sys.executable, "-m", "xffl_like.run", *args]
    if not launcher:
        cmd.append(f"hydra.run.dir={run_dir}")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - start


def run_recorded(args, tmp_path, **kwargs):
    """``run_cli`` with the rounds recorded under ``tmp_path/rounds``; returns (proc, summary)."""
    run_dir = tmp_path / "run"
    proc, _ = run_cli(args, run_dir, env={"XFFL_TEST_DUMP_ROUNDS": str(tmp_path / "rounds")}, **kwargs)
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads((run_dir / "summary.json").read_text())
