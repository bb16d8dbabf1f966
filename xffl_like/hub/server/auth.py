"""Who is calling, checked once for every method: a gRPC server interceptor.

With mutual TLS, the facility is the common name of the client certificate it presented, refused while its
certificate is revoked (``revoked.json`` beside the CA, re-read when it changes: from the next call, without
a restart). With ``--insecure`` (plaintext on loopback, for tests and one-machine demos), the request names
its facility (its ``facility`` key) and is taken on trust. The handler behind receives a context whose
``facility`` is that checked name (:class:`Caller`).

It also bounds the calls each facility has open per method (:data:`MAX_CALLS`; more are refused with
``RESOURCE_EXHAUSTED``): one member cannot take the server's threads, so the others' calls still get through.

The interceptor also turns every exception of a handler into the call's status, in one place (unary calls,
uploads, and streams of θ_global while they are read): a :class:`.errors.HubError` into its own code, a
description the hub cannot hold (:class:`..protocol.spec.SpecError`) and a malformed message
(:class:`..protocol.wire.WireError`) into ``INVALID_ARGUMENT``, a full disk or memory into
``RESOURCE_EXHAUSTED``, anything else into ``INTERNAL``; the detail is one line, never gRPC's ``UNKNOWN``
("Exception calling application"), and the hub logs it: ``hub: refused FACILITY METHOD: CODE: reason``.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import re
import threading
from collections import Counter
from pathlib import Path

import grpc

from ..protocol.spec import SpecError
from ..protocol.wire import WireError, unpack
from .errors import HubError

__all__ = ["Caller", "IdentityInterceptor", "status_of"]

#: The calls one facility may have open at once per method (an honest leader has one, and a few heartbeats).
MAX_CALLS = 4

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class Caller:
    """A handler's gRPC context with ``facility``, the caller's name as checked."""

    def __init__(self, context, facility: str):
        self._context, self.facility = context, facility

    def __getattr__(self, name: str):
        return getattr(self._context, name)


def status_of(exc: BaseException) -> tuple[str, str]:
    """The gRPC status name and the one line a handler's exception is answered with."""
    text = " ".join(str(exc).split())[:400]
    if isinstance(exc, HubError):
        return exc.code, text
    if isinstance(exc, SpecError):
        return "INVALID_ARGUMENT", text
    if isinstance(exc, WireError):
        return "INVALID_ARGUMENT", f"malformed request: {text}"
    if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)):
        return "RESOURCE_EXHAUSTED", f"the hub is out of memory or disk ({type(exc).__name__}: {text})"
    return "INTERNAL", f"the hub failed: {type(exc).__name__}: {text}"


class IdentityInterceptor(grpc.ServerInterceptor):
    """Checks each call's facility (``certs``: the directory of the CA and its revocation list; None: the hub
    serves ``--insecure``) before the method runs."""

    def __init__(self, certs: Path | None, log=print):
        self.revoked, self.log = None, log
        if certs is not None:
            from ..certs import identity

            self.revoked = identity().RevocationList(certs)
        self.open: Counter[tuple[str, str]] = Counter()
        self.lock = threading.Lock()

    def _enter(self, name: str, method: str) -> tuple[str, str]:
        """Count a call of ``method`` by ``name`` (refused beyond :data:`MAX_CALLS`); the key to :meth:`_exit`."""
        key = (name, method.rsplit("/", 1)[-1])
        with self.lock:
            if self.open[key] >= MAX_CALLS:
                raise HubError(f"facility {name} has {MAX_CALLS} {key[1]} calls open already: the hub takes no more "
                               f"until one ends", "RESOURCE_EXHAUSTED")  # fmt: skip
            self.open[key] += 1
        return key

    def _exit(self, key: tuple[str, str]) -> None:
        with self.lock:
            self.open[key] -= 1
            if not self.open[key]:
                del self.open[key]

    def facility(self, context, first: bytes | None) -> str:
        """The calling facility's name (``first``: the request, or a stream's first frame, for ``--insecure``)."""
        if self.revoked is None:  # --insecure: the request names its facility
            name = unpack(first).get("facility") if first is not None else None
            if not isinstance(name, str) or not _NAME.match(name):
                raise HubError("--insecure hub: the request must name its facility", "INVALID_ARGUMENT")
            return name
        auth = context.auth_context()
        names, pems = auth.get("x509_common_name", []), auth.get("x509_pem_cert", [])
        if len(names) != 1 or len(pems) != 1:
            raise HubError("no client certificate", "UNAUTHENTICATED")
        name = names[0].decode(errors="replace")
        from ..errors import IdentityError

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

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.request_streaming and not handler.response_streaming:
            return handler._replace(stream_unary=self._stream_in(method, handler.stream_unary))
        if handler.response_streaming and not handler.request_streaming:
            return handler._replace(unary_stream=self._stream_out(method, handler.unary_stream))
        if not handler.request_streaming:
            return handler._replace(unary_unary=self._unary(method, handler.unary_unary))
        return handler  # no method streams both ways

    def _refuse(self, context, method: str, caller: str | None, exc: Exception):
        """Log the handler's exception in one line and end the call with its status (raises)."""
        code, line = status_of(exc)
        self.log(f"hub: refused {caller or '(unnamed)'} {method}: {code}: {line}")
        context.abort(getattr(grpc.StatusCode, code), line)

    @contextlib.contextmanager
    def _call(self, context, method: str, named_by):
        """The call's checked facility (``named_by()``: the bytes naming it under ``--insecure``), holding one of
        its :data:`MAX_CALLS` for ``method``; every exception in the block (the handler's, also while its stream
        is read) is logged and ends the call as one line with a status."""
        caller = key = None
        try:
            caller = self.facility(context, named_by())
            key = self._enter(caller, method)
            yield Caller(context, caller)
        except Exception as exc:  # noqa: BLE001 - every exception becomes one line and a status
            self._refuse(context, method, caller, exc)
        finally:
            if key is not None:
                self._exit(key)

    def _unary(self, method: str, behavior):
        def run(request, context):
            with self._call(context, method, lambda: request) as caller:
                return behavior(request, caller)

        return run

    def _stream_in(self, method: str, behavior):
        def run(request_iterator, context):
            head: list[bytes] = []  # the first frame, read to name the facility under --insecure

            def first() -> bytes | None:
                if self.revoked is not None:
                    return None
                head.extend(itertools.islice(request_iterator, 1))
                return head[0] if head else None

            with self._call(context, method, first) as caller:
                return behavior(itertools.chain(head, request_iterator), caller)

        return run

    def _stream_out(self, method: str, behavior):
        def run(request, context):
            with self._call(context, method, lambda: request) as caller:
                yield from behavior(request, caller)

        return run
