"""Checkpoints of a training job with ``torch.distributed.checkpoint`` (DCP).

Every rank holds a :class:`Checkpointer`. After an aggregation round (when every facility
holds the mean) the loop calls :meth:`Checkpointer.after_round`; every
``checkpoint.every_rounds`` rounds, and always after the last, it saves:

- per facility ``f``: ``f<f>.model.*`` (the FSDP/HSDP-sharded weights: DTensors, so DCP
  writes each shard once and reshards on load), ``f<f>.optim.*`` (the optimizer's state:
  moments and step counts, by parameter name) and ``f<f>.losses`` (the facility's loss at
  every step so far). Facilities are kept apart because their optimizers, losses and any
  parameters outside ``strategy.only`` differ;
- per rank ``r``: ``rank<r>.rng.*`` (CPU and, where present, CUDA generator states);
- in ``state.json`` (rank 0): step and round counters, the data position (sources are pure
  functions of the step), the per-round records (with skipped facilities), the learning
  rates and the LR scheduler's state, the W&B run ids, the layout and the resolved config.

With ``checkpoint.async=true`` the state is staged to host memory (:mod:`.staging`: no device
copy is made), ``async_save`` writes it in a background thread over a dedicated gloo group while
training continues, and a new save first waits for the previous one: never two in flight. Rank 0 publishes a checkpoint
(rename, then ``latest``) only when DCP's save has finished on the coordinator, i.e. after
every rank's part is written. Old checkpoints beyond ``checkpoint.keep`` are deleted.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..config.schema import CheckpointConfig
from ..distributed.signals import cleanup_on_exit
from .safe import SafeFileSystemReader, SafeLoadPlanner, read_metadata
from .staging import HostStager, host_copy
from .store import (
    checkpoint_dir,
    checkpoint_name,
    latest_checkpoint,
    publish,
    read_state,
    remove_stale,
    retain,
)

__all__ = ["CheckpointError", "Checkpointer", "checkpoint_dir", "describe_failure", "host_copy", "restart_count"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; ``str()`` is one line naming the file and the cause."""


def _root_cause(exc: BaseException) -> BaseException:
    """The first real cause inside ``exc``: DCP's per-rank failures unwrapped (lowest rank first), then
    the ``__cause__``/``__context__`` chain searched for an ``OSError`` (a full disk shows up as a
    ``RuntimeError`` of the zip writer whose context is the ``OSError``)."""
    from torch.distributed.checkpoint.api import CheckpointException

    seen = set()
    while isinstance(exc, CheckpointException) and exc.failures and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.failures[min(exc.failures)][0]
    node: BaseException | None = exc
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        if isinstance(node, OSError):
            return node
        node = node.__cause__ or node.__context__
    return exc


