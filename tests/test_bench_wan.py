"""The wide-area benchmark's parts: the namespace network (root only) and the result arithmetic.

No timing assertions: the benchmark itself (``python -m xffl_like.bench.wan``) measures times.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import REPO as ROOT

from xffl_like.bench import netns, wan
from xffl_like.bench.wan import (
    eval_curve,
    format_speeds,
    link_round,
    loss_at_step,
    pace_figures,
    round_time,
    speeds_goal,
    time_to_target,
)


def _summary(algorithm: str, sizes: list[int], history: list[dict]) -> dict:
    return {"layout": {"facility_sizes": sizes}, "federation": {"algorithm": algorithm}, "eval_history": history}


def test_eval_curve_takes_the_one_model_the_job_holds():
    # Federated: only the rounds' averaged model (loss_global) is one model; sizes 3 and 1 weigh 3:1.
    fed = _summary(
        "federated",
        [3, 1],
        [
            {"step": 8, "loss_local": [4.0, 2.0], "loss_global": None, "time": 100.0},
            {"step": 16, "loss_local": [3.0, 2.0], "loss_global": [2.0, 6.0], "time": 110.0},
            {"step": 32, "loss_local": [2.0, 2.0], "loss_global": [1.0, 1.0], "time": 130.0},
        ],
    )
    assert eval_curve(fed) == [(16, 110.0, (3 * 2.0 + 6.0) / 4), (32, 130.0, 1.0)]
    # Synchronous: every copy is the same model at every evaluation.
    sync = _summary(
        "synchronous",
        [2, 2],
        [
            {"step": 16, "loss_local": [3.0, 5.0], "loss_global": None, "time": 50.0},
            {"step": 32, "loss_local": [2.5, 2.5], "loss_global": None, "time": 90.0},
        ],
    )
    assert eval_curve(sync) == [(16, 50.0, 4.0), (32, 90.0, 2.5)]


def test_time_to_target_is_the_first_point_at_or_below_it():
    curve = [(16, 110.0, 3.0), (32, 130.0, 2.4), (48, 150.0, 2.0), (64, 170.0, 2.2)]
    assert time_to_target(curve, 2.4, 100.0) == 30.0  # reached exactly at step 32
    assert time_to_target(curve, 2.1, 100.0) == 50.0  # step 48, not the later, higher point
    assert time_to_target(curve, 1.9, 100.0) is None  # never
    assert loss_at_step(curve, 48) == 2.0 and loss_at_step(curve, 40) is None


def _paced_summary(steps_taken, waited, train_seconds, steps=128, facility_steps=None) -> dict:
    return {
        "layout": {"facility_sizes": [2, 2]},
        "steps": steps,
        "train_seconds": train_seconds,
        "facility_steps": facility_steps,
        "round_records": [{"step": 0, "steps_taken": t, "waited_s": w} for t, w in zip(steps_taken, waited)],
    }


def test_pace_figures_steps_per_round_and_waiting_share():
    # every_s: facility 0 took 31 and 33 steps, facility 1 16 and 15; each waited a little at each round.
    paced = pace_figures(_paced_summary([[31, 16], [33, 15]], [[0.2, 0.0], [0.1, 0.3]], 40.0, facility_steps=[64, 31]))
    assert paced["steps_per_round"] == [32.0, 15.5]
    assert paced["waited_seconds"] == pytest.approx([0.3, 0.3])
    assert paced["waiting_share"] == pytest.approx([0.3 / 40, 0.3 / 40])
    assert paced["last_round_waiting_share"] == pytest.approx([0.1 / 40, 0.3 / 40])
    # Fixed every: no steps_taken, the job's steps over its rounds; facility 0 (fast) waits half of each round.
    fixed = pace_figures(_paced_summary([None] * 4, [[4.0, 0.0]] * 4, 40.0, steps=64))
    assert fixed["steps_per_round"] == [16.0, 16.0] and fixed["waiting_share"] == [0.4, 0.0]
    # Synchronous: no rounds, nothing to say.
    assert set(pace_figures(_paced_summary([], [], 40.0)).values()) == {None}


def test_round_time_is_the_median_round_less_the_exchange():
    # Rounds evaluated at 12, 22, 33, 43 s: intervals 12, 10, 11, 10 (median 10.5); exchanges 2, 3, 2, 9 s (median 2.5).
    assert round_time([12.0, 22.0, 33.0, 43.0], [2.0, 3.0, 2.0, 9.0]) == pytest.approx(8.0)
    assert round_time([], []) is None  # no rounds (synchronous)


def _speeds_report(fixed_ttt, paced_ttt, paced_share) -> dict:
    """A hand-made ``bench.mode=speeds`` run through the bench's own report: the reference ends at eval loss
    2.4 (the target); ``fixed`` and ``paced`` first reach it ``*_ttt`` seconds into training (None: never)."""

    def result(ttt, share, steps, per_round, every_s=None):
        curve = [
            {"step": 16, "seconds": 5.0, "loss": 3.0},
            {"step": 32, "seconds": ttt or 200.0, "loss": 2.39 if ttt else 2.5},
        ]
        return {
            "facility_steps": steps,
            "rounds": 4,
            "steps_per_round": per_round,
            "every_s": every_s,
            "wall_seconds": 60.0,
            "train_seconds": 50.0,
            "eval_curve": curve,
            "waiting_share": share,
            "last_round_waiting_share": share and [w / 2 for w in share],
        }

    results = {
        "synchronous": result(20.0, None, [64, 64], None),
        "every_16": result(fixed_ttt, [0.45, 0.001], [64, 64], [16.0, 16.0]),
        "every_s": result(paced_ttt, paced_share, [128, 63], [32.0, 15.75], every_s=8.5),
    }
    results["synchronous"]["eval_curve"][-1]["loss"] = 2.4
    bench = {
        "mode": "speeds",
        "link_mbit": 10,
        "facilities": 2,
        "nproc_per_facility": 2,
        "reference": "synchronous",
        "steps": 64,
        "speeds": {
            "slow": ["fault.slow_facility=1", "fault.slow_factor=2.0"],
            "overrides": [],
            "every_s": None,
            "fixed": "every_16",
            "paced": "every_s",
        },
    }
    return wan._report(bench, results, {})


def test_speeds_goal_ratio_and_waiting():
    report = _speeds_report(100.0, 60.0, [0.02, 0.01])
    goal = report["goal"]
    assert goal["ratio"] == pytest.approx(0.6) and goal["max_waiting_share"] == 0.02 and goal["met"] is True
    assert report["results"]["every_s"]["time_to_target_x_fixed"] == pytest.approx(0.6)
    assert report["results"]["every_16"]["time_to_target_x_fixed"] == 1.0
    table = format_speeds(report)
    assert "| every_s | 128 / 63 | 4 | 32.0 / 15.8 | 8.50 |" in table
    assert "| every_16 | 64 / 64 | 4 | 16.0 / 16.0 | - |" in table and "| 45.0% / 0.1% | 22.5% / 0.1% |" in table
    assert table.splitlines()[-1].endswith("0.600x (60.0 s / 100.0 s), most waiting 2.0%: met")
    assert report["target_eval_loss"] == 2.4 and report["results"]["every_s"]["time_to_target_ratio"] == 3.0
    # Fast enough but a facility waits too long; slow enough; a config that never reached the target.
    assert speeds_goal(_speeds_report(100.0, 60.0, [0.06, 0.0])["results"], "every_16", "every_s")["met"] is False
    assert _speeds_report(100.0, 80.0, [0.0, 0.0])["goal"]["met"] is False
    missing = _speeds_report(100.0, None, [0.0, 0.0])
    assert missing["goal"]["met"] is None and missing["goal"]["ratio"] is None
    assert format_speeds(missing).endswith("not measured")


def test_speeds_runs_and_every_s_placeholder():
    bench = {
        "mode": "speeds",
        "facilities": 2,
        "nproc_per_facility": 2,
        "steps": 64,
        "max_steps_factor": 2,
        "reference": "sync",
        "common": ["logger=none"],
        "speeds": {
            "slow": ["fault.slow_facility=1"],
            "overrides": ["train.seq_len=64"],
            "every_s": None,
            "fixed": "h16",
            "paced": "by_time",
            "configs": {
                "sync": ["+experiment=synchronous"],
                "h16": ["+experiment=fedavg"],
                "by_time": ["+experiment=fedavg", "federation.every=null"],
            },
        },
    }
    runs = wan._runs(bench)
    assert runs["sync"][-2:] == ["train.steps=64", "train.eval_every=0"] and "fault.slow_facility=1" not in runs["sync"]
    assert "fault.slow_facility=1" in runs["h16"] and "train.steps=128" in runs["h16"]
    assert "federation.every_s=1" in runs["by_time"]  # stands in until h16's rounds are measured
    assert "federation.every_s=8.250" in wan._set_every_s(runs["by_time"], 8.25)
    wan._check(
        {"bench": {**bench, "link_mbit": 10, "timeout_s": 10, "eval_every": 16, "link_overrides": [], "configs": {}}}
    )
    bench["speeds"]["configs"] = dict(reversed(bench["speeds"]["configs"].items()))  # by_time before h16
    with pytest.raises(wan.WanFailed, match="must have rounds of fixed steps and come before"):
        wan._check({"bench": {**bench, "link_mbit": 10, "timeout_s": 10, "eval_every": 16, "link_overrides": []}})


def test_counter_interpolation():
    samples = [(10.0, [0, 100]), (12.0, [1000, 300]), (13.0, [1000, 400])]
    assert netns.tx_at(samples, 11.0) == [500.0, 200.0]
    assert netns.tx_at(samples, 5.0) == [0.0, 100.0] and netns.tx_at(samples, 99.0) == [1000.0, 400.0]


def test_link_round_window_and_utilization():
    # 1000 B/s line rate, a sample every second. Facility 0 sends at the full rate from 3 s to 7 s,
    # facility 1 at half from 4 s to 8 s; 10 bytes between 1 s and 2 s (a barrier) stay under 5%.
    f0 = [0, 0, 0, 0, 1000, 2000, 3000, 4000, 4000, 4000, 4000]
    f1 = [0, 0, 10, 10, 10, 510, 1010, 1510, 2010, 2010, 2010]
    samples = [(float(t), [a, b]) for t, (a, b) in enumerate(zip(f0, f1))]
    assert netns.busy_window(samples, 0.0, 10.0, 1000.0) == (3.0, 8.0)
    assert netns.busy_window(samples, 3.5, 10.0, 1000.0) == (3.5, 8.0)  # clamped to the interval asked
    assert netns.busy_window(samples, 8.0, 10.0, 1000.0) is None
    mean_sent = (4000 + 2010) / 2
    fast = link_round(4.0, samples, 0.0, 10.0, 1000.0)  # the job's timer shorter than the wire's window
    assert fast["transfer_seconds"] == 5.0 and fast["round_overhead_seconds"] == -1.0
    assert fast["link_utilization"] == pytest.approx(mean_sent / 5000) == fast["transfer_utilization"]
    slow = link_round(6.0, samples, 0.0, 10.0, 1000.0)  # the round's own time contains the transfer
    assert slow["link_utilization"] == pytest.approx(mean_sent / 6000) and slow["transfer_window"] == [3.0, 8.0]


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


RECEIVER = """
import socket, sys
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
total = 0
while chunk := conn.recv(1 << 16):
    total += len(chunk)
