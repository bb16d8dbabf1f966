"""Tier 2 for xffl_like.parallel on 4 gloo processes (one launch, many cases).

Expected values are simulated here, in one process, from the documented equations:
the topologies' edges are written out by hand, the Bagua formulas re-derived.
"""

from __future__ import annotations

import pytest
import torch
from workers import parallel as W

from xffl_like import parallel as P
from xffl_like.distributed.launch import launch_local

WORLD = 4
LR = 0.1

TOPOLOGY_CASES = [
    ("ring", None, 1),
    ("complete", [0, 2], 1),
    ("ring", [3, 1, 0, 2], 1),
    ("alternating-exp-ring", None, 2),
    ("one-peer-exp", None, 1),
]

DDP_CASES = [
    dict(topology="complete", view=True, bucket_mb=1, accum=False),
    dict(topology="complete", view=False, bucket_mb=0.0001, accum=False),
    dict(topology="ring", view=True, bucket_mb=0.0001, accum=False),
    dict(topology="ring", view=False, bucket_mb=1, accum=False),
    dict(topology="ring", view=True, bucket_mb=1, accum=True),
    dict(topology="one-peer-exp", view=True, bucket_mb=0.0001, accum=True),
    dict(topology="alternating-exp-ring", view=False, bucket_mb=0.0001, accum=False, local=2),
    dict(topology="complete", view=True, bucket_mb=0.0001, accum=True, local=2),  # hierarchical: 2 nodes of 2
    dict(topology="ring", view=True, bucket_mb=0.0001, accum=False, mlp=True),
]

# This rank's group per iteration, written out by hand for 4 processes (Decent-DP's edges).
HAND_EDGES = {
    "complete": [[[0, 1, 2, 3]]],
    "ring": [[[0, 1], [2, 3]], [[0, 3], [1, 2]]],
    "one-peer-exp": [[[0, 1], [2, 3]], [[0, 2], [1, 3]]],
    "alternating-exp-ring": [[[0, 1], [2, 3]], [[0, 1, 2, 3]]],  # inside the 2 nodes, then both nodes
}

BAGUA_CASES = [
    dict(kind="grads", algorithm=P.GradientAllReduce()),
    dict(kind="grads", algorithm=P.GradientAllReduce(hierarchical=True, average=False), local=2),
    dict(kind="grads", algorithm=P.ByteGrad(hierarchical=False)),
    dict(kind="grads", algorithm=P.ByteGrad(hierarchical=True), local=2, bucket_mb=0.0001),
    dict(kind="steps", steps=3, algorithm=P.Decentralized(hierarchical=False, peer_selection_mode="shift_one")),
    dict(kind="steps", steps=3, algorithm=P.Decentralized(hierarchical=True, peer_selection_mode="shift_one"), local=1),
    dict(kind="steps", steps=3, algorithm=P.Decentralized(hierarchical=True, communication_interval=2), local=2),
    dict(kind="steps", steps=3, algorithm=P.LowPrecisionDecentralized(hierarchical=False)),
    dict(kind="steps", steps=2, algorithm=P.LowPrecisionDecentralized(hierarchical=True), local=2),
    dict(kind="async", steps=5, settle=60, algorithm=P.AsyncModelAverage(sync_interval_ms=20, warmup_steps=2)),
    dict(kind="async_mlp", steps=30, algorithm=P.AsyncModelAverage(sync_interval_ms=0)),
    # Nodes of unequal size (3 + 1 processes; each rank declares its own node's size, as LOCAL_WORLD_SIZE
    # differs between hosts): these hung before the node layout was agreed across ranks.
    dict(kind="grads", algorithm=P.GradientAllReduce(hierarchical=True), local=[3, 3, 3, 1]),
    dict(kind="grads", algorithm=P.ByteGrad(hierarchical=True), local=[1, 3, 3, 3], bucket_mb=0.0001),
    dict(kind="steps", steps=2, algorithm=P.Decentralized(hierarchical=True), local=[3, 3, 3, 1]),
    dict(
        kind="steps",
        steps=3,
        algorithm=P.Decentralized(hierarchical=True, peer_selection_mode="shift_one"),
        local=[1, 3, 3, 3],
    ),
    dict(kind="error", algorithm=P.GradientAllReduce(hierarchical=True), local=[2, 3, 3, 3]),
]


pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def results():
    calls = [
        ("topology_groups", (TOPOLOGY_CASES,)),
        ("ddp_cases", (DDP_CASES,)),
        ("bagua_cases", (BAGUA_CASES,)),
        ("switch", ()),
    ]
    return launch_local(W.run, (calls,), WORLD)


def init_weights():
    return [p.detach().clone() for p in W.Fixed(seed=0).parameters()]  # rank 0's: what everyone starts from


def grad(rank, it, accum=False):
    g = W.coefs(rank, it)
    return [a + b for a, b in zip(g, W.coefs(rank, it, 1))] if accum else g


def mix(xs, groups, weight_of):
    """Decent-DP's rule on every rank: x_i <- w x_i + (1-w)/(|R|-1) sum_{j in R, j != i} x_j."""
    out = [None] * len(xs)
    for ranks in groups:
        w = weight_of(ranks)
        for i in ranks:
            out[i] = [
                w * xi + (1 - w) / (len(ranks) - 1) * sum(xs[j][k] for j in ranks if j != i)
                for k, xi in enumerate(xs[i])
            ]
    return out


# ---------------------------------------------------------------------------------------------------- topologies
def test_topology_groups_carry_traffic_among_exactly_their_ranks(results):
    for rank, per_rank in enumerate(results):
        for (name, ranks, _local), rows in zip(TOPOLOGY_CASES, per_rank[0]):
            members = list(range(WORLD)) if ranks is None else ranks
            if rank not in members:
                assert rows == []
                continue
            for edge_ranks, _weight, total in rows:
                assert rank in edge_ranks and total == sum(edge_ranks)
            if ranks is None:
                expected = [next(g for g in it if rank in g) for it in HAND_EDGES[name]]
                assert [r for r, _, _ in rows] == expected
    # An arbitrary rank list (e.g. facility leaders) in its given order: positions map to those ranks.
    assert [r for r, _, _ in results[3][0][2]] == [[1, 3], [2, 3]]  # ring over [3, 1, 0, 2]
    assert results[0][0][1] == [([0, 2], 0.5, 2.0)]


# ---------------------------------------------------------------------------------------------------- Decent-DP
def simulate_ddp(case, iterations=3):
    """y_1 = x0 - lr g_1;  y_t = mix_{E_{t-1}}(y_{t-1}) - lr g_t (SGD), E_t the edge of iteration t."""
    period = HAND_EDGES[case["topology"]]
    weight = lambda ranks: 1.0 / len(ranks)  # noqa: E731 - every registered topology averages its edges
    x0 = init_weights()
    ys = [[p - LR * g for p, g in zip(x0, grad(r, 1, case["accum"]))] for r in range(WORLD)]
    for t in range(2, iterations + 1):
        mixed = mix(ys, period[(t - 1) % len(period)], weight)
        ys = [[p - LR * g for p, g in zip(mixed[r], grad(r, t, case["accum"]))] for r in range(WORLD)]
    return ys


def simulate_ddp_mlp(iterations=3):
    """Same equations on the MLP: the gradient is taken at this rank's unmixed weights y_{t-1}."""
    params = [[p.detach().clone() for p in W.mlp(0).parameters()] for _ in range(WORLD)]

    def grads(r, ps, it):
        net = W.mlp(0)
        with torch.no_grad():
            for q, v in zip(net.parameters(), ps):
                q.copy_(v)
        x, y = W.mlp_batch(r, it)
        torch.nn.functional.mse_loss(net(x), y).backward()
        return [q.grad for q in net.parameters()]

    ys = [[p - LR * g for p, g in zip(params[r], grads(r, params[r], 1))] for r in range(WORLD)]
    for t in range(2, iterations + 1):
        mixed = mix(ys, HAND_EDGES["ring"][(t - 1) % 2], lambda ranks: 0.5)
        ys = [[p - LR * g for p, g in zip(mixed[r], grads(r, ys[r], t))] for r in range(WORLD)]
    return ys


