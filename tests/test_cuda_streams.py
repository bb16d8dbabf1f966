"""Tensors that cross CUDA streams are recorded on the stream that reads them (issue 40 item 4): ByteGrad's
``flat`` (made on the training stream, read by the side stream after ``grad_ready`` drops it) and its packed rows
(made on the side stream, read on the training stream). CUDA only: skipped elsewhere."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from xffl_like.parallel.algorithms import ByteGrad

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_bytegrad_records_its_buffers_on_the_streams_that_read_them(monkeypatch):
    recorded = []
    real = torch.Tensor.record_stream

    def record(tensor, stream):
        recorded.append((tensor.data_ptr(), stream))
        return real(tensor, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", record)
    algo = ByteGrad(hierarchical=False, average=False)  # one member: its own sum, compressed once
    algo.comm = SimpleNamespace(world_size=1)
    algo._pending, algo._thread, algo._bcast_group, algo._group = [], None, None, None
    algo._stream = torch.cuda.Stream()
    flat = torch.randn(1000, device="cuda")
    got = []
    bucket = SimpleNamespace(grads_flat=lambda: flat, set_grads=got.append)
    algo.grad_ready(bucket)
    assert (flat.data_ptr(), algo._stream) in recorded
    algo.after_backward()
    torch.cuda.synchronize()
    main = torch.cuda.current_stream()
    assert any(stream == main for _, stream in recorded)
    assert len(got) == 1 and torch.allclose(got[0], flat, atol=0.05 * float(flat.abs().max()))


def test_each_kind_of_exchange_keeps_one_side_stream():
    """Streaming's fragment exchanges share one persistent side stream, delayed rounds another: the allocator's
    per-stream blocks are reused from one exchange to the next."""
    from xffl_like.federation.streaming import OverlappedExchange

    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.ones(8, device=device)
    works = [OverlappedExchange(lambda: x * 2, True, device, kind=k) for k in ("fragment", "fragment", "delayed")]
    assert works[0].stream is works[1].stream and works[0].stream is not works[2].stream
    assert all(torch.equal(w.result(), x * 2) for w in works)
