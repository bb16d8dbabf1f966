"""A delayed, overlapped outer step: ``federation.delay=1``.

Eager updates (arXiv 2502.12996) and DiLoCoX (2506.21263) hide a round's exchange behind the next
round's inner steps and apply its outer step one round late. Two rules (``federation.delay_rule``):

**eager** (the default, :class:`EagerFederation`; docs/running.md derives it): each facility ``f`` keeps its
own ``θ_f`` and outer state and at the boundary ``b_r`` steps on its own fresh progress at its share and the
others' one round late: ``θ_f <- outer(θ_f, s_f Δ_{r,f} + D_{r-1} - s'_f Δ_{r-1,f})``; nobody waits, and over
the rounds every facility applies each mean once. The class's docstring has the end of the job.

**own_full** (:class:`DelayedFederation`, the rule before eager), for facility ``f`` whose round ``r`` started
from ``s_r`` and ended at ``x_r`` (its local model at the boundary ``b_r``):

1. at ``b_r`` its round's pseudo-gradient is ``Δ_r = s_r - x_r``, weighted like a round's mean
   (``federation.weights``: the tokens of round ``r``);
2. round ``r - 1``'s exchange, which ran in the background during round ``r``, lands:
   ``D_{r-1} = Σ_f w_f Δ̂_{r-1,f}`` (``Δ̂``: what was sent, decoded; with ``compression=none`` ``Δ`` itself),
   and the outer optimizer steps: ``θ_g <- outer(θ_g, D_{r-1})``;
3. the local model becomes ``θ_g - Δ_r``: the landed global model plus this facility's own progress that
   is still in flight (its own progress at full weight, hence the name). Round ``r + 1`` starts there:
   ``s_{r+1} = θ_g - Δ_r`` (different on each facility by its own last round);
4. after the boundary's checkpoint, round ``r``'s exchange starts (``Δ_r`` encoded now, with the
   compression's error feedback), over process groups of its own (the state's ``overlap_*``): in a thread
   with gloo, on a side stream on CUDA (:class:`~.streaming.OverlappedExchange`). Step 4 is both rules'.

At the first boundary nothing lands (step 3 leaves the local model as it is). At the job's last boundary
round ``r - 1``'s step lands and round ``r``'s is exchanged in the foreground and applied: every copy ends
as ``θ_g``, the same on every facility. With ``average`` at lr 1 and no compression, ``θ_g`` after ``b_r``
is the start minus the sum of the means of rounds ``1 .. r - 1``.

A facility the non-finite guard leaves out of round ``r`` (``on_nonfinite=skip``: weight 0) discards its
round: ``Δ_r = 0``, so its local model becomes the landed ``θ_g`` (eager: ``θ_f`` after its step).

A checkpoint at ``b_r`` is taken after steps 1-3 and before step 4: it holds ``θ_g`` (eager: this facility's
``θ_f``), the outer state, the error-feedback residual, ``Δ_r`` and round ``r``'s weights, the outer step still
to be made. A resumed run starts that exchange first and lands it at ``b_{r+1}``, as the uninterrupted run
does: bitwise the same. Memory beside one world's rounds: ``Δ`` and the landed mean, two flat fp32 buffers of
this rank's shards.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .federation import Federation, compressed_exchange, sum_exchange
from .protocol import Boundary
from .record import RoundRecord
from .streaming import OverlappedExchange

__all__ = ["DelayedFederation", "EagerFederation", "delayed_federation"]


def delayed_federation(cfg) -> type:
    """The class of ``federation.delay=1`` for ``cfg.delay_rule`` (null: ``eager``)."""
    return DelayedFederation if cfg.delay_rule == "own_full" else EagerFederation


class DelayedFederation(Federation):
    """:class:`~.federation.Federation` with ``federation.delay=1`` and ``delay_rule=own_full`` (see the module);
    :class:`EagerFederation` changes steps 2-3 and the end."""

    rule = "own_full"

    def __init__(self, cfg, model: torch.nn.Module, strategy, state, **span):
        """As :class:`~.federation.Federation`'s (``span``: its keyword arguments: hooks)."""
        super().__init__(cfg, model, strategy, state, **span)
        if self.theta is None:  # average at lr 1 without compression: theta_global is still what lands on
            self._allocate_theta()
        n = state.num_facilities
        self.own = torch.zeros(self.numel, dtype=torch.float32, device=state.device)  # Δ of the round not landed
        self.scales = torch.full((n,), 1.0 / n, dtype=torch.float64)  # its weights in the mean
        self.pending = False  # Δ waits for its exchange to start (a boundary's, or a restored checkpoint's)
        self.pending_step = 0  # the step its round ended at
        self.inflight: dict | None = None
        # The exchange runs beside the training thread's collectives: groups no one else uses, connected now
        # by every rank at the same point (NCCL makes communicators lazily: never in a second thread).
        self.peers = state.group("overlap_peers") if n > 1 else None
        self.replicas = state.group("overlap_replicas") if state.num_replicas > 1 else None
        for group in (self.peers, self.replicas):
            if group is not None:
                dist.all_reduce(torch.zeros(1, device=state.device), group=group)

    def describe(self) -> dict:
        return {**super().describe(), "delay": 1, "delay_rule": self.rule}

    # ------------------------------------------------------------------ the loop's interface
    def finish(self, boundary: Boundary, index: int) -> list[RoundRecord]:
        """Steps 1-3 of the module's rule at ``boundary`` (at the job's end also the last round's exchange, in
        the foreground): one record, numbered ``index``."""
        if not boundary.finish:
            return []
        started, done = time.perf_counter(), boundary.step
        self.hooks.save(index, "before")
        weights, skipped = self.hooks.weights_for_round(self.facility_weights(), index, done)
        delta = self._take_delta(skipped)
        landed, exchange_s, sent = self._boundary(delta, weights, done, boundary.end)
        self.rounds += 1
        self.hooks.save(index, "after", bytes_per_rank=sent)
        taken = None if boundary.taken is None else list(boundary.taken)
        return [
            RoundRecord(
                index,
                done,
                None,
                steps_taken=taken,
                landed=landed,
                seconds=time.perf_counter() - started,
                exchange_seconds=exchange_s,
                bytes_per_rank=int(sent),
                cross_facility_bytes=self._sum_over_world(sent),
                skipped_facilities=skipped,
            )
        ]

    def _boundary(self, delta: Tensor, weights: list[float] | None, done: int, end: bool) -> tuple[list, float, int]:
        """Steps 2-3 (at the end, the last round's exchange too): ``(landed steps, exchange seconds, bytes sent)``."""
        mean, landed, exchange_s, sent = self._land()
        if mean is not None:
            self.outer.step(mean.to(self.theta.device))
        self._set_pending(delta, weights, done)
        self._write_params(self.theta.to(delta.device) - delta)
        if end:  # this round's exchange too, in the foreground: every copy ends as theta_global
            self._launch(background=False)
            more, more_landed, more_s, more_sent = self._land()
            self.outer.step(more.to(self.theta.device))
            landed, exchange_s, sent = landed + more_landed, exchange_s + more_s, sent + more_sent
            self.own.zero_()
            self._write_params(self.theta.to(self.state.device))
        return landed, exchange_s, sent

    def start(self, boundary: Boundary, index: int) -> None:
        """Step 4: start the exchange of the round ended at the last boundary (after its checkpoint; at the
        start, a restored checkpoint's)."""
        if self.pending:
            self._launch(background=True)
            self.hooks.save(index - 1, "start", step=boundary.step, **self._recorded())  # numbered by its round

    def wait(self) -> None:
        if self.inflight is not None:
            self.inflight["work"].result()

    # ------------------------------------------------------------------ the rule
    @torch.no_grad()
    def _take_delta(self, skipped: list[int]) -> Tensor:
        """``Δ = s - x``, with ``s = θ_g - own`` (where this round started); zero for a facility left out."""
        local = self._read_params(torch.empty(self.numel, dtype=torch.float32, device=self.state.device))
        if self.state.facility in skipped:
            return local.zero_()
        # s as step 3 wrote it (the same operation on the same values: bitwise the parameters it set), minus x
        return torch.sub(self.theta.to(local.device), self.own).sub_(local)

    @torch.no_grad()
    def _land(self) -> tuple[Tensor | None, list[int], float, int]:
        """Wait for the exchange in flight, if any (step 2): ``(its mean or None, [the step its round ended at],
        its seconds, bytes sent)``."""
        flight, self.inflight = self.inflight, None
        if flight is None:
            return None, [], 0.0, 0
        mean, sent = flight["work"].result()
        return mean, [flight["step"]], flight["work"].seconds, int(sent)

    @torch.no_grad()
    def _set_pending(self, delta: Tensor, weights: list[float] | None, done: int) -> None:
        """``own = Δ`` of the round ended after ``done`` steps, with its weights: its exchange is still to start."""
        n = self.state.num_facilities
        scales = [1.0 / n] * n if weights is None else [w / sum(weights) for w in weights]
        self.scales = torch.tensor(scales, dtype=torch.float64)
        self.own.copy_(delta)
        self.pending, self.pending_step = True, done

    def _launch(self, background: bool) -> None:
        """Encode ``own`` and start its exchange (step 4)."""
        state = self.state
        scales = self.scales.tolist()
        if self.compressor is not None:
            message = self.compressor.prepare(self.own.clone())  # every replica: the same bytes and residual
            fn = compressed_exchange(self.compressor, message, self.numel, scales, state, self.peers, self.replicas)
        else:
            message = None
            fn = sum_exchange(self.own.mul(scales[state.facility]), state, self.peers, self.replicas)
        self.pending = False
        work = OverlappedExchange(fn, background, state.device, kind="delayed")
        self.inflight = {"step": self.pending_step, "message": message, "work": work}

    def _recorded(self) -> dict:
        """The tests' record of an exchange that starts: this rank's message and residual after encoding."""
        message = (self.inflight or {}).get("message")
        residual = None if self.compressor is None else self.compressor.residual
        return {
            **({"message": message} if message is not None else {}),
            **({"residual": residual} if residual is not None else {}),
            "own": self.own,
        }

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """As :meth:`Federation.state_dict`, with ``Δ`` of the round whose outer step is still to be made,
        its weights and whether its exchange is still to start. Taken at a boundary, before the exchange starts."""
        if self.inflight is not None:
            raise RuntimeError("a checkpoint with the delayed exchange in flight: take it at the boundary, before it")
        out: dict[str, Any] = super().state_dict()
        out["delayed"] = {
            "own": self._as_dtensors(self.own),
            "scales": self.scales.clone(),
            "pending": torch.tensor(int(self.pending)),
            "step": torch.tensor(self.pending_step),
        }
        return out

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self._load_flat(self.own, sd["delayed"]["own"])
        self.scales.copy_(sd["delayed"]["scales"])
        self.pending = bool(int(sd["delayed"]["pending"]))
        self.pending_step = int(sd["delayed"]["step"])


