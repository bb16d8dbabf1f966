"""The hub's messages: one frozen dataclass per JSON object that crosses, checked in one place.

Each message is decoded by :meth:`Message.decode` (bytes) or :meth:`Message.from_json` (a dict): every key of
the dataclass present unless it has a default, no other key, each value of its field's type (``int`` excludes
``bool``, a ``float`` field takes an integer too and must be finite) and within its field's bounds
(``field(metadata={"range": (lo, hi)})``), a string at most :data:`TEXT` characters (``"length"``). The bytes
were bounded before parsing (:func:`.wire.unpack`: size, depth, digits of an integer), and a ``Join``'s
federation description is checked whole (:func:`.spec.check_spec`) when the message is made, so nothing a
handler reads has skipped a check. Anything else is one :class:`MessageError` naming the message,
the key and what it takes. :meth:`Message.to_json` leaves out optional fields that are None (the bytes the
earlier dict messages had). Requests carry ``facility`` only to a hub served ``--insecure`` (the name is
taken on trust there; with mutual TLS it is the client certificate's common name).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from .spec import check_spec
from .wire import WireError, pack, unpack

__all__ = [
    "CALLS",
    "ArriveReply",
    "ArriveRequest",
    "Geometry",
    "HubView",
    "JoinReply",
    "JoinRequest",
    "Message",
    "MessageError",
    "Ok",
    "Relay",
    "ResultHeader",
    "ResultRequest",
    "SessionRequest",
    "UploadHeader",
    "UploadReply",
]

#: Counts (steps, versions, rounds, bytes) are at most this.
COUNT = 1 << 62
#: The longest string field (a session, a facility's name: ``_bounds``'s ``length`` for others).
TEXT = 256


def _bounds(lo, hi) -> dict:
    return {"range": (lo, hi)}


def _text(n: int) -> dict:
    return {"length": n}


class MessageError(WireError):
    """A message whose keys or values are not what the protocol allows (one line)."""


def _name(kind: Any) -> str:
    return getattr(kind, "__name__", None) or str(kind).replace("typing.", "")


def _check(where: str, kind: Any, value: Any) -> Any:
    """``value`` as ``kind`` (a type hint), or :class:`MessageError`."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check(where, inner[0], value) if len(inner) == 1 else _fail(where, kind, value)
    if origin is Literal:
        return value if value in args and type(value) in {type(a) for a in args} else _fail(where, kind, value)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            _fail(where, kind, value)
        return {k: _check(f"{where}[{k!r}]", args[1], v) for k, v in value.items()}
    if origin is tuple:
        if not isinstance(value, list):
            _fail(where, kind, value)
        return tuple(_check(f"{where}[{i}]", args[0], v) for i, v in enumerate(value))
    if isinstance(kind, type) and issubclass(kind, Message):
        return kind.from_json(value) if isinstance(value, dict) else _fail(where, kind, value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value) if abs(value) <= 1 << 64 else _fail(where, kind, value)
    if kind is bool and isinstance(value, bool):
        return value
    if not isinstance(value, kind) or isinstance(value, bool):
        _fail(where, kind, value)
    if isinstance(value, float) and not math.isfinite(value):
        _fail(where, kind, value)
    return value


def _fail(where: str, kind: Any, value: Any):
    shown = repr(value) if len(repr(value)) <= 80 else f"{repr(value)[:77]}..."
    raise MessageError(f"{where}={shown} is not a {_name(kind)}")


