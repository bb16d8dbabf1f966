"""This process's GPU, the device and backend a job runs on, and the defaults a GPU process gets.

:func:`choose_backend` is the one place that turns ``distributed.backend`` (``auto | gloo | nccl``) and what
this node has (GPUs visible to the process, processes on the node, a per-task GPU binding by Slurm) into
the backend and device every rank uses: the launcher validates with it, and each worker initialises its
default group with it, so both make the same choice.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..config.errors import ConfigError

__all__ = ["DeviceChoice", "choose_backend", "cuda_defaults", "cuda_device", "gpus_bound_per_task", "visible_gpus"]


@dataclass(frozen=True)
class DeviceChoice:
    """The backend (``gloo`` or ``nccl``) and device type (``cpu`` or ``cuda``) of every rank on a node;
    ``notice``: one line saying what ``distributed.backend=auto`` chose instead of the GPUs, and how to change
    it (``None`` when nothing needs saying)."""

    backend: str
    device_type: str
    notice: str | None = None


def visible_gpus() -> int:
    """The CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpus_bound_per_task(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a Slurm task whose GPUs Slurm bound to it alone (``srun --gpus-per-task=N``:
    ``SLURM_GPUS_PER_TASK``, or ``gpu`` in ``SLURM_TRES_PER_TASK``, Slurm 23.11+). Each task then sees its
    own GPU(s) as ``cuda:0..``, so one visible GPU with 4 tasks on the node is 4 different GPUs. Only an srun
    task counts (``SLURM_PROCID`` set, torchrun's ``RANK`` not): workers this job launches itself inherit the
    variables of a batch script but share the GPUs its one process sees."""
    env = os.environ if environ is None else environ
    if env.get("RANK") or not env.get("SLURM_PROCID"):
        return False
    per_task = env.get("SLURM_GPUS_PER_TASK", "").strip()
    if per_task and per_task.split(":")[-1].isdigit() and int(per_task.split(":")[-1]) > 0:
        return True
    return "gpu" in env.get("SLURM_TRES_PER_TASK", "")


def choose_backend(
    requested: str, local_world_size: int, gpus: int | None = None, bound: bool | None = None
) -> DeviceChoice:
    """What ``distributed.backend=requested`` runs on with ``local_world_size`` processes on this node, ``gpus``
    visible to each (default: :func:`visible_gpus`), ``bound``: Slurm bound GPUs to each task (default:
    :func:`gpus_bound_per_task`). Raises :class:`~xffl_like.config.errors.ConfigError` (one line) for a job that
    cannot run.

    - ``gloo``: the CPU (a gloo job's tensors stay on the CPU).
    - ``nccl``: one GPU per process: as many visible GPUs as processes on the node, or one GPU per task bound
      by Slurm; otherwise refused (NCCL refuses two ranks on one GPU).
    - ``auto``: nccl, one GPU per process, where there are enough (or Slurm bound them); the CPU over gloo
      where there is no GPU; with fewer GPUs than processes (the main job's 4 processes on a one-GPU
      machine), the CPU over gloo too, with a notice: ranks sharing a GPU would need gloo collectives of
      host copies, slower than the CPU for the small models such a layout runs, and untested.
    """
    gpus = visible_gpus() if gpus is None else gpus
    bound = gpus_bound_per_task() if bound is None else bound
    enough = gpus >= 1 and (bound or gpus >= local_world_size)
    if requested == "gloo":
        return DeviceChoice("gloo", "cpu")
    if requested == "nccl":
        if gpus == 0:
            raise ConfigError(
                "distributed.backend=nccl needs CUDA GPUs, and torch sees none on this machine: "
                "use distributed.backend=auto (gloo on CPU)"
            )
        if not enough:
            raise ConfigError(
                f"distributed.backend=nccl needs one GPU per process: {local_world_size} processes on this node, "
                f"{gpus} GPU(s): lower distributed.nproc_per_node to {gpus}, give each srun task its GPU "
                f"(srun --gpus-per-task=1), or use distributed.backend=auto (the CPU over gloo)"
            )
        return DeviceChoice("nccl", "cuda")
    if requested != "auto":
        raise ConfigError(f"distributed.backend={requested!r}: use auto, gloo or nccl")
    if enough:
        return DeviceChoice("nccl", "cuda")
    if gpus == 0:
        return DeviceChoice("gloo", "cpu")
    return DeviceChoice(
        "gloo",
        "cpu",
        f"notice: {local_world_size} processes on this node but {gpus} GPU(s) (nccl needs one GPU per process): "
        f"running on the CPU over gloo; to train on the GPU use distributed.nproc_per_node={gpus} (with a layout "
        f"that fits), or set distributed.backend=gloo to choose the CPU without this notice",
    )


def cuda_device(local_rank: int) -> torch.device:
    """This process's GPU: ``local_rank`` modulo the GPUs it sees. Under ``srun --gpus-per-task=1``
    (or ``--gpu-bind``) each task sees one GPU, as ``cuda:0``, whatever its ``SLURM_LOCALID``."""
    count = torch.cuda.device_count()
    if count < 1:
        raise RuntimeError(
            "distributed.backend=nccl but this process sees no GPU: check CUDA_VISIBLE_DEVICES "
            "and the job's GPU binding, or use distributed.backend=gloo"
        )
    return torch.device("cuda", local_rank % count)


def cuda_defaults(device: torch.device) -> None:
    """Make ``device`` this process's GPU, and let fp32 matrix products use TF32 tensor cores
    (``torch.set_float32_matmul_precision("high")``) unless the user already chose a precision: the
    default ``train.dtype=float32`` otherwise runs the matmuls at full fp32 speed, several times slower."""
    torch.cuda.set_device(device)
    if torch.get_float32_matmul_precision() == "highest":  # torch's default: nobody asked for another
        torch.set_float32_matmul_precision("high")
