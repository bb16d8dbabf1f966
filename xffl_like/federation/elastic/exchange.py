"""A facility's side of the rounds held by the hub: :class:`ElasticFederation`.

Facilities differ in size and sharding, so what crosses is between each facility's leader (rank 0 of
its own world) and the hub (:mod:`xffl_like.hub`), on full, flat fp32 vectors of the parameters, which
the leader streams through files (its spool, under the run directory) and never holds whole:

1. every rank of the facility takes part in gathering the full parameters, one at a time, into the
   leader's spool file;
2. the leader arrives at the hub (:class:`xffl_like.hub.client.HubLink`) and uploads that file a frame at a time, or
   with ``federation.compression`` the encoding of its update ``θ_global - θ_f`` plus its error-feedback
   residual (encoded window by window from ``ef.f32``, θ_global and the residual folded together, a file of
   its spool like the others), while the other ranks wait on a small broadcast every second;
3. the hub decides the round (who arrived within ``grace_s``, whose contribution passes its checks),
   applies the weighted mean and the outer step, saves, and sends θ_global back into a second file,
   which the leader broadcasts to its facility one parameter at a time; each rank copies its own shard.
   With compression, an accepted facility receives instead the other accepted facilities' messages and
   applies the round itself, as the hub did (:mod:`.downlink`): its leader keeps θ_global and the outer
   optimizer's buffers in its spool, and heals (θ_global in full) when a relay does not match.

A facility whose version differs from the hub's (a joiner, a restart, a missed commit), whose step is not
the federation's (with a fixed ``every``) or whose contribution is rejected heals: it receives θ_global,
contributes nothing to that round and takes the federation's step (the round's record carries it). A hub that
does not answer costs the round, not the job, except the last: at its last step a facility asks again until
the federation's final version comes (``federation.elastic.final_wait_s``). The facility's checkpoint keeps
its model, inner optimizer, data position and version; θ_global and the outer state live at the hub (with
``federation.delay=1`` it keeps the round still to go up too: :mod:`.delayed`).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from ...config.schema import OuterConfig
from ...distributed.signals import requested
from ...distributed.state import to_local
from ...hub.protocol import relay
from ...hub.protocol.spec import final_in_fp32
from ...hub.protocol.update_codec import UpdateCodec
from ..clock import round_clock
from ..options import rounds_description
from ..protocol import Boundary, RoundClock
from ..record import RoundRecord
from ..topk_tensors import options_of
from .downlink import apply_relay, zero_outer

__all__ = ["ElasticFederation"]

_WINDOW = 1 << 22  # values read, encoded or folded at a time by the leader (16 MB of fp32)


class _Spool:
    """The leader's files for one round: its parameters, θ_global, the encoded update, its residual, and with
    compression ``ef`` (θ_global plus the residual it carries, what the next update is taken from)."""

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.mine, self.theta = directory / "parameters.f32", directory / "theta_global.f32"
        self.message, self.residual = directory / "update.bin", directory / "residual.f32"
        self.ef = directory / "ef.f32"  # compressed: θ_global + this facility's residual, between rounds
        self.outer, self.relay = directory / "outer.f32", directory / "relay.bin"  # compressed: the relay downlink
        self.start = directory / "start.f32"  # federation.delay=1: where the round in flight started (its upload)

    def remove(self) -> None:
        for path in (self.mine, self.theta, self.message, self.residual, self.ef, self.outer, self.relay, self.start):
            path.unlink(missing_ok=True)
        try:
            self.directory.rmdir()
        except OSError:
            pass  # not empty: something else of the user's is there


def _read_into(fh, out: Tensor) -> Tensor:
    """Exactly ``out``'s bytes from ``fh`` into ``out`` (a contiguous CPU tensor)."""
    view = memoryview(out.numpy()).cast("B")
    got = fh.readinto(view)
    if got != len(view):
        raise OSError(f"{fh.name}: {got} bytes where {len(view)} were expected (the spool file is damaged)")
    return out


