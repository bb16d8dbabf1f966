"""``python -m xffl_like.hub serve``: the hub every facility dials out to (gRPC over mutual TLS).

One port; facilities never connect to each other and never listen. Each call's facility is the
common name of the client certificate it presented (checked against the CA of ``--certs`` and its
revocation list on every call); ``--insecure`` serves plaintext on loopback only, taking the name
from the request, for tests and one-machine demos.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # gRPC core's own info lines (a refused handshake) stay quiet
import grpc  # noqa: E402 - after its verbosity is set

from . import store
from .federation import HubError, HubFederation
from .wire import GRPC_OPTIONS, SERVICE, Frames, WireError, pack, unpack

__all__ = ["HubService", "serve_main"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_SESSION = {"session": str}


class HubService:
    """The gRPC methods of :mod:`.wire` over one :class:`HubFederation`."""

    def __init__(self, federation: HubFederation, certs: Path | None):
        self.fed = federation
        self.revoked = None
        if certs is not None:
            from .identity import RevocationList

            self.revoked = RevocationList(certs)

    # ------------------------------------------------------------------ who is calling
    def _name(self, context, msg: dict | None) -> str:
        if self.revoked is None:  # --insecure: the request names its facility
            name = (msg or {}).get("facility")
            if not isinstance(name, str) or not _NAME.match(name):
                raise HubError("--insecure hub: the request must name its facility", "INVALID_ARGUMENT")
            return name
        auth = context.auth_context()
        names, pems = auth.get("x509_common_name", []), auth.get("x509_pem_cert", [])
        if len(names) != 1 or len(pems) != 1:
            raise HubError("no client certificate", "UNAUTHENTICATED")
        name = names[0].decode(errors="replace")
        from .identity import IdentityError

        try:
            revoked = self.revoked.is_revoked(pems[0])
        except IdentityError as exc:  # revoked.json damaged by hand: refuse everyone, saying why
            raise HubError(f"the hub cannot read its revocation list ({exc})", "UNAVAILABLE") from None
        if revoked:
            raise HubError(
                f"facility {name}'s certificate is revoked: ask the hub's operator for a new one "
                f"(python -m xffl_like.hub add DIR {name})",
                "PERMISSION_DENIED",
            )
        return name

    def _call(self, context, fn):
        try:
            return fn()
        except HubError as exc:
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        except WireError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {exc}")

    # ------------------------------------------------------------------ methods
    def join(self, request: bytes, context) -> bytes:
        def run():
            msg = unpack(request, {"spec": dict, "session": str, "steps": int})
            return pack(self.fed.join(self._name(context, msg), msg))

        return self._call(context, run)

    def beat(self, request: bytes, context) -> bytes:
        def run():
            msg = unpack(request, _SESSION)
            return pack(self.fed.beat(self._name(context, msg), msg["session"]))

        return self._call(context, run)

    def arrive(self, request: bytes, context) -> bytes:
        def run():
            msg = unpack(request, {**_SESSION, "version": int, "step": int, "taken": int, "tokens": (int, float)})
            return pack(self.fed.arrive(self._name(context, msg), msg))

        return self._call(context, run)

    def upload(self, request_iterator, context) -> bytes:
        def run():
            fed = self.fed
            frames = Frames(request_iterator, fed.expected_bytes, {**_SESSION, "kind": str})
            name = self._name(context, frames.header)
            if frames.header["kind"] == "create":
                fed._member(name, frames.header["session"])
                return pack(fed.create(name, frames))
            return pack(fed.upload(name, frames.header["session"], frames))

        return self._call(context, run)

    def _stream(self, context, frames):
        """The frames of ``frames()``, with a refusal as the call's status (as :meth:`_call` does)."""
        try:
            yield from frames()
        except HubError as exc:
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        except WireError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {exc}")

    def result(self, request: bytes, context):
        def frames():
            msg = unpack(request, _SESSION)
            rid = msg.get("round")
            if rid is not None and (not isinstance(rid, int) or isinstance(rid, bool)):
                raise WireError(f"round={rid!r}")
            return self.fed.result(self._name(context, msg), msg["session"], rid, context.is_active)

        return self._stream(context, frames)

    def fetch(self, request: bytes, context):
        def frames():
            msg = unpack(request, _SESSION)
            return self.fed.fetch(self._name(context, msg), msg["session"])

        return self._stream(context, frames)

    def leave(self, request: bytes, context) -> bytes:
        def run():
            msg = unpack(request, _SESSION)
            self.fed.leave(self._name(context, msg), msg["session"])
            return pack({"ok": True})

        return self._call(context, run)

    def handler(self) -> grpc.GenericRpcHandler:
        unary, stream_in, stream_out = (
            grpc.unary_unary_rpc_method_handler,
            grpc.stream_unary_rpc_method_handler,
            grpc.unary_stream_rpc_method_handler,
        )
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Join": unary(self.join),
                "Beat": unary(self.beat),
                "Arrive": unary(self.arrive),
                "Upload": stream_in(self.upload),
                "Result": stream_out(self.result),
                "Fetch": stream_out(self.fetch),
                "Leave": unary(self.leave),
            },
        )


