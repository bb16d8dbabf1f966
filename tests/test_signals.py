"""Signals, launcher death and a stale launcher environment (issue 19, classes 2, 3 and 7).

Real processes: the CLI in a session of its own, signalled as a user or a scheduler would.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import PLUGINS, REPO, TINY
from helpers.phases import phases_cover_the_loop

pytestmark = [pytest.mark.cli]

LONG = ["+experiment=llama_fed", "logger=none", "train.steps=400", "federation.every=2", *TINY]
#: Two facilities of one process each, for the tests whose assertions are about the launcher and its processes, not
#: about ranks within a facility (the signal's checkpoint and resume keep LONG's two FSDP facilities).
TWO = ["distributed.nproc_per_node=2", "distributed.federated=[1,1]"]


def _start(args, run_dir: Path, env=None) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "xffl_like.run", *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _wait_training(proc: subprocess.Popen, run_dir: Path, timeout: float = 180.0) -> None:
    """Until the workers have logged a step (metrics.jsonl has a row)."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if metrics.is_file() and metrics.stat().st_size > 0:
            return
        time.sleep(0.2)
    raise AssertionError("the workers did not start training")


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for child in _children(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="walks /proc")
def test_sigkill_of_the_launcher_takes_the_job_with_it(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start([*LONG, *TWO], run_dir)
    try:
        _wait_training(proc, run_dir)
        job = _descendants(proc.pid)
        workers = _workers(proc.pid)
        assert len(workers) == 2 and set(workers) < job, job  # the fork server and its 2 workers (and helpers)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in job):
            time.sleep(0.1)
        assert not [p for p in job if _alive(p)], "processes of the job outlived their launcher"
    finally:
        _kill_session(proc)


def _workers(launcher: int) -> list[int]:
    """The launcher's workers: the children of its fork server (its other child is multiprocessing's
    resource tracker; the server is a fork of the launcher, or a fresh interpreter running forkserver's main)."""
    servers = [p for p in _children(launcher) if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()]
    return [w for s in servers for w in _children(s)]


def _interrupt(args, run_dir: Path, signum: int, again: bool = False, hold_workers: bool = False):
    """Start the CLI, wait until it trains, send ``signum`` to the launcher only (twice, 1.5 s apart,
    with ``again``; with ``hold_workers`` the workers are SIGSTOPped first, as if stuck in a step, so the
    second one surely finds them still running); (returncode, stderr, seconds from the signal to the exit).
    No process of the job may outlive it, and nothing may be left for multiprocessing's resource tracker
    to clean up (its "leaked semaphore objects" warning at exit)."""
    proc = _start(args, run_dir)
    try:
        _wait_training(proc, run_dir)
        job = _descendants(proc.pid) if sys.platform.startswith("linux") else set()
        if hold_workers:
            held = _workers(proc.pid)
            assert held, job
            for pid in held:
                os.kill(pid, signal.SIGSTOP)
        os.kill(proc.pid, signum)
        sent = time.monotonic()
        if again:
            time.sleep(1.5)
            os.kill(proc.pid, signum)
        _, err = proc.communicate(timeout=60)
        seconds = time.monotonic() - sent
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(p) for p in job):
            time.sleep(0.1)
        assert not [p for p in job if _alive(p)], "processes of the job outlived it"
        assert "leaked" not in err, err  # the resource tracker's warning (it exits last: err has it all)
        return proc.returncode, err, seconds
    finally:
        _kill_session(proc)


