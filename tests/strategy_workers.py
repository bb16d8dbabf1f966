"""Workers for tests/test_strategies.py (spawned processes import them from here).

Every facility's values are derived from seeds, so each rank computes the expected
weighted mean of its own shard independently of the code under test.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from xffl_like.aggregation import STRATEGIES, aggregate, build_strategy
from xffl_like.aggregation.strategy import MODES
from xffl_like.distributed.layout import plan_layout
from xffl_like.distributed.state import build_state, read_env
from xffl_like.train.parallelize import contiguous_shards

BUCKET_MB = 100 / 2**20  # ~100-byte buckets: several buckets, and parameters split across them


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(7, 5)
        self.down = nn.Linear(5, 7, bias=False)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    """Odd sizes, three same-shape blocks (for ``stacked``), 1-row parameters (an empty
    shard on the second of two shards)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(9, 7)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.gate = nn.Parameter(torch.ones(1, 7))
        self.tiny = nn.Parameter(torch.ones(1))  # one element: an empty exchange part
        self.head = nn.Linear(7, 3)

    def forward(self, tokens):
        x = self.embed(tokens) * self.gate * self.tiny
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def param_bytes(dtype: torch.dtype) -> int:
    """Bytes of one full copy of Net's parameters, counted without any sharding."""
    return sum(p.numel() for p in Net().parameters()) * dtype.itemsize


def make_model(state, dtype: torch.dtype, contiguous: bool = False) -> Net:
    torch.manual_seed(0)
    model = Net().to(dtype)
    for block in model.blocks:
        fully_shard(block, mesh=state.mesh)
    fully_shard(model, mesh=state.mesh)
    if contiguous:  # what the training loop does: evenly sharded shards side by side in memory
        contiguous_shards(model, state.shard_size)
    return model


def _params(model):
    return [p for _, p in model.named_parameters()]


def set_values(model, state, dtype, tag):
    values = _values(model, state, dtype, tag, state.facility)
    with torch.no_grad():
        for p, v in zip(_params(model), values):
            p.to_local().copy_(v)


def _values(model, state, dtype, tag, facility):
    out = []
    for i, p in enumerate(_params(model)):
        gen = torch.Generator().manual_seed(((tag * 31 + facility) * 97 + i) * 13 + state.shard)
        out.append(torch.randn(p.to_local().shape, generator=gen).to(dtype))
    return out


def expected_mean(model, state, dtype, tag, weights) -> list[torch.Tensor]:
    w = [1.0] * state.num_facilities if weights is None else list(weights)
    per_facility = [_values(model, state, dtype, tag, f) for f in range(state.num_facilities)]
    return [
        sum(wf / sum(w) * vals[i].double() for wf, vals in zip(w, per_facility))
        for i in range(len(per_facility[0]))
    ]


def check_close(model, expected, dtype, what):
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    for (name, p), e in zip(model.named_parameters(), expected):
        got = p.to_local().double()
        if not torch.allclose(got, e, **tol):
            err = (got - e).abs().max().item()
            raise AssertionError(f"{what}: {name} differs from the expected mean by {err:.3g}")


def locals_of(model):
    return [p.to_local().detach().clone() for p in _params(model)]


def digest(model) -> str:
    return hashlib.sha1(b"".join(t.view(torch.uint8).numpy().tobytes() for t in locals_of(model))).hexdigest()


def identical_across_peers(state, digests: list[tuple[str, str]]) -> None:
    """Every rank holding the same shard (all replicas of all facilities) ended each case
    with the same bits. ``digests``: (case, digest) in case order, the same cases on all ranks."""
    everyone = [None] * state.world_size
    dist.all_gather_object(everyone, (state.shard, digests))
    mine = [d for s, d in everyone if s == state.shard]
    for k, (what, _) in enumerate(digests):
        if len({d[k][1] for d in mine}) != 1:
            raise AssertionError(f"{what}: ranks holding shard {state.shard} disagree after aggregation")


# gloo's default is the exchange; the all-reduce path (NCCL's) is checked with 2 streams only.
PATHS = (("exchange", 1), ("exchange", 2), ("all_reduce", 2))


def run_cases(state, report, names, weight_sets, dtypes=(torch.float32, torch.bfloat16), contiguous=False):
    """Every strategy x (collective, streams) x mode x dtype x weights, checked on every rank
    against the seed-derived mean; with two facilities, all-reduce results must also agree
    bitwise across strategies and modes (a + b is symmetric; with three, the ring's order of
    summation depends on where an element falls in the buffer)."""
    digests: list[tuple[str, str]] = []
    for d, dtype in enumerate(dtypes):
        model = make_model(state, dtype, contiguous)
        pointers = [p.to_local().data_ptr() for p in _params(model)]
        for k, weights in enumerate(weight_sets):
            tag = 10 * d + k  # the same inputs for every case of this dtype and weights
            expected = expected_mean(model, state, dtype, tag, weights)
            first = None
            for (collective, streams), name, mode in itertools.product(PATHS, names, MODES):
                what = f"{name} streams={streams} {mode} {collective} {dtype} weights={weights}"
                set_values(model, state, dtype, tag)
                options = dict(name=name, streams=streams, bucket_mb=BUCKET_MB, mode=mode)
                strategy = build_strategy(model, state, options, collective=collective)
                if contiguous and name == "fused" and state.shard_size == 1:
                    # every shard was moved side by side: each bucket is one view, nothing staged
                    if any(c.packing != "inplace" or c.buffer is not None for c in strategy.communications):
                        raise AssertionError(f"{what}: fused staged copies over contiguous shards")
                result = aggregate(strategy, state, weights)
                check_close(model, expected, dtype, what)
                digests.append((what, digest(model)))
                if collective == "all_reduce" and state.num_facilities == 2:
                    got = locals_of(model)
                    if first is None:
                        first = got
                    elif not all(torch.equal(a, b) for a, b in zip(got, first)):
                        raise AssertionError(f"{what}: differs bitwise from {names[0]} split all_reduce")
                key = f"{name}/{streams}/{mode}/{collective}/{dtype}/{k}"
                report["bytes_per_rank"][key] = result.bytes_per_rank
                report["cross_facility_bytes"][key] = result.cross_facility_bytes
                report["cases"] += 1
        if [p.to_local().data_ptr() for p in _params(model)] != pointers:
            raise AssertionError("aggregation rebound the parameters' storage")
    identical_across_peers(state, digests)


