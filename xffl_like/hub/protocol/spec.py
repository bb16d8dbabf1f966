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
    "SpecError",
    "check_spec",
    "codec_of",
    "federation_spec",
    "first_difference",
    "hub_spec",
    "numel_of",
]


#: The rules ``federation.elastic.aggregate`` names (the hub's :mod:`..server.aggregate`).
AGGREGATES = ("mean", "median", "trimmed_mean")
#: The value a key added since has in a federation saved before it (so its facilities still match).
ADDED = {"aggregate": "mean", "trim": 0.2}
#: The description's keys that are ``federation.elastic``'s.
ELASTIC_KEYS = ("grace_s", "max_norm_ratio", "aggregate", "trim", "min_facilities")


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
            "error_feedback": fed.error_feedback,
            **(
                {"density": float(fed.topk.density), "bits": int(fed.topk.bits), "decay": float(fed.topk.decay)}
                if fed.compression == "topk"
                else {}
            ),
        },  # fmt: skip
        # Facilities may take different steps per round (their own federation.every) if their rounds are as many;
        # with federation.every_s the round time and the last step are shared.
        "every_s": fed.every_s,
        "rounds": -(-job.train.steps // fed.every) if fed.every_s is None else None,
        "train.steps": job.train.steps if fed.every_s is not None else None,
        "weights": fed.mean_weights,
    }


def hub_spec(job) -> dict[str, Any]:
    """What every facility of a hub's federation shares: :func:`federation_spec` plus the hub's rules."""
    e, fed = job.federation.elastic, job.federation
    return {
        **federation_spec(job),
        "grace_s": float(e.grace_s),
        "max_norm_ratio": float(e.max_norm_ratio),
        "aggregate": e.aggregate,
        "trim": float(e.trim),
        "weights_rule": fed.weights,
        "paced": fed.paced,
        "min_facilities": e.min_facilities,
    }


def first_difference(mine: dict, theirs: dict) -> str | None:
    """The first way ``mine`` differs from the federation's ``theirs``, in words; None if they match."""
    a, b = mine["parameters"], theirs["parameters"]
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"parameter {i}: {x[0]} {x[1]} {x[2]} here, {y[0]} {y[1]} {y[2]} in the federation"
    if len(a) != len(b):
        return f"{len(a)} parameters here, {len(b)} in the federation"
    for key in mine:
        if key != "parameters" and mine[key] != theirs.get(key, ADDED.get(key)):
            if key == "rounds":
                return (
                    f"{mine[key]} rounds here (train.steps / federation.every), {theirs.get(key)} in the "
                    f"federation: set train.steps to {theirs.get(key)} x federation.every"
                )
            name = key if key == "train.steps" else f"federation.{'elastic.' * (key in ELASTIC_KEYS)}{key}"
            return f"{name}: {mine[key]!r} here, {theirs.get(key, ADDED.get(key))!r} in the federation"
    return None


def numel_of(spec: dict) -> int:
    """The number of parameters the description lists (fp32 only), checked."""
    params = spec.get("parameters")
    if not isinstance(params, list) or not params:
        raise SpecError("the federation's description lists no parameters")
    total = 0
    for p in params:
        if not (isinstance(p, list) and len(p) == 3 and isinstance(p[1], list) and p[2] == "float32"):
            raise SpecError(f"parameter {p!r}: the hub averages fp32 parameters only")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in p[1]):
            raise SpecError(f"parameter {p[0]!r} has an invalid shape")
        total += math.prod(p[1])
    if not 0 < total < 1 << 40:
        raise SpecError(f"{total} parameters is out of range")
    return total


def check_spec(spec: dict) -> None:
    """The hub's own keys of the description (round rules, compression, weights), checked before use."""
    for key in ("grace_s", "max_norm_ratio"):
        v = spec.get(key)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
            raise SpecError(f"federation.elastic.{key}={v!r} is invalid")
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
    if spec.get("aggregate", "mean") not in AGGREGATES:
        rule = spec.get("aggregate")
        raise SpecError(f"federation.elastic.aggregate={rule!r}: the hub takes {', '.join(AGGREGATES)}")
    trim = spec.get("trim", 0.0)
    if not (isinstance(trim, (int, float)) and not isinstance(trim, bool) and 0 <= trim < 0.5):
        raise SpecError(f"federation.elastic.trim={trim!r} is invalid: a fraction in [0, 0.5)")
    if spec.get("weights_rule") not in (None, "uniform", "tokens"):
        raise SpecError(f"weights {spec.get('weights_rule')!r}: the hub weighs uniform or tokens")


def codec_of(spec: dict):
    """The :class:`~.update_codec.UpdateCodec` of the description's compression (None: fp32 parameters)."""
    from .update_codec import UpdateCodec

    comp = spec["compression"]
    if comp["kind"] == "none":
        return None
    topk = (comp["density"], comp["bits"]) if comp["kind"] == "topk" else None
    return UpdateCodec(comp["kind"], numel_of(spec), comp["chunk_size"], topk)
