"""Issue 21: facilities of different speeds, through the CLI with real processes.

Two facilities of unequal size (2 processes with FSDP, 1 process) take different numbers of local
steps between rounds: ``federation.every=[4,2]`` (a list) and ``federation.every_s`` (rounds bounded
by time, facility 1 slowed by ``fault.slow_facility``). Each round's result is recomputed in float64
here from the ranks' recorded shards and the per-facility step counts the job recorded
(``round_records[].steps_taken``): the mean weighted by the tokens each facility trained in that round,
which the test derives from those counts and the batch geometry, not from the job's weights. The list
form is also killed mid-run and restarted: the resumed run must end bit for bit where the
uninterrupted one did.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import TINY, run_cli
from helpers.round_values import ATOL, MIN_FACILITY_SPREAD, facility_tensors, load_rounds

pytestmark = [pytest.mark.cli, pytest.mark.multiprocess, pytest.mark.slow]

SIZES = [2, 1]  # processes per facility (facility 0: 2 replicas of HSDP, shards of 1)
BATCH, SEQ = 4, 64  # TINY's train.batch_size, train.seq_len
COMMON = [
    "+experiment=llama_fed",
    *TINY,
    "logger=none",
    "distributed.nproc_per_node=3",
    "distributed.federated=[2,1]",
    "distributed.hsdp=1",
    "optim.warmup_steps=2",
    "train.eval_every=0",
    "distributed.timeout_s=120",
]


def _run(args, tmp_path, name, env=None):
    run_dir = tmp_path / name
    proc, _ = run_cli(
        [*COMMON, *args],
        run_dir,
        timeout=400,
        env={"XFFL_TEST_DUMP_ROUNDS": str(tmp_path / f"{name}-rounds"), **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text()), run_dir


def _check_rounds(directory, records) -> float:
    """Every recorded round: each rank's shard after == its piece of the float64 mean of the facilities'
    values before, weighted by tokens = steps taken x sequences x positions x the facility's processes."""
    recorded = load_rounds(directory)
    spread = 0.0
    for r, record in enumerate(records):
        weights = torch.tensor(
            [n * BATCH * SEQ * size for n, size in zip(record["steps_taken"], SIZES)], dtype=torch.float64
        )
        before, after = recorded[(r, "before")], recorded[(r, "after")]
        assert {x["rank"] for x in before} == {x["rank"] for x in after} == {0, 1, 2}
        for name in before[0]["params"]:
            full = facility_tensors(before, name)
            stacked = torch.stack([full[f] for f in range(len(SIZES))])
            spread = max(spread, float((stacked[0] - stacked[1]).abs().max()))
            mean = (stacked * weights.view(-1, *[1] * (stacked.dim() - 1))).sum(0) / weights.sum()
            for rec in after:
                chunks = torch.chunk(mean, rec["shard_size"])
                want = chunks[rec["shard"]] if rec["shard"] < len(chunks) else mean[:0]
                got = rec["params"][name].double()
                assert got.shape == want.shape
                err = float((got - want).abs().max()) if got.numel() else 0.0
                assert err <= ATOL, f"round {r}, rank {rec['rank']}: {name} is {err:.3g} from the tokens-weighted mean"
    assert spread > MIN_FACILITY_SPREAD  # the facilities trained apart: any copy would not pass as the mean
    return spread


def _metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {f: [row for row in rows if row["facility"] == f] for f in (0, 1)}


# A linear decay to a tenth after a 2-step warm-up, so that the learning rates show whose steps a schedule runs over.
LISTED = ["federation.every=[4,2]", "train.steps=8", "optim.schedule=linear", "optim.min_lr=0.0003"]


def _linear_lr(k: int, total: int, lr: float = 3e-3, warmup: int = 2, ratio: float = 0.1) -> float:
    """The documented schedule (train/optim.py), by hand: the lr after step ``k`` (1-based) of ``total``."""
    if k < warmup:
        return lr * (k + 1) / warmup
    p = min(1.0, max(0.0, (k - warmup) / max(1, total - warmup - 1)))
    return lr * (1 - p * (1 - ratio))


