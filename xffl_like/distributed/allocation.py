"""What one job asks of a scheduler, from its ``distributed.*``: processes, nodes, the partition's limit.

A sweep point launched as its own Slurm job (``hydra/launcher=slurm``, see
``conf/hydra/launcher/``) is sized from the point's own config by two OmegaConf resolvers,
registered when this module is imported:

- ``${xffl.world:${distributed.federated},${distributed.nproc_per_node}}``: the job's process
  count, the sum of the facility sizes when ``distributed.federated`` is a list, else
  ``distributed.nproc_per_node`` (the count a local run launches);
- ``${xffl.nodes:<federated>,<nproc_per_node>,<processes_per_node>}``: the nodes that hold that
  many processes at ``processes_per_node`` per node (one torchrun per node starts them).

:func:`partition_node_limit` reads the most nodes one job may have from ``sinfo``, so that a
sweep whose points ask for more is refused before anything is submitted.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from typing import Any

from omegaconf import OmegaConf

from ..config.checks import is_int

__all__ = ["world_size", "num_nodes", "partition_node_limit", "register_resolvers"]


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def world_size(federated: Any, nproc_per_node: Any) -> int:
    """The job's process count: ``sum(federated)`` for a list of facility sizes, else ``nproc_per_node``."""
    federated = _plain(federated)
    if isinstance(federated, (list, tuple)):
        if not federated or not all(is_int(n) and n > 0 for n in federated):
            raise ValueError(f"distributed.federated={federated}: facility sizes must be positive integers, e.g. [8,4]")
        return sum(federated)
    if not (is_int(nproc_per_node) and nproc_per_node > 0):
        raise ValueError(
            f"distributed.nproc_per_node={nproc_per_node!r}: must be a positive integer (the job's "
            f"process count when distributed.federated is not a list)"
        )
    return nproc_per_node


def num_nodes(federated: Any, nproc_per_node: Any, processes_per_node: Any) -> int:
    """Nodes for :func:`world_size` processes at ``processes_per_node`` each (every node runs as many)."""
    world = world_size(federated, nproc_per_node)
    if not (is_int(processes_per_node) and processes_per_node > 0):
        raise ValueError(
            f"hydra.launcher.processes_per_node={processes_per_node!r}: must be a positive integer "
            f"(processes per node, one per GPU)"
        )
    if world % processes_per_node:
        raise ValueError(
            f"distributed.federated={_plain(federated)} makes {world} processes, not a multiple of "
            f"hydra.launcher.processes_per_node={processes_per_node}: every node runs as many; choose "
            f"facility sizes that fill whole nodes, or fewer processes per node"
        )
    return world // processes_per_node


def register_resolvers() -> None:
    """``xffl.world`` and ``xffl.nodes`` (idempotent)."""
    for name, fn in (("xffl.world", world_size), ("xffl.nodes", num_nodes)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def _max_job_nodes(job_size: str) -> int | None:
    """sinfo's ``%s`` (``1-4``, ``1-infinite``, ``4``): the most nodes of one job, None when unlimited."""
    top = job_size.rpartition("-")[2].strip()
    return int(top) if top.isdigit() else None


def partition_node_limit(
    partition: str | None, run: Callable[..., subprocess.CompletedProcess] = subprocess.run
) -> tuple[int, str] | None:
    """The most nodes one job may have in ``partition`` (None: the default partition) and where that
    number comes from; None when ``sinfo`` is absent or cannot tell (then nothing is checked)."""
    if shutil.which("sinfo") is None and run is subprocess.run:
        return None
    cmd = ["sinfo", "--noheader", "--format=%P|%s|%D"] + ([f"--partition={partition}"] if partition else [])
    try:
        proc = run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    total, job_max, name = 0, None, partition
    for line in proc.stdout.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 3 or not fields[2].strip().isdigit():
            continue
        part = fields[0].strip()
        if partition is None and not part.endswith("*"):  # the default partition carries a '*'
            continue
        name = part.rstrip("*")
        total += int(fields[2])
        job_max = _max_job_nodes(fields[1])
    if not total:
        return None
    if job_max is not None and job_max < total:
        return job_max, f"partition {name} allows at most {job_max} nodes per job (sinfo)"
    return total, f"partition {name} has {total} nodes (sinfo)"


register_resolvers()
