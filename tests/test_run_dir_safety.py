"""Issue 19, classes 4-6: a resume that would change the run is refused, damaged checkpoints and a full
disk are named (file and cause) with the newest intact checkpoint, and one job owns a run directory."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO
from helpers.same_run import JOB

from xffl_like.checkpoint.resume import RESUME_MAY_CHANGE, config_differences
from xffl_like.checkpoint.store import Damaged, check_intact, checkpoint_name, newest_intact, publish

ENV = {
    **os.environ,
    "WANDB_MODE": "offline",
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
}


def run_cli(args, run_dir, timeout=300):
    cmd = [sys.executable, "-m", "xffl_like.run", *args, f"hydra.run.dir={run_dir}"]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


def batch(cases: list[dict], root: Path) -> list[dict]:
    """``workers.cli_batch``: many command lines in one process."""
    (root / "cases.json").write_text(json.dumps(cases))
    cmd = [sys.executable, "-m", "workers.cli_batch", str(root / "cases.json"), str(root / "results.json")]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120 + 20 * len(cases))
    assert proc.returncode == 0, proc.stderr
    return json.loads((root / "results.json").read_text())


def one_error_line(result: dict) -> str:
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result["stderr"]
    assert "Traceback" not in result["stderr"] + result["stdout"]
    return lines[0]


# ----------------------------------------------------------------------------- class 4, pure
def test_config_differences_allow_list():
    saved = {
        "seed": 0,
        "resume": None,
        "train": {"steps": 8, "log_every": 4, "batch_size": 2},
        "federation": {"every": 10, "outer": {"betas": [0.9, 0.99]}},
        "logger": {"name": "wandb"},
        "checkpoint": {"keep": 2},
        "data": {"name": "synthetic"},
    }
    now = {
        "seed": 1,
        "resume": "/r",
        "train": {"steps": 20, "log_every": 1, "batch_size": 2},
        "federation": {"every": 8, "outer": {"betas": (0.9, 0.95)}},
        "logger": {"name": "none"},
        "checkpoint": {"keep": 3},
        "data": {"name": "text"},
        "new_key": 1,
    }
    assert config_differences(saved, now) == [
        ("data.name", "synthetic", "text"),
        ("federation.every", 10, 8),
        ("federation.outer.betas", [0.9, 0.99], [0.9, 0.95]),
        ("new_key", "<unset>", 1),
        ("seed", 0, 1),
    ]
    assert config_differences(saved, saved) == []
    for key in RESUME_MAY_CHANGE:  # every allowed key is documented
        assert f"`{key}" in (REPO / "docs" / "outputs.md").read_text(), key


# ----------------------------------------------------------------------------- class 5, pure
def _checkpoint(ckpts: Path, step: int) -> Path:
    import torch.distributed.checkpoint as dcp

    tmp = ckpts / f".tmp-{checkpoint_name(step)}"
    dcp.save({"w": torch.arange(40.0) + step, "v": torch.ones(3)}, checkpoint_id=str(tmp), no_dist=True)
    publish(tmp, ckpts / checkpoint_name(step), {"step": step})
    return ckpts / checkpoint_name(step)


def _overwrite_start(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[:64] = b"\0" * 64
    p.write_bytes(bytes(data))


DAMAGE = [  # (what to do to the newest checkpoint, the file it names, the cause)
    (lambda c: (c / "__0_0.distcp").write_bytes((c / "__0_0.distcp").read_bytes()[:100]), "__0_0.distcp", "truncated"),
    (lambda c: _overwrite_start(c / "__0_0.distcp"), "__0_0.distcp", "not a DCP shard"),
    (lambda c: (c / "__0_0.distcp").write_text("a foreign file\n" * 1000), "__0_0.distcp", "not a DCP shard"),
    (lambda c: (c / "__0_0.distcp").unlink(), "__0_0.distcp", "missing shard file"),
    (lambda c: (c / ".metadata").unlink(), ".metadata", "missing .metadata"),
    (lambda c: (c / ".metadata").write_bytes(b"\x80\x04garbage"), ".metadata", "not DCP metadata"),
    (lambda c: (c / "state.json").write_text("{"), "state.json", "not JSON"),
]


@pytest.mark.parametrize("damage, file, cause", DAMAGE, ids=[f"{d[1]}-{d[2]}" for d in DAMAGE])
def test_check_intact_names_file_and_cause(tmp_path, damage, file, cause):
    ckpts = tmp_path / "checkpoints"
    old, new = _checkpoint(ckpts, 2), _checkpoint(ckpts, 4)
    check_intact(new)
    assert newest_intact(ckpts) == new
    damage(new)
    with pytest.raises(Damaged) as info:
        check_intact(new)
    assert info.value.file == new / file and cause in info.value.cause and "\n" not in str(info.value)
    assert newest_intact(ckpts) == old and newest_intact(ckpts, before=new) == old


@contextlib.contextmanager
def tmpfs(mnt: Path, size: str):
    """A tmpfs of ``size`` at ``mnt`` (root only); the test is skipped where mount is not allowed. Always unmounted."""
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs."""
    with tmpfs(tmp_path / "full", "1M") as mnt:
        yield mnt