@pytest.fixture(scope="module")
def listed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("listed")
    return tmp, *_run(LISTED, tmp, "run")


def test_a_list_gives_each_facility_its_steps_per_round(listed):
    tmp, summary, run_dir = listed
    records = summary["round_records"]
    # 8 / max(4, 2) = 2 rounds; facility 0 takes 4 steps per round, facility 1 takes 2.
    assert summary["rounds"] == 2 and [r["steps_taken"] for r in records] == [[4, 2], [4, 2]]
    assert summary["facility_steps"] == [8, 4]
    assert [r["step"] for r in records] == [4, 8]  # facility 0's own steps (rank 0 writes the records)
    assert all(len(r["waited_s"]) == 2 and min(r["waited_s"]) >= 0 for r in records)
    _check_rounds(tmp / "run-rounds", records)
    # Each facility trains its own steps, and its learning-rate schedule runs over them (facility 1: 4 steps).
    metrics = _metrics(run_dir)
    assert [row["step"] for row in metrics[0]] == list(range(1, 9))
    assert [row["step"] for row in metrics[1]] == list(range(1, 5))
    for f, total in ((0, 8), (1, 4)):
        assert [row["lr"] for row in metrics[f]] == pytest.approx([_linear_lr(k, total) for k in range(1, total + 1)])
    assert summary["max_param_divergence_after_last_round"] == 0


def test_a_list_resumes_exactly_after_a_kill(listed, tmp_path):
    """Facility 1's only rank dies at the start of its step 3 (after round 0's checkpoint); the restart
    resumes every facility at its own step from that checkpoint and ends bit for bit as the uninterrupted run."""
    _, reference, _ = listed
    summary, run_dir = _run(
        [*LISTED, "fault.kill_rank=2", "fault.at_step=3", "checkpoint.async=false", "distributed.max_restarts=1"],
        tmp_path,
        "killed",
    )
    # The restart resumed from round 0's checkpoint, named by the job's step (facility 0's 4; facility 1's own was 2).
    assert summary["checkpoints"]["resumed_from"].endswith("step-00000004"), summary["checkpoints"]
    assert summary["facility_steps"] == [8, 4]
    assert summary["facility_losses"] == reference["facility_losses"]
    assert summary["eval_loss"] == reference["eval_loss"]
    assert [r["steps_taken"] for r in summary["round_records"]] == [[4, 2], [4, 2]]


def test_rounds_by_time_follow_each_facility_s_speed(tmp_path):
    """``every_s``: facility 1 (slowed 12x, so that load cannot make it keep pace) takes fewer steps per round than
    facility 0; every round is the tokens-weighted mean of the steps each took; the job ends after the first round
    in which a facility reached train.steps, and no facility trains past it."""
    steps = 10
    summary, run_dir = _run(
        [
            "federation.every=null",
            "federation.every_s=2.5",
            "fault.slow_facility=1",
            "fault.slow_factor=12",  # so slow that a loaded machine cannot make it keep pace
            f"train.steps={steps}",
        ],
        tmp_path,
        "timed",
    )
    records = summary["round_records"]
    taken = [r["steps_taken"] for r in records]
    assert all(n >= 1 for row in taken for n in row), taken
    totals = [sum(row[f] for row in taken) for f in (0, 1)]
    assert totals == summary["facility_steps"] and max(totals) == steps, (totals, taken)
    running = [max(sum(row[f] for row in taken[: i + 1]) for f in (0, 1)) for i in range(len(taken))]
    assert running[-1] == steps and all(n < steps for n in running[:-1]), running  # ended at the first
    assert totals[1] < totals[0], taken  # the slow facility took fewer steps
    _check_rounds(tmp_path / "timed-rounds", records)
    metrics = _metrics(run_dir)
    assert [len(metrics[f]) for f in (0, 1)] == totals
