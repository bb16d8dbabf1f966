"""What happens across facilities: one :class:`Federation` per worker, built after the strategy.

``algorithm=federated`` (default): at each round of the clock (:mod:`.clock`: every ``every`` local
steps, or per facility), :meth:`Federation.round`

1. forms this round's target of the facilities' weights, by the mixing chosen at construction:
   the weighted mean through the aggregation strategy (:class:`PlainMean`, ``topology=complete``),
   the mix with this round's gossip peers (:class:`GossipMix`, other topologies), or the compressed
   mean of the facilities' updates (:class:`CompressedMix`, ``compression=bf16|uint8``, see :mod:`.compress`;
   ``topk``: SparseLoCo's sparse messages with error feedback, see :mod:`.topk`);
2. takes the pseudo-gradient ``delta = theta_global - target`` and makes an outer step
   on ``theta_global`` (:mod:`.outer`), then sets every copy's parameters to it.

``average`` with lr 1 and no compression skips step 2: the mean is the new weights, bitwise
the plain federated averaging this project did before outer optimizers. Only the
aggregated parameters (``strategy.only``) are touched; the inner (AdamW) optimizer's state
stays local to each facility, as in DiLoCo.

``algorithm=synchronous``: no rounds; after every backward :meth:`Federation.after_backward`
averages the gradients across facilities (data parallel over every model copy).

``fragments`` / ``overlap_steps``: :func:`~.phases.build_federation` makes a
:class:`~.streaming.StreamingFederation` (rounds of one fragment at a time, overlapped with
local steps), ``delay=1`` a :class:`~.delayed.DelayedFederation`. The sync drives each through
:meth:`Federation.finish` and :meth:`Federation.start` with the step's :class:`~.protocol.Boundary`
(the clock's, :mod:`.clock`), via :class:`~.phases.FederationSchedule` (``federation.schedule``:
phases); the training side's part of a round (the non-finite guard's weights, the tests' record of
the values) comes as the :class:`~.protocol.RoundHooks` given at construction. Each round's record is a
:class:`~.record.RoundRecord`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..aggregation import aggregate
from ..config.schema import FederationConfig
from ..distributed.state import to_local
from .compress import CompressedMean
from .gossip import Gossip
from .options import round_weights, rounds_description
from .outer import OuterOptimizer
from .protocol import Boundary, NoHooks, RoundHooks
from .record import RoundRecord
from .topk import TopkMean, zero_code_shares
from .topk_tensors import TensorCodec, options_of

__all__ = ["CompressedMix", "Federation", "GossipMix", "PlainMean", "compressed_exchange", "sum_exchange"]


def _local(p: Tensor) -> Tensor:
    return to_local(p).detach()


def _sum_over_world(value: int, state) -> int:
    total = torch.tensor([float(value)], dtype=torch.float64, device=state.device)
    dist.all_reduce(total)
    return int(total.item())


def compressed_exchange(comp, message: Tensor, numel: int, scales: list[float], state, peers, replicas):
    """An exchange (run inline, or as a :class:`~.streaming.OverlappedExchange`) of a compressed ``message`` of
    ``numel`` values: the first replica of each facility reduces it among ``peers`` (one per facility, weighted by
    ``scales``) and broadcasts the mean to its ``replicas``; returns ``(mean, bytes this rank sent)``."""
    source = state.layout.facility_offsets[state.facility] + state.shard

    def exchange() -> tuple[Tensor, int]:
        if state.num_facilities == 1:
            return comp.reduce(message, None, 0, scales)
        if state.replica == 0:  # one copy per facility crosses the boundary
            mean, sent = comp.reduce(message, peers, state.facility, scales)
        else:
            mean, sent = torch.empty(numel, dtype=torch.float32, device=message.device), 0
        if replicas is not None:
            dist.broadcast(mean, src=source, group=replicas)
        return mean, sent

    return exchange


def sum_exchange(scaled: Tensor, state, peers, replicas):
    """An exchange (run inline, or as a :class:`~.streaming.OverlappedExchange`) that sums ``scaled`` (already weighted)
    over ``peers`` in place, from the first replica of each facility, and broadcasts it to its ``replicas``;
    returns ``(sum, bytes sent)``."""
    source = state.layout.facility_offsets[state.facility] + state.shard
    n = state.num_facilities

    def exchange() -> tuple[Tensor, int]:
        sent = 0
        if n > 1 and state.replica == 0:
            dist.all_reduce(scaled, group=peers)
            sent = 2 * (n - 1) * scaled.nbytes // n  # a ring all-reduce's sends
        if replicas is not None:
            dist.broadcast(scaled, src=source, group=replicas)
        return scaled, sent

    return exchange


class PlainMean:
    """A round's target: the weighted mean through the aggregation strategy (``topology=complete``)."""

    def __init__(self, strategy, state):
        self.strategy, self.state = strategy, state

    def mix(self, weights: list[float] | None, index: int) -> tuple[Tensor | None, int, int]:
        """Set the parameters to the target; ``(delta or None, bytes this rank sent, bytes across facilities)``."""
        result = aggregate(self.strategy, self.state, weights)
        return None, result.bytes_per_rank, result.cross_facility_bytes

    def recorded(self) -> dict:
        """What the tests' record of the round keeps beside the weights (nothing here)."""
        return {}


