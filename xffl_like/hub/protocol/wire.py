"""What crosses between a facility's leader and the hub: gRPC methods on raw bytes, no protobuf
and nothing pickled.

Every method of the service ``xffl.hub.Hub`` carries bytes. A control message is one UTF-8 JSON
object of at most :data:`MAX_JSON` bytes (:func:`pack` / :func:`unpack`, which refuses anything
else), whose keys and values :mod:`.messages` checks. Tensors travel as a stream of frames: a JSON header
frame, then raw little-endian chunks of at most :data:`CHUNK_BYTES` each; the receiver checks every chunk's
size against what the header announced before it touches any state (:class:`Frames`).

Methods (the facility is the client; its name is its certificate's common name):

- ``Join`` (unary): the federation's description and this facility's geometry -> membership;
- ``Beat`` (unary): a heartbeat of the member's session;
- ``Arrive`` (unary): at a round boundary -> ``upload`` or ``heal``;
- ``Upload`` (stream -> unary): the member's parameters (or compressed update);
- ``Result`` (unary -> stream): waits for the round's commit, then θ_global;
- ``Fetch`` (unary -> stream): θ_global now (a joiner);
- ``Leave`` (unary).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "CHUNK_BYTES",
    "GRPC_OPTIONS",
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "MAX_JSON",
    "METHODS",
    "MIN_RATE",
    "RATE_GRACE_S",
    "SERVICE",
    "Frames",
    "WireError",
    "frames_of",
    "frames_of_file",
    "pack",
    "paced",
    "transfer_s",
    "unpack",
]

SERVICE = "xffl.hub.Hub"
METHODS = ("Join", "Beat", "Arrive", "Upload", "Result", "Fetch", "Leave")
#: Raw bytes per tensor frame (tens of MB: few frames, bounded buffers on both sides).
CHUNK_BYTES = 16 << 20
#: The largest control message.
MAX_JSON = 1 << 20
#: The deepest nesting of arrays and objects in a control message (checked before it is parsed).
MAX_DEPTH = 16
#: The most digits of an integer in a control message (2^63 has 19).
MAX_INT_DIGITS = 19
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"')
_MAX_MESSAGE = CHUNK_BYTES + (1 << 20)
#: The slowest transfer of tensor frames either end waits for (bytes per second), once :data:`RATE_GRACE_S`
#: have passed: a stream that trickles is cut (an upload by the hub, a download by either end's deadline).
MIN_RATE = 1 << 20
RATE_GRACE_S = 10.0

#: Channel and server options shared by both ends: frames up to CHUNK_BYTES; keepalive pings so a
#: NAT or proxy on the way never drops a connection idle in a long round.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    # a hub back after an outage is dialled again within a second (gRPC's own backoff grows to 120 s)
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class WireError(ValueError):
    """A message that is not what the protocol allows (one line)."""


def pack(obj: dict[str, Any]) -> bytes:
    """A control message (JSON; non-finite numbers are refused)."""
    data = json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()
    if len(data) > MAX_JSON:
        raise WireError(f"control message of {len(data)} bytes (at most {MAX_JSON})")
    return data


def _no_constants(name: str):
    raise WireError(f"non-finite number {name} in a control message")


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise WireError(f"an integer of {len(text.lstrip('-'))} digits in a control message (at most {MAX_INT_DIGITS})")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not np.isfinite(value):
        raise WireError(f"number {text[:40]} is out of range of a float")
    return value


def depth(data: bytes) -> int:
    """How deep ``data``'s arrays and objects nest (outside strings), counted without parsing it."""
    rest = np.frombuffer(_STRING.sub(b"", data), dtype=np.uint8)
    if not rest.size:
        return 0
    step = (rest == 91).astype(np.int32) + (rest == 123) - (rest == 93) - (rest == 125)  # [ { ] }
    return int(np.cumsum(step).max(initial=0))


def unpack(data: bytes) -> dict[str, Any]:
    """A control message: one JSON object within :data:`MAX_JSON` bytes, nested at most :data:`MAX_DEPTH` deep
    (both checked before it is parsed), integers of at most :data:`MAX_INT_DIGITS` digits, numbers finite
    (its keys and values: :meth:`.messages.Message.decode`)."""
    if not isinstance(data, bytes) or len(data) > MAX_JSON:
        raise WireError(f"control message too large or not bytes (at most {MAX_JSON} bytes)")
    if depth(data) > MAX_DEPTH:
        raise WireError(f"control message nested deeper than {MAX_DEPTH}")
    try:
        obj = json.loads(data.decode("utf-8"), parse_constant=_no_constants, parse_int=_int, parse_float=_float)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        if isinstance(exc, WireError):
            raise
        raise WireError(f"control message is not JSON ({str(exc)[:120]})") from None
    if not isinstance(obj, dict):
        raise WireError("control message is not a JSON object")
    return obj