def test_full_disk_save_names_the_cause(tiny_tmpfs):
    import torch.distributed.checkpoint as dcp

    from xffl_like.checkpoint.dcp import describe_failure

    where = tiny_tmpfs / ".tmp-step-00000002"
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
        dcp.save({"w": torch.zeros(1_000_000)}, storage_writer=dcp.FileSystemWriter(str(where)), no_dist=True)
    line = describe_failure(info.value, where)
    assert "No space left on device" in line and str(tiny_tmpfs) in line and "\n" not in line, line


# ----------------------------------------------------------------------------- classes 4 and 5 through the CLI
@pytest.fixture(scope="module")
def killed_run(killed_at_7):
    """The durability job killed at step 7 (the session's, shared with test_durability): checkpoints at steps
    4 and 6."""
    run, proc = killed_at_7
    assert proc.returncode != 0 and (run / "checkpoints" / checkpoint_name(6)).is_dir(), proc.stderr
    return run


def _ckpt(run: Path, step: int = 6) -> Path:
    return run / "checkpoints" / checkpoint_name(step)


RESUMES = [  # (overrides, damage to the run copy, needles in the one line)
    (
        ["seed=1", "federation.every=4"],
        None,
        ["the config differs from the checkpoint's in federation.every (2 -> 4), seed (0 -> 1)"],
    ),
    (["data.non_iid=0.2"], None, ["data.non_iid (0.5 -> 0.2)"]),
    (["federation.algorithm=synchronous"], None, ["federation.algorithm (federated -> synchronous)"]),
    (["federation.every=3", "train.steps=9"], None, ["federation.every (2 -> 3)"]),
    (["optim.lr=0.01"], None, ["optim.lr (0.003 -> 0.01)"]),
    (["model.dim=64"], None, ["model.dim (128 -> 64)"]),
    (["distributed.federated=null"], None, ["the checkpoint has 2 facilities, this job 1"]),
    (["train.steps=6"], None, ["leaves nothing to do"]),
    (
        [],
        lambda r: _overwrite_start(_ckpt(r) / "__1_0.distcp"),
        ["__1_0.distcp: not a DCP shard", "newest intact checkpoint is {step4} (resume={step4})"],
    ),
    (
        [],
        lambda r: (_ckpt(r) / "__0_0.distcp").write_text("foreign\n"),
        ["__0_0.distcp: not a DCP shard", "newest intact checkpoint is {step4}"],
    ),
    (
        [],
        lambda r: (_ckpt(r) / ".metadata").unlink(),
        [".metadata: missing .metadata", "newest intact checkpoint is {step4} (resume={step4})"],
    ),
    (
        [],
        lambda r: (r / "checkpoints" / "latest").unlink(),
        ["no complete checkpoint", "newest intact checkpoint is {step6}"],
    ),
]


def _listing(run: Path) -> list:
    return sorted((p.relative_to(run), p.stat().st_mtime_ns, p.stat().st_size) for p in run.rglob("*"))


# ----------------------------------------------------------------------------- class 6
def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, what
        time.sleep(0.2)


