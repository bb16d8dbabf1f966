"""``python -m xffl_like.bench.quality``'s parts: every variant of its matrix is a job the launcher accepts (composed
and validated here, nothing run), and its report's arithmetic against figures computed by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from xffl_like import CONF_DIR
from xffl_like.bench.quality import VARIANTS, overrides, quality_report, record
from xffl_like.config.validate import validate_config
from xffl_like.job import choices, resolve, typed_config


@pytest.mark.parametrize("facilities", [2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_is_a_valid_job(variant, facilities):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=overrides(variant, facilities, 1, 960), return_hydra_config=True)
        job, layout = validate_config(typed_config(resolve(cfg), choices(cfg)), 4, 4, Path.cwd())
    assert layout.num_facilities == facilities and job.train.steps == 960 and job.seed == 1
    fed = job.federation
    assert (fed.compression == "topk") == (variant != "fp32" and not variant.startswith("fp32_"))
    assert fed.delay == (1 if "delay" in variant else 0)


def test_the_pretrained_start_reads_the_base_and_the_held_out_half():
    cmd = overrides("topk", 2, 0, 96, base=Path("/b"))
    assert "model=hf" in cmd and "model.path=/b/run/hf" in cmd and "data.path=/b/finetune.txt" in cmd
    with pytest.raises(ValueError, match="--facilities 3: use 2 or 4"):
        overrides("topk", 3, 0, 96)


def _summary(loss, curve, zero=None):
    evals = [{"step": s, "loss_global": [a, b], "loss_local": None} for s, a, b in curve]
    fed = {} if zero is None else {"topk_zero_codes": zero}
    return {"eval_loss": loss, "eval_history": evals, "federation": fed, "cross_facility_bytes_per_round": [10]}


def test_the_report_by_hand():
    runs = {
        2: {
            "fp32": {0: record(_summary(2.0, [(16, 3.0, 2.0)])), 1: record(_summary(4.0, []))},
            "topk": {0: record(_summary(2.02, [], [[0.5, 0.25], [0.0, None]])), 1: record(_summary(4.1, []))},
        }
    }
    assert runs[2]["fp32"][0]["curve"] == [[16, 2.5]]
    assert runs[2]["topk"][0]["zero_codes"] == [0.375, 0.0]
    part = quality_report(runs, 192)[2]
    topk = part["variants"]["topk"]
    assert topk["mean_eval"] == pytest.approx(3.06)
    assert topk["excess"] == pytest.approx(6.12 / 6.0 - 1)  # of the means over the seeds, not of the ratios
    assert topk["excess_per_seed"] == {0: pytest.approx(0.01), 1: pytest.approx(0.025)}
    assert topk["zero_codes"] == pytest.approx(0.1875)
    assert part["goals"] == [{"variant": "topk", "within": 0.03, "excess": pytest.approx(0.02), "met": True}]
    pretrained = quality_report(runs, 192, pretrained=True)[2]["goals"]  # the pretrained start's goal: 1%
    assert pretrained == [{"variant": "topk", "within": 0.01, "excess": pytest.approx(0.02), "met": False}]
