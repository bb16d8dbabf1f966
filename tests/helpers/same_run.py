"""The same run, interrupted or not: the reference of every resume test is the job run uninterrupted
(torchft's pattern). Final weights and optimizer state (read back from both final checkpoints),
final_loss, eval_loss and facility_losses must be bitwise identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from xffl_like.checkpoint.safe import SafeFileSystemReader
from xffl_like.checkpoint.store import latest_checkpoint

from . import REPO

EXACT = ("final_loss", "eval_loss", "facility_losses", "rounds", "skipped_facilities")

#: The durability job: FSDP [2,2], 8 steps, a round every 2, a checkpoint every round.
JOB = [
    "+experiment=llama_fed",
    "train.steps=8",
    "federation.every=2",
    "train.seq_len=32",
    "train.batch_size=2",
    "train.log_every=4",
    "logger=none",
    "data.num_eval_batches=1",  # as helpers.TINY: evaluation was most of this job's compute
]
#: ``JOB`` with rank 1 SIGKILLed at step 7 (synchronous saves: checkpoints of steps 4 and 6 are complete).
KILLED_AT_7 = [*JOB, "fault.kill_rank=1", "fault.at_step=7", "checkpoint.async=false"]


def run_job(args, run_dir, timeout=400, env=None):
    env = {**os.environ, "WANDB_MODE": "offline", **(env or {})}
    cmd = [sys.executable, "-m", "xffl_like.run", *args, f"hydra.run.dir={run_dir}"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def final_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the run's newest checkpoint, read on one process."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    ckpt = latest_checkpoint(run_dir / "checkpoints")
    nested = _load_state_dict_from_keys(storage_reader=SafeFileSystemReader(str(ckpt)))

    def flat(node, prefix=""):
        for key, value in node.items():
            yield from flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [(f"{prefix}{key}", value)]

    return dict(flat(nested))


def assert_same_run(resumed: Path, reference: Path) -> None:
    a, b = summary(resumed), summary(reference)
    for key in EXACT:
        assert a[key] == b[key], key
    ta, tb = final_tensors(resumed), final_tensors(reference)
    weights = [k for k in tb if k.startswith("f") and ".model." in k]
    assert weights and sorted(ta) == sorted(tb)
    for key in tb:
        if not key.startswith("rank"):  # RNG states are per process: compared where they matter
            assert torch.equal(ta[key], tb[key]), key
    # The files cover the whole run once: no step twice after the resume.
    lines = [json.loads(x) for x in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert sorted((x["facility"], x["step"]) for x in lines) == sorted(
        (f, s) for f in range(len(b["facility_losses"])) for s in range(1, b["steps"] + 1)
    )
    assert len((resumed / "aggregation.csv").read_text().splitlines()) == b["rounds"] + 1
