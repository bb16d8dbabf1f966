"""The end of a run: the copies' divergence, the per-facility loss table and ``summary.json``.

The worker loop (:mod:`.loop`) ends every job this way, whatever keeps its copies in step
(federated rounds or a data-parallel algorithm); the summaries carry the same keys
(docs/outputs.md), so that sweeps, ``bench.wan`` and W&B read either one alike.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from ..distributed.state import DistributedState, to_local
from ..federation.record import RoundRecord
from .parallelize import peak_rss_mb

__all__ = ["gather_facility_losses", "job_summary", "max_param_divergence"]

PIECE = 1 << 22  # elements per message: float copies of a whole 8B-model shard would double the job's memory
_INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _fingerprints(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Two 64-bit hashes of each piece's bits, ``[pieces, 2]``: sums of the bit patterns times
    fixed pseudo-random multipliers, wrapping mod 2^64 (integer sums: the same on every rank and
    device, whatever the order). Holders whose bits differ agree on both with probability ~2^-64."""
    if not pieces:
        return torch.zeros(0, 2, dtype=torch.int64)
    device = pieces[0].device
    gen = torch.Generator().manual_seed(0x5EED)
    w = torch.randint(-(1 << 62), 1 << 62, (max(p.numel() for p in pieces),), generator=gen, dtype=torch.int64) | 1
    w = w.to(device)
    out = []
    for piece in pieces:
        bits = piece.contiguous().view(_INT_OF_SIZE[piece.element_size()]).to(torch.int64)
        m = w[: bits.numel()]
        out.append(torch.stack([(bits * m).sum(), (bits * m * m).sum()]))
    return torch.stack(out).cpu()


@torch.no_grad()
def max_param_divergence(model: torch.nn.Module, state: DistributedState) -> float:
    """Largest |a - b| between any two ranks holding the same piece of any parameter (facilities
    and replicas alike). Collective: every rank calls it.

    First 16 bytes per piece of ``PIECE`` elements cross the link (two hashes of its bits, max and
    min over the holders): pieces whose holders agree bit for bit add nothing. Only pieces that
    differ are compared by value (max and min over the holders, in the parameter's own precision,
    widened to float32 where gloo has no kernel), so a run that ends with identical copies does not
    send the model across facilities again.
    """
    group = state.group("peers")  # every holder of this rank's shard
    pieces = [piece for param in model.parameters() for piece in to_local(param).detach().reshape(-1).split(PIECE)]
    prints = _fingerprints(pieces)  # on the CPU (gloo) wherever the parameters are
    hi, lo = prints.clone(), prints.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    differ = (hi != lo).any(dim=1).tolist()
    worst = torch.zeros((), dtype=torch.float64)
    for piece, different in zip(pieces, differ):
        if not different or not piece.numel():
            continue
        # A copy (copy=True: .to of the same dtype would return the parameter itself, reduced in place).
        high = piece.to(piece.dtype if piece.dtype in (torch.float32, torch.float64) else torch.float32, copy=True)
        low = high.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        worst = torch.maximum(worst, (high.double() - low.double()).max().cpu())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def gather_facility_losses(losses: torch.Tensor, state: DistributedState) -> torch.Tensor:
    """Every rank's ``[facilities, steps]`` table, in place, from rows each rank filled for its
    own facility only: the other rows are zeroed and the sum over ranks / facility size restores
    each row (a collective: every rank calls it)."""
    for f in range(state.num_facilities):
        if f != state.facility:
            losses[f].zero_()
    losses /= state.facility_size
    dist.all_reduce(losses)
    return losses


