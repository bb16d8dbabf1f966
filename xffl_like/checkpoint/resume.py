"""Before launch: validate the durability keys and resolve ``resume`` to one complete checkpoint.

Runs in the launching process (rank 0 under torchrun); every problem is a ``ValueError``
with one sentence naming the key, the value and the fix. Nothing here writes to disk.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from .dcp import checkpoint_dir
from .store import LATEST, is_complete, latest_checkpoint, read_metadata, read_state
from ..checks import is_int
from ..schema import CheckpointConfig, JobConfig, as_plain, build_section

__all__ = ["ResumeTarget", "check_writable", "resolve_resume", "resumed", "validate_durability"]


@dataclass(frozen=True)
class ResumeTarget:
    """The checkpoint a job resumes from and the run directory it continues in."""

    checkpoint: Path
    run_dir: Path
    state: dict


def _int(value, key: str, low: int, high: int | None = None, example: str = "") -> int:
    ok = is_int(value) and value >= low and (high is None or value <= high)
    if not ok:
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{key}={value!r}: must be an integer {span}{example}")
    return value


def validate_durability(job: JobConfig, world_size: int) -> None:
    """``checkpoint.*``, ``fault.*``, ``federation.on_nonfinite``, ``distributed.max_restarts``, ``resume``:
    the keys of several sections that decide how a job survives failures (hence the whole job)."""
    ccfg, fcfg, steps = job.checkpoint, job.fault, job.train.steps
    _int(ccfg.every_rounds, "checkpoint.every_rounds", 1, example=" (rounds between checkpoints, e.g. 1)")
    _int(ccfg.keep, "checkpoint.keep", 1, example=" (checkpoints kept; the newest is always needed, e.g. 2)")
    is_async = getattr(ccfg, "async")  # a Python keyword
    if not isinstance(is_async, bool):
        raise ValueError(f"checkpoint.async={is_async!r}: use true or false")
    if ccfg.dir is not None and (not isinstance(ccfg.dir, str) or not ccfg.dir.strip()):
        raise ValueError(f"checkpoint.dir={ccfg.dir!r}: use a directory path, or null for <run_dir>/checkpoints")
    _int(job.distributed.max_restarts, "distributed.max_restarts", 0, example=" (0: no restart)")
    policy = job.federation.on_nonfinite
    if policy not in ("fail", "skip"):
        raise ValueError(f"federation.on_nonfinite={policy!r}: use fail or skip")
    for rank_key, step_key in (("kill_rank", "at_step"), ("nan_rank", "nan_step")):
        rank, step = getattr(fcfg, rank_key), getattr(fcfg, step_key)
        if (rank is None) != (step is None):
            raise ValueError(f"fault.{rank_key}={rank!r} fault.{step_key}={step!r}: set both (or neither)")
        if rank is not None:
            _int(rank, f"fault.{rank_key}", 0, world_size - 1, f" (a rank of this {world_size}-process job)")
            _int(step, f"fault.{step_key}", 1, steps, f" (a step of this {steps}-step job, 1-based)")
    resume = job.resume
    if resume is not None and (not isinstance(resume, str) or not resume.strip()):
        raise ValueError(f"resume={resume!r}: use a run directory, a checkpoint directory or latest")


def check_writable(path: Path, key: str) -> None:
    """Create ``path`` if needed and write (then remove) a probe file in it.

    A real write, not ``os.access``: root passes every permission check, read-only and
    pseudo file systems do not.
    """
    import tempfile

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-"):
            pass
    except OSError as exc:
        raise ValueError(f"{key}: {path} is not writable ({exc.strerror}); choose another directory") from None


def _find(path: Path) -> tuple[Path, Path]:
    """(checkpoint, run dir) for a checkpoint dir, a checkpoints dir or a run dir."""
    if is_complete(path):
        state = read_state(path)
        run_dir = Path(state.get("run_dir") or path.parent.parent)
        return path, run_dir if run_dir.is_dir() else path.parent.parent
    if (path / LATEST).is_file():
        ckpt_dir, run_dir = path, path.parent
    elif (path / "config.yaml").is_file() or (path / "checkpoints").is_dir():
        run_dir = path
        ckpt_dir = path / "checkpoints"
        if (path / "config.yaml").is_file():
            from omegaconf import OmegaConf  # safe YAML: no object construction

            plain = OmegaConf.to_container(OmegaConf.load(path / "config.yaml"))
            ckpt_dir = checkpoint_dir(build_section(CheckpointConfig, plain.get("checkpoint") or {}), path)
    elif (path / ".metadata").is_file() or path.name.startswith("step-"):
        raise ValueError(f"resume={path}: the checkpoint is incomplete (a job died while writing it); "
                         f"resume from its run directory to use the latest complete one")
    else:
        raise ValueError(f"resume={path}: neither a run directory nor a checkpoint (no config.yaml, "
                         f"checkpoints/ or .metadata inside)")
    found = latest_checkpoint(ckpt_dir)
    if found is None:
        raise ValueError(f"resume={path}: no complete checkpoint in {ckpt_dir} (no valid '{LATEST}' pointer)")
    return found, run_dir


def _experiment_of(run: Path) -> str | None:
    try:
        from omegaconf import OmegaConf

        return OmegaConf.load(run / "config.yaml").get("experiment")
    except Exception:  # noqa: BLE001 - not a run directory
        return None


def _latest_run(outputs: Path, experiment: str, current: Path | None) -> Path:
    """The newest run directory of ``experiment`` under ``outputs`` that holds a complete checkpoint."""
    runs = sorted((p for p in outputs.iterdir() if p.is_dir()), key=lambda p: p.name, reverse=True) if outputs.is_dir() else []
    for run in runs:
        if current is not None and run.absolute() == current.absolute() or _experiment_of(run) != experiment:
            continue
        try:
            _find(run)
            return run
        except ValueError:
            continue
    raise ValueError(f"resume=latest: no run of this experiment with a complete checkpoint under {outputs} "
                     f"(pass resume=<run dir> instead)")


def _check_files(ckpt: Path):
    """Every file DCP's metadata names exists and is long enough (catches truncated copies)."""
    metadata = read_metadata(ckpt)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in needed.items():
        path = ckpt / name
        if not path.is_file():
            raise ValueError(f"resume: {path} is missing (the checkpoint is incomplete); resume from an older checkpoint")
        if path.stat().st_size < size:
            raise ValueError(f"resume: {path} is truncated ({path.stat().st_size} of {size} bytes); "
                             f"resume from an older checkpoint")
    return metadata


