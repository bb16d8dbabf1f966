"""AsyncModelAverage's snapshot waits for every write of the weights (issue 40 item 4): each path that writes them
on the training thread (an optimizer step, the copy-back of an average in ``before_forward`` and ``abort``, a
write announced by ``writing()``, the module's broadcast at ``attach``) records ``_mark_written`` after the write,
which the side stream's snapshot waits for on CUDA. On the CPU a spy on ``_mark_written`` records the weights it
sees: every mark comes after its path's write. On CUDA the snapshot of a write delayed on the training stream
holds the written values."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from xffl_like.parallel import AsyncModelAverage, with_algorithm
from xffl_like.parallel.buckets import Bucket


def _algo(device: str = "cpu") -> tuple[AsyncModelAverage, torch.nn.Parameter]:
    """An attached-looking AsyncModelAverage over one parameter, its thread never started (stop is set)."""
    p = torch.nn.Parameter(torch.zeros(4, device=device))
    algo = AsyncModelAverage(sync_interval_ms=0)
    algo.module = SimpleNamespace(buckets=[Bucket([p])], device=torch.device(device))
    algo._lock, algo._stop = threading.Lock(), threading.Event()
    algo._stop.set()
    algo._delta, algo._busy, algo._error, algo._steps = None, False, None, 0
    algo._cuda = device != "cpu"
    algo._stream = torch.cuda.Stream() if algo._cuda else None
    algo._written = None
    algo._mark_written()
    return algo, p


def _spy(monkeypatch, algo, p) -> list[torch.Tensor]:
    seen, real = [], algo._mark_written

    def mark():
        seen.append(p.detach().cpu().clone())
        real()

    monkeypatch.setattr(algo, "_mark_written", mark)
    return seen


def _delta(value: float) -> list[torch.Tensor]:
    return [torch.full((4,), value)]


def test_an_optimizer_step_is_marked_after_it_writes(monkeypatch):
    algo, p = _algo()
    seen = _spy(monkeypatch, algo, p)
    p.grad = torch.ones(4)
    opt = torch.optim.SGD([p], lr=0.5)
    algo.before_step()
    opt.step()
    algo.after_step()
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((4,), -0.5))


@pytest.mark.parametrize("path", ["before_forward", "abort"])
def test_the_copy_back_of_an_average_is_marked_after_it_writes(monkeypatch, path):
    algo, p = _algo()
    seen = _spy(monkeypatch, algo, p)
    algo._delta = _delta(2.0)
    getattr(algo, path)()
    assert torch.equal(p.detach(), torch.full((4,), 2.0)) and algo._delta is None
    assert seen and all(torch.equal(s, torch.full((4,), 2.0)) for s in seen)


def test_a_write_outside_a_step_holds_off_the_snapshot_and_is_marked_after(monkeypatch):
    """A checkpoint load or a reset: ``writing()`` holds the lock the snapshot takes, and marks after."""
    algo, p = _algo()
    seen = _spy(monkeypatch, algo, p)
    with algo.writing():
        assert algo._lock.locked()
        p.data.copy_(torch.full((4,), 3.0))
        assert not seen
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((4,), 3.0)) and not algo._lock.locked()


def test_every_write_in_a_training_loop_is_marked(monkeypatch):
    """A one-rank world, the real thread running: attach (after the broadcast) and each optimizer step are marked
    after their writes: the weights after each step are what some mark saw, the last mark saw the final ones."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    marks: list[torch.Tensor] = []
    real = AsyncModelAverage._mark_written

    def mark(self):
        marks.append(torch.cat([p.detach().flatten().clone() for p in self.module.unwrap().parameters()]))
        real(self)

    monkeypatch.setattr(AsyncModelAverage, "_mark_written", mark)
    try:
        torch.manual_seed(0)

        def weights():
            return torch.cat([p.detach().flatten().clone() for p in model.parameters()])

        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        wrapped = with_algorithm(model, opt, AsyncModelAverage(sync_interval_ms=0), local_world_size=1)
        assert len(marks) == 1 and torch.equal(marks[0], weights())  # attach, after the broadcast
        for _ in range(3):
            wrapped(torch.ones(2, 4)).sum().backward()
            opt.step()
            after = weights()
            assert torch.equal(marks[-1], after)  # this step's mark came after its write
            opt.zero_grad()
        wrapped.close()  # abort: the last copy-back, if any, marked after it
        assert torch.equal(marks[-1], weights())
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_snapshot_waits_for_a_delayed_write_on_the_training_stream():
    algo, p = _algo("cuda")
    new = torch.full((4,), 7.0, device="cuda")
    with algo.writing():
        torch.cuda._sleep(500_000_000)  # the write reaches the GPU long after the host moved on
        p.data.copy_(new)
    with algo._lock:
        snaps = algo._snapshot()
    assert torch.equal(snaps[0], new.cpu())
    algo._delta = _delta(1.0)
    algo.before_forward()
    torch.cuda._sleep(500_000_000)
    with torch.no_grad():
        p.add_(1.0)  # a step's write ...
    algo.after_step()  # ... marked after it
    with algo._lock:
        snaps = algo._snapshot()
    assert torch.equal(snaps[0], torch.full((4,), 9.0))
