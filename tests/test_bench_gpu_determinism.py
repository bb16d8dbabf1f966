"""The checks that compare bitwise pin determinism in their jobs (issue 40 item 3): ``XFFL_DETERMINISTIC=1``
(``torch.use_deterministic_algorithms(True)`` in the job) and ``CUBLAS_WORKSPACE_CONFIG=:4096:8``."""

from __future__ import annotations

import contextlib

import pytest
import torch

from xffl_like.bench import gpu as G
from xffl_like.bench import hub_jobs
from xffl_like.train.speed import DETERMINISTIC_ENV, pin_determinism

PINNED = {"XFFL_DETERMINISTIC": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


class _Failed:
    """What :func:`xffl_like.bench.gpu.job` gets from a job that exits 1 at once."""

    returncode, pid = 1, -1

    def communicate(self, timeout=None):
        return "", "error: stopped by the test"


@pytest.fixture
def started(monkeypatch) -> list[tuple[list[str], dict]]:
    """Every job the checks start, as (command, environment); none runs."""
    seen = []

    def spawn(cmd, env=None, **_):
        seen.append((cmd, env or {}))
        return _Failed()

    @contextlib.contextmanager
    def hub(state, env):
        seen.append((["hub"], env))
        raise RuntimeError("no hub in this test")
        yield  # pragma: no cover

    monkeypatch.setattr(G, "spawn", spawn)
    monkeypatch.setattr(hub_jobs, "insecure_hub", hub)
    monkeypatch.setattr(G, "gpus", lambda: 2)
    return seen


@pytest.mark.parametrize("name", ["checkpoint", "hub", "hub_topk", "streams2"])
def test_bitwise_checks_pin_determinism(started, name, tmp_path):
    assert G.run_check(name, tmp_path).status == "FAIL"  # the stand-in job fails: only its environment matters
    assert started and all(env.items() >= PINNED.items() for _, env in started)


def test_other_checks_keep_the_default(started, tmp_path):
    G.run_check("bf16", tmp_path)
    assert started and not any("XFFL_DETERMINISTIC" in env for _, env in started)


def test_the_job_pins_what_the_check_asks(monkeypatch):
    assert G.BITWISE == DETERMINISTIC_ENV == PINNED
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    monkeypatch.delenv("XFFL_DETERMINISTIC", raising=False)
    assert not pin_determinism() and torch.are_deterministic_algorithms_enabled() == before[0]
    monkeypatch.setenv("XFFL_DETERMINISTIC", "1")
    try:
        assert pin_determinism() and torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
