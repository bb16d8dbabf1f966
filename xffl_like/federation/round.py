"""What happens across facilities: one :class:`Federation` per worker, built after the strategy.

``algorithm=federated`` (default): every ``every`` local steps, :meth:`Federation.round`

1. forms this round's target of the facilities' weights: the weighted mean through the
   aggregation strategy (``topology=complete``), the mix with this round's gossip peers
   (other topologies), or the compressed mean of the facilities' updates
   (``compression=bf16|uint8``, see :mod:`.compress`);
2. takes the pseudo-gradient ``delta = theta_global - target`` and makes an outer step
   on ``theta_global`` (:mod:`.outer`), then sets every copy's parameters to it.

``average`` with lr 1 and no compression skips step 2: the mean is the new weights, bitwise
the plain federated averaging this project did before outer optimizers. Only the
aggregated parameters (``strategy.only``) are touched; the inner (AdamW) optimizer's state
stays local to each facility, as in DiLoCo.

``algorithm=synchronous``: no rounds; after every backward :meth:`Federation.after_backward`
averages the gradients across facilities (data parallel over every model copy).

``fragments`` / ``overlap_steps``: :func:`~.schedule.build_federation` makes a
:class:`~.streaming.StreamingFederation` (rounds of one fragment at a time, overlapped with
local steps). The loop drives either through :meth:`Federation.finish_due` and
:meth:`Federation.start_due` after every step, via :class:`~.schedule.FederationSchedule`
(``federation.schedule``: phases).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..aggregation import aggregate
from ..distributed.state import to_local
from ..schema import FederationConfig
from .compress import CompressedMean
from .gossip import Gossip
from .options import round_weights
from .outer import OuterOptimizer
from .pace import RoundPace

__all__ = ["Federation"]


def _local(p: Tensor) -> Tensor:
    return to_local(p).detach()


class Federation:
    """This worker's side of the federation: rounds (or per-step gradient averaging), the
    global weights and the outer optimizer's state, the token counts since the last round.

    Collective: every rank constructs it at the same point, after the strategy is built.
    """

    _streaming = False  # StreamingFederation handles fragments and overlap

    def __init__(self, cfg: FederationConfig, model: torch.nn.Module, strategy, state):
        self.options = o = cfg  # validated in the launcher (options.validate_federation)
        if o.streaming and not self._streaming:
            raise ValueError(
                "federation.fragments / overlap_steps: build it with schedule.build_federation (a StreamingFederation)"
            )
        self.model, self.strategy, self.state = model, strategy, state
        named = list(model.named_parameters())
        self.names = [named[i][0] for i in strategy.selected]
        self.params = [named[i][1] for i in strategy.selected]
        self.locals = [_local(p) for p in self.params]
        self.numel = sum(t.numel() for t in self.locals)
        self.tokens = torch.zeros(state.num_facilities, dtype=torch.float64, device=state.device)
        self.gossip = Gossip(o.topology, self.locals, state) if o.topology != "complete" and self.federated else None
        # theta_global and the outer state: flat fp32 over this rank's shards, when a round needs them.
        self.theta: Tensor | None = None
        self.outer: OuterOptimizer | None = None
        self.compressor: CompressedMean | None = None
        if self.federated and not o.streaming and (not o.outer.is_plain_mean or o.compression != "none"):
            self._allocate_theta()
            if o.compression != "none":
                self.compressor = CompressedMean(
                    o.compression, self.numel, state.num_facilities, o.chunk_size, o.error_feedback, device=state.device
                )
        self.rounds = 0
        # federation.every as a list or every_s: where this facility's rounds end (set by build_federation),
        # and every facility's steps so far (known to all after each round).
        self.pace: RoundPace | None = None
        self.facility_steps = torch.zeros(state.num_facilities, dtype=torch.int64)
        # The steps this federation covers (a phase of federation.schedule, or the whole job):
        # rounds count from ``begin``; ``last``: the job ends at ``end`` (a final round there).
        self.begin, self.end, self.last = 0, None, True

    def _allocate_theta(self) -> None:
        o, state = self.options, self.state
        device = torch.device("cpu") if o.outer.offload else state.device
        self.theta = torch.empty(
            self.numel, dtype=torch.float32, device=device, pin_memory=o.outer.offload and state.device.type == "cuda"
        )
        self._read_params(self.theta)
        self.outer = OuterOptimizer(o.outer, self.theta)

    @property
    def federated(self) -> bool:
        return self.options.algorithm == "federated"

    def describe(self) -> dict:
        """What the summary records: the algorithm and, for rounds, topology, outer rule, compression."""
        o = self.options
        if not self.federated:
            return {"algorithm": o.algorithm}
        paced = {"every_s": o.every_s} if o.every_s is not None else {}
        return {
            "algorithm": o.algorithm,
            "every": o.every,
            **paced,
            "topology": o.topology,
            "outer": o.outer.name,
            "outer_lr": o.outer.lr,
            "compression": o.compression,
        }

    # ------------------------------------------------------------------ per step
    def trained(self, tokens: int) -> None:
        """Count ``tokens`` this rank trained on this step (for ``weights=tokens``)."""
        self.tokens[self.state.facility] += tokens

    # ------------------------------------------------------------------ the loop's interface
    def applies_at(self, done: int) -> bool:
        """Whether rounds end after ``done`` steps (then :meth:`finish_due` returns their records).
        Rounds count from ``begin``; at ``end`` a final round only when the job ends there (a
        phase switch of :mod:`.schedule` averages instead)."""
        if self.pace is not None:
            return self.pace.due(done)
        if not self.federated or done <= self.begin:
            return False
        if self.end is not None and done >= self.end:
            return done == self.end and self.last
        return (done - self.begin) % self.options.every == 0

    def boundary_at(self, done: int) -> bool:
        """A round, or for ``synchronous`` every ``every`` steps and at the end: where the loop
        evaluates the local model and may checkpoint."""
        if self.federated:  # per-facility paces need federated rounds (refused otherwise)
            return self.applies_at(done)
        return done > self.begin and ((done - self.begin) % self.options.every == 0 or done == self.end)

    def finish_due(self, done: int, adjust=None, dump=None, index: int = 0) -> list[dict]:
        """The rounds that end after ``done`` steps, as records numbered from ``index``.
        ``adjust(weights, round_index)`` may change a round's weights (the non-finite guard);
        ``dump`` (a :class:`~xffl_like.train.round_dump.RoundDump`) records values around each round."""
        if not self.applies_at(done):
            return []
        taken, to_cap = self._meet(done) if self.pace is not None else (None, None)
        if dump is not None:
            dump.save(index, "before")
        out = self.round(adjust=None if adjust is None else lambda weights: adjust(weights, index))
        if dump is not None:
            dump.save(index, "after", bytes_per_rank=out["bytes_per_rank"])
        if self.pace is not None:
            self.pace.round_done(done, to_cap)
        return [{"round": index, "step": done, "fragment": None, "steps_taken": taken, **out}]

    # ------------------------------------------------------------------ per-facility paces (federation/pace.py)
    @property
    def paced(self) -> bool:
        return self.pace is not None

    def _meet(self, done: int) -> tuple[list[int], list[float]]:
        """The steps every facility took in this round, from which :attr:`facility_steps` and, with
        ``every_s``, the end of the job follow, and every facility's :meth:`~.pace.RoundPace.seconds_to_cap`
        (one collective over the world; step counts are exact in float64)."""
        state = self.state
        met = torch.zeros(2, state.num_facilities, dtype=torch.float64)
        if state.facility_rank == 0:
            met[0, state.facility] = done - self.pace.first
            met[1, state.facility] = self.pace.seconds_to_cap(done)
        dist.all_reduce(met)
        taken = met[0].round().to(torch.int64)
        self.facility_steps += taken
        return taken.tolist(), met[1].tolist()

    def job_step(self, done: int) -> int:
        """The job's step after this facility's ``done`` steps: with per-facility paces, the most
        steps any facility has taken (known at a round: what checkpoints are named by); else ``done``."""
        return int(self.facility_steps.max()) if self.pace is not None else done

    def ends_at(self, done: int) -> bool:
        """Whether this facility's training ends after its ``done`` steps: at ``end``; with ``every_s``
        after the first round in which a facility reached it."""
        if self.pace is not None and self.pace.every is None:
            return self.pace.due(done) and int(self.facility_steps.max()) >= self.pace.cap
        if self.pace is not None:
            return done == self.pace.steps
        return self.last and done == self.end

    def starts_at(self, done: int) -> bool:
        """Whether an exchange that overlaps the next local steps starts after ``done`` steps."""
        return False

    def start_due(self, done: int, adjust=None, dump=None, index: int = 0) -> None:
        """Start the exchanges that overlap the next local steps (``overlap_steps``); none here."""

    def wait(self) -> None:
        """Block until no exchange is in flight (nothing to wait for without overlap)."""

    def facility_weights(self) -> list[float] | None:
        """Per-facility weights of this round's mean; ``tokens``: each facility's tokens since the
        last round (collective over the world: every rank adds its own count). Resets the counts."""
        tokens, self.tokens = self.tokens, torch.zeros_like(self.tokens)
        return round_weights(self.options.mean_weights, tokens)

    @torch.no_grad()
    def after_backward(self) -> int:
        """``synchronous``: average the gradients over every facility (weighted like the mean).
        Returns the bytes this rank sent across facilities (0 when federated)."""
        if self.pace is not None:
            self.pace.step_taken()
        if self.federated:
            return 0
        state = self.state
        weights = self.facility_weights()
        n = state.num_facilities
        share = 1.0 / n if weights is None else weights[state.facility] / sum(weights)
        grads = [_local(p.grad) for p in self.model.parameters() if p.grad is not None]
        if n == 1 or not grads:
            return 0
        # Replicas of a facility hold the same gradient after FSDP: each contributes 1/R of its share.
        flat = torch.cat([g.reshape(-1) for g in grads]).mul_(share / state.num_replicas)
        dist.all_reduce(flat, group=state.group("peers"))
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        world = len(state.layout.peer_ranks(state.shard))
        return 2 * (world - 1) * flat.nbytes // world

    # ------------------------------------------------------------------ rounds
    def _read_params(self, out: Tensor) -> Tensor:
        offset = 0
        for t in self.locals:
            out[offset : offset + t.numel()].copy_(t.reshape(-1))
            offset += t.numel()
        return out

    def _write_params(self, flat: Tensor) -> None:
        offset = 0
        for t in self.locals:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    @torch.no_grad()
    def round(self, adjust=None) -> dict:
        """One round across facilities; returns ``seconds``, ``bytes_per_rank``, ``cross_facility_bytes``
        and ``skipped_facilities``. ``adjust(weights) -> (weights, skipped)`` may change this round's
        weights (the non-finite guard leaves facilities out with weight 0)."""
        start = time.perf_counter()
        state = self.state
        weights = self.facility_weights()
        skipped: list[int] = []
        if adjust is not None:
            weights, skipped = adjust(weights)
        index, self.rounds = self.rounds, self.rounds + 1
        delta = None
        if self.compressor is not None:
            delta, sent_bytes = self._compressed_delta(weights)
            cross = self._sum_over_world(sent_bytes)
        elif self.gossip is not None:
            sent_bytes = self.gossip.mix(index)
            cross = self._sum_over_world(sent_bytes)
        else:
            result = aggregate(self.strategy, state, weights)
            sent_bytes, cross = result.bytes_per_rank, result.cross_facility_bytes
        if self.outer is not None:
            if delta is None:  # theta_global - the target the parameters now hold
                delta = self._read_params(torch.empty_like(self.theta)).neg_().add_(self.theta)
            self.outer.step(delta.to(self.theta.device))
            self._write_params(self.theta)
        return {
            "seconds": time.perf_counter() - start,
            "bytes_per_rank": int(sent_bytes),
            "cross_facility_bytes": int(cross),
            "skipped_facilities": skipped,
        }

    def _compressed_delta(self, weights) -> tuple[Tensor, int]:
        """The compressed mean of the facilities' updates ``theta_global - theta_f``, and the bytes sent."""
        state, n = self.state, self.state.num_facilities
        update = self._read_params(torch.empty(self.numel, dtype=torch.float32, device=state.device))
        update.neg_().add_(self.theta.to(state.device))
        message = self.compressor.prepare(update)  # every replica: the same bytes and residual
        scales = [1.0 / n] * n if weights is None else [w / sum(weights) for w in weights]
        if n == 1:
            return self.compressor.reduce(message, None, 0, scales)
        if state.replica == 0:  # one copy per facility crosses the boundary (peers in facility order)
            delta, sent = self.compressor.reduce(message, state.group("senders"), state.facility, scales)
        else:
            delta, sent = torch.empty(self.numel, dtype=torch.float32, device=state.device), 0
        if state.num_replicas > 1:  # the first replica hands the mean update to the others
            src = state.layout.facility_offsets[state.facility] + state.shard
            dist.broadcast(delta, src=src, group=state.group("replica"))
        return delta, sent

    def _sum_over_world(self, value: int) -> int:
        total = torch.tensor([float(value)], dtype=torch.float64, device=self.state.device)
        dist.all_reduce(total)
        return int(total.item())

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The federation's state for DCP: per parameter (by name) DTensors over the same mesh and
        placements as the parameter, viewing this rank's shard of ``theta_global``, the outer
        state and the error-feedback residual; plus counters. Empty tensors sections when unused."""
        # Counters as tensors: DCP stores other objects pickled, which safe loading refuses.
        out: dict[str, Any] = {"rounds": torch.tensor(self.rounds), "tokens": self.tokens.clone()}
        if self.pace is not None:  # each facility's own step: where it resumes (checkpoints carry the job's)
            out["facility_steps"] = self.facility_steps.clone()
        if self.theta is None:
            return out
        out["theta_global"] = self._as_dtensors(self.theta)
        out["outer"] = {
            "steps": torch.tensor(self.outer.steps),
            **{k: self._as_dtensors(v) for k, v in self.outer.buffers.items()},
        }
        if self.compressor is not None and self.compressor.residual is not None:
            out["residual"] = self._as_dtensors(self.compressor.residual)
        return out

    def load_state_dict(self, sd: dict) -> None:
        """Restore what :meth:`state_dict` returned (tensors are copied into the live buffers)."""
        self.rounds = int(sd["rounds"])
        self.tokens.copy_(sd["tokens"])
        if self.pace is not None:
            self.facility_steps.copy_(sd["facility_steps"])
        if self.theta is None:
            return
        self._load_flat(self.theta, sd["theta_global"])
        self.outer.steps = int(sd["outer"]["steps"])
        for k, v in self.outer.buffers.items():
            self._load_flat(v, sd["outer"][k])
        if "residual" in sd and self.compressor is not None and self.compressor.residual is not None:
            self._load_flat(self.compressor.residual, sd["residual"])

    def _views(self, flat: Tensor):
        offset = 0
        for name, p, t in zip(self.names, self.params, self.locals):
            yield name, p, flat[offset : offset + t.numel()].view(t.shape)
            offset += t.numel()

    def _as_dtensors(self, flat: Tensor) -> dict:
        """Per parameter, a DTensor like the parameter whose local tensor is the view of ``flat`` itself,
        on ``flat``'s device: a CPU buffer (``federation.outer.offload=true``) is neither copied nor moved
        to the GPU at a save (``DTensor.from_local`` would move it to the mesh's device), and DCP loads
        into the view in place."""
        from torch.distributed.tensor import DTensor

        from ..checkpoint.staging import dtensor_over

        out = {}
        for name, p, view in self._views(flat):
            if isinstance(p, DTensor):
                out[name] = dtensor_over(view, p)
            else:
                out[name] = view
        return out

    def _load_flat(self, flat: Tensor, tensors: dict) -> None:
        for name, _, view in self._views(flat):
            t = tensors[name]
            view.copy_(to_local(t))
