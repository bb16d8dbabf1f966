"""Before launch: validate the durability keys and resolve ``resume`` to one complete checkpoint.

Runs in the launching process (rank 0 under torchrun); every problem is a ``ValueError`` (a key's:
a ``ConfigError``) with one sentence naming the key, the value and the fix. Nothing here writes to disk.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..config.checks import is_int
from ..config.errors import ConfigError
from ..config.schema import CheckpointConfig, JobConfig, as_plain, build_section
from .store import LATEST, Damaged, check_intact, checkpoint_dir, newest_intact, read_state

__all__ = [
    "RESUME_MAY_CHANGE",
    "ResumeTarget",
    "check_writable",
    "config_differences",
    "resolve_resume",
    "resumed",
    "validate_durability",
]

#: Config keys (a dotted key, or a section: every key under it) that a resume may change: they do not change
#: the trajectory (the weights, optimizer state and data of every step). Every other key must equal the
#: checkpoint's; docs/outputs.md#resume-rules lists them. ``train.steps`` must exceed the checkpoint's step.
#: ``distributed.nproc_per_node``/``federated`` are compared through the layout (``layout.facility_sizes``:
#: ranks per facility decide the batches), not as keys: torchrun's world size is not in the config.
RESUME_MAY_CHANGE = (
    "resume",
    "experiment",
    "train.steps",
    "train.log_every",
    "train.eval_every",
    "checkpoint.every_rounds",
    "checkpoint.keep",
    "checkpoint.async",
    "checkpoint.dir",
    "logger",
    "export",
    "fault",
    "distributed.timeout_s",
    "distributed.max_restarts",
    "distributed.backend",
    "distributed.hsdp",
    "distributed.nproc_per_node",
    "distributed.federated",
    "model.name",
    "model.init",
    "model.path",  # the weights come from the checkpoint; the shape is compared
)


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
        raise ConfigError(f"{key}={value!r}: must be an integer {span}{example}")
    return value


def validate_durability(job: JobConfig, world_size: int) -> None:
    """``checkpoint.*``, ``fault.*``, ``federation.on_nonfinite``, ``distributed.max_restarts``, ``resume``:
    the keys of several sections that decide how a job survives failures (hence the whole job)."""
    ccfg, fcfg, steps = job.checkpoint, job.fault, job.train.steps
    _int(ccfg.every_rounds, "checkpoint.every_rounds", 1, example=" (rounds between checkpoints, e.g. 1)")
    _int(ccfg.keep, "checkpoint.keep", 1, example=" (checkpoints kept; the newest is always needed, e.g. 2)")
    is_async = getattr(ccfg, "async")  # a Python keyword
    if not isinstance(is_async, bool):
        raise ConfigError(f"checkpoint.async={is_async!r}: use true or false")
    if ccfg.dir is not None and (not isinstance(ccfg.dir, str) or not ccfg.dir.strip()):
        raise ConfigError(f"checkpoint.dir={ccfg.dir!r}: use a directory path, or null for <run_dir>/checkpoints")
    _int(job.distributed.max_restarts, "distributed.max_restarts", 0, example=" (0: no restart)")
    policy = job.federation.on_nonfinite
    if policy not in ("fail", "skip"):
        raise ConfigError(f"federation.on_nonfinite={policy!r}: use fail or skip")
    for rank_key, step_key in (("kill_rank", "at_step"), ("nan_rank", "nan_step")):
        rank, step = getattr(fcfg, rank_key), getattr(fcfg, step_key)
        if (rank is None) != (step is None):
            raise ConfigError(f"fault.{rank_key}={rank!r} fault.{step_key}={step!r}: set both (or neither)")
        if rank is not None:
            _int(rank, f"fault.{rank_key}", 0, world_size - 1, f" (a rank of this {world_size}-process job)")
            _int(step, f"fault.{step_key}", 1, steps, f" (a step of this {steps}-step job, 1-based)")
    resume = job.resume
    if resume is not None and (not isinstance(resume, str) or not resume.strip()):
        raise ConfigError(f"resume={resume!r}: use a run directory, a checkpoint directory or latest")


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


def _intact_hint(ckpt_dir: Path, before: Path | None = None) -> str:
    older = newest_intact(ckpt_dir, before)
    if older is None:
        return f"no intact checkpoint is left in {ckpt_dir} (start a new run)"
    return f"the newest intact checkpoint is {older} (resume={older})"


def _damaged(resume: Path, exc: Damaged, ckpt: Path) -> ValueError:
    """One line: the broken file, why, and the newest intact checkpoint older than ``ckpt`` (never ``ckpt``)."""
    return ValueError(f"resume={resume}: {exc.file}: {exc.cause}; {_intact_hint(ckpt.parent, ckpt)}")


def _find(path: Path) -> tuple[Path, Path]:
    """(checkpoint, run dir) for a checkpoint dir, a checkpoints dir or a run dir; the checkpoint is intact."""
    if path.name.startswith(".tmp-"):
        raise ValueError(
            f"resume={path}: the checkpoint is incomplete (a job died while writing it); "
            f"resume from its run directory to use the latest complete one"
        )
    if path.name.startswith("step-") or (path / ".metadata").is_file():
        try:
            check_intact(path)
        except Damaged as exc:
            raise _damaged(path, exc, path) from None
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
    else:
        raise ValueError(
            f"resume={path}: neither a run directory nor a checkpoint (no config.yaml, "
            f"checkpoints/ or .metadata inside)"
        )
    pointer = ckpt_dir / LATEST
    name = pointer.read_text().strip() if pointer.is_file() else ""
    found = ckpt_dir / name if name.startswith("step-") else None
    if found is None or not found.is_dir():
        raise ValueError(
            f"resume={path}: no complete checkpoint in {ckpt_dir} (no valid '{LATEST}' pointer); "
            f"{_intact_hint(ckpt_dir)}"
        )
    try:
        check_intact(found)
    except Damaged as exc:
        raise _damaged(path, exc, found) from None
    return found, run_dir


def _experiment_of(run: Path) -> str | None:
    try:
        from omegaconf import OmegaConf

        return OmegaConf.load(run / "config.yaml").get("experiment")
    except Exception:  # noqa: BLE001 - not a run directory
        return None


def _latest_run(outputs: Path, experiment: str, current: Path | None) -> Path:
    """The newest run directory of ``experiment`` under ``outputs`` that holds a complete checkpoint."""
    runs = (
        sorted((p for p in outputs.iterdir() if p.is_dir()), key=lambda p: p.name, reverse=True)
        if outputs.is_dir()
        else []
    )
    for run in runs:
        if current is not None and run.absolute() == current.absolute() or _experiment_of(run) != experiment:
            continue
        try:
            _find(run)
            return run
        except ValueError:
            continue
    raise ValueError(
        f"resume=latest: no run of this experiment with a complete checkpoint under {outputs} "
        f"(pass resume=<run dir> instead)"
    )


def _flat(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out: dict = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def _may_change(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUME_MAY_CHANGE)


_UNSET = "<unset>"


def config_differences(saved: dict, now: dict) -> list[tuple[str, object, object]]:
    """(dotted key, checkpoint's value, this job's value) of every key outside :data:`RESUME_MAY_CHANGE`
    whose plain values differ (sorted by key; a key on one side only shows ``<unset>`` on the other)."""
    import json

    a, b = (_flat(json.loads(json.dumps(c, default=str))) for c in (saved, now))  # tuples -> lists, as JSON keeps them
    return [
        (k, a.get(k, _UNSET), b.get(k, _UNSET))
        for k in sorted(set(a) | set(b))
        if not _may_change(k) and a.get(k, _UNSET) != b.get(k, _UNSET)
    ]


def _show(value) -> str:
    import json

    return value if isinstance(value, str) else json.dumps(value)


def _saved_config(state: dict, run_dir: Path) -> dict:
    """The config the checkpoint was written by: its ``state.json``'s, else the run's ``config.yaml``."""
    if state.get("config"):
        return state["config"]
    from omegaconf import OmegaConf

    return (
        OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml")) if (run_dir / "config.yaml").is_file() else {}
    )


def _check_compatible(job: JobConfig, state: dict, saved: dict, metadata, layout, model) -> None:
    saved_sizes = list(state["layout"]["facility_sizes"])
    if len(saved_sizes) != layout.num_facilities:
        raise ValueError(
            f"resume: the checkpoint has {len(saved_sizes)} facilities, this job {layout.num_facilities} "
            f"(the checkpoint's ranks per facility: "
            f"distributed.federated=[{','.join(map(str, saved_sizes))}])"
        )
    diffs = config_differences(saved, as_plain(job))
    if saved_sizes != list(layout.facility_sizes):
        diffs.append(("layout.facility_sizes", saved_sizes, list(layout.facility_sizes)))
    if diffs:
        listed = ", ".join(f"{key} ({_show(old)} -> {_show(new)})" for key, old, new in diffs)
        raise ValueError(
            f"resume: the config differs from the checkpoint's in {listed}: these change the run; "
            f"drop the overrides or start a new run (keys a resume may change: docs/outputs.md, "
            f"resume rules)"
        )
    present = metadata.state_dict_metadata
    for name, param in model.named_parameters():
        entry = present.get(f"f0.model.{name}")
        if entry is None or tuple(entry.size) != tuple(param.shape):
            got = "missing" if entry is None else f"shape {tuple(entry.size)}"
            raise ValueError(
                f"resume: parameter {name} is {got} in the checkpoint, shape {tuple(param.shape)} "
                f"in this model (resume with the model the checkpoint was written by)"
            )
    if job.train.steps <= state["step"]:
        raise ValueError(
            f"resume: the checkpoint is at step {state['step']}, train.steps={job.train.steps} "
            f"leaves nothing to do (raise train.steps)"
        )


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
    from ..models import build_model
    from .safe import read_metadata  # DCP's import: only when resuming

    state = read_state(ckpt)
    metadata = read_metadata(ckpt)

    _check_compatible(
        job, state, _saved_config(state, run_dir), metadata, layout, build_model(job.model, device="meta")
    )
    return ResumeTarget(ckpt.absolute(), run_dir.absolute(), state)


def resumed(job: JobConfig, target: ResumeTarget) -> JobConfig:
    """``job`` resuming from ``target``: ``resume`` the checkpoint's absolute path, ``checkpoint.dir`` its directory."""
    return replace(
        job, resume=str(target.checkpoint), checkpoint=replace(job.checkpoint, dir=str(target.checkpoint.parent))
    )
