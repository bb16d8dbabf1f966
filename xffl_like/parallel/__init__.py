"""Data-parallel libraries usable on their own (from a user's torchrun script) or from the main job.

- :mod:`.topology`: gossip schedules (``complete``, ``ring``, ``one-peer-exp``, ``alternating-exp-ring``)
  over any list of ranks, with their process groups;
- :mod:`.codec`: the min-max uint8 codec (ByteGrad, low-precision gossip, federation compression);
- :mod:`.decentralized` and :mod:`.accum_adam`: Decent-DP's DecentralizedDataParallel, AccumAdam(W), factories;
- :mod:`.algorithms` and :mod:`.bagua`: Bagua's algorithms, ``with_algorithm`` and ``switch_to``; both import
  :mod:`.buckets` (the gradient buckets and the interface an algorithm sees of its module), not each other.
- :mod:`.runtime`: what they all run on: node groups (``NodeComm``), the communication thread, finishing
  communication at exit, and small collectives (``p2p_exchange``, ``consensus_distance``).
"""

from .accum_adam import (
    AccumAdam,
    AccumAdamW,
    lr_scheduler_fn_cosine_with_warmup,
    optim_fn_accum_adam,
    optim_fn_accum_adamw,
    optim_fn_adam,
    optim_fn_adamw,
)
from .algorithms import (
    Algorithm,
    AsyncModelAverage,
    ByteGrad,
    Decentralized,
    GradientAllReduce,
    LowPrecisionDecentralized,
    shift_one_peer,
)
from .bagua import BaguaModule, allreduce_parameters, broadcast_parameters, with_algorithm
from .decentralized import DecentralizedDataParallel
from .runtime import consensus_distance
from .topology import TOPOLOGIES, Edge, Topology, register_topology, topology_edges

__all__ = [
    "AccumAdam",
    "AccumAdamW",
    "Algorithm",
    "AsyncModelAverage",
    "BaguaModule",
    "ByteGrad",
    "Decentralized",
    "DecentralizedDataParallel",
    "Edge",
    "GradientAllReduce",
    "LowPrecisionDecentralized",
    "TOPOLOGIES",
    "Topology",
    "allreduce_parameters",
    "broadcast_parameters",
    "consensus_distance",
    "lr_scheduler_fn_cosine_with_warmup",
    "optim_fn_accum_adam",
    "optim_fn_accum_adamw",
    "optim_fn_adam",
    "optim_fn_adamw",
    "register_topology",
    "shift_one_peer",
    "topology_edges",
    "with_algorithm",
]
