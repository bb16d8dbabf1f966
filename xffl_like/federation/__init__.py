"""Federated algorithms across facilities: what a round does (see :mod:`.federation`).

    federation = FederationSchedule(job.federation, model, strategy, state, steps, hooks)  # after the strategy
    federation.trained(tokens); federation.after_backward()                    # every step
    boundary = federation.clock.at(done)                                       # what the step is, once
    records = federation.finish(boundary, index)                               # its rounds
    federation.start(boundary, index)                                          # once the step is settled

- :mod:`.options`: the ``federation`` section's checks (:func:`validate_federation`, in the launcher),
  its phases (:func:`plan_phases`) and the weights of a mean;
- :mod:`.federation`: :class:`Federation`, one phase's rounds (or per-step gradient averaging);
- :mod:`.outer`: the outer optimizer on the pseudo-gradient (average, momentum, nesterov = DiLoCo, adam);
- :mod:`.gossip`: mixing with this round's peers over a topology of facilities;
- :mod:`.compress`: bf16 / min-max uint8 compressed mean of the facilities' updates, error feedback;
- :mod:`.topk`: SparseLoCo's top-k messages with error feedback (``compression=topk``);
- the update encodings that cross to an elastic federation's hub: :mod:`xffl_like.hub.protocol.update_codec`;
- :mod:`.streaming`: fragments synced at staggered steps, exchanges overlapping local steps;
- :mod:`.delayed`: a round's exchange overlapping the next round (``delay=1``), its mean applied one round late
  by ``delay_rule``: eager (:class:`~.delayed.EagerFederation`) or own_full;
- :mod:`.phases`: phases of different federation settings (``federation.schedule``), and
  :func:`build_federation`, which picks a :class:`Federation`, a :class:`StreamingFederation` or
  one of :mod:`.delayed`'s;
- :mod:`.clock`: what each step is (a :class:`Boundary`: a fixed ``every``, one per facility, ``every_s``,
  an elastic facility's), one object chosen once by :func:`round_clock`; :mod:`.pace`: the per-facility paces;
- :mod:`.record`: :class:`RoundRecord`, a round's record;
- :mod:`.elastic`: this job as one facility of a federation of independent jobs, its rounds held by a hub;
- :mod:`.protocol`: the interfaces, declared: :class:`Rounds` (what the training side calls),
  :class:`RoundClock`, :class:`Boundary`, :class:`RoundHooks` (what it does at a round).

The config types are :class:`xffl_like.config.schema.FederationConfig` and
:class:`~xffl_like.config.schema.OuterConfig`.
"""

from .clock import round_clock, sync_offsets, synced_at
from .compress import COMPRESSIONS, CompressedMean
from .federation import Federation
from .gossip import GOSSIP_TOPOLOGIES, Gossip, check_gossip_layout
from .options import (
    FEDERATION_ALGORITHMS,
    PHASE_KEYS,
    Phase,
    check_fragments,
    plan_phases,
    round_weights,
    validate_federation,
)
from .outer import OUTER_NAMES, OuterOptimizer, validate_outer
from .phases import FederationSchedule, build_federation
from .protocol import Boundary, FederationPhase, NoHooks, RoundClock, RoundHooks, Rounds
from .record import RoundRecord
from .streaming import StreamingFederation, fragment_of

__all__ = [
    "Boundary",
    "COMPRESSIONS",
    "FEDERATION_ALGORITHMS",
    "GOSSIP_TOPOLOGIES",
    "OUTER_NAMES",
    "CompressedMean",
    "Federation",
    "FederationPhase",
    "FederationSchedule",
    "Gossip",
    "OuterOptimizer",
    "PHASE_KEYS",
    "NoHooks",
    "Phase",
    "RoundClock",
    "RoundHooks",
    "RoundRecord",
    "Rounds",
    "StreamingFederation",
    "build_federation",
    "check_fragments",
    "check_gossip_layout",
    "fragment_of",
    "plan_phases",
    "round_clock",
    "round_weights",
    "sync_offsets",
    "synced_at",
    "validate_federation",
    "validate_outer",
]
