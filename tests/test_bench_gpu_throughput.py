"""bench.gpu's throughput checks time steady-state steps only, as ``bench.mfu`` does (issue 40 item 3): which
steps the window holds (a fake clock), the command they run, their pass condition, and timeouts that fit one GPU
command."""

from __future__ import annotations

import json

import pytest
import torch

from xffl_like.bench import gpu as G
from xffl_like.bench import gpu_run
from xffl_like.bench.mfu import _timed_steps


def test_the_window_times_the_steps_after_the_warm_up_only():
    """Warm-up steps take 100 s each on the fake clock (a cold compile), timed steps 1 s: the window is 4 s, read
    after step 2 and after step 6, so no warm-up step is in it."""
    now, ran, reads = [0.0], [], []

    def step(n):
        ran.append(n)
        now[0] += 100.0 if n < 3 else 1.0
        return torch.tensor(1.0)

    def clock():
        reads.append(list(ran))
        return now[0]

    assert _timed_steps(step, 3, 4, torch.device("cpu"), clock=clock) == 4.0
    assert ran == list(range(7))
    assert reads == [[0, 1, 2], [0, 1, 2, 3, 4, 5, 6]]


def _m(**kw) -> dict:
    m = {"tokens_per_second": 5e4, "mfu": 0.3, "timed_steps": 20, "dtype": "bfloat16", "device": "NVIDIA H200"}
    return {**m, **kw}


def test_the_verdict_is_an_mfu_floor():
    assert G.throughput_verdict(_m(), 0.2)[0] == "PASS"
    status, figure = G.throughput_verdict(_m(mfu=0.1), 0.2)
    assert status == "FAIL" and "MFU 10.0% (floor 20%)" in figure and "20 steady-state steps" in figure
    assert G.throughput_verdict(_m(mfu=None), 0.2)[0] == "SKIP"  # unknown peak: no figure to judge
    status, figure = G.throughput_verdict(_m(device="cpu"), 0.0)
    assert status == "FAIL" and "not on CUDA" in figure


class _Proc:
    pid, returncode = -1, 0

    def __init__(self, out: str):
        self.out = out

    def communicate(self, timeout=None):
        assert timeout == G.THROUGHPUT_TIMEOUT_S
        return self.out, ""


@pytest.mark.parametrize("name", ["throughput_llama_bench", "throughput_llama3_2_1b"])
def test_the_check_runs_bench_mfu_compiled_with_activation_checkpointing(monkeypatch, tmp_path, name):
    seen = []

    def spawn(cmd, **_):
        seen.append(cmd)
        return _Proc("FLOPs/token = ...\npeak: ...\n" + json.dumps(_m(mfu=0.5)) + "\n")

    monkeypatch.setattr(G, "spawn", spawn)
    result = G.run_check(name, tmp_path)
    assert result.status == "PASS" and "MFU 50.0%" in result.figure
    (cmd,) = seen
    assert cmd[1:3] == ["-m", "xffl_like.bench.mfu"] and cmd[cmd.index("--model") + 1] == name.split("_", 1)[1]
    args = " ".join(cmd)
    assert "--compile true" in args and "--dtype bfloat16" in args and "--json" in args
    assert f"--warmup {G.WARMUP}" in args and G.WARMUP >= 1 and "train.activation_checkpointing=full" in args


def test_a_failed_measurement_is_one_fail_line(monkeypatch, tmp_path):
    proc = _Proc("")
    proc.returncode = 1
    proc.communicate = lambda timeout=None: ("", "Traceback\nerror: out of memory\n")
    monkeypatch.setattr(G, "spawn", lambda cmd, **_: proc)
    result = G.run_check("throughput_llama_bench", tmp_path)
    assert result.status == "FAIL" and result.figure == "exit 1: error: out of memory"


def test_timeouts_fit_one_gpu_command():
    """Every job a check waits for ends within tools/gpu_run.sh's whole budget, itself inside a 10-minute
    command; the default job timeout is the constant."""
    assert max(G.JOB_TIMEOUT_S, G.MFU_TIMEOUT_S, G.THROUGHPUT_TIMEOUT_S) <= gpu_run.BUDGET_S < 600
    assert G.job.__defaults__[0] == G.JOB_TIMEOUT_S
    assert all(s.timeout_s <= 600 for s in gpu_run.steps(False, "python", G.REPO))
