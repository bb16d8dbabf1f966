"""What each ``bench.wan`` config costs to reach the target (pure functions over its results).

Per config, at the first evaluation whose loss reaches the target (the reference's final eval loss):

- ``steps_to_target``, and ``steps_to_target_ratio`` against the reference's (synchronous's) own;
- ``bytes_to_target``: the bytes that crossed the links from the start of training to that evaluation (the
  interfaces' counters), and ``bytes_to_target_fraction`` of the reference's;
- ``overhead``: the time to the target over the compute time of the slowest facility over the same steps,
  ``steps_to_target x`` its seconds per step outside the link, read from its phase table (every phase but
  ``aggregation`` and ``wait``: data, forward, backward, optimizer, eval, checkpoint; the facility's slowest
  rank). 1.0: the link is fully hidden behind compute. ``overhead_run``: the same over the whole run (to its
  last evaluation), measured whether or not the config reaches the target.

The goals of issue 29 (:data:`GOALS`) apply to ``bench.goal_configs``: :func:`goal_verdicts` says met or not
per config and figure.
"""

from __future__ import annotations

__all__ = ["GOALS", "LINK_GOAL", "compute_per_step", "goal_verdicts", "link_ratio", "target_figures"]

#: Issue 29's goals at 10 Mbit/s: figure -> the most it may be.
GOALS = {"bytes_to_target_fraction": 1 / 1000, "overhead": 1.05, "steps_to_target_ratio": 1.15}
#: ``bench.mode=link``: a top-k round's bytes over an fp32 round's, at most.
LINK_GOAL = 1 / 60
_LINK_PHASES = ("aggregation", "wait")


def compute_per_step(summary: dict) -> list[float]:
    """Per facility, the seconds per step outside the link of its slowest rank (``summary["phases"]``)."""
    per_rank = summary["phases"]["per_rank_seconds_per_step"]
    out, rank = [], 0
    for size in summary["layout"]["facility_sizes"]:
        ranks = [per_rank[str(r)] for r in range(rank, rank + size) if str(r) in per_rank]
        out.append(max(sum(v for k, v in phases.items() if k not in _LINK_PHASES) for phases in ranks))
        rank += size
    return out


def _reached(curve: list[dict], target: float) -> dict | None:
    return next((p for p in curve if p["loss"] <= target), None)


def target_figures(results: dict, reference: str, target: float | None) -> None:
    """Add the module's figures to every config of ``results`` (in place; ``None`` where a config or the
    reference never reached the target)."""
    ref = results.get(reference)
    ref_point = _reached(ref["eval_curve"], target) if ref and target is not None else None
    for r in results.values():
        point = _reached(r["eval_curve"], target) if target is not None else None
        figures = dict.fromkeys(
            ("steps_to_target", "steps_to_target_ratio", "bytes_to_target", "bytes_to_target_fraction", "overhead")
        )
        if point is not None:
            compute = max(r.get("compute_seconds_per_step") or [0.0]) * point["step"]
            figures.update(
                steps_to_target=point["step"],
                bytes_to_target=point.get("cross_bytes"),
                overhead=point["seconds"] / compute if compute > 0 else None,
            )
            if ref_point is not None:
                figures["steps_to_target_ratio"] = point["step"] / ref_point["step"]
                if point.get("cross_bytes") is not None and ref_point.get("cross_bytes"):
                    figures["bytes_to_target_fraction"] = point["cross_bytes"] / ref_point["cross_bytes"]
        last = r["eval_curve"][-1] if r["eval_curve"] else None
        compute_run = max(r.get("compute_seconds_per_step") or [0.0]) * (last["step"] if last else 0)
        figures["overhead_run"] = last["seconds"] / compute_run if compute_run > 0 else None
        r.update(figures)


def goal_verdicts(results: dict, configs: list[str]) -> dict:
    """``{config: {figure: {"value", "goal", "met"}}}`` for the ``configs`` of ``results`` (``met`` None when
    the figure is missing: the config failed or never reached the target)."""
    out = {}
    for name in configs:
        r = results.get(name) or {}
        out[name] = {
            key: {"value": r.get(key), "goal": most, "met": None if r.get(key) is None else r[key] <= most}
            for key, most in GOALS.items()
        }
    return out


def link_ratio(results: dict) -> dict:
    """``bench.mode=link``: the top-k round's bytes (counters) over the fp32 round's, against :data:`LINK_GOAL`."""
    fp32, topk = results.get("link"), results.get("link_topk")
    if not fp32 or not topk or not fp32["cross_bytes"]:
        return {"ratio": None, "goal": LINK_GOAL, "met": None}
    ratio = topk["cross_bytes"] / fp32["cross_bytes"]
    return {"ratio": ratio, "goal": LINK_GOAL, "met": ratio <= LINK_GOAL}
