"""Sweeps: a real multirun in a subprocess (two jobs train, two fail validation), the summary
written from a made-up sweep directory, and the presets under conf/sweep."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO as ROOT
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from xffl_like.observe.sweep import FIELDS, collect_jobs, write_sweep_summary

TINY = [
    "train.steps=4",
    "federation.every=2",
    "train.batch_size=2",
    "distributed.nproc_per_node=2",
]


@pytest.mark.cli
@pytest.mark.slow
def test_multirun_summary_with_a_failed_job(tmp_path):
    sweep_dir = tmp_path / "sweep"
    env = {**os.environ, "WANDB_MODE": "offline"}
    # One job trains; three fail in validation (optim.warmup_steps=5 exceeds train.steps=4, train.seq_len=999 the
    # model's max_seq_len) and the sweep goes on. One job that trains is enough for what a real sweep adds to
    # test_summary_of_a_made_up_sweep (real outputs, a real failure, the exit status): each costs a whole launch.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "xffl_like.run",
            "-m",
            "+experiment=llama_fed",
            *TINY,
            "distributed.federated=1",
            "logger=none",
            "strategy=layer_by_layer",
            "optim.warmup_steps=2,5",
            "train.seq_len=32,999",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # every job ran; one failed -> exit 1
    with open(sweep_dir / "sweep_summary.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert tuple(rows[0]) == FIELDS
    assert [(r["job"], r["status"]) for r in rows] == [
        ("0_layer_by_layer", "ok"),
        ("1_layer_by_layer", "failed"),
        ("2_layer_by_layer", "failed"),
        ("3_layer_by_layer", "failed"),
    ]
    for row in rows:
        if row["status"] == "ok":
            summary = json.loads((sweep_dir / row["job"] / "summary.json").read_text())
            assert float(row["final_loss"]) == pytest.approx(summary["final_loss"])
            assert float(row["aggregation_seconds_median"]) > 0 and float(row["busbw_gbps_median"]) > 0
            assert int(float(row["cross_facility_bytes_per_round"])) == summary["cross_facility_bytes_per_round"][0]
            assert row["streams"] == "1" and not (sweep_dir / row["job"] / "wandb").exists()  # logger=none
    assert "train.seq_len=999 exceeds model.max_seq_len=256" in rows[1]["error"]
    assert "optim.warmup_steps=5 exceeds train.steps=4" in rows[2]["error"]
    assert "exceeds" in rows[3]["error"]
    assert rows[0]["overrides"] == "optim.warmup_steps=2 train.seq_len=32"
    md = (sweep_dir / "sweep_summary.md").read_text()
    assert "4 jobs, 1 ok, 3 failed" in md and "## Failed jobs" in md and "`1_layer_by_layer`: train.seq_len=999" in md
    assert (sweep_dir / "sweep_aggregation.png").read_bytes()[:4] == b"\x89PNG"
    assert "job 1_layer_by_layer failed: train.seq_len=999" in proc.stderr


def _fake_job(
    sweep_dir: Path,
    num: int,
    strategy: str,
    overrides: list[str],
    summary: dict | None = None,
    error: str | None = None,
) -> Path:
    job = sweep_dir / f"{num}_{strategy}"
    (job / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"strategy": {"name": strategy, "streams": 2}}), job / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": {"job": {"num": num}}}), job / ".hydra" / "hydra.yaml")
    OmegaConf.save(OmegaConf.create(overrides), job / ".hydra" / "overrides.yaml")
    if summary is not None:
        (job / "summary.json").write_text(json.dumps(summary))
    if error is not None:
        (job / "error.txt").write_text(error + "\nmore detail\n")
    return job


def _summary(seconds):
    return {
        "strategy": {"name": "fused", "streams": 2},
        "aggregation_seconds": seconds,
        "aggregation_busbw_gbps": [1.0] * len(seconds),
        "cross_facility_bytes_per_round": [100] * len(seconds),
        "final_loss": 2.0,
        "eval_loss": 2.5,
        "tokens_per_second": 1000.0,
    }


def test_summary_of_a_made_up_sweep(tmp_path, monkeypatch):
    _fake_job(tmp_path, 10, "fused", ["+experiment=x", "strategy=fused", "seed=10"], _summary([0.3, 0.1, 0.2]))
    _fake_job(tmp_path, 2, "stacked", ["+experiment=x", "strategy=stacked", "seed=2"], error="rank 1 failed: boom")
    _fake_job(tmp_path, 3, "bucket_flatten", ["+experiment=x", "strategy=bucket_flatten", "seed=3"])  # killed
    rows = collect_jobs(tmp_path)
    assert [r["job"] for r in rows] == ["2_stacked", "3_bucket_flatten", "10_fused"]  # job order, not name order
    assert [r["status"] for r in rows] == ["failed", "failed", "ok"]
    assert rows[0]["error"] == "rank 1 failed: boom" and "killed" in rows[1]["error"]
    assert rows[2]["aggregation_seconds_median"] == pytest.approx(0.2)
    assert (rows[2]["aggregation_seconds_min"], rows[2]["aggregation_seconds_max"]) == (0.1, 0.3)
    assert rows[2]["overrides"] == "strategy=fused seed=10"  # +experiment=x is common to all jobs
    # Without matplotlib: the tables, and a one-line note instead of the picture.
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    write_sweep_summary(tmp_path)
    assert not (tmp_path / "sweep_aggregation.png").exists()
    md = (tmp_path / "sweep_summary.md").read_text()
    assert "Note: sweep_aggregation.png skipped: matplotlib is not installed" in md
    assert "| 10_fused | fused | 2 |" in md and "200 ms" in md


@pytest.mark.parametrize(
    "preset, key, values",
    [
        ("strategies", "strategy", "glob(*)"),
        ("streams", "strategy.streams", "1,2,4"),
        ("bucket_sizes", "strategy.bucket_mb", "0.25,1,5,25,100"),
    ],
)
def test_sweep_presets_compose(preset, key, values):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(
            config_name="config", overrides=["+experiment=llama_fed", f"+sweep={preset}"], return_hydra_config=True
        )
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    assert str(cfg.hydra.sweeper.params[key]) == values
    assert cfg.hydra.callbacks.sweep_summary._target_ == "xffl_like.observe.sweep.SweepSummary"


def test_a_job_that_raised_is_reported(tmp_path):
    from hydra.core.utils import JobReturn, JobStatus
    from hydra.types import RunMode

    from xffl_like.observe.sweep import SweepSummary

    job = _fake_job(tmp_path, 0, "fused", ["strategy=fused"])
    config = OmegaConf.create(
        {"hydra": {"mode": RunMode.MULTIRUN, "runtime": {"output_dir": str(job)}, "sweep": {"dir": str(tmp_path)}}}
    )
    failed = JobReturn(status=JobStatus.FAILED, _return_value=RuntimeError("boom\nsecond line"))
    callback = SweepSummary()
    callback.on_job_end(config=config, job_return=failed)
    assert (job / "error.txt").read_text() == "RuntimeError: boom\n"
    assert "`0_fused`: RuntimeError: boom" in (tmp_path / "sweep_summary.md").read_text()
    with pytest.raises(SystemExit) as exit_info:
        callback.on_multirun_end(config=config)
    assert exit_info.value.code == 1
    SweepSummary(fail_on_error=False).on_multirun_end(config=config)  # reports, exits 0
