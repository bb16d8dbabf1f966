"""Backend-agnostic collectives: the same call over ``torch.distributed`` or MPI.

Every function takes ``backend`` (``"torch"`` or ``"mpi"``) and ``group`` (a torch
ProcessGroup or an MPI communicator; ``None`` is the whole world). Ranks passed in
(``src``, ``dst``) are ranks *within* ``group``. The MPI paths round-trip through host
memory and copy the result back into the tensor on its own device.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.distributed as dist

from .backends import as_bytes, check_backend, get_mpi, mpi_group, to_host_contiguous

__all__ = ["OPS", "get_rank", "get_world_size", "barrier", "all_reduce", "all_gather", "broadcast", "gather_varlen"]

OPS = ("SUM", "MAX", "MIN", "AVG")
_TORCH_OPS = {"SUM": dist.ReduceOp.SUM, "MAX": dist.ReduceOp.MAX, "MIN": dist.ReduceOp.MIN}
# numpy (hence MPI) has no bfloat16 and MPI reductions over float16 are not portable:
# such tensors are reduced in float32 on the host and cast back.
_WIDEN = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.bool: torch.uint8}


def get_rank(backend: str = "torch", group: Any = None) -> int:
    """This process's rank in ``group``."""
    if check_backend(backend) == "torch":
        return dist.get_rank(group)
    return mpi_group(group).Get_rank()


def get_world_size(backend: str = "torch", group: Any = None) -> int:
    """Number of processes in ``group``."""
    if check_backend(backend) == "torch":
        return dist.get_world_size(group)
    return mpi_group(group).Get_size()


def barrier(backend: str = "torch", group: Any = None) -> None:
    """Block until every process of ``group`` has called it."""
    if check_backend(backend) == "torch":
        dist.barrier(group)
    else:
        mpi_group(group).Barrier()


def _check_op(op: str) -> str:
    name = str(op).upper()
    if name not in OPS:
        raise ValueError(f"unknown reduction op {op!r}: valid ops are {', '.join(OPS)}")
    return name


