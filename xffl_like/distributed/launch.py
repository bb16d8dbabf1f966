"""Start local workers through PyTorch's elastic launch API.

Used when ``python -m xffl_like.run`` is started plainly (no torchrun/srun), and by
the multi-process tests. A worker that raises writes its traceback to
``<error_dir>/rank<R>.txt`` and exits non-zero; the launcher stops the others and
raises :class:`WorkerFailure` carrying the first error's last line, so the user
sees the cause once instead of one traceback per rank.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable

__all__ = ["WorkerFailure", "free_port", "launch_local", "loopback_store", "start_fork_server", "worker_count_threads"]


class WorkerFailure(RuntimeError):
    """A worker failed; ``str(exc)`` is one line, ``exc.details`` the saved traceback path."""

    def __init__(self, message: str, details: str | None = None, dead_ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.details = details
        self.dead_ranks = dead_ranks  # ranks killed by a signal (no error of their own)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def loopback_store(port: int = 0, world_size: int | None = None, timeout_s: float = 300.0):
    """A TCPStore server that listens on 127.0.0.1 only (TCPStore alone binds every interface).

    Multi-tenant: a later ``TCPStore(..., port, is_master=True, multi_tenant=True)`` in this
    process (the elastic rendezvous', the default process group's) reuses this server.
    """
    from datetime import timedelta

    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(512)
    port = sock.getsockname()[1]
    # detach(): the store owns the descriptor from now on (Python must not close it under it).
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=True, multi_tenant=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.detach()), port


def worker_count_threads(nproc: int) -> int:
    """Intra-op threads per worker so that workers do not oversubscribe the cores."""
    return max(1, (os.cpu_count() or 1) // nproc)


# Errors that a rank sees when another rank died (the cause is elsewhere).
_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
_SECONDARY_GRACE_S = 3.0


# Workers are forked from multiprocessing's fork server, which imports these once (it lives as
# long as the launching process): a worker costs a fork instead of a fresh interpreter that
# imports torch and the training loop (seconds of CPU per worker, per launch).
# torch._dynamo: FSDP2 imports it at its first DTensor (seconds); the figures are rank 0's.
_PRELOAD = ["torch", "torch._dynamo", "xffl_like.train.loop", "matplotlib.figure", "matplotlib.backends.backend_agg"]
# What the elastic agent sets for each worker; the rest of the environment is the launcher's.
_AGENT_KEYS = {"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
               "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
               "OMP_NUM_THREADS"}


def start_fork_server() -> None:
    """Start the fork server now (it imports torch and the training loop while the caller goes
    on: the launcher calls it once the config is valid); :func:`launch_local` uses it."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(_PRELOAD)  # no effect once the server runs
    forkserver.ensure_running()


def _adopt_environment(env: dict[str, str]) -> None:
    """Give a forked worker the launcher's environment of now (the fork server's is the one it
    started with) plus what the agent set, and the intra-op threads of ``OMP_NUM_THREADS``
    (OpenMP read the variable when the server imported torch)."""
    agent = {k: v for k, v in os.environ.items() if k in _AGENT_KEYS or k.startswith("TORCHELASTIC_")}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(agent)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        import torch

        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))


_FALLBACK = "XFFL_ERROR_FALLBACK_DIR"


def _entry(fn: Callable, args: tuple, error_dir: str, env: dict[str, str]) -> Any:
    # Runs in each worker process.
    try:
        _adopt_environment(env)
        return fn(*args)
    except BaseException as exc:  # noqa: BLE001 - report anything, then exit non-zero
        rank = os.environ.get("RANK", "?")
        path = Path(error_dir) / f"rank{rank}.txt"
        summary = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(summary + "\n\n" + traceback.format_exc())
        except OSError:  # e.g. the run directory's disk is full: the line goes to the launcher's fallback (RAM)
            if path.parent.is_dir():
                path.unlink(missing_ok=True)
            (Path(os.environ[_FALLBACK]) / path.name).write_text(summary + "\n")
        sys.stderr.flush()
        if any(s in summary for s in _SECONDARY):
            # Only a symptom of another rank's death: let the agent see that death first, so
            # the launcher names the rank that died (and its signal), not this one.
            time.sleep(_SECONDARY_GRACE_S)
        os._exit(1)


