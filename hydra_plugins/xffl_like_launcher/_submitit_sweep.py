"""Sweep points as their own jobs through submitit: ``hydra/launcher=slurm`` (one Slurm batch job per
point, sized from the point's own ``distributed.*``) and ``hydra/launcher=local_submitit`` (the same
on this machine: a laptop, CI).

Every point runs the worker path of ``workflows/slurm/``: one task per node (``srun`` starts them),
each runs ``torchrun --nproc-per-node <processes_per_node>`` on a static rendezvous at the first
node, and torchrun's workers are ``python -m xffl_like.run <the point's overrides>``: rank 0 composes
and validates and writes the run into the point's directory inside the sweep directory
(``XFFL_RUN_DIR``). The first node's task runs that as Hydra's job (the point's ``.hydra/``, the
sweep-summary callback, ``error.txt`` for a failed point), so the sweep summary is the same as for
a sweep run one job after another.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides, run_job, setup_globals
from omegaconf import DictConfig, OmegaConf, open_dict

from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, LocalQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from xffl_like.distributed.allocation import partition_node_limit  # also registers ${xffl.world}, ${xffl.nodes}

log = logging.getLogger(__name__)

#: Launcher keys of ours, not submitit's.
OWN_KEYS = ("processes_per_node", "max_nodes")
_INIT_KEYS = ("submitit_folder", "max_num_timeout")


@dataclass
class SlurmSweepConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.xffl_like_launcher._submitit_sweep.SlurmSweepLauncher"
    processes_per_node: int = 1  # torchrun --nproc-per-node on every node: one process per GPU
    max_nodes: int | None = None  # most nodes per job when sinfo cannot tell (null: ask sinfo)


@dataclass
class LocalSweepConf(LocalQueueConf):
    _target_: str = "hydra_plugins.xffl_like_launcher._submitit_sweep.LocalSweepLauncher"
    processes_per_node: int = 1
    max_nodes: int | None = None  # unused here (one node)


ConfigStore.instance().store(
    group="hydra/launcher", name="xffl_slurm_schema", node=SlurmSweepConf, provider="xffl_like"
)
ConfigStore.instance().store(
    group="hydra/launcher", name="xffl_local_schema", node=LocalSweepConf, provider="xffl_like"
)


class SweepRefused(Exception):
    """A sweep that cannot be submitted as it stands (one line: the points, the problem, the fix)."""


def executor_parameters(launcher: dict[str, Any], cluster: str) -> dict[str, Any]:
    """submitit's parameters for one point from its resolved ``hydra.launcher``: the shared keys as they
    are, the cluster's own keys with its prefix (``slurm_partition``), ours and the folder left out."""
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    skip = {"_target_", *OWN_KEYS, *_INIT_KEYS}
    return {(k if k in base else f"{cluster}_{k}"): v for k, v in launcher.items() if k not in skip}


