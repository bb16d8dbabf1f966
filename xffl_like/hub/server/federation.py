"""The federation the hub holds: its members, its rounds, θ_global and the outer step, orchestrated.

``grants``: what the operator lets each facility claim (``grants.json``, :func:`.checks.granted`).

A round opens when the first member arrives at its boundary with the hub's version, and closes
when every live member has arrived and every upload has ended, or ``grace_s`` after it opened, whichever
comes first: ``grace_s`` bounds the whole round, uploads included (an upload not over by then is cut and
counts as none; one slower than :data:`..protocol.wire.MIN_RATE` is cut before). :mod:`.rounds`: its states
and their transitions. A facility creating the federation has ``grace_s`` to upload its parameters, or
loses the role to the next facility that joins. Then, in the hub's committer thread:

1. each uploaded contribution is checked (:func:`.checks.judge`): finite, its update norm
   ``|θ_global - θ_f|`` at most ``max_norm_ratio`` times the median of the round's (three or more)
   or of the facility's own recent accepted rounds; claims (steps taken, tokens) were checked on
   arrival against the facility's geometry (:func:`.checks.claims`);
2. the weighted mean of the accepted ones (uniform or tokens weights, in name order), read back
   chunk by chunk from the files the uploads were spooled to (:mod:`.spool`), into one accumulator;
3. θ_global becomes the mean, or moves by the outer optimizer's step on ``θ_global - mean``;
4. the version (rounds committed) moves on, and the state is saved (:mod:`.store`) before any
   member hears of the result: a round is applied once, whatever dies when.

Members that arrive with another version, whose claims fail, or that come after the round
closed, heal: they receive θ_global (after the open round, if any) and contribute nothing. A round
with no accepted contribution commits nothing. Members and their liveness: :mod:`.membership`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from ...config.schema import OuterConfig
from ...federation.outer import OuterOptimizer, validate_outer
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
from ..protocol.spec import check_spec, codec_of, first_difference, numel_of
from ..protocol.update_codec import UpdateCodec
from ..protocol.wire import Frames, WireError, frames_of, paced, transfer_s
from . import checks, store
from .errors import HubError
from .membership import LIVE_S, Membership
from .rounds import Arrival, Outcome, Part, Round, RoundState
from .spool import Spool

__all__ = ["LIVE_S", "HubError", "HubFederation"]


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
        self.readers = 0  # streams reading θ_global now (a round waits for none before it commits)
        self.committing: Round | None = None  # the round changing θ_global now (no stream starts)
        self.creator: str | None = None
        self.create_by = 0.0  # the creator's parameters are due by then (grace_s after it was told to create)
        self.create_cut = None  # ends the creator's upload call
        self.dropped: set[str] = set()  # facilities that lost the creator's role (they create last)
        self.asked: dict[str, float] = {}  # when each facility last asked to join a federation not created yet
        self.pending_spec: dict | None = None  # the creator's description until its parameters arrive
        self.spool = Spool(state_dir / "spool")
        self.snap = snap
        self.spec: dict | None = snap.spec if snap else None
        self.theta: Tensor | None = snap.theta if snap else None
        self.acc: Tensor | None = None
        self.outer: OuterOptimizer | None = None
        self.codec: UpdateCodec | None = None
        if snap is not None:
            self._restore(snap)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._commit_loop, name="xffl-hub-commit", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ state
    def _restore(self, snap: store.Snapshot) -> None:
        self.codec = codec_of(snap.spec)
        self.outer = OuterOptimizer(_outer_config(snap.spec), snap.theta)
        for k, v in snap.buffers.items():
            self.outer.buffers[k].copy_(v)
        self.outer.steps = snap.outer_steps

    @property
    def version(self) -> int:
        return self.snap.version if self.snap else 0

    def expected_bytes(self, header) -> int:
        """The bytes an upload with ``header`` must have: parameters (fp32), or the codec's message."""
        if header.kind == "create":
            if self.pending_spec is None:
                raise HubError("no federation is being created: join again", "FAILED_PRECONDITION")
            return 4 * numel_of(self.pending_spec)
        if self.theta is None:
            raise HubError("the federation has not been created yet: join again", "FAILED_PRECONDITION")
        return self.codec.nbytes if self.codec is not None else 4 * self.theta.numel()

    def _view(self) -> HubView:
        s = self.snap
        return self.members.view(self.version, s.progress if s else 0, bool(s and s.ended))

    def _save(self) -> None:
        s = self.snap
        s.theta, s.buffers, s.outer_steps = self.theta, dict(self.outer.buffers), self.outer.steps
        s.members = self.members.durable()
        self.store.save(s)

    def close(self) -> None:
        self._stop.set()
        with self.cv:
            self.cv.notify_all()
        self._thread.join(timeout=10)

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
            return JoinReply("create" if self.spec is None else "member", **vars(self._view()))

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
        theta = torch.empty(numel_of(spec), dtype=torch.float32)
        frames.into(theta)
        if not torch.isfinite(theta).all():
            with self.cv:
                self.creator = None
            raise HubError("the parameters that would create the federation are not finite", "INVALID_ARGUMENT")
        with self.cv:
            if self.creator != name:
                raise HubError(f"facility {name}'s parameters came after its deadline (federation.elastic.grace_s): "
                               f"another facility creates the federation; join again", "DEADLINE_EXCEEDED")  # fmt: skip
            self.spec, self.theta, self.creator, self.create_cut = spec, theta, None, None
            self.outer = OuterOptimizer(_outer_config(spec), theta)
            self.codec = codec_of(spec)
            self.snap = store.Snapshot(0, spec, theta)
            self._save()
            self.log(f"hub: facility {name} created the federation ({theta.numel()} parameters)")
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
            r = self.round
            if r is None or r.version != self.version:
                if stale is not None:  # nothing to wait for: θ_global now
                    return ArriveReply("heal", None, stale)
                r = self.round = Round(self.next_rid, self.version, time.monotonic())
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
            if a is None or a.part is not Part.WANTED:
                raise HubError(f"facility {name} has no upload pending in this round", "FAILED_PRECONDITION")
            a.move(Part.UPLOADING)
            a.spool, a.cut = self.spool.path(r.rid, name), cut
            frames.frames = paced(frames.frames, r.opened + self._grace(), f"facility {name}'s upload")
        part, reason = Part.BROKEN, "upload broken off"
        try:
            a.norm = self.spool.write(frames, a.spool, self.theta, self.codec)
            part, reason = Part.UPLOADED, None
        except WireError as exc:
            reason = f"malformed upload ({exc})"
        except Exception as exc:  # noqa: BLE001 - the member's connection broke mid-upload
            reason = f"upload broken off ({str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__})"
        finally:
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
            with self.cv:
                if self.creator is not None and time.monotonic() >= self.create_by:
                    self._drop_creator("did not upload in time")
                r = self.round
                if r is None or r.state is not RoundState.OPEN or not self._closable(r, time.monotonic()):
                    self.cv.wait(timeout=0.2)
                    continue
                self._cut_late(r)
                r.move(RoundState.CLOSED)
                while self.readers:
                    self.cv.wait(timeout=0.2)
                r.move(RoundState.COMMITTING)
                self.committing = r
            try:
                outcome = self._commit(r)
            except Exception as exc:  # noqa: BLE001 - a round that cannot commit commits nothing
                outcome = Outcome(False, error=f"{type(exc).__name__}: {exc}")
                self.log(f"hub: round {r.rid} failed to commit ({outcome.error}); version stays {self.version}")
            with self.cv:
                r.outcome = dataclasses.replace(outcome, view=self._view())
                r.move(RoundState.DECIDED)
                self.committing = None
                self.decided[r.rid] = r
                for old in [k for k in self.decided if k < r.rid - 8]:
                    del self.decided[old]
                self.round = None
                self.cv.notify_all()

    @torch.no_grad()
    def _commit(self, r: Round) -> Outcome:
        start = time.perf_counter()
        rejected = checks.judge(r, self.members.members, float(self.spec.get("max_norm_ratio") or 0))
        accepted = {n: a for n, a in sorted(r.arrivals.items()) if not a.heal and n not in rejected}
        healed = {n: a.reason for n, a in r.arrivals.items() if a.heal}
        for n, why in rejected.items():
            self.log(f"hub: round {r.rid}: facility {n}'s contribution rejected: {why}")
        if not accepted:
            return Outcome(False, {}, rejected, healed)
        weights = checks.weights(self.spec, accepted)
        total = sum(weights.values())
        acc = self.acc = self.acc if self.acc is not None else torch.empty_like(self.theta)
        acc.zero_()
        for n, a in accepted.items():
            self.spool.accumulate(acc, a.spool, weights[n] / total, self.codec)
        if self.codec is not None:  # acc: the mean update, θ_global - mean
            self.outer.step(acc)
        elif self.outer.options.is_plain_mean:
            self.theta.copy_(acc)
        else:
            self.outer.step(torch.sub(self.theta, acc, out=acc))
        self._advance(r, accepted)
        self._save()
        self.log(
            f"hub: round {r.rid} committed version {self.version}: {', '.join(accepted)}"
            + (f"; rejected {', '.join(rejected)}" if rejected else "")
            + f" ({time.perf_counter() - start:.2f} s)"
        )
        return Outcome(True, {n: weights[n] / total for n in accepted}, rejected, healed)

    def _advance(self, r: Round, accepted: dict[str, Arrival]) -> None:
        s, members = self.snap, self.members
        s.version += 1
        for n, a in r.arrivals.items():
            members[n].accepted(a.step, a.norm if n in accepted else None)
        s.progress = max([s.progress] + [a.step // members[n].every for n, a in accepted.items() if members[n].every])
        s.ended = s.ended or self._ends(accepted)

    def _ends(self, accepted: dict[str, Arrival]) -> bool:
        """Whether the round ends the federation: with ``every_s``, an accepted member reached the federation's last
        step; else every accepted member reached its last step (each made the federation's rounds on joining)."""
        last = self.spec.get("train.steps")
        if self.spec.get("every_s") is not None and type(last) is int:
            return any(a.step >= last for a in accepted.values())
        return bool(accepted) and all(a.step >= self.members[n].steps for n, a in accepted.items())

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
            if rid is None:
                header = ResultHeader("healed", "heal", **vars(self._view()))
            else:
                header = self.decided[rid].outcome.header(name)
        return self._theta_frames(header, self._cutting(name, "Result", cut))

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

    def _theta_frames(self, header: ResultHeader, cut=None) -> Iterator[bytes]:
        """θ_global's frames; a round waits until every stream reading it has finished before it commits. A
        stream not read within :func:`..protocol.wire.transfer_s` of θ_global's bytes (``grace_s`` of slack) is
        ended (``cut()``: the hub's side of its deadline)."""
        with self.cv:
            while self.committing is not None:
                self.cv.wait(timeout=0.2)
            if header.version != self.version:  # a newer round committed meanwhile
                header = dataclasses.replace(header, **vars(self._view()))
            self.readers += 1
            timer = threading.Timer(transfer_s(4 * self.theta.numel(), self._grace()), cut or (lambda: None))
        timer.daemon = True
        timer.start()
        try:
            yield from frames_of(header.to_json(), self.theta)
        finally:
            timer.cancel()
            with self.cv:
                self.readers -= 1
                self.cv.notify_all()
