"""The worker: local steps inside the facility, a cross-facility aggregation every round.

``train_worker(cfg, run_dir)`` runs in every process. ``cfg`` is the typed
:class:`~xffl_like.schema.JobConfig` the launcher validated (workers never start Hydra);
``run_dir`` is the job's one run directory.
Rank 0 returns the summary (and writes ``summary.json``); other ranks return ``None``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..aggregation import build_strategy
from ..checkpoint import Checkpointer
from ..data import build_data
from ..distributed.layout import plan_layout
from ..distributed.state import DistributedState, all_peer_groups, build_state, read_env
from ..federation import FederationSchedule
from ..observe import Observer
from ..observe.timing import PhaseTimer, gather_phase_table
from ..schema import JobConfig, as_plain
from .evaluate import eval_points, evaluate, facility_eval
from .optim import build_optimizer, build_scheduler
from .fault import FaultInjector
from .nonfinite import NonFiniteGuard
from .parallelize import build_sharded_model, contiguous_shards, peak_rss_mb
from .round_dump import RoundDump
from .step import accumulate_gradients
from .summary import gather_facility_losses, job_summary, max_param_divergence

__all__ = ["train_worker"]


def train_worker(cfg: JobConfig, run_dir: str, started_at: float | None = None) -> dict | None:
    env = read_env()
    dcfg = cfg.distributed
    layout = plan_layout(env.world_size, dcfg.federated, dcfg.hsdp, env.local_world_size)
    state = build_state(
        layout, env, backend=dcfg.backend, num_streams=cfg.strategy.streams, timeout_s=dcfg.timeout_s
    )
    try:
        if cfg.parallel.name != "fsdp":  # full copies: Decent-DP or Bagua
            from .dataparallel_loop import train_data_parallel

            return train_data_parallel(cfg, state, Path(run_dir), started_at or time.time())
        return _train(cfg, state, Path(run_dir), started_at or time.time())
    finally:
        dist.destroy_process_group()


def _train(cfg: JobConfig, state: DistributedState, run_dir: Path, started_at: float) -> dict | None:
    tcfg, ocfg = cfg.train, cfg.optim
    steps, device, accum = tcfg.steps, state.device, tcfg.grad_accum
    torch.manual_seed(cfg.seed)
    model = build_sharded_model(cfg.model, state, tcfg.dtype, seed=cfg.seed)  # same start on every rank
    setup_rss = torch.tensor(peak_rss_mb(), dtype=torch.float64)
    dist.all_reduce(setup_rss, op=dist.ReduceOp.MAX)
    contiguous_shards(model, state.shard_size)  # aggregation buckets become views: no copies
    optimizer = build_optimizer(model, ocfg)
    scheduler = build_scheduler(optimizer, ocfg, steps)
    data = build_data(
        cfg.data, vocab_size=cfg.model.vocab_size, seq_len=tcfg.seq_len, batch_size=tcfg.batch_size,
        seed=cfg.seed, facility=state.facility, num_facilities=state.num_facilities,
        facility_rank=state.facility_rank, facility_size=state.facility_size,
    )
    strategy = build_strategy(model, state, cfg.strategy)
    federation = FederationSchedule(cfg.federation, model, strategy, state, steps)  # its phases' federations
    peer_groups = all_peer_groups(state)
    dump = RoundDump(model, state)  # tests only ($XFFL_TEST_DUMP_ROUNDS): the values around each round
    tokens_per_step = tcfg.batch_size * tcfg.seq_len * accum * state.world_size
    eval_batches = data.eval_batches()
    # Row f holds facility f's mean loss per step (filled by this rank's facility share).
    losses = torch.zeros(state.num_facilities, steps, dtype=torch.float64)
    resolved = as_plain(cfg)  # recorded whole in each checkpoint's state.json and as W&B's run config
    ckpt = Checkpointer(cfg.checkpoint, state, run_dir, model, optimizer, scheduler, federation,
                        resume=cfg.resume, config=resolved)
    restored = ckpt.restore(losses)  # None: a fresh start
    start_step = restored["step"] if restored else 0
    rounds: list[dict] = list(restored["rounds"]) if restored else []
    # {"step", "loss_local", "loss_global", "time"}: losses per facility, None when not evaluated
    evals: list[dict] = list(restored.get("records", {}).get("evals", [])) if restored else []
    observer = Observer(tcfg, cfg.strategy, cfg.logger, state, run_dir, restored, rounds_at=federation.applies_at,
                        experiment=cfg.experiment, config=resolved)
    fault = FaultInjector(cfg.fault, state.rank)
    guard = NonFiniteGuard(cfg.federation.on_nonfinite, state, model, optimizer, ckpt.dir)
    timer = PhaseTimer(device)

    def adjust(done):  # the non-finite guard sets the weights of a round ending or starting after `done` steps
        return lambda weights, index: guard.weights_for_round(weights, index, done)

    dist.barrier()
    start, train_started_at = time.perf_counter(), time.time()
    try:
        if start_step == 0:
            dump.save(0, "init")  # tests: the common start, theta_global of every fragment
        # An exchange overlapping the first steps starts now (after a resume: as the saved run did).
        federation.start_due(start_step, adjust(start_step), dump, len(rounds))
        for step in range(start_step, steps):
            fault.before_step(step + 1)
            # Micro-batch i of step s is batch s * grad_accum + i of the source: with grad_accum=1, as before.
            def micro_batch(i, step=step):
                batch = data.train_batch(step * accum + i)
                federation.trained(batch[1].numel())  # tokens actually trained (federation.weights=tokens)
                return batch

            loss = accumulate_gradients(model, micro_batch, tcfg, device, timer)
            with timer("optimizer"):
                federation.after_backward()  # synchronous: gradients averaged across facilities
                if ocfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), ocfg.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            fault.after_step(step + 1, model)
            facility_loss = loss / state.facility_size
            dist.all_reduce(facility_loss, group=state.facility_groups[0])
            losses[state.facility, step] = float(facility_loss)
            done = step + 1
            # Rounds (synchronous: every `every` steps) evaluate the local model before and may checkpoint after.
            boundary = federation.boundary_at(done)
            local_eval = eval_points(done, boundary, tcfg.eval_every)
            record_eval = {"step": done, "loss_local": None, "loss_global": None}
            if local_eval:
                record_eval["loss_local"] = facility_eval(model, eval_batches, state, tcfg.loss_chunk)
            if federation.applies_at(done):  # synchronous runs have no rounds (but a phase switch)
                with timer("aggregation"):
                    # Ranks arrive at different times; the wait is charged to this phase
                    # (and shows as imbalance), the round's seconds time the exchange alone.
                    dist.barrier()
                    records = federation.finish_due(done, adjust(done), dump, len(rounds))
                for record in records:
                    rounds.append(record)
                    observer.round(record)
                record_eval["loss_global"] = facility_eval(model, eval_batches, state, tcfg.loss_chunk)
            if local_eval:
                record_eval["time"] = time.time()  # when it was known: wall-clock time-to-loss (bench.wan)
                evals.append(record_eval)
            observer.step(step, float(facility_loss), optimizer.param_groups[0]["lr"], tokens_per_step,
                          time.perf_counter() - start, record_eval if local_eval else None)
            if boundary:  # nothing is in flight here: a step's exchanges start after its checkpoint
                ckpt.after_round(done, rounds, losses, final=done == steps, records={"evals": evals})
            if federation.starts_at(done):
                with timer("aggregation"):
                    federation.start_due(done, adjust(done), dump, len(rounds))
    except BaseException:
        observer.abort()
        raise
    train_seconds = time.perf_counter() - start
    checkpoints = ckpt.close()

    eval_loss = evaluate(model, eval_batches, device, tcfg.loss_chunk)
    divergence = max_param_divergence(model, state, peer_groups)
    gather_facility_losses(losses, state)
    phases = gather_phase_table(timer, state, steps - start_step)
    if cfg.export.hf:
        from ..checkpoint.hf import export_job

        export_job(model, state, run_dir, cfg.export, cfg.data, base_model=cfg.model.path)
    # The slowest rank's aggregation time is the round's time.
    agg = torch.tensor([r["seconds"] for r in rounds], dtype=torch.float64)
    dist.all_reduce(agg, op=dist.ReduceOp.MAX)
    for record, seconds in zip(rounds, agg.tolist()):
        record["seconds"] = seconds

    if state.rank != 0:
        observer.finish(None)
        return None
    summary = job_summary(
        cfg.experiment, state, losses=losses, steps=steps, trained_steps=steps - start_step, tokens_per_step=tokens_per_step,
        train_seconds=train_seconds, train_started_at=train_started_at, started_at=started_at, eval_loss=eval_loss,
        evals=evals, divergence=divergence, phases=phases, setup_rss=setup_rss, rounds=rounds,
        strategy={"name": cfg.strategy.name, "streams": cfg.strategy.streams}, federation=federation.describe(),
        checkpoints=checkpoints)
    observer.finish(summary)
    return summary