@pytest.mark.parametrize("index", range(len(DDP_CASES)))
def test_decentralized_data_parallel_matches_the_simulation(results, index):
    case = DDP_CASES[index]
    if case.get("mlp"):
        expected = simulate_ddp_mlp()
        for rank in range(WORLD):
            for a, b in zip(results[rank][1][index]["trained"], expected[rank]):
                assert torch.allclose(a, b, atol=1e-5), rank
        return
    expected = simulate_ddp(case)
    mean = [sum(ys[k] for ys in expected) / WORLD for k in range(len(W.SHAPES))]
    for rank in range(WORLD):
        got = results[rank][1][index]
        for a, b in zip(got["trained"], expected[rank]):
            assert torch.allclose(a, b, atol=1e-5), (case, rank)
        for a, b in zip(got["avg"], mean):  # global_avg: the exact mean over ranks
            assert torch.allclose(a, b, atol=1e-5)
        assert got["buckets"] == (len(W.SHAPES) if case["bucket_mb"] < 1 else 1)
        # Edges over whole parts of 2 nodes are summed node, leaders, node (the simulation is flat).
        assert got["hierarchical"] == (case.get("local", 1) == 2)
        # consensus distance: mean over ranks of |y_r - mean|, from the simulated copies
        distance = (
            sum(float(torch.linalg.vector_norm(flat(expected[r]) - flat(mean)).double()) for r in range(WORLD)) / WORLD
        )
        assert got["consensus"] == pytest.approx(distance, rel=1e-4, abs=1e-6)
        assert got["consensus_after"] < 1e-6
    # The copies really differ before global_avg (a sparse topology is not an all-reduce).
    if case["topology"] != "complete":
        assert not torch.allclose(results[0][1][index]["trained"][0], results[1][1][index]["trained"][0])


def test_decentralized_data_parallel_rejects_different_traced_orders(results):
    for rank in range(WORLD):
        error = results[rank][1][-2]
        assert error is not None and "ranks [1] traced a different parameter order" in error


# ---------------------------------------------------------------------------------------------------- Bagua
def flat(ts):
    return torch.cat([t.reshape(-1) for t in ts])


def test_gradient_allreduce_exact(results):
    g = [grad(r, 1) for r in range(WORLD)]
    mean = [sum(g[r][k] for r in range(WORLD)) / WORLD for k in range(len(W.SHAPES))]
    for rank in range(WORLD):
        for a, b in zip(results[rank][2][0]["grads"], mean):
            assert torch.allclose(a, b, atol=1e-6)
        for a, b in zip(results[rank][2][1]["grads"], mean):  # hierarchical, average=False: the sum
            assert torch.allclose(a, b * WORLD, atol=1e-5)


@pytest.mark.parametrize("index, members", [(2, [[0], [1], [2], [3]]), (3, [[0, 1], [2, 3]])])
def test_bytegrad_within_the_quantization_bound(results, index, members):
    """Each member's (node's) scaled sum is quantized, summed, re-quantized: error <= sum of half-steps."""
    g = [flat(grad(r, 1)) / WORLD for r in range(WORLD)]
    parts = [sum(g[r] for r in ranks) for ranks in members]
    exact = sum(parts)
    first = sum((p.max() - p.min()) / 510 for p in parts)  # every part's whole range bounds its chunks'
    second = (exact.max() - exact.min() + 2 * first) / 510
    got = [flat(results[r][2][index]["grads"]) for r in range(WORLD)]
    for r in range(WORLD):
        err = (got[r] - exact).abs().max()
        assert err <= first + second + 1e-6
        assert torch.equal(got[r], got[0])  # every rank decodes the same bytes
    assert (got[0] - exact).abs().max() > 0  # it was compressed