class GossipMix:
    """A round's target: the mix with this round's gossip peers (other topologies; the weights are the topology's)."""

    def __init__(self, gossip: Gossip, state):
        self.gossip, self.state = gossip, state

    def mix(self, weights: list[float] | None, index: int) -> tuple[Tensor | None, int, int]:
        sent = self.gossip.mix(index)
        return None, sent, _sum_over_world(sent, self.state)

    def recorded(self) -> dict:
        return {}


class CompressedMix:
    """A round's target: the compressed mean of the facilities' updates ``theta_global - theta_f``
    (``compression=bf16|uint8|topk``): the pseudo-gradient itself, the parameters untouched."""

    def __init__(self, federation: Federation, compressor: CompressedMean | TopkMean):
        self.federation, self.compressor = federation, compressor
        self.message: Tensor | None = None  # the last round's, until :meth:`recorded` hands it over

    def recorded(self) -> dict:
        """This rank's last message and its error-feedback residual after it (the tests' record of a round)."""
        message, self.message = self.message, None
        residual = self.compressor.residual
        return {
            **({"message": message} if message is not None else {}),
            **({"residual": residual} if residual is not None else {}),
        }

    def mix(self, weights: list[float] | None, index: int) -> tuple[Tensor | None, int, int]:
        fed = self.federation
        state, n = fed.state, fed.state.num_facilities
        update = fed._read_params(torch.empty(fed.numel, dtype=torch.float32, device=state.device))
        update.neg_().add_(fed.theta.to(state.device))
        message = self.compressor.prepare(update)  # every replica: the same bytes and residual
        self.message = message
        scales = [1.0 / n] * n if weights is None else [w / sum(weights) for w in weights]
        peers = state.group("senders") if n > 1 else None  # one copy per facility crosses, in facility order
        replicas = state.group("replica") if state.num_replicas > 1 else None
        delta, sent = compressed_exchange(self.compressor, message, fed.numel, scales, state, peers, replicas)()
        return delta, sent, _sum_over_world(sent, state)


