"""This process's GPU and the defaults a GPU process gets (used by the state and by the MPI launch)."""

from __future__ import annotations

import torch

__all__ = ["cuda_defaults", "cuda_device"]


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