class EagerFederation(DelayedFederation):
    """``federation.delay=1`` with ``delay_rule=eager`` (the default): eager updates (arXiv 2502.12996).

    Facility ``f`` keeps its own ``θ_f`` and outer state (``theta``, ``outer``). At ``b_r`` its round's
    ``Δ_r = θ_f - x_r`` (the round started from ``θ_f``), round ``r - 1``'s mean ``D_{r-1}`` lands, and
    ``θ_f <- outer(θ_f, s_f Δ_r + D_{r-1} - s'_f Δ_{r-1})``: its own fresh progress at its share ``s_f``, the
    others' one round late (the landed mean less its own stale share ``s'_f Δ_{r-1}``, as it was added). The
    local model becomes ``θ_f``. At the job's end round ``r``'s exchange runs in the foreground and replaces the
    fresh share (``θ_f <- outer(θ_f, D_r + D_{r-1} - s'_f Δ_{r-1})``); the facilities then hold different
    ``θ_f`` (their outer states saw different fresh shares), so the job ends on their weighted mean
    ``Σ_f s_f θ_f``, one fp32 all-reduce of the model: every copy the same."""

    rule = "eager"

    @torch.no_grad()
    def _take_delta(self, skipped: list[int]) -> Tensor:
        """``Δ = θ_f - x`` (``θ_f``: where this round started, bitwise); zero for a facility left out."""
        local = self._read_params(torch.empty(self.numel, dtype=torch.float32, device=self.state.device))
        if self.state.facility in skipped:
            return local.zero_()
        return torch.sub(self.theta.to(local.device), local)

    def _others(self, mean: Tensor | None) -> Tensor | None:
        """The others' part of a landed mean: ``D - s'_f Δ_{r-1}`` (``own`` and ``scales`` still round
        ``r - 1``'s), on ``theta``'s device."""
        if mean is None:
            return None
        mean = mean.to(self.theta.device)
        return mean.sub_(self.own.to(mean.device), alpha=float(self.scales[self.state.facility]))

    @torch.no_grad()
    def _boundary(self, delta: Tensor, weights: list[float] | None, done: int, end: bool) -> tuple[list, float, int]:
        mean, landed, exchange_s, sent = self._land()
        others = self._others(mean)
        self._set_pending(delta, weights, done)
        if end:  # this round's exchange in the foreground: its mean replaces the fresh share
            self._launch(background=False)
            fresh, more_landed, more_s, more_sent = self._land()
            fresh = fresh.to(self.theta.device)
            landed, exchange_s, sent = landed + more_landed, exchange_s + more_s, sent + more_sent
        else:
            fresh = delta.to(self.theta.device).mul_(float(self.scales[self.state.facility]))
        self.outer.step(fresh if others is None else others.add_(fresh))
        if end:
            sent += self._settle()
        self._write_params(self.theta.to(self.state.device))
        return landed, exchange_s, sent

    @torch.no_grad()
    def _settle(self) -> int:
        """The job's end: ``θ_f <- Σ_f s_f θ_f`` (the last round's weights), the same on every copy; bytes sent."""
        self.own.zero_()
        if self.state.num_facilities == 1:
            return 0
        scaled = self.theta.to(self.state.device).mul(float(self.scales[self.state.facility]))
        mean, sent = sum_exchange(scaled, self.state, self.peers, self.replicas)()
        self.theta.copy_(mean)
        return int(sent)
