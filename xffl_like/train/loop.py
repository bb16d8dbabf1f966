"""The worker loop: local steps inside the facility, whatever keeps the copies in step.

``train_worker(cfg, run_dir)`` runs in every process. ``cfg`` is the typed
:class:`~xffl_like.schema.JobConfig` the launcher validated (workers never start Hydra);
``run_dir`` is the job's one run directory. One skeleton serves every job: the local steps,
evaluations, logging, the final evaluation, divergence, export and summary; a
:class:`~.sync.Sync` keeps the copies in step at fixed points of each step
(:class:`~.sync.FederatedSync` for ``parallel=fsdp``: the federation's rounds;
:class:`~.dataparallel.DataParallelSync` for ``parallel=decentralized|bagua``).
Rank 0 returns the summary (and writes ``summary.json``); other ranks return ``None``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..data import build_data
from ..distributed.layout import plan_layout
from ..distributed.signals import agree_stop, signal_name
from ..distributed.state import DistributedState, build_state, read_env
from ..federation import plan_phases
from ..observe import Observer
from ..observe.timing import PhaseTimer, gather_phase_table
from ..schema import JobConfig, as_plain
from .evaluate import eval_points, evaluate, facility_eval
from .fault import FaultInjector
from .parallelize import peak_rss_mb
from .step import accumulate_gradients
from .summary import gather_facility_losses, job_summary, max_param_divergence
from .sync import FederatedSync, Sync

__all__ = ["STOP_GRACE_S", "build_sync", "train_worker"]

#: After a stop request, training goes on to the next round boundary (where checkpoints are exact)
#: when that is at most this many seconds away; otherwise it stops at once, without a checkpoint.
STOP_GRACE_S = 5.0


def train_worker(cfg: JobConfig, run_dir: str, started_at: float | None = None) -> dict | None:
    env = read_env()
    dcfg = cfg.distributed
    layout = plan_layout(env.world_size, dcfg.federated, dcfg.hsdp, env.local_world_size)
    # Exchanges overlapping local steps run on groups of their own (federation.overlap_steps in any phase).
    overlap = cfg.parallel.name == "fsdp" and any(
        phase.config.overlap_steps > 0 for phase in plan_phases(cfg.federation, cfg.train.steps)
    )
    state = build_state(
        layout, env, backend=dcfg.backend, num_streams=cfg.strategy.streams, timeout_s=dcfg.timeout_s, overlap=overlap
    )
    try:
        return _train(cfg, state, Path(run_dir), started_at or time.time())
    finally:
        dist.destroy_process_group()


def build_sync(cfg: JobConfig, state: DistributedState, run_dir: Path, config: dict) -> Sync:
    """The model and what keeps its copies in step, for ``cfg.parallel.name`` (collective)."""
    if cfg.federation.elastic.lighthouse:  # this job is one facility of a federation of independent jobs
        from .elastic import ElasticSync

        return ElasticSync(cfg, state, run_dir, config)
    if cfg.parallel.name == "fsdp":
        return FederatedSync(cfg, state, run_dir, config)
    from .dataparallel import DataParallelSync  # full copies: Decent-DP or Bagua

    return DataParallelSync(cfg, state)


class _StepLog:
    """Each step's facility loss stays on the device; the rows reach ``losses`` and the observer
    (metrics.jsonl, W&B, progress) in one host sync every ``train.log_every`` steps, and before
    anything that reads them (an evaluation, a round, a checkpoint, a stop, the end): a float() of
    the loss every step would make a GPU wait for each step's kernels before queueing the next."""

    def __init__(self, observer, losses: torch.Tensor, facility: int, tokens_per_step: int):
        self.observer, self.losses, self.facility, self.tokens_per_step = observer, losses, facility, tokens_per_step
        self.rows: list[tuple] = []

    def add(self, step: int, loss: torch.Tensor, lr: float, elapsed: float, evals: dict | None, extra: dict) -> None:
        self.rows.append((step, loss.detach(), lr, elapsed, evals, extra))

    def flush(self) -> None:
        if not self.rows:
            return
        values = torch.stack([row[1].reshape(()) for row in self.rows]).tolist()  # the one host sync
        for (step, _, lr, elapsed, evals, extra), value in zip(self.rows, values):
            self.losses[self.facility, step] = value
            self.observer.step(step, value, lr, self.tokens_per_step, elapsed, evals, **extra)
        self.rows.clear()


