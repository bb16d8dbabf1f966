"""Apply a Bagua-style algorithm to a model, and switch algorithms during training.

    model = with_algorithm(model, optimizer, GradientAllReduce())
    ... train: loss = model(x); loss.backward(); optimizer.step(); optimizer.zero_grad()
    model.switch_to(Decentralized(peer_selection_mode="shift_one"))
    ... train on

The wrapper splits the parameters (in reverse order, roughly the order their
gradients appear) into buckets of about ``bucket_mb`` MB (the first one at most 1 MiB,
as in DDP, so communication starts early in backward) and tells the algorithm
when a bucket's gradients are ready (always in bucket order, so every rank issues
its collectives in the same order), when backward has finished, and when the
optimizer has stepped. One backward per optimizer step (no gradient accumulation).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from .algorithms import Algorithm
from .buckets import Bucket
from .runtime import NodeComm, close_at_exit, node_comm

__all__ = ["BaguaModule", "Bucket", "with_algorithm", "broadcast_parameters", "allreduce_parameters"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FIRST_BUCKET_BYTES = 1024 * 1024  # DDP's first bucket size (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


@torch.no_grad()
def broadcast_parameters(module: nn.Module, broadcast_buffers: bool = True) -> None:
    """Copy rank 0's parameters (and buffers) to every rank."""
    tensors = list(module.parameters()) + (list(module.buffers()) if broadcast_buffers else [])
    for t in tensors:
        dist.broadcast(t.data, 0)


@torch.no_grad()
def allreduce_parameters(module: nn.Module) -> None:
    """Replace parameters and float buffers by their mean over all ranks (every rank gets the same bytes)."""
    world = dist.get_world_size()
    for t in list(module.parameters()) + [b for b in module.buffers() if b.dtype in FLOAT_DTYPES]:
        dist.all_reduce(t.data)
        t.data.div_(world)