def _cause(exc: BaseException) -> str:
    """A resolver's own message, without OmegaConf's wrapping."""
    text = str(exc).splitlines()[0]
    found = re.search(r"\w+ raised while resolving interpolation: (.*)", text)
    return found[1] if found else text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(
    overrides: Sequence[str],
    launcher: dict[str, Any],
    max_restarts: int,
    run_dir: Path | None,
    errors: list[str] | None = None,
) -> int:
    """This node's torchrun of the point; with ``errors``, its ``error:`` lines are collected too."""
    import submitit

    env = submitit.JobEnvironment()
    if env.num_nodes == 1:
        endpoint = f"127.0.0.1:{_free_port()}"
    else:  # every node derives the same port from the job id; the first node hosts the store
        endpoint = f"{env.hostnames[0]}:{20000 + int(re.sub(r'[^0-9]', '', env.job_id) or 0) % 20000}"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={env.num_nodes}",
        f"--nproc-per-node={launcher['processes_per_node']}",
        f"--node-rank={env.node}",
        "--rdzv-backend=static",
        f"--rdzv-endpoint={endpoint}",
        f"--max-restarts={max_restarts}",
        "-m",
        "xffl_like.run",
        *overrides,
    ]
    child_env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}
    if run_dir is not None:
        child_env["XFFL_RUN_DIR"] = str(run_dir)
    print(f"xffl: node {env.node} of {env.num_nodes}: {' '.join(cmd[1:])}", flush=True)
    # Its own session: a stop reaches the point from the sweep's process (which stops every point), never
    # half of it from the terminal.
    proc = subprocess.Popen(cmd, env=child_env, stderr=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
    assert proc.stderr is not None
    for line in proc.stderr:  # passed on as it comes (the task's log), error lines kept
        sys.stderr.write(line)
        if errors is not None and line.startswith("error: "):
            errors.append(line[len("error: ") :].strip())
    return proc.wait()


def _run_point(cfg: DictConfig) -> dict[str, Any]:
    """Hydra's task function on the first node: the point's torchrun, its result as the job's return."""
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    launcher = OmegaConf.to_container(hc.launcher, resolve=True)
    errors: list[str] = []
    code = _torchrun(_task_overrides(hc.overrides.task), launcher, cfg.distributed.max_restarts, run_dir, errors)
    if code == 0 and (run_dir / "summary.json").exists():
        return json.loads((run_dir / "summary.json").read_text())
    error = (
        errors[0] if errors else f"torchrun exited with status {code} (the point's log: {hc.launcher.submitit_folder})"
    )
    (run_dir / "error.txt").write_text(error + "\n")  # read by the sweep summary, as for a local sweep
    print(f"error: {error}", file=sys.stderr, flush=True)
    return {"status": "failed", "error": error}


def _task_overrides(overrides: Sequence[str]) -> list[str]:
    return [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]


class _SweepLauncher(BaseSubmititLauncher):
    """One submitit job per sweep point, with the point's own resources."""

    def __call__(
        self,
        sweep_overrides: list[str],
        job_dir_key: str,
        job_num: int,
        job_id: str,
        singleton_state: dict[type, Singleton],
    ) -> Any:
        import submitit

        assert self.hydra_context is not None and self.config is not None
        Singleton.set_state(singleton_state)
        setup_globals()
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, sweep_overrides)
        env = submitit.JobEnvironment()
        with open_dict(cfg.hydra.job) as job:
            job.id = env.job_id
            cfg.hydra.job.num = job_num
        if env.global_rank != 0:  # the other nodes: their torchrun only; the first node is Hydra's job
            launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
            return _torchrun(_task_overrides(cfg.hydra.overrides.task), launcher, cfg.distributed.max_restarts, None)
        return run_job(
            hydra_context=self.hydra_context,
            task_function=_run_point,
            config=cfg,
            job_dir_key=job_dir_key,
            job_subdir_key="hydra.sweep.subdir",
        )

    def point_launcher(self, overrides: Sequence[str]) -> dict[str, Any]:
        """The resolved ``hydra.launcher`` of the point with these overrides (sized from its ``distributed.*``)."""
        assert self.hydra_context is not None and self.config is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        return OmegaConf.to_container(cfg.hydra.launcher, resolve=True)

    def check(self, points: list[tuple]) -> None:
        """Refuse the sweep before anything is submitted (raise :class:`SweepRefused`)."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        assert self.config is not None
        points = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            try:
                points.append((idx, list(overrides), self.point_launcher(overrides)))
            except Exception as exc:  # noqa: BLE001 - a resolver's ValueError: one line naming the point
                _refuse(f"sweep point #{idx} ({_shown(overrides)}): {_cause(exc)}; nothing was submitted")
        try:
            self.check(points)
        except SweepRefused as exc:
            _refuse(str(exc))
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        init = {"folder": self.params["submitit_folder"]}
        if "max_num_timeout" in self.params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = self.params["max_num_timeout"]
        jobs: list = []
        with _stop_requests() as stop:
            try:
                executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
                log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
                for idx, overrides, launcher in points:
                    executor.update_parameters(**executor_parameters(launcher, self._EXECUTOR))
                    with _terminal_ignored():  # a point's processes hear a stop from here, not the terminal
                        job = executor.submit(
                            self, overrides, "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()
                        )
                    log.info(
                        f"\t#{idx} : {' '.join(filter_overrides(overrides))} -> job {job.job_id}: "
                        f"{launcher['nodes']} node(s) x {launcher['processes_per_node']} process(es)"
                    )
                    jobs.append(job)
                return [job.results()[0] for job in jobs]
            except KeyboardInterrupt:
                _stop_points(jobs, sweep_dir, stop.get("signum", signal.SIGINT), len(points))
            except RuntimeError as exc:  # submitit's: no Slurm here, sbatch refused the job
                _stop_points(jobs, sweep_dir, None, len(points))
                _refuse(f"hydra/launcher={self._NAME}: {str(exc).splitlines()[0]}; {len(jobs)} of {len(points)} "
                        f"point(s) were submitted (and are stopped)")  # fmt: skip


class _terminal_ignored:
    """SIGINT ignored while a point's processes start: they inherit it (a Ctrl-C in the terminal reaches the
    whole foreground process group), so only the sweep's process hears it and stops every point in order."""

    def __enter__(self):
        self.before = signal.signal(signal.SIGINT, signal.SIG_IGN)

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.before)