def _losses_and_tokens(state, losses, steps, trained_steps, tokens_per_step, facility_steps):
    """The summary's first and final loss and the job's tokens (see :func:`job_summary`). A step not taken
    has no loss (NaN in ``losses``): an elastic facility that joined late has none before the federation's
    step it joined at, a facility that stopped early none after its last step."""
    first_loss = final_loss = None
    taken = losses[:, :steps].isfinite()
    if facility_steps is None and taken.any():  # the facilities step together: the mean of theirs
        per_step = losses[:, :steps].mean(dim=0)
        at = per_step.isfinite().nonzero().flatten().tolist() or [0]
        first_loss, final_loss = float(per_step[at[0]]), float(per_step[at[-1]])
    elif facility_steps is not None and taken.any():  # different paces: each at its own first and last step
        rows = [(row[ok.nonzero()[0]], row[ok.nonzero()[-1]]) for row, ok in zip(losses, taken) if ok.any()]
        first_loss = sum(float(first) for first, _ in rows) / len(rows)
        final_loss = sum(float(last) for _, last in rows) / len(rows)
    tokens = tokens_per_step * trained_steps if isinstance(trained_steps, int) else 0
    if facility_steps is not None:
        sizes = state.layout.facility_sizes
        tokens = sum(tokens_per_step * size // state.world_size * n for size, n in zip(sizes, trained_steps))
    return first_loss, final_loss, tokens


def _facility_losses(losses: torch.Tensor, steps: int) -> list[list[float | None]]:
    """``[facility][step]`` up to the job's last step; ``None`` where a facility took no step (no figure
    is made up: not the steps before an elastic facility joined, nor those after a slower one's last)."""
    return [[None if math.isnan(v) else v for v in row] for row in losses[:, :steps].tolist()]


def _layout(layout) -> dict:
    return {
        "facility_sizes": list(layout.facility_sizes),
        "shard_size": layout.shard_size,
        "replicas_per_facility": list(layout.replicas),
    }


def _round_record(r: RoundRecord) -> dict:
    """A round's entry in the summary's ``round_records``."""
    return {
        "step": r.step,
        "phase": r.get("phase", 0),
        "fragment": r.fragment,
        "switch": bool(r.get("switch", False)),
        "started_step": r.get("started_step", r.step),
        "steps_taken": r.get("steps_taken"),
        "waited_s": r.get("waited_s"),
        **({"landed": r.landed} if r.has("landed") else {}),  # federation.delay=1: the rounds whose step landed
    }


def _round_tables(rounds: list[RoundRecord], losses: torch.Tensor, steps: int) -> dict:
    """The summary's per-round lists and per-facility loss table, in the summary's key order."""
    return {
        "aggregation_seconds": [r.seconds for r in rounds],
        "aggregation_bytes_per_rank": [r.bytes_per_rank for r in rounds],
        "cross_facility_bytes_per_round": [r.cross_facility_bytes for r in rounds],
        "facility_losses": _facility_losses(losses, steps),
        "skipped_facilities": [r.skipped_facilities for r in rounds],
        "round_records": [_round_record(r) for r in rounds],
    }


def _timings(tokens, train_seconds, train_started_at, phases, setup_rss, started_at) -> dict:
    """The summary's throughput, clocks and memory (its last keys: ``wall_seconds`` read now)."""
    return {
        "tokens_per_second": tokens / train_seconds if tokens else 0.0,
        "train_seconds": train_seconds,
        "train_started_at": train_started_at,
        "phases": phases,
        "setup_peak_rss_mb": float(setup_rss),
        "peak_rss_mb": peak_rss_mb(),  # rank 0's (an elastic facility's leader), over the whole job
        "wall_seconds": time.time() - started_at,
    }


def job_summary(
    experiment: str,
    state: DistributedState,
    *,
    losses: torch.Tensor,
    steps: int,
    trained_steps: int,
    tokens_per_step: int,
    train_seconds: float,
    train_started_at: float,
    started_at: float,
    eval_loss: float,
    evals: list[dict],
    divergence: float,
    phases: dict,
    setup_rss: torch.Tensor,
    rounds: list[RoundRecord] | None = None,
    strategy: dict | None = None,
    federation: dict | None = None,
    checkpoints=None,
    extra: dict | None = None,
    facility_steps: list[int] | None = None,
    forward_param_dtype: str | None = None,
) -> dict:
    """The summary (rank 0) of job ``experiment``: ``losses`` from :func:`gather_facility_losses` (NaN: a step not
    taken), ``steps`` the last step the job reached (``train.steps`` unless it ended early: a federation that
    ended, ``federation.every_s``), ``trained_steps`` the steps this process ran (fewer than ``steps`` after a
    resume), ``rounds`` the round records (none without federated rounds), ``extra`` keys of one loop only (e.g.
    ``parallel``). Facilities of different paces: ``facility_steps`` each facility's steps so far (``steps``: the
    most), ``trained_steps`` a list of each one's steps in this job. ``forward_param_dtype``: the dtype the
    first block's parameters have inside a forward (:func:`~.parallelize.forward_param_dtype`)."""
    rounds = rounds or []
    first_loss, final_loss, tokens = _losses_and_tokens(
        state, losses, steps, trained_steps, tokens_per_step, facility_steps
    )
    return {
        "experiment": experiment,
        "world_size": state.world_size,
        "layout": _layout(state.layout),
        "device": str(state.device),  # this rank's (rank 0's): cpu, or cuda:<n> (distributed.backend's choice)
        "group_backends": state.group_backends(),  # each process group's backend, by name (GROUP_NAMES)
        "forward_param_dtype": forward_param_dtype,  # the first block's parameters inside a forward (train.dtype)
        "strategy": strategy,
        "federation": federation,
        **(extra or {}),
        "steps": steps,
        "rounds": len(rounds),
        "first_loss": first_loss,
        "final_loss": final_loss,
        "facility_steps": facility_steps,
        "eval_loss": eval_loss,
        "eval_history": evals,
        "max_param_divergence_after_last_round": divergence,
        **_round_tables(rounds, losses, steps),
        "checkpoints": checkpoints,
        **_timings(tokens, train_seconds, train_started_at, phases, setup_rss, started_at),
    }