class BaguaModule(nn.Module):
    """``module`` trained data-parallel with an :class:`~xffl_like.parallel.algorithms.Algorithm`;
    build it with :func:`with_algorithm`."""

    def __init__(
        self,
        module: nn.Module,
        optimizers: list[Optimizer],
        algorithm: Algorithm,
        bucket_mb: float = 10,
        local_world_size: int | None = None,
    ):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("with_algorithm needs torch.distributed to be initialized")
        if not isinstance(algorithm, Algorithm):
            raise TypeError(f"algorithm must be an xffl_like.parallel Algorithm, got {type(algorithm).__name__}")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.module = module
        self.optimizers = optimizers
        self.comm: NodeComm = node_comm(local_world_size)
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the module has no parameter that requires a gradient")
        self.device = params[0].device
        self.buckets: list[Bucket] = []
        # As DDP's reducer: the first bucket (the last parameters, whose gradients come first) holds at
        # most FIRST_BUCKET_BYTES, so its communication starts early and overlaps the rest of backward.
        limit, current, size = bucket_mb * 1024 * 1024, [], 0
        for p in reversed(params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= (min(limit, FIRST_BUCKET_BYTES) if not self.buckets else limit):
                self.buckets.append(Bucket(current))
                current, size = [], 0
        if current:
            self.buckets.append(Bucket(current))
        index = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._hooks = [
            p.register_post_accumulate_grad_hook(lambda _, i=index[id(p)]: self._grad_ready(i)) for p in params
        ]
        for opt in optimizers:
            self._hooks.append(opt.register_step_pre_hook(self._before_step))
            self._hooks.append(opt.register_step_post_hook(self._after_step))
        self._reset_backward()
        self._stepped = 0
        self._async_group = None
        self._closed = False
        broadcast_parameters(module)
        self.algorithm = algorithm
        algorithm.attach(self)
        # A script may end without close() or destroy_process_group: the algorithm's exchange in flight
        # and its threads must then be finished before the interpreter's teardown (comm.close_at_exit).
        close_at_exit(self)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """FSDP2's micro-batch switch. Bagua's algorithms synchronise in every backward pass, so only ``True`` is
        possible (the main job refuses ``train.grad_accum`` > 1 with ``parallel=bagua``)."""
        if not requires_gradient_sync:
            raise ValueError("BaguaModule synchronises every backward pass: it has no gradient accumulation")

    def forward(self, *args, **kwargs):
        """Run the module; in training, let the algorithm start its pre-forward communication."""
        if self.training and torch.is_grad_enabled() and not self._closed:
            self.algorithm.before_forward()
        return self.module(*args, **kwargs)

    def close(self) -> None:
        """Stop the algorithm (``detach``: its communication in flight finishes, its threads end) and
        stop reporting events to it: later iterations train each copy locally, without communication.
        Collective (every rank calls it, as ``switch_to``); idempotent; done at exit for a script that
        does not call it."""
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.algorithm.detach()

    def _finish_at_exit(self, timeout: float | None) -> None:
        """At exit (comm.finish_communication): close, then drop the references to process groups so
        that destroying the groups really ends them (comm.release_process_groups). The algorithm's
        own waits are not bounded by ``timeout``: they end when the exchange does, or fails."""
        try:
            self.close()
        finally:
            self.algorithm._drop_groups()
            self.comm, self._async_group = None, None

    def switch_to(self, algorithm: Algorithm) -> BaguaModule:
        """Stop the current algorithm, average weights, buffers and optimizer state over all ranks, and
        continue with ``algorithm`` (collective). Returns ``self``."""
        if not isinstance(algorithm, Algorithm):
            raise TypeError(f"algorithm must be an xffl_like.parallel Algorithm, got {type(algorithm).__name__}")
        if self._closed:
            raise RuntimeError("switch_to after close(): this BaguaModule no longer communicates")
        self.algorithm.detach()
        allreduce_parameters(self.module)
        self._average_optimizer_state()
        self.algorithm = algorithm
        algorithm.attach(self)
        return self

    def async_group(self) -> dist.ProcessGroup:
        """A world-wide group for background threads (created once, collectively)."""
        if self._async_group is None:
            self._async_group = dist.new_group(list(range(dist.get_world_size())))
        return self._async_group

    def unwrap(self) -> nn.Module:
        """The wrapped module."""
        return self.module

    @torch.no_grad()
    def _average_optimizer_state(self) -> None:
        world = dist.get_world_size()
        for opt in self.optimizers:
            # Parameter order gives every rank the same sequence of collectives.
            for group in opt.param_groups:
                for p in group["params"]:
                    for key in sorted(opt.state.get(p, {})):
                        t = opt.state[p][key]
                        if isinstance(t, Tensor) and t.dtype in FLOAT_DTYPES:
                            dist.all_reduce(t)
                            t.div_(world)

    def _reset_backward(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._queued = False

    def _grad_ready(self, i: int) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._ready[i] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next].params):
            self.algorithm.grad_ready(self.buckets[self._next])
            self._next += 1

    def _end_backward(self) -> None:
        for bucket in self.buckets[self._next :]:  # buckets with unused parameters, still in order
            self.algorithm.grad_ready(bucket)
        self._reset_backward()
        self.algorithm.after_backward()

    def _before_step(self, *_) -> None:
        if self._stepped == 0:
            self.algorithm.before_step()

    def _after_step(self, *_) -> None:
        self._stepped += 1
        if self._stepped == len(self.optimizers):
            self._stepped = 0
            self.algorithm.after_step()


def with_algorithm(
    model: nn.Module,
    optimizer: Optimizer | list[Optimizer],
    algorithm: Algorithm,
    bucket_mb: float = 10,
    *,
    local_world_size: int | None = None,
) -> BaguaModule:
    """Wrap ``model`` (already on its device) so that ``algorithm`` keeps the copies in step.

    Broadcasts rank 0's parameters and buffers first. ``local_world_size`` (default
    ``LOCAL_WORLD_SIZE``) sets the node size for hierarchical algorithms.
    """
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    return BaguaModule(model, optimizers, algorithm, bucket_mb, local_world_size)