@pytest.mark.slow
# SIGTERM takes the same path (one handler for both, signal-agnostic): its 143 and its one line naming it are
# test_a_stop_cuts_an_injected_slow_step's, which sends it (one job fewer in the suite).
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130)], ids=["SIGINT"])
def test_a_signal_stops_at_a_step_with_a_checkpoint_and_resumes(tmp_path, signum, code):
    run_dir = tmp_path / "run"
    rc, err, seconds = _interrupt(LONG, run_dir, signum)
    assert rc == code, err
    assert seconds < 15, f"{seconds:.1f} s from the signal to the exit"
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and signal.Signals(signum).name in lines[0], err
    assert not list(run_dir.rglob(".tmp-*")), "a temporary checkpoint was left"
    match = re.search(
        r"interrupted at step (\d+) of 400 \(\w+\): checkpoint saved to (\S+); resume with: .*"
        r"resume=(\S+)$",
        lines[0],
    )
    assert match, lines[0]
    step, checkpoint, resume = int(match[1]), Path(match[2]), match[3]
    assert checkpoint.is_dir() and step % 2 == 0 and Path(resume) == run_dir
    # The run resumes from the named checkpoint (train.steps may change on a resume). Two more steps, and at
    # least the experiment's warm-up (5): a signal seen early (step 2 on a fast machine) must not make the resumed
    # run shorter than its warm-up, which the launcher rightly refuses.
    again = tmp_path / "again"
    steps = max(step + 2, 6)
    args = [a for a in LONG if not a.startswith("train.steps=")] + [f"train.steps={steps}", f"resume={resume}"]
    proc = subprocess.run(
        [sys.executable, "-m", "xffl_like.run", *args, f"hydra.run.dir={again}"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    # Where the resumed attempt writes its summary (its run directory or beside the original's) is not this test's.
    summaries = list(tmp_path.rglob("summary.json"))
    assert summaries, proc.stdout
    assert json.loads(summaries[0].read_text())["checkpoints"]["resumed_from"] == str(checkpoint)


@pytest.mark.slow
def test_a_stop_cuts_an_injected_slow_step(tmp_path):
    """Facility 1's steps sleep 999 x their own time (fault.slow_factor=1000); facilities of their own pace
    (a list of every) so facility 0 logs its steps meanwhile. SIGTERM ends the job within seconds, not after
    the sleep (minutes)."""
    args = ["+experiment=llama_fed", "logger=none", "train.steps=40", "federation.every=[4,4]", *TINY, *TWO,
            "train.log_every=1", "fault.slow_facility=1", "fault.slow_factor=1000"]  # fmt: skip
    rc, err, seconds = _interrupt(args, tmp_path / "run", signal.SIGTERM)
    assert seconds < 20, f"{seconds:.1f} s from the signal to the exit: {err[-2000:]}"
    assert rc == 143, err
    assert "Traceback" not in err, err
    # SIGTERM's one line, as SIGINT's (test_a_signal_stops_at_a_step_with_a_checkpoint_and_resumes), and no temporary.
    lines = [line for line in err.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and re.match(r"interrupted at step \d+ of 40 \(SIGTERM\): ", lines[0]), err
    assert not list((tmp_path / "run").rglob(".tmp-*")), "a temporary checkpoint was left"


@pytest.mark.slow
def test_a_second_sigint_exits_at_once(tmp_path):
    run_dir = tmp_path / "run"
    # The workers are held (SIGSTOP) so the second one surely finds them still stopping: the launcher kills
    # them and ends at once: 130, no traceback, no temporaries, no process left, and the named semaphores of
    # the agent's queues and events released (they were left to the resource tracker, which warned of them).
    args = [a if a != "federation.every=2" else "federation.every=8" for a in [*LONG, *TWO]]
    rc, err, seconds = _interrupt(args, run_dir, signal.SIGINT, again=True, hold_workers=True)
    assert "interrupted again (SIGINT): stopped at once" in err, err
    assert rc == 130, err
    assert "Traceback" not in err, err
    assert seconds < 12, f"{seconds:.1f} s"
    assert not list(run_dir.rglob(".tmp-*"))


# --------------------------------------------------------------------------- a stale launcher environment
def _taken_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# (case, variables, what stderr says, whether the process exits by itself)
STALE = [
    (
        "waiting",
        {"RANK": "1", "WORLD_SIZE": "4"},
        r"waiting for 3 more processes at 127\.0\.0\.1:\d+ \(RANK=1 "
        r"WORLD_SIZE=4 are set: .*unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT",
        False,
    ),
    (
        "port in use",
        {"RANK": "0", "WORLD_SIZE": "2"},
        r"^error: MASTER_PORT=\d+ is in use: .*unset RANK WORLD_SIZE",
        True,
    ),
]


@pytest.mark.slow  # waits at a rendezvous on purpose
@pytest.mark.parametrize("case, variables, says, exits", STALE, ids=[c[0] for c in STALE])
def test_a_stale_launcher_environment_says_what_it_waits_for(tmp_path, case, variables, says, exits):
    sock, port = _taken_port() if exits else (None, _free_port())
    env = {**os.environ, "PYTHONPATH": f"{PLUGINS}{os.pathsep}{REPO}", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), **variables}  # fmt: skip
    # The waiting notice after 1 s, not the shipped 5 (tests/plugins/hook_wait_notice.py); where the process exits by
    # itself its one line is the error, whatever the load delays it by: no notice before it.
    env["XFFL_TEST_WAIT_NOTICE_S"] = "600" if exits else "1"
    proc = subprocess.Popen(
        [sys.executable, "-m", "xffl_like.run", "+experiment=llama_fed", "logger=none"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        if exits:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 2, err
            assert len(err.strip().splitlines()) == 1 and re.search(says, err.strip()), err
        else:
            line = proc.stderr.readline()  # blocks until the notice (the process waits on)
            assert re.search(says, line), line
            assert proc.poll() is None
    finally:
        _kill_session(proc)
        proc.communicate()
        if sock is not None:
            sock.close()


@pytest.mark.parametrize(
    "signame, code", [("SIGINT", 130), ("SIGTERM", 143), ("SIGUSR1", 0)], ids=["SIGINT", "SIGTERM", "SIGUSR1"]
)
def test_an_elastic_facility_that_leaves_exits_as_documented(monkeypatch, tmp_path, signame, code):
    """An elastic facility stopped by a signal leaves its federation, then exits as any job does (Ctrl-C 130,
    SIGTERM 143: docs/running.md), except at Slurm's walltime notice (SIGUSR1): 0, it rejoins later. The
    launcher's decision on what rank 0 returned (no process is started: launch_local and the hub's probe are
    replaced)."""
    from hydra import compose, initialize_config_dir

    import xffl_like.job as job_module
    from xffl_like import CONF_DIR

    left = "facility a left the federation at the hub localhost:29999"
    info = {"signal": signame, "step": 3, "steps": 8, "checkpoint": str(tmp_path / "c"), "last_checkpoint": None,
            "run_dir": str(tmp_path / "run"), "left": left}  # fmt: skip
    monkeypatch.setattr(job_module, "launch_local", lambda *args, **kw: [{"interrupted": info}])
    monkeypatch.setattr(job_module, "_admit", lambda job: None)
    overrides = ["+experiment=llama_fed", "distributed.federated=null", "distributed.nproc_per_node=1",
                 "federation.elastic.hub=localhost:29999", "federation.elastic.facility=a", "logger=none"]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    with pytest.raises(job_module.JobInterrupted) as stopped:
        job_module.run_local(cfg, tmp_path / "run")
    assert stopped.value.code == code and str(stopped.value).startswith("facility a left"), str(stopped.value)
    assert job_module.stop_exit_code(getattr(signal, signame), left=False) == 128 + getattr(signal, signame)


@pytest.mark.slow
def test_nothing_crosses_facilities_between_rounds(tmp_path):
    """Two facilities of one process each, rounds every 4 steps: between two steps that end no round, no
    collective spans more than one process (the stop agreement waits for the round; it ran on every step
    before); each round has its own.
    Counted by wrapping torch.distributed's collectives in every process (tests/plugins/hook_collectives.py)."""
    counts = tmp_path / "collectives"
    counts.mkdir()
    args = [
        "+experiment=llama_fed",
        "logger=none",
        "distributed.nproc_per_node=2",
        "distributed.federated=[1,1]",
        "train.steps=8",
        "federation.every=4",
        *TINY,
        "train.log_every=1",
        "checkpoint.async=false",
    ]  # fmt: skip (an asynchronous save's own collectives come a step later)
    env = {"XFFL_TEST_COLLECTIVES": str(counts), "PYTHONPATH": f"{PLUGINS}{os.pathsep}{REPO}"}
    proc = _start(args, tmp_path / "run", env=env)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    phases_cover_the_loop(json.loads((tmp_path / "run" / "summary.json").read_text()))  # the waits are in "wait"
    workers = [f.read_text().splitlines() for f in counts.glob("*.log")]
    workers = [lines for lines in workers if any(line.startswith("step ") for line in lines)]
    assert len(workers) == 2, workers
    for lines in workers:
        across: dict[int, int] = {}  # step (0-based) -> collectives of more than one process until the next step
        step = None
        for line in lines:
            if line.startswith("step "):
                step = int(line.split()[1])
                across[step] = 0
            elif step is not None and int(line.split()[2]) > 1:
                across[step] += 1
        assert sorted(across) == list(range(8)), across
        quiet = {s: n for s, n in across.items() if (s + 1) % 4}
        assert quiet == dict.fromkeys(quiet, 0), f"collectives across facilities between rounds: {across}"
        assert across[3] > 0 and across[7] > 0, across
