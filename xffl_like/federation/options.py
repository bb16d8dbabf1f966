"""The ``federation`` section's semantics: its checks, its phases and the weights of a mean.

The config type is :class:`~xffl_like.config.schema.FederationConfig` (``outer``:
:class:`~xffl_like.config.schema.OuterConfig`); this module owns what its values mean:

- :func:`validate_federation`: every key of the section and of each phase of
  ``federation.schedule``, against the planned layout (the launcher calls it once, from
  :func:`xffl_like.config.validate.validate_config`; workers trust the result);
- :func:`plan_phases`: the phases a schedule runs (pure; one phase without ``schedule``);
- :func:`round_weights`: the per-facility weights of a round's mean.

:mod:`.federation`, :mod:`.streaming` and :mod:`.phases` import this module, never each other's
options: the import graph of the package has no cycle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from typing import Any

import torch.distributed as dist
from torch import Tensor

from ..config.checks import is_int, is_number
from ..config.errors import ConfigError
from ..config.schema import FederationConfig, OuterConfig, TopkConfig, as_plain, build_section
from .compress import COMPRESSIONS
from .gossip import check_gossip_layout
from .outer import validate_outer
from .pace import validate_pace
from .topk_tensors import BITS, CHUNKS, MAX_TILE, QUANTIZERS

__all__ = [
    "FEDERATION_ALGORITHMS",
    "PHASE_KEYS",
    "Phase",
    "check_fragments",
    "plan_phases",
    "round_weights",
    "rounds_description",
    "validate_federation",
]

FEDERATION_ALGORITHMS = ("federated", "synchronous")
DELAY_RULES = ("eager", "own_full")  # federation.delay_rule (federation/delayed.py)
#: The keys a phase of ``federation.schedule`` may override: every federation key but these three.
PHASE_KEYS = frozenset(f.name for f in fields(FederationConfig)) - {"schedule", "on_nonfinite", "elastic"}
_EXAMPLE = "e.g. [{until_step: 50, algorithm: synchronous}, {until_step: null, every: 16}]"


def rounds_description(o: FederationConfig) -> dict:
    """The summary's ``federation`` for rounds: the algorithm, ``every`` (and ``every_s``), topology, outer rule,
    compression (one world's :class:`~.federation.Federation` and an elastic facility's alike)."""
    paced = {"every_s": o.every_s} if o.every_s is not None else {}
    return {
        "algorithm": o.algorithm,
        "every": o.every,
        **paced,
        "topology": o.topology,
        "outer": o.outer.name,
        "outer_lr": o.outer.lr,
        "compression": o.compression,
        **({"topk": as_plain(o.topk)} if o.compression == "topk" else {}),
    }


def round_weights(spec: Any, tokens: Tensor) -> list[float] | None:
    """The per-facility weights of a mean for ``federation.weights=spec``: None (uniform), the
    facilities' token counts summed over the world (collective: every rank adds its own count into
    ``tokens``, in place), or the fixed list."""
    if spec == "uniform":
        return None
    if spec == "tokens":
        dist.all_reduce(tokens)
        return tokens.tolist()
    return [float(w) for w in spec]


@dataclass(frozen=True)
class Phase:
    """One phase: steps ``from_step < step <= until_step`` (``None``: to the end) with ``config``
    (the top-level federation keys overridden by the phase's own; ``schedule`` null)."""

    index: int
    from_step: int
    until_step: int | None
    config: FederationConfig
    scheduled: bool = True

    @property
    def where(self) -> str:
        return f"federation.schedule[{self.index}]" if self.scheduled else "federation"

    @property
    def spec(self) -> dict:
        """The phase's keys as plain values (what the summary records), without ``schedule``."""
        return {k: v for k, v in as_plain(self.config).items() if k != "schedule"}


def _merge(base: dict, override: Mapping) -> dict:
    out = dict(base)
    for key, value in override.items():
        if key in ("outer", "topk") and isinstance(value, Mapping):
            out[key] = {**(base.get(key) or {}), **value}
        else:
            out[key] = value
    return out


def plan_phases(cfg: FederationConfig, steps: int | None = None) -> list[Phase]:
    """The phases of ``cfg`` (one, without ``schedule``). Pure: ``cfg`` was validated by
    :func:`validate_federation` (which also plans them, and checks the schedule's shape)."""
    if cfg.schedule is None:
        return [Phase(0, 0, None, cfg, scheduled=False)]
    base = {k: v for k, v in as_plain(cfg).items() if k != "schedule"}
    phases, previous = [], 0
    for i, entry in enumerate(cfg.schedule):
        merged = _merge(base, {k: v for k, v in entry.items() if k != "until_step"})
        phases.append(Phase(i, previous, entry["until_step"], build_section(FederationConfig, merged)))
        previous = entry["until_step"]
    return phases


def _check_schedule(schedule: Any, steps: int | None) -> None:
    """The shape of ``federation.schedule`` (one ``ConfigError`` line; ``steps``: ``train.steps``)."""
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ConfigError(f"federation.schedule={schedule!r}: must be a non-empty list of phases ({_EXAMPLE}) or null")
    previous = 0
    for i, entry in enumerate(schedule):
        where = f"federation.schedule[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where}={entry!r}: a phase is a mapping of until_step and federation keys ({_EXAMPLE})")
        if "until_step" not in entry:
            raise ConfigError(
                f"{where}: until_step is missing (the step the phase ends after; null: the end of training)"
            )
        unknown = sorted(set(entry) - PHASE_KEYS - {"until_step"})
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}: a phase takes until_step and {sorted(PHASE_KEYS)}")
        if "outer" in entry and not isinstance(entry["outer"], Mapping):
            raise ConfigError(
                f"{where}.outer={entry['outer']!r}: must be a mapping of outer keys (e.g. {{name: nesterov}})"
            )
        unknown = sorted(set(entry.get("outer") or {}) - {f.name for f in fields(OuterConfig)})
        if unknown:
            raise ConfigError(
                f"{where}: federation.outer: unknown key(s) {unknown}: use name, lr, momentum, betas, eps, offload"
            )
        topk = entry.get("topk", {})
        if not isinstance(topk, Mapping) or set(topk) - {f.name for f in fields(TopkConfig)}:
            raise ConfigError(f"{where}.topk={topk!r}: a mapping of density, bits, decay (e.g. {{density: 0.02}})")
        until, last = entry["until_step"], i == len(schedule) - 1
        if until is None:
            if not last:
                raise ConfigError(f"{where}.until_step=null: only the last phase may run to the end of training")
        elif not is_int(until) or until <= previous:
            raise ConfigError(
                f"{where}.until_step={until!r}: must be an integer > {previous} (phases end at "
                f"increasing steps; null for the last)"
            )
        elif last and steps is not None and until < steps:
            raise ConfigError(
                f"{where}.until_step={until}: the last phase ends before train.steps={steps}; "
                f"make it null (the end of training)"
            )
        previous = until


