"""Runs that survive: checkpoints, exact resume, elastic restart, fail-fast, the non-finite guard.

The reference of every resume test is the same job run uninterrupted (torchft's pattern):
final weights and optimizer state (read back from both final checkpoints), final_loss,
eval_loss and facility_losses must be bitwise identical.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO
from helpers.same_run import JOB, assert_same_run, run_job, summary
from workers import durability as workers

from xffl_like.checkpoint.safe import SafeFileSystemReader, SafeLoadPlanner, read_metadata
from xffl_like.checkpoint.store import (
    LATEST,
    checkpoint_name,
    latest_checkpoint,
    list_checkpoints,
    publish,
    remove_stale,
    retain,
)
from xffl_like.distributed.launch import free_port, launch_local


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory, killed_at_7):
    """FSDP [2,2]: the uninterrupted job (its run directory), and the same job with rank 1 killed at step 7
    (the session's ``killed_at_7``: its run directory and process)."""
    ref = tmp_path_factory.mktemp("fsdp") / "ref"
    proc = run_job(JOB, ref)
    assert proc.returncode == 0, proc.stderr
    return ref, *killed_at_7


@pytest.mark.cli
@pytest.mark.slow
def test_fail_fast_names_dead_rank_and_resume_is_bitwise_exact(fsdp_runs, tmp_path):
    ref, run, killed = fsdp_runs
    # 5: the job ends (not the 300 s collective timeout), naming the dead rank and the checkpoint.
    assert killed.returncode != 0
    errors = [line for line in killed.stderr.splitlines() if line.startswith("error:")]
    last = run / "checkpoints" / checkpoint_name(6)
    assert len(errors) == 1 and "rank 1 (SIGKILL) died" in errors[0] and str(last) in errors[0], killed.stderr
    assert "Traceback" not in killed.stderr and not (run / "summary.json").exists()
    assert latest_checkpoint(run / "checkpoints") == last
    # 2 + 3: resume=<run dir> continues in that directory and ends where the uninterrupted job ends.
    copy = tmp_path / "killed"
    shutil.copytree(run, copy)
    fresh = tmp_path / "fresh"
    proc = run_job([*JOB, f"resume={copy}"], fresh)
    assert proc.returncode == 0, proc.stderr
    assert not fresh.exists()  # the directory Hydra made for the resume is dropped
    assert summary(copy)["checkpoints"]["resumed_from"] == str(copy / "checkpoints" / checkpoint_name(6))
    assert_same_run(copy, ref)
    # keep=2: older checkpoints were deleted once newer ones were complete.
    assert [p.name for p in list_checkpoints(copy / "checkpoints")] == [checkpoint_name(6), checkpoint_name(8)]


# Synchronous for 2 steps, then DiLoCo over 2 fragments with overlapped uint8 exchanges weighted by
# tokens: fragment 0 starts after step 3 and is applied after 4, fragment 1 after 5 and 6, both at 8.
# The checkpoint of step 6 (or 4) holds per-fragment theta_global, outer state, residual and tokens.
STREAMING = [
    "federation.schedule=[{until_step:2,algorithm:synchronous},{until_step:null,every:4,fragments:2,"
    "overlap_steps:1,weights:tokens,compression:uint8,error_feedback:true,"
    "outer:{name:nesterov,lr:0.7,momentum:0.9}}]"
]


@pytest.mark.cli
@pytest.mark.slow
def test_unequal_hsdp_elastic_restart_is_bitwise_exact(tmp_path):
    # 6: the elastic launcher restarts the job by itself, which resumes from its newest checkpoint.
    # (The explicit resume=<run dir> path is test_fail_fast_names_dead_rank_and_resume_is_bitwise_exact.)
    job = [
        *JOB,
        "distributed.nproc_per_node=6",
        "distributed.federated=[4,2]",
        "distributed.hsdp=2",
        "seed=1",
        *STREAMING,
    ]
    ref = run_job(job, tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr
    # Rank 5 is facility 1's second shard; async save (the step-6 checkpoint may still be in flight).
    run = tmp_path / "killed"
    proc = run_job([*job, "fault.kill_rank=5", "fault.at_step=7", "distributed.max_restarts=1"], run)
    assert proc.returncode == 0, proc.stderr
    s = summary(run)
    assert s["checkpoints"]["restarts"] == 1 and s["checkpoints"]["resumed_from"] is not None, s["checkpoints"]
    assert_same_run(run, tmp_path / "ref")
    records = summary(tmp_path / "ref")["round_records"]
    assert [(r["step"], r["phase"], r["fragment"], r["started_step"]) for r in records] == [
        (2, 0, None, 2),
        (4, 1, 0, 3),
        (6, 1, 1, 5),
        (8, 1, 0, 8),
        (8, 1, 1, 8),
    ]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_nonfinite_guard_fail_and_skip():
    # 7: facility 1 holds a NaN. fail: one message naming it; skip: the mean of the others.
    cases = [None, [1.0, 2.0, 3.0]]
    reports = launch_local(workers.nonfinite_round, (cases,), 3)
    messages = {r["fail"] for r in reports}
    assert len(messages) == 1  # every rank raises the same error at once
    message = messages.pop()
    assert "facility 1 before round 3 (step 8)" in message and "no checkpoint was written yet" in message
    shapes = reports[0]["shapes"]
    for c, weights in enumerate(cases):
        w = [1.0, 0.0, 1.0] if weights is None else [weights[0], 0.0, weights[2]]
        for i, shape in enumerate(shapes):
            expected = sum(w[f] * workers.facility_full_values(f, i, shape).double() for f in (0, 2)) / sum(w)
            for report in reports:
                assert report["skipped"][c] == [1]
                torch.testing.assert_close(report["values"][c][i].double(), expected, rtol=0, atol=1e-6)


@pytest.mark.cli
@pytest.mark.slow
def test_nonfinite_skip_end_to_end(tmp_path):
    args = [
        "+experiment=llama_fed",
        "distributed.nproc_per_node=3",
        "distributed.federated=1",
        "train.steps=6",
        "federation.every=2",
        "train.seq_len=32",
        "train.batch_size=2",
        "logger=none",
        "fault.nan_rank=1",
        "fault.nan_step=3",
        "federation.on_nonfinite=skip",
        "checkpoint.every_rounds=2",
    ]
    proc = run_job(args, tmp_path)
    assert proc.returncode == 0, proc.stderr
    s = summary(tmp_path)
    assert s["skipped_facilities"] == [[], [1], []]
    assert math.isfinite(s["final_loss"]) and math.isfinite(s["eval_loss"])
    assert s["max_param_divergence_after_last_round"] == 0.0
    # every_rounds=2 and the final one; keep=2.
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == [checkpoint_name(4), checkpoint_name(6)]


# ----------------------------------------------------------------------------- on one process
def test_all_finite_sees_nan_and_inf_and_not_large_values():
    from xffl_like.train.nonfinite import all_finite

    for dtype in (torch.float32, torch.bfloat16):
        big = torch.full((1000,), 3.0e38 if dtype == torch.float32 else 3.0e38, dtype=dtype)  # sums and norms overflow
        assert bool(all_finite([big, -big, torch.zeros(3, dtype=dtype)])) and bool(all_finite([]))
        for bad in (float("nan"), float("inf"), -float("inf")):
            t = torch.ones(2000, dtype=dtype)
            t[1234] = bad
            assert not bool(all_finite([torch.ones(5, dtype=dtype), t])), (dtype, bad)


def test_publish_latest_retain_and_stale(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        tmp = ckpts / f".tmp-{checkpoint_name(step)}"
        tmp.mkdir(parents=True)
        (tmp / ".metadata").write_bytes(b"x")
        assert latest_checkpoint(ckpts) == (None if step == 2 else ckpts / checkpoint_name(step - 2))
        publish(tmp, ckpts / checkpoint_name(step), {"step": step})
        assert not tmp.exists() and latest_checkpoint(ckpts) == ckpts / checkpoint_name(step)
        retain(ckpts, 2)
    assert [p.name for p in list_checkpoints(ckpts)] == [checkpoint_name(4), checkpoint_name(6)]
    assert (ckpts / LATEST).read_text().strip() == checkpoint_name(6)
    (ckpts / ".tmp-step-00000008").mkdir()
    remove_stale(ckpts)
    assert sorted(p.name for p in ckpts.iterdir()) == [LATEST, checkpoint_name(4), checkpoint_name(6)]
    (ckpts / checkpoint_name(6) / "state.json").unlink()  # incomplete: latest names nothing usable
    assert latest_checkpoint(ckpts) is None


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_loading_executes_no_code(tmp_path):
    import torch.distributed.checkpoint as dcp

    # A .metadata whose pickle would call os.system is refused before anything runs.
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(ValueError, match="refusing to load posix.system|refusing to load os.system"):
        read_metadata(tmp_path / "evil")
    # A real DCP checkpoint reads; a pickled (non-tensor) entry in it is refused.
    dcp.save({"w": torch.arange(4.0), "note": "hello"}, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    assert "w" in read_metadata(tmp_path / "ok").state_dict_metadata
    target = {"w": torch.zeros(4), "note": ""}
    with pytest.raises(BaseException) as info:  # DCP wraps it in a CheckpointException (a BaseException)
        dcp.load(
            target, storage_reader=SafeFileSystemReader(str(tmp_path / "ok")), planner=SafeLoadPlanner(), no_dist=True
        )
    assert "is a pickled object; refusing" in str(getattr(info.value, "failures", info.value)) and target["note"] == ""
    target = {"w": torch.zeros(4)}
    dcp.load(target, storage_reader=SafeFileSystemReader(str(tmp_path / "ok")), planner=SafeLoadPlanner(), no_dist=True)
    assert torch.equal(target["w"], torch.arange(4.0))


# ----------------------------------------------------------------------------- bad inputs around a checkpoint
def _compose(overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose(config_name="config", overrides=["+experiment=llama_fed", *overrides])


def _truncate(run: Path) -> None:
    path = next((latest_checkpoint(run / "checkpoints")).glob("__0_*.distcp"))
    path.write_bytes(path.read_bytes()[:100])


def _corrupt_metadata(run: Path) -> None:
    (latest_checkpoint(run / "checkpoints") / ".metadata").write_bytes(b"\x80\x04garbage")


def _drop_latest(run: Path) -> None:
    (run / "checkpoints" / LATEST).unlink()


BAD_RESUME = [
    ([], _truncate, "distcp: truncated ("),
    ([], _corrupt_metadata, ".metadata: not DCP metadata"),
    ([], _drop_latest, "no complete checkpoint"),
    (["model.dim=64"], None, "the config differs from the checkpoint's in model.dim (128 -> 64)"),
    (["distributed.federated=null"], None, "the checkpoint has 2 facilities, this job 1"),
    (["train.steps=6"], None, "leaves nothing to do"),
    (["federation.delay=1"], None, "the config differs from the checkpoint's in federation.delay (0 -> 1)"),
]


@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, prepare, needle", BAD_RESUME, ids=[b[2].split()[0] + str(i) for i, b in enumerate(BAD_RESUME)]
)
def test_bad_resume_is_refused_before_launch(fsdp_runs, tmp_path, overrides, prepare, needle):
    from xffl_like.job import JobFailed, run_local

    _, killed, _ = fsdp_runs
    run = tmp_path / "run"
    shutil.copytree(killed, run)
    if prepare:
        prepare(run)
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns, p.stat().st_size) for p in run.rglob("*"))
    cfg = _compose([*JOB[1:], f"resume={run}", *overrides])
    with pytest.raises(JobFailed, match=re.escape(needle)) as info:
        run_local(cfg, tmp_path / "fresh", worker=lambda *a: pytest.fail("a worker started"))
    assert "\n" not in str(info.value)
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns, p.stat().st_size) for p in run.rglob("*")) == before


