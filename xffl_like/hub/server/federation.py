"""The federation the hub holds: its members, its rounds, θ_global and the outer step, orchestrated.

``grants``: what the operator lets each facility claim (``grants.json``, :func:`.checks.granted`).

A round opens when the first member arrives at its boundary with the hub's version, and closes
when every live member has arrived and every upload has ended, or ``grace_s`` after it opened, whichever
comes first: ``grace_s`` bounds the whole round, uploads included (an upload not over by then is cut and
counts as none; one slower than :data:`..protocol.wire.MIN_RATE` is cut before). :mod:`.rounds`: its states
and their transitions. A facility creating the federation has ``grace_s`` to upload its parameters, or
loses the role to the next facility that joins. Then, in the hub's committer thread:

1. each uploaded contribution is checked (:func:`.checks.judge`): finite, its update norm
   ``|θ_global - θ_f|`` at most ``max_norm_ratio`` times a reference no member sets alone (the other
   members' norms this round, the federation's recent accepted ones, a floor) and at most
   ``max_norm_ratio x max(|θ_global|, 1)``; claims (steps taken, tokens) were checked on arrival against
   the facility's geometry (:func:`.checks.claims`);
2. the next version is computed and saved window by window (:meth:`HubFederation._apply`, :mod:`.fold`): the
   saved version's θ_global and outer state are read a window at a time from its file, with each accepted
   upload's window from the file it was spooled to (:mod:`.spool`); the window is combined by the
   federation's ``aggregate`` rule (the weighted mean, uniform or tokens weights, in name order; or the
   coordinate-wise median or trimmed mean, :mod:`.aggregate`), θ_global's window becomes the mean, or
   moves by the outer optimizer's step on ``θ_global - mean`` (the round's one step number), and goes
   straight into the next version's file. The hub holds neither θ_global nor the outer state nor an
   accumulator in memory: one window per upload and per saved tensor, whatever the model's size. With fp32
   uploads this runs ahead (:mod:`.ahead`): once every live member has arrived, each window is folded into the
   next version's file as soon as every upload has spooled it, so that at the close only the last frames'
   windows, the header and the fsync remain; used only if the round decides what it assumed, else removed
   unfinished and the round computed as above (bitwise the same version either way);
3. the next version (θ_global, the outer state, the version, the members' history) becomes the hub's only
   once its file is whole and durable (:mod:`.store`: fsync, rename): a round is applied once, whatever dies
   when. A save that fails (a full disk), or that the disk has no room for (checked before anything is
   written), changes nothing anyone sees: the hub keeps the saved version, the log says so in one line,
   and the round's members hear that it was ``missed``. A compressed round commits sooner, by a small durable
   record of what it decided (:mod:`.journal`: the accepted messages, their weights in fold order, the next
   version's description): its members hear at once, and the hub writes the version's file behind the record
   (:meth:`HubFederation._write_behind`, before any other round is judged; a hub killed meanwhile writes it from
   the record when it starts again). The file is begun, its room checked and reserved, before the record, so a
   disk without room refuses the round before it commits; a write that fails later is tried again every
   :data:`RETRY_S` while the record stays.

Members read θ_global (Result, Fetch) from the saved file of the version they are told (:meth:`.store.
StateStore.theta_reader`): a reader, however slow, never holds a commit, and a commit never changes what a
reader is sending. Every spool file of a round is removed when it is decided.

With compression the round is applied by :func:`..protocol.relay.apply_round`, the function every facility calls
too, and the downlink is relayed (:mod:`.relayed`): a member accepted in the round reads, once its record is durable
(the version's file may still be being written), a header (the new version, the accepted members in fold order,
their weights, the outer step count, the message sizes) and the other accepted members' messages, and applies the
round itself, so it downloads (F-1) messages instead of θ_global. This is SparseLoCo's (Templar's) exchange, and it
keeps one algorithm here and in one world: no second compression error, no residual at the hub. It reveals to each
accepted member every other accepted member's sparse update (indices and quantized values) and weight, which the
mean alone would hide. Everyone else (rejected, healed, joining, behind a newer commit) reads θ_global with the
outer optimizer's buffers and step count, once the version's file is written. One round of a compressed federation
carries fp32 parameters instead of messages (:attr:`.rounds.Round.fp32`, :func:`..protocol.spec.final_in_fp32`): the
final round of ``federation.delay=1`` with ``delay_rule=eager``, whose uploads are each facility's end; it is folded
as an fp32 round, relays nothing, and its members read θ_global in full. The hub knows it by its own round count, so
an upload of the other size is refused before a byte is spooled.

Members that arrive with another version, whose claims fail, or that come after the round
closed, heal: they receive θ_global (after the open round, if any) and contribute nothing. So do members
at another step than the federation's (a fixed ``every``: round ``k`` takes each member's step ``k x every``
only, :func:`.checks.misaligned`), which then realign their step counter to the version they receive, as a
joiner does. A round with no accepted contribution commits nothing. The federation ends once: with its round
``rounds`` (or, with ``every_s``, the first in which a member reached ``train.steps``); after it every arrival
heals at once to the final version. Members and their liveness: :mod:`.membership`. A member resumed from a checkpoint
with a round still to go up (``federation.delay=1``) names it when it joins, and hears whether that round counted its
upload (:meth:`HubFederation._pending`: from the open round, and each member's durable record of the last round that
accepted it).
The creator's parameters are spooled to a file too, and version 0 written from it a window at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ...config.schema import OuterConfig
from ...federation.outer import OuterOptimizer, validate_outer
from ..protocol import relay
from ..protocol.messages import (
    ArriveReply,
    ArriveRequest,
    HubView,
    JoinReply,
    JoinRequest,
    ResultHeader,
    ResultRequest,
    SessionRequest,
    UploadReply,
)
from ..protocol.spec import check_spec, codec_of, final_in_fp32, first_difference, numel_of
from ..protocol.update_codec import UpdateCodec
from ..protocol.wire import CHUNK_BYTES, Frames, WireError, paced, pack, transfer_s
from . import checks, journal, relayed, store
from .ahead import Ahead
from .errors import HubError
from .fold import Plan, next_window, window
from .latency import ResultLatency
from .membership import LIVE_S, Membership
from .rounds import Arrival, Outcome, Part, Round, RoundState
from .spool import Spool

__all__ = ["LIVE_S", "RETRY_S", "HubError", "HubFederation"]

RETRY_S = 5.0  # a version whose file could not be written behind its record is tried again after this


@dataclass
class _Behind:
    """A version committed by its record (:mod:`.journal`) whose file is still to be written: from ``saved`` (the
    version it applies to), into ``pending`` (begun before the record, its room reserved) or a new file."""

    record: journal.Record
    saved: store.Snapshot
    pending: store.Pending | None
    retry_at: float = 0.0


def _outer_config(spec: dict) -> OuterConfig:
    """The outer optimizer of the federation's description, checked (it came from the network)."""
    o = spec.get("outer")
    if not isinstance(o, dict):
        raise HubError("the federation's description has no outer optimizer", "INVALID_ARGUMENT")
    try:
        cfg = OuterConfig(**{k: o[k] for k in ("name", "lr", "momentum", "betas", "eps", "offload")})
        validate_outer(cfg)
    except (KeyError, TypeError, ValueError) as exc:
        raise HubError(f"the federation's outer optimizer is invalid ({exc})", "INVALID_ARGUMENT") from None
    return cfg


