"""The worker loop of ``parallel=decentralized|bagua``: full copies, no rounds.

The outputs are those of :mod:`.loop` (``summary.json`` with the same keys, ``metrics.jsonl``,
``aggregation.csv`` without rows, plots, W&B), plus the consensus distance (mean distance of
the copies to their average) at every log step: ``consensus_distance`` in ``metrics.jsonl``,
``train/consensus_distance`` on W&B, the history and the last value in ``summary.json``.
After the last step every copy becomes the exact mean of all copies; the final evaluation
and the export see that one model. No checkpoints (see ``validate_parallel``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..data import build_data
from ..distributed.state import DistributedState, all_peer_groups
from ..models import build_model
from ..observe import Observer
from ..observe.timing import PhaseTimer, gather_phase_table
from .dataparallel import DataParallel
from .evaluate import evaluate, facility_eval
from .fault import FaultInjector
from .optim import OptimConfig
from .parallelize import peak_rss_mb
from .round_dump import RoundDump
from .step import TrainConfig, accumulate_gradients

__all__ = ["train_data_parallel"]


def train_data_parallel(cfg: dict, state: DistributedState, run_dir: Path, started_at: float) -> dict | None:
    """Train with ``cfg["parallel"]`` on this rank's full copy; rank 0 returns the summary."""
    from .loop import max_param_divergence

    tcfg, ocfg = TrainConfig.from_mapping(cfg["train"]), OptimConfig.from_mapping(cfg["optim"])
    steps, device, accum = tcfg.steps, state.device, tcfg.grad_accum
    torch.manual_seed(cfg["seed"])
    model = build_model(cfg["model"], device=device, seed=cfg["seed"])  # the same start on every rank
    if cfg["model"].get("path"):
        from ..checkpoint.hf import load_hf_weights

        load_hf_weights(model, cfg["model"]["path"])
    dp = DataParallel(cfg, state, model, ocfg, steps)
    setup_rss = torch.tensor(peak_rss_mb(), dtype=torch.float64)
    dist.all_reduce(setup_rss, op=dist.ReduceOp.MAX)
    data = build_data(
        cfg["data"], vocab_size=cfg["model"]["vocab_size"], seq_len=tcfg.seq_len, batch_size=tcfg.batch_size,
        seed=cfg["seed"], facility=state.facility, num_facilities=state.num_facilities,
        facility_rank=state.facility_rank, facility_size=state.facility_size,
    )
    dump = RoundDump(model, state)  # tests only ($XFFL_TEST_DUMP_ROUNDS): the copies around switches and the end
    tokens_per_step = tcfg.batch_size * tcfg.seq_len * accum * state.world_size
    eval_batches = data.eval_batches()
    losses = torch.zeros(state.num_facilities, steps, dtype=torch.float64)
    evals: list[dict] = []
    consensus: list[dict] = []
    observer = Observer(cfg, state, run_dir)
    fault = FaultInjector(cfg, state.rank)
    timer = PhaseTimer(device)

    dist.barrier()
    start = time.perf_counter()
    try:
        for step in range(steps):
            done = step + 1
            fault.before_step(done)
            loss = accumulate_gradients(dp.wrapped, lambda i, step=step: data.train_batch(step * accum + i), tcfg,
                                        device, timer)
            with timer("optimizer"):
                dp.step()
            fault.after_step(done, model)
            facility_loss = loss / state.facility_size
            dist.all_reduce(facility_loss, group=state.facility_groups[0])
            losses[state.facility, step] = float(facility_loss)
            record_eval = None
            if done == steps or (tcfg.eval_every > 0 and done % tcfg.eval_every == 0):
                record_eval = {"step": done, "loss_local": facility_eval(model, eval_batches, state, tcfg.loss_chunk),
                               "loss_global": None}
                evals.append(record_eval)
            distance = None
            if done % tcfg.log_every == 0 or done == steps:
                distance = dp.consensus_distance()
                consensus.append({"step": done, "distance": distance})
            observer.step(step, float(facility_loss), dp.lr(), tokens_per_step, time.perf_counter() - start,
                          record_eval, consensus=distance)
            switch = dp.switch_due(done)
            if switch is not None:
                dump.save(len(dp.switches), "before")
                dp.switch(switch)
                dump.save(len(dp.switches) - 1, "after")
    except BaseException:
        observer.abort()
        raise
    train_seconds = time.perf_counter() - start
    dump.save(len(dp.switches), "before")  # the copies as trained, before the final mean
    dp.finish()
    eval_loss = evaluate(model, eval_batches, device, tcfg.loss_chunk)
    divergence = max_param_divergence(model, state, all_peer_groups(state))
    for f in range(state.num_facilities):  # as in loop.py: each facility's row, restored by the sum
        if f != state.facility:
            losses[f].zero_()
    losses /= state.facility_size
    dist.all_reduce(losses)
    phases = gather_phase_table(timer, state, steps)
    if cfg.get("export", {}).get("hf"):
        from ..checkpoint.hf import export_job

        export_job(model, state, cfg, run_dir)
    if state.rank != 0:
        observer.finish(None)
        return None
    per_step = losses.mean(dim=0)
    summary = {  # the keys of loop.py's summary (docs/outputs.md), plus parallel and consensus_distance
        "experiment": cfg["experiment"],
        "world_size": state.world_size,
        "layout": {
            "facility_sizes": list(state.layout.facility_sizes),
            "shard_size": state.layout.shard_size,
            "replicas_per_facility": list(state.layout.replicas),
        },
        "strategy": None,
        "federation": None,
        "parallel": dp.describe(),
        "steps": steps,
        "rounds": 0,
        "first_loss": float(per_step[0]) if steps else None,
        "final_loss": float(per_step[-1]) if steps else None,
        "eval_loss": eval_loss,
        "eval_history": evals,
        "max_param_divergence_after_last_round": divergence,
        "consensus_distance": consensus,
        "final_consensus_distance": consensus[-1]["distance"] if consensus else 0.0,
        "aggregation_seconds": [],
        "aggregation_bytes_per_rank": [],
        "cross_facility_bytes_per_round": [],
        "facility_losses": losses.tolist(),
        "skipped_facilities": [],
        "checkpoints": None,
        "tokens_per_second": tokens_per_step * steps / train_seconds if steps else 0.0,
        "train_seconds": train_seconds,
        "phases": phases,
        "setup_peak_rss_mb": float(setup_rss),
        "wall_seconds": time.time() - started_at,
    }
    observer.finish(summary)
    return summary
