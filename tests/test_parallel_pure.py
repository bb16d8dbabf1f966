"""Tier 1 for xffl_like.parallel: topology schedules, the min-max uint8 codec, AccumAdam(W), factories."""

from __future__ import annotations

import math

import pytest
import torch

from xffl_like.parallel import codec
from xffl_like.parallel.accum_adam import AccumAdam, AccumAdamW, optim_fn_accum_adamw, optim_fn_adam
from xffl_like.parallel.topology import topology_edges

VALID = (
    [("complete", n, 1) for n in (1, 2, 3, 5, 8)]
    + [("ring", n, 1) for n in (2, 4, 6, 10)]
    + [("one-peer-exp", n, 1) for n in (2, 4, 8, 16)]
    + [
        ("alternating-exp-ring", n, local)
        for n, local in ((4, 2), (8, 2), (8, 4), (16, 2), (16, 4), (12, 3))
        if (n // local) & (n // local - 1) == 0
    ]
)


def mixing_matrix(iteration, n):
    """The matrix of the rule x_i <- w x_i + (1-w)/(|R|-1) sum_{j != i} x_j, from the edges' ranks and weights."""
    m = torch.zeros(n, n, dtype=torch.float64)
    for e in iteration:
        for i in e.ranks:
            for j in e.ranks:
                m[i, j] = e.weight if i == j else (1 - e.weight) / (len(e.ranks) - 1)
    return m


@pytest.mark.parametrize("name, n, local", VALID)
def test_every_iteration_uses_every_rank_once_and_mixes_doubly_stochastic(name, n, local):
    edges = topology_edges(name, n, local)
    for iteration in edges:
        used = [r for e in iteration for r in e.ranks]
        assert sorted(used) == list(range(n))
        m = mixing_matrix(iteration, n)
        assert torch.allclose(m.sum(0), torch.ones(n, dtype=torch.float64))
        assert torch.allclose(m.sum(1), torch.ones(n, dtype=torch.float64))
        assert torch.allclose(m, m.T) and (m >= 0).all()
    # Over one period the product of the mixing matrices is a contraction towards the mean (connected schedule).
    prod = torch.eye(n, dtype=torch.float64)
    for _ in range(3):
        for iteration in edges:
            prod = mixing_matrix(iteration, n) @ prod
    if n > 1:
        assert (prod - 1.0 / n).abs().max() < 0.9


def test_edges_are_decent_dps():
    pairs = lambda it: sorted(tuple(e.ranks) for e in it)  # noqa: E731
    ring = topology_edges("ring", 6)
    assert [pairs(it) for it in ring] == [[(0, 1), (2, 3), (4, 5)], [(0, 5), (1, 2), (3, 4)]]
    assert all(e.weight == 0.5 for it in ring for e in it)
    exp = topology_edges("one-peer-exp", 8)
    assert [pairs(it) for it in exp] == [
        [(0, 1), (2, 3), (4, 5), (6, 7)],
        [(0, 2), (1, 3), (4, 6), (5, 7)],
        [(0, 4), (1, 5), (2, 6), (3, 7)],
    ]
    alt = topology_edges("alternating-exp-ring", 8, 2)  # 4 nodes of 2
    assert [pairs(it) for it in alt] == [
        [(0, 1), (2, 3), (4, 5, 6, 7)],
        [(0, 1, 2, 3), (4, 5), (6, 7)],
        [(0, 1), (2, 3, 6, 7), (4, 5)],
        [(0, 1, 4, 5), (2, 3), (6, 7)],
    ]
    assert {e.weight for it in alt for e in it} == {0.5, 0.25}  # node: 1/L, node pair: 1/(2L): plain means
    assert topology_edges("complete", 5)[0][0].weight == pytest.approx(0.2)


@pytest.mark.parametrize(
    "name, n, local, words",
    [
        ("ring", 3, 1, ["even", "got 3", "2, 4, 6"]),
        ("one-peer-exp", 6, 1, ["power-of-two", "got 6", "2, 4, 8"]),
        ("one-peer-exp", 1, 1, ["power-of-two", "got 1"]),
        ("alternating-exp-ring", 6, 2, ["power-of-two number of nodes", "6 processes with 2 per node"]),
        ("alternating-exp-ring", 4, 1, [">= 2 processes each", "4 processes with 1 per node"]),
        ("alternating-exp-ring", 4, 4, ["(>= 2)", "4 processes with 4 per node"]),
        ("alternating-exp-ring", 6, 4, ["6 processes with 4 per node"]),
        ("star", 4, 1, ["unknown topology 'star'", "complete", "ring"]),
    ],
)
def test_impossible_sizes_raise_one_clear_error(name, n, local, words):
    with pytest.raises(ValueError) as err:
        topology_edges(name, n, local)
    assert "\n" not in str(err.value)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("numel, chunks", [(1, 1), (10, 3), (1000, 4), (4097, 2), (64, 64)])
def test_codec_round_trip_within_half_a_step(numel, chunks):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3 + 1
    packed = codec.compress(x, chunks)
    assert packed.dtype == torch.uint8 and packed.numel() == codec.packed_bytes(numel, chunks)
    y = codec.decompress(packed, numel)
    # Independent bound: each chunk of ceil(n/chunks) values has its own range / 255 step.
    length = math.ceil(numel / chunks)
    for c in range(chunks):
        part = x[c * length : (c + 1) * length]
        if part.numel():
            step = (part.max() - part.min()) / 255
            assert ((y[c * length : (c + 1) * length] - part).abs() <= step / 2 + 1e-6).all()
    # Header: min and max stored exactly as raw float32 bytes.
    assert torch.equal(packed[0, :8].clone().view(torch.float32), torch.stack([x[:length].min(), x[:length].max()]))


def test_codec_constant_and_bfloat16():
    assert torch.equal(codec.decompress(codec.compress(torch.full((7,), 2.5)), 7), torch.full((7,), 2.5))
    x = torch.linspace(-1, 1, 256, dtype=torch.bfloat16)
    out = torch.empty(2, 128, dtype=torch.bfloat16)
    codec.decompress(codec.compress(x, 2), 256, out=out)
    assert (out.view(-1).float() - x.float()).abs().max() <= 1 / 255 + 1e-2


def accum_adam_loop(p0, grads, lr, b1, b2, eps, wd, accum, decoupled):
    """The AccumAdam(W) update rule, element by element in float64."""
    p = p0.double().clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    a = torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        a = a + g / accum
        k = math.ceil(t / accum)
        m_t = m + (1 - b1) * g
        v_t = v + (1 - b2) * g * g
        p = p - lr / (1 - b1**k) * m_t / (v_t.sqrt() / math.sqrt(1 - b2**k) + eps)
        if t % accum == 0:
            m = b1 * (m + (1 - b1) * a)
            v = b2 * (v + (1 - b2) * a * a)
            a = torch.zeros_like(p)
    return p


@pytest.mark.parametrize("cls, decoupled", [(AccumAdam, False), (AccumAdamW, True)])
@pytest.mark.parametrize("accum, wd", [(1, 0.0), (3, 0.0), (4, 0.1)])
def test_accum_adam_matches_the_update_rule(cls, decoupled, accum, wd):
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(6, 4, generator=gen)
    grads = [torch.randn(6, 4, generator=gen) for _ in range(9)]
    p = torch.nn.Parameter(p0.clone())
    opt = cls([p], lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=wd, accum_iter=accum)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        assert torch.equal(p.grad, g)  # the L2 term is not written into the gradient
    expected = accum_adam_loop(p0, grads, 0.01, 0.8, 0.95, 1e-6, wd, accum, decoupled)
    assert torch.allclose(p.detach().double(), expected, atol=1e-5)
    if accum == 1 and wd == 0:  # with accum_iter=1 it is plain Adam
        q = torch.nn.Parameter(p0.clone())
        ref = torch.optim.Adam([q], lr=0.01, betas=(0.8, 0.95), eps=1e-6)
        for g in grads:
            q.grad = g.clone()
            ref.step()
        assert torch.allclose(p, q, atol=1e-5)


def test_factories_leave_biases_and_norms_undecayed():
    lin, norm = torch.nn.Linear(3, 4), torch.nn.LayerNorm(4)
    named = list(lin.named_parameters()) + [("bn.weight", norm.weight), ("bn.bias", norm.bias)]
    opt = optim_fn_accum_adamw(named, weight_decay=0.3, accum_iter=2)
    decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert decay == {id(lin.weight): 0.3, id(lin.bias): 0.0, id(norm.weight): 0.0, id(norm.bias): 0.0}
    assert isinstance(optim_fn_adam(named), torch.optim.Adam)
    every = optim_fn_accum_adamw(named, weight_decay=0.3, decay_all=True)
    assert [g["weight_decay"] for g in every.param_groups] == [0.3] and len(every.param_groups[0]["params"]) == 4


@pytest.mark.parametrize("tied", [False, True])
def test_factories_and_the_main_job_split_weight_decay_by_one_rule(tied):
    """Bucket by bucket, (name, parameter) pairs get the groups the main job gives the whole model."""
    from xffl_like.models import LlamaConfig, build_model
    from xffl_like.train.optim import decay_groups

    model = build_model(
        LlamaConfig.from_mapping(
            {
                "name": "llama_tiny",
                "dim": 16,
                "n_layers": 2,
                "n_heads": 2,
                "n_kv_heads": 1,
                "vocab_size": 32,
                "ffn_dim": 32,
                "max_seq_len": 16,
                "tie_embeddings": tied,
            }
        ),
        seed=0,
    )
    named = list(model.named_parameters())
    decayed = {id(p) for p in dict(named).values() if p is not None} - {
        id(dict(named)[n]) for n in decay_groups(model)[1]
    }
    for bucket in (named[:3], named[3:]):  # DecentralizedDataParallel calls optim_fn once per bucket
        opt = optim_fn_accum_adamw(bucket, weight_decay=0.3)
        got = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
        assert got == {id(p): 0.3 if id(p) in decayed else 0.0 for _, p in bucket}
    assert "tok_embeddings.weight" in decay_groups(named)[1] and "norm.weight" in decay_groups(named)[1]


@pytest.mark.cli
def test_parallel_bench_rejects_bad_input_before_launching():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "xffl_like.bench.parallel",
            "--methods",
            "ddp,decent:star",
            "--nproc",
            "3",
            "--link-mbit",
            "0",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "decent:star" in lines[0] and "--local-world-size 2 must divide --nproc 3" in lines[0]
    assert "--link-mbit 0.0: must be a positive number of Mbit/s" in lines[0]


def test_comm_thread_runs_jobs_in_order_and_stops_after_a_failure():
    """ByteGrad's chains run on a CommThread: FIFO (every rank's collectives in one order), a failed
    job's error reaches result(), later jobs are skipped rather than entering collectives."""
    import gc
    import threading

    from xffl_like.parallel.runtime import CommThread

    seen, gate = [], threading.Event()
    comm = CommThread("test-comm")
    first = comm.submit(lambda: (gate.wait(5), seen.append(1)))  # holds the queue until released
    later = [comm.submit(seen.append, i) for i in range(2, 6)]
    assert seen == [] and not first.done()
    gate.set()
    assert [f.result(5) for f in later] == [None] * 4 and seen == [1, 2, 3, 4, 5]
    failed = comm.submit(lambda: 1 / 0)
    skipped = comm.submit(seen.append, 6)
    with pytest.raises(ZeroDivisionError):
        failed.result(5)
    with pytest.raises(RuntimeError, match="skipped after an earlier communication job failed: division by zero"):
        skipped.result(5)
    assert seen == [1, 2, 3, 4, 5]
    comm.close()
    with pytest.raises(RuntimeError, match="closed"):
        comm.submit(seen.append, 7)
    dropped = CommThread("test-dropped")  # dropped without close(): its thread ends with it
    thread = dropped._thread
    del dropped
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()
