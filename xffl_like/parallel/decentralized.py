"""DecentralizedDataParallel: data parallelism by gossip over a sparse topology (Decent-DP).

Instead of all-reducing gradients, every copy steps on its own gradient and mixes
its *weights* with the ranks of one :class:`~xffl_like.parallel.topology.Edge` per
iteration. The mixing of iteration ``t`` overlaps the backward pass of ``t + 1``:

1. iteration 1 traces the order in which parameters receive their gradients;
2. at the second forward the parameters are split, in that order, into buckets of
   about ``bucket_size_in_mb``, each with its own optimizer (``optim_fn``) and LR
   scheduler; every rank checks that all ranks traced the same order; the first
   update is applied and the first mixing all-reduce is launched;
3. from then on, when the last parameter of a bucket gets its gradient, a hook
   waits for that bucket's pending mixing, replaces the weights by the mix, steps
   the bucket's optimizer and launches the next mixing, asynchronously.

So with ``y_t`` the weights after update ``t`` and ``E_t`` the edge of iteration
``t``, ``y_t = step(mix_{E_{t-1}}(y_{t-1}), grad(y_{t-1}))``.

Differences from Decent-DP, on purpose: the pending mixing is finished with the
edge it was launched on (Decent-DP mixes the first one with the next iteration's
weight, which breaks double stochasticity when the two differ, e.g. in
``alternating-exp-ring``); the trace check is an all-gather so every rank raises
the same error instead of rank 0 waiting forever; buffers are broadcast at the
start too; a one-rank edge (one process) is a no-op instead of a division by zero.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from .runtime import CommThread, close_at_exit, node_sizes, wait_work
from .topology import Edge, Topology

__all__ = ["DecentralizedDataParallel", "OPTIM_FN_TYPE", "LR_SCHEDULER_FN_TYPE"]

OPTIM_FN_TYPE = Callable[[list[tuple[str, Tensor]]], Optimizer]
LR_SCHEDULER_FN_TYPE = Callable[[Optimizer], LRScheduler]

_ALIGN = 32  # elements: bucket slots start on 128-byte boundaries (fp32) for vectorized kernels


def _aligned(n: int) -> int:
    return math.ceil(n / _ALIGN) * _ALIGN


def _hierarchical_sum(t: Tensor, edge: Edge) -> None:
    """Sum ``t`` over ``edge`` in three steps (on the communication thread): inside this rank's
    node to its leader, among the nodes' leaders, then from the leader back inside the node."""
    if t.is_cuda:
        torch.cuda.set_device(t.device)  # a new thread's current device is 0
    dist.reduce(t, dst=edge.node_leader, group=edge.node_group)
    if edge.leaders_group is not None:
        dist.all_reduce(t, group=edge.leaders_group)
    dist.broadcast(t, src=edge.node_leader, group=edge.node_group)


class _Pending:
    """A mixing submitted to the communication thread, waited like a collective's work."""

    def __init__(self, future):
        self.future = future

    def wait(self, timeout: float | None = None) -> None:
        self.future.result(timeout)


