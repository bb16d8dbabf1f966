"""What a run shows and leaves behind: progress output, phase table, local files, plots, W&B offline runs.

One tiny job (2 facilities of 1 rank, logger=wandb, offline) runs once in a subprocess with
its output piped (not a TTY); the other tests are pure.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO as ROOT
from helpers.phases import phases_cover_the_loop

from xffl_like.observe.observer import AGG_FIELDS, bandwidth
from xffl_like.observe.progress import Progress, steps_to_aggregation, steps_to_round
from xffl_like.observe.timing import PHASES, format_phase_table, load_imbalance, phase_stats

EVAL = {"eval/loss_local": [2, 3, 4], "eval/loss_global": [2, 4]}
TINY = [
    "train.steps=4",
    "optim.warmup_steps=2",
    "federation.every=2",
    "train.seq_len=32",
    "train.batch_size=2",
    "distributed.nproc_per_node=2",
]
CONTROL = re.compile(r"\r|\x1b\[")


def run_cli(args: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    env.pop("WANDB_API_KEY", None)
    return subprocess.run(
        [sys.executable, "-m", "xffl_like.run", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        **kw,
    )


# ----------------------------------------------------------------------------- W&B run files
def wandb_records(path: Path):
    """Records of a ``run-<id>.wandb`` file: LevelDB-log framing (32 KiB blocks, 7-byte record
    headers: crc, length, type), each payload a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        if kind in (1, 2):  # full, first
            pending = payload
        else:  # middle, last
            pending += payload
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def read_wandb_run(run_dir: Path) -> dict:
    (path,) = run_dir.glob("run-*.wandb")
    out = {"history": {}, "summary": {}, "config": {}}
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out.update(group=r.run.run_group, name=r.run.display_name, project=r.run.project)
            out["config"].update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            out["history"].setdefault(r.history.step.num, {}).update(row)
        elif kind == "summary":
            out["summary"].update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.summary.update})
    return out