def all_reduce(tensor: torch.Tensor, op: str = "SUM", backend: str = "torch", group: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` in place with ``op`` (SUM, MAX, MIN or AVG); returns it.

    AVG is the sum divided by the group size and needs a floating-point tensor. On gloo
    (no AVG) and on MPI it is computed as exactly that.
    """
    check_backend(backend)
    op = _check_op(op)
    if op == "AVG" and not tensor.is_floating_point():
        raise ValueError(f"all_reduce op AVG needs a floating-point tensor, got {tensor.dtype}")
    if backend == "torch":
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        if op == "AVG" and dist.get_backend(group) == "nccl":
            dist.all_reduce(work, op=dist.ReduceOp.AVG, group=group)
        else:
            dist.all_reduce(work, op=_TORCH_OPS["SUM" if op == "AVG" else op], group=group)
            if op == "AVG":
                work.div_(dist.get_world_size(group))
        if work is not tensor:
            tensor.copy_(work)
        return tensor
    MPI = get_mpi()
    comm = mpi_group(group)
    wide = _WIDEN.get(tensor.dtype, tensor.dtype)
    host = to_host_contiguous(tensor) if wide == tensor.dtype else tensor.detach().to("cpu", wide).contiguous()
    mpi_op = {"SUM": MPI.SUM, "AVG": MPI.SUM, "MAX": MPI.MAX, "MIN": MPI.MIN}[op]
    comm.Allreduce(MPI.IN_PLACE, host.numpy(), op=mpi_op)
    if op == "AVG":
        host.div_(comm.Get_size())
    if host.data_ptr() != tensor.data_ptr():
        tensor.copy_(host)
    return tensor


def _check_like(tensors: list[torch.Tensor], like: torch.Tensor, what: str) -> None:
    for i, t in enumerate(tensors):
        if t.shape != like.shape or t.dtype != like.dtype:
            raise ValueError(
                f"{what}[{i}] is {tuple(t.shape)} {t.dtype}, the local tensor {tuple(like.shape)} {like.dtype}: "
                "they must match"
            )


def all_gather(
    output_list: list[torch.Tensor], tensor: torch.Tensor, backend: str = "torch", group: Any = None
) -> None:
    """Fill ``output_list[r]`` with rank ``r``'s ``tensor`` (same shape and dtype everywhere)."""
    check_backend(backend)
    size = get_world_size(backend, group)
    if len(output_list) != size:
        raise ValueError(f"all_gather needs one output tensor per rank: got {len(output_list)} for {size} ranks")
    _check_like(output_list, tensor, "output_list")
    if backend == "torch":
        dist.all_gather(output_list, tensor.contiguous(), group=group)
        return
    send = to_host_contiguous(as_bytes(tensor))
    recv = torch.empty(size * send.numel(), dtype=torch.uint8)
    mpi_group(group).Allgather(send.numpy(), recv.numpy())
    for out, part in zip(output_list, recv.view(size, -1)):
        out.copy_(part.view(tensor.dtype).view(tensor.shape))


def broadcast(tensor: torch.Tensor, src: int, backend: str = "torch", group: Any = None) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with rank ``src``'s (``src`` is a rank in ``group``)."""
    if check_backend(backend) == "torch":
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        dist.broadcast(work, group=group, group_src=src)
        if work is not tensor:
            tensor.copy_(work)
        return tensor
    host = to_host_contiguous(as_bytes(tensor))
    mpi_group(group).Bcast(host.numpy(), root=src)
    if host.data_ptr() != tensor.data_ptr():
        tensor.copy_(host.view(tensor.dtype).view(tensor.shape))
    return tensor


def gather_varlen(
    local_tensor: torch.Tensor, dst: int = 0, backend: str = "torch", group: Any = None
) -> torch.Tensor | None:
    """Concatenate every rank's rows (dim 0, any length, possibly none) on ``dst``, in rank order.

    Trailing dimensions and dtype must agree across ranks (checked on every rank, so all
    raise the same ``ValueError``). Returns the concatenation on ``dst`` (on
    ``local_tensor``'s device), ``None`` elsewhere.
    """
    check_backend(backend)
    t = local_tensor.detach().contiguous()
    if t.dim() == 0:
        t = t.view(1)
    meta = (t.shape[0], tuple(t.shape[1:]), str(t.dtype))
    if backend == "torch":
        metas: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(metas, meta, group=group)
    else:
        metas = mpi_group(group).allgather(meta)
    if len({(m[1], m[2]) for m in metas}) > 1:
        shown = ", ".join(f"rank {r}: {m[1]} {m[2]}" for r, m in enumerate(metas))
        raise ValueError(f"gather_varlen needs the same trailing shape and dtype on every rank, got {shown}")
    rows = [m[0] for m in metas]
    me = get_rank(backend, group)
    if backend == "torch":
        # gloo and nccl gather equal sizes only: pad every rank's rows to the longest.
        longest = max(rows)
        padded = torch.zeros((longest, *t.shape[1:]), dtype=t.dtype, device=t.device)
        padded[: t.shape[0]] = t
        parts = [torch.empty_like(padded) for _ in rows] if me == dst else None
        dist.gather(padded, parts, group=group, group_dst=dst)
        return torch.cat([p[:n] for p, n in zip(parts, rows)]) if me == dst else None
    MPI = get_mpi()
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    counts = [n * row_bytes for n in rows]
    displs = [0, *itertools.accumulate(counts)][:-1]
    send = to_host_contiguous(as_bytes(t))
    recv = torch.empty(sum(counts), dtype=torch.uint8) if me == dst else None
    mpi_group(group).Gatherv(send.numpy(), [recv.numpy(), counts, displs, MPI.BYTE] if me == dst else None, root=dst)
    if me != dst:
        return None
    out = recv.view(t.dtype).view(sum(rows), *t.shape[1:])
    return out.to(local_tensor.device)