def _pause(pid: int) -> list[int]:
    """SIGSTOP ``pid``'s descendants (its fork server and ranks, Linux: /proc), not ``pid`` itself: the ones stopped."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    stopped, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGSTOP)
                stopped.append(child)
            todo.append(child)
    return stopped


@pytest.fixture(scope="module")
def refusals(killed_run, tmp_path_factory):
    """One ``workers.cli_batch`` process (one import of torch and Hydra fewer) for the command lines of classes 4-6:
    while a first job owns ``run`` (running, then paused), two jobs that want it (``lock``), then the resumes of
    ``RESUMES``, each from its own copy of the killed run (``resumes``: (run copy, its files before), result).
    The first job is killed before this returns."""
    tmp = tmp_path_factory.mktemp("refusals")
    copies = []
    for i, (_, damage, _) in enumerate(RESUMES):
        run = tmp / f"run{i}"
        shutil.copytree(killed_run, run, ignore=shutil.ignore_patterns(".lock"))
        if damage:
            damage(run)
        copies.append((run, _listing(run)))
    resumes = [
        {"args": [*JOB, f"resume={run}", *overrides], "run_dir": str(tmp / f"fresh{i}")}
        for i, ((overrides, _, _), (run, _)) in enumerate(zip(RESUMES, copies))
    ]
    run = tmp / "run"
    cmd = [sys.executable, "-m", "xffl_like.run", *JOB, "train.steps=60", "checkpoint.every_rounds=100",
           f"hydra.run.dir={run}"]  # fmt: skip
    first = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    paused: list[int] = []
    try:
        _wait_for(lambda: (run / "metrics.jsonl").is_file() or first.poll() is not None, 240, "the first job started")
        assert first.poll() is None, first.communicate()
        owner = (run / ".lock").read_text()
        # Paused (SIGSTOP) while the others try: its lock is held all the same, and its ranks leave the CPU to the
        # batch instead of training on until they are killed.
        paused = _pause(first.pid)
        assert paused, "the first job's ranks were not found"
        lock = [{"args": [*JOB, f"resume={run}"], "run_dir": str(tmp / "fresh")}, {"args": JOB, "run_dir": str(run)}]
        results = batch([*lock, *resumes], tmp)
    finally:
        if first.poll() is None:
            first.kill()
        for pid in paused:  # SIGKILL ends a stopped process too; its ranks also die with their parent
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    first.wait(timeout=60)  # killed above (its run is not this test's)
    return {
        "run": run,
        "pid": first.pid,
        "owner": owner,
        "lock": results[:2],
        "resumes": list(zip(copies, results[2:])),
    }


@pytest.mark.cli
@pytest.mark.slow
def test_resume_refusals_are_one_line_and_leave_the_run_alone(refusals):
    assert len(refusals["resumes"]) == len(RESUMES)
    for (_, _, needles), ((run, before), result) in zip(RESUMES, refusals["resumes"]):
        line = one_error_line(result)
        assert result["rc"] == 2, line
        for needle in needles:  # a damaged step 6 points to step 4, never to itself
            needle = needle.format(step4=_ckpt(run, 4), step6=_ckpt(run, 6))
            assert needle in line, (needle, line)
        # Nothing of the original run was written: config.yaml, checkpoints, metrics.
        assert _listing(run) == before


@pytest.mark.cli
@pytest.mark.multiprocess
@pytest.mark.slow
def test_second_job_on_a_locked_run_dir_is_refused(refusals):
    run, pid = refusals["run"], refusals["pid"]
    assert refusals["owner"].startswith(f"pid {pid} on ")
    for result in refusals["lock"]:
        line = one_error_line(result)
        assert result["rc"] == 2 and f"pid {pid} on" in line and "is in use by another job" in line, line
    # The owner is gone: the .lock file left behind blocks nothing (flock dies with its process).
    from xffl_like.job import lock_run_dir

    lock_run_dir(run)
    assert (run / ".lock").read_text().startswith(f"pid {os.getpid()} on ")


@pytest.mark.multiprocess
def test_stale_lock_of_a_killed_owner_does_not_block(tmp_path):
    code = (
        "import sys,time; from xffl_like.job import lock_run_dir; lock_run_dir(sys.argv[1]); "
        "print('held', flush=True); time.sleep(60)"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], cwd=REPO, env=ENV, stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout.readline().strip() == "held"
        probe = (
            "import sys; from xffl_like.job import JobFailed, lock_run_dir\n"
            "try: lock_run_dir(sys.argv[1])\nexcept JobFailed as e: print(e)"
        )
        refused = subprocess.run(
            [sys.executable, "-c", probe, str(tmp_path)], cwd=REPO, env=ENV, capture_output=True, text=True
        )
        assert f"pid {owner.pid} on" in refused.stdout, refused
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    ok = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], cwd=REPO, env=ENV, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout == "", ok


# ----------------------------------------------------------------------------- class 5: a real job on a full disk
@pytest.mark.cli
@pytest.mark.multiprocess
@pytest.mark.slow
def test_full_disk_job_fails_with_one_line(tmp_path):
    with tmpfs(tmp_path / "disk", "3M") as mnt:
        result = run_cli([*JOB, "train.steps=4", "optim.warmup_steps=2"], mnt / "run")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr
    assert "No space left on device" in errors[0] and str(mnt / "run" / "checkpoints") in errors[0], errors[0]
    assert "Traceback" not in result.stderr and "IndexError" not in result.stderr