class HubFederation:
    """One federation's state and rounds; thread-safe (gRPC handlers call in from a pool). ``state``: where it
    is kept (:class:`.store.StateStore`; default: safetensors files in ``state_dir``)."""

    def __init__(self, state_dir: Path, snap: store.Snapshot | None, log=print, state: store.StateStore | None = None,
                 grants=None):  # fmt: skip
        self.log, self.store = log, state or store.SafetensorsStore(state_dir, log)
        self.grants = grants or (lambda name: None)  # the operator's grant of a facility (grants.json), or None
        self.cv = threading.Condition()
        self.members = Membership(snap.members if snap else None)
        self.round: Round | None = None
        self.decided: dict[int, Round] = {}
        self.next_rid = 0
        self.creator: str | None = None
        self.create_by = 0.0  # the creator's parameters are due by then (grace_s after it was told to create)
        self.create_cut = None  # ends the creator's upload call
        self.dropped: set[str] = set()  # facilities that lost the creator's role (they create last)
        self.asked: dict[str, float] = {}  # when each facility last asked to join a federation not created yet
        self.pending_spec: dict | None = None  # the creator's description until its parameters arrive
        self.spool = Spool(state_dir / "spool")
        self.latency = ResultLatency(log)  # each round's last upload to its result's first byte, logged
        self.snap = snap
        self.spec: dict | None = snap.spec if snap else None
        self.options: OuterConfig | None = None  # the federation's outer optimizer
        self.theta_norm = 0.0  # |θ_global| of the saved version (the checks' scale)
        self.codec: UpdateCodec | None = None
        self.relayed: relayed.Relayed | None = None  # the last compressed round's messages, for its members
        self.ahead: Ahead | None = None  # the open round's next version, folded as its uploads stream in
        self.not_ahead: tuple | None = None  # a round's plan whose file could not be begun (not tried again)
        self.journal = state_dir / store.JOURNAL  # compressed rounds' records (:mod:`.journal`)
        self.behind: _Behind | None = None  # the latest version, committed by its record, its file being written
        self._stop = threading.Event()
        if snap is not None:
            self._restore(snap)
        self._replay()
        self._thread = threading.Thread(target=self._commit_loop, name="xffl-hub-commit", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ state
    def _restore(self, snap: store.Snapshot) -> None:
        self.codec = codec_of(snap.spec)
        self.options = _outer_config(snap.spec)
        self.theta_norm = math.sqrt(checks.squares(snap.theta.numpy(), None, 0))

    def _replay(self) -> None:
        """Versions committed by their record whose file was not written (a hub killed in between, :mod:`.journal`):
        written now, in order, bitwise as they would have been; a record of a version already saved is removed."""
        for rec in journal.read(self.journal, self.codec.nbytes if self.codec is not None else 0):
            if self.snap is not None and rec.version <= self.snap.version:
                rec.remove()
                continue
            if self.snap is None or rec.base != self.snap.version or rec.snap.federation != self.snap.federation:
                held = "no saved version" if self.snap is None else f"version {self.snap.version}" + (
                    "" if rec.snap.federation == self.snap.federation else " of another federation")  # fmt: skip
                raise store.StateError(
                    f"{rec.path} commits version {rec.version} over version {rec.base}, but --state holds {held}: "
                    f"put version {rec.base}'s file back, or remove the record (members that applied it heal), or "
                    f"start with --fresh"
                )
            self.behind = _Behind(rec, self.snap, None)
            self._write_behind()
            if self.behind is not None:
                raise store.StateError(f"cannot write version {rec.version} from its record {rec.path}: free space on "
                                       f"--state's disk, then start the hub again")  # fmt: skip
            self.log(f"hub: version {rec.version} (round {rec.rid}) was committed by its record: its file is written")
        journal.clear(self.journal)

    @property
    def head(self) -> store.Snapshot | None:
        """The latest committed version's description: the saved one, or one committed by its record whose file is
        still being written (:meth:`_write_behind`; its θ_global is then ``None``)."""
        return self.behind.record.snap if self.behind is not None else self.snap

    def saved(self) -> store.Snapshot | None:
        """The latest version, its tensors mapped from its file (pages the kernel reads and drops; never written):
        waits while that file is being written behind its record."""
        with self.cv:
            while self.behind is not None and not self._stop.is_set():
                self.cv.wait(timeout=0.5)
            return self.snap

    @property
    def theta(self) -> Tensor | None:
        """θ_global of the latest version (:meth:`saved`)."""
        snap = self.saved()
        return snap.theta if snap else None

    @property
    def version(self) -> int:
        return self.head.version if self.head else 0

    def expected_bytes(self, header) -> int:
        """The bytes an upload with ``header`` must have: parameters (fp32), or the codec's message (that of the
        round it names: :meth:`codec_of`)."""
        if header.kind == "create":
            if self.pending_spec is None:
                raise HubError("no federation is being created: join again", "FAILED_PRECONDITION")
            return 4 * numel_of(self.pending_spec)
        if self.snap is None:
            raise HubError("the federation has not been created yet: join again", "FAILED_PRECONDITION")
        r = self.round
        codec = self.codec_of(r) if r is not None and r.rid == header.round else self.codec
        return codec.nbytes if codec is not None else 4 * numel_of(self.spec)

    def codec_of(self, r: Round) -> UpdateCodec | None:
        """The codec of round ``r``'s uploads: the federation's, or None (fp32 parameters) without compression and in
        a final round that carries fp32 parameters (:func:`..protocol.spec.final_in_fp32`: ``delay_rule=eager``)."""
        return None if r.fp32 else self.codec

    def _view(self) -> HubView:
        s = self.head
        view = self.members.view(self.version, s.progress if s else 0, bool(s and s.ended))
        return dataclasses.replace(view, federation=s.federation if s else None)

    def _saved(self, what: str, save) -> str | None:
        """``save()`` (a version saved: :meth:`.store.StateStore.save`, :meth:`.ahead.Ahead.finish`); None, or why it
        could not be saved (one line, logged; nothing kept changed)."""
        try:
            save()
            return None
        except store.NoRoom as exc:
            why = f"refused {what}: {exc}"
        except OSError as exc:
            where = f" ({exc.filename})" if exc.filename else ""
            why = f"cannot save {what}: {exc.strerror or exc}{where}; free space on --state's disk"
        except Exception as exc:  # noqa: BLE001 - any failure to save keeps the previous version
            why = f"cannot save {what}: {type(exc).__name__}: {exc}"
        self.log(f"hub: {why}; the hub keeps version {self.version}")
        return why

    def close(self) -> None:
        self._stop.set()
        with self.cv:
            self.cv.notify_all()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._drop_ahead()
            if self.behind is not None:  # else its record is replayed when the hub starts again
                self.behind.retry_at = 0.0
                self._write_behind()

    # ------------------------------------------------------------------ membership
    def join(self, name: str, msg: JoinRequest) -> JoinReply:
        """A facility asks in (``probe``: only check, as its launcher does before workers start)."""
        with self.cv:
            self.members.refuse_twin(name, msg.session)
            if self.spec is not None:
                difference = first_difference(msg.spec, self.spec)
                if difference is not None:
                    raise HubError(
                        f"facility {name} does not match the federation: {difference}; run it with the "
                        f"federation's settings (or serve a new federation with another --state)",
                        "FAILED_PRECONDITION",
                    )
            elif self._another_creates(name):
                return JoinReply("retry", **vars(self._view()))  # another facility is creating it
            checks.granted(name, msg, self.spec or msg.spec, self.grants(name))
            if msg.probe:  # ended: the launcher refuses before its workers start
                return JoinReply("ok", **vars(self._view()))
            if self.spec is None:
                numel_of(msg.spec), _outer_config(msg.spec), check_spec(msg.spec)
                if self.creator != name:  # its deadline is not moved by joining again
                    self.create_by = time.monotonic() + float(msg.spec["grace_s"])
                self.creator, self.pending_spec = name, msg.spec
            self.members.admit(name, msg.session, msg.geometry, msg.every, msg.steps)
            self.cv.notify_all()
            if self.spec is None or msg.pending_step is None:
                return JoinReply("create" if self.spec is None else "member", **vars(self._view()))
            pending, share = self._pending(name, msg.pending_step, msg.pending_version)
            status = "retry" if pending is None else "member"
            return JoinReply(status, **vars(self._view()), pending=pending, share=share)

    def _pending(self, name: str, step: int, version: int | None) -> tuple[str | None, float | None]:
        """Whether the upload a resumed member holds, of its round at ``step`` taken against ``version``, counted
        (the caller holds the lock): ``counted`` (a committed round at that step accepted it; its share), ``open``
        (the round at that step on that version is the hub's next: it may upload), ``missed``, or None while the
        open round holds an upload of its earlier process (that round's decision is the answer: ask again)."""
        m, r = self.members[name], self.round
        a = r.arrivals.get(name) if r is not None else None
        if a is not None:
            if r.state is not RoundState.OPEN or a.part in (Part.UPLOADING, Part.UPLOADED):
                return None, None
            del r.arrivals[name]  # its earlier process arrived and sent nothing that counts: it may arrive again
        if m.counted == step:
            return "counted", m.share
        aligned = checks.misaligned(m, step, self.head.progress, self.spec) is None
        if version == self.version and not self.head.ended and aligned:
            return "open", None
        return "missed", None

    def _another_creates(self, name: str) -> bool:
        """Whether ``name`` must wait while another facility creates the federation: the creator is live and
        within its deadline, or ``name`` lost the role before and another facility asks too."""
        now = time.monotonic()
        self.asked[name] = now
        if self.creator not in (None, name):
            if self.members[self.creator].live(now) and now < self.create_by:
                return True
            self._drop_creator("stopped beating" if now < self.create_by else "did not upload in time")
        others = any(n != name and now - t < LIVE_S for n, t in self.asked.items())
        return self.creator is None and name in self.dropped and others

    def _drop_creator(self, why: str) -> None:
        """The creator loses its role (the caller holds the lock): the next facility that joins creates."""
        name, cut = self.creator, self.create_cut
        self.creator, self.pending_spec, self.create_cut = None, None, None
        self.dropped.add(name)
        self.log(f"hub: facility {name} {why} (its parameters were due within grace_s): it is not creating the "
                 f"federation any more; the next facility that joins creates it")  # fmt: skip
        if cut is not None:
            cut()
        self.cv.notify_all()

    def beat(self, name: str, msg: SessionRequest) -> HubView:
        with self.cv:
            self.members.beat(name, msg.session)
            self.cv.notify_all()
            return self._view()

    def leave(self, name: str, msg: SessionRequest) -> None:
        with self.cv:
            if self.members.leave(name, msg.session):
                self.cv.notify_all()

    def create(self, name: str, frames: Frames, cut=None) -> HubView:
        """The first facility's parameters become θ_global (version 0), if they arrive by its deadline."""
        with self.cv:
            self.members.member(name, frames.header.session)
            if self.creator != name or self.spec is not None:
                raise HubError(f"facility {name} is not creating this federation: join again", "FAILED_PRECONDITION")
            spec, self.create_cut = self.pending_spec, cut
            frames.frames = paced(frames.frames, self.create_by, f"facility {name}'s parameters")
        path = self.spool.dir / f"create-{name}.bin"  # received to a file: never held whole
        try:
            self.spool.receive(frames, path)
            norm = self.spool.norm(path)  # after the upload: never slows its frames down
            if not math.isfinite(norm):
                with self.cv:
                    self.creator = None
                raise HubError("the parameters that would create the federation are not finite", "INVALID_ARGUMENT")
            with self.cv:
                if self.creator != name:
                    raise HubError(f"facility {name}'s parameters came after its deadline (federation.elastic."
                                   f"grace_s): another facility creates the federation; join again",
                                   "DEADLINE_EXCEEDED")  # fmt: skip
                members = self.members.durable()
            snap = store.Snapshot(0, spec, None, {}, 0, members=members, federation=uuid.uuid4().hex)
            windows = _created(path, numel_of(spec), _outer_config(spec))
            why = self._saved("the new federation", lambda: self.store.save(snap, windows))
        finally:
            path.unlink(missing_ok=True)
        with self.cv:
            if why is not None:
                self.creator, self.create_cut = None, None  # not created: the next join creates it
                raise HubError(f"the hub {why}: the federation is not created", "INTERNAL")
            self.snap = self.store.load(0, verify=False)
            self.spec, self.creator, self.options, self.theta_norm = spec, None, _outer_config(spec), norm
            self.create_cut = None
            self.codec = codec_of(spec)
            self.log(f"hub: facility {name} created the federation ({numel_of(spec)} parameters)")
            self.cv.notify_all()
            return self._view()

    # ------------------------------------------------------------------ rounds
    def arrive(self, name: str, msg: ArriveRequest) -> ArriveReply:
        """A member at its boundary: ``upload`` (its contribution is wanted) or ``heal``."""
        with self.cv:
            m = self.members.beat(name, msg.session)
            if self.spec is None:
                raise HubError("the federation has not been created yet: join again", "FAILED_PRECONDITION")
            stale = None if msg.version == self.version else f"version {msg.version} (the hub's is {self.version})"
            if stale is None and self.head.ended:
                stale = "the federation has ended"
            stale = stale or checks.misaligned(m, msg.step, self.head.progress, self.spec)
            r = self.round
            if r is None or r.version != self.version:
                if stale is not None:  # nothing to wait for: θ_global now
                    return ArriveReply("heal", None, stale)
                fp32 = final_in_fp32(self.spec) and self.head.progress + 1 >= self.spec["rounds"]
                r = self.round = Round(self.next_rid, self.version, time.monotonic(), fp32=fp32)
                self.next_rid += 1
            if name in r.arrivals:
                raise HubError(f"facility {name} already arrived at this round", "ALREADY_EXISTS")
            a = Arrival(msg.step, msg.taken, msg.tokens, Part.HEAL, stale)
            if stale is None and r.state is not RoundState.OPEN:
                a.reason = "arrived after the round closed (federation.elastic.grace_s)"
            elif stale is None:
                a.reason = checks.claims(m, a)  # a claim that cannot hold: rejected, nothing uploaded
                a.part = Part.WANTED if a.reason is None else Part.REFUSED
            r.arrivals[name] = a
            self.cv.notify_all()
            return ArriveReply("upload" if a.part is Part.WANTED else "heal", r.rid, a.reason)

    def upload(self, name: str, frames: Frames, cut=None) -> UploadReply | HubView:
        """A ``create`` (:meth:`create`), or spool the member's contribution to disk, measuring finiteness and its
        update's norm. ``cut()``: ends the call (the round's deadline passed before the upload ended)."""
        if frames.header.kind == "create":
            return self.create(name, frames, cut)
        with self.cv:
            m = self.members.member(name, frames.header.session)
            r = self.round
            a = r.arrivals.get(name) if r is not None and r.rid == frames.header.round else None
            if a is None or a.part is not Part.WANTED or r.state is not RoundState.OPEN:
                raise HubError(f"facility {name} has no upload pending in this round", "FAILED_PRECONDITION")
            a.move(Part.UPLOADING)
            a.spool, a.cut = self.spool.path(r.rid, name), cut
            frames.frames = paced(frames.frames, r.opened + self._grace(), f"facility {name}'s upload")
        part, reason = Part.BROKEN, "upload broken off"
        try:
            received = functools.partial(setattr, a, "received")
            ended = functools.partial(self.latency.upload_ended, r.rid)
            codec = self.codec_of(r)  # fp32 parameters are measured against θ_global (its file written, if behind)
            theta = self.theta if codec is None else None
            a.norm, a.crc = self.spool.write(frames, a.spool, theta, codec, received, ended)
            part, reason = Part.UPLOADED, None
        except WireError as exc:
            reason = f"malformed upload ({exc})"
        except Exception as exc:  # noqa: BLE001 - the member's connection broke mid-upload
            reason = f"upload broken off ({str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__})"
        finally:
            if part is Part.BROKEN:
                a.spool.unlink(missing_ok=True)
            with self.cv:
                a.cut = None
                if a.part is Part.UPLOADING:  # else the round's deadline cut it (BROKEN)
                    a.move(part, reason)
                m.beat = time.monotonic()
                self.cv.notify_all()
        return UploadReply(a.part is Part.UPLOADED, a.reason)

    def _grace(self) -> float:
        return float(self.spec["grace_s"])

    def _closable(self, r: Round, now: float) -> bool:
        """Every live member arrived and every upload ended, or the round's deadline (``grace_s``) passed."""
        live = self.members.live(now)
        uploads_done = all(a.settled or (a.part is Part.WANTED and n not in live) for n, a in r.arrivals.items())
        return (uploads_done and live <= set(r.arrivals)) or now - r.opened >= self._grace()

    @staticmethod
    def _cut_late(r: Round) -> None:
        """At the round's close (the caller holds the lock): an upload still pending counts as none, and one in
        flight is ended."""
        for a in r.arrivals.values():
            if a.part is Part.WANTED:
                a.move(Part.BROKEN, "no upload by the round's deadline (federation.elastic.grace_s)")
            elif a.part is Part.UPLOADING:
                a.move(Part.BROKEN, "upload not over by the round's deadline (federation.elastic.grace_s)")
                cut, a.cut = a.cut, None
                if cut is not None:
                    cut()

    def _commit_loop(self) -> None:
        while not self._stop.is_set():
            if self.behind is not None:  # the latest version's file, behind its record, before any other round
                self._write_behind()
                if self.behind is not None:  # it failed: tried again after RETRY_S
                    with self.cv:
                        self.cv.wait(timeout=0.2)
                    continue
            with self.cv:
                if self.creator is not None and time.monotonic() >= self.create_by:
                    self._drop_creator("did not upload in time")
                r = self.round
                if r is None or r.state is not RoundState.OPEN:
                    self.cv.wait(timeout=0.2)
                    continue
                closing = self._closable(r, time.monotonic())
                if closing:
                    self._cut_late(r)
                    r.move(RoundState.CLOSED)
                    r.move(RoundState.COMMITTING)  # readers read saved files: none is waited for
                else:
                    plan = self._ahead_plan(r, time.monotonic())
            if not closing:
                self._fold_ahead(plan)
                with self.cv:  # the round's state changes under the lock: no close is missed
                    if r.state is RoundState.OPEN and not self._closable(r, time.monotonic()):
                        self.cv.wait(timeout=0.2)
                continue
            try:
                outcome = self._commit(r)
            except Exception as exc:  # noqa: BLE001 - a round that cannot commit commits nothing
                outcome = Outcome(False, error=f"{type(exc).__name__}: {exc}")
                self.log(f"hub: round {r.rid} failed to commit ({outcome.error}); version stays {self.version}")
            finally:
                self._drop_ahead()
                self.spool.clear(r.rid)
            with self.cv:
                r.outcome = dataclasses.replace(outcome, view=self._view())
                r.move(RoundState.DECIDED)
                self.decided[r.rid] = r
                for old in [k for k in self.decided if k < r.rid - 8]:
                    del self.decided[old]
                self.round = None
                self.cv.notify_all()

    # ------------------------------------------------------------------ folding ahead (:mod:`.ahead`)
    def _ahead_plan(self, r: Round, now: float) -> tuple | None:
        """What the open round would commit if every upload wanted is accepted (the caller holds the lock): its
        key (the round, the members in name order, their scales), their arrivals and the aggregate's plan; None
        while it cannot be known (a live member has not arrived), or for a round of messages (:mod:`.ahead`)."""
        if self.codec_of(r) is not None or not self.members.live(now) <= set(r.arrivals):
            return None
        wanted = (Part.WANTED, Part.UPLOADING, Part.UPLOADED)
        up = {n: a for n, a in sorted(r.arrivals.items()) if a.part in wanted and a.reason is None}
        if not up:
            return None
        rule = self.spec.get("aggregate", "mean")
        weights = checks.weights(self.spec, up) if rule == "mean" else dict.fromkeys(up, 1.0)
        total = sum(weights.values())
        scales = tuple(weights[n] / total for n in up)
        plan = Plan(rule, scales, float(self.spec.get("trim", 0.0)), self.options, self.snap.outer_steps + 1)
        return (r.rid, tuple(up), scales), list(up.values()), plan

    def _fold_ahead(self, planned: tuple | None) -> None:
        """Begin the round's next version (a new plan drops the old one's file), then fold what is spooled."""
        if planned is None:
            return
        key, arrivals, plan = planned
        if self.ahead is not None and self.ahead.key != key:
            self._drop_ahead()
        if self.ahead is None and key != self.not_ahead:
            saved = self.snap
            head = dataclasses.replace(saved, version=saved.version + 1, theta=None, buffers={},
                                       outer_steps=saved.outer_steps + 1)  # fmt: skip
            try:
                pending = self.store.begin(head, ("theta", *saved.buffers), saved.theta.numel())
            except (OSError, store.StateError):  # no room: the close refuses the round, and says so
                pending = None
            if pending is None:
                self.not_ahead = key
                return
            self.ahead = Ahead(key, pending, plan, saved, arrivals, window(len(arrivals)))
        try:
            self.ahead.advance()
        except Exception as exc:  # noqa: BLE001 - the round commits at its close, from the spool files
            self.log(f"hub: round {key[0]}: cannot fold ahead ({type(exc).__name__}: {exc}); it commits at its close")
            self._drop_ahead()
            self.not_ahead = key

    def _drop_ahead(self) -> None:
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead.abort()

    def _commit(self, r: Round) -> Outcome:
        start = time.perf_counter()
        accepted, weights, rejected, healed = self._decide(r)
        if not accepted:
            return Outcome(False, {}, rejected, healed)
        nxt, members = self._next(r, accepted, weights)
        total = sum(weights.values())
        scales = {n: weights[n] / total for n in accepted}
        ahead, self.ahead, logged = self.ahead, None, None
        if ahead is not None and (ahead.key != (r.rid, tuple(scales), tuple(scales.values())) or
                                  not ahead.pending.fits(nxt)):  # fmt: skip
            ahead.abort()  # the round decided otherwise: nothing folded ahead is kept
            ahead = None
        if self.codec_of(r) is not None:
            why, logged = self._record(r, nxt, scales, accepted)
        elif ahead is None:
            why = self._apply(nxt, self.snap, [a.spool for a in accepted.values()], tuple(scales.values()), None)
        else:
            why = self._finish_ahead(nxt, ahead)
        if why is not None:
            return Outcome(False, {}, rejected, healed, error=f"the hub {why}")
        with self.cv:
            if logged is None:
                self.snap = self.store.load(nxt.version, verify=False)  # the saved file, mapped
            else:
                self.behind = _Behind(logged[0], self.snap, logged[1])
            self._keep_relay(r, logged[0] if logged else None)
            for n, m in members.items():
                if n in self.members.members:
                    held = self.members[n]
                    held.last_step, held.norms, held.counted, held.share = m.last_step, m.norms, m.counted, m.share
        how = ", folded ahead" if ahead is not None else ", its record: the file is written behind it" if logged else ""
        self.log(
            f"hub: round {r.rid} committed version {self.version}: {', '.join(accepted)}"
            + (f"; rejected {', '.join(rejected)}" if rejected else "")
            + f" ({time.perf_counter() - start:.2f} s{how})"
        )
        return Outcome(True, scales, rejected, healed)

    def _record(self, r: Round, nxt: store.Snapshot, scales: dict[str, float], accepted: dict[str, Arrival]
                ) -> tuple[str | None, tuple[journal.Record, store.Pending | None] | None]:  # fmt: skip
        """Commit compressed round ``r`` by its record (:mod:`.journal`): the next version's file begun first (the
        disk's room checked and its blocks reserved: a disk without room refuses the round before it commits), then
        the record made durable. The file is written behind it (:meth:`_write_behind`). None and (the record, the
        begun file), or why not (:meth:`_saved`; nothing kept changed)."""
        begun: list = [None, None]

        def begin():
            begun[1] = self.store.begin(nxt, ("theta", *self.snap.buffers), numel_of(self.spec))

        def log():
            spooled = {n: (a.spool, a.crc) for n, a in accepted.items()}
            begun[0] = journal.write(self.journal, nxt, r.rid, r.version, scales, spooled)

        why = self._saved(f"version {nxt.version}", begin)
        if why is None:
            why = self._saved(f"version {nxt.version}'s record", log)
            if why is not None and begun[1] is not None:
                begun[1].abort()
        return why, (None if why else tuple(begun))

    def _write_behind(self) -> None:
        """Write the version its record committed (:mod:`.journal`) into its file; once durable it is the hub's saved
        version and the record goes. A failure is logged (:meth:`_saved`) and tried again after :data:`RETRY_S`: the
        record stays, and a hub started again replays it."""
        b = self.behind
        if time.monotonic() < b.retry_at:
            return
        rec, pending, b.pending = b.record, b.pending, None
        start = time.perf_counter()
        why = self._apply(rec.snap, b.saved, list(rec.paths.values()), tuple(rec.scales.values()), self.codec, pending)
        if why is not None:
            b.retry_at = time.monotonic() + RETRY_S
            self.log(f"hub: version {rec.version} stays committed by its record {rec.path}; its file is tried again in "
                     f"{RETRY_S:.0f} s")  # fmt: skip
            return
        snap = self.store.load(rec.version, verify=False)
        with self.cv:
            self.snap, self.behind = snap, None
            self.cv.notify_all()
        rec.done()
        self.log(f"hub: version {rec.version}'s file written behind its record ({time.perf_counter() - start:.2f} s)")

    def _keep_relay(self, r: Round, record: journal.Record | None) -> None:
        """With compression, the committed round's accepted messages (its record's) are kept for its members (the
        caller holds the lock); the previous round's are removed (a round of fp32 parameters relays nothing: its
        members read θ_global)."""
        if self.codec is None:
            return
        old, self.relayed = self.relayed, None
        if old is not None:
            old.remove()
        if record is not None:
            self.relayed = relayed.Relayed(r.rid, record.base, record.version, record.scales, record.paths,
                                           record.snap.outer_steps)  # fmt: skip

    def _decide(self, r: Round) -> tuple[dict[str, Arrival], dict[str, float], dict[str, str], dict[str, str]]:
        """The round's judgement: the accepted contributions (in name order) and their weights, the rejected
        ones and why, the healed ones and why."""
        rejected = checks.judge(r, self.members.members, float(self.spec.get("max_norm_ratio") or 0), self.theta_norm)
        accepted = {n: a for n, a in sorted(r.arrivals.items()) if not a.heal and n not in rejected}
        healed = {n: a.reason for n, a in r.arrivals.items() if a.heal}
        for n, why in rejected.items():
            self.log(f"hub: round {r.rid}: facility {n}'s contribution rejected: {why}")
        rule = self.spec.get("aggregate", "mean")
        weights = checks.weights(self.spec, accepted) if rule == "mean" else dict.fromkeys(accepted, 1.0)
        return accepted, weights, rejected, healed

    @torch.no_grad()
    def _apply(self, nxt: store.Snapshot, saved: store.Snapshot, paths: list[Path], scales: tuple[float, ...],
               codec: UpdateCodec | None, pending: store.Pending | None = None) -> str | None:  # fmt: skip
        """Save version ``nxt`` (:meth:`_saved`: None, or why not), its θ_global and outer state computed window
        by window from ``saved``'s and the accepted uploads' files (``paths``, weighted ``scales``, in fold order),
        each window written into its file (``pending`` when begun, else a new one) as it is computed: nothing of the
        model's size is held in memory. With compression (``codec``, the round's), the windows of
        :func:`..protocol.relay.rounds`, which every facility applies a relayed round with (bitwise the same); else
        :func:`.fold.fold`'s."""
        numel = numel_of(self.spec)
        readers = []
        squares = [0.0]  # |θ_global|² of the next version, window by window

        def items():
            for theta, buffers in self._windows(saved, readers, scales, codec):
                squares[0] += checks.squares(theta.numpy(), None, 0)
                yield {"theta": theta, **buffers}

        def save():
            readers.extend(relay.Reader(p, codec) for p in paths)
            windows = store.Windows(("theta", *saved.buffers), numel, items())
            if pending is None:
                self.store.save(nxt, windows)
            else:
                store.fill(pending, windows, nxt)

        try:
            why = self._saved(f"version {nxt.version}", save)
        finally:
            for reader in readers:
                reader.close()
            if pending is not None and pending.fd is not None:
                pending.abort()
        if why is None:
            self.theta_norm = math.sqrt(squares[0])
        return why

    def _finish_ahead(self, nxt: store.Snapshot, ahead: Ahead) -> str | None:
        """Save version ``nxt`` from the file folded ahead (:meth:`_saved`: None, or why not)."""

        def save():
            try:
                ahead.finish(nxt)
            except BaseException:
                ahead.abort()
                raise

        why = self._saved(f"version {nxt.version}", save)
        if why is None:
            self.theta_norm = math.sqrt(ahead.squares)
        return why

    def _windows(self, saved: store.Snapshot, readers: list, scales: tuple[float, ...], codec: UpdateCodec | None):
        """(θ_global's window, the outer buffers' windows) of the next version, in order (:meth:`_apply`)."""
        rule, trim, numel = self.spec.get("aggregate", "mean"), float(self.spec.get("trim", 0.0)), numel_of(self.spec)

        if codec is not None:

            def read(start: int, stop: int):
                return saved.theta[start:stop].clone(), {b: t[start:stop].clone() for b, t in saved.buffers.items()}

            args = (self.options, saved.outer_steps, readers, list(scales), rule, trim)
            for _, theta, buffers in relay.rounds(read, numel, *args, checked=True):  # finite norms: finite values
                yield theta, buffers
            return
        plan = Plan(rule, scales, trim, self.options, saved.outer_steps + 1)
        n = window(len(readers))
        stack = torch.empty(len(readers), n, dtype=torch.float32)
        for start in range(0, numel, n):
            yield next_window(plan, saved, readers, start, stack[:, : min(n, numel - start)])

    def _next(self, r: Round, accepted: dict[str, Arrival], weights: dict[str, float]) -> tuple[store.Snapshot, dict]:
        """The next version's description (its tensors are computed as it is saved, :meth:`_apply`), and its
        members' history (with each accepted member's step and share: :meth:`_pending`'s record); the hub's stays as
        it is until it is saved."""
        s = self.head
        with self.cv:
            members = {n: dataclasses.replace(m, norms=list(m.norms)) for n, m in self.members.members.items()}
        every = {n: members[n].every for n in accepted if members[n].every}
        progress = max([s.progress] + [-(-accepted[n].step // e) for n, e in every.items()])
        for n, a in r.arrivals.items():  # a member that healed realigns to the federation's step (every_s: its own)
            step = a.step if n in accepted or not members[n].every else checks.federation_step(members[n], progress)
            share = weights[n] / sum(weights.values()) if n in accepted else None
            members[n].accepted(step, a.norm if n in accepted else None, share)
        ended = s.ended or self._ends(accepted, progress)
        nxt = dataclasses.replace(s, version=s.version + 1, theta=None, buffers={}, outer_steps=s.outer_steps + 1,
                                  progress=progress, ended=ended,
                                  members={n: m.durable() for n, m in members.items()})  # fmt: skip
        return nxt, {n: members[n] for n in r.arrivals}

    def _ends(self, accepted: dict[str, Arrival], progress: int) -> bool:
        """Whether the round ends the federation: with ``every_s``, an accepted member reached the federation's last
        step; else it is the federation's last round (``progress`` reached its ``rounds``: every member made them on
        joining, and each round takes only the members at its step)."""
        last, rounds = self.spec.get("train.steps"), self.spec.get("rounds")
        if self.spec.get("every_s") is not None and type(last) is int:
            return any(a.step >= last for a in accepted.values())
        return bool(accepted) and type(rounds) is int and progress >= rounds

    # ------------------------------------------------------------------ θ_global out
    def result(self, name: str, msg: ResultRequest, active, cut=None) -> Iterator[bytes]:
        """After round ``msg.round`` is decided (or now, for a heal outside a round): the member's status and
        θ_global. ``active()``: False once the member's call is gone; ``cut()`` ends it (:meth:`_theta_frames`).
        A round that is neither open nor decided (any more) is refused at once."""
        rid = msg.round
        with self.cv:
            self.members.member(name, msg.session)
            if rid is not None and rid not in self.decided and (self.round is None or self.round.rid != rid):
                raise HubError(f"round {rid} is neither open nor decided at the hub: arrive at a boundary again",
                               "FAILED_PRECONDITION")  # fmt: skip
            while rid is not None and rid not in self.decided:
                if self._stop.is_set() or not active():
                    raise HubError("the hub is stopping", "UNAVAILABLE")
                self.cv.wait(timeout=0.5)
            r = self.decided[rid] if rid is not None else None
            if r is None:
                header = ResultHeader("healed", "heal", **vars(self._view()))
            else:
                header = r.outcome.header(name)
        frames = self._theta_frames(header, self._cutting(name, "Result", cut), relay_to=(name, rid))
        if r is None or not r.outcome.committed:
            return frames
        return self.latency.first_byte(rid, r.outcome.view.version, r.opened, frames)

    def fetch(self, name: str, msg: SessionRequest, cut=None) -> Iterator[bytes]:
        with self.cv:
            self.members.member(name, msg.session)
            header = ResultHeader("healed", "join", **vars(self._view()))
        return self._theta_frames(header, self._cutting(name, "Fetch", cut))

    def _cutting(self, name: str, method: str, cut):
        """``cut``, saying so in the hub's log (a stream not read in time)."""
        if cut is None:
            return None

        def run():
            self.log(f"hub: facility {name}'s {method} was not read within its deadline: the hub ended it")
            cut()

        return run

    def _theta_frames(self, header: ResultHeader, cut=None, relay_to: tuple[str, int] | None = None) -> Iterator[bytes]:
        """θ_global's frames, read from the saved file of the version the header names (opened now: a commit
        that follows neither waits for the stream nor changes what it sends); with compression, the outer
        optimizer's buffers follow, or to a member accepted in the round ``relay_to`` names (its version still the
        hub's) the other accepted members' messages (:mod:`.relayed`). A stream not read within
        :func:`..protocol.wire.transfer_s` of its bytes (``grace_s`` of slack) is ended (``cut()``: the hub's side of
        its deadline)."""
        with self.cv:
            if self.snap is None:
                raise HubError("the federation has not been created yet: join again", "FAILED_PRECONDITION")
            while True:
                if header.version != self.version:  # a newer round committed meanwhile
                    header = dataclasses.replace(header, **vars(self._view()))
                if self.behind is None or self._relay(header, relay_to) is not None:
                    break
                if self._stop.is_set():
                    raise HubError("the hub is stopping", "UNAVAILABLE")
                self.cv.wait(timeout=0.5)  # θ_global in full: its file is being written behind its record
            try:
                header, sources = self._sources(header, relay_to)
            except (OSError, store.StateError) as exc:
                self.log(f"hub: cannot read version {self.version}'s saved state ({exc})")
                raise HubError(f"the hub cannot read its saved state ({exc}): its operator must check --state",
                               "INTERNAL") from None  # fmt: skip
        nbytes = sum(n for _, n in sources)
        return _file_frames(header, sources, transfer_s(nbytes, self._grace()), cut)

    def _relay(self, header: ResultHeader, relay_to: tuple[str, int] | None) -> relayed.Relayed | None:
        """The relay for a member accepted in the round ``relay_to`` names, while its version is the hub's; None
        when it reads θ_global in full (the caller holds the lock)."""
        r = self.relayed
        if relay_to is None or header.status != "accepted" or r is None or r.rid != relay_to[1]:
            return None
        return r if r.version == self.version == header.version else None

    def _sources(self, header: ResultHeader, relay_to: tuple[str, int] | None) -> tuple[ResultHeader, list]:
        """What follows ``header`` (the caller holds the lock): open files and their bytes."""
        r = self._relay(header, relay_to)
        if r is not None:
            return dataclasses.replace(header, relay=r.header(relay_to[0])), r.open(relay_to[0])
        sources = [self.store.theta_reader(self.version)]
        if self.codec is None:
            return header, sources
        try:
            sources += [self.store.tensor_reader(self.version, f"outer.{k}") for k in self.snap.buffers]
        except BaseException:
            for fh, _ in sources:
                fh.close()
            raise
        return dataclasses.replace(header, outer_steps=self.snap.outer_steps), sources


def _created(path: Path, numel: int, options: OuterConfig) -> store.Windows:
    """Version 0's tensors, a window at a time: the creator's parameters (spooled to ``path``) and the outer
    optimizer's state at zero."""
    names = tuple(OuterOptimizer(options, torch.empty(0)).buffers)

    def items():
        reader, n = relay.Reader(path, None), window(1)
        try:
            for start in range(0, numel, n):
                theta = torch.empty(min(n, numel - start), dtype=torch.float32)
                reader.take(theta)
                yield {"theta": theta, **{k: torch.zeros_like(theta) for k in names}}
        finally:
            reader.close()

    return store.Windows(("theta", *names), numel, items())


def _file_frames(header: ResultHeader, sources: list, deadline_s: float, cut) -> Iterator[bytes]:
    """The header, then the bytes of each ``(fh, nbytes)`` of ``sources`` in order (the files are closed); ``cut()``
    ends the stream if it is not read within ``deadline_s``."""
    timer = threading.Timer(deadline_s, cut or (lambda: None))
    timer.daemon = True
    timer.start()
    try:
        yield pack({**header.to_json(), "nbytes": sum(n for _, n in sources)})
        for fh, nbytes in sources:
            with fh:
                left = nbytes
                while left:
                    chunk = fh.read(min(CHUNK_BYTES, left))
                    if not chunk:
                        raise HubError("the hub's saved state was cut short: its operator must check --state",
                                       "DATA_LOSS")  # fmt: skip
                    left -= len(chunk)
                    yield chunk
    finally:
        timer.cancel()
        for fh, _ in sources:
            fh.close()
