"""Federated algorithms across facilities: what a round does (see :mod:`.round`).

    federation = FederationSchedule(job.federation, model, strategy, state, steps, hooks)  # after the strategy
    federation.trained(tokens); federation.after_backward()                  # every step
    records = federation.finish_due(done, index); federation.start_due(done, index)  # after every step
    federation.clock.due(done); federation.clock.ends_at(done)               # evaluate, checkpoint, stop

- :mod:`.options`: the ``federation`` section's checks (:func:`validate_federation`, in the launcher),
  its phases (:func:`plan_phases`) and the weights of a mean;
- :mod:`.outer`: the outer optimizer on the pseudo-gradient (average, momentum, nesterov = DiLoCo, adam);
- :mod:`.gossip`: mixing with this round's peers over a topology of facilities;
- :mod:`.compress`: bf16 / min-max uint8 compressed mean of the facilities' updates, error feedback;
- :mod:`.streaming`: fragments synced at staggered steps, exchanges overlapping local steps;
- :mod:`.schedule`: phases of different federation settings (``federation.schedule``), and
  :func:`build_federation`, which picks a :class:`Federation` or a :class:`StreamingFederation`;
- :mod:`.clock`: where rounds end (a fixed ``every``, one per facility, ``every_s``, an elastic
  facility's), one object chosen once by :func:`round_clock`;
- :mod:`.protocol`: the interfaces, declared: :class:`Rounds` (what the training side calls),
  :class:`RoundClock`, :class:`RoundHooks` (what it does at a round).

The config types are :class:`xffl_like.config.schema.FederationConfig` and
:class:`~xffl_like.config.schema.OuterConfig`.
"""

from .clock import round_clock, sync_offsets, synced_at
from .compress import COMPRESSIONS, CompressedMean
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
from .protocol import FederationPhase, NoHooks, RoundClock, RoundHooks, Rounds
from .round import Federation
from .schedule import FederationSchedule, build_federation
from .streaming import StreamingFederation, fragment_of

__all__ = [
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
