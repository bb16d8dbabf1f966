"""The checks of a member's contribution: its claims on arrival, then each upload when the round closes.

What a member may claim is the federation's: on joining, its geometry and steps must be within its operator's
grant (``grants.json`` beside the hub's certificates, when it has one) and its steps must make the
federation's rounds (or, with ``every_s``, be the federation's last step) (:func:`granted`).

With a fixed ``every`` a round belongs to one federation step: round ``k = progress + 1`` (``progress``: the
federation's rounds behind θ_global) takes a member's contribution only at its step ``min(k x every, steps)``
(:func:`misaligned`); a member at another step heals and realigns its step counter to the federation's.
Claims (steps taken, tokens) are checked on arrival against the facility's geometry (:func:`claims`). When
the round closes, each uploaded contribution must be finite and its update norm ``|θ_global - θ_f|`` at most
``max_norm_ratio`` times a reference no member sets alone (:func:`reference`: the other members' norms this
round, the federation's recent accepted ones, a floor) and ``max_norm_ratio x max(|θ_global|, 1)`` (:func:`judge`).
The accepted ones are weighed uniformly or by their tokens (:func:`weights`), a weight capped at
:data:`MAX_WEIGHT_RATIO` times the smallest of the others': no claim makes one member's upload the mean.
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import torch
from torch import Tensor

from ..protocol.messages import JoinRequest
from .errors import HubError
from .membership import Member
from .rounds import Arrival, Part, Round

__all__ = [
    "FLOOR",
    "MAX_WEIGHT_RATIO",
    "SLICE",
    "claims",
    "federation_step",
    "granted",
    "judge",
    "misaligned",
    "reference",
    "squares",
    "weights",
]

SLICE = 1 << 20  # values checked or accumulated at a time: transient buffers of a few MB per upload
#: The least reference norm, as a fraction of ``max(|θ_global|, 1)``: a history of zero updates cannot switch
#: the norm check off (an update is then at most ``max_norm_ratio x FLOOR`` of θ_global's norm).
FLOOR = 1e-3
#: A tokens weight is at most this many times the smallest other accepted weight of its round.
MAX_WEIGHT_RATIO = 8.0


def granted(name: str, msg: JoinRequest, spec: dict, grant: dict[str, int] | None) -> None:
    """A joining facility's geometry and steps: within its grant (``grant``: the operator's, or None) and the
    federation's rounds; :class:`.errors.HubError` (one line, with the fix) otherwise."""
    declared = {**msg.geometry.to_json(), "steps": msg.steps}
    for key, most in (grant or {}).items():
        if declared[key] > most:
            raise HubError(
                f"facility {name} declares {key}={declared[key]}, over its grant of {most} (grants.json beside the "
                f"hub's certificates): run it within its grant, or ask the hub's operator for more (python -m "
                f"xffl_like.hub add DIR {name} --{key.replace('_', '-')} N)",
                "PERMISSION_DENIED",
            )
    rounds, last, every = spec.get("rounds"), spec.get("train.steps"), msg.every
    if spec.get("every_s") is None and type(rounds) is int and every is not None and -(-msg.steps // every) != rounds:
        raise HubError(f"facility {name}: train.steps={msg.steps} with federation.every={every} makes "
                       f"{-(-msg.steps // every)} rounds, the federation {rounds}: set train.steps to {rounds} x "
                       f"federation.every", "FAILED_PRECONDITION")  # fmt: skip
    if spec.get("every_s") is not None and type(last) is int and msg.steps != last:
        raise HubError(f"facility {name}: train.steps={msg.steps}, the federation's is {last}: set it to {last}",
                       "FAILED_PRECONDITION")  # fmt: skip


def federation_step(m: Member, progress: int) -> int:
    """Member ``m``'s step after the federation's ``progress`` rounds: ``min(progress x every, steps)`` (a joiner's,
    and a realigned member's)."""
    return min(progress * m.every, m.steps)


def misaligned(m: Member, step: int, progress: int, spec: dict) -> str | None:
    """Why member ``m`` at ``step`` with the hub's version is not at the federation's next round (None: it is).
    With ``every_s`` steps differ legitimately (tokens weigh them): never."""
    if spec.get("every_s") is not None or not m.every:
        return None
    expected = federation_step(m, progress + 1)
    if step == expected:
        return None
    return f"step {step} is not the federation's step {expected} (round {progress + 1}): realigned"


def claims(m: Member, a: Arrival) -> str | None:
    """Why the member's claims cannot hold (None: they can)."""
    g = m.geometry
    if a.taken < 1 or a.step < a.taken:
        return f"claims {a.taken} steps taken at step {a.step}"
    if m.last_step is not None and a.step - m.last_step < a.taken:  # more when it missed rounds
        return f"claims {a.taken} steps since its last round at step {m.last_step}, now at step {a.step}"
    if a.step > m.steps:
        return f"claims step {a.step} of a job of {m.steps} steps"
    bound = a.taken * g.batch_size * g.seq_len * g.dp
    if not (math.isfinite(a.tokens) and 0 < a.tokens <= bound):
        return f"claims {a.tokens:g} tokens; its geometry allows at most {bound}"
    return None


def squares(values: np.ndarray, theta: Tensor | None, first: int) -> float:
    """The sum of squares of ``theta[first:] - values`` (of ``values`` when ``theta`` is None), in fp64, a
    slice at a time; inf or nan when a value is not finite."""
    total = 0.0
    for start in range(0, values.size, SLICE):
        x = torch.from_numpy(values[start : start + SLICE]) if values.flags.writeable else None
        if x is None:  # a received frame is read-only: copy one slice
            x = torch.from_numpy(values[start : start + SLICE].copy())
        if theta is not None:
            x = torch.sub(theta[first + start : first + start + x.numel()], x, out=x)
        total += float(torch.linalg.vector_norm(x, dtype=torch.float64) ** 2)
        if not math.isfinite(total):
            return total
    return total


def reference(name: str, up: dict[str, Arrival], members: dict[str, Member], theta_norm: float) -> float:
    """The norm ``name``'s update is measured against: the greatest of the lower median of the other members'
    norms this round, the lower median of the federation's recent accepted norms (every member's, kept by
    :class:`.membership.Member`), and the floor ``FLOOR x max(|θ_global|, 1)``. The member's own upload is never
    in it, a lower median is not moved by one member of two, and zeros cannot switch it off."""
    others = [a.norm for n, a in up.items() if n != name and math.isfinite(a.norm)]
    history = [x for m in members.values() for x in m.norms if math.isfinite(x)]
    floor = FLOOR * max(theta_norm, 1.0)
    return max([floor] + [statistics.median_low(xs) for xs in (others, history) if xs])


def judge(r: Round, members: dict[str, Member], ratio: float, theta_norm: float) -> dict[str, str]:
    """Per contribution of the round, why it is rejected (absent: accepted; a heal is not judged). With
    ``ratio`` > 0 an update norm must be at most ``ratio`` times :func:`reference` (when the round has other
    uploads or the federation a history) and at most ``ratio x max(|θ_global|, 1)`` (always: a lone first
    upload too)."""
    out = {n: a.reason for n, a in r.arrivals.items() if a.reason is not None and not a.heal}
    out.update({n: "no upload" for n, a in r.arrivals.items() if not a.heal and a.part is not Part.UPLOADED
                and n not in out})  # fmt: skip
    up = {n: a for n, a in r.arrivals.items() if a.part is Part.UPLOADED and n not in out}
    for n, a in up.items():
        if not math.isfinite(a.norm):
            out[n] = "not finite"
    up = {n: a for n, a in up.items() if n not in out}
    history = any(m.norms for m in members.values())
    bound = ratio * max(theta_norm, 1.0)
    for n, a in up.items():
        if ratio <= 0:
            break
        if a.norm > bound:
            out[n] = f"update norm {a.norm:.3g} is over {ratio:g}x max(|θ_global|, 1) = {bound:.3g}"
            continue
        if len(up) < 2 and not history:
            continue  # nothing to compare with: the bound above only
        ref = reference(n, up, members, theta_norm)
        if a.norm > ratio * ref:
            out[n] = f"update norm {a.norm:.3g} is over {ratio:g}x the reference {ref:.3g}"
    return out


def weights(spec: dict, accepted: dict[str, Arrival]) -> dict[str, float]:
    """Each accepted contribution's weight (not normalised): uniform or its tokens, as the description says."""
    rule = spec.get("weights_rule")
    if rule is None:
        paced = bool(spec.get("paced"))
        rule = "tokens" if paced or len({a.taken for a in accepted.values()}) > 1 else "uniform"
    if rule != "tokens":
        return dict.fromkeys(accepted, 1.0)
    claimed = {n: a.tokens for n, a in accepted.items()}
    if len(claimed) < 2:
        return claimed
    return {n: min(w, MAX_WEIGHT_RATIO * min(v for o, v in claimed.items() if o != n)) for n, w in claimed.items()}