def _free_bytes(where: Path) -> tuple[int, int] | None:
    """(free, total) bytes of the file system holding ``where`` (its nearest existing ancestor)."""
    path = Path(where)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def describe_failure(exc: BaseException, where: Path) -> str:
    """``<file>: <cause>`` in one line for a failed save or load of checkpoint ``where``."""
    cause = _root_cause(exc)
    if isinstance(cause, OSError):
        file = cause.filename or where
        return f"{file}: {cause.strerror or cause}"
    # Another rank's failure crosses as a pickled exception without its context: a full disk then reads
    # as the zip writer's "unexpected pos"; the file system says what it was.
    space = _free_bytes(where)
    if space is not None and space[0] < max(1 << 20, space[1] // 100):
        return f"{where}: No space left on device ({space[0]} bytes free on its file system)"
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    return f"{where}: {type(cause).__name__}{': ' + first[:200] if first else ''}"


def _load_failure(exc: BaseException, path: Path) -> CheckpointError:
    """The one line for a failed load of ``path``: the damaged file and why (found by :func:`check_intact` when
    the exception does not say), and the newest intact older checkpoint, never ``path`` itself."""
    from .store import Damaged, check_intact, newest_intact

    try:
        check_intact(path)
        what = describe_failure(exc, path)
    except Damaged as damaged:
        what = f"{damaged.file}: {damaged.cause}"
    older = newest_intact(path.parent, path)
    hint = f"the newest intact checkpoint is {older} (resume={older})" if older else "no older intact checkpoint"
    return CheckpointError(f"cannot read checkpoint {path}: {what}; {hint}")


def restart_count() -> int:
    """How often the elastic agent (or torchrun ``--max-restarts``) restarted this worker group."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class Checkpointer:
    """Saves and restores one worker's share of the job's state (construct on every rank)."""

    def __init__(
        self,
        checkpoint: CheckpointConfig,
        state,
        run_dir: Path,
        model: torch.nn.Module,
        optimizer,
        scheduler,
        federation=None,
        *,
        resume: str | None = None,
        config: dict | None = None,
    ):
        """``checkpoint``: the ``checkpoint`` section; ``resume``: the job's ``resume`` (a checkpoint path,
        resolved by the launcher, or None); ``config``: the resolved job config as plain dicts
        (``schema.as_plain``), recorded in each ``state.json`` for the resume checks."""
        self.state, self.run_dir = state, Path(run_dir)
        self.resume, self.config = resume, config
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        # The sync (train/sync.py): its state_dict() holds the federation's outer optimizer, theta_global, residuals,
        # counters; state_dict(at_step=s) the template a checkpoint of step s loads into.
        self.federation = federation
        self.dir = checkpoint_dir(checkpoint, run_dir)
        # ``async`` is a Python keyword: no attribute syntax for it.
        self.every, self.keep, self.use_async = (
            checkpoint.every_rounds,
            checkpoint.keep,
            bool(getattr(checkpoint, "async")),
        )
        self.lead = state.rank == 0
        # A group of its own (the state's ``background``, gloo): async saves run collectives from a
        # background thread, which must never interleave with the training loop's collectives on the same group.
        self.group = state.group("background")
        self.pending: Future | None = None
        self.stager = HostStager()  # its host buffers serve every save of this rank
        self.pending_dir: Path = self.dir  # the .tmp- directory of the save in flight
        self.published = threading.Event()
        self.published.set()
        self.error: BaseException | None = None
        self.saved_step = -1
        self.blocked_seconds: list[float] = []  # per save: how long training waited
        self.write_seconds: list[float] = []  # rank 0, per save: start to published
        self.device_peaks: list[tuple[int, int]] = []  # on a GPU, per save: peak bytes before it, during it
        self.restored_from: str | None = None
        self.wandb_ids: list[str] | None = None  # from the checkpoint a resumed job starts from
        if self.lead:
            self.dir.mkdir(parents=True, exist_ok=True)
            remove_stale(self.dir)
        dist.barrier(group=self.group)

    # ------------------------------------------------------------------ what to restore
    def source(self) -> Path | None:
        """The checkpoint this worker starts from: after an elastic restart the newest one of
        this run; otherwise ``resume`` (resolved to a checkpoint path before launch)."""
        if restart_count() > 0:
            found = latest_checkpoint(self.dir)
            if found is not None:
                return found
        return Path(self.resume) if self.resume else None

    # ------------------------------------------------------------------ state dicts
    def _state_dicts(self) -> tuple[dict, dict]:
        model_sd = get_model_state_dict(self.model)
        optim_sd = get_optimizer_state_dict(self.model, self.optimizer)
        return model_sd, optim_sd

    def _rng(self) -> dict[str, torch.Tensor]:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and self.state.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.state.device)
        return rng

    def _json_state(self, step: int, rounds: list[dict], param_groups: list[dict]) -> dict:
        from ..observe.wandb_logger import wandb_run_ids

        return {
            "step": step,
            "round": len(rounds),
            "data_position": {"step": step},  # batches are a pure function of (seed, facility, rank, step)
            "rounds": rounds,
            "lrs": [g["lr"] for g in param_groups],
            "scheduler": self.scheduler.state_dict(),
            "wandb_ids": self.wandb_ids or wandb_run_ids(self.run_dir, self.state.num_facilities),
            "layout": {
                "world_size": self.state.world_size,
                "facility_sizes": list(self.state.layout.facility_sizes),
                "shard_size": self.state.layout.shard_size,
            },
            "run_dir": str(self.run_dir),
            "config": self.config,
            "saved_at": time.time(),
        }

    # ------------------------------------------------------------------ restore
    def restore(self, losses: torch.Tensor) -> dict | None:
        """Load :meth:`source` into the model, optimizer, scheduler, RNG and ``losses`` (in place).

        Returns the checkpoint's ``state.json`` (``step``, ``rounds``, ``wandb_ids``, ...) or
        ``None`` for a fresh start. A different shard or world size inside the facilities is
        resharded by DCP; the per-rank RNG states are restored where the rank existed.
        """
        path = self.source()
        if path is None:
            return None
        saved = read_state(path)
        present = read_metadata(path).state_dict_metadata
        f, me = self.state.facility, self.state.rank
        model_sd, optim_sd = self._state_dicts()
        stored_losses = present.get(f"f{f}.losses")
        losses_row = torch.zeros(tuple(stored_losses.size), dtype=losses.dtype) if stored_losses is not None else None
        sd: dict[str, Any] = {f"f{f}": {"model": model_sd, "optim": optim_sd["state"]}}
        if losses_row is not None:
            sd[f"f{f}"]["losses"] = losses_row
        federation_sd = None
        if self.federation is not None and f"f{f}.federation.rounds" in present:
            federation_sd = self.federation.state_dict(at_step=saved["step"])  # the phase running at that step
            sd[f"f{f}"]["federation"] = federation_sd
        rng = {k: torch.empty_like(v) for k, v in self._rng().items() if f"rank{me}.rng.{k}" in present}
        if rng:
            sd[f"rank{me}"] = {"rng": rng}
        try:
            dcp.load(
                sd, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(), process_group=self.group
            )
        except (Exception, dcp.api.CheckpointException) as exc:  # noqa: BLE001 - CheckpointException is a BaseException
            raise _load_failure(exc, Path(path)) from None
        set_model_state_dict(self.model, model_sd)
        for group, lr in zip(optim_sd["param_groups"], saved["lrs"]):
            group["lr"] = lr
        set_optimizer_state_dict(self.model, self.optimizer, optim_sd)
        self.scheduler.load_state_dict(saved["scheduler"])
        if "cpu" in rng:
            torch.set_rng_state(rng["cpu"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], self.state.device)
        if federation_sd is not None:
            self.federation.load_state_dict(federation_sd)
        if losses_row is not None:
            n = min(losses_row.numel(), losses.shape[1])
            losses[f, :n] = losses_row[:n]
        self.saved_step = saved["step"]
        self.wandb_ids = saved.get("wandb_ids")
        self.restored_from = str(path)
        return saved

    # ------------------------------------------------------------------ save
    def after_round(
        self, step: int, rounds: list[dict], losses: torch.Tensor, final: bool = False, records: dict | None = None
    ) -> None:
        """Called by every rank after each aggregation round (``step`` steps done); ``records``:
        other JSON lists of the run so far (kept in ``state.json``, returned by :meth:`restore`)."""
        if final or (len(rounds) % self.every == 0):
            self.save(step, rounds, losses, records)

    def save(self, step: int, rounds: list[dict], losses: torch.Tensor, records: dict | None = None) -> None:
        """Write a checkpoint of the state after ``step`` steps (sync or async)."""
        if step == self.saved_step:
            return
        started = time.perf_counter()
        self.wait()  # never two in flight
        model_sd, optim_sd = self._state_dicts()
        f = self.state.facility
        sd = {
            f"f{f}": {"model": model_sd, "optim": optim_sd["state"], "losses": losses[f].clone()},
            f"rank{self.state.rank}": {"rng": self._rng()},
        }
        if self.federation is not None:
            sd[f"f{f}"]["federation"] = self.federation.state_dict()
        final = self.dir / checkpoint_name(step)
        tmp = self.dir / f".tmp-{final.name}"
        meta = self._json_state(step, [dict(r) for r in rounds], optim_sd["param_groups"]) if self.lead else None
        if meta is not None:
            meta["records"] = json.loads(json.dumps(records or {}))  # a snapshot: the lists keep growing
        writer = dcp.FileSystemWriter(str(tmp))
        peak_before = self._reset_device_peak()
        if self.lead:
            cleanup_on_exit(tmp)  # a second Ctrl-C/SIGTERM exits at once: this half-written save goes first
        if self.use_async:
            if self.lead:
                self.published.clear()
            self.pending_dir = tmp
            self.pending = dcp.async_save(sd, storage_writer=writer, process_group=self.group, async_stager=self.stager)
            if self.lead:
                self.pending.add_done_callback(lambda fut: self._publish(fut, tmp, final, meta, started))
        else:
            try:
                dcp.save(sd, storage_writer=writer, process_group=self.group)
            except (Exception, dcp.api.CheckpointException) as exc:  # noqa: BLE001 - a BaseException
                raise CheckpointError(f"checkpoint could not be written: {describe_failure(exc, tmp)}") from None
            if self.lead:
                self._publish(None, tmp, final, meta, started)
                if self.error is not None:
                    error, self.error = self.error, None
                    raise CheckpointError(f"checkpoint could not be written: {describe_failure(error, tmp)}")
            dist.barrier(group=self.group)  # the checkpoint is published when every rank returns
        if peak_before is not None:  # what the save added to the device's peak: nothing, when staged to CPU
            self.device_peaks.append((peak_before, torch.cuda.max_memory_allocated(self.state.device)))
        self.saved_step = step
        self.blocked_seconds.append(time.perf_counter() - started)

    def _reset_device_peak(self) -> int | None:
        """On a GPU: the device's peak allocated bytes so far (training since the last save), then the peak is
        reset so that what this save's staging allocates is measured alone."""
        device = self.state.device
        if device.type != "cuda":
            return None
        before = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return before

    def _publish(self, fut: Future | None, tmp: Path, final: Path, meta: dict, started: float) -> None:
        try:
            if fut is not None:
                fut.result()  # re-raises a failed write
            publish(tmp, final, meta)
            cleanup_on_exit(tmp, add=False)
            retain(self.dir, self.keep)
            self.write_seconds.append(time.perf_counter() - started)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the next wait()
            self.error = exc
        finally:
            self.published.set()

    def wait(self) -> None:
        """Block until the checkpoint in flight (if any) is written and published."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            try:
                pending.result()
            except (Exception, dcp.api.CheckpointException) as exc:  # noqa: BLE001 - a BaseException
                self.published.wait()
                self.error = None
                raise CheckpointError(
                    f"checkpoint could not be written: {describe_failure(exc, self.pending_dir)}"
                ) from None
            # The done-callback runs in the writer thread after result() wakes us: wait for it.
            self.published.wait()
        if self.error is not None:
            error, self.error = self.error, None
            raise CheckpointError(
                f"checkpoint could not be written: {describe_failure(error, self.pending_dir)}"
            ) from None

    def close(self) -> dict:
        """Wait for the last checkpoint; return what the summary reports about checkpoints."""
        self.wait()
        dist.barrier(group=self.group)
        latest = latest_checkpoint(self.dir)
        return {
            "dir": str(self.dir),
            "latest": str(latest) if latest else None,
            "resumed_from": self.restored_from,
            "restarts": restart_count(),
            "saves": len(self.blocked_seconds),
            "blocked_seconds": self.blocked_seconds,
            "write_seconds": self.write_seconds,
            "device_peak_bytes": [list(p) for p in self.device_peaks],
        }