print(total, flush=True)
"""
SENDER = (
    "import socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); "
    "s.sendall(b'x' * 400000); s.close()"
)


@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))
def test_network_carries_traffic_counts_it_and_is_always_removed():
    with netns.Network(2, 100) as net:
        names = [f.namespace for f in net.facilities] + [net.switch]
        assert all(n in _namespaces() for n in names)
        assert net.tcp["net.ipv4.tcp_slow_start_after_idle"] == "0" and net.tcp["net.ipv4.tcp_congestion_control"]
        a, b = net.facilities
        before = net.counters()
        receiver = subprocess.Popen(
            [*b.exec_prefix(), sys.executable, "-c", RECEIVER, b.address], stdout=subprocess.PIPE, text=True
        )
        port = receiver.stdout.readline().strip()
        subprocess.run([*a.exec_prefix(), sys.executable, "-c", SENDER, b.address, port], check=True, timeout=60)
        assert int(receiver.stdout.readline()) == 400000
        receiver.wait(timeout=30)
        after = net.counters()
        sent, received = after[0][0] - before[0][0], after[1][1] - before[1][1]
        assert 400000 < sent < 440000 and 400000 < received < 440000  # payload + TCP/IP headers, across the link
        with pytest.raises(RuntimeError, match="boom"):
            with netns.Network(2, 10, prefix=f"xfw{_dead_pid()}") as other:  # a second network, failing inside
                raise RuntimeError("boom")
        assert other.switch not in _namespaces()
    assert not any(n in _namespaces() for n in names)
    # A crashed run's namespaces (its pid dead) are swept by the next one.
    stale = netns.Network(2, 10, prefix=f"xfw{_dead_pid()}")
    stale._closed = True  # as if the process died without closing
    removed = netns.sweep_stale()
    assert stale.switch in removed and stale.switch not in _namespaces()
    for holder in stale._holders:
        holder.wait(timeout=10)  # killed by the sweep


@pytest.mark.cli
def test_wan_rejects_bad_input_before_building_anything(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "xffl_like.bench.wan",
            f"hydra.run.dir={tmp_path}",
            'bench.configs.synchronous=["+experiment=no_such_preset"]',
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: config synchronous:") and "no_such_preset" in lines[0]
    assert not (tmp_path / "wan.json").exists() and f"xfw{proc.pid}-" not in _namespaces()


def test_target_figures_by_hand():
    """Steps, bytes and overhead to the target: the first evaluation at or below it; overhead is the time to it
    over the slowest facility's seconds per step outside the link (its slowest rank) times those steps."""
    from xffl_like.bench.targets import compute_per_step, goal_verdicts, link_ratio, target_figures

    phases = {
        "0": {"forward": 0.2, "backward": 0.3, "aggregation": 5.0, "wait": 1.0},
        "1": {"forward": 0.25, "backward": 0.3, "aggregation": 0.0, "wait": 0.0},
        "2": {"forward": 0.5, "backward": 0.4, "eval": 0.1, "aggregation": 9.0},
    }
    summary = {"phases": {"per_rank_seconds_per_step": phases}, "layout": {"facility_sizes": [2, 1]}}
    assert compute_per_step(summary) == pytest.approx([0.55, 1.0])
    results = {
        "sync": {
            "eval_curve": [
                {"step": 16, "seconds": 20.0, "loss": 3.0, "cross_bytes": 4_000_000},
                {"step": 32, "seconds": 40.0, "loss": 2.0, "cross_bytes": 8_000_000},
            ],
            "compute_seconds_per_step": [1.0, 1.0],
        },
        "topk": {
            "eval_curve": [
                {"step": 16, "seconds": 17.0, "loss": 2.5, "cross_bytes": 3_000},
                {"step": 32, "seconds": 34.0, "loss": 1.9, "cross_bytes": 6_000},
                {"step": 48, "seconds": 51.0, "loss": 1.8, "cross_bytes": 9_000},
            ],
            "compute_seconds_per_step": compute_per_step(summary),
        },
        "never": {"eval_curve": [{"step": 64, "seconds": 9.0, "loss": 2.1, "cross_bytes": 1}]},
    }
    target_figures(results, "sync", 2.0)
    t = results["topk"]
    assert (t["steps_to_target"], t["steps_to_target_ratio"], t["bytes_to_target"]) == (32, 1.0, 6_000)
    assert t["bytes_to_target_fraction"] == pytest.approx(6_000 / 8_000_000)
    assert t["overhead"] == pytest.approx(34.0 / (1.0 * 32)) and t["overhead_run"] == pytest.approx(51.0 / 48)
    assert results["sync"]["overhead"] == pytest.approx(40.0 / 32) and results["never"]["steps_to_target"] is None
    goals = goal_verdicts(results, ["topk", "never", "missing"])
    assert goals["topk"]["bytes_to_target_fraction"]["met"] is True
    assert goals["topk"]["overhead"]["met"] is False and goals["topk"]["steps_to_target_ratio"]["met"] is True
    assert goals["never"]["overhead"]["met"] is None and goals["missing"]["overhead"]["value"] is None
    assert link_ratio({"link": {"cross_bytes": 6_000}, "link_topk": {"cross_bytes": 90}}) == {
        "ratio": 0.015,
        "goal": 1 / 60,
        "met": True,
    }
    assert link_ratio({"link": {"cross_bytes": 6_000}})["met"] is None


