"""``federation.delay=1`` through the hub: :class:`DelayedElasticFederation` (``delay_rule=own_full``) and
:class:`EagerElasticFederation` (``eager``, the default; its docstring: the hub's θ_global carries the means, and
with compression the final round carries fp32 parameters).

One world's ``own_full`` rule (:mod:`xffl_like.federation.delayed`) keeps one θ_g for everyone, stepped on each
round's mean one round late, and makes each facility's local model ``θ_g - Δ_r``: the landed global model plus
its own progress still in flight, at full weight. The hub already holds that θ_g: its θ_global, stepped by its
outer optimizer on each round's mean. So the hub's rounds stay what they are, and only the facility changes:

- at the boundary ``b_r`` the hub's round ``r - 1``, which ran during round ``r``, lands: θ_global of version
  ``r - 1`` (the hub's, bitwise, or applied here from the relay with compression);
- the round's pseudo-gradient is ``Δ_r = s_r - x_r`` (``s_r``: where round ``r`` started, ``x_r``: the
  facility's model now), and the model becomes ``u_r = θ_global - Δ_r``;
- after the boundary's checkpoint, round ``r``'s exchange starts in a thread of the leader: ``u_r`` goes up to
  the hub's round at step ``b_r`` exactly as a round's parameters do without delay (the hub's pseudo-gradient
  ``θ_global - u_r`` is ``Δ_r``; with compression the message encodes it plus the residual) while round
  ``r + 1`` trains from ``s_{r+1} = u_r``. The leader's thread only uploads, waits and downloads: no
  collective runs outside the training thread, and every rank learns the result at ``b_{r+1}``.

The arithmetic is the leader's, on its spool files a window at a time (``start.f32``: ``u_r``, what went up;
``parameters.f32``: ``x`` gathered, then ``u`` written over it and scattered back): no rank holds a second
copy of the model. Where nothing landed (the first boundary, after a join or a resume, or a round the hub
did not answer) the model stays ``x``: its progress since the last θ_global it holds goes up whole at the next
round. A round in which the hub healed or rejected this facility lands θ_global without its ``Δ_r``: that
round is discarded, as one world's non-finite guard discards one; a realigned step carries over to the steps
trained since. The job's last boundary lands the round in flight, then makes its own round in the foreground
(the federation's final one, :meth:`~xffl_like.hub.client.HubLink.until_final`): every facility ends on the
hub's final θ_global, bitwise.

Checkpoints: one at ``b_r`` is taken after the model became ``u_r`` and before the exchange starts, and keeps the
round still to go up (:meth:`DelayedElasticFederation.state_dict`: the leader's spool files of it, mapped from disk,
and its step and tokens). A resumed facility's join names that round, and the hub says whether it counted it
(:meth:`DelayedElasticFederation.join`): ``open``, it goes up as it would have; ``counted``, nothing is sent again and
the version that counted it lands at the next boundary; ``missed``, the facility heals and that round's progress is
dropped (one line). docs/running.md ("Through the hub") has both rules' design and this choice's reasons.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time

import torch
import torch.distributed as dist
from torch import Tensor

from ...config.schema import OuterConfig
from ...hub.protocol import relay
from ...hub.protocol.spec import CARRIER
from ..outer import end_scale, outer_step
from ..record import RoundRecord
from .downlink import FileState, zero_outer
from .exchange import _WINDOW, ElasticFederation, _read_into

__all__ = ["DelayedElasticFederation", "EagerElasticFederation", "delayed_elastic", "final_residual", "own_full_window"]


def delayed_elastic(cfg) -> type:
    """The class of ``federation.delay=1`` through the hub for ``cfg.delay_rule`` (null: ``eager``)."""
    return DelayedElasticFederation if cfg.delay_rule == "own_full" else EagerElasticFederation


def _share(out: dict, name: str) -> float:
    """This facility's weight in the round ``out`` accepted it in, over the round's total (a counted round a resumed
    facility lands: the hub's answer, ``share``)."""
    if out.get("share") is not None:
        return float(out["share"])
    weights = out.get("weights") or {}
    return weights[name] / sum(weights.values())


def own_full_window(theta: torch.Tensor, start: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``θ_global - (s - x)``: the landed θ_global plus the progress still in flight (fp32, in this order)."""
    return theta - (start - local)


def final_residual(ef: torch.Tensor, theta: torch.Tensor, decay: float) -> torch.Tensor:
    """The error-feedback residual the last message carries, ``decay x (ef - θ_global)`` (``ef``: θ_global plus
    the residual; decay 1: ``ef - θ_global`` as it is), fp32 in this order."""
    carried = torch.sub(ef, theta)
    return carried.mul_(decay) if decay != 1.0 else carried


_OPEN, _COUNTED, _HEALED = 1, 2, 0  # what a resumed facility's join kept of its pending round


def _mapped(path, values: int) -> torch.Tensor:
    """The spool file ``path`` as a flat fp32 tensor of ``values`` mapped from it (made, zero, at that size if it is
    not): a checkpoint saves it, and a restore writes into it, without a copy of the model in memory."""
    with open(path, "ab") as fh:
        if fh.tell() != 4 * values:
            fh.truncate(4 * values)
    return torch.from_file(str(path), shared=True, size=values, dtype=torch.float32)


class DelayedElasticFederation(ElasticFederation):
    """:class:`~.exchange.ElasticFederation` with ``federation.delay=1`` (``delay_rule=own_full``): the module's
    rule; a round's exchange runs from the boundary's :meth:`start` to the next boundary's :meth:`finish`."""

    rule = "own_full"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.flight: dict | None = None  # the round in flight: the leader's handle, its step, when it started
        self.ending = False  # this boundary ends the job: the round in flight lands, then the final round
        self.moved = 0  # the steps trained since the landing round was sent
        self.pending = False  # the model is u: its round is still to start (after the boundary's checkpoint)
        self.pending_step = 0  # the step that round ended at
        self.round_tokens = 0.0  # its tokens (the facility's, summed at its boundary)
        self.kept = False  # a resumed facility kept its checkpoint's state at its join (its round open or counted)

    # ------------------------------------------------------------------ the loop's interface
    def finish(self, boundary, index: int) -> list[RoundRecord]:
        """At a boundary: the round in flight lands (the rule); at the job's end this facility's last round
        follows in the foreground."""
        if not boundary.finish:
            return []
        self.ending = boundary.end  # unless the landed round realigns this facility's step back (_land)
        records = self._land(boundary.step)
        if self.ending:
            self.pending = False
            records.append(self._final_round(records[-1].step if records else boundary.step))
        else:  # the round that starts after the checkpoint: its step and tokens are the checkpoint's
            self.pending_step, self.round_tokens = records[-1].step if records else boundary.step, self._round_tokens()
        return records

    def _final_round(self, done: int) -> RoundRecord:
        """The job's last round, in the foreground: the model goes up, the federation's final θ_global comes back."""
        return self.round_at(done)

    def start(self, boundary, index: int) -> None:
        """After the boundary's checkpoint: the exchange of ``u`` starts (the leader's thread)."""
        if self.pending:
            self._launch(boundary.step)

    def leave(self) -> None:
        flight, self.flight = self.flight, None
        if flight is not None and self.leader:  # a stop while a round is in flight: it ends now, unapplied
            if self.link is not None:
                self.link.cancel()
            flight["handle"]["thread"].join(timeout=60.0)
        super().leave()

    def describe(self) -> dict:
        return {**super().describe(), "delay": 1, "delay_rule": self.rule}

    # ------------------------------------------------------------------ a resumed facility's pending round
    def join(self, step: int) -> int:
        """As every facility joins; a facility resumed from a checkpoint with its round still to go up names it,
        and the hub's answer decides (docs/running.md, "Checkpoints: a pending round through the hub"): ``open``,
        it goes up after the join as it would have; ``counted``, it lands at the next boundary (the version that
        counted it, downloaded now); ``missed`` (or the federation moved on since), it heals as any joiner, one line
        says so, and that round's progress is dropped. Collective."""
        self.kept = False
        if not self.pending:
            return super().join(step)
        started, last_step = time.perf_counter(), self.last_step
        out = self._while_leader_works(lambda: self._resume(step))
        kept = torch.tensor([out["kept"] if self.leader else 0], dtype=torch.int32, device=self.state.device)
        dist.broadcast(kept, src=0)
        record = self._conclude(out, started, lambda: self._scatter(self.files.theta if self.leader else None))
        self.kept = int(kept.item()) != _HEALED
        if self.kept:
            self.last_step = last_step  # the pending round's claim counts the steps since the round before it
        if int(kept.item()) == _COUNTED:  # lands at the next boundary, as the round in flight would have
            landed = out["landed"] if self.leader else None
            self.flight = {"handle": self._spawn(lambda: landed), "step": self.pending_step}
        self.pending = int(kept.item()) == _OPEN
        return record.step

    def _pending_claim(self) -> tuple[int, int] | None:
        return (self.pending_step, self.round) if self.pending else None

    def _resume(self, done: int) -> dict:
        """The leader's join naming its pending round (its thread), and what the hub's answer keeps: ``kept``
        (:data:`_OPEN`, :data:`_COUNTED`, :data:`_HEALED`), and with ``counted`` the round's result, ``landed``."""
        held = self.round
        self._before_send()  # eager: the version held, which the counted round's mean is taken against
        if self.codec is not None:  # the message and residual that round went up with (deterministic)
            self._encode(self.options.feedback)
        out = self._lead(0.0, done, True)
        answer = out.get("pending")
        pending = f"facility {self.name}: resumed with its round at step {self.pending_step} pending"
        if out["status"] == "created":  # the hub held no federation (a new --state): this upload created it
            print(f"{pending}: the hub holds no federation, and its upload created one", flush=True)
            return {**out, "changed": True, "kept": _HEALED}  # the model becomes that θ_global
        if out["status"] == "resumed":
            print(f"{pending}: that round is open at the hub; it sends the upload its checkpoint kept", flush=True)
            return {**out, "kept": _OPEN}
        if answer == "counted" and out["round"] == held + 1:
            print(f"{pending}: the hub counted it in version {out['round']}; nothing is sent again, and that "
                  f"version lands at the next boundary", flush=True)  # fmt: skip
            if self.codec is not None:  # as the round's own result: θ_global plus the residual of the accepted update
                self._refold(with_residual=self.options.feedback)
            landed = {**out, "status": "accepted", "healed": [], "bytes": 0, "bytes_up": 0, "bytes_down": 0,
                      "share": out["share"], "exchange_seconds": 0.0}  # fmt: skip
            kept = {"round": held, "step": done, "changed": False, "status": "resumed", "healed": []}
            return {**out, **kept, "kept": _COUNTED, "landed": landed}
        moved = f"the federation moved on to version {out['round']}"
        why = f"the hub counted it, and {moved}" if answer == "counted" else f"its round closed without it, or {moved}"
        print(f"{pending}: {why}; it heals to θ_global (that round's progress is not sent: it would count in a round "
              f"of another step)", flush=True)  # fmt: skip
        return {**out, "kept": _HEALED}

    # ------------------------------------------------------------------ checkpoints
    def _kept_files(self) -> dict[str, tuple]:
        """The leader's spool files a checkpoint keeps, by name: (path, values). ``mine``: the upload ``u``;
        ``theta``: θ_global of the version held; with compression ``ef`` and the hub's outer buffers."""
        f, n = self.files, self.numel
        kept = {"mine": (f.mine, n), "theta": (f.theta, n)}
        if self.codec is not None:
            kept["ef"] = (f.ef, n)
            kept["outer"] = (f.outer, n * len(relay.buffer_names(self.hub_outer)))
        return {k: v for k, v in kept.items() if v[1] > 0}

    def state_dict(self) -> dict:
        """The round counter, and the round still to go up at a boundary's checkpoint (after the rule, before the
        exchange starts): whether one is pending, its step and tokens, the step of the round before; on the
        leader its spool files (:meth:`_kept_files`, mapped from disk: no copy of the model is made in memory) and
        its counters. A checkpoint with a round in flight (none is taken there) keeps nothing pending."""
        pending = self.pending and self.flight is None
        out = {
            **super().state_dict(),
            "delayed": {
                "pending": torch.tensor(int(pending)),
                "step": torch.tensor(self.pending_step),
                "last_step": torch.tensor(self.last_step),
                "tokens": torch.tensor([self.round_tokens], dtype=torch.float64),
            },
        }
        if self.leader:
            counters = {k: torch.tensor([float(v)], dtype=torch.float64) for k, v in self._counters().items()}
            out["leader"] = {"spool": {k: _mapped(p, n) for k, (p, n) in self._kept_files().items()}, **counters}
        return out

    def _counters(self) -> dict[str, float]:
        """The leader's own counters a checkpoint keeps."""
        return {"outer_steps": self.outer_steps}

    def load_state_dict(self, sd: dict) -> None:
        """Restored in place: the leader's spool files were written through their mappings."""
        super().load_state_dict(sd)
        d = sd["delayed"]
        self.pending, self.pending_step = bool(int(d["pending"])), int(d["step"])
        self.last_step, self.round_tokens = int(d["last_step"]), float(d["tokens"][0])
        if self.leader:
            self._restore_counters({k: float(v[0]) for k, v in sd["leader"].items() if k != "spool"})

    def _restore_counters(self, counters: dict[str, float]) -> None:
        self.outer_steps = int(counters["outer_steps"])

    # ------------------------------------------------------------------ the rule
    def _launch(self, done: int) -> None:
        """Round at step ``done``: ``files.mine`` (``u``) goes up in a thread of the leader, with the round's
        tokens (summed at its boundary)."""
        tokens = self.round_tokens
        self.pending = False

        def work() -> dict:
            self._before_send()
            out = self._lead(tokens, done, False)
            out["exchange_seconds"] = time.perf_counter() - started
            return out

        started = time.perf_counter()
        self.flight = {"handle": self._spawn(work), "step": done}

    def _before_send(self) -> None:
        """The leader's thread, before the round goes up (nothing here)."""

    def _land(self, done: int) -> list[RoundRecord]:
        """After ``done`` steps: wait for the round in flight, gather ``x`` and apply the rule (:meth:`_take`;
        collective). Its record, or none when nothing was in flight."""
        started, flight, self.flight = time.perf_counter(), self.flight, None
        f = self.files if self.leader else None
        out = self._await(flight["handle"]) if flight is not None else None
        if flight is not None and self.leader:
            os.replace(f.mine, f.start)  # what went up: where the round that ends now started
        self._gather(f.mine if self.leader else None)
        self.pending = True
        if flight is None:
            self._take(None, landed=False)
            return []
        taken: list[bool] = []
        self.moved = done - flight["step"]
        record = self._conclude(out, started, lambda: taken.append(self._take(out, landed=True)))
        if not taken:  # nothing came back (the hub did not answer, or a stop)
            self._take(out, landed=False)
        record.step += self.moved  # a realigned step carries over to the steps trained since
        self.ending = self.ending and record.step >= self.steps  # realigned back: the end comes later
        record.landed = [flight["step"]]
        if self.leader:
            record.exchange_seconds = out.get("exchange_seconds", 0.0)
        return [record]

    def _take(self, out: dict | None, landed: bool) -> bool:
        """The rule at a boundary (collective): where θ_global came back (``landed``) the model becomes
        ``θ_global - (s - x)`` and goes up next; else it stays ``x``. ``out``: the leader's round (None elsewhere,
        and where nothing was in flight)."""
        if landed:
            f = self.files if self.leader else None
            if self.leader:
                self._compose(f.theta, f.start, f.mine)
            self._scatter(f.mine if self.leader else None)
        return True

    def _compose(self, theta, start, mine) -> None:
        """``mine <- θ_global - (start - mine)`` (the leader's files), a window at a time."""
        target = mine.with_name(f"{mine.name}.next")
        with open(theta, "rb") as t, open(start, "rb") as s, open(mine, "rb") as x, open(target, "wb") as out:
            for first in range(0, self.numel, _WINDOW):
                n = min(_WINDOW, self.numel - first)
                read = [_read_into(fh, torch.empty(n, dtype=torch.float32)) for fh in (t, s, x)]
                own_full_window(*read).numpy().tofile(out)
        os.replace(target, mine)


class EagerElasticFederation(DelayedElasticFederation):
    """``federation.delay=1`` with ``delay_rule=eager`` through the hub (docs/running.md): each facility keeps its
    own ``θ_f`` and outer state in its leader's spool; the hub's θ_global carries the sum of the rounds' means (its
    outer rule is ``average`` at lr 1, :data:`~xffl_like.hub.protocol.spec.CARRIER`: :attr:`hub_outer`), so that
    ``D_v = θ_{v-1} - θ_v`` at every facility, bitwise alike (with compression: the mean of the decoded messages,
    the relayed round applied here as at the hub).

    At a boundary, with ``Δ = θ_f - x``: ``θ_f <- outer_f(θ_f, (D - s' Δ_prev) + s Δ)`` (``D`` and ``s'``: the
    landed round's mean and this facility's weight in it, 0 where it was healed or nothing landed; ``s``: its
    weight in the last round it was accepted in, ``1 / min_facilities`` before one), the model becomes ``θ_f``,
    and ``u = θ_global - Δ`` goes up (the hub's pseudo-gradient ``θ_global - u`` is ``Δ``; with compression the
    message encodes it plus the error-feedback residual, and the stale share taken out is ``s' Δ``, as in one
    world). At the job's last boundary, with ``A = outer_f(θ_f, D - s' Δ_prev)``: ``u = A - c Δ``
    (:func:`~..outer.end_scale`) goes up in the foreground, and the hub's last round (``θ - Σ s_f (θ - u_f)``) is
    ``Σ s_f outer_f(θ_f, D - s' Δ_prev + D_R)``: one world's end, ``Σ_f s_f θ_f`` after the last mean replaced
    the fresh share.

    **With compression** the final round carries fp32 parameters, not a message
    (:func:`~xffl_like.hub.protocol.spec.final_in_fp32`: the hub knows it by its round count, the facility by its
    last step): ``u`` is far from θ_global (``A`` moved by this facility's own outer rule), and only its fp32 mean
    makes the hub's final θ_global ``Σ s_f outer_f(...)`` that every facility exports bitwise. What ``u`` folds in
    is one world's last message: ``Δ`` plus the decayed residual (:func:`final_residual`), encoded and decoded here
    (``Δ̂``, :meth:`_last_message`; its bytes stay in ``files.message``, unsent), ``u = A - c Δ̂``, so the hub's last
    round is ``Σ s_f outer_f(θ_f, D - s' Δ_prev + D̂_R)`` with ``D̂_R = Σ s_f Δ̂_f``, the mean one world's last
    exchange decodes: one world's end, up to fp32 rounding (one world sums the decoded messages, then steps; here
    each facility steps on its own and the hub sums). What the message left out stays unsent, as in one world.
    The upload and download of that round are those of an fp32 round (θ_global in full comes back, as to a
    joiner), once per job."""

    rule = "eager"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.share = 1.0 / max(1, int(self.options.elastic.min_facilities))
        self.own_steps = 0  # this facility's outer optimizer's steps
        if self.leader:
            d = self.files.directory
            self.own_theta, self.own_outer = d / "own_theta.f32", d / "own_outer.f32"
            self.own_delta, self.prev = d / "own_delta.f32", d / "theta_prev.f32"

    @property
    def hub_outer(self) -> OuterConfig:
        """The hub's rule: the carrier of the means (``average`` at lr 1), not this facility's own."""
        return dataclasses.replace(self.options.outer, **CARRIER)

    def join(self, step: int) -> int:
        """Join as before; this facility's θ_f is θ_global, its outer state and Δ zero."""
        out = super().join(step)
        if self.leader and not self.kept and self.files.theta.exists():  # not after a stop while joining
            shutil.copyfile(self.files.theta, self.own_theta)
            zero_outer(self.own_outer, relay.buffer_names(self.options.outer), self.numel)
            zero_outer(self.own_delta, ("delta",), self.numel)
        return out

    def _final_round(self, done: int) -> RoundRecord:
        record = self._round(done, joining=False, gather=False)  # u is the leader's file already
        if record.step < self.steps and self.leader:  # the hub was behind: training goes on from θ_global
            shutil.copyfile(self.files.theta, self.own_theta)
        return record

    def _before_send(self) -> None:
        shutil.copyfile(self.files.theta, self.prev)  # θ_global before the round: its mean is the difference

    def leave(self) -> None:
        if self.leader:  # the round in flight (if any) uses none of these
            for path in (self.own_theta, self.own_outer, self.own_delta, self.prev):
                path.unlink(missing_ok=True)
        super().leave()

    def _take(self, out: dict | None, landed: bool) -> bool:
        """Eager's step (the class's), at every boundary; the model becomes ``θ_f`` (but at the end, whose model
        is the last round's)."""
        if landed:  # a round that realigned this facility's step back does not end it (finish: the same test)
            self.ending = self.ending and self.last_step + self.moved >= self.steps
        if self.leader:
            accepted = landed and out["status"] == "accepted"
            stale = _share(out, self.name) if accepted else 0.0
            self._compose_eager(landed, stale)
            if accepted:
                self.share = stale
        self.own_steps += 1
        if not self.ending:
            self._scatter(self.own_theta if self.leader else None)
        return True

    def _compose(self, theta, start, mine) -> None:
        raise AssertionError("eager composes with _compose_eager")

    def _kept_files(self) -> dict[str, tuple]:
        """As own_full's, with this facility's θ_f, its outer state and Δ."""
        n, buffers = self.numel, len(relay.buffer_names(self.options.outer))
        own = {"own_theta": (self.own_theta, n), "own_outer": (self.own_outer, n * buffers),
               "own_delta": (self.own_delta, n)}  # fmt: skip
        return {**super()._kept_files(), **{k: v for k, v in own.items() if v[1] > 0}}

    def _counters(self) -> dict[str, float]:
        return {**super()._counters(), "share": self.share}

    def _restore_counters(self, counters: dict[str, float]) -> None:
        super()._restore_counters(counters)
        self.share = counters["share"]

    def state_dict(self) -> dict:
        out = super().state_dict()
        out["delayed"]["own_steps"] = torch.tensor(self.own_steps)  # every rank's
        return out

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self.own_steps = int(sd["delayed"]["own_steps"])

    @torch.no_grad()
    def _compose_eager(self, landed: bool, stale: float) -> None:
        """The leader's files, :data:`_WINDOW` values at a time: ``θ_f`` and its outer state step, ``Δ`` is kept, and
        ``mine`` (``x`` on entry) becomes the next upload; at the last boundary with compression, first the window of
        the codec's (top-k: whole tensors) of the last message (:meth:`_last_message`)."""
        f, options = self.files, self.options.outer
        state = FileState(self.own_theta, self.own_outer, relay.buffer_names(options), self.numel)
        final = self.ending and self.codec is not None  # the last message, decoded here: Δ̂ (the class's)
        names = [f.mine, self.own_delta] + ([f.message] if final else [])
        outs = [open(p.with_name(f"{p.name}.next"), "wb") for p in names]
        paths = (f.mine, self.own_delta, f.theta, self.prev if landed else f.theta)
        ins = [open(p, "rb") for p in paths]
        windows = self.codec.windows(_WINDOW) if final else [(0, self.numel)]
        try:
            for first, n in windows:
                sent = self._last_message(state, first, n, outs[2]) if final else None
                for at in range(first, first + n, _WINDOW):
                    m = min(_WINDOW, first + n - at)
                    x, before, theta, prev = (_read_into(fh, torch.empty(m, dtype=torch.float32)) for fh in ins)
                    own, buffers = state.read(at, at + m)
                    delta = torch.sub(own, x)
                    others = torch.sub(prev, theta).sub_(before, alpha=stale)  # D - s' Δ_prev (0 without a mean)
                    if self.ending:  # A = outer_f(θ_f, others); u = A - c Δ (with compression: A - c Δ̂)
                        outer_step(options, self.own_steps + 1, own, buffers, others)
                        last = sent[at - first : at - first + m] if final else delta
                        upload = own.sub(last, alpha=end_scale(options))
                    else:
                        outer_step(options, self.own_steps + 1, own, buffers, others.add_(delta.mul(self.share)))
                        upload = theta.sub(delta)
                    state.write(at, own, buffers)
                    upload.numpy().tofile(outs[0])
                    delta.numpy().tofile(outs[1])
        except BaseException:
            state.discard()
            raise
        finally:
            for fh in outs + ins:
                fh.close()
        state.commit()
        for p in names:
            os.replace(p.with_name(f"{p.name}.next"), p)

    def _last_message(self, state: FileState, first: int, n: int, out) -> Tensor:
        """The window ``(first, n)`` of the message one world's last exchange would send, ``Δ + decay x residual``
        (``Δ = θ_f - x``; :func:`final_residual`), encoded (its bytes to ``out``, the leader's ``files.message``: the
        record of what the fp32 upload folds in), decoded: ``Δ̂`` (``n`` values). Read :data:`_WINDOW` values at a
        time: the window's update, then its decoding, are the only buffers of its size."""
        f, update = self.files, torch.empty(n, dtype=torch.float32)
        with open(f.mine, "rb") as mine, open(f.theta, "rb") as theta, open(f.ef, "rb") as ef:
            for fh in (mine, theta, ef):
                fh.seek(4 * first)
            for at in range(0, n, _WINDOW):
                m = min(_WINDOW, n - at)
                own = state.read(first + at, first + at + m)[0]
                x, t, e = (_read_into(fh, torch.empty(m, dtype=torch.float32)) for fh in (mine, theta, ef))
                torch.sub(own, x, out=update[at : at + m]).add_(final_residual(e, t, self.decay))
        encoded = self.codec.encode_window(update, first)
        del update
        encoded.numpy().tofile(out)
        return self.codec.decode_window(encoded, first, n)
