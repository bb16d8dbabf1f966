"""The federation the hub holds: members, rounds, θ_global, the outer step, the checks.

A round opens when the first member arrives at its boundary with the hub's version, and closes
when every live member has arrived (and every upload has ended) or ``grace_s`` after it opened,
whichever comes first. Then, in the hub's committer thread:

1. each uploaded contribution is checked (:meth:`HubFederation._judge`): finite, its update norm
   ``|θ_global - θ_f|`` at most ``max_norm_ratio`` times the median of the round's (three or more)
   or of the facility's own recent accepted rounds; claims (steps taken, tokens) were checked on
   arrival against the facility's geometry;
2. the weighted mean of the accepted ones (uniform or tokens weights, in name order), read back
   chunk by chunk from the spool files the uploads were written to, into one accumulator;
3. θ_global becomes the mean, or moves by the outer optimizer's step on ``θ_global - mean``;
4. the version (rounds committed) moves on, and the state is saved (:mod:`.store`) before any
   member hears of the result: a round is applied once, whatever dies when.

Members that arrive with another version, whose claims fail, or that come after the round
closed, heal: they receive θ_global (after the open round, if any) and contribute nothing. A round
with no accepted contribution commits nothing.
"""

from __future__ import annotations

import math
import shutil
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..config.schema import OuterConfig
from ..federation.elastic.options import first_difference
from ..federation.outer import OuterOptimizer, validate_outer
from ..federation.update_codec import CODECS, UpdateCodec
from . import store
from .wire import Frames, WireError, frames_of

__all__ = ["LIVE_S", "HubError", "HubFederation"]

#: A member whose last heartbeat is older than this is not waited for.
LIVE_S = 5.0
#: Accepted update norms kept per facility (its own recent rounds).
HISTORY = 5
_LIMITS = {"batch_size": 1 << 20, "seq_len": 1 << 24, "dp": 1 << 20}


class HubError(RuntimeError):
    """A request the hub refuses (one line for the facility: what and the fix); ``code``: the gRPC status name."""

    def __init__(self, message: str, code: str = "FAILED_PRECONDITION"):
        super().__init__(message)
        self.code = code


@dataclass
class Member:
    name: str
    session: str
    geometry: dict[str, int]
    every: int | None
    steps: int
    beat: float = field(default_factory=time.monotonic)
    last_step: int | None = None
    norms: list[float] = field(default_factory=list)
    left: bool = False

    def live(self, now: float) -> bool:
        return not self.left and now - self.beat < LIVE_S

    def durable(self) -> dict[str, Any]:
        keep = ("geometry", "every", "steps", "last_step", "norms")
        return {k: getattr(self, k) for k in keep}


@dataclass
class Arrival:
    step: int
    taken: int
    tokens: float
    heal: bool
    reason: str | None = None  # why its contribution is out (claims, upload, checks)
    spool: Path | None = None
    uploading: bool = False
    uploaded: bool = False
    norm: float = math.nan


@dataclass
class Round:
    rid: int  # this hub's round number (across versions: a round that commits nothing keeps the version)
    version: int
    opened: float
    arrivals: dict[str, Arrival] = field(default_factory=dict)
    closing: bool = False
    outcome: dict[str, Any] | None = None


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


def _rules(spec: dict) -> None:
    """The hub's own keys of the description (from the network: checked before use)."""
    for key in ("grace_s", "max_norm_ratio"):
        v = spec.get(key)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
            raise HubError(f"federation.elastic.{key}={v!r} is invalid", "INVALID_ARGUMENT")
    comp = spec.get("compression")
    if not isinstance(comp, dict) or comp.get("kind") not in ("none", *CODECS):
        raise HubError(f"compression {comp!r}: the hub takes none, {', '.join(CODECS)}", "INVALID_ARGUMENT")
    if comp["kind"] != "none":
        size = comp.get("chunk_size")
        if not (isinstance(size, int) and not isinstance(size, bool) and 1 <= size <= 1 << 24):
            raise HubError(f"federation.chunk_size={size!r} is invalid", "INVALID_ARGUMENT")
    if comp["kind"] == "topk":
        density, bits = comp.get("density"), comp.get("bits")
        if not (isinstance(density, float) and 0.0 < density <= 1.0):
            raise HubError(f"federation.topk.density={density!r} is invalid", "INVALID_ARGUMENT")
        if bits not in (2, 4, 8) or isinstance(bits, bool):
            raise HubError(f"federation.topk.bits={bits!r} is invalid", "INVALID_ARGUMENT")
    if spec.get("weights_rule") not in (None, "uniform", "tokens"):
        raise HubError(f"weights {spec.get('weights_rule')!r}: the hub weighs uniform or tokens", "INVALID_ARGUMENT")


