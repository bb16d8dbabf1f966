"""``python -m workers.fork_probe OUT [--thread]``: a launcher in miniature for ``test_fork_server``.

It imports torch (as the CLI's launcher does), holds a file open (as the launcher holds its run directory's
lock), optionally starts a Python thread, starts the fork server with ``from_here=True``, runs two workers
through ``launch_local`` (each all-reduces ``rank + 1`` and reports its parent and the files it holds), and
writes to ``OUT`` (JSON): its own pid and command line, the server's pid, command line and open files, and the
workers' reports."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch  # noqa: F401 - the launcher has torch loaded before it starts the server

from xffl_like.distributed.fork_server import server_pid, start_fork_server
from xffl_like.distributed.launch import launch_local


def report():
    """In each worker: (rank, parent pid, the sum over ranks of rank + 1, OMP threads of this process)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    out = {"rank": dist.get_rank(), "parent": os.getppid(), "sum": value.item(), "files": _files(os.getpid())}
    dist.destroy_process_group()
    return out


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _files(pid: int) -> list[str]:
    """What the descriptors of ``pid`` point at."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return found


def main() -> None:
    out = Path(sys.argv[1])
    held = open(f"{out}.held", "w")  # noqa: SIM115 - held for the launcher's life, as the run directory's lock
    if "--thread" in sys.argv:
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
    start_fork_server(from_here=True)
    server = server_pid()
    reports = launch_local(report, (), 2)
    out.write_text(
        json.dumps(
            {
                "pid": os.getpid(),
                "cmdline": _cmdline(os.getpid()),
                "server": server,
                "server_cmdline": _cmdline(server),
                "server_files": _files(server),
                "held": held.name,
                "workers": reports,
            }
        )
    )


if __name__ == "__main__":
    main()
