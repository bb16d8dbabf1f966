"""The federation's description: what every facility of one federation shares, and its checks.

A facility builds it from its job (:func:`federation_spec`, :func:`hub_spec`); the first facility's becomes
the federation's, and every later one must match it (:func:`first_difference`). It came from the network, so
the hub checks the keys it reads before using them (:func:`check_spec`, :func:`numel_of`), each refusal one
:class:`SpecError` line.
"""

from __future__ import annotations

import math
from typing import Any

from .update_codec import CODECS

__all__ = [
    "AGGREGATES",
    "CARRIER",
    "MAX_PARAMETERS",
    "MAX_TENSORS",
    "SpecError",
    "carries_means",
    "check_spec",
    "codec_of",
    "federation_spec",
    "final_in_fp32",
    "first_difference",
    "hub_spec",
    "numel_of",
]


#: The rules ``federation.elastic.aggregate`` names (the hub's :mod:`..server.aggregate`).
AGGREGATES = ("mean", "median", "trimmed_mean")
#: The value a key added since has in a federation saved before it (so its facilities still match).
ADDED = {"aggregate": "mean", "trim": 0.2, "delay": 0, "delay_rule": None, "delay_outer": None}
#: The description's keys that are ``federation.elastic``'s.
ELASTIC_KEYS = ("grace_s", "max_norm_ratio", "aggregate", "trim", "min_facilities")
#: The most parameters a federation may have (the hub holds θ_global, an accumulator and the outer optimizer's
#: state in fp32: 2^34 parameters are 64 GiB each).
MAX_PARAMETERS = 1 << 34
#: The most tensors (entries of ``parameters``) a description may list.
MAX_TENSORS = 1 << 16
#: The longest round time (``federation.every_s``) or grace (``federation.elastic.grace_s``), in seconds.
MAX_SECONDS = 1e7
_MAX_KEYS = 64


class SpecError(ValueError):
    """A federation's description the hub cannot hold (one line: what is invalid)."""