def _stop_step(sync: Sync, done: int, steps: int, step_seconds: float) -> int:
    """Collective: where to stop after a stop request seen after ``done`` steps. Checkpoints are taken
    at round boundaries only (where a resume is exact: nothing of a round is in flight); the next one
    when it is at most :data:`STOP_GRACE_S` away (by the slowest rank's mean step time), else here."""
    if sync.ckpt is None or hasattr(sync, "leave"):  # no checkpoints (decentralized|bagua), or elastic: stop now
        return done
    if sync.paced:  # facilities of different paces agree only at rounds: this is one
        return done
    seconds = torch.tensor([step_seconds], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    for step in range(done, steps + 1):
        if sync.boundary_at(step):
            return step if (step - done) * float(seconds) <= STOP_GRACE_S else done
    return done


def _interrupted(
    sync: Sync,
    observer,
    state: DistributedState,
    signum: int,
    done: int,
    steps: int,
    rounds: list[dict],
    losses: torch.Tensor,
    evals: list[dict],
    run_dir: Path,
) -> dict | None:
    """Stop after ``done`` steps: a checkpoint at a round boundary, none elsewhere; rank 0 returns
    ``{"interrupted": {...}}`` (what the launcher's one line says). An elastic facility saves at any
    step (what it rejoins with: its model, inner optimizer and data position; the federation's state
    comes from a live facility) and leaves the federation."""
    ckpt = sync.ckpt
    saved = last = None
    leaving = hasattr(sync, "leave")
    exact = sync.boundary_at(done) or leaving
    if ckpt is not None:
        if exact:  # no-op if the cadence saved it
            ckpt.save(sync.job_step(done), rounds, losses, records={"evals": evals})
        ckpt.wait()  # published, or raises
        if state.rank == 0:
            from ..checkpoint.store import latest_checkpoint, remove_stale

            remove_stale(ckpt.dir)  # temporaries of an interrupted save
            latest = latest_checkpoint(ckpt.dir)
            last = str(latest) if latest else None
            saved = last if exact else None
        dist.barrier(group=ckpt.group)
    left = sync.leave() if leaving else None
    observer.abort()
    if state.rank != 0:
        return None
    return {
        "interrupted": {
            "signal": signal_name(signum),
            "step": done,
            "steps": steps,
            "checkpoint": saved,
            "last_checkpoint": last,
            "run_dir": str(run_dir),
            "left": left,
        }
    }


def _train(cfg: JobConfig, state: DistributedState, run_dir: Path, started_at: float) -> dict | None:
    tcfg = cfg.train
    steps, device, accum = tcfg.steps, state.device, tcfg.grad_accum
    torch.manual_seed(cfg.seed)
    resolved = as_plain(cfg)  # recorded whole in each checkpoint's state.json and as W&B's run config
    sync = build_sync(cfg, state, run_dir, resolved)
    model = sync.model
    setup_rss = torch.tensor(peak_rss_mb(), dtype=torch.float64)
    dist.all_reduce(setup_rss, op=dist.ReduceOp.MAX)
    data_facility, data_facilities = sync.data_facility or (state.facility, state.num_facilities)
    data = build_data(
        cfg.data,
        vocab_size=cfg.model.vocab_size,
        seq_len=tcfg.seq_len,
        batch_size=tcfg.batch_size,
        seed=sync.data_seed,
        facility=data_facility,
        num_facilities=data_facilities,
        facility_rank=state.facility_rank,
        facility_size=state.facility_size,
    )
    tokens_per_step = tcfg.batch_size * tcfg.seq_len * accum * state.world_size
    eval_batches = data.eval_batches()
    # Row f holds facility f's mean loss per step (filled by this rank's facility share).
    losses = torch.zeros(state.num_facilities, steps, dtype=torch.float64)
    restored = sync.restore(losses)  # None: a fresh start
    start_step = restored["step"] if restored else 0
    rounds: list[dict] = list(restored["rounds"]) if restored else []
    # {"step", "loss_local", "loss_global", "time"}: losses per facility, None when not evaluated
    evals: list[dict] = list(restored.get("records", {}).get("evals", [])) if restored else []
    observer = Observer(
        tcfg,
        cfg.strategy,
        cfg.logger,
        state,
        run_dir,
        restored,
        rounds_at=sync.applies_at,
        experiment=cfg.experiment,
        config=resolved,
    )
    fault = FaultInjector(cfg.fault, state.rank, state.facility)
    timer = PhaseTimer(device)
    facility_group = state.group("facility")
    log = _StepLog(observer, losses, state.facility, tokens_per_step)

    dist.barrier()
    start, train_started_at = time.perf_counter(), time.time()
    stop_at: int | None = None  # the step a stop request ends training at
    try:
        # An elastic facility joins here: it adopts the federation's step, keeps its own data position.
        data_at, start_step = start_step, sync.begin(start_step, len(rounds))
        done = start_step
        for step in range(start_step, sync.steps):  # this facility's steps (federation.every as a list: its own)
            done = step + 1
            fault.before_step(done)

            # Micro-batch i of step s is batch s * grad_accum + i of the source: with grad_accum=1, as before.
            def micro_batch(i, step=step + data_at - start_step):
                batch = data.train_batch(step * accum + i)
                sync.trained(batch[1].numel())  # tokens actually trained (federation.weights=tokens)
                return batch

            loss = accumulate_gradients(sync.module, micro_batch, tcfg, device, timer)
            with timer("optimizer"):
                sync.optimizer_step()
            fault.after_step(done, model)
            facility_loss = loss / state.facility_size
            dist.all_reduce(facility_loss, group=facility_group)
            # Rounds (synchronous: every `every` steps) evaluate the local model before and may checkpoint after.
            due = sync.applies_at(done)
            if due:
                with timer("aggregation"):
                    sync.arrive(done)  # every facility at the round (what this one waited: the round's waited_s)
            local_eval = eval_points(done, sync.boundary_at(done), tcfg.eval_every)
            record_eval = {"step": done, "loss_local": None, "loss_global": None}
            if local_eval:
                record_eval["loss_local"] = facility_eval(model, eval_batches, state, tcfg.loss_chunk)
            if due:
                with timer("aggregation", join=True):  # one iteration with the wait in arrive
                    records = sync.finish_due(done, len(rounds))
                for record in records:
                    rounds.append(record)
                    observer.round(record)
                record_eval["loss_global"] = facility_eval(model, eval_batches, state, tcfg.loss_chunk)
            if local_eval:
                record_eval["time"] = time.time()  # when it was known: wall-clock time-to-loss (bench.wan)
                evals.append(record_eval)
            log.add(
                step,
                facility_loss,
                sync.lr(),
                time.perf_counter() - start,
                record_eval if local_eval else None,
                sync.metrics(done),
            )
            last = sync.ends_at(done)  # federation.every_s: the round just made may end the job
            if local_eval or done % tcfg.log_every == 0 or last:  # local_eval: every round boundary too
                log.flush()
            sync.end_step(done, rounds, losses, evals)  # checkpoints after a boundary
            # SIGINT/SIGTERM on any rank: every rank stops at the same step (facilities of different paces: at a round).
            signum = agree_stop() if not sync.paced or due else None
            if signum and stop_at is None:
                stop_at = _stop_step(sync, done, steps, (time.perf_counter() - start) / (done - start_step))
            if stop_at is not None and done >= stop_at and not last:
                log.flush()
                return _interrupted(sync, observer, state, signum, done, steps, rounds, losses, evals, run_dir)
            if last:
                break
            if sync.starts_at(done):  # exchanges start after the step's checkpoint; algorithm switches
                with timer("aggregation"):
                    sync.start_due(done, len(rounds))
    except BaseException:
        observer.abort()
        sync.close()
        raise
    train_seconds = time.perf_counter() - start
    reported = sync.finish()  # every copy the same model; what the summary adds
    sync.close()

    eval_loss = evaluate(model, eval_batches, device, tcfg.loss_chunk)
    divergence = max_param_divergence(model, state)
    gather_facility_losses(losses, state)
    phases = gather_phase_table(timer, state, done - start_step)
    if cfg.export.hf:
        from ..checkpoint.hf import export_job

        export_job(model, state, run_dir, cfg.export, cfg.data, base_model=cfg.model.path)
    # The slowest rank's aggregation time is the round's time.
    agg = torch.tensor([r["seconds"] for r in rounds], dtype=torch.float64)
    dist.all_reduce(agg, op=dist.ReduceOp.MAX)
    # Each facility's wait at each round for the others (its slowest rank's). Rounds a resume restored carry rank 0's
    # wait from state.json, so each facility's column there holds facility 0's: approximate for those rounds.
    waited = torch.zeros(len(rounds), state.num_facilities, dtype=torch.float64)
    for i, record in enumerate(rounds):
        if "waited" in record:
            waited[i, state.facility] = record.pop("waited")
    dist.all_reduce(waited, op=dist.ReduceOp.MAX)
    for record, seconds, wait in zip(rounds, agg.tolist(), waited.tolist()):
        record["seconds"] = seconds
        record.setdefault("waited_s", wait)
    facility_steps = sync.federation.facility_steps.tolist() if sync.paced else None
    trained = done - start_step  # this facility's steps in this job (facilities of different paces: its own)
    if facility_steps is not None:  # every facility's, for the job's tokens
        before = restored.get("facility_steps") if restored else None
        trained = [n - (before[f] if before else 0) for f, n in enumerate(facility_steps)]

    if state.rank != 0:
        observer.finish(None)
        return None
    summary = job_summary(
        cfg.experiment,
        state,
        losses=losses,
        steps=steps,
        trained_steps=trained,
        tokens_per_step=tokens_per_step,
        train_seconds=train_seconds,
        train_started_at=train_started_at,
        started_at=started_at,
        eval_loss=eval_loss,
        evals=evals,
        divergence=divergence,
        phases=phases,
        setup_rss=setup_rss,
        rounds=rounds,
        facility_steps=facility_steps,
        **reported,
    )
    observer.finish(summary)
    return summary
