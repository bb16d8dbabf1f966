"""``python -m xffl_like.hub serve``: the hub every facility dials out to (gRPC over mutual TLS).

One port; facilities never connect to each other and never listen. Each call's facility is the
common name of the client certificate it presented (checked against the CA of ``--certs`` and its
revocation list on every call, by :class:`.auth.IdentityInterceptor`); ``--insecure`` serves plaintext on
loopback only, taking the name from the request, for tests and one-machine demos. The state: :mod:`.store`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # gRPC core's own info lines (a refused handshake) stay quiet
import grpc  # noqa: E402 - after its verbosity is set

from ..protocol.wire import GRPC_OPTIONS  # noqa: E402
from . import store
from .auth import IdentityInterceptor
from .errors import HubError
from .federation import HubFederation
from .service import HubService

__all__ = ["build_server", "line_log", "serve_main"]

#: The server's threads (each open call holds one; :data:`.auth.MAX_CALLS` bounds each facility's).
WORKERS = 64


def line_log(stream=None):
    """The hub's log: each line one write and a flush under a lock. The round threads, the committer and the gRPC
    workers log at once; ``print``'s separate writes of a line and its newline would interleave their lines."""
    lock = threading.Lock()

    def log(line: str) -> None:
        out = stream or sys.stdout
        with lock:
            out.write(f"{line}\n")
            out.flush()

    return log


def _credentials(certs: Path) -> grpc.ServerCredentials:
    from ..certs import identity

    ca, cert, key = identity().check_hub_identity(certs)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


#: A connection that has not finished its (TLS and HTTP/2) handshake this long after it was accepted is closed, and
#: one with no call for IDLE_S is closed (its facility dials again at its next call): idle sockets cannot hold
#: the hub's descriptors.
HANDSHAKE_S, IDLE_S = 10, 300
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),  # off: a second hub on a port in use is refused instead of sharing it
    ("grpc.server_handshake_timeout_ms", HANDSHAKE_S * 1000),
    ("grpc.max_connection_idle_ms", IDLE_S * 1000),
]


def _raise_descriptor_limit() -> int:
    """The soft limit of open files raised to the hard one (each connection holds one); the limit now."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, ValueError, OSError):
        return -1


def _return_big_buffers() -> None:
    """glibc: buffers of 1 MiB and more (the 16 MiB frames) are mapped and unmapped each time, never kept in
    a thread's heap: the hub's peak stays θ_global, the outer state and the accumulator (measured: 26.5 bytes
    per parameter without this, 16.5 with it, on llama_bench). Elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (also ends its dynamic growth)
    except (OSError, AttributeError):
        pass


def build_server(fed: HubFederation, certs: Path | None, log=print) -> grpc.Server:
    """The hub's gRPC server over ``fed``, not started and with no port (``certs``: None serves --insecure;
    ``log``: where the interceptor's refusals go)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=WORKERS),
        interceptors=[IdentityInterceptor(certs, log=log)],
        options=[*GRPC_OPTIONS, *SERVER_OPTIONS],
    )
    server.add_generic_rpc_handlers((HubService(fed).handler(),))
    return server


def _grants(certs: Path | None):
    """What each facility may claim (``certs/grants.json``, re-read when it changes; read once here so a damaged
    file stops the hub in one line), as a function of its name; None for --insecure."""
    if certs is None:
        return None
    from ..certs import identity
    from ..errors import IdentityError

    grants = identity().Grants(certs)
    grants("")

    def grant(name: str):
        try:
            return grants(name)
        except IdentityError as exc:
            raise HubError(f"the hub cannot read its grants ({exc})", "UNAVAILABLE") from None

    return grant


def serve_main(args) -> int:
    """Run the hub until SIGINT/SIGTERM; 0 after a clean stop, 2 (one line) on bad input."""
    _return_big_buffers()
    files = _raise_descriptor_limit()
    log = line_log()
    try:
        if not args.insecure and args.certs is None:
            raise store.StateError("serve needs --certs DIR (from `python -m xffl_like.hub init DIR`), or --insecure")
        creds = None if args.insecure else _credentials(Path(args.certs))
        state = store.SafetensorsStore(Path(args.state), log=log)
        snap = state.open(args.fresh)
        grants = _grants(None if args.insecure else Path(args.certs))
        fed = HubFederation(Path(args.state), snap, log=log, state=state, grants=grants)
    except (store.StateError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    server = build_server(fed, None if args.insecure else Path(args.certs), log=log)
    bind = "127.0.0.1" if args.insecure else args.bind
    try:
        port = server.add_insecure_port(f"{bind}:{args.port}") if creds is None else (
            server.add_secure_port(f"{bind}:{args.port}", creds))  # fmt: skip
    except RuntimeError:
        port = 0
    if port == 0:
        print(f"error: cannot listen on {bind}:{args.port} (in use?): choose a free --port", file=sys.stderr)
        fed.close()
        return 2
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: stopped.set())
    server.start()
    mode = "INSECURE plaintext on loopback only (tests and one-machine demos)" if creds is None else "mutual TLS"
    print(f"hub: serving on {bind}:{port} ({mode}); state in {args.state}; {files} open files", flush=True)
    stopped.wait()
    server.stop(grace=2).wait()
    fed.close()
    if fed.snap is None:
        print(f"hub: stopped; no federation was created, nothing is saved in {args.state}", flush=True)
    else:
        print(f"hub: stopped; the federation is saved in {args.state} at version {fed.version}", flush=True)
    return 0
