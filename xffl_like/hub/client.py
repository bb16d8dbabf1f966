"""The facility's side of the hub's protocol: a leader's link to the hub (``federation.elastic.hub``), gRPC
over mutual TLS, outbound only.

The leader joins (creating the federation when it is the first, or downloading θ_global), beats
every :data:`BEAT_S` from a daemon thread, and at each boundary arrives, uploads its parameters
when the hub wants them and downloads θ_global once the round is decided. A hub that does not
answer costs the round, not the job: the facility trains on and tries again at a later boundary
(backing off: :data:`~.protocol.retry.ROUND_RETRY`), and the hub's version tells it on return whether it
missed a commit. Every call has a deadline (:meth:`HubLink.deadline`: a stream's includes the round's ``grace_s``
and its bytes at the protocol's minimum rate); one that expires is a missed round too. It imports
:mod:`.protocol` (messages, wire, the federation's description, the retry
policy), never the hub's server.
"""

from __future__ import annotations

import math
import os
import threading
import time
import uuid
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # gRPC core's own info lines (a refused handshake) stay quiet
import grpc  # noqa: E402 - after its verbosity is set

from .protocol.dial import ElasticError, address  # noqa: E402
from .protocol.messages import CALLS, HubView, JoinReply, ResultHeader, UploadHeader, UploadReply  # noqa: E402
from .protocol.relay import buffer_names, outer_of  # noqa: E402
from .protocol.retry import LIVE_S, POLL_RETRY, ROUND_RETRY  # noqa: E402
from .protocol.spec import codec_of, hub_spec  # noqa: E402
from .protocol.wire import GRPC_OPTIONS, SERVICE, Frames, WireError, frames_of_file, transfer_s  # noqa: E402

__all__ = ["BEAT_S", "HubLink", "explain", "hub_link"]

BEAT_S = 1.0
_WAIT_LINE_S = 10.0


