"""One job, from a composed config to a summary: validate, launch workers, report.

``run_local`` is the plain ``python -m xffl_like.run`` path (the job launches its own
workers); ``run_under_launcher`` is the torchrun/srun path (this process is a worker).
Either way the config is composed and validated once, by one process, and workers
receive the typed :class:`~xffl_like.config.schema.JobConfig` and the one run directory.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from . import CONF_DIR
from .config.errors import ConfigError
from .config.hydra_errors import compose_error
from .config.plan import worker_plan
from .config.schema import JobConfig, as_plain, job_config
from .config.validate import validate_config
from .distributed.launch import WorkerFailure, launch_local, start_fork_server

__all__ = ["CONF_DIR", "JobFailed", "JobInterrupted", "run_local", "run_under_launcher", "resolve"]


class JobFailed(RuntimeError):
    """The job could not run or a worker failed; ``str(exc)`` is the one line to show."""


class JobInterrupted(JobFailed):
    """SIGINT/SIGTERM stopped the job; ``str(exc)`` is the one line, ``exc.code`` the exit status (130/143)."""

    def __init__(self, line: str, code: int):
        super().__init__(line)
        self.code = code


def _overrides() -> list[str]:
    """This job's command-line overrides (Hydra's, else the arguments), less ``resume`` and ``hydra.*``."""
    from hydra.core.hydra_config import HydraConfig

    given = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else sys.argv[1:]
    return [o for o in given if not o.lstrip("+~").startswith(("resume=", "hydra."))]


def _again(run_dir: Path, resume: bool, launcher: str = "python") -> str:
    import shlex

    args = " ".join(shlex.quote(o) for o in _overrides())
    tail = f" resume={shlex.quote(str(run_dir))}" if resume else ""
    return f"{launcher} -m xffl_like.run {args}{tail}".replace("  ", " ")


def stop_exit_code(signum: int, left: bool) -> int:
    """The exit status of a job a signal stopped: 0 for an elastic facility that ``left`` its federation at
    Slurm's walltime notice (SIGUSR1, ``--signal=USR1@120``: a success, it rejoins later); otherwise the
    shell's 128 + the signal, elastic or not (Ctrl-C 130, SIGTERM 143)."""
    import signal

    from .distributed.signals import exit_code

    return 0 if left and signum == signal.SIGUSR1 else exit_code(signum)


def interrupted_line(info: dict, launcher: str = "python") -> str:
    """The one line of a job that a signal stopped (``info``: what rank 0's loop returned)."""
    head = f"interrupted at step {info['step']} of {info['steps']} ({info['signal']})"
    run_dir = Path(info["run_dir"])
    if info.get("left") and not (info["checkpoint"] or info.get("last_checkpoint")):  # stopped while joining
        return (
            f"{info['left']} at step {info['step']} of {info['steps']} ({info['signal']}) before training: nothing "
            f"to save; join again with: {_again(run_dir, False, launcher)}"
        )
    if info.get("left"):  # an elastic facility: it rejoins the federation from its checkpoint
        saved = info["checkpoint"] or f"none at this step (the last: {info['last_checkpoint']})"
        return (
            f"{info['left']} at step {info['step']} of {info['steps']} ({info['signal']}): checkpoint saved to "
            f"{saved}; rejoin with: {_again(run_dir, True, launcher)}"
        )
    if info.get("checkpoint"):
        return f"{head}: checkpoint saved to {info['checkpoint']}; resume with: {_again(run_dir, True, launcher)}"
    if info.get("last_checkpoint"):
        return (
            f"{head}: no checkpoint at this step (the next round boundary was more than a few seconds away); "
            f"last complete checkpoint: {info['last_checkpoint']}; resume with: {_again(run_dir, True, launcher)}"
        )
    return f"{head}: no checkpoint was written; start again with: {_again(run_dir, False, launcher)}"


