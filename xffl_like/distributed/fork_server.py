"""The fork server the local workers are forked from (multiprocessing's ``forkserver`` start method).

A worker costs a fork of a process that has imported torch, torch._dynamo and the training loop
(:data:`PRELOAD`), instead of a fresh interpreter that imports them (seconds of CPU per worker, per launch).
The server lives as long as the launching process (``forkserver_init``: it dies with it, ignores SIGTERM).

Where the server comes from:

- **Forked from the launcher** (:func:`start_fork_server`, on a machine without CUDA): the launcher has
  imported torch already (validating the job needs it), so its fork imports only the rest of the list. That
  is the same server, without a second import of torch: about 1.2 s of CPU less per launch (a fresh
  interpreter and ``import torch``), on each of a test suite's hundred launches and on every user's job.
  A fork is safe only from a process with one thread (a lock another thread held stays held in the child),
  so the launcher forks before anything starts a thread (the hub's gRPC channel, the rendezvous store);
  the child closes every inherited file descriptor but its two (as the spawned server gets only those), and
  leaves with ``os._exit``, so none of the launcher's exit handlers run twice.
- **A fresh interpreter** (multiprocessing's own ``ensure_running``) otherwise: a machine where torch sees a
  GPU (asking initialised the CUDA driver in the launcher, which a fork cannot carry), a launcher with more
  than one thread, or a Python whose fork server protocol is not the one :func:`_fork_from_here` speaks.

The workers are the same either way: forked by the server, set up by :mod:`.launch` (``_entry``).
"""

from __future__ import annotations

import inspect
import os
import socket
import sys

__all__ = ["PRELOAD", "check_cuda_fresh", "server_pid", "start_fork_server"]

# forkserver_init first: the fork server dies with this process and ignores SIGTERM (.signals).
# torch._dynamo: FSDP2 imports it at its first DTensor (seconds); the figures are rank 0's.
PRELOAD = [
    "xffl_like.distributed.forkserver_init",
    "torch",
    "torch._dynamo",
    "xffl_like.train.loop",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
]


def start_fork_server(from_here: bool = False) -> None:
    """Start the fork server now (it imports :data:`PRELOAD` while the caller goes on: the launcher calls it
    once the config is valid); :func:`~.launch.launch_local` uses it. ``from_here``: forked from this process
    where that is safe (the launcher's own call; module docstring), else a fresh interpreter. Idempotent while
    the server lives."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(PRELOAD)  # no effect once the server runs
    # Once one was started, ensure_running keeps it (or starts a fresh one if it died).
    if from_here and forkserver._forkserver._forkserver_pid is None and _can_fork_here():
        _fork_from_here(forkserver._forkserver)
    forkserver.ensure_running()  # a fresh interpreter, unless one of ours is running


def server_pid() -> int | None:
    """The fork server's process id (the workers' parent), or ``None`` before it starts."""
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def _threads() -> set[str]:
    """This process's threads, native ones included (Linux: /proc); empty where unknown."""
    try:
        return set(os.listdir("/proc/self/task"))
    except OSError:
        return set()


#: The threads when this module was imported: in the launcher, the main one and those torch's import started
#: (an idle OpenMP pool, as in any process that imports torch, the fork server included), before anything else
#: (a gRPC channel, the rendezvous store) could start one.
_AT_IMPORT = _threads()


#: The protocol :func:`_fork_from_here` speaks: CPython 3.10-3.13's ``forkserver.main`` (3.14 adds an authkey).
_PROTOCOL = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]


def _can_fork_here() -> bool:
    import threading
    from multiprocessing import forkserver

    if "torch" not in sys.modules or sys.platform != "linux" or threading.active_count() != 1:
        return False
    now = _threads()
    if not now or not now <= _AT_IMPORT:  # a thread started since: a fork would copy its locks, held
        return False
    if list(inspect.signature(forkserver.main).parameters) != _PROTOCOL:
        return False
    import torch

    return not torch.cuda.is_available()  # False without a GPU: the driver is never initialised here


def _fork_from_here(server) -> None:
    """What ``ForkServer.ensure_running`` does, with ``os.fork`` in place of a fresh interpreter: the server's
    listening socket and the 'alive' pipe (every client holds its write end; the server leaves at EOF)."""
    from multiprocessing import connection, resource_tracker, util

    with server._lock:
        resource_tracker.ensure_running()  # before the fork, as ensure_running does: the workers share it
        address = connection.arbitrary_address("AF_UNIX")
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            sys.stdout.flush()  # else the child's copy of a buffered line would be written twice
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the server
                _serve(listener.fileno(), alive_r)
            os.close(alive_r)
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


def _serve(listener_fd: int, alive_r: int) -> None:
    """In the forked server: keep only its two descriptors and the standard streams, serve, and leave without
    running the launcher's exit handlers."""
    code = 0
    try:
        import threading
        from multiprocessing import forkserver

        forkserver._forkserver._lock = threading.Lock()  # the launcher held it across the fork
        keep = {0, 1, 2, listener_fd, alive_r}
        for fd in [int(f) for f in os.listdir("/proc/self/fd")]:
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        forkserver.main(listener_fd, alive_r, PRELOAD)
    except SystemExit as exc:  # the launcher is gone (EOF on the alive pipe)
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException:  # noqa: BLE001 - say why, then leave as the spawned server would
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def check_cuda_fresh() -> None:
    """A forked worker must find CUDA uninitialised: a CUDA context does not survive ``fork``, and a
    worker that inherits one fails at its first kernel, or worse. The fork server imports torch,
    torch._dynamo and the loop (:data:`PRELOAD`); if one of them ever initialises CUDA (on the CUDA
    wheel, triton is imported through torch._dynamo), this fails loudly, naming the cause."""
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError(
            "CUDA was initialised in the fork server before the workers were forked (an import in "
            "xffl_like.distributed.fork_server.PRELOAD touched the GPU): forked workers cannot use it; "
            "remove that import from the preload list"
        )
