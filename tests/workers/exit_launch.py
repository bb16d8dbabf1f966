"""Run a torchrun script many times, cheaply, and report how every process ended (test_exit.py).

    python -m workers.exit_launch [--stress] SCRIPT WORLD REPS AT_ONCE [SCRIPT ARGS...]

Each repetition starts ``WORLD`` processes the way torchrun starts its workers (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set, a
fresh port per repetition; ``AT_ONCE`` repetitions at a time), each running ``SCRIPT`` as
``__main__`` and leaving through the interpreter's ordinary exit (atexit handlers, then teardown:
what the test is about). The processes are forked from this one, which has imported torch and
``xffl_like.parallel`` already: importing them costs ~2.5 s of CPU per process and a torchrun
agent as much again per repetition, too much for 80 processes on a 2-core machine; a forked rank
costs ~0.35 s (``gc.freeze``: no copy-on-write of the inherited heap by the rank's collections).

``--stress`` widens the race behind "terminate called without an active exception" (see
``xffl_like.parallel.runtime``): gloo's threads get ``SCHED_IDLE`` (set on each one once its group
is created) and the GIL switch interval is 1 s, so that a gloo thread that still has to release a
finished collective's tensors waits for the GIL until the main thread gives it up, which at the
end of a script is in the interpreter's teardown. Without the fix the issue's script aborted in 11
to 16 of 20 repetitions so; unstressed, 1 run in 6 per the issue, from 0 in 10 to 6 in 16 here
under torchrun depending on the machine's load, and never in 20 through this launcher.

Prints one JSON line per repetition: ``{"rep", "returncodes", "stdout", "stderr", "cpu_s"}`` (one
entry per rank; a return code is negative for a signal: -6 for an abort).
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import socket
import sys
import tempfile

import torch  # noqa: F401 - imported once here, inherited by every forked rank
import torch.distributed as dist

import xffl_like.parallel  # noqa: F401

STRESS_SWITCH_S = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _demote_gloo_threads() -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if name.startswith(("pt_gloo", "gloo")):
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # the thread has ended
            pass


def _stress() -> None:
    def demoting(create):
        def call(*args, **kwargs):
            group = create(*args, **kwargs)
            _demote_gloo_threads()
            return group

        return call

    dist.init_process_group = demoting(dist.init_process_group)
    dist.new_group = demoting(dist.new_group)
    sys.setswitchinterval(STRESS_SWITCH_S)


def _rank(script: str, args: list[str], env: dict[str, str], out: str, err: str, stress: bool):
    """In the forked child: become rank ``env['RANK']`` running ``script``; never returns."""
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):  # the C++ runtime's abort message goes to fd 2 too
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    if stress:
        _stress()
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)  # an ordinary exit: atexit handlers, then the interpreter's teardown


def main() -> None:
    argv = sys.argv[1:]
    stress = argv[:1] == ["--stress"]
    script, world, reps, at_once, *args = argv[1:] if stress else argv
    world, reps, at_once = int(world), int(reps), int(at_once)
    tmp = tempfile.mkdtemp(prefix="xffl-exit-")
    gc.freeze()
    for first in range(0, reps, at_once):
        started = []  # (rep, pid, out, err), rank by rank
        for rep in range(first, min(first + at_once, reps)):
            port = _free_port()
            for rank in range(world):
                env = {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(world),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                }
                out, err = (os.path.join(tmp, f"{rep}-{rank}.{s}") for s in ("out", "err"))
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    _rank(script, args, env, out, err, stress)
                started.append((rep, pid, out, err))
        reports: dict[int, dict] = {}
        for rep, pid, out, err in started:
            _, status, usage = os.wait4(pid, 0)
            report = reports.setdefault(rep, {"rep": rep, "returncodes": [], "stdout": [], "stderr": [], "cpu_s": []})
            report["returncodes"].append(os.waitstatus_to_exitcode(status))
            report["cpu_s"].append(round(usage.ru_utime + usage.ru_stime, 2))
            for key, path in (("stdout", out), ("stderr", err)):
                with open(path) as f:
                    report[key].append(f.read())
                os.remove(path)
        for rep in sorted(reports):
            print(json.dumps(reports[rep]), flush=True)
    os.rmdir(tmp)


if __name__ == "__main__":
    main()
