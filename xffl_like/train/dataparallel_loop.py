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
from ..schema import JobConfig, as_plain
from .dataparallel import DataParallel
from .evaluate import evaluate, facility_eval
from .fault import FaultInjector
from .parallelize import peak_rss_mb
from .round_dump import RoundDump
from .step import accumulate_gradients
from .summary import gather_facility_losses, job_summary, max_param_divergence

__all__ = ["train_data_parallel"]


def train_data_parallel(cfg: JobConfig, state: DistributedState, run_dir: Path, started_at: float) -> dict | None:
    """Train with ``cfg.parallel`` on this rank's full copy; rank 0 returns the summary."""
    tcfg, ocfg = cfg.train, cfg.optim
    steps, device, accum = tcfg.steps, state.device, tcfg.grad_accum
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, device=device, seed=cfg.seed)  # the same start on every rank
    if cfg.model.path:
        from ..checkpoint.hf import load_hf_weights

        load_hf_weights(model, cfg.model.path)
    dp = DataParallel(cfg, state, model, ocfg, steps)  # the whole JobConfig: train/dataparallel.py's signature
    setup_rss = torch.tensor(peak_rss_mb(), dtype=torch.float64)
    dist.all_reduce(setup_rss, op=dist.ReduceOp.MAX)
    data = build_data(
        cfg.data, vocab_size=cfg.model.vocab_size, seq_len=tcfg.seq_len, batch_size=tcfg.batch_size,
        seed=cfg.seed, facility=state.facility, num_facilities=state.num_facilities,
        facility_rank=state.facility_rank, facility_size=state.facility_size,
    )
    dump = RoundDump(model, state)  # tests only ($XFFL_TEST_DUMP_ROUNDS): the copies around switches and the end
    tokens_per_step = tcfg.batch_size * tcfg.seq_len * accum * state.world_size
    eval_batches = data.eval_batches()
    losses = torch.zeros(state.num_facilities, steps, dtype=torch.float64)
    evals: list[dict] = []
    consensus: list[dict] = []
    observer = Observer(tcfg, cfg.strategy, cfg.logger, state, run_dir, experiment=cfg.experiment,
                        config=as_plain(cfg))
    fault = FaultInjector(cfg.fault, state.rank)
    timer = PhaseTimer(device)

    dist.barrier()
    start, train_started_at = time.perf_counter(), time.time()
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
    gather_facility_losses(losses, state)
    phases = gather_phase_table(timer, state, steps)
    if cfg.export.hf:
        from ..checkpoint.hf import export_job

        export_job(model, state, run_dir, cfg.export, cfg.data, base_model=cfg.model.path)
    if state.rank != 0:
        observer.finish(None)
        return None
    summary = job_summary(
        cfg.experiment, state, losses=losses, steps=steps, trained_steps=steps, tokens_per_step=tokens_per_step,
        train_seconds=train_seconds, train_started_at=train_started_at, started_at=started_at, eval_loss=eval_loss,
        evals=evals, divergence=divergence, phases=phases, setup_rss=setup_rss,
        extra={"parallel": dp.describe(), "consensus_distance": consensus,
               "final_consensus_distance": consensus[-1]["distance"] if consensus else 0.0})
    observer.finish(summary)
    return summary