def transfer_s(nbytes: int, slack: float) -> float:
    """The longest a transfer of ``nbytes`` may take: ``slack`` seconds plus its bytes at :data:`MIN_RATE`."""
    return max(float(slack), 0.0) + RATE_GRACE_S + nbytes / MIN_RATE


def paced(frames: Iterator[bytes], deadline: float, what: str) -> Iterator[bytes]:
    """``frames`` as they arrive, cut with a :class:`WireError` once ``time.monotonic()`` passes ``deadline``, or
    when, after :data:`RATE_GRACE_S`, they come slower than :data:`MIN_RATE` (``what``: named in the error)."""
    start, seen = time.monotonic(), 0
    for frame in frames:
        now = time.monotonic()
        seen += len(frame) if isinstance(frame, bytes) else 0
        if now > deadline:
            raise WireError(f"{what} not over by its deadline (federation.elastic.grace_s)")
        if seen < MIN_RATE * (now - start - RATE_GRACE_S):
            raise WireError(f"{what} slower than {MIN_RATE} bytes/s ({seen} bytes in {now - start:.0f} s)")
        yield frame


def frames_of(header: dict[str, Any], flat: Tensor | None) -> Iterator[bytes]:
    """``header`` (a JSON object; ``nbytes`` is set here) then ``flat``'s bytes in frames of :data:`CHUNK_BYTES`."""
    raw = _as_bytes(flat)
    yield pack({**header, "nbytes": 0 if raw is None else raw.numel()})
    if raw is None:
        return
    for start in range(0, raw.numel(), CHUNK_BYTES):
        yield raw[start : start + CHUNK_BYTES].numpy().tobytes()


def frames_of_file(header: dict[str, Any], path) -> Iterator[bytes]:
    """``header`` (a JSON object; ``nbytes`` is set here) then the bytes of the file ``path``, read a frame at a time (a
    contribution spooled to disk is never loaded whole)."""
    with open(path, "rb") as fh:
        fh.seek(0, 2)
        yield pack({**header, "nbytes": fh.tell()})
        fh.seek(0)
        while chunk := fh.read(CHUNK_BYTES):
            yield chunk


def _as_bytes(flat: Tensor | None) -> Tensor | None:
    if flat is None:
        return None
    return flat.detach().contiguous().view(-1).view(torch.uint8)


class Frames:
    """Receives the frames of one tensor: the header, then exactly ``nbytes`` of chunks.

    ``message``: the header's message class (:mod:`.messages`: its ``decode`` checks it; it has ``nbytes``);
    ``expect``: the bytes the receiver allows (a number, or a function of the header); a header that
    announces another size, a chunk over :data:`CHUNK_BYTES`, or more or fewer bytes than announced
    is a :class:`WireError`. Chunks are handed on as they arrive (:meth:`chunks`), never joined."""

    def __init__(self, frames: Iterator[bytes], expect, message):
        self.frames = iter(frames)
        try:
            first = next(self.frames)
        except StopIteration:
            raise WireError("empty stream (no header)") from None
        self.header = message.decode(first)
        self.nbytes = self.header.nbytes
        allowed = expect(self.header) if callable(expect) else expect
        if self.nbytes != allowed:
            raise WireError(f"{self.nbytes} bytes announced, expected {allowed}")

    def chunks(self) -> Iterator[tuple[int, bytes]]:
        """(offset in bytes, chunk) in order; raises :class:`WireError` on any size mismatch."""
        seen = 0
        for frame in self.frames:
            if not isinstance(frame, bytes) or not frame or len(frame) > CHUNK_BYTES:
                raise WireError(f"a frame of {len(frame) if isinstance(frame, bytes) else '?'} bytes")
            if seen + len(frame) > self.nbytes:
                raise WireError(f"more than the {self.nbytes} bytes announced")
            yield seen, frame
            seen += len(frame)
        if seen != self.nbytes:
            raise WireError(f"{seen} bytes received of the {self.nbytes} announced")

    def to_file(self, path) -> None:
        """All chunks written to the file ``path`` in order (created or truncated)."""
        with open(path, "wb") as fh:
            for _, chunk in self.chunks():
                fh.write(chunk)

    def into(self, out: Tensor) -> Tensor:
        """All chunks copied into ``out`` (its bytes must be ``nbytes``)."""
        raw = out.view(-1).view(torch.uint8).numpy()
        for offset, chunk in self.chunks():
            raw[offset : offset + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)  # no copy of the frame
        return out