def _abort(job: JobConfig, run_dir: Path) -> Callable[[int], None]:
    """What the launcher does on a second SIGINT/SIGTERM, once the workers are killed: remove the
    temporaries of a checkpoint being written and say what is left, in one line."""

    def abort(signum: int) -> None:
        from .checkpoint import checkpoint_dir
        from .checkpoint.store import remove_stale
        from .distributed.signals import signal_name

        remove_stale(checkpoint_dir(job.checkpoint, run_dir))
        print(
            f"interrupted again ({signal_name(signum)}): stopped at once{_last_checkpoint(job, run_dir)}",
            file=sys.stderr,
            flush=True,
        )

    return abort


def resolve(cfg: DictConfig) -> dict:
    """The plain, resolved config (no Hydra node) that validation reads and the run directory keeps."""
    if "hydra" in cfg:  # composed with return_hydra_config: Hydra's node is not the job's
        cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def choices(cfg: DictConfig) -> dict | None:
    """Hydra's group -> option of this composition (from ``cfg.hydra`` or the running Hydra app)."""
    from hydra.core.hydra_config import HydraConfig

    if "hydra" in cfg:
        return OmegaConf.to_container(cfg.hydra.runtime.choices)
    return dict(HydraConfig.get().runtime.choices) if HydraConfig.initialized() else None


def _save_config(job: JobConfig, run_dir: Path) -> Path:
    """Write the job's resolved config: ``config.yaml``, or for a resumed attempt ``config.resume-<n>.yaml``
    beside it (the original run's files are never rewritten); the path written."""
    target = run_dir / "config.yaml"
    if job.resume is not None and target.exists():
        n = 1
        while (run_dir / f"config.resume-{n}.yaml").exists():
            n += 1
        target = run_dir / f"config.resume-{n}.yaml"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(as_plain(job)), target)
    except OSError as exc:
        raise JobFailed(
            f"cannot write {target}: {exc.strerror or exc}; free space or choose another run directory"
        ) from None
    return target


# ----------------------------------------------------------------------------- one job per run directory
LOCK_FILE = ".lock"
_HELD: dict[Path, int] = {}  # run dir -> the open, flock'ed descriptor (held until this process ends)


def _lock_owner(fd: int) -> str:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "an unknown process"