@pytest.mark.cli
@pytest.mark.slow
def test_resume_latest_picks_the_newest_run_of_the_experiment(fsdp_runs, tmp_path):
    from xffl_like.checkpoint.resume import resolve_resume
    from xffl_like.distributed.layout import plan_layout
    from xffl_like.job import JobFailed, resolve, run_local

    _, killed, _ = fsdp_runs
    outputs = tmp_path / "outputs" / "llama_fed"
    outputs.mkdir(parents=True)
    with pytest.raises(JobFailed, match="resume=latest: no run of this experiment with a complete checkpoint"):
        run_local(_compose([*JOB[1:], "resume=latest"]), outputs / "fresh", worker=lambda *a: pytest.fail("started"))
    shutil.copytree(killed, outputs / "2000-01-01_00-00-00")  # older, complete
    shutil.copytree(killed, outputs / "2000-01-02_00-00-00")  # newer, but another experiment
    cfg_path = outputs / "2000-01-02_00-00-00" / "config.yaml"
    cfg_path.write_text(cfg_path.read_text().replace("experiment: llama_fed", "experiment: other"))
    from xffl_like.checkpoint.resume import resumed
    from xffl_like.config.schema import job_config

    job = job_config(resolve(_compose([*JOB[1:], "resume=latest"])))
    target = resolve_resume(job, plan_layout(4, 2, None), outputs, outputs / "fresh")
    assert target.checkpoint == outputs / "2000-01-01_00-00-00" / "checkpoints" / checkpoint_name(6)
    job = resumed(job, target)
    assert job.resume == str(target.checkpoint) and job.checkpoint.dir == str(target.checkpoint.parent)