def validate_federation(cfg: FederationConfig, layout, steps: int | None = None) -> list[Phase]:
    """Check the ``federation`` section against the planned layout (launching process, once):
    the top-level keys, and with ``schedule`` its shape and every phase (``steps``: ``train.steps``).
    Returns the phases (:func:`plan_phases`); :func:`check_fragments` bounds their fragments by
    the model's blocks. One ``ConfigError`` line naming the key and the fix."""
    validate_pace(cfg, layout.num_facilities, steps or 0)
    _check_one(cfg, layout)
    if cfg.schedule is None:
        return plan_phases(cfg, steps)
    _check_schedule(cfg.schedule, steps)
    phases = plan_phases(cfg, steps)
    if any(phase.config.delay for phase in phases):
        raise ConfigError(
            "federation.delay=1 with federation.schedule: a phase switch averages the copies while a delayed step "
            "is in flight; use delay=0 with a schedule, or drop the schedule"
        )
    for phase in phases:
        try:
            if phase.config.paced or not is_int(phase.config.every) or phase.config.every < 1:
                raise ConfigError(
                    f"federation.every={phase.config.every!r}, every_s={phase.config.every_s!r}: a phase "
                    f"takes a positive integer every and no every_s (phases switch at a step every "
                    f"facility reaches in the same round)"
                )
            _check_one(phase.config, layout)
        except ValueError as exc:
            raise ConfigError(f"{phase.where}: {exc}") from None
    return phases


