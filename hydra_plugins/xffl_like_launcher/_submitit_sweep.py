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
import socket
import subprocess
import sys
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
    proc = subprocess.Popen(cmd, env=child_env, stderr=subprocess.PIPE, text=True, bufsize=1)
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
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        jobs = []
        for idx, overrides, launcher in points:
            executor.update_parameters(**executor_parameters(launcher, self._EXECUTOR))
            job = executor.submit(self, overrides, "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state())
            log.info(
                f"\t#{idx} : {' '.join(filter_overrides(overrides))} -> job {job.job_id}: {launcher['nodes']} "
                f"node(s) x {launcher['processes_per_node']} process(es)"
            )
            jobs.append(job)
        return [job.results()[0] for job in jobs]


def _shown(overrides: Sequence[str]) -> str:
    return " ".join(o for o in overrides if "distributed." in o) or "defaults"


def _refuse(line: str) -> None:
    print(f"error: {line}", file=sys.stderr, flush=True)
    raise SystemExit(2)


class LocalSweepLauncher(_SweepLauncher):
    _EXECUTOR = "local"


class SlurmSweepLauncher(_SweepLauncher):
    _EXECUTOR = "slurm"

    def check(self, points: list[tuple]) -> None:
        """No point may ask for more nodes than one job may have in its partition."""
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
