"""Aggregation strategies: pure planning tests, then every strategy on three layouts (gloo, CPU)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from helpers import CONF
from torch import nn
from workers import strategy as workers

from xffl_like.aggregation import STRATEGIES, Strategy, build_strategy, strategy_config, validate_strategy_options
from xffl_like.aggregation.planners import cut_chunks
from xffl_like.config.schema import StrategyConfig
from xffl_like.distributed.launch import launch_local
from xffl_like.distributed.layout import plan_layout


# ----------------------------------------------------------------------------- pure
def fake_state(world=4, federated=2, hsdp=1, rank=0, streams=2):
    """What build_strategy reads from a DistributedState, without any process group."""
    layout = plan_layout(world, federated, hsdp)
    c = layout.coords(rank)
    return SimpleNamespace(
        layout=layout,
        facility=c.facility,
        replica=c.replica,
        shard=c.shard,
        num_replicas=layout.replicas[c.facility],
        num_facilities=layout.num_facilities,
        num_streams=streams,
        backend="gloo",
    )


def plain_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 5))


def test_strategy_yamls_compose_and_validate():
    from hydra import compose, initialize_config_dir

    assert sorted(p.stem for p in (CONF / "strategy").glob("*.yaml")) == sorted(STRATEGIES)
    with initialize_config_dir(config_dir=str(CONF / "strategy"), version_base=None):
        for name in STRATEGIES:
            cfg = compose(config_name=name)
            assert set(cfg) == {"name", "streams", "bucket_mb", "mode", "only", "transport"}
            assert validate_strategy_options(strategy_config(cfg)).name == name


@pytest.mark.parametrize(
    "options, message",
    [
        (StrategyConfig(name="fusd"), "unknown strategy name 'fusd': valid names are ['layer_by_layer'"),
        (StrategyConfig(name="fused", streams=0), "strategy.streams=0"),
        (StrategyConfig(name="fused", bucket_mb=0), "strategy.bucket_mb=0"),
        (StrategyConfig(name="fused", mode="all"), "valid modes are ['split', 'one_sender']"),
        (dict(name="fused", buckets=3), "unknown strategy option(s) ['buckets']"),  # a plain mapping (a YAML spec)
        (dict(name="fused", streams=0), "strategy.streams=0"),
    ],
)
def test_validate_rejects(options, message):
    with pytest.raises(ValueError) as err:
        validate_strategy_options(strategy_config(options) if isinstance(options, dict) else options)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_validate_only_patterns():
    names = [n for n, _ in plain_model().named_parameters()]
    assert validate_strategy_options(StrategyConfig(name="fused", only=["0.*"]), names).only == ("0.*",)
    with pytest.raises(
        ValueError, match=r"pattern 'layers\.\*' matches no parameter name: parameters look like 0\.weight, 0\.bias"
    ):
        validate_strategy_options(StrategyConfig(name="fused", only=["layers.*"]), names)
    # A class name can only be checked against a model.
    assert validate_strategy_options(StrategyConfig(name="fused", only="Linear"), names).only == ("Linear",)
    validate_strategy_options(StrategyConfig(name="fused", only=["Linear"]), model=plain_model())
    with pytest.raises(ValueError, match="'Conv2d' matches no parameter name nor module class"):
        validate_strategy_options(StrategyConfig(name="fused", only=["Conv2d"]), model=plain_model())


def test_cut_chunks_equal_pieces_and_views():
    ts = [(0, torch.zeros(5, 3)), (1, torch.zeros(0)), (2, torch.zeros(7)), (3, torch.zeros(2, dtype=torch.bfloat16))]
    chunks = cut_chunks(ts, 3)
    fp32 = [sum(s.stop - s.start for s in c if s.dtype == torch.float32) for c in chunks]
    assert fp32 == [7, 7, 8] and sum(fp32) == 22
    assert [sum(s.stop - s.start for s in c if s.dtype == torch.bfloat16) for c in chunks] == [0, 1, 1]
    for c in chunks:
        for seg in c:
            assert seg.tensor.data_ptr() == ts[seg.index][1].view(-1)[seg.start :].data_ptr()
    assert chunks[0][0].tensor.shape == (7,)  # split at a boundary: a 1-D slice
    assert [s.tensor.shape for s in cut_chunks(ts, 1)[0]][0] == (5, 3)  # whole: keeps its shape


def test_builders_plan_shapes():
    model = plain_model()
    n_params = len(list(model.parameters()))
    state = fake_state()  # facility 0 of [2, 2], R=2: two chunks, this rank owns chunk 0
    by_name = {n: build_strategy(model, state, StrategyConfig(name=n, streams=2, bucket_mb=0.004)) for n in STRATEGIES}
    for s in by_name.values():
        assert s.num_chunks == 2 and {c.chunk for c in s.communications} == {0, 1}
        assert all(c.reduce == (c.chunk == 0) and c.broadcast and c.owner == c.chunk for c in s.communications)
        covered = sum(c.numel for c in s.communications)
        assert covered == sum(p.numel() for p in model.parameters())
        assert s.cross_facility_bytes == 2 * 4 * covered
    lbl = by_name["layer_by_layer"].communications
    assert len(lbl) >= n_params and all(len(c.spans) == 1 for c in lbl)
    assert [c.stream for c in lbl if c.chunk == 0] == [i % 2 for i in range(len([c for c in lbl if c.chunk == 0]))]
    cap = int(0.004 * 2**20) // 4
    # fused: weights (>= one 4 KB bucket) in place in bucket-size pieces, biases (and the small
    # pieces of weights cut at the chunk boundary) staged together.
    fused = by_name["fused"].communications
    inplace = [c for c in fused if c.packing == "inplace"]
    staged = [c for c in fused if c.packing == "persistent"]
    assert inplace and staged and len(inplace) + len(staged) == len(fused)
    assert all(len(c.spans) == 1 and c.buffer is None and c.numel <= cap for c in inplace)
    assert {c.indices[0] % 2 for c in inplace} == {0} and {1, 3, 5, 7} <= {i for c in staged for i in c.indices}
    assert all(len(c.spans) > 1 and c.buffer.numel() == c.numel <= cap for c in staged)
    flat = by_name["bucket_flatten"].communications
    assert all(c.numel <= cap or len(c.spans) == 1 for c in flat)
    for c in by_name["stacked"].communications:
        assert len(set(c.shapes)) == 1
    assert any(len(c.shapes) == 2 for c in by_name["stacked"].communications)  # the two 32x32 weights

    # Largest-first balancing never does worse than round-robin.
    def spread(s):
        load = [sum(c.nbytes for c in s.communications if c.chunk == 0 and c.stream == k) for k in range(2)]
        return max(load) - min(load)

    assert spread(by_name["layer_by_layer_optimized"]) <= spread(by_name["layer_by_layer"])


def test_collective_and_scratch():
    model = plain_model()
    state = fake_state()  # gloo: the exchange by default
    s = build_strategy(model, state, StrategyConfig(name="layer_by_layer"))
    assert s.collective == "exchange"
    for c in s.communications:  # 2 facilities: this rank receives half of what it reduces
        assert (c.scratch.numel() == c.numel // 2) if c.reduce else c.scratch is None
    coalesced = build_strategy(model, state, StrategyConfig(name="bucket_coalesced"))
    assert all(c.scratch is None for c in coalesced.communications)  # lists use the all-reduce
    assert (
        build_strategy(model, state, StrategyConfig(name="fused"), collective="all_reduce").collective == "all_reduce"
    )
    with pytest.raises(ValueError, match="valid collectives are"):
        build_strategy(model, state, StrategyConfig(name="fused"), collective="ring")


def test_one_sender_and_single_facility():
    model = plain_model()
    s = build_strategy(model, fake_state(rank=1), StrategyConfig(name="fused", mode="one_sender"))
    assert s.num_chunks == 1 and all(not c.reduce and c.broadcast and c.source == 0 for c in s.communications)
    single = build_strategy(model, fake_state(world=2, federated=None, hsdp=1), StrategyConfig(name="fused"))
    assert single.communications == () and single.cross_facility_bytes == 0


def test_strategy_is_frozen_and_equal_on_the_plan():
    model = plain_model()
    a = build_strategy(model, fake_state(), StrategyConfig(name="fused", streams=2, bucket_mb=0.01))
    b = build_strategy(model, fake_state(), StrategyConfig(name="fused", streams=2, bucket_mb=0.01))
    assert isinstance(a, Strategy) and a == b and hash(a) == hash(b)
    staged = [k for k, c in enumerate(a.communications) if c.buffer is not None]
    assert staged and all(
        a.communications[k].buffer.data_ptr() != b.communications[k].buffer.data_ptr() for k in staged
    )
    assert a != build_strategy(model, fake_state(), StrategyConfig(name="fused", streams=1, bucket_mb=0.01))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.mode = "one_sender"
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.communications[0].stream = 1


def test_streams_beyond_state_rejected():
    with pytest.raises(ValueError, match="build the state with num_streams=3"):
        build_strategy(plain_model(), fake_state(streams=2), StrategyConfig(name="fused", streams=3))
    with pytest.raises(TypeError, match="as a StrategyConfig, got dict"):
        build_strategy(plain_model(), fake_state(), dict(name="fused"))


def test_exchange_announces_every_receive_before_sending(monkeypatch):
    # gloo sends a message only after the receiver announced the receive, and the announcement
    # queues behind the data already sent on the same connection: every bucket's receive must
    # be posted before the first byte leaves, each result's receive before its part is sent.
    from xffl_like.aggregation import executor

    calls = []

    class Done:
        def wait(self):
            pass

    monkeypatch.setattr(executor.dist, "isend", lambda t, group, tag, group_dst: calls.append(("send", tag)) or Done())
    monkeypatch.setattr(executor.dist, "irecv", lambda t, group, tag, group_src: calls.append(("recv", tag)) or Done())
    state = fake_state(world=2, federated=1, hsdp=1, streams=1)  # 2 facilities of 1 rank
    strategy = build_strategy(plain_model(), state, StrategyConfig(name="layer_by_layer"))
    state.streams = None
    state.split_exchanges = [SimpleNamespace(exchange=SimpleNamespace(chunk=0, ranks=[0, 1]), groups=[None])]
    state.group = lambda name, stream=0: None  # the replica group: one replica per facility here
    executor.aggregate(strategy, state)
    k = len(strategy.communications)
    assert k > 2 and sorted(calls) == sorted([(kind, t) for t in range(2 * k) for kind in ("send", "recv")])
    first_send = calls.index(next(c for c in calls if c[0] == "send"))
    assert {t for kind, t in calls[:first_send] if kind == "recv"} >= set(range(0, 2 * k, 2))
    for b in range(k):  # the result's receive before the part leaves
        assert calls.index(("recv", 2 * b + 1)) < calls.index(("send", 2 * b))


# ----------------------------------------------------------------------------- multi-process
LAUNCHES = {
    4: [
        dict(name="fsdp_2x2", federated=2, hsdp=None, weights=[None, (2.0, 5.0)]),  # R = (1, 1), S = 2
        dict(name="hsdp_2x2", federated=2, hsdp=1, weights=[None, (2.0, 5.0)]),  # R = (2, 2), S = 1
        # The training loop's memory layout: shards side by side, so fused buckets are views.
        dict(
            name="hsdp_2x2_contiguous",
            federated=2,
            hsdp=1,
            weights=[None, (2.0, 5.0)],
            names=["fused", "layer_by_layer", "bucket_flatten"],
            contiguous=True,
        ),
        # Shards of 2: some parameters moved side by side, the others padded by FSDP.
        dict(
            name="fsdp_2x2_contiguous",
            federated=2,
            hsdp=None,
            weights=[None, (2.0, 5.0)],
            names=["fused", "layer_by_layer"],
            dtypes=["float32"],
            contiguous=True,
        ),
    ],
    6: [
        dict(name="unequal_4_2", federated=[4, 2], hsdp=2, weights=[None, (2.0, 5.0)]),  # R = (2, 1), S = 2
        dict(
            name="unequal_4_2_contiguous",
            federated=[4, 2],
            hsdp=2,
            weights=[None, (2.0, 5.0)],
            names=["fused"],
            dtypes=["float32"],
            contiguous=True,
        ),  # R = (2, 1), S = 2
        dict(
            name="fsdp_3x2_contiguous",
            federated=3,
            hsdp=None,
            weights=[None, (2.0, 5.0)],
            names=["fused"],
            dtypes=["float32"],
            contiguous=True,
        ),  # R = (1, 1), S = 3
        # Three facilities of 2 replicas: the exchange's general (F > 2) reduction.
        dict(
            name="three_facilities",
            federated=2,
            hsdp=1,
            weights=[None, (2.0, 5.0, 3.0)],
            names=["layer_by_layer", "fused"],
            dtypes=["float32"],
        ),
    ],
}


def check_bytes(reports: list[dict], spec: dict, nproc: int) -> None:
    """One model copy of the aggregated parameters per facility crosses the boundaries; in
    split mode every replica sends a share, in one_sender mode only replica 0."""
    n_facilities = len(spec["weights"][1])
    per_launch = [r[spec["name"]] for r in reports]
    n_cases = (
        len(spec.get("names", STRATEGIES))
        * len(workers.PATHS)
        * 2
        * len(spec.get("dtypes", ("float32", "bfloat16")))
        * 2
    )
    assert [r["cases"] for r in per_launch] == [n_cases] * nproc, spec["name"]
    for key in per_launch[0]["bytes_per_rank"]:
        sent = [(r["replica"], r["bytes_per_rank"][key]) for r in per_launch]
        if "/one_sender/" in key:
            assert all(b == 0 for replica, b in sent if replica > 0), key
        else:
            assert all(b > 0 for _, b in sent), key
        expected = n_facilities * workers.param_bytes(torch.float32 if "float32" in key else torch.bfloat16)
        assert {r["cross_facility_bytes"][key] for r in per_launch} == {expected}, key
        assert sum(b for _, b in sent) == expected, key


def check_contiguous_reports(reports: list[dict], specs: list[dict]) -> None:
    """Every contiguous layout ran the forward check; over shards of 2 and 3 it mixed moved
    and padded parameters (which ones: counted here from Net's first dimensions)."""
    first_dims = [p.shape[0] for p in workers.Net().parameters()]
    for spec in specs:
        if not spec.get("contiguous"):
            continue
        S = plan_layout(len(reports), spec["federated"], spec["hsdp"]).shard_size
        even = sum(d % S == 0 for d in first_dims)
        for r in reports:
            got = r[spec["name"]]["contiguous_forward"]
            assert got["moved_bytes"] > 0 and got["even"] == even, (spec["name"], got)
            assert S == 1 or 0 < even < len(first_dims), spec["name"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_strategy_on_4_processes():
    """FSDP [2, 2] and HSDP [2, 2] x (R=2, S=1): every strategy, both streams counts, modes,
    collectives, dtypes, uniform and weighted, checked on every rank."""
    reports = launch_local(workers.run_layouts, (LAUNCHES[4],), 4)
    for spec in LAUNCHES[4]:
        check_bytes(reports, spec, 4)
    check_contiguous_reports(reports, LAUNCHES[4])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_strategy_on_6_processes_and_properties():
    """Unequal facilities [4, 2] (R = 2, 1) and three facilities; plus: parameters stay the
    model's, optimizer and forward keep working, ``only`` keeps the rest local (workers)."""
    reports = launch_local(workers.run_layouts, (LAUNCHES[6], True), 6)
    for spec in LAUNCHES[6]:
        check_bytes(reports, spec, 6)
    check_contiguous_reports(reports, LAUNCHES[6])
    only_bytes = (
        2 * 4 * sum(p.numel() for n, p in workers.Net().named_parameters() if n.startswith(("blocks.0.", "embed.")))
    )
    assert {r["properties"]["only_cross_facility_bytes"] for r in reports} == {only_bytes}
    assert sum(r["properties"]["only_bytes_per_rank"] for r in reports) == only_bytes