_SLICE = 1 << 20  # values checked or accumulated at a time: transient buffers of a few MB per upload


def _squares(values: np.ndarray, theta: Tensor | None, first: int) -> float:
    """The sum of squares of ``theta[first:] - values`` (of ``values`` when ``theta`` is None), in fp64, a
    slice at a time; inf or nan when a value is not finite."""
    total = 0.0
    for start in range(0, values.size, _SLICE):
        x = torch.from_numpy(values[start : start + _SLICE]) if values.flags.writeable else None
        if x is None:  # a received frame is read-only: copy one slice
            x = torch.from_numpy(values[start : start + _SLICE].copy())
        if theta is not None:
            x = torch.sub(theta[first + start : first + start + x.numel()], x, out=x)
        total += float(torch.linalg.vector_norm(x, dtype=torch.float64) ** 2)
        if not math.isfinite(total):
            return total
    return total


def numel_of(spec: dict) -> int:
    params = spec.get("parameters")
    if not isinstance(params, list) or not params:
        raise HubError("the federation's description lists no parameters", "INVALID_ARGUMENT")
    total = 0
    for p in params:
        if not (isinstance(p, list) and len(p) == 3 and isinstance(p[1], list) and p[2] == "float32"):
            raise HubError(f"parameter {p!r}: the hub averages fp32 parameters only", "INVALID_ARGUMENT")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in p[1]):
            raise HubError(f"parameter {p[0]!r} has an invalid shape", "INVALID_ARGUMENT")
        total += math.prod(p[1])
    if not 0 < total < 1 << 40:
        raise HubError(f"{total} parameters is out of range", "INVALID_ARGUMENT")
    return total


