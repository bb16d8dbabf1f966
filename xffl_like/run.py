"""``python -m xffl_like.run [+experiment=NAME] [overrides]``: the main job.

Started plainly it composes the config with Hydra, validates it, and launches
``distributed.nproc_per_node`` local workers. Under torchrun, srun or mpirun each process
is a worker: rank 0 composes and validates, then shares the config with the others.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from . import CONF_DIR
from .config.hydra_errors import compose_error
from .distributed.env import read_env, reports_launcher_errors
from .job import JobFailed, JobInterrupted, run_local


# An absolute path (package data): a relative one would be read as the module "conf" under the console script
@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def main(cfg: DictConfig) -> dict | None:
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    try:
        return run_local(cfg, run_dir)
    except JobInterrupted as exc:  # SIGINT/SIGTERM: one line, 130/143 (a sweep stops too)
        print(str(exc), file=sys.stderr, flush=True)
        sys.exit(exc.code)
    except JobFailed as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        if hc.mode == RunMode.MULTIRUN:  # one failed job must not stop the sweep
            (run_dir / "error.txt").write_text(f"{exc}\n")
            return {"status": "failed", "error": str(exc)}
        sys.exit(2)


def _launched() -> bool:
    try:
        return read_env() is not None
    except ValueError as exc:  # contradictory launcher variables: one line, before anything starts
        if reports_launcher_errors():  # once per job, not once per process
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


def _main_one_line() -> None:
    """``main`` with a composition error (unknown key, wrong type, no such option) as one line."""
    wants_trace = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing its own several-line report
    try:
        main()
    except Exception as exc:
        line = None if wants_trace else compose_error(exc)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr, flush=True)
        sys.exit(2)


def cli() -> None:
    """The ``xffl-run`` command (and ``python -m xffl_like.run``): a worker under torchrun/srun/mpirun,
    else the launcher."""
    if _launched():
        from .job import run_under_launcher

        sys.exit(run_under_launcher(sys.argv[1:]))
    try:
        _main_one_line()
    except KeyboardInterrupt:  # Ctrl-C before the workers started (after, launch.py forwards it)
        print("interrupted (SIGINT) before the workers started", file=sys.stderr, flush=True)
        sys.exit(130)


if __name__ == "__main__":
    cli()