def federation_spec(job) -> dict[str, Any]:
    """What every facility of one federation must share: the model's parameters (names, shapes,
    dtypes), the algorithm, the outer optimizer, compression, the number of rounds (each facility its own
    ``federation.every``) or, with ``federation.every_s``, the round time and the last step."""
    from ...config.schema import as_plain
    from ...models import build_model

    model = build_model(job.model, device="meta")
    fed = job.federation
    return {
        "parameters": [[n, list(p.shape), str(p.dtype).replace("torch.", "")] for n, p in model.named_parameters()],
        "algorithm": fed.algorithm,
        "outer": as_plain(fed.outer),
        "compression": {
            "kind": fed.compression,
            "chunk_size": fed.chunk_size,
            "error_feedback": fed.feedback,
            **(_topk_spec(fed.topk) if fed.compression == "topk" else {}),
        },  # fmt: skip
        # Facilities may take different steps per round (their own federation.every) if their rounds are as many;
        # with federation.every_s the round time and the last step are shared.
        "every_s": fed.every_s,
        "rounds": -(-job.train.steps // fed.every) if fed.every_s is None else None,
        "train.steps": job.train.steps if fed.every_s is not None else None,
        "weights": fed.mean_weights,
    }


#: The mean a top-k description names: per index over the senders (issue 39). A description without it (nor its
#: ``chunks`` and ``quantizer``) is top-k as it was before issue 39, whose weighted mean is no longer computed.
TOPK_MEAN = {"mean": "senders"}
TILE = 64  # ``federation.topk.tile``'s default: absent from a description at this value


def _topk_spec(t) -> dict[str, Any]:
    out = {"density": float(t.density), "bits": int(t.bits), "decay": float(t.decay), **TOPK_MEAN}
    out |= {"chunks": t.chunks, "quantizer": t.quantizer}
    return out | ({"tile": int(t.tile)} if t.tile != TILE else {})


#: The hub's outer rule under ``federation.delay=1`` with ``delay_rule=eager``: θ_global carries the sum of the
#: rounds' means (``θ_v = θ_{v-1} - D_v``); the facilities step their own (:func:`hub_spec`).
CARRIER = {"name": "average", "lr": 1.0, "momentum": 0.0}


def carries_means(fed) -> bool:
    """Whether the hub's θ_global carries the means (:data:`CARRIER`): ``fed`` (``federation``) has ``delay=1`` with
    ``delay_rule=eager``."""
    return fed.delay == 1 and (fed.delay_rule or "eager") == "eager"


def hub_spec(job) -> dict[str, Any]:
    """What every facility of a hub's federation shares: :func:`federation_spec` plus the hub's rules. Under
    ``federation.delay=1`` with ``delay_rule=eager`` the hub's outer rule is the carrier of the means
    (``average`` at lr 1) and the facilities' own one is ``delay_outer``."""
    e, fed = job.federation.elastic, job.federation
    spec = federation_spec(job)
    if carries_means(fed):
        spec["delay_outer"] = spec["outer"]
        spec["outer"] = {**spec["outer"], **CARRIER}
    return {
        **spec,
        "grace_s": float(e.grace_s),
        "max_norm_ratio": float(e.max_norm_ratio),
        "aggregate": e.aggregate,
        "trim": float(e.trim),
        "weights_rule": fed.weights,
        "paced": fed.paced,
        "min_facilities": e.min_facilities,
        "delay": int(fed.delay),
        "delay_rule": (fed.delay_rule or "eager") if fed.delay else None,
    }


def final_in_fp32(spec: dict) -> bool:
    """Whether the federation's final round (round ``rounds``, with a fixed ``every``) carries fp32 parameters
    although the federation compresses: under ``delay=1`` with ``delay_rule=eager`` each facility's upload there is
    its end, ``outer_f(θ_f, ...) - c Δ``, far from θ_global (``xffl_like/federation/elastic/delayed.py``), which a
    compressed update would lose; the hub's last round is then the fp32 mean of those ends. The hub and every
    facility decide it from the description alone (the hub by its own round count, a facility by its last step)."""
    compression = spec.get("compression")
    return (
        isinstance(compression, dict)
        and compression.get("kind") != "none"
        and spec.get("delay") == 1
        and spec.get("delay_rule") == "eager"
        and spec.get("every_s") is None
        and type(spec.get("rounds")) is int
    )


def first_difference(mine: dict, theirs: dict) -> str | None:
    """The first way ``mine`` differs from the federation's ``theirs``, in words; None if they match."""
    a, b = mine["parameters"], theirs["parameters"]
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"parameter {i}: {x[0]} {x[1]} {x[2]} here, {y[0]} {y[1]} {y[2]} in the federation"
    if len(a) != len(b):
        return f"{len(a)} parameters here, {len(b)} in the federation"
    # the delay first: under delay_rule=eager it changes the outer rule the hub is given too
    for key in sorted(mine, key=lambda k: k not in ("delay", "delay_rule")):
        if key != "parameters" and mine[key] != theirs.get(key, ADDED.get(key)):
            if key in ("compression", "delay", "delay_rule"):
                return _setting_difference(key, mine[key], theirs.get(key, ADDED.get(key)))
            if key == "rounds":
                return (
                    f"{mine[key]} rounds here (train.steps / federation.every), {theirs.get(key)} in the "
                    f"federation: set train.steps to {theirs.get(key)} x federation.every"
                )
            name = key if key == "train.steps" else f"federation.{'elastic.' * (key in ELASTIC_KEYS)}{key}"
            name = "federation.outer" if key == "delay_outer" else name
            return f"{name}: {mine[key]!r} here, {theirs.get(key, ADDED.get(key))!r} in the federation"
    return None


#: The config key of each entry of the description's ``compression``.
_COMPRESSION_KEYS = {"kind": "federation.compression", "chunk_size": "federation.chunk_size",
                     "error_feedback": "federation.error_feedback", "density": "federation.topk.density",
                     "bits": "federation.topk.bits", "decay": "federation.topk.decay",
                     "tile": "federation.topk.tile", "chunks": "federation.topk.chunks",
                     "quantizer": "federation.topk.quantizer"}  # fmt: skip


def _override(value) -> str:
    """``value`` as a Hydra override writes it."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _with_tile(comp: dict) -> dict:
    """A top-k description with its ``tile`` spelled out (absent at :data:`TILE`)."""
    return {"tile": TILE, **comp} if comp.get("kind") == "topk" else comp


def _setting_difference(key: str, mine, theirs) -> str:
    """A facility dialling with another compression or delay than the federation's: the first setting that
    differs, both values and the override that makes this facility match."""
    name, a, b = f"federation.{key}", mine, theirs
    if key == "compression" and isinstance(mine, dict) and isinstance(theirs, dict):
        mine, theirs = _with_tile(mine), _with_tile(theirs)
        subs = [s for s in ("kind", *sorted(set(mine) | set(theirs) - {"kind"})) if mine.get(s) != theirs.get(s)]
        if subs:
            name, a, b = _COMPRESSION_KEYS.get(subs[0], f"{name}.{subs[0]}"), mine.get(subs[0]), theirs.get(subs[0])
    return (
        f"{name}: {a!r} here, {b!r} in the federation: every facility of a federation must use the same; run this "
        f"facility with {name}={_override(b)}"
    )


def _is_int(v, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _is_real(v, lo: float, hi: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi


def _tensor(i: int, p: Any) -> int:
    """The number of values of entry ``i`` of ``parameters`` ([name, shape, "float32"]), checked."""
    if not (isinstance(p, list) and len(p) == 3 and isinstance(p[0], str) and 0 < len(p[0]) <= 512):
        raise SpecError(f"parameters[{i}] is not [name, shape, dtype]")
    if not (isinstance(p[1], list) and len(p[1]) <= 8 and all(_is_int(d, 0, MAX_PARAMETERS) for d in p[1])):
        raise SpecError(f"parameter {p[0]!r}: its shape {str(p[1])[:60]} is not a list of at most 8 sizes")
    if p[2] != "float32":
        raise SpecError(f"parameter {p[0]!r}: the hub averages fp32 parameters only")
    return math.prod(p[1])


def numel_of(spec: dict) -> int:
    """The number of parameters the description lists (fp32 only, at most :data:`MAX_PARAMETERS`), checked."""
    params = spec.get("parameters") if isinstance(spec, dict) else None
    if not isinstance(params, list) or not params:
        raise SpecError("the federation's description lists no parameters")
    if len(params) > MAX_TENSORS:
        raise SpecError(f"the federation's description lists {len(params)} tensors (at most {MAX_TENSORS})")
    total = 0
    for i, p in enumerate(params):
        total += _tensor(i, p)
        if total > MAX_PARAMETERS:
            break
    if not 0 < total <= MAX_PARAMETERS:
        raise SpecError(f"{total} parameters is out of range (the hub holds 1 to {MAX_PARAMETERS})")
    return total


def _check_rules(spec: dict) -> None:
    """The round rules: times, counts and switches, each of its type and within bounds."""
    for key in ("grace_s", "max_norm_ratio"):
        if not _is_real(spec.get(key), 0.0, MAX_SECONDS):
            raise SpecError(f"federation.elastic.{key}={spec.get(key)!r} is invalid (a number in [0, {MAX_SECONDS:g}])")
    every_s = spec.get("every_s")
    if every_s is not None and not _is_real(every_s, 1e-3, MAX_SECONDS):
        raise SpecError(f"federation.every_s={every_s!r} is invalid (null or seconds in [0.001, {MAX_SECONDS:g}])")
    for key in ("rounds", "train.steps"):
        if spec.get(key) is not None and not _is_int(spec.get(key), 1, 1 << 62):
            raise SpecError(f"{key}={spec.get(key)!r} is invalid (null or a positive integer)")
    if spec.get("min_facilities") is not None and not _is_int(spec.get("min_facilities"), 0, 1 << 16):
        raise SpecError(f"federation.elastic.min_facilities={spec.get('min_facilities')!r} is invalid")
    if spec.get("paced") not in (None, True, False):
        raise SpecError(f"federation.paced={spec.get('paced')!r} is invalid (true or false)")
    if not isinstance(spec.get("outer"), dict):
        raise SpecError("the federation's description has no outer optimizer (outer: an object)")


def check_spec(spec: dict) -> None:
    """The whole description, checked before use: the parameters (:func:`numel_of`), the round rules, the
    compression and the weights (other keys are only compared between facilities: at most 64 keys)."""
    if not isinstance(spec, dict) or len(spec) > _MAX_KEYS:
        raise SpecError(f"the federation's description is not an object of at most {_MAX_KEYS} keys")
    numel_of(spec)
    _check_rules(spec)
    comp = spec.get("compression")
    if not isinstance(comp, dict) or comp.get("kind") not in ("none", *CODECS):
        raise SpecError(f"compression {comp!r}: the hub takes none, {', '.join(CODECS)}")
    if comp["kind"] != "none":
        size = comp.get("chunk_size")
        if not (isinstance(size, int) and not isinstance(size, bool) and 1 <= size <= 1 << 24):
            raise SpecError(f"federation.chunk_size={size!r} is invalid")
    if comp["kind"] == "topk":
        density, bits = comp.get("density"), comp.get("bits")
        if not (isinstance(density, float) and 0.0 < density <= 1.0):
            raise SpecError(f"federation.topk.density={density!r} is invalid")
        if bits not in (2, 4, 8) or isinstance(bits, bool):
            raise SpecError(f"federation.topk.bits={bits!r} is invalid")
        _check_topk_choices(comp)
    if spec.get("aggregate", "mean") not in AGGREGATES:
        rule = spec.get("aggregate")
        raise SpecError(f"federation.elastic.aggregate={rule!r}: the hub takes {', '.join(AGGREGATES)}")
    trim = spec.get("trim", 0.0)
    if not (isinstance(trim, (int, float)) and not isinstance(trim, bool) and 0 <= trim < 0.5):
        raise SpecError(f"federation.elastic.trim={trim!r} is invalid: a fraction in [0, 0.5)")
    if spec.get("weights_rule") not in (None, "uniform", "tokens"):
        raise SpecError(f"weights {spec.get('weights_rule')!r}: the hub weighs uniform or tokens")


def _check_topk_choices(comp: dict) -> None:
    from ...federation.topk_tensors import CHUNKS, MAX_TILE, QUANTIZERS

    if any(comp.get(k) != v for k, v in TOPK_MEAN.items()):
        raise SpecError(
            f"federation.topk mean={comp.get('mean')!r}: the weighted top-k mean of before issue 39 is no longer "
            f"computed (only {TOPK_MEAN}); start this federation anew (a new --state) with the facilities of this "
            f"version"
        )
    for key, choices in (("chunks", CHUNKS), ("quantizer", QUANTIZERS)):
        if comp.get(key) not in choices:
            raise SpecError(f"federation.topk.{key}={comp.get(key)!r} is invalid (one of {', '.join(choices)})")
    tile = comp.get("tile", TILE)
    if not (isinstance(tile, int) and not isinstance(tile, bool) and 1 <= tile <= MAX_TILE):
        raise SpecError(f"federation.topk.tile={tile!r} is invalid")


def codec_of(spec: dict):
    """The :class:`~.update_codec.UpdateCodec` of the description's compression (None: fp32 parameters)."""
    from .update_codec import UpdateCodec

    comp = spec["compression"]
    if comp["kind"] == "none":
        return None
    if comp["kind"] != "topk":
        return UpdateCodec(comp["kind"], numel_of(spec), comp["chunk_size"])
    from ...federation.topk_tensors import TopkOptions

    topk = TopkOptions(
        comp["density"], comp["bits"], comp.get("tile", TILE), comp["chunks"], comp["quantizer"], comp["chunk_size"]
    )
    shapes = [p[1] for p in spec["parameters"]]
    return UpdateCodec(comp["kind"], numel_of(spec), comp["chunk_size"], topk, shapes)
