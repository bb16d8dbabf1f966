"""Federated algorithms across facilities: what a round does (see :mod:`.round`).

    federation = FederationSchedule(cfg["federation"], model, strategy, state, steps)  # after the strategy
    federation.trained(tokens); federation.after_backward()                # every step
    records = federation.finish_due(done, ...); federation.start_due(done, ...)  # after every step

- :mod:`.outer`: the outer optimizer on the pseudo-gradient (average, momentum, nesterov = DiLoCo, adam);
- :mod:`.gossip`: mixing with this round's peers over a topology of facilities;
- :mod:`.compress`: bf16 / min-max uint8 compressed mean of the facilities' updates, error feedback;
- :mod:`.streaming`: fragments synced at staggered steps, exchanges overlapping local steps;
- :mod:`.schedule`: phases of different federation settings (``federation.schedule``).
"""

from .compress import COMPRESSIONS, CompressedMean
from .gossip import GOSSIP_TOPOLOGIES, Gossip, check_gossip_layout
from .outer import OUTER_NAMES, OuterOptimizer, OuterOptions
from .round import ALGORITHMS, Federation, FederationOptions, validate_federation
from .schedule import FederationSchedule, Phase, plan_phases
from .streaming import StreamingFederation, fragment_of, sync_offsets, synced_at

__all__ = [
    "ALGORITHMS",
    "COMPRESSIONS",
    "GOSSIP_TOPOLOGIES",
    "OUTER_NAMES",
    "CompressedMean",
    "Federation",
    "FederationSchedule",
    "FederationOptions",
    "Gossip",
    "OuterOptimizer",
    "OuterOptions",
    "Phase",
    "StreamingFederation",
    "check_gossip_layout",
    "fragment_of",
    "plan_phases",
    "sync_offsets",
    "synced_at",
    "validate_federation",
]