@pytest.mark.cli
@pytest.mark.slow  # starts processes that meet at a rendezvous
def test_leftover_rank_env_and_site_with_bad_config_fail_at_once(tmp_path):
    # A shell with RANK/WORLD_SIZE left over but no rendezvous address: one line, no hang.
    env = {"RANK": "0", "WORLD_SIZE": "4"}
    clean = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, "-m", "xffl_like.run", "+experiment=llama_fed"],
        cwd=REPO,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.count("error:") == 1 and "MASTER_ADDR" in proc.stderr, proc.stderr
    # One site of a multi-site job (rank 2 of 4, first on its node) with a typo: it fails before
    # joining the rendezvous, where it would otherwise wait for rank 0's store.
    env = {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "xffl_like.run", "+experiment=llama_fed", "federation.every=0"],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "error: federation.every=0" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_async_staging_stays_on_host_and_restores_bitwise():
    # On a GPU the fault was a second device copy per save (OOM on real models) and, for local rank != 0, a
    # writer thread reading a copy still in flight on another device's stream; neither shows on CPU. What
    # does is the move: the live tensors sit under a mesh of another device type (see the worker).
    (report,) = launch_local(workers.staged_on_host, (), 1)
    # Staged: CPU local tensors under the same mesh, new storage, equal values.
    assert report["staged"] == [("cpu", "meta", "DTensor", False, True)] * 2
    # The federation's CPU flat buffer: views of it, nothing copied, global shapes kept.
    assert report["wrapped"] == [("cpu", 0, (4, 3)), ("cpu", 12 * 4, (5,))]
    # Saved from the staged copy: the changes made after async_save returned are not in it.
    assert report["restored"] == [True, True]
