"""Aggregation across facilities: immutable strategies, named builders, one executor.

    strategy = build_strategy(model, state, cfg.strategy)      # once, after fully_shard
    result = aggregate(strategy, state, weights)               # every round

Modules: :mod:`.planners` (pure: segments, chunks, buckets, the named builders), :mod:`.options`
(the ``strategy`` section's checks, parameter selection), :mod:`.backend` (reduce op, ``collective``
check, MPI transport), :mod:`.builders` (``build_strategy``), :mod:`.strategy` (the immutable plan),
:mod:`.executor` (one round).
"""

from .backend import check_collective
from .builders import build_strategy
from .executor import AggregationResult, aggregate, facility_scale
from .options import select_parameters, strategy_config, validate_strategy_options
from .planners import STRATEGIES
from .strategy import Communication, Strategy

__all__ = [
    "STRATEGIES",
    "AggregationResult",
    "Communication",
    "Strategy",
    "aggregate",
    "build_strategy",
    "check_collective",
    "facility_scale",
    "select_parameters",
    "strategy_config",
    "validate_strategy_options",
]
