"""CUDA paths (nccl, CUDA streams, bf16): run only where GPUs are present; CI has none."""

import json
import subprocess
import sys

import pytest
import torch

from helpers import REPO

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (nccl, one GPU per rank)")


pytestmark = [pytest.mark.multiprocess, pytest.mark.cli, pytest.mark.slow]


@needs_two_gpus
@pytest.mark.parametrize("strategy", ["fused", "layer_by_layer"])
def test_nccl_job_with_streams_and_bf16(tmp_path, strategy):
    args = ["+experiment=llama_fed", "distributed.nproc_per_node=2", "distributed.federated=1",
            "train.dtype=bfloat16", f"strategy={strategy}", "strategy.streams=2", "train.steps=4", "optim.warmup_steps=2",
            "federation.every=2", "logger=none", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run([sys.executable, "-m", "xffl_like.run", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["max_param_divergence_after_last_round"] <= 1e-6
    assert summary["rounds"] == 2
