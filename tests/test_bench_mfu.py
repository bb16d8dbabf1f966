"""``bench.mfu`` times the job's own update (issue 40 item 3, item 4): the same gradient clipping as the job, and
each measurement starts on a device the last one left empty (its model freed, its peak not counted)."""

from __future__ import annotations

import pytest
import torch

from xffl_like.bench.mfu import measure


@pytest.mark.parametrize(("extra", "clips"), [([], [1.0, 1.0]), (["optim.grad_clip=0.25"], [0.25, 0.25]),
                                              (["optim.grad_clip=0"], [])])  # fmt: skip
def test_mfu_clips_gradients_as_the_job_does(monkeypatch, extra, clips):
    """One clip per step at the job's ``optim.grad_clip`` (conf/optim/adamw.yaml: 1.0), none when it is 0."""
    seen = []
    clip = torch.nn.utils.clip_grad_norm_

    def recording(parameters, max_norm, *args, **kwargs):
        seen.append(float(max_norm))
        return clip(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording)
    measure("llama_tiny", 16, 2, dtype="float32", warmup=1, steps=1, peak_tflops=1.0, extra=extra)
    assert seen == clips


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mfu_frees_the_model_and_resets_the_peak_between_measurements():
    """A large measurement, then a small one: the small one's peak is its own, and nothing stays allocated."""
    before = torch.cuda.memory_allocated()
    large = measure("llama_bench", 256, 4, warmup=1, steps=1)
    left = torch.cuda.memory_allocated() - before
    small = measure("llama_tiny", 16, 2, warmup=1, steps=1)
    assert left < 64 * 2**20, f"{left / 2**20:.0f} MiB still allocated after a measurement"
    assert small.peak_memory_bytes < large.peak_memory_bytes / 4