def _open_state(path: Path, fresh: bool) -> store.Snapshot | None:
    """The saved federation (None: a new one); raises :class:`store.StateError` (one line)."""
    if not path.exists():
        path.mkdir(parents=True)
        print(f"hub: {path} did not exist: a new federation begins there", flush=True)
        return None
    if not path.is_dir():
        raise store.StateError(f"--state {path} is not a directory: give a directory (it is created if missing)")
    if fresh:
        old = [p for p in path.iterdir() if p.name.startswith("state-")]
        if old:
            aside = path / f"discarded-{time.strftime('%Y%m%d-%H%M%S')}"
            aside.mkdir()
            for p in old:
                p.rename(aside / p.name)
            print(f"hub: --fresh: the previous state moved to {aside}; a new federation begins", flush=True)
        return None
    snap = store.load_latest(path)
    if snap is None:
        print(f"hub: no saved state in {path}: a new federation begins there", flush=True)
    else:
        print(f"hub: resuming the federation of {path} at version {snap.version}", flush=True)
    return snap


def _credentials(certs: Path) -> grpc.ServerCredentials:
    from .identity import check_hub_identity

    ca, cert, key = check_hub_identity(certs)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def _return_big_buffers() -> None:
    """glibc: buffers of 1 MiB and more (the 16 MiB frames) are mapped and unmapped each time, never kept in
    a thread's heap: the hub's peak stays θ_global, the outer state and the accumulator (measured: 26.5 bytes
    per parameter without this, 16.5 with it, on llama_bench). Elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (also ends its dynamic growth)
    except (OSError, AttributeError):
        pass


def serve_main(args) -> int:
    """Run the hub until SIGINT/SIGTERM; 0 after a clean stop, 2 (one line) on bad input."""
    _return_big_buffers()
    try:
        if not args.insecure and args.certs is None:
            raise store.StateError("serve needs --certs DIR (from `python -m xffl_like.hub init DIR`), or --insecure")
        creds = None if args.insecure else _credentials(Path(args.certs))
        snap = _open_state(Path(args.state), args.fresh)
    except (store.StateError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    fed = HubFederation(Path(args.state), snap, log=lambda line: print(line, flush=True))
    # so_reuseport off: a second hub on a port in use is refused instead of sharing it
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64), options=[*GRPC_OPTIONS, ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((HubService(fed, None if args.insecure else Path(args.certs)).handler(),))
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
    print(f"hub: serving on {bind}:{port} ({mode}); state in {args.state}", flush=True)
    stopped.wait()
    server.stop(grace=2).wait()
    fed.close()
    print(f"hub: stopped; the federation is saved in {args.state} at version {fed.version}", flush=True)
    return 0
