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
import random
import signal
import socket
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .fork_server import check_cuda_fresh, server_pid, start_fork_server

__all__ = ["WorkerFailure", "free_port", "launch_local", "loopback_store", "start_fork_server", "worker_count_threads"]


class WorkerFailure(RuntimeError):
    """A worker failed; ``str(exc)`` is one line, ``exc.details`` the saved traceback path."""

    def __init__(self, message: str, details: str | None = None, dead_ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.details = details
        self.dead_ranks = dead_ranks  # ranks killed by a signal (no error of their own)
        self.interrupted: int | None = None  # the SIGINT/SIGTERM the launcher received before, if any


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (outgoing connections' local ports); 32768 if unknown."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a rendezvous that rank 0 binds later. Taken at random below the kernel's
    ephemeral range where there is room, so that no outgoing connection of this machine (a gRPC client's, another
    job's) takes it as its local port in between, and two launchers picking at once rarely meet; else the
    kernel's choice."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64) if low > 11024 else ():
        port = rng.randrange(10000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
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
    return dist.TCPStore(
        "127.0.0.1",
        port,
        world_size,
        is_master=True,
        multi_tenant=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=sock.detach(),
    ), port


def worker_count_threads(nproc: int) -> int:
    """Intra-op threads per worker so that workers do not oversubscribe the cores."""
    return max(1, (os.cpu_count() or 1) // nproc)


# Errors that a rank sees when another rank died (the cause is elsewhere).
_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
_SECONDARY_GRACE_S = 3.0


# What the elastic agent sets for each worker; the rest of the environment is the launcher's.
_AGENT_KEYS = {
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
}


def _adopt_environment(env: dict[str, str]) -> None:
    """Give a forked worker the launcher's environment of now (the fork server's is the one it
    started with) plus what the agent set, and the intra-op threads of ``OMP_NUM_THREADS``
    (OpenMP read the variable when the server imported torch)."""
    agent = {k: v for k, v in os.environ.items() if k in _AGENT_KEYS or k.startswith("TORCHELASTIC_")}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(agent)
    if env.get(_RANK0_PORT):  # the launcher's choice, not the agent's (which is in the ephemeral range)
        os.environ["MASTER_PORT"] = env[_RANK0_PORT]
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        import torch

        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))


_FALLBACK = "XFFL_ERROR_FALLBACK_DIR"
# The port worker rank 0's store listens on (MASTER_PORT), picked by the launcher with :func:`free_port`. The
# agent's own pick binds port 0 and lets it go: a port of the ephemeral range, which any outgoing connection of
# the machine may take as its local port before rank 0 binds it (seen as 'Address already in use').
_RANK0_PORT = "XFFL_RANK0_PORT"


def _entry(fn: Callable, args: tuple, error_dir: str, env: dict[str, str]) -> Any:
    # Runs in each worker process.
    from .signals import die_with_parent, install_stop_handlers

    die_with_parent()  # its parent is the fork server, which dies with the launcher
    install_stop_handlers()  # SIGINT/SIGTERM: stop at the next step boundary (the loop asks)
    try:
        check_cuda_fresh()
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
            # the launcher names the rank that died (and its signal), not this one. Its SIGTERM to the
            # survivors (it saw the death, it stops the others) ends the wait at once.
            from .signals import sleep

            sleep(_SECONDARY_GRACE_S, poll=0.05)
        os._exit(1)


def _worker_pids() -> list[int]:
    """The fork server's children: the workers (Linux: /proc; elsewhere ``pgrep -P``)."""
    server = server_pid()
    if not server:
        return []
    pids = []
    if os.path.isdir("/proc/self"):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as fh:
                        stat = fh.read()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == server:
                    pids.append(int(entry))
        return pids
    import subprocess

    out = subprocess.run(["pgrep", "-P", str(server)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


class _Forwarder:
    """The launcher's SIGINT/SIGTERM: the first is forwarded to the workers (they stop at the next step
    boundary and return); a second one (later than ``signals.REPEAT_S``) kills them, calls ``on_abort(signum)``
    and exits at once with 128 + signal. The elastic agent is told to leave both signals alone."""

    def __init__(self, on_abort: Callable[[int], None] | None):
        self.on_abort, self.signum, self.at, self.previous = on_abort, None, 0.0, {}

    def __enter__(self) -> _Forwarder:
        import threading

        self.env = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")  # the agent sets it from its config
        if threading.current_thread() is threading.main_thread():
            from .signals import STOP_SIGNALS

            self.previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def _send(self, sig: int) -> list[int]:
        pids = _worker_pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        return pids

    def _handle(self, signum, frame) -> None:
        from .signals import REPEAT_S, exit_code, release_at_exit

        now = time.monotonic()
        if self.signum is None:
            self.signum, self.at = signum, now
            self._send(signum)
            return
        if now - self.at < REPEAT_S:
            return
        pids = self._send(signal.SIGKILL)
        deadline = time.monotonic() + 2.0
        while pids and time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.02)
        if self.on_abort is not None:
            try:
                self.on_abort(signum)
            except Exception:  # noqa: BLE001 - exiting at once regardless
                pass
        release_at_exit()  # the agent's semaphores (its queues and events): else the resource tracker warns
        sys.stderr.flush()
        os._exit(exit_code(signum))

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            # After a stop request the job is ending (its one line follows): a repeat changes nothing.
            signal.signal(sig, signal.SIG_IGN if self.signum is not None else handler)
        if self.env is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = self.env


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


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


def _launch_config(nproc: int, rdzv_port: int, max_restarts: int):
    """The elastic agent's configuration: ``nproc`` workers on this node, rendezvous on loopback at ``rdzv_port``."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
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
        # SIGINT/SIGTERM are ours (_Forwarder): the agent's handler would SIGTERM the workers and wait 30 s.
        signals_to_handle="SIGHUP,SIGQUIT",
    )


def _name_events_cheaply() -> None:
    """torch's dynamic rendezvous names each event it records after the method that recorded it, found with
    ``inspect.stack()``: that reads the source file of every frame on the stack, about 0.25 s of CPU per launch
    here (more under load). ``sys._getframe`` gives the same name without reading a file."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    dynamic_rendezvous.get_method_name = _method_name


def _method_name(depth: int = 2) -> str:
    """What ``dynamic_rendezvous.get_method_name(depth)`` returns: the name of the function ``depth`` frames up
    from this one (1: its caller, ``_record``; 2: the method that recorded)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # a stack shorter than depth
        return "no_method_name"


def _silence_agent() -> list[tuple[logging.Logger, int]]:
    """Raise the agent's loggers to CRITICAL (it logs every worker's failure at ERROR level; we report the
    cause once); return each logger with the level to restore."""
    quiet = [
        logging.getLogger(n)
        for n in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing.spawn")
    ]
    levels = [(lg, lg.level) for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.CRITICAL)
    return levels


def _worker_failure(exc, error_dir: Path) -> WorkerFailure:
    """The failure to report for the agent's ``exc``: a rank killed by a signal is the cause (the others only
    saw broken connections), else the first error a worker wrote."""
    killed = _killed(exc)
    if killed:
        names = ", ".join(f"rank {r} ({sig})" for r, sig in killed)
        return WorkerFailure(f"{names} died", None, tuple(r for r, _ in killed))
    return WorkerFailure(*_first_error(error_dir))


def launch_local(
    fn: Callable,
    args: tuple,
    nproc: int,
    *,
    error_dir: str | os.PathLike | None = None,
    threads_per_worker: int | None = None,
    max_restarts: int = 0,
    on_abort: Callable[[int], None] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` in ``nproc`` local workers; return their results in rank order.

    The workers see torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT, ...) and rendezvous on loopback (127.0.0.1 only) at a free port. With
    ``max_restarts`` > 0 the agent restarts every worker after a failure (they see
    ``TORCHELASTIC_RESTART_COUNT``); a worker that dies by a signal is named in the error.

    SIGINT/SIGTERM to this process reach the workers (see :class:`_Forwarder`); a worker failure
    after one carries it as ``WorkerFailure.interrupted``. The fork server and the workers die with
    this process (:func:`.signals.die_with_parent`).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

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
    config = _launch_config(nproc, rdzv_port, max_restarts)
    _name_events_cheaply()
    levels = _silence_agent()
    start_fork_server()
    forwarder = _Forwarder(on_abort)
    try:
        with forwarder:
            env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_SIGNALS_TO_HANDLE"}
            env[_RANK0_PORT] = str(free_port())
            results = elastic_launch(config, _entry)(fn, args, str(err_dir), env)
    except ChildFailedError as exc:
        failure = _worker_failure(exc, err_dir)
        failure.interrupted = forwarder.signum
        raise failure from None
    finally:
        for lg, level in levels:
            lg.setLevel(level)
        del rdzv_store
        import shutil

        shutil.rmtree(os.environ.pop(_FALLBACK), ignore_errors=True)
    return [results[r] for r in sorted(results)]