def check_fragments(phases: list[Phase], num_layers: int) -> None:
    """``fragments`` of every phase against the model's ``num_layers`` blocks (a relation between sections)."""
    for phase in phases:
        fragments = phase.config.fragments
        if fragments > num_layers:
            msg = (
                f"federation.fragments={fragments} exceeds the model's {num_layers} blocks (model.n_layers): "
                f"use fragments <= {num_layers}"
            )
            raise ConfigError(f"{phase.where}: {msg}" if phase.scheduled else msg)


def _check_one(cfg: FederationConfig, layout) -> None:
    """One phase's (or the section's) keys; one ``ConfigError`` line naming the key and the fix."""
    if cfg.algorithm not in FEDERATION_ALGORITHMS:
        raise ConfigError(f"federation.algorithm={cfg.algorithm!r}: use federated or synchronous")
    _check_weights(cfg.weights, layout.num_facilities)
    validate_outer(cfg.outer)
    _check_compression(cfg)
    _check_streaming(cfg)
    _check_delay(cfg)
    _check_combinations(cfg)
    if cfg.algorithm == "federated" and cfg.topology != "complete":
        check_gossip_layout(layout, cfg.topology)


def _check_weights(weights, num_facilities: int) -> None:
    if weights in (None, "uniform", "tokens"):
        return
    if not (
        isinstance(weights, (list, tuple))
        and len(weights) == num_facilities
        and all(is_number(w) and w >= 0 for w in weights)
        and sum(weights) > 0
    ):
        raise ConfigError(
            f"federation.weights={weights!r}: use uniform, tokens, or a list of {num_facilities} non-negative "
            f"numbers with a positive sum (one per facility); null: uniform, or tokens when facilities take "
            f"different steps per round"
        )


def _check_compression(cfg: FederationConfig) -> None:
    """``compression``, ``chunk_size``, ``error_feedback``, and gossip's limits on compression and weights."""
    topology, compression = cfg.topology, cfg.compression
    if compression not in COMPRESSIONS:
        raise ConfigError(f"federation.compression={compression!r}: use one of {', '.join(COMPRESSIONS)}")
    if not is_int(cfg.chunk_size) or cfg.chunk_size < 1:
        raise ConfigError(
            f"federation.chunk_size={cfg.chunk_size!r}: must be a positive integer (values per "
            f"min-max chunk, e.g. 4096)"
        )
    if cfg.error_feedback is not None and not isinstance(cfg.error_feedback, bool):
        raise ConfigError(f"federation.error_feedback={cfg.error_feedback!r}: must be true, false or null")
    _check_preset(cfg)
    if cfg.error_feedback and compression == "none":
        raise ConfigError(
            "federation.error_feedback=true needs federation.compression=bf16 or uint8 "
            "(nothing is lost without compression)"
        )
    if compression == "topk":
        _check_topk(cfg)
    elif replace(cfg.topk, preset=None) != TopkConfig():
        raise ConfigError(
            f"federation.topk={as_plain(cfg.topk)} applies to federation.compression=topk, not "
            f"{compression}: drop it, or set federation.compression=topk"
        )
    if topology != "complete" and compression != "none":
        raise ConfigError(
            f"federation.topology={topology} with federation.compression={compression}: compressed "
            f"gossip is not supported; use topology=complete or compression=none"
        )
    if topology != "complete" and cfg.mean_weights != "uniform":
        raise ConfigError(
            f"federation.weights={cfg.weights!r} with federation.topology={topology}: gossip "
            f"mixes with the topology's own weights; use weights=uniform or topology=complete"
        )