# ----------------------------------------------------------------------------- the tiny job
@pytest.fixture(scope="module")
def tiny_job(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("job") / "tiny"
    proc = run_cli(
        [
            "+experiment=llama_fed",
            *TINY,
            "distributed.federated=1",
            "logger=wandb",
            "train.log_every=1",
            "train.eval_every=3",
            f"hydra.run.dir={run_dir}",
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, run_dir


@pytest.mark.cli
@pytest.mark.slow
def test_local_files(tiny_job):
    _, run_dir = tiny_job
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted((m["step"], m["facility"]) for m in lines) == [(s, f) for s in range(1, 5) for f in range(2)]
    assert all(set(m) - set(EVAL) == {"step", "facility", "loss", "lr", "tokens_per_s"} for m in lines)
    # Eval of the local model every 3 steps and before each round (steps 2, 4), of the averaged one after.
    for key, steps in EVAL.items():
        assert sorted((m["step"], m["facility"]) for m in lines if key in m) == [
            (s, f) for s in steps for f in range(2)
        ]
    history = {
        (e["step"], f): (e["loss_local"][f], e["loss_global"] and e["loss_global"][f])
        for e in summary["eval_history"]
        for f in range(2)
    }
    assert {
        (m["step"], m["facility"]): (m["eval/loss_local"], m.get("eval/loss_global"))
        for m in lines
        if "eval/loss_local" in m
    } == history
    # After the last round both facilities hold one model: the mean of their held-out losses is the job's eval_loss.
    last = [m["eval/loss_global"] for m in lines if m["step"] == 4]
    assert sum(last) / 2 == pytest.approx(summary["eval_loss"], rel=1e-9)
    assert [m["loss"] for m in lines if m["facility"] == 1] == pytest.approx(summary["facility_losses"][1])
    with open(run_dir / "aggregation.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert tuple(rows[0]) == AGG_FIELDS and [int(r["step"]) for r in rows] == [2, 4]
    for row, seconds in zip(rows, summary["aggregation_seconds"]):  # the slowest rank's time
        assert float(row["seconds"]) == pytest.approx(seconds)
        algbw, busbw = bandwidth(int(row["bytes_per_rank"]), seconds, 2)
        assert int(row["bytes_per_rank"]) > 0 and float(row["algbw_gbps"]) == pytest.approx(algbw)
        assert float(row["busbw_gbps"]) == pytest.approx(busbw) and busbw == pytest.approx(algbw)  # 2(n-1)/n = 1
        assert row["strategy"] == "fused" and row["streams"] == "1"
    assert summary["aggregation_busbw_gbps"] == pytest.approx([float(r["busbw_gbps"]) for r in rows])
    for png in ("loss.png", "aggregation.png"):
        assert (run_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.cli
@pytest.mark.slow
def test_plain_output_without_a_tty(tiny_job):
    proc, _ = tiny_job
    assert not CONTROL.search(proc.stdout), "progress-bar control characters in non-TTY output"
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [int(line.split()[1].split("/")[0]) for line in steps] == [1, 2, 3, 4]  # log_every=1
    assert "next aggregation in 1 steps" in steps[0] and "aggregating" in steps[1]
    assert sum(line.startswith("round ") and "busbw" in line for line in proc.stdout.splitlines()) == 2
    assert "wandb: offline runs in" in proc.stdout
    assert proc.stderr.strip() == "", proc.stderr  # nobody else says anything


@pytest.mark.cli
@pytest.mark.slow
def test_phase_table_has_every_phase_for_every_rank(tiny_job):
    proc, run_dir = tiny_job
    phases = json.loads((run_dir / "summary.json").read_text())["phases"]
    assert sorted(phases["per_rank_seconds_per_step"]) == ["0", "1"]
    for rank, row in phases["per_rank_seconds_per_step"].items():
        assert set(row) == set(PHASES) and all(v > 0 for v in row.values()), (rank, row)
    for phase in (*PHASES, "total"):
        assert set(phases[phase]) == {"mean_s", "max_s", "max_rank", "imbalance", "useful_s", "waiting_s", "iterations"}
    # Load imbalance, checked against the per-rank totals: the mean over ranks of the sums is
    # the sum of the per-iteration means (useful), and the per-iteration max - mean summed
    # (waiting) is at least what the totals alone show.
    per_rank = phases["per_rank"]
    assert sorted(per_rank) == ["0", "1"] and all(set(per_rank[r]) == set(PHASES) for r in per_rank)
    for phase in PHASES:
        totals = [per_rank[r][phase]["total_s"] for r in ("0", "1")]
        assert phases[phase]["useful_s"] == pytest.approx(sum(totals) / 2)
        assert phases[phase]["waiting_s"] >= max(totals) - sum(totals) / 2 - 1e-12
        # 2 rounds, 4 steps, local evaluations at steps 2, 3, 4 and global ones after the 2 rounds, 2 checkpoints
        assert phases[phase]["iterations"] == {"aggregation": 2, "eval": 5, "checkpoint": 2}.get(phase, 4), phase
        for r in ("0", "1"):
            assert per_rank[r][phase]["average_s"] == pytest.approx(
                per_rank[r][phase]["total_s"] / phases[phase]["iterations"]
            )
            assert per_rank[r][phase]["total_s"] == pytest.approx(phases["per_rank_seconds_per_step"][r][phase] * 4)
    assert phases["total"]["useful_s"] == pytest.approx(sum(phases[p]["useful_s"] for p in PHASES))
    assert phases["total"]["waiting_s"] == pytest.approx(sum(phases[p]["waiting_s"] for p in PHASES))
    out = proc.stdout.splitlines()
    head = next(i for i, line in enumerate(out) if line.startswith("phase "))
    rows = out[head + 1 : head + 2 + len(PHASES)]
    assert [line.split()[0] for line in rows] == [*PHASES, "total"]
    assert out[head].split()[-4:] == ["useful", "s", "waiting", "s"]
    useful_col = [float(line.split()[-2]) for line in rows]
    assert useful_col == pytest.approx([phases[p]["useful_s"] for p in (*PHASES, "total")], abs=1e-3)
    row = next(i for i, line in enumerate(out) if line.startswith("rank "))
    assert out[row].split() == ["rank", *PHASES, "total", "seconds"]
    assert [line.split()[0] for line in out[row + 1 : row + 3]] == ["0", "1"]
    assert all(len(line.split()) == len(PHASES) + 3 for line in out[row + 1 : row + 3])
    for r, line in zip(("0", "1"), out[row + 1 : row + 3]):
        assert float(line.split()[-1]) == pytest.approx(sum(v["total_s"] for v in per_rank[r].values()), abs=1e-3)
    phases_cover_the_loop(json.loads((run_dir / "summary.json").read_text()))


@pytest.mark.cli
@pytest.mark.slow
def test_wandb_offline_runs(tiny_job):
    _, run_dir = tiny_job
    run_dirs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2  # one per facility
    runs = sorted((read_wandb_run(d) for d in run_dirs), key=lambda r: r["name"])
    assert [r["name"] for r in runs] == ["llama_fed-fused-f0", "llama_fed-fused-f1"]
    assert {r["group"] for r in runs} == {"llama_fed-tiny"} and {r["project"] for r in runs} == {"xffl_like"}
    for f, run in enumerate(runs):
        assert run["config"]["strategy"]["name"] == "fused" and run["config"]["train"]["steps"] == 4
        assert run["config"]["job"]["facility"] == f
        assert sorted(run["history"]) == [1, 2, 3, 4]
        for step, row in run["history"].items():
            assert {"train/loss", "train/lr", "train/tokens_per_s"} <= set(row)
            agg = {k for k in row if k.startswith("aggregation/")}
            expected = {
                f"aggregation/{k}"
                for k in (
                    "round",
                    "seconds",
                    "bytes_per_rank",
                    "cross_facility_bytes",
                    "algbw_gbps",
                    "busbw_gbps",
                    "strategy",
                    "streams",
                )
            }
            assert agg == (expected if step % 2 == 0 else set()), (step, agg)
            assert {k for k in row if k.startswith("eval/")} == {k for k, steps in EVAL.items() if step in steps}
        assert run["history"][4]["aggregation/strategy"] == "fused"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [runs[f]["history"][s]["train/loss"] for f in range(2) for s in range(1, 5)] == pytest.approx(
        [x for row in summary["facility_losses"] for x in row]
    )
    assert runs[0]["summary"]["job/final_loss"] == pytest.approx(summary["final_loss"])
    phases = summary["phases"]
    for row in (*PHASES, "total"):
        for key in ("useful_s", "waiting_s"):
            assert runs[0]["summary"][f"load/{row}/{key}"] == pytest.approx(phases[row][key])
    for r in ("0", "1"):
        assert runs[0]["summary"][f"load/rank{r}/total_s"] == pytest.approx(
            sum(v["total_s"] for v in phases["per_rank"][r].values())
        )
        assert runs[0]["summary"][f"load/rank{r}/average_s"] == pytest.approx(
            sum(phases["per_rank_seconds_per_step"][r].values())
        )


@pytest.mark.cli
def test_wandb_is_imported_only_when_used():
    code = "import sys, xffl_like.observe, xffl_like.observe.sweep; assert 'wandb' not in sys.modules; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr


# ----------------------------------------------------------------------------- pure
def test_bandwidth():
    assert bandwidth(2e9, 1.0, 2) == pytest.approx((2.0, 2.0))
    assert bandwidth(2e9, 1.0, 4) == pytest.approx((2.0, 3.0))
    assert bandwidth(2e9, 1.0, 1) == (0.0, 0.0)  # no cross-facility traffic
    assert bandwidth(0, 0.0, 2) == (0.0, 0.0)


def test_steps_to_aggregation():
    assert [steps_to_aggregation(s, 4, 10) for s in range(1, 11)] == [3, 2, 1, 0, 3, 2, 1, 0, 1, 0]
    # A schedule's own rule: synchronous to step 4 (a switch there), then a round every 3 steps from it.
    rounds = {4, 7, 10}
    assert [steps_to_round(s, 10, rounds.__contains__) for s in range(1, 11)] == [3, 2, 1, 0, 2, 1, 0, 2, 1, 0]
    assert steps_to_round(3, 10, lambda done: False) is None


def test_progress_follows_the_federation_rule():
    # Rounds only where the federation says (a phase switch at 4, then every 3): the plain lines say so;
    # no rounds at all (synchronous): no countdown.
    out = io.StringIO()
    p = Progress(steps=9, every=0, log_every=1, stream=out, rounds_at={4, 7, 9}.__contains__)
    for s in range(1, 10):
        p.step(s, 1.0, 10.0)
    tails = [line.split("tok/s")[1].strip() for line in out.getvalue().splitlines()]
    assert tails == [
        "next aggregation in 3 steps",
        "next aggregation in 2 steps",
        "next aggregation in 1 steps",
        "aggregating",
        "next aggregation in 2 steps",
        "next aggregation in 1 steps",
        "aggregating",
        "next aggregation in 1 steps",
        "aggregating",
    ]
    out = io.StringIO()
    p = Progress(steps=3, every=0, log_every=1, stream=out, rounds_at=lambda done: False)
    for s in range(1, 4):
        p.step(s, 1.0, 10.0)
    assert "aggregat" not in out.getvalue()


def _round(step):
    return {
        "round": step // 2 - 1,
        "step": step,
        "seconds": 0.01,
        "bytes_per_rank": 1000,
        "cross_facility_bytes": 2000,
        "algbw_gbps": 1.0,
        "busbw_gbps": 1.0,
    }


def test_progress_plain_lines():
    out = io.StringIO()
    p = Progress(steps=10, every=2, log_every=5, stream=out)
    assert not p.tty
    for s in range(1, 11):
        p.step(s, 1.0 / s, 100.0)
        if s % 2 == 0:
            p.round(_round(s))
    p.close()
    text = out.getvalue()
    assert not CONTROL.search(text)
    assert [line.split()[1] for line in text.splitlines() if line.startswith("step")] == ["1/10", "5/10", "10/10"]
    assert [line.split()[1] for line in text.splitlines() if line.startswith("round")] == ["4"]  # round at step 10


def test_progress_bar_on_a_tty():
    out = io.StringIO()
    p = Progress(steps=3, every=2, log_every=1, stream=out, tty=True, facilities=2)
    for s in range(1, 4):
        p.step(s, 2.5, 1234.0)
    p.print("done")
    text = out.getvalue()
    assert text.startswith("\rstep 1/3 [") and "loss f0 2.5000" in text and "1,234 tok/s" in text
    assert text.endswith("\ndone\n") and "aggregating" in text  # the last step always draws


def test_load_imbalance_by_hand():
    import torch

    # Equal totals (6 s each), yet every other iteration one rank waits 1 s for the other.
    times = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]], dtype=torch.float64)
    assert load_imbalance(times) == pytest.approx((6.0, 2.0))
    # Three ranks, one iteration: mean 2, max 4.
    assert load_imbalance(torch.tensor([[1.0], [1.0], [4.0]])) == pytest.approx((2.0, 2.0))
    assert load_imbalance(torch.zeros(2, 0)) == (0.0, 0.0)  # a phase that never ran


def test_phase_table_format_many_ranks():
    per_rank = {str(r): {p: 0.001 * (1 + (r == 7) * (p == "backward")) for p in PHASES} for r in range(40)}
    stats = phase_stats(per_rank)
    assert stats["backward"]["max_rank"] == 7 and stats["total"]["max_rank"] == 7
    table = format_phase_table({"per_rank_seconds_per_step": per_rank, **stats})
    assert "the 16 slowest of 40 ranks" in table
    rows = [line.split()[0] for line in table.splitlines()[1 : 2 + len(PHASES)]]
    assert rows == [*PHASES, "total"]


@pytest.mark.cli
@pytest.mark.slow
def test_outputs_are_documented(tiny_job):
    """docs/outputs.md names every file, summary field, metrics field and CSV column a job writes."""
    _, run_dir = tiny_job
    doc = (ROOT / "docs" / "outputs.md").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    names = [
        *summary,
        *summary["layout"],
        *summary["strategy"],
        *json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0]),
        *AGG_FIELDS,
        *(p.name for p in run_dir.iterdir() if not p.name.startswith(".")),
    ]
    missing = sorted({n for n in names if f"`{n}" not in doc and f"{n}`" not in doc})
    assert not missing, f"not in docs/outputs.md: {missing}"


def test_wandb_rounds_carry_the_hubs_verdict():
    """A hub's facility logs what the hub made of its update: status, a 0/1 chart and the reason."""
    from xffl_like.observe.wandb_logger import WandbLogger

    class Run:
        rows: list = []

        def log(self, row, step):
            self.rows.append((step, row))

    logger = object.__new__(WandbLogger)
    logger.run = Run()
    base = {"round": 3, "step": 8, "seconds": 1.0, "bytes_per_rank": 4, "cross_facility_bytes": 4,
            "algbw_gbps": 0.0, "busbw_gbps": 0.0, "strategy": "fused", "streams": 1}  # fmt: skip
    logger.round(base, status="rejected", reason="update norm 1e6 x the median")
    logger.round({**base, "step": 10}, status="accepted")
    logger.round({**base, "step": 12})
    (s1, r1), (s2, r2), (s3, r3) = logger.run.rows
    assert (s1, r1["round/status"], r1["round/accepted"], r1["round/reason"]) == (
        8, "rejected", 0, "update norm 1e6 x the median")  # fmt: skip
    assert (s2, r2["round/status"], r2["round/accepted"], "round/reason" in r2) == (10, "accepted", 1, False)
    assert not any(k.startswith("round/") for k in r3)