class ElasticFederation:
    """This rank's side of the rounds among facilities (collective over the facility's world); the
    training side's :class:`~..protocol.Rounds`, plus :meth:`join` and :meth:`leave`."""

    def __init__(self, cfg, model: torch.nn.Module, state, name: str, steps: int, link=None, spool=None):
        """``steps``: this facility's steps in the job; ``link``: the leader's :class:`~xffl_like.hub.client.HubLink`
        (None on the other ranks); ``spool``: the leader's directory for what crosses (the run directory's
        ``.hub-spool`` by default)."""
        self.options, self.state, self.name, self.steps = cfg, state, name, steps
        self.model = model
        self.params = list(model.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.leader = state.rank == 0
        self.round = 0  # the federation's version (rounds the hub committed) this facility holds
        self.tokens = 0.0  # tokens this rank trained since its facility's last round
        self.records: list[RoundRecord] = []  # per round this facility took part in: members, healed, attempts
        self.ended = False  # federation.every_s: the last round made ended the job
        self.last_step = 0  # this facility's steps at its last round (or join)
        self.link = link
        # Where this facility's rounds end: every `every` of its steps, or by its own step time (every_s).
        self.clock: RoundClock = round_clock(cfg, state, steps, elastic=True)
        self.codec: UpdateCodec | None = None
        self.outer_steps = 0  # with compression: the outer optimizer's steps in files.outer (the leader's)
        if self.leader:
            self.files = _Spool(Path(spool) if spool is not None else Path.cwd() / ".hub-spool")
            if cfg.compression != "none":
                topk = options_of(cfg.topk, cfg.chunk_size) if cfg.compression == "topk" else None
                shapes = [list(p.shape) for p in self.params]  # the hub's spec: the same tensors, in this order
                self.codec = UpdateCodec(cfg.compression, self.numel, cfg.chunk_size, topk, shapes)
        # SparseLoCo's error feedback decays what was not sent (federation.topk.decay); the others keep it all.
        self.decay = float(cfg.topk.decay) if cfg.compression == "topk" else 1.0

    @property
    def hub_outer(self) -> OuterConfig:
        """The hub's outer rule (``federation.outer``; :mod:`.delayed`'s eager: the carrier of the means), which a
        relayed round is applied with and whose buffers the leader's ``files.outer`` holds."""
        return self.options.outer

    # ------------------------------------------------------------------ inside the facility
    @torch.no_grad()
    def _gather(self, path: Path | None) -> None:
        """The full parameters, flat fp32, into the leader's file ``path`` one parameter at a time
        (collective): the leader never holds a second copy of the model."""
        fh = open(path, "wb") if self.leader else None
        try:
            for p in self.params:
                full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                if fh is not None:
                    full.reshape(-1).to("cpu", torch.float32).contiguous().numpy().tofile(fh)
                del full
        finally:
            if fh is not None:
                fh.close()

    @torch.no_grad()
    def _scatter(self, path: Path | None) -> None:
        """Set every rank's shards to the flat parameters of the leader's file ``path`` (collective)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        fh = open(path, "rb") if self.leader else None
        try:
            for p in self.params:
                buf = torch.empty(p.shape, dtype=torch.float32, device=self.state.device)
                if fh is not None:
                    host = buf if buf.device.type == "cpu" else torch.empty(p.shape, dtype=torch.float32)
                    _read_into(fh, host)
                    if host is not buf:
                        buf.copy_(host)
                dist.broadcast(buf, src=0)
                if isinstance(p, DTensor):  # this rank's piece, cut locally (no communication)
                    buf = distribute_tensor(buf, p.device_mesh, p.placements, src_data_rank=None).to_local()
                to_local(p).detach().copy_(buf)
        finally:
            if fh is not None:
                fh.close()

    def _while_leader_works(self, work):
        """Run ``work()`` on the leader while the other ranks wait on a small broadcast every second
        (so a long wait for other facilities never trips this facility's collective timeout);
        returns the leader's result (None elsewhere). Collective."""
        return self._await(self._spawn(work))

    def _spawn(self, work) -> dict | None:
        """Start ``work()`` in a thread of the leader (None elsewhere): the handle :meth:`_await` takes. Only
        the leader's thread runs: no collective is issued from it."""
        if not self.leader:
            return None
        handle: dict = {}

        def run():
            try:
                handle["value"] = work()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                handle["error"] = exc

        handle["thread"] = thread = threading.Thread(target=run, daemon=True, name="xffl-elastic-round")
        thread.start()
        return handle

    def _await(self, handle: dict | None):
        """The result of :meth:`_spawn`'s ``handle`` (the leader's; None elsewhere), every rank waiting on a small
        broadcast every second (a stop request cancels the leader's wait at the hub). Collective."""
        flag = torch.zeros(1, dtype=torch.int32, device=self.state.device)
        while True:
            if self.leader:
                thread = handle["thread"]
                thread.join(timeout=1.0)
                if self.link is not None and thread.is_alive() and requested() is not None:
                    self.link.cancel()  # a stop while waiting in a round: leave now, not after the round
                flag.fill_(0 if thread.is_alive() else (2 if "error" in handle else 1))
            dist.broadcast(flag, src=0)
            if int(flag.item()) != 0:
                break
        if int(flag.item()) == 2:
            if self.leader:
                raise handle["error"]
            from .options import ElasticError

            raise ElasticError(f"facility {self.name}: its leader left the federation (see rank 0's line)")
        return handle.get("value") if self.leader else None

    # ------------------------------------------------------------------ the loop's interface (protocol.Rounds)
    def trained(self, tokens: int) -> None:
        self.tokens += tokens

    def after_backward(self) -> int:
        """A local step was taken (its backward passes are done); nothing crosses facilities here."""
        return 0

    def finish(self, boundary: Boundary, index: int) -> list[RoundRecord]:
        """The round at ``boundary`` (its record): at each of the clock's boundaries."""
        return [self.round_at(boundary.step)] if boundary.finish else []

    def start(self, boundary: Boundary, index: int) -> None:
        pass  # no exchange overlaps local steps

    def join(self, step: int) -> int:
        """Before training: take part in the federation's next round as a member to heal (weight 0),
        or start it when none is live. Returns the step to train from (the federation's)."""
        return self._round(step, joining=True).step

    def round_at(self, done: int) -> RoundRecord:
        """The round after ``done`` local steps; its record."""
        return self._round(done, joining=False)

    def leave(self) -> None:
        if self.link is not None:
            self.link.leave()
        if self.leader:
            self.files.remove()

    def _round(self, done: int, joining: bool, gather: bool = True) -> RoundRecord:
        """This facility's round (or join) at the hub after ``done`` steps, in the foreground (collective);
        ``gather``: its parameters go up (False: the leader's ``files.mine`` as it is)."""
        start = time.perf_counter()
        if gather:
            self._gather(self.files.mine if self.leader else None)
        tokens = self._round_tokens()
        out = self._while_leader_works(lambda: self._lead(tokens, done, joining))
        return self._conclude(out, start, lambda: self._scatter(self.files.theta if self.leader else None))

    def _round_tokens(self) -> float:
        """The tokens this facility trained since its last round (every rank's; collective)."""
        tokens = torch.tensor([self.tokens], dtype=torch.float64, device=self.state.device)
        dist.all_reduce(tokens)
        self.tokens = 0.0
        return float(tokens.item())

    def _conclude(self, out: dict | None, start: float, take) -> RoundRecord:
        """Every rank learns the leader's round ``out`` (collective); ``take()`` makes what came back this
        facility's model when θ_global changed. The round's record (kept by the leader)."""
        header = torch.zeros(5, dtype=torch.float64, device=self.state.device)
        if self.leader:
            header.copy_(
                torch.tensor([out["round"], out["step"], float(out["changed"]), out["bytes"], float(out["ended"])])
            )
        dist.broadcast(header, src=0)
        before = self.round
        self.round, step, changed, sent = int(header[0]), int(header[1]), bool(header[2]), int(header[3])
        self.ended = bool(header[4])
        self.last_step = step
        if changed:
            take()
        # The index of the round committed here; None for a join that only healed (no mean yet).
        record = RoundRecord(
            self.round - 1 if self.round > before else None,
            step,
            None,
            seconds=time.perf_counter() - start,
            bytes_per_rank=sent if self.leader else 0,
            cross_facility_bytes=sent,
            skipped_facilities=[],
        )
        if self.leader:
            for k in ("facilities", "healed", "attempts", "status", "reason", "rejected", "bytes_up", "bytes_down"):
                if k in out:
                    setattr(record, k, out[k])
            self.records.append(record)
        return record

    # ------------------------------------------------------------------ the leader's round
    def _lead(self, tokens: float, done: int, joining: bool) -> dict:
        """Through the hub: the spooled parameters (``files.mine``) go up, θ_global comes back into
        ``files.theta`` (the hub's, bitwise)."""
        f = self.files
        if joining:
            out = self.link.join(f.mine, f.theta, done, self.options.elastic.min_facilities, outer=f.outer,
                                 pending=self._pending_claim())  # fmt: skip
            if out["status"] == "created":  # this facility's parameters are θ_global
                shutil.copyfile(f.mine, f.theta)
                if self.codec is not None:
                    zero_outer(f.outer, relay.buffer_names(self.hub_outer), self.numel)
            if self.codec is not None and out["status"] in ("created", "joined"):  # θ_global, no residual yet
                shutil.copyfile(f.theta, f.ef)
                self.outer_steps = out.get("outer_steps") or 0
            return out
        out = self._exchange(done, tokens)
        if done >= self.steps and self.options.every_s is None:  # the federation's final round: ends with its result
            bound = float(self.options.elastic.final_wait_s)
            out = self.link.until_final(lambda: self._exchange(done, tokens), out, done, bound)
        return out

    def _pending_claim(self) -> tuple[int, int] | None:
        """(step, version) of the round whose upload this facility holds from its checkpoint, which a join names
        (:mod:`.delayed`); None: nothing is pending."""
        return None

    def _exchange(self, done: int, tokens: float) -> dict:
        """This facility's round at the hub after ``done`` steps: its parameters (or encoded update) up, θ_global
        back."""
        if self.codec is None:
            f = self.files
            return self.link.round(f.mine, f.theta, done, tokens, taken=done - self.last_step)
        if done >= self.steps and final_in_fp32(self.link.spec):
            return self._round_fp32(done, tokens)
        return self._round_compressed(done, tokens)

    def _round_fp32(self, done: int, tokens: float) -> dict:
        """A compressed federation's round of fp32 parameters (its final one under ``delay_rule=eager``:
        :func:`~xffl_like.hub.protocol.spec.final_in_fp32`): ``files.mine`` goes up whole, θ_global and the outer
        buffers come back in full (a relay is refused), and ``ef`` becomes θ_global (no residual is left). No message
        is sent (``files.message`` is left as the caller made it)."""
        f = self.files
        out = self.link.round(f.mine, f.theta, done, tokens, taken=done - self.last_step, outer=f.outer)
        if out["status"] in ("missed", "left"):
            return out
        if out.get("outer_steps") is not None:
            self.outer_steps = out["outer_steps"]
        self._refold(with_residual=False)
        return out

    def _round_compressed(self, done: int, tokens: float) -> dict:
        """Upload the encoded update ``θ_global + residual - θ_f``; keep the new residual only when the hub
        accepted it (a rejected or healed facility starts again from θ_global, without residual)."""
        f, feedback = self.files, self.options.feedback
        self._encode(feedback)
        out = self.link.round(f.mine, f.theta, done, tokens, taken=done - self.last_step, message=f.message,
                              outer=f.outer, relay=f.relay)  # fmt: skip
        if out["status"] in ("missed", "left"):
            return out  # nothing decided: θ_global and the residual stay as they were
        accepted = out["status"] == "accepted"
        out = self._apply_relay(out, done) if out.get("relay") is not None else out
        if out["status"] == "missed":
            return out  # the relay did not match and healing failed: the next round heals
        if out.get("outer_steps") is not None:
            self.outer_steps = out["outer_steps"]
        self._refold(with_residual=feedback and accepted)
        return out

    def _apply_relay(self, out: dict, done: int) -> dict:
        """The relayed round applied here (:mod:`.downlink`), every claim checked first; on a mismatch one line,
        and θ_global is downloaded in full instead (the result of :meth:`HubLink.heal`)."""
        f, header, e = self.files, out["relay"], self.options.elastic
        try:
            relay.check(header, me=self.name, version=self.round, new_version=out["round"], steps=self.outer_steps,
                        accepted=out.get("weights"), message_bytes=self.codec.nbytes,
                        nbytes=f.relay.stat().st_size)  # fmt: skip
            steps = apply_relay(f.theta, f.outer, f.message, f.relay, me=self.name, header=header, codec=self.codec,
                                options=self.hub_outer, steps=self.outer_steps, rule=e.aggregate,
                                trim=float(e.trim))  # fmt: skip
        except (ValueError, OSError) as exc:  # RelayError, a message that does not decode, a damaged spool
            return self.link.heal(f.theta, f.outer, done, f"the hub's relay does not match: {exc}")  # its bytes count
        finally:
            f.relay.unlink(missing_ok=True)
        self.link.applied(out["round"])
        return {**out, "outer_steps": steps}

    def _encode(self, feedback: bool) -> None:
        """``files.message``: the encoding of ``ef - θ_f``, a window of the codec at a time (top-k: whole tensors);
        ``files.residual``: what it lost (with error feedback). Nothing is held whole: ``ef`` is ``files.ef``, and a
        window is read :data:`_WINDOW` values at a time. With ``topk`` the carried residual ``ef - θ_global``
        (θ_global: ``files.theta``, the last one this facility holds) first decays: the update is
        ``decay * (ef - θ_global) + θ_global - θ_f``."""
        f, decay = self.files, self.decay
        with (
            open(f.ef, "rb") as ef,
            open(f.mine, "rb") as mine,
            open(f.theta if decay != 1.0 else os.devnull, "rb") as theta,
            open(f.message, "wb") as message,
            open(f.residual, "wb") as residual,
        ):
            for start, n in self.codec.windows(_WINDOW):
                update = torch.empty(n, dtype=torch.float32)
                for at in range(0, n, _WINDOW):
                    part = update[at : at + _WINDOW]
                    held = _read_into(ef, torch.empty_like(part))
                    torch.sub(held, _read_into(mine, torch.empty_like(part)), out=part)
                    if decay != 1.0:  # minus (1 - decay) of the residual
                        part.sub_(held.sub_(_read_into(theta, torch.empty_like(part))), alpha=1.0 - decay)
                encoded = self.codec.encode_window(update, start)
                encoded.numpy().tofile(message)
                if feedback:
                    self.codec.take_sent(update, encoded, start).numpy().tofile(residual)

    def _refold(self, with_residual: bool) -> None:
        """``files.ef`` becomes θ_global (``files.theta``), plus the residual of an accepted update, a window at
        a time into ``ef.f32.next``, which replaces it once whole."""
        f, step = self.files, _WINDOW
        target = f.ef.with_name(f"{f.ef.name}.next")
        try:
            with (
                open(f.theta, "rb") as theta,
                open(f.residual if with_residual else os.devnull, "rb") as residual,
                open(target, "wb") as out,
            ):
                for start in range(0, self.numel, step):
                    window = _read_into(theta, torch.empty(min(step, self.numel - start), dtype=torch.float32))
                    if with_residual:
                        window.add_(_read_into(residual, torch.empty_like(window)))
                    window.numpy().tofile(out)
        except BaseException:
            target.unlink(missing_ok=True)
            raise
        os.replace(target, f.ef)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The round counter (the federation's state itself comes from a live facility on rejoin)."""
        return {"rounds": torch.tensor(self.round), "tokens": torch.tensor([self.tokens], dtype=torch.float64)}

    def load_state_dict(self, sd: dict) -> None:
        self.round = int(sd["rounds"])

    def describe(self) -> dict:
        o = self.options
        return {
            **rounds_description(o),
            "elastic": {
                "facility": self.name,
                "hub": o.elastic.hub,
                "rounds": [
                    {
                        k: r.get(k)
                        for k in (
                            "round",
                            "step",
                            "seconds",
                            "facilities",
                            "healed",
                            "attempts",
                            "status",
                            "reason",
                            "rejected",
                            "bytes_up",
                            "bytes_down",
                        )
                        if r.has(k)
                    }  # fmt: skip
                    for r in self.records
                ],
            },
        }
