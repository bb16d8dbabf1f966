"""One batch ahead, on a background thread, in pinned memory: what a GPU job's training thread reads.

:class:`Prefetcher` wraps a data source (``train_batch(step)``, ``eval_batches()``). While the training
thread trains on batch ``n``, a thread draws batch ``n + 1`` and pins it, so that the copy to the GPU
(``tensor.to(device, non_blocking=True)`` in :func:`xffl_like.train.step.accumulate_gradients`) is
asynchronous and the source's own work (the synthetic chain's walk, a corpus read) never runs on the
training thread. Every batch is the source's own ``train_batch(n)``: the same tensors, drawn elsewhere.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

__all__ = ["Prefetcher"]


class Prefetcher:
    """``source``'s batches, each drawn one call ahead on a thread (pinned when ``pin``)."""

    def __init__(self, source, *, pin: bool = True):
        self.source, self.pin = source, pin
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xffl-prefetch")
        self._pending: tuple[int, Future] | None = None

    def _draw(self, step: int) -> tuple[torch.Tensor, ...]:
        batch = self.source.train_batch(step)
        return tuple(t.pin_memory() for t in batch) if self.pin else tuple(batch)

    def train_batch(self, step: int) -> tuple[torch.Tensor, ...]:
        """The source's batch ``step`` (drawn ahead when ``step`` follows the previous call's), then starts
        drawing ``step + 1``."""
        pending, self._pending = self._pending, None
        batch = pending[1].result() if pending is not None and pending[0] == step else self._draw(step)
        self._pending = (step + 1, self._pool.submit(self._draw, step + 1))
        return batch

    def close(self) -> None:
        """Stop drawing ahead (the batch being drawn is finished and dropped)."""
        self._pending = None
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __getattr__(self, name: str):  # eval_batches() and the rest: the source's own
        return getattr(self.source, name)