@dataclass(frozen=True)
class Message:
    """A control message: ``from_json`` / ``decode`` check it, ``to_json`` / ``encode`` write it."""

    _hints: ClassVar[dict[str, dict[str, Any]]] = {}

    @classmethod
    def _types(cls) -> dict[str, Any]:
        if cls.__name__ not in Message._hints:
            Message._hints[cls.__name__] = typing.get_type_hints(cls)
        return Message._hints[cls.__name__]

    @classmethod
    def from_json(cls, obj: Any):
        """The message ``obj`` (a JSON object) carries, checked; :class:`MessageError` otherwise."""
        if not isinstance(obj, dict):
            raise MessageError(f"{cls.__name__} is not a JSON object")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(obj) - set(fields))
        if unknown:
            raise MessageError(f"{cls.__name__}: unknown key {unknown[0]!r} (it takes {', '.join(fields)})")
        values, hints = {}, cls._types()
        for name, f in fields.items():
            if name not in obj:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise MessageError(f"{cls.__name__}: key {name!r} missing")
                continue
            value = values[name] = _check(f"{cls.__name__}.{name}", hints[name], obj[name])
            lo, hi = f.metadata.get("range", (None, None))
            if value is not None and lo is not None and not lo <= value <= hi:
                raise MessageError(f"{cls.__name__}.{name}={value!r} is out of range [{lo}, {hi}]")
            if isinstance(value, str) and len(value) > f.metadata.get("length", TEXT):
                raise MessageError(f"{cls.__name__}.{name} is a string of {len(value)} characters (at most "
                                   f"{f.metadata.get('length', TEXT)})")  # fmt: skip
        return cls(**values)

    @classmethod
    def decode(cls, data: bytes):
        """The message of the bytes ``data`` (:func:`.wire.unpack`, then :meth:`from_json`)."""
        return cls.from_json(unpack(data))

    def to_json(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            if isinstance(value, Message):
                value = value.to_json()
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def encode(self) -> bytes:
        return pack(self.to_json())


# ---------------------------------------------------------------------------------------------- facility -> hub
@dataclass(frozen=True)
class Geometry(Message):
    """A facility's batch geometry: what bounds its claims of tokens."""

    batch_size: int = field(metadata=_bounds(1, 1 << 20))
    seq_len: int = field(metadata=_bounds(1, 1 << 24))
    dp: int = field(metadata=_bounds(1, 1 << 20))


@dataclass(frozen=True)
class SessionRequest(Message):
    """``Beat``, ``Fetch``, ``Leave``: who is asking (its session: one process of the facility)."""

    session: str
    facility: str | None = None


@dataclass(frozen=True)
class JoinRequest(Message):
    """``Join``: the federation's description (:mod:`.spec`), this facility's geometry and job; ``probe``:
    only check (its launcher, before workers start). ``pending_step`` and ``pending_version``: a facility resumed
    from a checkpoint with a round still to be exchanged (``federation.delay=1``) names that round, by the step it
    ended at and the version its upload is taken against; the answer says whether the hub counted it."""

    session: str
    spec: dict
    geometry: Geometry
    steps: int = field(metadata=_bounds(0, COUNT))
    every: int | None = field(default=None, metadata=_bounds(1, COUNT))
    probe: bool | None = None
    facility: str | None = None
    pending_step: int | None = field(default=None, metadata=_bounds(1, COUNT))
    pending_version: int | None = field(default=None, metadata=_bounds(0, COUNT))

    def __post_init__(self):
        check_spec(self.spec)  # the whole description, before any handler reads it


@dataclass(frozen=True)
class ArriveRequest(Message):
    """``Arrive``: a member at its boundary, with its claims (steps taken since its last round, tokens)."""

    session: str
    version: int = field(metadata=_bounds(0, COUNT))
    step: int = field(metadata=_bounds(0, COUNT))
    taken: int = field(metadata=_bounds(0, COUNT))
    tokens: float = field(metadata=_bounds(0.0, math.inf))
    facility: str | None = None


@dataclass(frozen=True)
class UploadHeader(Message):
    """``Upload``'s first frame: ``create`` (the first facility's parameters) or ``round`` (a contribution to
    round ``round``), then ``nbytes`` of raw frames."""

    session: str
    kind: Literal["create", "round"]
    round: int | None = field(default=None, metadata=_bounds(0, COUNT))
    nbytes: int = field(default=0, metadata=_bounds(0, COUNT))
    facility: str | None = None


@dataclass(frozen=True)
class ResultRequest(Message):
    """``Result``: θ_global once round ``round`` is decided (None: now, a heal outside a round)."""

    session: str
    round: int | None = field(default=None, metadata=_bounds(0, COUNT))
    facility: str | None = None


# ---------------------------------------------------------------------------------------------- hub -> facility
@dataclass(frozen=True)
class HubView(Message):
    """The federation as the hub sees it now (``Beat``'s answer; ``Upload``'s to a ``create``)."""

    version: int = field(metadata=_bounds(0, COUNT))
    progress: int = field(metadata=_bounds(0, COUNT))
    ended: bool
    live: tuple[str, ...]
    federation: str | None = None  # its id: a hub started --fresh holds another


@dataclass(frozen=True)
class JoinReply(Message):
    """``Join``'s answer: ``create`` (upload the parameters), ``member``, ``ok`` (a probe), ``retry`` (another
    facility is creating the federation, or the round a resumed facility names is being decided), with the hub's
    view. To a join that names a pending round (``JoinRequest.pending_step``): ``pending``, ``counted`` (a committed
    round accepted that upload; ``share``: its weight there, over the round's total), ``open`` (the round at that
    step, on that version, is the hub's next: upload it) or ``missed`` (it closed without it, or the hub moved on)."""

    status: Literal["create", "member", "ok", "retry"]
    version: int = field(metadata=_bounds(0, COUNT))
    progress: int = field(metadata=_bounds(0, COUNT))
    ended: bool
    live: tuple[str, ...]
    federation: str | None = None  # its id: a hub started --fresh holds another
    pending: Literal["counted", "open", "missed"] | None = None
    share: float | None = field(default=None, metadata=_bounds(0.0, 1.0))


@dataclass(frozen=True)
class ArriveReply(Message):
    """``Arrive``'s answer: ``upload`` (the contribution is wanted in round ``round``) or ``heal`` (why)."""

    action: Literal["upload", "heal"]
    round: int | None = field(metadata=_bounds(0, COUNT))
    reason: str | None = field(metadata=_text(4096))


@dataclass(frozen=True)
class UploadReply(Message):
    """``Upload``'s answer to a ``round`` upload: spooled, or why not."""

    ok: bool
    reason: str | None = field(metadata=_text(4096))


@dataclass(frozen=True)
class Ok(Message):
    """``Leave``'s answer."""

    ok: bool = True


@dataclass(frozen=True)
class Relay(Message):
    """A compressed round's result as its messages (:mod:`.relay`): the version they apply to (``base``), the
    accepted facilities in the hub's fold order, each one's weight as the hub used it, the bytes of its message
    that follow (0 for the receiver's own), and the outer optimizer's steps after the round."""

    base: int = field(metadata=_bounds(0, COUNT))
    order: tuple[str, ...]
    weights: tuple[float, ...]
    sizes: tuple[int, ...]
    outer_steps: int = field(metadata=_bounds(0, COUNT))


@dataclass(frozen=True)
class ResultHeader(Message):
    """The first frame of θ_global (``Result``, ``Fetch``): this member's status in the round (``accepted``,
    ``rejected``, ``healed``, or ``missed``: the round could not be committed, nothing changed) and why, the
    round's outcome when one was decided, the hub's view (``federation``: its id), then ``nbytes`` of θ_global
    (with compression: θ_global and the outer optimizer's buffers, after ``outer_steps`` steps), or of the
    ``relay``'s messages."""

    status: Literal["accepted", "rejected", "healed", "missed"]
    reason: str | None = field(metadata=_text(4096))
    version: int = field(metadata=_bounds(0, COUNT))
    progress: int = field(metadata=_bounds(0, COUNT))
    ended: bool
    live: tuple[str, ...]
    federation: str | None = None  # its id: a hub started --fresh holds another
    committed: bool | None = None
    accepted: dict[str, float] | None = None
    rejected: dict[str, str] | None = None
    nbytes: int = field(default=0, metadata=_bounds(0, COUNT))
    relay: Relay | None = None  # with compression, to an accepted member: the other members' messages follow
    outer_steps: int | None = field(default=None, metadata=_bounds(0, COUNT))  # compressed, in full: θ, buffers


#: Each method of :data:`.wire.METHODS`: its request's message, its answer's (``Upload``: the header of its
#: frames; its answer is a :class:`HubView` to a ``create``, an :class:`UploadReply` to a ``round``;
#: ``Result`` and ``Fetch``: the header of θ_global's frames).
CALLS: dict[str, tuple[type[Message], type[Message]]] = {
    "Join": (JoinRequest, JoinReply),
    "Beat": (SessionRequest, HubView),
    "Arrive": (ArriveRequest, ArriveReply),
    "Upload": (UploadHeader, UploadReply),
    "Result": (ResultRequest, ResultHeader),
    "Fetch": (SessionRequest, ResultHeader),
    "Leave": (SessionRequest, Ok),
}