class _stop_requests:
    """While points run: SIGTERM (a scheduler, ``kill``) stops the sweep as Ctrl-C does (KeyboardInterrupt);
    the signal received is ``stop["signum"]``."""

    def __enter__(self) -> dict:
        self.stop: dict = {}

        def handler(signum, frame):
            self.stop["signum"] = signum
            raise KeyboardInterrupt

        self.before = signal.signal(signal.SIGTERM, handler)
        return self.stop

    def __exit__(self, *exc):
        signal.signal(signal.SIGTERM, self.before)


#: After a stop: seconds a point's processes have to end on SIGTERM (a checkpoint at a step) before SIGKILL.
STOP_GRACE_S = 5.0


def _stop_points(jobs: list, sweep_dir: Path, signum: int | None, total: int) -> None:
    """Stop every point still running (local: its processes, SIGTERM then SIGKILL after
    :data:`STOP_GRACE_S`; Slurm: scancel), write the summary of those that finished, and, for a signal, exit
    128 + the signal with one line."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop short
    pids = set()
    for job in jobs:
        process = getattr(job, "_process", None)  # a local job: its controller
        if process is not None:
            pids |= {process.pid, *_descendants(process.pid)}
        elif not job.done():
            job.cancel(check=False)
    _end(pids)
    from xffl_like.observe.sweep import write_sweep_summary

    rows = write_sweep_summary(sweep_dir, plot=False) if sweep_dir.is_dir() else []
    done = sum(1 for r in rows if r["status"] == "ok")
    if signum is not None:
        name = signal.Signals(signum).name
        print(
            f"interrupted ({name}): the sweep stopped; {done} of {total} point(s) had finished, the others were "
            f"stopped; summary: {sweep_dir / 'sweep_summary.md'}",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(128 + int(signum))


def _end(pids: set[int]) -> None:
    """SIGTERM to ``pids`` (and to the process group each leads), SIGKILL to what is left after the grace."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + (STOP_GRACE_S if sig == signal.SIGTERM else 2.0)
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap our own children
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (Linux: /proc; elsewhere none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _shown(overrides: Sequence[str]) -> str:
    return " ".join(o for o in overrides if "distributed." in o) or "defaults"


def _refuse(line: str) -> None:
    print(f"error: {line}", file=sys.stderr, flush=True)
    raise SystemExit(2)


class LocalSweepLauncher(_SweepLauncher):
    _EXECUTOR = "local"
    _NAME = "local_submitit"


class SlurmSweepLauncher(_SweepLauncher):
    _EXECUTOR = "slurm"
    _NAME = "slurm"

    def check(self, points: list[tuple]) -> None:
        """Slurm is here, and no point asks for more nodes than one job may have in its partition."""
        if shutil.which("sbatch") is None:
            raise SweepRefused(
                "hydra/launcher=slurm needs Slurm, and sbatch is not on PATH here: run the sweep on the cluster's "
                "login node, or hydra/launcher=local_submitit to run its points on this machine; nothing was submitted"
            )
        by_partition: dict[Any, list[tuple]] = {}
        for point in points:
            by_partition.setdefault((point[2].get("partition"), point[2].get("max_nodes")), []).append(point)
        for (partition, max_nodes), group in by_partition.items():
            limit = (
                (max_nodes, f"hydra.launcher.max_nodes={max_nodes}") if max_nodes else partition_node_limit(partition)
            )
            if limit is None:  # no sinfo here and no max_nodes: Slurm itself refuses at submission
                continue
            over = [f"#{idx} ({_shown(o)}: {p['nodes']} nodes)" for idx, o, p in group if p["nodes"] > limit[0]]
            if over:
                raise SweepRefused(
                    f"{len(over)} sweep point(s) ask for more nodes than {limit[1]}: {', '.join(over)}; nothing was "
                    f"submitted: make their distributed.federated smaller, raise hydra.launcher.processes_per_node, "
                    f"or choose another hydra.launcher.partition"
                )
