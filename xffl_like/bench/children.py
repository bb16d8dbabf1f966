"""The processes a benchmark check starts, each in its own process group, so that a check that fails (an
exception, a timeout) leaves nothing behind on the machine: :func:`kill_all` ends every group started since
the last call, launchers' workers included."""

from __future__ import annotations

import os
import signal
import subprocess

__all__ = ["kill_all", "spawn"]

_GROUPS: set[int] = set()


def spawn(cmd: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kwargs)`` as the leader of a new process group, recorded for :func:`kill_all`."""
    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    _GROUPS.add(proc.pid)
    return proc


def kill_all() -> int:
    """SIGKILL every process group :func:`spawn` started (those already gone are skipped); how many were alive."""
    alive = 0
    while _GROUPS:
        group = _GROUPS.pop()
        try:
            os.killpg(group, signal.SIGKILL)
            alive += 1
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.waitpid(group, os.WNOHANG)  # reap the leader if it was ours and is done
        except ChildProcessError:
            pass
    return alive
