"""A delayed, overlapped outer step: ``federation.delay=1``.

Eager updates (arXiv 2502.12996) and DiLoCoX (2506.21263) hide a round's exchange behind the next
round's inner steps and apply its outer step one round late. The rule here, for facility ``f`` whose
round ``r`` started from ``s_r`` and ended at ``x_r`` (its local model at the boundary ``b_r``):

1. at ``b_r`` its round's pseudo-gradient is ``Δ_r = s_r - x_r``, weighted like a round's mean
   (``federation.weights``: the tokens of round ``r``);
2. round ``r - 1``'s exchange, which ran in the background during round ``r``, lands:
   ``D_{r-1} = Σ_f w_f Δ̂_{r-1,f}`` (``Δ̂``: what was sent, decoded; with ``compression=none`` ``Δ`` itself),
   and the outer optimizer steps: ``θ_g <- outer(θ_g, D_{r-1})``;
3. the local model becomes ``θ_g - Δ_r``: the landed global model plus this facility's own progress that
   is still in flight. Put another way, when the stale global step lands the local model takes the outer
   step and gives back its own round ``r - 1`` progress, which the mean now counts:
   ``x <- x + (θ_g,new - θ_g,old) + Δ_{r-1}``. Round ``r + 1`` starts there: ``s_{r+1} = θ_g - Δ_r``
   (different on each facility by its own last round);
4. after the boundary's checkpoint, round ``r``'s exchange starts (``Δ_r`` encoded now, with the
   compression's error feedback), over process groups of its own (the state's ``overlap_*``): in a thread
   with gloo, on a side stream on CUDA (:class:`~.streaming.OverlappedExchange`).

At the first boundary nothing lands (step 3 leaves the local model as it is). At the job's last boundary
round ``r - 1``'s step lands and round ``r``'s is exchanged in the foreground and applied: every copy ends
as ``θ_g``, the same on every facility. With ``average`` at lr 1 and no compression, ``θ_g`` after ``b_r``
is the start minus the sum of the means of rounds ``1 .. r - 1``.

A facility the non-finite guard leaves out of round ``r`` (``on_nonfinite=skip``: weight 0) discards its
round: ``Δ_r = 0``, so its local model becomes the landed ``θ_g``.

A checkpoint at ``b_r`` is taken after steps 1-3 and before step 4: it holds ``θ_g``, the outer state, the
error-feedback residual, ``Δ_r`` and round ``r``'s weights, the outer step still to be made. A resumed run
starts that exchange first and lands it at ``b_{r+1}``, as the uninterrupted run does: bitwise the same.
Memory beside one world's rounds: ``Δ`` and the landed mean, two flat fp32 buffers of this rank's shards.
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

__all__ = ["DelayedFederation"]


class DelayedFederation(Federation):
    """:class:`~.federation.Federation` with ``federation.delay=1`` (see the module)."""

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
        return {**super().describe(), "delay": 1}

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
        landed, exchange_s, sent = self._land()
        self._set_pending(delta, weights, done)
        if boundary.end:  # this round's exchange too, in the foreground: every copy ends as theta_global
            self._launch(background=False)
            more, more_s, more_sent = self._land()
            landed, exchange_s, sent = landed + more, exchange_s + more_s, sent + more_sent
            self.own.zero_()
            self._write_params(self.theta.to(self.state.device))
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
    def _land(self) -> tuple[list[int], float, int]:
        """Apply the exchange in flight, if any (step 2): ``([the step its round ended at], its seconds, bytes
        sent)``."""
        flight, self.inflight = self.inflight, None
        if flight is None:
            return [], 0.0, 0
        mean, sent = flight["work"].result()
        self.outer.step(mean.to(self.theta.device))
        return [flight["step"]], flight["work"].seconds, int(sent)

    @torch.no_grad()
    def _set_pending(self, delta: Tensor, weights: list[float] | None, done: int) -> None:
        """Step 3: ``own = Δ`` of the round ended after ``done`` steps, with its weights; the local model
        ``θ_g - Δ``."""
        n = self.state.num_facilities
        scales = [1.0 / n] * n if weights is None else [w / sum(weights) for w in weights]
        self.scales = torch.tensor(scales, dtype=torch.float64)
        self.own.copy_(delta)
        self.pending, self.pending_step = True, done
        self._write_params(self.theta.to(delta.device) - delta)

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