def _check_compatible(job: JobConfig, state: dict, metadata, layout, model) -> None:
    saved = state.get("config") or {}
    saved_facilities = len(state["layout"]["facility_sizes"])
    if saved_facilities != layout.num_facilities:
        raise ValueError(f"resume: the checkpoint has {saved_facilities} facilities, this job {layout.num_facilities} "
                         f"(set distributed.federated to {saved_facilities} facilities; shard and world sizes inside "
                         f"a facility may change)")
    now = as_plain(job.model)
    for key in sorted(set(saved.get("model", {})) | set(now)):
        old, new = saved.get("model", {}).get(key), now.get(key)
        if old != new and key not in ("name", "init", "path"):  # the weights come from the checkpoint
            raise ValueError(f"resume: model.{key} is {old!r} in the checkpoint, {new!r} now (resume with the same model)")
    present = metadata.state_dict_metadata
    for name, param in model.named_parameters():
        entry = present.get(f"f0.model.{name}")
        if entry is None or tuple(entry.size) != tuple(param.shape):
            got = "missing" if entry is None else f"shape {tuple(entry.size)}"
            raise ValueError(f"resume: parameter {name} is {got} in the checkpoint, shape {tuple(param.shape)} "
                             f"in this model (resume with the model the checkpoint was written by)")
    if saved.get("optim", {}).get("name") != job.optim.name:
        raise ValueError(f"resume: optim.name is {saved.get('optim', {}).get('name')!r} in the checkpoint, "
                         f"{job.optim.name!r} now")
    if job.train.steps <= state["step"]:
        raise ValueError(f"resume: the checkpoint is at step {state['step']}, train.steps={job.train.steps} "
                         f"leaves nothing to do (raise train.steps)")


def resolve_resume(job: JobConfig, layout, outputs: Path, current_run_dir: Path | None = None) -> ResumeTarget | None:
    """Resolve ``job.resume`` and check it against ``job``; ``None`` when not resuming.

    ``outputs`` is where this experiment's runs live (for ``resume=latest``). :func:`resumed`
    gives the job that workers receive (the checkpoint's absolute path and directory, so that
    workers and a restart find it wherever they run).
    """
    resume = job.resume
    if resume is None:
        return None
    if resume == "latest":
        path = _latest_run(Path(outputs), job.experiment, current_run_dir)
    else:
        path = Path(resume).expanduser().absolute()
        if not path.exists():
            raise ValueError(f"resume={resume}: no such directory (pass a run directory, a checkpoint or latest)")
    ckpt, run_dir = _find(path)
    state = read_state(ckpt)
    metadata = _check_files(ckpt)
    from ..models import build_model

    _check_compatible(job, state, metadata, layout, build_model(job.model, device="meta"))
    return ResumeTarget(ckpt.absolute(), run_dir.absolute(), state)


def resumed(job: JobConfig, target: ResumeTarget) -> JobConfig:
    """``job`` resuming from ``target``: ``resume`` the checkpoint's absolute path, ``checkpoint.dir`` its directory."""
    return replace(job, resume=str(target.checkpoint), checkpoint=replace(job.checkpoint, dir=str(target.checkpoint.parent)))
