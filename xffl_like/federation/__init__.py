"""Federated algorithms across facilities: what a round does (see :mod:`.round`).

    federation = Federation(cfg["federation"], model, strategy, state)   # once, after the strategy
    federation.trained(tokens); federation.after_backward()              # every step
    if federation.round_due(step, steps): record = federation.round()    # every round

- :mod:`.outer`: the outer optimizer on the pseudo-gradient (average, momentum, nesterov = DiLoCo, adam);
- :mod:`.gossip`: mixing with this round's peers over a topology of facilities;
- :mod:`.compress`: bf16 / min-max uint8 compressed mean of the facilities' updates, error feedback.
"""

from .compress import COMPRESSIONS, CompressedMean
from .gossip import GOSSIP_TOPOLOGIES, Gossip, check_gossip_layout
from .outer import OUTER_NAMES, OuterOptimizer, OuterOptions
from .round import ALGORITHMS, Federation, FederationOptions, validate_federation

__all__ = [
    "ALGORITHMS",
    "COMPRESSIONS",
    "GOSSIP_TOPOLOGIES",
    "OUTER_NAMES",
    "CompressedMean",
    "Federation",
    "FederationOptions",
    "Gossip",
    "OuterOptimizer",
    "OuterOptions",
    "check_gossip_layout",
    "validate_federation",
]