def test_hub_results_are_the_rows_of_rounds_a_facility_holds(tmp_path):
    """``bench.mode=hub`` sees each facility's round results in its ``aggregation.csv`` while the job runs (the
    kill scenarios' moment to kill, the survivor's stall): a row with a round number is version round + 1, a
    missed round (no number) is none, a line still being written waits for its end, and the job's final
    rewrite of the file adds nothing."""
    import csv
    from types import SimpleNamespace

    from xffl_like.bench import hub_wan
    from xffl_like.observe.observer import AGG_FIELDS

    jobs = [SimpleNamespace(name=name, run_dir=tmp_path / name) for name in ("f0", "f1")]
    results = hub_wan._Results(jobs)
    results.poll()  # no file yet
    assert results("f0") == [] and results("f1") == []

    def write(name: str, rounds: list, partial: str = "") -> None:
        (tmp_path / name).mkdir(exist_ok=True)
        with open(tmp_path / name / "aggregation.csv", "w", newline="") as fh:  # as the observer writes it
            writer = csv.DictWriter(fh, fieldnames=AGG_FIELDS)
            writer.writeheader()
            writer.writerows({"round": r, "step": 2 * (i + 1), "seconds": 0.5} for i, r in enumerate(rounds))
            fh.write(partial)

    write("f0", [0, None], partial="2,6,0.")
    results.poll()
    assert [v for _, v in results("f0")] == [1] and results("f1") == []
    write("f0", [0, None, 2])
    write("f1", [1])
    results.poll()
    assert [v for _, v in results("f0")] == [1, 3] and [v for _, v in results("f1")] == [2]
    first = results("f0")
    write("f0", [0, None, 2])  # the job's final rewrite: the same rows
    results.poll()
    assert results("f0") == first
