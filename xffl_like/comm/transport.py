"""Byte transport between two ranks over ``torch.distributed`` or MPI.

Any tensor travels as its raw bytes (reinterpreted as uint8, never cast), so every dtype
round-trips exactly; the receiver gets a flat uint8 tensor and views it as it knows.

Wire protocols (sender and receiver must use the same backend):

- ``torch``: a 1-element int64 tensor holding the payload's byte length on tag ``2*tag``,
  then the payload on tag ``2*tag + 1`` (also when it is empty). A plain
  ``torch.distributed.recv`` on those two tags reads what :func:`send` wrote.
- ``mpi``: one message on ``tag``; the receiver probes it for its size (a matched probe,
  so concurrent receivers cannot steal each other's message).

Ranks (``dst``, ``src``, the returned source) are ranks within ``group`` (the world when
``None``). The MPI paths stage device tensors through host memory.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from .backends import as_bytes, check_backend, get_mpi, handles_cpu, mpi_group, to_host_contiguous

__all__ = ["AsyncSendHandle", "AsyncRecvHandle", "send", "recv", "isend", "irecv_into"]


def _peer(group: Any, rank: int | None, role: str) -> dict:
    """torch.distributed's keyword for ``rank`` (``role`` "dst" or "src"): it takes global ranks
    as dst/src and group ranks as group_dst/group_src. Nothing for any source."""
    if rank is None:
        return {}
    return {role: rank} if group is None else {f"group_{role}": rank}


def _length(n: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([n], dtype=torch.int64, device=device)


class _Requests:
    """Outstanding torch works or MPI requests, polled without blocking.

    gloo marks a point-to-point work complete only inside ``wait()`` (and a timed-out wait
    closes the connection), so for CPU tensors (gloo's, also in a ``cpu:gloo,cuda:nccl`` group)
    a helper thread waits and :meth:`done` reads its flag. Decided by the tensors' ``device``, not
    by ``dist.get_backend``, which names both backends of a mixed group."""

    def __init__(self, backend: str, requests: list, device: torch.device | None = None):
        self.backend, self.requests = backend, requests
        self.error: BaseException | None = None
        self.thread = None
        if backend == "torch" and (device is None or torch.device(device).type == "cpu"):
            self.thread = threading.Thread(target=self._wait_all, daemon=True)
            self.thread.start()

    def _wait_all(self) -> None:
        try:
            for work in self.requests:
                work.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait() in the caller's thread
            self.error = exc

    def done(self) -> bool:
        if self.thread is not None:
            return not self.thread.is_alive()
        if self.backend == "torch":
            return all(work.is_completed() for work in self.requests)
        return all(req.Test() for req in self.requests)

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            if self.error is not None:
                raise self.error
        elif self.backend == "torch":
            for work in self.requests:
                work.wait()
        else:
            for req in self.requests:
                req.Wait()


class AsyncSendHandle:
    """A send in flight. It holds the buffers being sent until the send completes: poll
    :meth:`is_complete` or block in :meth:`wait`."""

    def __init__(self, requests: _Requests, buffers: tuple):
        self._request = requests
        self._buffer = buffers  # keeps the bytes alive while the backend reads them

    def is_complete(self) -> bool:
        """Whether the send has completed (non-blocking); the buffer is released once it has."""
        done = self._request.done()
        if done:
            self._request.wait()  # returns at once; raises a failed send's error
            self._buffer = None
        return done

    def wait(self) -> None:
        """Block until the send has completed, then release the buffer."""
        self._request.wait()
        self._buffer = None


class AsyncRecvHandle:
    """A receive into a given tensor in flight (see :func:`irecv_into`)."""

    def __init__(
        self, requests: _Requests, out: torch.Tensor, staged: torch.Tensor | None, length: torch.Tensor | None
    ):
        self._request = requests
        self._out, self._staged, self._length = out, staged, length

    def is_complete(self) -> bool:
        """Whether the data has arrived (non-blocking); :meth:`wait` then returns at once."""
        return self._request.done()

    def wait(self) -> torch.Tensor:
        """Block until the data has arrived in the tensor; returns it."""
        self._request.wait()
        nbytes = self._out.numel() * self._out.element_size()
        if self._length is not None and int(self._length[0]) != nbytes:
            raise ValueError(f"received a {int(self._length[0])}-byte message into a {nbytes}-byte tensor")
        if self._staged is not None:
            self._out.copy_(self._staged.view(self._out.dtype).view(self._out.shape))
            self._staged = None
        return self._out


def _post_send(data: torch.Tensor, dst: int, backend: str, tag: int, group: Any) -> tuple[list, tuple]:
    """Start the messages of one send; returns (works or requests, buffers to keep alive)."""
    payload = as_bytes(data)
    if check_backend(backend) == "torch":
        length = _length(payload.numel(), payload.device)
        works = [
            dist.isend(length, group=group, tag=2 * tag, **_peer(group, dst, "dst")),
            dist.isend(payload, group=group, tag=2 * tag + 1, **_peer(group, dst, "dst")),
        ]
        return works, (length, payload)
    MPI = get_mpi()
    host = to_host_contiguous(payload)
    buf = host.numpy()
    return [mpi_group(group).Isend([buf, MPI.BYTE], dest=dst, tag=tag)], (data, host, buf)


def isend(data: torch.Tensor, dst: int, backend: str = "torch", tag: int = 0, group: Any = None) -> AsyncSendHandle:
    """Start sending ``data``'s bytes to ``dst``; the handle keeps them alive until done."""
    requests, buffers = _post_send(data, dst, backend, tag, group)
    return AsyncSendHandle(_Requests(backend, requests, buffers[-1].device if backend == "torch" else None), buffers)


def send(data: torch.Tensor, dst: int, backend: str = "torch", tag: int = 0, group: Any = None) -> None:
    """Send ``data``'s bytes to ``dst`` and return when the send has completed."""
    requests, _buffers = _post_send(data, dst, backend, tag, group)
    for req in requests:
        req.wait() if backend == "torch" else req.Wait()


def recv(
    src: int | None = None,
    backend: str = "torch",
    tag: int = 0,
    group: Any = None,
    device: torch.device | str | None = None,
) -> tuple[int, torch.Tensor]:
    """Receive one message sent by :func:`send`/:func:`isend` on ``tag`` from ``src`` (any
    rank when ``None``). Returns ``(source rank, flat uint8 tensor)``; the tensor is on
    ``device`` (default: the CPU; the current CUDA device for a group that has no CPU backend, nccl
    alone). A sender's CUDA tensor on a ``cpu:gloo,cuda:nccl`` group needs ``device`` here too: the
    tensors' device picks the backend, and both ends must pick the same one."""
    if check_backend(backend) == "torch":
        if device is None:
            device = "cpu" if handles_cpu(group) else torch.device("cuda", torch.cuda.current_device())
        length = _length(0, torch.device(device))
        source = dist.recv(length, group=group, tag=2 * tag, **_peer(group, src, "src"))
        if group is not None:
            source = dist.get_group_rank(group, source)
        payload = torch.empty(int(length[0]), dtype=torch.uint8, device=device)
        # The payload comes from the sender of the length, whatever src was.
        dist.recv(payload, group=group, tag=2 * tag + 1, **_peer(group, source, "src"))
        return source, payload
    MPI = get_mpi()
    comm = mpi_group(group)
    status = MPI.Status()
    message = comm.Mprobe(source=MPI.ANY_SOURCE if src is None else src, tag=tag, status=status)
    data = torch.empty(status.Get_count(MPI.BYTE), dtype=torch.uint8)
    message.Recv([data.numpy(), MPI.BYTE])
    return status.Get_source(), data if device is None else data.to(device)


def irecv_into(out: torch.Tensor, src: int, backend: str = "torch", tag: int = 0, group: Any = None) -> AsyncRecvHandle:
    """Start receiving one message from ``src`` on ``tag`` into ``out`` (its size is known, so
    nothing is probed); ``wait()`` on the handle returns ``out`` filled. The message must
    hold exactly ``out``'s bytes (checked on the torch backend, whose protocol carries it)."""
    check_backend(backend)
    direct = out.is_contiguous() and (backend == "torch" or out.device.type == "cpu")
    target = (
        as_bytes(out)
        if direct
        else torch.empty(
            out.numel() * out.element_size(), dtype=torch.uint8, device=out.device if backend == "torch" else "cpu"
        )
    )
    staged = None if direct else target
    if backend == "torch":
        length = _length(0, out.device)
        works = [
            dist.irecv(length, group=group, tag=2 * tag, **_peer(group, src, "src")),
            dist.irecv(target, group=group, tag=2 * tag + 1, **_peer(group, src, "src")),
        ]
        return AsyncRecvHandle(_Requests("torch", works, target.device), out, staged, length)
    MPI = get_mpi()
    req = mpi_group(group).Irecv([target.numpy(), MPI.BYTE], source=src, tag=tag)
    return AsyncRecvHandle(_Requests("mpi", [req]), out, staged, None)