class _Bucket:
    """Parameters updated and mixed together: their optimizer, scheduler and buffers."""

    def __init__(
        self, params: list[Tensor], names: list[str], optim: Optimizer, sched: LRScheduler | None, as_view: bool
    ):
        self.params, self.names, self.optim, self.sched = params, names, optim, sched
        total = sum(_aligned(p.numel()) for p in params)
        ref = params[0]
        self.comm = torch.zeros(total, dtype=ref.dtype, device=ref.device)  # what is all-reduced
        self.comm_views = self._views(self.comm)
        self.block = None
        if as_view:  # parameters become views of one contiguous block: mixing is two kernels
            self.block = torch.zeros(total, dtype=ref.dtype, device=ref.device)
            for p, view in zip(params, self._views(self.block)):
                view.copy_(p.detach())
                p.data = view
        self.op = None  # pending mixing all-reduce
        self.edge: Edge | None = None  # the edge that op runs on

    def _views(self, flat: Tensor) -> list[Tensor]:
        views, start = [], 0
        for p in self.params:
            views.append(flat.narrow(0, start, p.numel()).view_as(p))
            start += _aligned(p.numel())
        return views

    def launch(self, edge: Edge, thread: CommThread | None = None) -> None:
        """Start mixing the current weights over ``edge`` (other ranks' shares summed into ``comm``;
        an edge spanning nodes in three steps on ``thread`` when it has one)."""
        if self.block is not None:
            self.comm.copy_(self.block)
        else:
            torch._foreach_copy_(self.comm_views, [p.detach() for p in self.params])
        self.edge = edge
        if len(edge.ranks) > 1:
            self.comm.mul_(edge.others_weight)
            if edge.hierarchical and thread is not None:
                self.op = _Pending(thread.submit(_hierarchical_sum, self.comm, edge))
            else:
                self.op = dist.all_reduce(self.comm, group=edge.group, async_op=True)

    def finish(self, timeout: float | None = None) -> None:
        """Wait for the pending mixing (at most ``timeout`` seconds when given, then raise) and replace
        the weights by the mix."""
        edge, op = self.edge, self.op
        self.edge, self.op = None, None
        if edge is None or len(edge.ranks) == 1:
            return
        wait_work(op, timeout)
        # comm = c * sum_{j in R} x_j, so w x_i + c sum_{j != i} x_j = (w - c) x_i + comm
        keep = edge.weight - edge.others_weight
        if self.block is not None:
            self.block.mul_(keep).add_(self.comm)
        else:
            params = [p.detach() for p in self.params]
            torch._foreach_mul_(params, keep)
            torch._foreach_add_(params, self.comm_views)