def test_decentralized_shift_one_follows_baguas_formula(results):
    x0 = init_weights()
    for index, n_members in ((4, WORLD), (5, WORLD)):  # flat, and hierarchical with one process per node
        xs = [list(x0) for _ in range(WORLD)]
        for step in range(3):
            peers = {}
            half = n_members // 2
            for i in range(n_members):  # Bagua: first half i -> half + (step + i) % half, and back
                if i < half:
                    j = half + (step + i) % half
                    peers[i], peers[j] = j, i
            xs = [
                [(a + b) / 2 - LR * g for a, b, g in zip(xs[r], xs[peers[r]], grad(r, step + 1))] for r in range(WORLD)
            ]
            for r in range(WORLD):
                for a, b in zip(results[r][2][index]["steps"][step], xs[r]):
                    assert torch.allclose(a, b, atol=1e-5), (index, step, r)


def test_hierarchical_decentralized_all_with_interval(results):
    x0 = init_weights()
    xs = [list(x0) for _ in range(WORLD)]
    for step in range(3):
        if step % 2 == 0:  # all nodes average (node mean, then mean of the leaders' = world mean)
            avg = [sum(xs[r][k] for r in range(WORLD)) / WORLD for k in range(len(W.SHAPES))]
            xs = [list(avg) for _ in range(WORLD)]
        xs = [[a - LR * g for a, g in zip(xs[r], grad(r, step + 1))] for r in range(WORLD)]
        for r in range(WORLD):
            for a, b in zip(results[r][2][6]["steps"][step], xs[r]):
                assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("index, nodes", [(7, [[0], [1], [2], [3]]), (8, [[0, 1], [2, 3]])])
def test_low_precision_decentralized_within_the_bound_and_copies_agree(results, index, nodes):
    """Exact DCD-PSGD on the ring of nodes: x <- (x + x_left + x_right)/3 - lr * (node mean of g)."""
    steps = len(results[0][2][index]["steps"])
    n = len(nodes)
    x = [flat(init_weights()) for _ in range(n)]
    bound = 0.0
    for step in range(steps):
        g = [sum(flat(grad(r, step + 1)) for r in ranks) / len(ranks) for ranks in nodes]
        new = [(x[i] + x[(i - 1) % n] + x[(i + 1) % n]) / 3 - LR * g[i] for i in range(n)]
        bound += max(float((new[i] - x[i]).max() - (new[i] - x[i]).min()) for i in range(n)) / 510
        x = new
        for i, ranks in enumerate(nodes):
            for r in ranks:
                got = flat(results[r][2][index]["steps"][step])
                # errors are averaged (never amplified) by the mixing: the half-steps add up at most
                assert (got - x[i]).abs().max() <= 1.5 * bound + 1e-6, (step, r)
    # Every copy of a node's weights (its own, its neighbours' left/right copies) is the same tensor.
    last = {i: flat(results[nodes[i][0]][2][index]["steps"][-1]) for i in range(n)}
    for i, ranks in enumerate(nodes):
        for r in ranks:
            left = torch.cat(results[r][2][index]["left"])
            right = torch.cat(results[r][2][index]["right"])
            assert torch.equal(left, bucket_order(last[(i - 1) % n]))
            assert torch.equal(right, bucket_order(last[(i + 1) % n]))


def bucket_order(flat_model_order):
    """Buckets list parameters in reverse order: rebuild that layout from a model-order flat tensor."""
    sizes = [torch.Size(s).numel() for s in W.SHAPES]
    parts = list(torch.split(flat_model_order, sizes))
    return torch.cat(parts[::-1])


def test_async_model_average_converges_and_stops(results):
    case = BAGUA_CASES[9]
    steps = case["steps"]
    # Averaging preserves the sum over ranks: the mean is x0 - lr * sum_t mean_r g.
    mean = [
        p - LR * sum(sum(grad(r, t)[k] for r in range(WORLD)) / WORLD for t in range(1, steps + 1))
        for k, p in enumerate(init_weights())
    ]
    for r in range(WORLD):
        res = results[r][2][9]
        assert res["rounds"] > 0 and not res["alive"] and not res["alive_after_resume"]
        for a, b in zip(res["final"], mean):
            assert torch.allclose(a, b, atol=1e-5)