def _check_topk(cfg: FederationConfig) -> None:
    """``federation.topk.*`` and what ``compression=topk`` needs (SparseLoCo: error feedback, whole rounds)."""
    t = cfg.topk
    if not is_number(t.density) or not 0 < t.density <= 1:
        raise ConfigError(
            f"federation.topk.density={t.density!r}: must be a number in (0, 1] (the fraction of each chunk's "
            f"values sent, e.g. 0.02)"
        )
    if not is_int(t.bits) or t.bits not in BITS:
        raise ConfigError(f"federation.topk.bits={t.bits!r}: use 2, 4 or 8 (the sent values' bits)")
    if not is_number(t.decay) or not 0 <= t.decay <= 1:
        raise ConfigError(
            f"federation.topk.decay={t.decay!r}: must be a number in [0, 1] (the error-feedback accumulator's "
            f"decay; SparseLoCo: 0.95)"
        )
    if cfg.error_feedback is False:
        raise ConfigError(
            "federation.error_feedback=false with federation.compression=topk: top-k without its accumulator "
            "drops what each message leaves out for good; drop the key (topk carries it) or use compression=uint8"
        )
    _check_topk_choices(t)
    fragments, overlap = cfg.fragments, cfg.overlap_steps  # their own checks follow (_check_streaming)
    if (is_int(fragments) and fragments > 1) or (is_int(overlap) and overlap > 0):
        raise ConfigError(
            f"federation.compression=topk with federation.fragments={cfg.fragments} / overlap_steps="
            f"{cfg.overlap_steps}: streaming rounds do not send top-k messages; use fragments=1 overlap_steps=0, "
            f"or compression=uint8"
        )


#: ``federation/topk=NAME`` (conf/federation/topk/NAME.yaml): the keys each preset sets. Another value of one of
#: them, set after the preset (the command line, an experiment), is refused.
TOPK_PRESETS: dict[str, dict[str, Any]] = {
    "sparseloco": {
        "compression": "topk",
        "error_feedback": True,
        "outer.name": "average",
        "outer.lr": 1.0,
        "topk.density": 0.03125,
        "topk.bits": 2,
        "topk.decay": 0.95,
        "topk.tile": 64,
        "topk.chunks": "tiles",
        "topk.quantizer": "bins",
    },
    "flat": {
        "compression": "topk",
        "error_feedback": True,
        "chunk_size": 4096,
        "topk.density": 0.02,
        "topk.bits": 2,
        "topk.decay": 0.95,
        "topk.chunks": "flat",
        "topk.quantizer": "levels",
    },
}


def _check_preset(cfg: FederationConfig) -> None:
    """``federation.topk.preset``: a known preset, none of whose keys another value contradicts."""
    name = cfg.topk.preset
    if name is None:
        return
    if name not in TOPK_PRESETS:
        raise ConfigError(f"federation.topk.preset={name!r}: use federation/topk={' or '.join(TOPK_PRESETS)}")
    for key, want in TOPK_PRESETS[name].items():
        section, _, field = key.rpartition(".")
        got = getattr(getattr(cfg, section) if section else cfg, field)
        if got != want:
            raise ConfigError(
                f"federation.{key}={got!r} contradicts federation/topk={name}, which sets it to {want!r}: drop "
                f"federation.{key} (from the command line or the experiment), or set it to {want!r}, or drop the preset"
            )


def _check_topk_choices(t: TopkConfig) -> None:
    """``federation.topk``'s chunks, quantizer and tile, and with tiles a density that keeps a whole number of a full
    tile's values."""
    for key, choices in (("chunks", CHUNKS), ("quantizer", QUANTIZERS)):
        if getattr(t, key) not in choices:
            raise ConfigError(f"federation.topk.{key}={getattr(t, key)!r}: use {' or '.join(choices)}")
    if not is_int(t.tile) or not 1 <= t.tile <= MAX_TILE:
        raise ConfigError(f"federation.topk.tile={t.tile!r}: must be an integer in 1..{MAX_TILE} (a tile's side)")
    if t.chunks == "tiles" and is_number(t.density) and (Fraction(repr(float(t.density))) * t.tile**2).denominator != 1:
        raise ConfigError(
            f"federation.topk.density={t.density!r} x tile^2 ({t.tile}x{t.tile}) is not a whole number of values: "
            f"a full tile keeps density x tile^2 values; e.g. density={128 / t.tile**2!r} keeps 128 (SparseLoCo)"
        )


