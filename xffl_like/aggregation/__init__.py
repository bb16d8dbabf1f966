"""Aggregation across facilities: immutable strategies, named builders, one executor.

    strategy = build_strategy(model, state, cfg["strategy"])   # once, after fully_shard
    result = aggregate(strategy, state, weights)               # every round
"""

from .builders import STRATEGIES, StrategyOptions, build_strategy, check_collective, validate_strategy_options
from .executor import AggregationResult, aggregate
from .reference import ReferenceAverage, facility_scale
from .strategy import Communication, Strategy

__all__ = [
    "STRATEGIES",
    "AggregationResult",
    "Communication",
    "ReferenceAverage",
    "Strategy",
    "StrategyOptions",
    "aggregate",
    "build_strategy",
    "check_collective",
    "facility_scale",
    "validate_strategy_options",
]