class DecentralizedDataParallel(nn.Module):
    """Wrap ``model`` for decentralized data parallelism over ``topology`` (see the module docstring).

    ``optim_fn(list of (name, parameter))`` builds one optimizer per bucket (e.g.
    :func:`~xffl_like.parallel.accum_adam.optim_fn_accum_adamw`), ``lr_scheduler_fn(optimizer)``
    one scheduler per bucket. The training loop only calls ``forward`` and
    ``backward``: updates happen inside backward, so there is no ``optimizer.step()``.
    ``set_accumulate_grad(True)`` makes the following forward/backward passes only
    accumulate gradients (no step counted, no update). ``global_avg()`` replaces
    every copy by the exact mean over all ranks (call it before evaluating).
    ``close()`` finishes the mixing in flight and stops communicating; a script that
    never calls it (nor ``destroy_process_group``) is closed at exit, while the
    interpreter is still whole (see :func:`~xffl_like.parallel.runtime.close_at_exit`).
    ``local_world_size`` (default ``LOCAL_WORLD_SIZE``) is the processes per node
    used by ``alternating-exp-ring``. Assumes every parameter is used once per
    backward, like Decent-DP.
    """

    FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

    def __init__(
        self,
        model: nn.Module,
        optim_fn: OPTIM_FN_TYPE,
        lr_scheduler_fn: LR_SCHEDULER_FN_TYPE | None = None,
        topology: str = "complete",
        scaler: torch.amp.GradScaler | None = None,
        grad_clip_norm: float = 0.0,
        param_as_bucket_view: bool = True,
        sync_buffer_in_global_avg: bool = False,
        bucket_size_in_mb: int = 25,
        local_world_size: int | None = None,
    ):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("DecentralizedDataParallel needs torch.distributed to be initialized")
        if bucket_size_in_mb <= 0:
            raise ValueError(f"bucket_size_in_mb must be > 0, got {bucket_size_in_mb}")
        self._model = model
        self._optim_fn, self._lr_schd_fn = optim_fn, lr_scheduler_fn
        self._scaler, self._grad_clip_norm = scaler, grad_clip_norm
        self._as_view = param_as_bucket_view
        self._sync_buffers = sync_buffer_in_global_avg
        self._bucket_bytes = bucket_size_in_mb * 1024 * 1024
        self._world_size = dist.get_world_size()
        local = local_world_size if local_world_size is not None else int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        # Agreed by all ranks: a rank building its schedule from its own node size alone would
        # wait on edges the others never form (hosts with different LOCAL_WORLD_SIZE).
        sizes = node_sizes(local)
        if len(set(sizes)) > 1 and topology == "alternating-exp-ring":
            raise ValueError(
                f"topology 'alternating-exp-ring' needs nodes of equal size, got nodes of {list(sizes)} "
                f"processes: start the same number of processes per node or use another topology"
            )
        # Edges over whole parts of several nodes are summed hierarchically (node, leaders, node) on
        # one communication thread: less across the nodes' links than a flat all-reduce.
        self._topo = Topology(topology, local_world_size=sizes[0], hierarchical=len(set(sizes)) == 1 and sizes[0] > 1)
        spans = any(self._topo.get_edge(t).hierarchical for t in range(self._topo.period))
        self._thread = CommThread("xffl-decentralized") if spans else None
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._traced: list[int] = []
        self._trace_hooks = [
            p.register_post_accumulate_grad_hook(partial(self._trace, pid=i)) for i, p in enumerate(self._params)
        ]
        self._buckets: list[_Bucket] = []
        self._hooks = []
        self._step = 0
        self._accumulating = False
        self._initialized = False
        self._closed = False
        with torch.no_grad():  # every copy starts from rank 0's weights
            for t in list(self._params) + [b for b in model.buffers()]:
                dist.broadcast(t.data, 0)
        # A script may end without close() or destroy_process_group: the last mixing, global_avg's
        # all-reduces and the communication thread must then be finished before the interpreter's
        # teardown, or the process aborts after its last line (see comm.close_at_exit).
        close_at_exit(self)

    # -- user API ----------------------------------------------------------------------------------------------
    def set_accumulate_grad(self, enable: bool = True) -> None:
        """While enabled, backward passes only accumulate gradients (no update, no step counted)."""
        self._accumulating = enable

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """FSDP2's name for the same switch: ``False`` for the micro-batches before a step's last."""
        self.set_accumulate_grad(not requires_gradient_sync)

    def forward(self, *args, **kwargs):
        """Run the model; at the second training iteration, set up the buckets and apply the first update."""
        if self._closed:
            return self._model(*args, **kwargs)
        if self._step == 1 and not self._initialized:
            self._setup()
        if self._model.training and not self._accumulating:
            self._step += 1
        return self._model(*args, **kwargs)

    def train(self, mode: bool = True):
        """Set the wrapped model's training mode."""
        self._model.train(mode)
        self.training = mode
        return self

    def eval(self):
        """Set the wrapped model to evaluation mode."""
        return self.train(False)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The wrapped model's parameters."""
        return self._model.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The wrapped model's named parameters (names without a wrapper prefix)."""
        return self._model.named_parameters(prefix, recurse, remove_duplicate)

    @property
    def module(self) -> nn.Module:
        """The wrapped model."""
        return self._model

    @property
    def topology(self) -> Topology:
        """The gossip topology."""
        return self._topo

    @property
    def optimizers(self) -> list[Optimizer]:
        """One optimizer per bucket (empty before the second iteration)."""
        return [b.optim for b in self._buckets]

    def wait_pending(self) -> None:
        """Block until the mixing in flight has arrived, without applying it (the next backward
        applies it, as in training): what follows is then timed apart from it."""
        for b in self._buckets:
            if b.op is not None:
                b.op.wait()

    def close(self) -> None:
        """Finish the mixing in flight (wait for it and apply it to the weights, as ``global_avg`` does
        first) and stop communicating: the communication thread ends and later backward passes only
        compute gradients (no update, no mixing); ``forward`` runs the model, ``global_avg`` still
        works while the process group exists. Every rank calls it (each finishes a mixing all ranks
        started). Idempotent; done at exit for a script that does not call it."""
        self._close()

    @torch.no_grad()
    def _close(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        for h in self._trace_hooks + self._hooks:
            h.remove()
        self._trace_hooks, self._hooks = [], []
        try:
            for b in self._buckets:
                b.finish(timeout)
        finally:  # stop the thread even when a mixing failed (it runs, then skips, what is queued)
            if self._thread is not None and not self._thread.close(timeout):
                raise RuntimeError(f"the communication thread did not stop within {timeout} s")

    def _finish_at_exit(self, timeout: float | None) -> None:
        """At exit (comm.finish_communication): close, then drop the references to process groups
        (this topology's edges), so that destroying the groups really ends them (comm.release_process_groups)."""
        try:
            self._close(timeout)
        finally:
            for iteration in self._topo.schedule:
                for e in iteration:
                    e.group = e.node_group = e.leaders_group = None

    @torch.no_grad()
    def global_avg(self) -> None:
        """Finish pending mixing, then set every copy to the exact mean over all ranks (and float buffers
        when ``sync_buffer_in_global_avg``)."""
        for b in self._buckets:
            b.finish()
        tensors = [b.block for b in self._buckets if b.block is not None]
        tensors += [p.data for b in self._buckets if b.block is None for p in b.params]
        covered = {id(p) for b in self._buckets for p in b.params}
        tensors += [p.data for p in self._params if id(p) not in covered]  # before set-up or never used
        if self._sync_buffers:
            tensors += [t.data for t in self._model.buffers() if t.dtype in self.FLOAT_DTYPES]
        for t in tensors:
            t.div_(self._world_size)
            dist.all_reduce(t)
        # Nothing is pending now: the next backward only updates, then mixing resumes.

    # -- internals ---------------------------------------------------------------------------------------------
    def _trace(self, _: Tensor, pid: int) -> None:
        if self._accumulating or self._initialized:
            return
        if pid in self._traced:
            raise RuntimeError(
                f"parameter {self._names[pid]} is used more than once in one backward pass; "
                "DecentralizedDataParallel needs each parameter used once"
            )
        self._traced.append(pid)

    @torch.no_grad()
    def _setup(self) -> None:
        self._initialized = True
        order = [(i, self._params[i].numel()) for i in self._traced]
        everyone = [None] * self._world_size
        dist.all_gather_object(everyone, order)
        if any(o != order for o in everyone):
            bad = [r for r, o in enumerate(everyone) if o != everyone[0]]
            raise RuntimeError(
                f"ranks {bad} traced a different parameter order (or sizes) than rank 0 in the "
                "first iteration: every rank must run the same model on the same code path"
            )
        for h in self._trace_hooks:
            h.remove()
        self._trace_hooks = []
        start, size = 0, 0
        for i, pid in enumerate(self._traced):
            p = self._params[pid]
            size += _aligned(p.numel()) * p.element_size()
            if size >= self._bucket_bytes or i == len(self._traced) - 1:
                pids = self._traced[start : i + 1]
                params, names = [self._params[j] for j in pids], [self._names[j] for j in pids]
                optim = self._optim_fn(list(zip(names, params)))
                sched = self._lr_schd_fn(optim) if self._lr_schd_fn is not None else None
                bucket = _Bucket(params, names, optim, sched, self._as_view)
                self._buckets.append(bucket)
                self._hooks.append(p.register_post_accumulate_grad_hook(partial(self._on_bucket_ready, bucket=bucket)))
                start, size = i + 1, 0
        # First update with the first iteration's gradients, then the first mixing (waited: a clean start).
        edge = self._topo.get_edge(self._step)
        for b in self._buckets:
            self._update(b)
            b.launch(edge, self._thread)
            if b.op is not None:
                b.op.wait()

    def _update(self, b: _Bucket) -> None:
        last = b is self._buckets[-1]
        if self._scaler is not None:
            if self._grad_clip_norm > 0:
                self._scaler.unscale_(b.optim)
                nn.utils.clip_grad_norm_(b.params, self._grad_clip_norm)
            self._scaler.step(b.optim)
            if last:
                self._scaler.update()
        else:
            if self._grad_clip_norm > 0:
                nn.utils.clip_grad_norm_(b.params, self._grad_clip_norm)
            b.optim.step()
        b.optim.zero_grad()
        if b.sched is not None:
            b.sched.step()

    @torch.no_grad()
    def _on_bucket_ready(self, _: Tensor, bucket: _Bucket) -> None:
        if self._accumulating:
            return
        bucket.finish()
        self._update(bucket)
        bucket.launch(self._topo.get_edge(self._step), self._thread)
