"""Background communication never shares a group with the training thread (issue 30 item 4).

ByteGrad's communication thread and AsyncModelAverage's thread issue their collectives on gloo
groups of their own (``parallel.topology.background_group``), never the world or the node /
leader groups the training thread uses; the overlapped streaming exchange on host tensors runs in
a thread (on CUDA it is enqueued by the training thread on a side stream: tests/test_cuda.py).
Every collective of ``torch.distributed`` is wrapped in the workers and recorded with its thread
and group. (No ``.item()`` or synchronous default-stream op in the background paths is by design,
documented in the classes: the async thread's flag and averages are host tensors; on CUDA its
snapshot is a side-stream copy into pinned memory.)
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from xffl_like.distributed.launch import launch_local

#: The one-tensor all-gather under its name on this torch (xffl_like.distributed.compat: 2.11 has only
#: all_gather_into_tensor).
ALL_GATHER = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else "all_gather_into_tensor"
COLLECTIVES = ["all_reduce", "all_to_all_single", ALL_GATHER, "broadcast", "reduce", "all_gather"]


def _record_collectives(log):
    import torch.distributed as dist

    for name in COLLECTIVES:
        real = getattr(dist, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            group = kwargs.get("group")
            log.append((_name, threading.current_thread() is threading.main_thread(), group))
            return _real(*args, **kwargs)

        setattr(dist, name, wrapped)


def _describe(log, training_groups):
    import torch.distributed as dist

    from xffl_like.parallel import topology

    gloo_built = [g for key, g in topology._GROUPS.items() if key[-1] == "gloo" and g is not None]
    out = []
    for name, main, group in log:
        g = dist.group.WORLD if group is None else group
        out.append(
            {
                "op": name,
                "main": main,
                "backend": str(dist.get_backend(g)),
                "training": any(g is t for t in training_groups if t is not None),
                "world": g is dist.group.WORLD,
                "background_group": any(g is b for b in gloo_built),
            }
        )
    return out


def worker(local):
    """One wrapped model per algorithm; the recorded collectives of the background thread(s)."""
    import torch.distributed as dist

    from xffl_like import parallel as P

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        rank = dist.get_rank()
        results = {}
        for name, algo in [
            ("bytegrad_flat", P.ByteGrad(hierarchical=False)),
            ("bytegrad_node", P.ByteGrad(hierarchical=True)),
            ("async", P.AsyncModelAverage(sync_interval_ms=1)),
        ]:
            torch.manual_seed(rank)
            model = torch.nn.Linear(8, 4)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            wrapped = P.with_algorithm(model, opt, algo, bucket_mb=0.0001, local_world_size=local)
            log: list = []
            real = {n: getattr(dist, n) for n in COLLECTIVES}
            _record_collectives(log)
            try:
                for _ in range(3):
                    wrapped(torch.ones(2, 8)).sum().backward()
                    opt.step()
                    opt.zero_grad()
                    time.sleep(0.02)
                if name == "async":
                    deadline = time.time() + 30
                    while algo.rounds < 2 and time.time() < deadline:
                        time.sleep(0.005)
                    algo.abort()
            finally:
                for n, fn in real.items():
                    setattr(dist, n, fn)
            comm = wrapped.comm
            results[name] = _describe(log, [dist.group.WORLD, comm.node_group, comm.leader_group])
            results[name + "_rounds"] = getattr(algo, "rounds", None)
            wrapped.close()
        return results
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_background_threads_use_gloo_groups_of_their_own():
    per_rank = launch_local(worker, (None,), 2)
    for rank, res in enumerate(per_rank):
        for name in ("bytegrad_flat", "bytegrad_node", "async"):
            background = [c for c in res[name] if not c["main"]]
            assert background, (rank, name, res[name])  # the thread did communicate
            for call in background:
                assert call["backend"] == "gloo" and call["background_group"], (rank, name, call)
                assert not call["training"] and not call["world"], (rank, name, call)
        # ByteGrad's chain: the members' exchange (flat) on the thread; the training thread issues no exchange
        assert {c["op"] for c in res["bytegrad_flat"] if not c["main"]} == {"all_to_all_single", ALL_GATHER}
        assert all(c["op"] != "all_to_all_single" for c in res["bytegrad_flat"] if c["main"])
        assert res["async_rounds"] >= 2


def test_streaming_exchange_overlaps_in_a_thread_on_host_tensors():
    from xffl_like.federation.streaming import OverlappedExchange as Exchange

    seen = []
    work = Exchange(lambda: seen.append(threading.current_thread()) or 7, True, torch.device("cpu"))
    assert work.overlapped and work.stream is None
    assert work.result() == 7 and seen[0] is not threading.main_thread()
    inline = Exchange(lambda: seen.append(threading.current_thread()) or 8, False, torch.device("cpu"))
    assert not inline.overlapped and inline.result() == 8 and seen[1] is threading.main_thread()
