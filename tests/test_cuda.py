"""CUDA paths (nccl, CUDA streams, bf16, checkpoints on a GPU): the checks of ``python -m xffl_like.bench.gpu``,
each a job of the CLI. Without CUDA they skip (CI has none); the command's one line without CUDA is checked
on every machine."""

import os
import subprocess
import sys

import pytest
import torch
from helpers import PYTHONPATH, REPO

from xffl_like.bench.gpu import CHECKS, run_check

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cli
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device: the checks run instead")
def test_gpu_bench_without_cuda_prints_one_line_and_exits_0():
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    proc = subprocess.run(
        [sys.executable, "-m", "xffl_like.bench.gpu"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1 and proc.stdout.startswith("no CUDA device found"), proc.stdout
    assert proc.stderr == "", proc.stderr


def test_gpu_bench_refuses_an_unknown_check_in_one_line():
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    proc = subprocess.run(
        [sys.executable, "-m", "xffl_like.bench.gpu", "--only", "bf16,nope"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert (
        proc.stderr.startswith("error: --only nope: no such check; choose from bf16,") and proc.stderr.count("\n") == 1
    )


@needs_cuda
@pytest.mark.multiprocess
@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHECKS))
def test_gpu_check(name, tmp_path):
    result = run_check(name, tmp_path)
    if result.status == "SKIP":
        pytest.skip(result.line())
    assert result.status == "PASS", result.line()


@needs_cuda
def test_overlapped_streaming_exchange_is_enqueued_by_the_training_thread_on_a_side_stream():
    """No NCCL from a second thread (issue 30 item 4): on CUDA the overlapped exchange runs on this thread,
    on a stream of its own, and the training stream waits for it only at result()."""
    import threading

    from xffl_like.federation.streaming import OverlappedExchange as Exchange

    device = torch.device("cuda", torch.cuda.current_device())
    seen = []

    def fn():
        seen.append((threading.current_thread(), torch.cuda.current_stream(device)))
        return torch.ones(4, device=device) * 2

    work = Exchange(fn, True, device)
    assert work.overlapped and work.thread is None
    thread, stream = seen[0]
    assert thread is threading.current_thread() and stream == work.stream
    assert stream != torch.cuda.current_stream(device)
    assert torch.equal(work.result().cpu(), torch.full((4,), 2.0)) and work.seconds >= 0