def run_layouts(layouts: list[dict], properties: bool = False) -> dict:
    """Run :func:`run_cases` on each of ``layouts`` (dicts: name, federated, hsdp and optionally
    names, weights, dtypes) over the same processes: one launch serves several layouts
    (launches are the slow part of these tests). With ``properties``, also
    :func:`check_properties` on the first layout."""
    env = read_env()
    report = {"rank": env.rank}
    for k, spec in enumerate(layouts):
        state = build_state(plan_layout(env.world_size, spec["federated"], spec["hsdp"]), env, num_streams=2)
        out = {"replica": state.replica, "cases": 0, "bytes_per_rank": {}, "cross_facility_bytes": {}}
        if properties and k == 0:
            report["properties"] = check_properties(state)
        run_cases(
            state, out, tuple(spec.get("names", STRATEGIES)), tuple(spec["weights"]),
            dtypes=tuple(getattr(torch, d) for d in spec.get("dtypes", ("float32", "bfloat16"))),
            contiguous=spec.get("contiguous", False),
        )
        if spec.get("contiguous"):
            check_contiguous_forward(state)
        report[spec["name"]] = out
    return report


def check_properties(state) -> dict:
    """Parameters stay the model's, optimizer/forward still work, ``only`` keeps the rest local,
    strategies are immutable and reproducible."""
    dtype = torch.float32
    model = make_model(state, dtype)
    params = _params(model)
    options = dict(name="fused", streams=2, bucket_mb=BUCKET_MB, mode="split")

    # Immutable, equal when built twice, different when the options differ.
    a, b = build_strategy(model, state, options), build_strategy(model, state, options)
    if a != b or hash(a) != hash(b):
        raise AssertionError("building the same strategy twice gave different plans")
    if a == build_strategy(model, state, {**options, "streams": 1}):
        raise AssertionError("strategies with different streams compare equal")
    try:
        a.name = "x"  # type: ignore[misc]
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("Strategy is mutable")

    # An optimizer step after aggregation updates the aggregated tensors.
    set_values(model, state, dtype, 1)
    aggregate(a, state, None)
    mean = expected_mean(model, state, dtype, 1, None)
    check_close(model, mean, dtype, "fused before the optimizer step")
    optimizer = torch.optim.SGD(params, lr=0.5)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    check_close(model, [m - 0.5 for m in mean], dtype, "after an SGD step")
    # A forward/backward through FSDP sees the aggregated weights (all ranks agree on the loss).
    optimizer.zero_grad()
    tokens = torch.arange(6).view(2, 3) % 9
    loss = model(tokens).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    # The plan was built before FSDP's first forward (lazy init): its views must still be the
    # parameters' storage, so aggregating now still changes the model.
    set_values(model, state, dtype, 3)
    aggregate(a, state, (1.0, 3.0))
    check_close(model, expected_mean(model, state, dtype, 3, (1.0, 3.0)), dtype, "fused after forward/backward/step")

    # `only`: a glob and a module class name; everything else stays bitwise unchanged.
    set_values(model, state, dtype, 2)
    before = locals_of(model)
    only = build_strategy(model, state, {**options, "only": ["blocks.0.*", "Embedding"]})
    result = aggregate(only, state, (1.0, 3.0))
    mean = expected_mean(model, state, dtype, 2, (1.0, 3.0))
    names = [n for n, _ in model.named_parameters()]
    chosen = {n for n in names if n.startswith(("blocks.0.", "embed."))}
    for name, p, old, m in zip(names, params, before, mean):
        if name in chosen:
            if not torch.allclose(p.to_local().double(), m, rtol=1e-5, atol=1e-6):
                raise AssertionError(f"only: {name} was not aggregated")
        elif not torch.equal(p.to_local(), old):
            raise AssertionError(f"only: {name} changed although it was not selected")
    if {names[i] for i in only.selected} != chosen:
        raise AssertionError(f"only selected {[names[i] for i in only.selected]}")
    return {"only_bytes_per_rank": result.bytes_per_rank,
            "only_cross_facility_bytes": result.cross_facility_bytes}


def check_contiguous_forward(state) -> None:
    """After ``contiguous_shards``, FSDP's forward reads the moved storage: writing through
    the parameters (as the aggregation does) changes the output exactly like an unsharded
    copy holding the same values, also after the first forward and an optimizer step."""
    model = make_model(state, torch.float32)
    if contiguous_shards(model, state.shard_size) == 0:
        raise AssertionError("nothing was moved: this layout does not exercise contiguous shards")
    tokens = torch.arange(6).view(2, 3) % 9
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for round_ in range(2):
        set_values(model, state, torch.float32, 4 + round_)
        plain = Net()
        with torch.no_grad():
            for (name, p), q in zip(model.named_parameters(), plain.parameters()):
                q.copy_(p.full_tensor())
        got, want = model(tokens), plain(tokens)
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            raise AssertionError(f"round {round_}: FSDP forward does not see values written to the moved shards")
        got.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