class HubFederation:
    """One federation's state and rounds; thread-safe (gRPC handlers call in from a pool)."""

    def __init__(self, state_dir: Path, snap: store.Snapshot | None, log=print):
        self.dir, self.log = state_dir, log
        self.cv = threading.Condition()
        self.members: dict[str, Member] = {}
        self.round: Round | None = None
        self.decided: dict[int, Round] = {}
        self.next_rid = 0
        self.readers = 0  # streams reading θ_global now
        self.writing = False  # the committer is changing θ_global
        self.creator: str | None = None
        self.spool = state_dir / "spool"
        shutil.rmtree(self.spool, ignore_errors=True)
        self.spool.mkdir(parents=True, exist_ok=True)
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
    def _codec(self, spec: dict) -> UpdateCodec | None:
        comp = spec["compression"]
        if comp["kind"] == "none":
            return None
        topk = (comp["density"], comp["bits"]) if comp["kind"] == "topk" else None
        return UpdateCodec(comp["kind"], numel_of(spec), comp["chunk_size"], topk)

    def expected_bytes(self, kind: str) -> int:
        """The bytes an upload of ``kind`` must have: parameters (fp32), or the codec's message."""
        if kind == "create":
            return 4 * numel_of(self.pending_spec)
        if self.theta is None:
            raise HubError("the federation has not been created yet: join again", "FAILED_PRECONDITION")
        return self.codec.nbytes if self.codec is not None else 4 * self.theta.numel()

    def _restore(self, snap: store.Snapshot) -> None:
        self.codec = self._codec(snap.spec)
        self.outer = OuterOptimizer(_outer_config(snap.spec), snap.theta)
        for k, v in snap.buffers.items():
            self.outer.buffers[k].copy_(v)
        self.outer.steps = snap.outer_steps
        for name, d in snap.members.items():
            m = Member(name, "", d["geometry"], d["every"], d["steps"], beat=-math.inf)
            m.last_step, m.norms = d["last_step"], list(d["norms"])
            self.members[name] = m

    @property
    def version(self) -> int:
        return self.snap.version if self.snap else 0

    def _save(self) -> None:
        s = self.snap
        s.theta, s.buffers, s.outer_steps = self.theta, dict(self.outer.buffers), self.outer.steps
        s.members = {n: m.durable() for n, m in self.members.items()}
        store.save(self.dir, s)

    def close(self) -> None:
        self._stop.set()
        with self.cv:
            self.cv.notify_all()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ membership
    def join(self, name: str, msg: dict) -> dict:
        """A facility asks in (``probe``: only check, as its launcher does before workers start)."""
        spec, session = msg["spec"], msg["session"]
        geometry = self._geometry(msg.get("geometry"))
        with self.cv:
            now = time.monotonic()
            held = self.members.get(name)
            if held is not None and held.live(now) and held.session != session:
                raise HubError(
                    f"a facility named {name} is already a member (its heartbeat is live): each facility "
                    f"needs its own name and certificate (python -m xffl_like.hub add DIR NAME)",
                    "ALREADY_EXISTS",
                )
            if self.spec is not None:
                difference = first_difference(spec, self.spec)
                if difference is not None:
                    raise HubError(
                        f"facility {name} does not match the federation: {difference}; run it with the "
                        f"federation's settings (or serve a new federation with another --state)",
                        "FAILED_PRECONDITION",
                    )
            elif self.creator not in (None, name):
                if self.members[self.creator].live(now):
                    return {"status": "retry"}  # another facility is creating the federation
                self.creator = None  # it died before its parameters arrived: this one creates it
            if msg.get("probe"):  # ended: the launcher refuses before its workers start
                return {"status": "ok", **self._public()}
            if self.spec is None:
                numel_of(spec), _outer_config(spec), _rules(spec)
                self.creator, self.pending_spec = name, spec
                status = "create"
            else:
                status = "member"
            member = Member(name, session, geometry, msg.get("every"), int(msg["steps"]))
            if held is not None:  # a facility coming back keeps its history
                member.norms = held.norms
            self.members[name] = member
            self.cv.notify_all()
            return {"status": status, **self._public()}

    def _geometry(self, g: Any) -> dict[str, int]:
        if not isinstance(g, dict) or set(g) != set(_LIMITS):
            raise HubError(f"geometry must give {sorted(_LIMITS)}", "INVALID_ARGUMENT")
        for k, hi in _LIMITS.items():
            v = g[k]
            if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= hi):
                raise HubError(f"geometry {k}={v!r} is out of range", "INVALID_ARGUMENT")
        return dict(g)

    def _public(self) -> dict:
        now = time.monotonic()
        return {
            "version": self.version,
            "progress": self.snap.progress if self.snap else 0,
            "ended": bool(self.snap and self.snap.ended),
            "live": sorted(n for n, m in self.members.items() if m.live(now)),
        }

    def _member(self, name: str, session: str) -> Member:
        m = self.members.get(name)
        if m is None or (m.session and m.session != session):
            if m is not None and m.session and not m.live(time.monotonic()):
                m.session = session  # the hub restarted or the facility's old process is gone
                return m
            raise HubError(f"facility {name} is not a member of this federation now: join again", "NOT_FOUND")
        if not m.session:
            m.session = session  # known from the saved state (the hub restarted): adopt this process
        return m

    def beat(self, name: str, session: str) -> dict:
        with self.cv:
            self._member(name, session).beat = time.monotonic()
            self.cv.notify_all()
            return self._public()

    def leave(self, name: str, session: str) -> None:
        with self.cv:
            m = self.members.get(name)
            if m is not None and m.session == session:
                m.left = True
                self.cv.notify_all()

    def create(self, name: str, frames: Frames) -> dict:
        """The first facility's parameters become θ_global (version 0)."""
        with self.cv:
            if self.creator != name or self.spec is not None:
                raise HubError(f"facility {name} is not creating this federation", "FAILED_PRECONDITION")
            spec = self.pending_spec
        theta = torch.empty(numel_of(spec), dtype=torch.float32)
        frames.into(theta)
        if not torch.isfinite(theta).all():
            with self.cv:
                self.creator = None
            raise HubError("the parameters that would create the federation are not finite", "INVALID_ARGUMENT")
        with self.cv:
            self.spec, self.theta, self.creator = spec, theta, None
            self.outer = OuterOptimizer(_outer_config(spec), theta)
            self.codec = self._codec(spec)
            self.snap = store.Snapshot(0, spec, theta)
            self._save()
            self.log(f"hub: facility {name} created the federation ({theta.numel()} parameters)")
            self.cv.notify_all()
            return self._public()

    # ------------------------------------------------------------------ rounds
    def arrive(self, name: str, msg: dict) -> dict:
        """A member at its boundary: ``upload`` (its contribution is wanted) or ``heal``."""
        with self.cv:
            m = self._member(name, msg["session"])
            m.beat = time.monotonic()
            if self.spec is None:
                raise HubError("the federation has not been created yet: join again", "FAILED_PRECONDITION")
            r = self.round
            if r is None or r.version != self.version:
                if int(msg["version"]) != self.version:  # nothing to wait for: θ_global now
                    return {"action": "heal", "round": None, "reason": self._stale(msg)}
                r = self.round = Round(self.next_rid, self.version, time.monotonic())
                self.next_rid += 1
            a = Arrival(int(msg["step"]), int(msg["taken"]), float(msg["tokens"]), heal=False)
            if name in r.arrivals:
                raise HubError(f"facility {name} already arrived at this round", "ALREADY_EXISTS")
            if int(msg["version"]) != self.version:
                a.heal, a.reason = True, self._stale(msg)
            elif r.closing:
                a.heal, a.reason = True, "arrived after the round closed (federation.elastic.grace_s)"
            else:
                a.reason = self._claims(m, a)  # a claim that cannot hold: rejected, nothing uploaded
            r.arrivals[name] = a
            self.cv.notify_all()
            upload = not a.heal and a.reason is None
            return {"action": "upload" if upload else "heal", "round": r.rid, "reason": a.reason}

    def _stale(self, msg: dict) -> str:
        return f"version {msg['version']} (the hub's is {self.version})"

    def _claims(self, m: Member, a: Arrival) -> str | None:
        """Why the member's claims cannot hold (None: they can)."""
        g = m.geometry
        if a.taken < 1 or a.step < a.taken:
            return f"claims {a.taken} steps taken at step {a.step}"
        if m.last_step is not None and a.step - m.last_step < a.taken:  # more when it missed rounds
            return f"claims {a.taken} steps since its last round at step {m.last_step}, now at step {a.step}"
        if a.step > m.steps:
            return f"claims step {a.step} of a job of {m.steps} steps"
        bound = a.taken * g["batch_size"] * g["seq_len"] * g["dp"]
        if not (math.isfinite(a.tokens) and 0 < a.tokens <= bound):
            return f"claims {a.tokens:g} tokens; its geometry allows at most {bound}"
        return None

    def upload(self, name: str, session: str, frames: Frames) -> dict:
        """Spool the member's parameters to disk, measuring finiteness and its update's norm."""
        with self.cv:
            m = self._member(name, session)
            r = self.round
            a = r.arrivals.get(name) if r is not None and r.rid == frames.header.get("round") else None
            if a is None or a.heal or a.uploading or a.uploaded:
                raise HubError(f"facility {name} has no upload pending in this round", "FAILED_PRECONDITION")
            a.uploading, a.spool = True, self.spool / f"{r.rid}-{name}.bin"
        try:
            a.norm = self._spool(frames, a.spool)
            a.uploaded = True
        except WireError as exc:
            a.reason = f"malformed upload ({exc})"
        except Exception as exc:  # noqa: BLE001 - the member's connection broke mid-upload
            a.reason = f"upload broken off ({str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__})"
        finally:
            with self.cv:
                a.uploading = False
                m.beat = time.monotonic()
                self.cv.notify_all()
        return {"ok": a.uploaded, "reason": a.reason}

    def _spool(self, frames: Frames, path: Path) -> float:
        """Write the chunks to ``path``; the norm of the update ``θ_global - θ_f`` (nan when not finite)."""
        if self.codec is not None:
            with open(path, "wb") as fh:
                for _, chunk in frames.chunks():
                    fh.write(chunk)
            return self._update_norm(path)
        squares = 0.0
        theta = self.theta
        with open(path, "wb") as fh:
            for offset, chunk in frames.chunks():
                if offset % 4 or len(chunk) % 4:
                    raise WireError("a frame that splits a value")
                fh.write(chunk)
                if math.isfinite(squares):  # read in place: the frame is never copied
                    squares += _squares(np.frombuffer(chunk, dtype=np.float32), theta, offset // 4)
        return math.sqrt(squares) if math.isfinite(squares) else math.nan

    def _update_norm(self, path: Path) -> float:
        squares = 0.0
        with open(path, "rb") as fh:
            for _, values in self.codec.decode_stream(fh.read):
                squares += _squares(values.numpy(), None, 0)
                if not math.isfinite(squares):
                    return math.nan
        return math.sqrt(squares)

    def _closable(self, r: Round, now: float) -> bool:
        live = {n for n, m in self.members.items() if m.live(now)}
        uploads_done = all(
            a.heal or a.uploaded or a.reason is not None or (not a.uploading and n not in live)
            for n, a in r.arrivals.items()
        )
        everyone = live <= set(r.arrivals)
        return uploads_done and (everyone or now - r.opened >= float(self.spec["grace_s"]))

    def _commit_loop(self) -> None:
        while not self._stop.is_set():
            with self.cv:
                r = self.round
                if r is None or r.closing or not self._closable(r, time.monotonic()):
                    self.cv.wait(timeout=0.2)
                    continue
                r.closing = True
                while self.readers:
                    self.cv.wait(timeout=0.2)
                self.writing = True
            try:
                outcome = self._commit(r)
            except Exception as exc:  # noqa: BLE001 - a round that cannot commit commits nothing
                outcome = {"committed": False, "error": f"{type(exc).__name__}: {exc}"}
                self.log(f"hub: round {r.rid} failed to commit ({outcome['error']}); version stays {self.version}")
            with self.cv:
                self.writing = False
                r.outcome = {**outcome, **self._public()}
                self.decided[r.rid] = r
                for old in [k for k in self.decided if k < r.rid - 8]:
                    del self.decided[old]
                self.round = None
                self.cv.notify_all()

    def _judge(self, r: Round) -> dict[str, str]:
        """Per uploaded contribution, why it is rejected (absent: accepted)."""
        out = {n: a.reason for n, a in r.arrivals.items() if a.reason is not None and not a.heal}
        out.update({n: "no upload" for n, a in r.arrivals.items() if not a.heal and not a.uploaded and n not in out})
        up = {n: a for n, a in r.arrivals.items() if a.uploaded and n not in out}
        for n, a in up.items():
            if not math.isfinite(a.norm):
                out[n] = "not finite"
        norms = [a.norm for n, a in up.items() if n not in out]
        ratio = float(self.spec.get("max_norm_ratio") or 0)
        for n, a in up.items():
            if n in out or ratio <= 0:
                continue
            ref = statistics.median(norms) if len(norms) >= 3 else None
            own = self.members[n].norms
            if ref is None and len(own) >= 2:
                ref = statistics.median(own)
            if ref is not None and ref > 0 and a.norm > ratio * ref:
                out[n] = f"update norm {a.norm:.3g} is over {ratio:g}x the median {ref:.3g}"
        return out

    def _weights(self, accepted: dict[str, Arrival]) -> dict[str, float]:
        rule = self.spec.get("weights_rule")
        if rule is None:
            paced = bool(self.spec.get("paced"))
            rule = "tokens" if paced or len({a.taken for a in accepted.values()}) > 1 else "uniform"
        return {n: (a.tokens if rule == "tokens" else 1.0) for n, a in accepted.items()}

    @torch.no_grad()
    def _commit(self, r: Round) -> dict:
        start = time.perf_counter()
        rejected = self._judge(r)
        accepted = {n: a for n, a in sorted(r.arrivals.items()) if not a.heal and n not in rejected}
        healed = {n: a.reason for n, a in r.arrivals.items() if a.heal}
        for n, why in rejected.items():
            self.log(f"hub: round {r.rid}: facility {n}'s contribution rejected: {why}")
        if not accepted:
            return {"committed": False, "accepted": {}, "rejected": rejected, "healed": healed}
        weights = self._weights(accepted)
        total = sum(weights.values())
        acc = self.acc = self.acc if self.acc is not None else torch.empty_like(self.theta)
        acc.zero_()
        for n, a in accepted.items():
            self._accumulate(acc, a.spool, weights[n] / total)
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
        return {"committed": True, "accepted": {n: weights[n] / total for n in accepted}, "rejected": rejected,
                "healed": healed}  # fmt: skip

    def _accumulate(self, acc: Tensor, path: Path, scale: float) -> None:
        if self.codec is not None:
            with open(path, "rb") as fh:
                for start, values in self.codec.decode_stream(fh.read):
                    acc[start : start + values.numel()].add_(values, alpha=scale)
            path.unlink(missing_ok=True)
            return
        with open(path, "rb") as fh:
            offset, x = 0, torch.empty(_SLICE, dtype=torch.float32)
            while got := fh.readinto(memoryview(x.numpy()).cast("B")):
                n = got // 4
                acc[offset : offset + n].add_(x[:n], alpha=scale)
                offset += n
        path.unlink(missing_ok=True)

    def _advance(self, r: Round, accepted: dict[str, Arrival]) -> None:
        s = self.snap
        s.version += 1
        for n, a in r.arrivals.items():
            m = self.members[n]
            m.last_step = a.step
            if n in accepted:
                m.norms = (m.norms + [a.norm])[-HISTORY:]
        s.progress = max([s.progress] + [a.step // self.members[n].every for n, a in accepted.items()
                                          if self.members[n].every])  # fmt: skip
        s.ended = s.ended or any(a.step >= self.members[n].steps for n, a in accepted.items())

    # ------------------------------------------------------------------ θ_global out
    def result(self, name: str, session: str, rid: int | None, active) -> Iterator[bytes]:
        """After round ``rid`` is decided (or now, for a heal outside a round): the member's status and
        θ_global. ``active()``: False once the member's call is gone."""
        with self.cv:
            self._member(name, session)
            while rid is not None and rid not in self.decided:
                if self._stop.is_set() or not active():
                    raise HubError("the hub is stopping", "UNAVAILABLE")
                self.cv.wait(timeout=0.5)
            header = self._status(name, self.decided[rid].outcome if rid is not None else None)
        return self._theta_frames(header)

    def _status(self, name: str, outcome: dict | None) -> dict:
        if outcome is None:
            return {"status": "healed", "reason": "heal", **self._public()}
        if name in outcome.get("accepted", {}):
            status, reason = "accepted", None
        elif name in outcome.get("rejected", {}):
            status, reason = "rejected", outcome["rejected"][name]
        else:
            status, reason = "healed", outcome.get("healed", {}).get(name)
        return {"status": status, "reason": reason, **{k: outcome[k] for k in ("committed", "accepted", "rejected")},
                **{k: outcome[k] for k in ("version", "progress", "ended", "live")}}  # fmt: skip

    def fetch(self, name: str, session: str) -> Iterator[bytes]:
        with self.cv:
            self._member(name, session)
            header = {"status": "healed", "reason": "join", **self._public()}
        return self._theta_frames(header)

    def _theta_frames(self, header: dict) -> Iterator[bytes]:
        """θ_global's frames; the committer waits until every stream reading it has finished."""
        with self.cv:
            while self.writing:
                self.cv.wait(timeout=0.2)
            if header.get("version", self.version) != self.version:  # a newer round committed meanwhile
                header = {**header, **self._public()}
            self.readers += 1
        try:
            yield from frames_of(header, self.theta)
        finally:
            with self.cv:
                self.readers -= 1
                self.cv.notify_all()