class Federation:
    """This worker's side of the federation: rounds (or per-step gradient averaging), the
    global weights and the outer optimizer's state, the token counts since the last round.

    Collective: every rank constructs it at the same point, after the strategy is built.
    """

    _streaming = False  # StreamingFederation handles fragments and overlap

    def __init__(
        self,
        cfg: FederationConfig,
        model: torch.nn.Module,
        strategy,
        state,
        *,
        hooks: RoundHooks | None = None,
    ):
        """A phase of ``federation.schedule``, or the whole job (where its rounds fall is the clock's: the
        :class:`~.protocol.Boundary` given to :meth:`finish`); ``hooks``: what the training side does at
        each round (by default nothing)."""
        self.options = o = cfg  # validated in the launcher (options.validate_federation)
        if o.streaming and not self._streaming:
            raise ValueError(
                "federation.fragments / overlap_steps: build it with phases.build_federation (a StreamingFederation)"
            )
        self.model, self.strategy, self.state = model, strategy, state
        self.hooks = hooks if hooks is not None else NoHooks()
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
        self.compressor: CompressedMean | TopkMean | None = None
        if self.federated and not o.streaming and (not o.outer.is_plain_mean or o.compression != "none"):
            self._allocate_theta()
            n, t = state.num_facilities, o.topk
            if o.compression == "topk":
                # the tiles of this rank's shard of each tensor (the same shapes on every facility's rank), or flat
                # chunks of this rank's shards concatenated
                codec = TensorCodec(self.numel, options_of(t, o.chunk_size), [list(p.shape) for p in self.locals])
                self.compressor = TopkMean(codec, n, t.decay, state.device)
            elif o.compression != "none":
                self.compressor = CompressedMean(
                    o.compression, self.numel, n, o.chunk_size, o.feedback, device=state.device
                )
        self.rounds = 0
        self.mixing = self._mixing()  # what forms a round's target, chosen once

    def _mixing(self) -> PlainMean | GossipMix | CompressedMix:
        if self.compressor is not None:
            return CompressedMix(self, self.compressor)
        if self.gossip is not None:
            return GossipMix(self.gossip, self.state)
        return PlainMean(self.strategy, self.state)

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
        return rounds_description(o) if self.federated else {"algorithm": o.algorithm}

    def message_stats(self) -> dict:
        """What the summary records of the messages sent (collective, at the job's end): with top-k,
        ``topk_zero_codes`` (:func:`.topk.zero_code_shares`); else nothing."""
        if not isinstance(self.compressor, TopkMean):
            return {}
        return {"topk_zero_codes": zero_code_shares(self.compressor.zero_codes, self.state)}

    # ------------------------------------------------------------------ per step
    def trained(self, tokens: int) -> None:
        """Count ``tokens`` this rank trained on this step (for ``weights=tokens``)."""
        self.tokens[self.state.facility] += tokens

    # ------------------------------------------------------------------ the loop's interface
    def finish(self, boundary: Boundary, index: int) -> list[RoundRecord]:
        """The round that ends at ``boundary`` (its record, numbered ``index``); none where it has no round
        (``synchronous``, a phase switch: :mod:`.phases` averages instead)."""
        if not boundary.finish:
            return []
        done = boundary.step
        self.hooks.save(index, "before")
        out = self.round(index, done)
        self.hooks.save(index, "after", bytes_per_rank=out["bytes_per_rank"], **self.mixing.recorded())
        taken = None if boundary.taken is None else list(boundary.taken)
        return [RoundRecord(index, done, None, steps_taken=taken, **out)]

    def start(self, boundary: Boundary, index: int) -> None:
        """Start the exchanges that overlap the next local steps (``overlap_steps``, ``delay``); none here."""

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
    def round(self, index: int = 0, done: int = 0) -> dict:
        """One round across facilities (record ``index``, after ``done`` steps); returns ``seconds``,
        ``bytes_per_rank``, ``cross_facility_bytes`` and ``skipped_facilities``. The hooks may change
        this round's weights (the non-finite guard leaves facilities out with weight 0)."""
        start = time.perf_counter()
        weights, skipped = self.hooks.weights_for_round(self.facility_weights(), index, done)
        rounds, self.rounds = self.rounds, self.rounds + 1
        delta, sent_bytes, cross = self.mixing.mix(weights, rounds)
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

    def _sum_over_world(self, value: int) -> int:
        return _sum_over_world(value, self.state)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The federation's state for DCP: per parameter (by name) DTensors over the same mesh and
        placements as the parameter, viewing this rank's shard of ``theta_global``, the outer
        state and the error-feedback residual; plus counters. Empty tensors sections when unused."""
        # Counters as tensors: DCP stores other objects pickled, which safe loading refuses.
        out: dict[str, Any] = {"rounds": torch.tensor(self.rounds), "tokens": self.tokens.clone()}
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