def explain(exc: grpc.RpcError, hub: str) -> str:
    """One line for a failed call: what went wrong with the hub ``hub`` and the fix."""
    code, details = exc.code(), (exc.details() or "").splitlines()[0][:200] if exc.details() else ""
    low = details.lower()
    if code == grpc.StatusCode.UNAVAILABLE:
        if "not in peer certificate" in low or "hostname" in low:
            return (
                f"the hub at {hub} presented a certificate that does not name the host dialled ({details}): dial a "
                f"name given to `python -m xffl_like.hub init --host`, or issue the hub a certificate for it"
            )
        if "ssl" in low or "handshake" in low or "certificate" in low or "tls" in low:
            return (
                f"the TLS handshake with the hub at {hub} failed ({details}): federation.elastic.ca must be the hub's "
                f"ca.crt and cert/key a pair it issued (python -m xffl_like.hub add DIR NAME)"
            )
        return (
            f"the hub at {hub} does not answer ({details or 'unavailable'}): is `python -m xffl_like.hub serve` "
            f"running there and reachable from this node (or through the relay)? A hub that serves TLS closes a "
            f"plaintext connection too: give federation.elastic.ca, cert and key"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"the hub at {hub} did not answer in time: is it overloaded or the link down?"
    return f"the hub at {hub} refused this facility: {details}"


class _Cancelled(Exception):
    """A stop request ended a wait of the join, or cut an upload in flight."""


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


class HubLink:
    """The leader's side of the hub's protocol (:mod:`.protocol`); its calls answer :mod:`.protocol.messages`."""

    def __init__(self, cfg, name: str, spec: dict, geometry: dict, steps: int, every: int | None):
        self.cfg, self.name, self.spec, self.geometry = cfg, name, spec, geometry
        self.steps, self.every, self.hub = steps, every, cfg.hub
        self.session = uuid.uuid4().hex
        self.version = 0
        self.federation: str | None = None  # the id of the federation joined (a hub started --fresh holds another)
        self.insecure = cfg.cert is None
        host, port = address(cfg.hub, "federation.elastic.hub")
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if self.insecure:
            self.channel = grpc.insecure_channel(target, options=GRPC_OPTIONS)
        else:
            creds = grpc.ssl_channel_credentials(_read(cfg.ca), _read(cfg.key), _read(cfg.cert))
            self.channel = grpc.secure_channel(target, creds, options=GRPC_OPTIONS)
        self._beat: threading.Thread | None = None
        self._stop = threading.Event()
        self._call = None  # the call in flight that :meth:`cancel` may cut
        self._cancelled = threading.Event()  # a stop request: the waits of a join end too
        self.backoff_until = 0.0
        self.missed = 0
        # With compression a round's result is relayed (the other members' messages, :mod:`.protocol.relay`), and
        # θ_global in full comes with the outer optimizer's buffers.
        self.codec = codec_of(spec)
        self.buffers = buffer_names(outer_of(spec)) if self.codec is not None else ()
        self.up = self.down = 0  # bytes sent and received in the round (payload and headers)

    # ------------------------------------------------------------------ calls
    def _msg(self, **kw) -> dict:
        kw.setdefault("session", self.session)
        if self.insecure:
            kw["facility"] = self.name
        return kw

    def unary(self, method: str, timeout: float | None = None, **kw):
        """The unary call ``method`` with the keys ``kw`` (checked as its request); its answer's message."""
        request, reply = CALLS[method]
        call = self.channel.unary_unary(f"/{SERVICE}/{method}")
        return reply.decode(
            call(request.from_json(self._msg(**kw)).encode(), timeout=timeout or float(self.cfg.timeout_s))
        )

    def deadline(self, nbytes: int, wait: bool) -> float:
        """Seconds a stream of ``nbytes`` may take: ``timeout_s``, the round's ``grace_s`` when it waits for
        the round to close, and the bytes at :data:`~.protocol.wire.MIN_RATE` (the hub cuts a slower one too)."""
        grace = float(self.spec.get("grace_s") or 0.0) if wait else 0.0
        return transfer_s(nbytes, float(self.cfg.timeout_s) + grace)

    def _stream(self, method: str, **kw):
        request = CALLS[method][0].from_json(self._msg(**kw))
        timeout = self.deadline(self.full_bytes, wait=method == "Result")
        call = self.channel.unary_stream(f"/{SERVICE}/{method}")(request.encode(), timeout=timeout)
        self._call = call
        if self._cancelled.is_set():  # :meth:`cancel` set the flag, then found no call to cut: cut this one
            call.cancel()
        return call

    def _upload(self, path: Path, kind: str, rid: int | None = None) -> HubView | UploadReply:
        """Upload the spooled file ``path`` (parameters, or an encoded update), a frame at a time."""
        header = UploadHeader.from_json(self._msg(kind=kind, round=rid))
        call = self.channel.stream_unary(f"/{SERVICE}/Upload")
        timeout = self.deadline(Path(path).stat().st_size, wait=True)
        future = self._call = call.future(frames_of_file(header.to_json(), path), timeout=timeout)
        if self._cancelled.is_set():  # a stop request between the call's start and ``_call``: cut it here
            future.cancel()
        try:
            answer = future.result()
        except grpc.FutureCancelledError:  # cut by :meth:`cancel` (a stop request), not an RpcError
            raise _Cancelled from None
        out = (HubView if kind == "create" else UploadReply).decode(answer)
        self._call = None
        self.up += Path(path).stat().st_size
        return out

    def upload_round(self, path: Path, rid: int, parameters: bool) -> None:
        """This facility's contribution to round ``rid``: the file ``path`` of its parameters (``parameters``), or
        of its encoded update."""
        self._upload(path, "round", rid)

    def claim(self, tokens: float) -> float:
        """The tokens this facility claims for the round (those it trained on since its last one)."""
        return tokens

    @property
    def full_bytes(self) -> int:
        """The bytes of θ_global in full (with compression, and the outer optimizer's buffers after it)."""
        return 4 * self.geometry_numel * (1 + len(self.buffers))

    def _download(self, call, path: Path, outer: Path | None = None, relay: Path | None = None) -> ResultHeader:
        """θ_global into the file ``path`` (with compression, the outer buffers into ``outer``), or a relay's
        messages into ``relay``, a frame at a time, each file replaced only once whole; the result's header."""

        def expect(header: ResultHeader) -> int:
            if header.relay is None or relay is None or self.codec is None:
                return self.full_bytes
            return min(header.nbytes, len(header.relay.order) * self.codec.nbytes)  # more: refused, not written

        frames = Frames(call, expect, ResultHeader)
        header = frames.header
        if header.relay is None and self.codec is not None and header.outer_steps is None:
            raise WireError("θ_global came without the outer optimizer's state")
        if header.relay is not None and relay is None:  # a round of fp32 parameters relays nothing
            raise WireError("a relay came where θ_global was expected (a round of fp32 parameters)")
        targets = [(relay, header.nbytes)] if header.relay is not None else [(path, 4 * self.geometry_numel)]
        if header.relay is None and self.buffers:
            outer = outer or Path(path).with_name(f"{Path(path).name}.outer")
            targets.append((outer, self.full_bytes - 4 * self.geometry_numel))
        _to_files(frames, targets)
        self._call = None
        self.down += len(header.encode()) + header.nbytes
        return header

    def cancel(self) -> None:
        """Cut the call in flight and end a join's waits (a stop request while waiting at the hub). The flag is
        set first: a call started meanwhile sees it once it is ``_call`` (:meth:`_upload`, :meth:`_stream`)."""
        self._cancelled.set()
        call = self._call
        if call is not None:
            call.cancel()

    # ------------------------------------------------------------------ membership
    def probe(self) -> None:
        """The launcher's check before workers start: the hub answers, admits this identity and description.
        A process of this facility's name still live at the hub (ALREADY_EXISTS) is waited for once, up to twice
        the hub's liveness window (:data:`~.protocol.retry.LIVE_S`): a facility restarted within seconds of its
        death finds its old heartbeat lapsed then; a twin that keeps beating is still refused, in one line."""
        until, said = time.monotonic() + 2 * LIVE_S, False
        while True:
            try:
                out = self.unary(
                    "Join", spec=self.spec, geometry=self.geometry, steps=self.steps, every=self.every, probe=True
                )
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.ALREADY_EXISTS or time.monotonic() >= until:
                    raise ElasticError(f"facility {self.name}: {explain(exc, self.hub)}") from None
                if not said:
                    print(
                        f"facility {self.name}: a process of this name is still live at the hub {self.hub}; waiting "
                        f"up to {2 * LIVE_S:.0f} s for its heartbeat to lapse (a restart soon after a kill)",
                        flush=True,
                    )
                    said = True
                time.sleep(min(LIVE_S / 10, max(0.0, until - time.monotonic())))
        self._refuse_if_ended(out)

    def _refuse_if_ended(self, out: HubView | JoinReply) -> None:
        """A federation that ended (its facilities reached their train.steps) trains no more: joining it would
        train nothing, or alone from its last θ_global. One line; the job exits non-zero."""
        if out.ended:
            raise ElasticError(
                f"facility {self.name}: the federation at the hub {self.hub} has ended (its facilities reached their "
                f"train.steps, after {out.version} rounds): nothing is left to train; to train again, serve a "
                f"new federation (python -m xffl_like.hub serve with another --state)"
            )

    def join(self, mine: Path, theta: Path, done: int, min_facilities: int, outer: Path | None = None,
             pending: tuple[int, int] | None = None) -> dict:  # fmt: skip
        """Join: this facility's parameters (the file ``mine``) create the federation, or θ_global is
        downloaded into the file ``theta`` (with compression, the outer buffers into ``outer``). Returns the
        leader's round result. ``pending``: (step, version) of the round whose upload this facility holds, resumed
        from a checkpoint (``federation.delay=1``); the result's ``pending`` is the hub's answer
        (:class:`~.protocol.messages.JoinReply`), and to ``open`` nothing is downloaded (status ``resumed``: the
        facility holds that version, and uploads that round next)."""
        self.up = self.down = 0
        try:
            return self._join(mine, theta, done, min_facilities, outer, pending)
        except _Cancelled:
            return self._left(done, "joining")
        except grpc.RpcError as exc:
            if self._cancelled.is_set():
                return self._left(done, "joining")
            raise ElasticError(f"facility {self.name}: {explain(exc, self.hub)}") from None

    def _join(self, mine: Path, theta: Path, done: int, min_facilities: int, outer: Path | None = None,
              pending: tuple[int, int] | None = None) -> dict:  # fmt: skip
        said = [time.monotonic()]
        named = {"pending_step": pending[0], "pending_version": pending[1]} if pending is not None else {}

        def join() -> JoinReply:
            out = self.unary("Join", spec=self.spec, geometry=self.geometry, steps=self.steps, every=self.every,
                             **named)  # fmt: skip
            if out.status == "retry" and time.monotonic() - said[0] > _WAIT_LINE_S:
                what = (f"its round at step {pending[0]} holds an upload of this facility's earlier process; waiting "
                        f"for the hub to decide it" if pending is not None and out.federation is not None else
                        f"another facility is creating the federation at the hub {self.hub}; waiting (it has "
                        f"federation.elastic.grace_s to upload its parameters, or loses the role)")  # fmt: skip
                print(f"facility {self.name}: {what}", flush=True)
                said[0] = time.monotonic()
            return out

        out = POLL_RETRY.poll(join, lambda out: out.status != "retry", self._pause)  # another one creates it
        self._refuse_if_ended(out)  # it ended since the launcher's probe
        self._start_beats()
        self.federation = out.federation
        if out.status == "create":
            view = self._upload(mine, "create")
            self.version, self.federation = view.version, view.federation
            self._wait_for(min_facilities)
            return self._result(view, done, changed=False, healed=[], status="created")
        self._wait_for(min_facilities)
        if out.pending == "open":  # the round at its step is still to come: the facility uploads it as it is
            self.version = out.version
            return {**self._result(out, done, changed=False, healed=[], status="resumed"), "pending": "open"}
        header = self._download(self._stream("Fetch"), theta, outer)
        self.version, self.federation = header.version, header.federation or self.federation
        result = self._result(header, self._federation_step(header, done), changed=True, healed=[self.name],
                              status="joined")  # fmt: skip
        return {**result, "pending": out.pending, "share": out.share}

    def _federation_step(self, header: ResultHeader, done: int) -> int:
        """The step this facility trains on from after receiving the version of ``header``: with a fixed ``every``
        the federation's, its rounds times this facility's ``every`` (a joiner's, and a facility's whose step
        was not the federation's: it missed rounds, or trained through them); with ``every_s`` its own."""
        return done if self.cfg_every_s else min(header.progress * int(self.every), self.steps)

    @property
    def cfg_every_s(self) -> bool:
        return self.spec.get("every_s") is not None

    def _wait_for(self, n: int) -> None:
        said = [0.0]

        def enough(view: HubView) -> bool:
            if len(view.live) >= n:
                return True
            if time.monotonic() - said[0] > _WAIT_LINE_S:
                print(f"facility {self.name}: waiting for {n - len(view.live)} more facilities at the hub {self.hub}",
                      flush=True)  # fmt: skip
                said[0] = time.monotonic()
            return False

        POLL_RETRY.poll(lambda: self.unary("Beat"), enough, self._pause)

    def _pause(self, seconds: float) -> None:
        if self._cancelled.wait(seconds):
            raise _Cancelled

    def _start_beats(self) -> None:
        if self._beat is not None:
            return

        def run():
            while not self._stop.wait(BEAT_S):
                try:
                    self.unary("Beat", timeout=5.0)
                except grpc.RpcError:
                    pass  # a missed beat is the hub's to judge; rounds say what went wrong

        self._beat = threading.Thread(target=run, name="xffl-hub-beat", daemon=True)
        self._beat.start()

    def leave(self) -> None:
        self._stop.set()
        try:
            self.unary("Leave", timeout=5.0)
        except grpc.RpcError:
            pass  # the hub notices the missing heartbeats
        self.channel.close()

    # ------------------------------------------------------------------ rounds
    def round(self, mine: Path, theta: Path, done: int, tokens: float, taken: int, message: Path | None = None,
              outer: Path | None = None, relay: Path | None = None) -> dict:  # fmt: skip
        """The round at this boundary: the file ``mine`` (this facility's parameters, or with compression the
        file ``message`` of its encoded update) goes up; θ_global comes back into the file ``theta`` (with
        compression, the outer buffers into ``outer``), or, to a member accepted in a compressed round, the other
        members' messages into the file ``relay`` (``out["relay"]``: the facility applies the round itself, then
        calls :meth:`applied`, or :meth:`heal`)."""
        self.up = self.down = 0
        if time.monotonic() < self.backoff_until:
            return self._missed(done, "the hub did not answer at an earlier boundary")
        tokens = self.claim(tokens)
        try:
            arrived = self.unary("Arrive", version=self.version, step=done, taken=taken, tokens=tokens)
            if arrived.action == "upload":
                self.upload_round(mine if message is None else message, arrived.round, parameters=message is None)
            elif arrived.reason:
                print(f"facility {self.name}: heals this round ({arrived.reason})", flush=True)
            header = self._download(self._stream("Result", round=arrived.round), theta, outer, relay)
        except WireError as exc:  # nothing was written: θ_global in full instead
            return self.heal(theta, outer, done, f"the hub's result does not match ({exc})")
        except _Cancelled:  # a stop request while this facility's upload was going up
            return self._left(done, "uploading its round")
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:  # a stop request while waiting: the trainer leaves next
                return self._left(done, "waiting in the round")
            if exc.code() in (grpc.StatusCode.NOT_FOUND,):
                self._rejoin(done)
            self.missed += 1
            self.backoff_until = time.monotonic() + ROUND_RETRY.delay(self.missed)
            return self._missed(done, explain(exc, self.hub))
        self._same_federation(header.federation, header.version, done)
        if header.status == "missed":  # the hub could not commit the round: nothing changed
            return self._missed(done, f"the hub could not commit it: {header.reason}")
        self.missed = 0
        if header.relay is None:  # a relay's version is this facility's once it applied it (:meth:`applied`)
            self.version = header.version
        if header.status == "rejected":
            print(f"facility {self.name}: the hub rejected this facility's contribution ({header.reason}); "
                  f"it heals to θ_global", flush=True)  # fmt: skip
        healed = [] if header.status == "accepted" else [self.name]
        step = self._federation_step(header, done)
        if step != done:
            print(f"facility {self.name}: realigned from step {done} to the federation's step {step} (version "
                  f"{header.version}); its data keep their position", flush=True)  # fmt: skip
        return self._result(header, step, changed=True, healed=healed, status=header.status)

    def until_final(self, attempt, out: dict, done: int, bound_s: float) -> dict:
        """The federation's final round, from this facility's last step ``done``: while it is missed (the hub down,
        this facility's backoff, a commit that failed), ``attempt()`` it again after the retry policy's delay, for at
        most ``bound_s`` seconds (``federation.elastic.final_wait_s``); then one line (:class:`ElasticError`): an
        export without the final version would not be the federation's. A stop request cuts the wait."""
        deadline, tries = time.monotonic() + bound_s, 0
        while out["status"] == "missed":
            pause = max(self.backoff_until - time.monotonic(), ROUND_RETRY.delay(tries))
            if time.monotonic() + pause > deadline:
                raise ElasticError(
                    f"facility {self.name}: the federation's final version did not come from the hub {self.hub} "
                    f"within federation.elastic.final_wait_s={bound_s:g} s (last: {out['reason']}): this facility's "
                    f"model is not the federation's, so it exports nothing; the hub's final θ_global is in its --state"
                )
            if self._cancelled.wait(pause):
                return self._left(done, "waiting for the federation's final version")
            out, tries = attempt(), tries + 1
        return out

    def applied(self, version: int) -> None:
        """The relayed round to ``version`` was applied: this facility holds that version."""
        self.version = version

    def heal(self, theta: Path, outer: Path | None, done: int, why: str) -> dict:
        """θ_global in full now (``Fetch``; with compression the outer buffers too), after ``why`` (one line): a
        relay or result that did not match. If that fails too, the round counts as missed and the next one
        heals (this facility's version is left as it was)."""
        print(f"facility {self.name}: {why}; it heals (downloads θ_global in full)", flush=True)
        try:
            header = self._download(self._stream("Fetch"), theta, outer)
        except (grpc.RpcError, WireError) as exc:
            detail = explain(exc, self.hub) if isinstance(exc, grpc.RpcError) else str(exc)
            return self._missed(done, f"{why}; healing failed too ({detail})")
        self._same_federation(header.federation, header.version, done)
        self.version = header.version
        return self._result(header, self._federation_step(header, done), changed=True, healed=[self.name],
                            status="healed")  # fmt: skip

    def _rejoin(self, done: int) -> None:
        self.session = uuid.uuid4().hex
        try:
            out = self.unary("Join", spec=self.spec, geometry=self.geometry, steps=self.steps, every=self.every)
        except grpc.RpcError:
            return  # the round is missed; the next boundary tries again
        self._same_federation(out.federation, out.version, done)

    def _same_federation(self, federation: str | None, version: int, done: int) -> None:
        """The hub still holds the federation this facility joined; else one line, and the job stops: its
        rounds would count for nothing (a hub started with --fresh, or on another --state, holds another)."""
        if self.federation is None or federation == self.federation:
            return
        now = "no federation yet" if federation is None else f"another federation, at version {version}"
        raise ElasticError(
            f"facility {self.name}: the hub {self.hub} no longer holds the federation this facility joined (it "
            f"holds {now}; was it restarted with --fresh or another --state?): stopped at step {done}; to train "
            f"in the new federation, start this facility's job again (resume= keeps its progress)"
        )

    def _left(self, done: int, where: str) -> dict:
        print(f"facility {self.name}: a stop request while {where} at the hub {self.hub}; it leaves", flush=True)
        why = f"a stop request while {where}"
        return {"round": self.version, "step": done, "changed": False, "bytes": 0, "ended": False, "healed": [],
                "facilities": [], "attempts": 1, "status": "left", "reason": why}  # fmt: skip

    def _missed(self, done: int, why: str) -> dict:
        print(f"facility {self.name}: round at step {done} missed ({why}); training on", flush=True)
        return {"round": self.version, "step": done, "changed": False, "bytes": 0, "ended": False, "healed": [],
                "facilities": [], "attempts": 1, "status": "missed", "reason": why}  # fmt: skip

    def _result(self, header: ResultHeader | HubView, step: int, changed: bool, healed: list, status: str) -> dict:
        accepted = getattr(header, "accepted", None) or {}
        return {
            "round": header.version,
            "step": step,
            "changed": changed,
            "bytes": self.up + self.down,
            "bytes_up": self.up,
            "bytes_down": self.down,
            "relay": getattr(header, "relay", None),
            "relay_bytes": header.nbytes if getattr(header, "relay", None) is not None else 0,
            "outer_steps": getattr(header, "outer_steps", None),
            "ended": header.ended,
            "healed": healed,
            "facilities": sorted(accepted or header.live),
            "attempts": 1,
            "status": status,
            "reason": getattr(header, "reason", None),
            "rejected": getattr(header, "rejected", None) or {},
            "weights": accepted,
        }

    @property
    def geometry_numel(self) -> int:
        return sum(math.prod(p[1]) for p in self.spec["parameters"])


def _to_files(frames: Frames, targets: list[tuple[Path, int]]) -> None:
    """``frames``' bytes into the files of ``targets`` in turn (each its path and bytes), each written beside it and
    moved over it only once every byte arrived (a broken download leaves the files as they were)."""
    parts = [(Path(path), Path(path).with_name(f"{Path(path).name}.part"), n) for path, n in targets]
    chunks = frames.chunks()
    try:
        pending = b""
        for _, part, n in parts:
            with open(part, "wb") as fh:
                left = n
                while left:
                    data = pending or next(chunks)[1]
                    fh.write(data[:left])
                    pending, left = data[left:], left - min(left, len(data))
        for _ in chunks:  # the end of the stream: Frames checks the count
            pass
        for path, part, _ in parts:
            os.replace(part, path)
    finally:
        for _, part, _ in parts:
            part.unlink(missing_ok=True)


def hub_link(job, name: str, world_size: int):
    """This facility leader's :class:`HubLink` (``federation.elastic.hub``)."""
    t = job.train
    geometry = {"batch_size": t.batch_size * t.grad_accum, "seq_len": t.seq_len, "dp": world_size}
    every = job.federation.every if job.federation.every_s is None else None
    return HubLink(job.federation.elastic, name, hub_spec(job), geometry, t.steps, every)
