"""The benchmark entry point, end to end in a subprocess (tiny model; no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO as ROOT

from xffl_like.aggregation import STRATEGIES

KEYS = {
    "median_s",
    "p90_s",
    "limit_median_s",
    "ratio_to_limit",
    "bytes_per_rank",
    "cross_facility_bytes",
    "algbw_GBps",
    "busbw_GBps",
    "peak_memory_mb",
    "streams",
    "collective",
    "mode",
    # the limit is the faster of (a) and (b); (c) the floor from the raw p2p rate
    "limit_kind",
    "allreduce_median_s",
    "ratio_to_allreduce",
    "p2p_exchange_median_s",
    "p2p_exchange_connections",
    "p2p_bandwidth_GBps",
    "floor_s",
    "floor_fraction",
}


pytestmark = pytest.mark.cli


def bench(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "xffl_like.bench", f"hydra.run.dir={tmp_path}", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_bench_writes_every_strategy(tmp_path):
    proc = bench(tmp_path, "model=llama_tiny", "bench.repeats=1", "bench.warmup=0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert set(report["results"]) == set(STRATEGIES)
    fp32_params = 4 * sum(_tiny_param_counts())  # bytes of llama_tiny, counted from its config
    for name, r in report["results"].items():
        assert KEYS <= set(r), name
        assert r["median_s"] > 0 and r["limit_median_s"] > 0 and r["p90_s"] >= r["median_s"]
        assert r["cross_facility_bytes"] == 2 * fp32_params  # one model copy from each facility
        assert r["bytes_per_rank"] == fp32_params // 2  # FSDP over 2 shards, one sender each
        assert abs(r["busbw_GBps"] - r["algbw_GBps"]) < 1e-12  # 2 peers: 2(n-1)/n = 1
        # The limit is the faster of the two references, and the ratio is taken to it.
        a, b = r["allreduce_median_s"], r["p2p_exchange_median_s"]
        assert r["limit_median_s"] == min(a, b) and r["limit_kind"] == ("all_reduce" if a <= b else "p2p_exchange")
        assert r["ratio_to_limit"] == r["median_s"] / min(a, b) and r["ratio_to_allreduce"] == r["median_s"] / a
        assert r["p2p_exchange_connections"] == 1  # every strategy's own streams: 1
        # 2 peers: the floor is one transfer of the bytes, at the measured rate.
        assert r["floor_s"] == pytest.approx(r["bytes_per_rank"] / r["p2p_bandwidth_GBps"] / 1e9)
        assert r["floor_fraction"] == pytest.approx(r["floor_s"] / r["median_s"])
    lines = proc.stdout.splitlines()
    ratios = [float(line.split()[5]) for line in lines if line.split() and line.split()[0] in STRATEGIES]
    assert len(ratios) == len(STRATEGIES) and ratios == sorted(ratios)
    assert (tmp_path / "config.yaml").exists()


@pytest.mark.slow  # one subprocess per bad input: ~45 s on a loaded machine
def test_bench_rejects_bad_input_before_launching(tmp_path):
    proc = bench(tmp_path, "model=llama_tiny", "bench.strategies=[fused,fusd]")
    assert proc.returncode == 2
    assert "unknown strategy name 'fusd': valid names are" in proc.stderr
    assert not (tmp_path / "bench.json").exists()
    proc = bench(tmp_path, "model=llama_tiny", "distributed.federated=null")
    assert proc.returncode == 2 and "needs at least 2 facilities" in proc.stderr
    proc = bench(tmp_path, "model=llama_tiny", "distributed.backend=nccl", "bench.collective=exchange")
    assert proc.returncode == 2 and proc.stderr.count("bench.collective=exchange is for gloo; on nccl use") == 1
    assert "Traceback" not in proc.stderr


def _tiny_param_counts():
    from omegaconf import OmegaConf

    from xffl_like.models import LlamaConfig, build_model

    model = build_model(
        LlamaConfig.from_mapping(OmegaConf.load(ROOT / "conf" / "model" / "llama_tiny.yaml")), device="meta"
    )
    return [p.numel() for p in model.parameters()]