def _check_combinations(cfg: FederationConfig) -> None:
    """What ``synchronous`` and gossip exclude."""
    topology, fragments, overlap = cfg.topology, cfg.fragments, cfg.overlap_steps
    if cfg.algorithm == "synchronous":
        changed = [
            k
            for k, bad in (
                ("topology", topology != "complete"),
                ("compression", cfg.compression != "none"),
                ("outer", not cfg.outer.is_plain_mean),
                ("fragments", fragments > 1),
                ("overlap_steps", overlap > 0),
                ("delay", cfg.delay != 0),
            )
            if bad
        ]
        if changed:
            raise ConfigError(
                f"federation.algorithm=synchronous averages gradients every step, so federation."
                f"{changed[0]} does not apply: drop it or use algorithm=federated"
            )
    if topology != "complete" and (fragments > 1 or overlap > 0):
        raise ConfigError(
            f"federation.topology={topology} with federation.fragments={fragments} / overlap_steps="
            f"{overlap}: streaming gossip is not supported; use topology=complete or fragments=1 "
            f"overlap_steps=0"
        )


def _check_delay(cfg: FederationConfig) -> None:
    """``delay``: 0 or 1, and what a delayed outer step (federation/delayed.py) excludes besides ``synchronous``."""
    delay = cfg.delay
    if not is_int(delay) or delay not in (0, 1):
        raise ConfigError(
            f"federation.delay={delay!r}: use 0 (each round's outer step at its boundary) or 1 (one round late, its "
            f"exchange overlapping the next round's local steps)"
        )
    rule = cfg.delay_rule
    if rule is not None and rule not in DELAY_RULES:
        raise ConfigError(
            f"federation.delay_rule={rule!r}: use eager (the default: each facility's own fresh progress at its "
            f"share, the others' one round late) or own_full (the rule before eager)"
        )
    if rule is not None and delay != 1:
        raise ConfigError(
            f"federation.delay_rule={rule} applies to federation.delay=1 (now {delay}): drop delay_rule or set "
            f"federation.delay=1"
        )
    if delay == 0 or cfg.algorithm != "federated":
        return
    if cfg.topology != "complete":
        raise ConfigError(
            f"federation.delay=1 with federation.topology={cfg.topology}: a delayed step is an outer step on the "
            f"mean; use topology=complete or delay=0"
        )
    if cfg.streaming:
        raise ConfigError(
            f"federation.delay=1 with federation.fragments={cfg.fragments} / overlap_steps={cfg.overlap_steps}: "
            f"streaming rounds overlap fragments their own way; use fragments=1 overlap_steps=0, or delay=0"
        )


def _check_streaming(cfg: FederationConfig) -> None:
    """``fragments``, ``overlap_steps``, ``merge_alpha``, checked against ``every`` (per-facility paces refuse
    them: :func:`~.pace.check_pace_job`)."""
    every, fragments, overlap, alpha = cfg.every, cfg.fragments, cfg.overlap_steps, cfg.merge_alpha
    if not is_int(fragments) or fragments < 1:
        raise ConfigError(
            f"federation.fragments={fragments!r}: must be a positive integer (1: the whole model at once)"
        )
    if not cfg.paced and fragments > every:
        raise ConfigError(
            f"federation.fragments={fragments} exceeds federation.every={every}: each fragment syncs at "
            f"its own step of the round; use fragments <= every"
        )
    if not is_int(overlap) or overlap < 0:
        raise ConfigError(f"federation.overlap_steps={overlap!r}: must be an integer >= 0 (0: no overlap)")
    if not cfg.paced and overlap * fragments >= every:
        raise ConfigError(
            f"federation.overlap_steps={overlap} must be < federation.every/fragments = "
            f"{every}/{fragments} so that one fragment is in flight at a time: lower overlap_steps or "
            f"fragments, or raise every"
        )
    if not is_number(alpha) or not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"federation.merge_alpha={alpha!r}: must be a number in [0, 1] (Streaming DiLoCo: 0.5)")
