"""Signals: a stop request the training loop honours at a step boundary, and processes that die
with their launcher.

**Stop request.** The first SIGINT, SIGTERM or SIGUSR1 a worker receives (from the terminal, from its
launcher forwarding it, from torchrun/srun/scancel, or Slurm's ``--signal=USR1@120`` before walltime)
only records the signal
(:func:`install_stop_handlers`); the loop calls :func:`agree_stop` once per step, one small
all-reduce over the world group, so that every rank sees the same request at the same step.
A second SIGINT/SIGTERM, later than :data:`REPEAT_S` after the first, exits at once
(``os._exit(128 + signal)``) after removing the temporary directory of a checkpoint being
written (:func:`cleanup_on_exit`). A repeat within :data:`REPEAT_S` counts as the same
request: a Ctrl-C in a terminal reaches the workers both directly and through the launcher.
The other signals keep their default handling.

**Parent death.** :func:`die_with_parent` makes the calling process die when its parent does:
on Linux with ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (then ``getppid()`` is checked once, in case
the parent died before the call), elsewhere with a daemon thread that polls ``os.getppid()``
every second and exits the process when it changes. The fork server calls it at start
(:mod:`.forkserver_init`), every local worker at its start (:mod:`.launch`), and a process
started by torchrun, srun or mpirun before it joins the rendezvous (``job.run_under_launcher``):
a SIGKILLed launcher takes its whole job with it.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

__all__ = [
    "REPEAT_S",
    "STOP_SIGNALS",
    "agree_stop",
    "cleanup_on_exit",
    "die_with_parent",
    "exit_code",
    "install_stop_handlers",
    "release_at_exit",
    "requested",
    "signal_name",
    "sleep",
    "stopped_by",
]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
#: A repeat of the signal within this many seconds is the same request (delivered twice).
REPEAT_S = 1.0

_request: dict = {"signum": None, "at": 0.0, "agreed": None}
_cleanup: set[Path] = set()


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def exit_code(signum: int) -> int:
    """The shell's convention: 128 + the signal (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum)


def cleanup_on_exit(path: Path, add: bool = True) -> None:
    """Remove ``path`` (a checkpoint being written) if a second signal ends the process at once."""
    (_cleanup.add if add else _cleanup.discard)(Path(path))


def release_at_exit() -> None:
    """Before an ``os._exit``: what multiprocessing's exit function releases at a normal exit (its finalizers
    of exit priority >= 0), above all the named semaphores of the queues and events this process created.
    ``os._exit`` skips it: they stayed in /dev/shm for the resource tracker to unlink, which warned of them
    ("There appear to be N leaked semaphore objects"; the elastic agent's are 5 + 2 per worker)."""
    util = sys.modules.get("multiprocessing.util")
    if util is None:
        return
    try:
        util._run_finalizers(0)
    except Exception:  # noqa: BLE001 - exiting at once regardless
        pass


def _handler(signum, frame) -> None:
    now = time.monotonic()
    if _request["signum"] is None:
        _request["signum"], _request["at"] = signum, now
        return
    if now - _request["at"] < REPEAT_S:  # the same Ctrl-C, through the terminal and the launcher
        return
    for path in list(_cleanup):  # exit at once: no checkpoint, no half-written one left behind
        shutil.rmtree(path, ignore_errors=True)
    release_at_exit()
    sys.stderr.flush()
    os._exit(exit_code(signum))


def sleep(seconds: float, poll: float = 0.2) -> bool:
    """Sleep up to ``seconds``, back within ``poll`` of a stop request; True if one came. Every wait of a
    worker that is not a collective goes through here, so that a stop is never held up by it."""
    end = time.monotonic() + max(0.0, seconds)
    while _request["signum"] is None:
        left = end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(poll, left))
    return True


def install_stop_handlers() -> None:
    """In a worker (main thread): SIGINT/SIGTERM/SIGUSR1 request a stop at the next step boundary."""
    _request.update(signum=None, at=0.0, agreed=None)
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, _handler)


def requested() -> int | None:
    """The signal received by this process, or ``None``."""
    return _request["signum"]


def agree_stop(group=None) -> int | None:
    """Collective, once per step: the stop signal if any rank received one (the same on every rank)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([_request["signum"] or 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    value = int(flag.item())
    if value:
        _request["agreed"] = value
    return value or None


def stopped_by() -> int | None:
    """The signal the loop stopped for (after :func:`agree_stop` returned it), or ``None``."""
    return _request["agreed"]


def _watch_parent(ppid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != ppid:
            os._exit(1)


def die_with_parent() -> None:
    """Die with the parent process (see the module docstring); call it at the process's start."""
    ppid = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) == 0:
                if os.getppid() != ppid:  # the parent died before prctl: nobody will signal us
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass
    threading.Thread(target=_watch_parent, args=(ppid,), name="xffl-parent-watch", daemon=True).start()