def lock_run_dir(run_dir: Path) -> None:
    """Take ``<run_dir>/.lock`` (``fcntl.flock``, exclusive) for the rest of this process's life and record
    ``pid <pid> on <host> since <time>`` in it; :class:`JobFailed` naming the owner when another job holds it.
    The OS releases the lock when its owner dies: a leftover ``.lock`` file blocks nothing."""
    import fcntl
    import socket

    run_dir = Path(run_dir).absolute()
    path = run_dir / LOCK_FILE
    if run_dir in _HELD:  # this process holds it already (several jobs in one process), if it is the same file
        try:
            if os.fstat(_HELD[run_dir]).st_ino == os.stat(path).st_ino:
                return
        except OSError:
            pass
        os.close(_HELD.pop(run_dir))
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise JobFailed(f"cannot create {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        owner = _lock_owner(fd)
        os.close(fd)
        raise JobFailed(
            f"{run_dir} is in use by another job ({owner}; {path} is locked): wait for it to end or "
            f"stop it, or use another run directory (a lock whose owner died is released by the OS)"
        ) from None
    try:  # the owner's line: best effort (a full disk must not hide the job's real error)
        os.ftruncate(fd, 0)
        os.pwrite(
            fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0
        )
    except OSError:
        pass
    _HELD[run_dir] = fd


def _refuse_if_in_use(resume: str | None) -> None:
    """A failed resume of a directory another job holds: say that instead (its checkpoints are in flux)."""
    if not resume or resume == "latest":
        return
    import fcntl

    path = Path(resume).expanduser().absolute()
    for candidate in (path, path.parent, path.parent.parent):
        lock = candidate / LOCK_FILE
        if candidate in _HELD or not lock.is_file():
            continue
        try:  # a probe only: read-only, nothing written
            fd = os.open(lock, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            raise JobFailed(
                f"{candidate} is in use by another job ({_lock_owner(fd)}; {lock} is locked): wait "
                f"for it to end or stop it (a lock whose owner died is released by the OS)"
            ) from None
        finally:
            os.close(fd)


def typed_config(plain: dict, choices: dict | None = None) -> JobConfig:
    """The one typed :class:`JobConfig` of the resolved ``plain`` dict (keys checked, values not yet:
    :func:`~xffl_like.config.validate.validate_config` does that)."""
    return job_config(plain, choices)  # a key the schema lacks: ConfigError


def prepare_durability(job: JobConfig, layout, run_dir: Path) -> tuple[JobConfig, Path]:
    """Resolve ``resume`` (the run directory then becomes the resumed run's, and the job points at the
    checkpoint) and check that the run and checkpoint directories are writable; the job and its run directory."""
    from .checkpoint.resume import check_writable, resolve_resume, resumed

    try:
        target = resolve_resume(job, layout, outputs=run_dir.parent, current_run_dir=run_dir)
        if target is not None:
            job, run_dir = resumed(job, target), target.run_dir
        check_writable(run_dir, "run directory")
        if job.checkpoint.dir:
            check_writable(Path(job.checkpoint.dir), "checkpoint.dir")
    except ValueError as exc:
        _refuse_if_in_use(job.resume)
        raise JobFailed(str(exc)) from None
    lock_run_dir(run_dir)  # held by this (launching) process for the job's life; a second job is refused
    return job, run_dir


def _drop_if_empty(fresh: Path) -> None:
    # Resuming continues in the old run directory: drop the one Hydra just made (only .hydra/ in it).
    import shutil

    if fresh.is_dir() and {p.name for p in fresh.iterdir()} <= {".hydra"}:
        shutil.rmtree(fresh, ignore_errors=True)


def run_local(cfg: DictConfig, run_dir: Path, worker: Callable | None = None) -> dict:
    """Validate, then run ``nproc_per_node`` local workers; return rank 0's summary."""
    started = time.time()
    try:
        job = typed_config(resolve(cfg), choices(cfg))
        nproc = job.distributed.nproc_per_node
        job, layout = validate_config(job, nproc, nproc, Path.cwd())
    except ConfigError as exc:
        raise JobFailed(str(exc)) from None
    # The workers' imports run while this process prepares the run directory; first, while this process has
    # one thread (before _admit's gRPC channel): the server may then be forked from it (.distributed.fork_server).
    start_fork_server(from_here=True)
    device_notice(job, nproc)
    _admit(job)  # a facility of the hub's federation: the hub answers, admits its identity, the model matches
    fresh = run_dir
    job, run_dir = prepare_durability(job, layout, run_dir)
    if run_dir != fresh:
        _drop_if_empty(fresh)
    _save_config(job, run_dir)
    try:
        results = launch_local(
            worker or _train_worker,
            (job, str(run_dir), started, worker_plan(job, layout)),
            nproc,
            error_dir=run_dir / "errors",
            max_restarts=job.distributed.max_restarts,
            on_abort=_abort(job, run_dir),
        )
    except WorkerFailure as exc:
        if exc.interrupted:  # a signal reached the workers before their loop could honour it
            from .distributed.signals import exit_code, signal_name

            raise JobInterrupted(
                f"interrupted ({signal_name(exc.interrupted)}) before training could stop at a "
                f"step{_last_checkpoint(job, run_dir)}",
                exit_code(exc.interrupted),
            ) from None
        where = f" (traceback: {exc.details})" if exc.details else ""
        raise JobFailed(f"{exc}{where}{_last_checkpoint(job, run_dir)}") from None
    if isinstance(results[0], dict) and "interrupted" in results[0]:
        import signal

        info = results[0]["interrupted"]
        raise JobInterrupted(interrupted_line(info), stop_exit_code(signal.Signals[info["signal"]], info.get("left")))
    return results[0]


def _admit(job: JobConfig) -> None:
    """A facility of the hub's federation, before workers start: the hub answers, admits its identity (its
    certificate's name, not revoked, not in use) and matches its description (one line if refused)."""
    e = job.federation.elastic
    if not e.enabled:
        return
    from .federation.elastic import ElasticError, facility_name
    from .hub.client import hub_link

    link = hub_link(job, facility_name(e), job.distributed.nproc_per_node)
    try:
        link.probe()
    except ElasticError as exc:
        raise JobFailed(str(exc)) from None
    finally:
        link.channel.close()


def _train_worker(*args):
    # By name: this process never imports the training loop (its workers' fork server does).
    from .train.loop import train_worker

    return train_worker(*args)


def _last_checkpoint(job: JobConfig, run_dir: Path) -> str:
    """What a failed job leaves to resume from, for its one error line: the newest intact checkpoint
    (``.metadata`` parses, every shard file it names is there), never a damaged one."""
    from .checkpoint import checkpoint_dir
    from .checkpoint.store import latest_checkpoint, newest_intact

    ckpt_dir = checkpoint_dir(job.checkpoint, run_dir)
    last = newest_intact(ckpt_dir)
    if last is None:
        return "; no checkpoint was completed"
    # The run directory resumes from the checkpoint ``latest`` names: if that one is damaged, name the intact one.
    resume = run_dir if latest_checkpoint(ckpt_dir) == last else last
    return f"; last complete checkpoint: {last} (resume={resume})"


def _compose(overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


def _torchrun_run_dir(experiment: str) -> Path:
    """``$XFFL_RUN_DIR``, else a new ``outputs/<experiment>/<stamp>-torchrun``; after an elastic
    restart (torchrun ``--max-restarts``) the directory of the first attempt, found by run id."""
    if os.environ.get("XFFL_RUN_DIR"):
        return Path(os.environ["XFFL_RUN_DIR"]).resolve()
    outputs = Path("outputs") / experiment
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 and outputs.is_dir():
        for run in sorted(outputs.glob("*-torchrun"), reverse=True):
            marker = run / ".torchelastic_run_id"
            if marker.is_file() and marker.read_text().strip() == run_id:
                return run.resolve()
    run_dir = (outputs / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}-torchrun").resolve()
    if run_id:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / ".torchelastic_run_id").write_text(run_id + "\n")
    return run_dir


def _one_line(exc: BaseException) -> str:
    return compose_error(exc) or (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def configured_backend(overrides: list[str], local_world_size: int = 1) -> str:
    """The backend (``gloo`` or ``nccl``) of the job ``overrides`` compose to with ``local_world_size``
    processes on this node, read before the default group exists (every rank composes; Hydra reads only
    files): :func:`~xffl_like.distributed.device.choose_backend`'s. ``auto``'s choice where the config does not
    compose or names a backend this node cannot run (``nccl`` without a GPU per process): rank 0 then refuses
    the job in one line once the group exists, as for any bad config."""
    from .distributed.device import choose_backend

    try:
        backend = str(OmegaConf.select(_compose(overrides), "distributed.backend", default="auto"))
        return choose_backend(backend, local_world_size).backend
    except Exception:  # noqa: BLE001 - reported by rank 0's validation
        return choose_backend("auto", local_world_size).backend


def device_notice(job: JobConfig, local_world_size: int) -> None:
    """Print :func:`~xffl_like.distributed.device.choose_backend`'s notice, if any (one line, stderr): what
    ``distributed.backend=auto`` chose instead of the GPUs, and how to change it. Once per job: the launching
    process, or rank 0 under a launcher."""
    from .distributed.device import choose_backend

    notice = choose_backend(job.distributed.backend, local_world_size).notice
    if notice:
        print(notice, file=sys.stderr, flush=True)


def _validate_here(overrides: list[str], env):
    """Compose, validate and resolve ``resume``; the validated job, the run directory and the workers' plan."""
    composed = _compose(overrides)
    job = typed_config(resolve(composed), choices(composed))
    job, layout = validate_config(job, env.world_size, env.local_world_size, Path.cwd())
    if env.rank != 0:
        return job, Path("."), None
    job, run_dir = prepare_durability(job, layout, _torchrun_run_dir(job.experiment))
    return job, run_dir, worker_plan(job, layout)


#: Seconds at the rendezvous before a process says what it waits for (a stale RANK/WORLD_SIZE, a missing peer).
WAIT_NOTICE_S = 5.0

_VARIABLES = {
    "torchrun": "RANK WORLD_SIZE MASTER_ADDR MASTER_PORT",
    "slurm": "SLURM_PROCID SLURM_NTASKS",
    "mpi": "OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE PMI_RANK PMI_SIZE",
}


def _unset_hint(env) -> str:
    names = _VARIABLES.get(env.launcher, _VARIABLES["torchrun"])
    return (
        f"if you did not start this under torchrun/srun/mpirun, unset {names} "
        f"(they are left over from another job) and run it again"
    )


def _set_variables(env) -> str:
    if env.launcher == "torchrun":
        return f"RANK={os.environ.get('RANK')} WORLD_SIZE={os.environ.get('WORLD_SIZE')} are set"
    return f"this is rank {env.rank} of {env.world_size} by {env.launcher}'s variables"


def _waiting_notice(env):
    """A context: after :data:`WAIT_NOTICE_S` seconds still at the rendezvous, print once what this
    process waits for and which variables to unset if they are stale."""
    import contextlib
    import threading

    others = env.world_size - 1
    line = (
        f"waiting for {others} more process{'es' if others != 1 else ''} at {env.master_addr}:{env.master_port} "
        f"({_set_variables(env)}: {_unset_hint(env)})"
    )
    timer = threading.Timer(WAIT_NOTICE_S, lambda: print(line, file=sys.stderr, flush=True))
    timer.daemon = True

    @contextlib.contextmanager
    def notice():
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    return notice()


def _port_in_use(exc: BaseException) -> bool:
    import errno

    return getattr(exc, "errno", None) == errno.EADDRINUSE or "address already in use" in str(exc).lower()


def _finalize_mpi_last() -> None:
    """atexit under an MPI launcher, while the interpreter is whole: torch's process groups first
    (destroyed, dropped, their gloo threads joined: :func:`~xffl_like.parallel.runtime.release_process_groups`),
    then MPI. mpi4py would finalize MPI itself only at the very end of interpreter teardown (``Py_AtExit``),
    after whatever groups teardown frees, in whatever order, and a gloo thread aborting there (see
    ``parallel.runtime``) makes mpiexec fail a job that had finished."""
    from .parallel.runtime import release_process_groups

    release_process_groups()
    mpi = sys.modules.get("mpi4py.MPI")  # never imported here: only where the rendezvous or the transport used it
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


def _rendezvous_env():
    """This process's environment with a rendezvous address, or ``None`` once the reason is printed."""
    from .distributed.env import agree_rendezvous
    from .distributed.state import read_env

    env = read_env()
    if env.launcher == "mpi":  # registered after train.loop's import, so it runs before parallel.runtime's hook
        import atexit

        atexit.register(_finalize_mpi_last)
    try:
        env = agree_rendezvous(env)  # under mpirun: MPI agrees on MASTER_ADDR/MASTER_PORT
    except (ValueError, ImportError) as exc:  # e.g. no mpi4py: the line names the extra to install
        if env.rank == 0:
            print(f"error: {exc} (or set MASTER_ADDR and MASTER_PORT)", file=sys.stderr)
        return None
    if env.master_addr is None or env.master_port is None:
        print(
            "error: RANK/WORLD_SIZE (or SLURM_PROCID/SLURM_NTASKS) are set but MASTER_ADDR/MASTER_PORT are not: "
            "unset them to let the job launch its own workers, or start it under torchrun/srun with a "
            "rendezvous address",
            file=sys.stderr,
        )
        return None
    return env


def _join_world(overrides: list[str], env) -> bool:
    """Validate on the first process of every other node, then make the default group; false once the
    reason is printed."""
    from .distributed.state import init_default_group

    if env.local_rank == 0 and env.rank != 0:
        try:
            _validate_here(overrides, env)
        except Exception as exc:  # noqa: BLE001 - one line, before anyone waits on us
            print(f"error: {_one_line(exc)}", file=sys.stderr)
            return False
    # The default group gets exactly the configured backend: made ``cpu:gloo,cuda:nccl`` on a GPU node
    # for a gloo job, its gloo-only subgroups would make NCCL splits on non-members (pytorch#145376).
    # build_state applies distributed.timeout_s to this group once rank 0 has shared the config.
    try:
        with _waiting_notice(env):
            init_default_group(env, configured_backend(overrides, env.local_world_size))
    except (OSError, RuntimeError) as exc:
        if not _port_in_use(exc):
            raise
        print(
            f"error: MASTER_PORT={env.master_port} is in use: another job (or a leftover launcher) listens on "
            f"{env.master_addr}:{env.master_port}; choose a free MASTER_PORT, or {_unset_hint(env)}",
            file=sys.stderr,
            flush=True,
        )
        return False
    return True


def _shared_config(overrides: list[str], env):
    """Rank 0 validates and admits the job and saves its config; every rank gets ``(job, run_dir, plan)``,
    or ``None`` once rank 0 has printed why the job is off (the process group is then destroyed)."""
    import torch.distributed as dist

    payload: list = [None]
    if env.rank == 0:
        try:
            job, run_dir, plan = _validate_here(overrides, env)
            device_notice(job, env.local_world_size)
            _admit(job)
            _save_config(job, run_dir)
            payload = [(job, str(run_dir), plan, None)]
        except Exception as exc:  # noqa: BLE001 - every rank must learn that the job is off
            payload = [(None, None, None, _one_line(exc))]
    dist.broadcast_object_list(payload, src=0)
    job, run_dir, plan, error = payload[0]
    if error is not None:
        if env.rank == 0:
            print(f"error: {error}", file=sys.stderr)
        dist.destroy_process_group()
        return None
    return job, run_dir, plan


def run_under_launcher(overrides: list[str]) -> int:
    """torchrun/srun/mpirun path: rank 0 composes and validates, every rank trains.

    The first process of every node validates the config before joining the rendezvous:
    in a job spanning sites, the site with a typo fails at once instead of leaving the
    others waiting for it.
    """
    import signal

    from .distributed.signals import die_with_parent, install_stop_handlers, stopped_by
    from .train.loop import train_worker

    started = time.time()
    die_with_parent()  # torchrun's, srun's or mpirun's process: when it dies, so does this one
    # Until the rendezvous is done a signal ends the process at once (a wait in C++ would not see a handler).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    env = _rendezvous_env()
    if env is None or not _join_world(overrides, env):
        return 2
    install_stop_handlers()  # from now on SIGINT/SIGTERM stop the loop at the next step boundary
    shared = _shared_config(overrides, env)
    if shared is None:
        return 2
    job, run_dir, plan = shared
    try:
        result = train_worker(job, run_dir, started, plan)
    except Exception as exc:  # noqa: BLE001 - one line per failing rank, not a traceback
        print(f"error: rank {env.rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if stopped_by() is not None and isinstance(result, dict) and "interrupted" in result:
        print(interrupted_line(result["interrupted"], launcher="<your launcher>"), file=sys.stderr, flush=True)
    if stopped_by() is not None and (result is None or "interrupted" in result):
        return stop_exit_code(stopped_by(), job.federation.elastic.enabled)
    return 0
