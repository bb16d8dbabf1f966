"""The elastic benchmark's report (``python -m xffl_like.bench.wan bench.mode=elastic``), from hand-made
results: no processes, no namespaces."""

from __future__ import annotations

import pytest

from xffl_like.bench.elastic_wan import _elastic_report, facility_cpus, format_elastic

BENCH = {
    "link_mbit": 1000,
    "nproc_per_facility": 2,
    "elastic": {"late_s": 10, "timeout_s": 10, "scenarios": ["alone", "baseline", "late"]},
}


def _result(curve: list[tuple[float, float]], train_seconds: float, rounds: int = 12, load=None) -> dict:
    """One scenario as :func:`~xffl_like.bench.elastic_wan._scenario` returns it (the parts the report
    reads); ``curve``: (seconds, eval loss) after each round, at steps 8, 16, ..."""
    return {
        "events": {},
        "train_seconds": train_seconds,
        "curve": [(t, x, 8 * (i + 1)) for i, (t, x) in enumerate(curve)],
        "rounds": [],
        "round_seconds": [0.1] * rounds,
        **({"load": load} if load else {}),
    }


def _report(late_curve: list[tuple[float, float]]) -> dict:
    results = {
        "alone": _result([(2.0, 3.0), (4.0, 2.6), (6.0, 2.4), (8.0, 2.2)], 8.0, load=[1.0, 2.5]),  # final 2.2
        "baseline": _result([(5.0, 3.1), (10.0, 2.7), (15.0, 2.5)], 15.0),  # final 2.5: the target
        "late": _result(late_curve, 12.0),
    }
    return _elastic_report(BENCH, results, {})


def test_late_goal_not_reached_is_printed_as_such():
    report = _report([(2.0, 3.0), (4.0, 2.6), (7.0, 2.7), (12.0, 2.55)])  # never at or below 2.5
    assert report["target_eval_loss"] == 2.5
    late = report["goals"]["late"]
    assert late["seconds"] is None and late["ratio"] is None and late["alone_seconds"] == 6.0
    assert late["steps"] is None and late["alone_steps"] == 24
    assert late["final_eval_loss"] == 2.55
    text = format_elastic(report)
    lines = [line for line in text.splitlines() if line.startswith("facility 1 10 s late")]
    assert lines == [
        "facility 1 10 s late: facility 0 did not reach the target 2.5000 (final eval loss 2.5500; "
        "alone at it in 6.0 s): not reached; goal <= 1 x alone"
    ], text
    # The table still has the late row, its time to target '-'.
    row = next(line for line in text.splitlines() if line.startswith("| late |"))
    assert row == "| late | 12.0 | 12 | 2.5500 | - | - | - | - | - |", row
    row = next(line for line in text.splitlines() if line.startswith("| alone |"))
    assert row == "| alone | 8.0 | 12 | 2.2000 | 6.0 | 0.400 | 1.000 | 24 | 1.0-2.5 |", row  # baseline at 2.5 in 15 s


def test_late_goal_reached_gives_the_ratio_to_alone():
    report = _report([(2.0, 3.0), (4.0, 2.6), (4.5, 2.45), (12.0, 2.3)])  # at the target (2.5) at 4.5 s
    late = report["goals"]["late"]
    assert late["seconds"] == 4.5 and late["ratio"] == pytest.approx(4.5 / 6.0) and late["steps"] == 24
    lines = [line for line in format_elastic(report).splitlines() if line.startswith("facility 1 10 s late")]
    assert lines == [
        "facility 1 10 s late: facility 0 at the target in 4.5 s, 0.75 x alone (6.0 s); goal <= 1; "
        "at step 24 (alone: 24)"
    ]


def test_no_late_scenario_no_late_line_and_failures_listed():
    results = {"alone": _result([(2.0, 3.0), (8.0, 2.2)], 8.0)}
    report = _elastic_report(BENCH, results, {"late": "exit codes {'f1': 1}"})
    text = format_elastic(report)
    assert "goals" in report and "late" not in report["goals"]
    assert "facility 1 10 s late" not in text and text.splitlines()[-1] == "failed: late: exit codes {'f1': 1}"


def test_each_facility_gets_its_own_cpus():
    assert facility_cpus(2, [0, 1]) == [[0], [1]]
    assert facility_cpus(2, [4, 0, 2, 1, 3]) == [[0, 1], [2, 3]]  # sorted, equal shares, the remainder unused
    assert facility_cpus(2, [7]) is None  # fewer CPUs than facilities: nothing to pin
    report = _report([(2.0, 3.0), (12.0, 2.3)])
    assert not any(line.startswith("facility 0 on CPUs") for line in format_elastic(report).splitlines())
    report["results"]["alone"]["cpus"] = [[0], [1]]
    assert "facility 0 on CPUs 0; facility 1 on CPUs 1; the lighthouse on any" in format_elastic(report).splitlines()