def test_async_model_average_never_breaks_autograd(results):
    for r in range(WORLD):  # 30 steps with the thread averaging continuously: no in-place error, rounds ran
        assert results[r][2][10]["rounds"] > 0


def test_switch_to_starts_every_copy_from_the_same_weights_and_state(results):
    reports = [results[r][3] for r in range(WORLD)]
    for phase in range(len(reports[0])):
        before = [reports[r][phase]["before"] for r in range(WORLD)]
        mean = [sum(b[k] for b in before) / WORLD for k in range(len(W.SHAPES))]
        for r in range(WORLD):
            rep = reports[r][phase]
            for k in range(len(W.SHAPES)):
                assert torch.equal(rep["after"][k], reports[0][phase]["after"][k])
                assert torch.allclose(rep["after"][k], mean[k], atol=1e-6)
                for key, value in rep["state"][k].items():
                    assert torch.equal(value, reports[0][phase]["state"][k][key]), (phase, key)
    # The phases before the switches really diverged the copies (shift_one, low precision).
    assert not torch.allclose(reports[0][1]["before"][0], reports[1][1]["before"][0])


# ---------------------------------------------------------------------------------------------------- unequal nodes
def test_hierarchical_gradient_allreduce_and_bytegrad_with_unequal_nodes(results):
    g = [flat(grad(r, 1)) for r in range(WORLD)]
    mean = sum(g) / WORLD
    for r in range(WORLD):
        assert torch.allclose(flat(results[r][2][11]["grads"]), mean, atol=1e-6)
    # ByteGrad, nodes [0] and [1, 2, 3]: two quantized parts (each node's sum / WORLD), summed, re-quantized.
    parts = [g[0] / WORLD, (g[1] + g[2] + g[3]) / WORLD]
    first = sum((p.max() - p.min()) / 510 for p in parts)
    second = (mean.max() - mean.min() + 2 * first) / 510
    got = [flat(results[r][2][12]["grads"]) for r in range(WORLD)]
    for r in range(WORLD):
        assert (got[r] - mean).abs().max() <= first + second + 1e-6 and torch.equal(got[r], got[0])


def test_hierarchical_decentralized_with_unequal_nodes_keeps_the_mean(results):
    x0 = init_weights()
    # all: node means weighted by node size = the mean over the 4 processes, every step.
    xs = [list(x0) for _ in range(WORLD)]
    for step in range(2):
        avg = [sum(xs[r][k] for r in range(WORLD)) / WORLD for k in range(len(W.SHAPES))]
        xs = [[a - LR * g for a, g in zip(avg, grad(r, step + 1))] for r in range(WORLD)]
        for r in range(WORLD):
            for a, b in zip(results[r][2][13]["steps"][step], xs[r]):
                assert torch.allclose(a, b, atol=1e-5), (step, r)
    # shift_one between the two nodes [0] and [1, 2, 3]: their means, weighted 1 : 3.
    xs = [list(x0) for _ in range(WORLD)]
    for step in range(3):
        node_b = [sum(xs[r][k] for r in (1, 2, 3)) / 3 for k in range(len(W.SHAPES))]
        both = [(a + 3 * b) / 4 for a, b in zip(xs[0], node_b)]
        xs = [[a - LR * g for a, g in zip(both, grad(r, step + 1))] for r in range(WORLD)]
        for r in range(WORLD):
            for a, b in zip(results[r][2][14]["steps"][step], xs[r]):
                assert torch.allclose(a, b, atol=1e-5), (step, r)


def test_inconsistent_node_sizes_and_unequal_alternating_exp_ring_fail_on_every_rank(results):
    for r in range(WORLD):
        assert "rank 0 starts a node of 2 but ranks 0..1 do not all declare 2" in results[r][2][15]["error"]
        assert "needs nodes of equal size, got nodes of [3, 1]" in results[r][1][-1]