def _killed(exc) -> list[tuple[int, str]]:
    """(rank, signal name) of the workers that a signal ended (SIGKILL, OOM killer, ...)."""
    out = []
    for rank, failure in sorted(getattr(exc, "failures", {}).items()):
        if failure.exitcode < 0:
            out.append((rank, failure.signal_name()))
    return out


def _first_error(error_dir: Path) -> tuple[str, str | None]:
    # A crash shows up on the other ranks as broken connections: report the cause first.
    fallback = os.environ.get(_FALLBACK)
    files = sorted(
        [*error_dir.glob("rank*.txt"), *(Path(fallback).glob("rank*.txt") if fallback else [])],
        key=lambda p: (any(s in p.read_text().split("\n", 1)[0] for s in _SECONDARY), p.stat().st_mtime),
    )
    if not files:
        return "a worker died without reporting an error (killed, out of memory, or a crash)", None
    first = files[0]
    rank = first.stem.removeprefix("rank")
    line = (first.read_text().splitlines() or ["(an empty error file: was its disk full?)"])[0]
    others = sorted(int(p.stem.removeprefix("rank")) for p in files[1:] if p.stem[4:].isdigit())
    more = f" (ranks {others} failed after it)" if others else ""
    return f"rank {rank} failed: {line}{more}", str(first) if first.parent == error_dir else None


def launch_local(
    fn: Callable,
    args: tuple,
    nproc: int,
    *,
    error_dir: str | os.PathLike | None = None,
    threads_per_worker: int | None = None,
    max_restarts: int = 0,
) -> list[Any]:
    """Run ``fn(*args)`` in ``nproc`` local workers; return their results in rank order.

    The workers see torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT, ...) and rendezvous on loopback (127.0.0.1 only) at a free port. With
    ``max_restarts`` > 0 the agent restarts every worker after a failure (they see
    ``TORCHELASTIC_RESTART_COUNT``); a worker that dies by a signal is named in the error.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    err_dir = Path(error_dir) if error_dir is not None else Path(tempfile.mkdtemp(prefix="xffl-errors-"))
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    os.environ[_FALLBACK] = tempfile.mkdtemp(prefix="xffl-errors-", dir=shm)  # when err_dir cannot be written
    threads = threads_per_worker or worker_count_threads(nproc)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    # Listen on loopback only: the rendezvous store is ours (bound to 127.0.0.1, reused by the
    # agent), and the agent does not share its own store (which would bind every interface):
    # worker rank 0 hosts the process group's store instead, on loopback too (distributed.state).
    rdzv_store, rdzv_port = loopback_store()
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"xffl-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{rdzv_port}",
        rdzv_configs={"timeout": 120},
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="forkserver",
        local_addr="127.0.0.1",
    )
    # The agent logs every worker's failure at ERROR level; we report the cause once.
    quiet = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing.spawn")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.CRITICAL)
    start_fork_server()
    try:
        results = elastic_launch(config, _entry)(fn, args, str(err_dir), dict(os.environ))
    except ChildFailedError as exc:
        killed = _killed(exc)
        if killed:  # a dead rank is the cause; the others only saw broken connections
            names = ", ".join(f"rank {r} ({sig})" for r, sig in killed)
            raise WorkerFailure(f"{names} died", None, tuple(r for r, _ in killed)) from None
        message, details = _first_error(err_dir)
        raise WorkerFailure(message, details) from None
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
        del rdzv_store
        import shutil

        shutil.rmtree(os.environ.pop(_FALLBACK), ignore_errors=True)
    return [results[r] for r in sorted(results)]
