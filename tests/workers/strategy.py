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
from torch.distributed.tensor import DTensor

from xffl_like.aggregation import STRATEGIES, aggregate, build_strategy
from xffl_like.aggregation.strategy import AGGREGATION_MODES
from xffl_like.config.schema import StrategyConfig
from xffl_like.distributed.layout import plan_layout
from xffl_like.distributed.state import build_state, read_env
from xffl_like.train.parallelize import contiguous_shards

BUCKET_MB = 100 / 2**20  # ~100-byte buckets: several buckets, and parameters split across them


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 5)
        self.down = nn.Linear(5, 6, bias=False)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    """Odd sizes, three same-shape blocks (for ``stacked``), 1-row parameters (an empty
    shard on the second of two shards). First dimensions 9, 5, 6, 1 and 3: over 2 or 3
    shards some divide evenly (``contiguous_shards`` moves them) and some are padded."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(9, 6)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.gate = nn.Parameter(torch.ones(1, 6))
        self.tiny = nn.Parameter(torch.ones(1))  # one element: an empty exchange part
        self.head = nn.Linear(6, 3)

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
    """The exact weighted mean of the facilities' values (float64 from the dtype's values)."""
    return [m for m, _ in expected(model, state, dtype, tag, weights)]


def expected(model, state, dtype, tag, weights, lerp: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per parameter: (exact weighted mean, the most rounding may move the result from it);
    ``lerp``: the path is the two-facility exchange (see :func:`rounding_bound`)."""
    w = [1.0] * state.num_facilities if weights is None else list(weights)
    scales = [wf / sum(w) for wf in w]
    per_facility = [_values(model, state, dtype, tag, f) for f in range(state.num_facilities)]
    out = []
    for i in range(len(per_facility[0])):
        xs = [vals[i].double() for vals in per_facility]
        mean = sum(s * x for s, x in zip(scales, xs))
        out.append((mean, rounding_bound(dtype, xs, scales, mean, lerp)))
    return out


def rounding_bound(dtype, xs: list[torch.Tensor], scales: list[float], mean: torch.Tensor, lerp: bool) -> torch.Tensor:
    """Elementwise bound on |aggregated - exact mean| for F facilities' values ``xs``.

    Let u be the dtype's unit roundoff (2^-8 for bf16's 8-bit significand, 2^-24 for fp32),
    S = sum_f s_f |x_f| and M = max_f |x_f|; inside one operation torch computes in fp32
    (bf16's opmath), each fp32 operation erring by at most 2^-24 of a value <= 2M.

    - Exchange between 2 facilities (``lerp``): one ``torch.lerp(a, b, s)`` computed in fp32
      (b - a, 1 - s, a product and a sum: <= 8 * 2^-24 * M with the scale's conversion),
      rounded once to the dtype (u |mean|): bound u |mean| + 9 * 2^-24 * M.
    - Otherwise every path rounds to the dtype at most F times on the way to an element,
      each time a value of magnitude <= S: the exchange for F > 2 (``mul_`` by s_me, then
      F-1 ``add_(alpha=s_j)``) and the all-reduce (each contribution pre-scaled, F-1 additions
      in the ring). Summation analysis gives gamma_F * S, gamma_F = F u / (1 - F u), plus
      at most 3 fp32 roundings per step: bound gamma_F * S + 3 F 2^-24 M.

    For bf16 this is half an ulp of the mean (lerp) or ~F/2 ulps of S, where the old test
    allowed 2e-2 relative plus 1e-2 absolute, 5-10x more; fp32 gets a few ulps of M.
    """
    n = len(xs)
    u = torch.finfo(dtype).eps / 2  # eps = 2^(1-p)
    m = torch.stack([x.abs() for x in xs]).amax(0)
    if lerp:
        return u * mean.abs() + 9 * 2.0**-24 * m
    gamma = n * u / (1 - n * u)
    s = sum(sf * x.abs() for sf, x in zip(scales, xs))
    return gamma * s + 3 * n * 2.0**-24 * m


def check_close(model, expected, what):
    """Each local shard within its bound of the exact mean (``expected``: (mean, bound) pairs)."""
    for (name, p), (e, bound) in zip(model.named_parameters(), expected):
        err = (p.to_local().double() - e).abs()
        if not bool((err <= bound).all()):
            worst = int((err - bound).argmax())
            raise AssertionError(
                f"{what}: {name} differs from the expected mean by {err.view(-1)[worst].item():.3g} "
                f"where rounding allows {bound.view(-1)[worst].item():.3g}"
            )


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
            want = expected(model, state, dtype, tag, weights)
            want_lerp = expected(model, state, dtype, tag, weights, lerp=True)
            first = None
            for (collective, streams), name, mode in itertools.product(PATHS, names, AGGREGATION_MODES):
                what = f"{name} streams={streams} {mode} {collective} {dtype} weights={weights}"
                set_values(model, state, dtype, tag)
                options = StrategyConfig(name=name, streams=streams, bucket_mb=BUCKET_MB, mode=mode)
                strategy = build_strategy(model, state, options, collective=collective)
                if contiguous and name == "fused" and state.shard_size == 1:
                    # every shard was moved side by side: each bucket is one view, nothing staged
                    if any(c.packing != "inplace" or c.buffer is not None for c in strategy.communications):
                        raise AssertionError(f"{what}: fused staged copies over contiguous shards")
                result = aggregate(strategy, state, weights)
                # Two facilities exchanging (not as coalesced lists, which all-reduce): one lerp.
                lerp = strategy.collective == "exchange" and state.num_facilities == 2 and "coalesced" not in name
                check_close(model, want_lerp if lerp else want, what)
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
            state,
            out,
            tuple(spec.get("names", STRATEGIES)),
            tuple(spec["weights"]),
            dtypes=tuple(getattr(torch, d) for d in spec.get("dtypes", ("float32", "bfloat16"))),
            contiguous=spec.get("contiguous", False),
        )
        if spec.get("contiguous"):
            out["contiguous_forward"] = check_contiguous_forward(state, spec["weights"][-1])
        report[spec["name"]] = out
    return report


def check_properties(state) -> dict:
    """Parameters stay the model's, optimizer/forward still work, ``only`` keeps the rest local,
    strategies are immutable and reproducible."""
    dtype = torch.float32
    model = make_model(state, dtype)
    params = _params(model)
    options = StrategyConfig(name="fused", streams=2, bucket_mb=BUCKET_MB, mode="split")

    # Immutable, equal when built twice, different when the options differ.
    a, b = build_strategy(model, state, options), build_strategy(model, state, options)
    if a != b or hash(a) != hash(b):
        raise AssertionError("building the same strategy twice gave different plans")
    if a == build_strategy(model, state, dataclasses.replace(options, streams=1)):
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
    want = expected(model, state, dtype, 1, None)
    check_close(model, want, "fused before the optimizer step")
    optimizer = torch.optim.SGD(params, lr=0.5)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    # The step p - 0.5 rounds once more: u |p - 0.5| <= u (|m - 0.5| + bound).
    u = 2.0**-24
    stepped = [(m - 0.5, b + u * ((m - 0.5).abs() + b)) for m, b in want]
    check_close(model, stepped, "after an SGD step")
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
    check_close(model, expected(model, state, dtype, 3, (1.0, 3.0)), "fused after forward/backward/step")

    # `only`: a glob and a module class name; everything else stays bitwise unchanged.
    set_values(model, state, dtype, 2)
    before = locals_of(model)
    only = build_strategy(model, state, dataclasses.replace(options, only=["blocks.0.*", "Embedding"]))
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
    return {"only_bytes_per_rank": result.bytes_per_rank, "only_cross_facility_bytes": result.cross_facility_bytes}


def check_contiguous_forward(state, weights) -> dict:
    """``contiguous_shards`` under real sharding, as training uses it: two rounds of (a local
    SGD step on the facility's own tokens, the fused aggregation), checked against F unsharded
    models driven by the same steps and averaged here in float64.

    After each aggregation: every local shard holds its piece of the weighted mean, and
    FSDP's forward (its all-gather) sees exactly those values: the tensors the modules hold
    during the forward are, bitwise, the shards the aggregation wrote, and match the
    unsharded mean. Were FSDP's all-gather input a copy of a moved shard (if
    ``reset_sharded_param`` copied instead of aliasing, or were never called), the forward
    would see stale values and the optimizer would update a tensor nobody reads."""
    S, F = state.shard_size, state.num_facilities
    model = make_model(state, torch.float32)
    even = [p.shape[0] % S == 0 for p in model.parameters()]
    probe = torch.arange(12).view(3, 4) % 9
    if S > 1:
        # FSDP's lazy init (the first forward) re-points its all-gather inputs by itself; after
        # it, only contiguous_shards' own reset_sharded_param can: exercise that order here,
        # the training loop's (before any forward) over shards of 1.
        with torch.no_grad():
            model(probe)
        model.reshard()
    moved = contiguous_shards(model, S)
    if not moved or (S > 1 and all(even)):
        raise AssertionError(
            f"shards of {S}: need moved (and, over S > 1, padded) parameters, moved {moved} bytes, even {even}"
        )
    flat = {
        p.to_local().untyped_storage().data_ptr()
        for p, e in zip(model.parameters(), even)
        if e and p.to_local().numel()
    }
    if len(flat) != 1:
        raise AssertionError(f"evenly sharded parameters should share one buffer, found {len(flat)} storages")
    plain = []
    for _ in range(F):
        torch.manual_seed(0)  # the same initial values as make_model's
        plain.append(Net())
    names = [n for n, _ in model.named_parameters()]
    lr, momentum = 0.1, 0.5
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    plain_opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum) for m in plain]
    strategy = build_strategy(model, state, StrategyConfig(name="fused", streams=2, bucket_mb=BUCKET_MB, mode="split"))
    w = torch.tensor(weights, dtype=torch.float64)
    seen: dict[str, torch.Tensor] = {}

    def record(module, _inputs):
        prefix = module_names[module]
        for n, p in module.named_parameters(recurse=False):
            seen[prefix + n] = p.detach().clone()

    module_names = {m: (n + "." if n else "") for n, m in model.named_modules()}
    hooks = [
        m.register_forward_pre_hook(record) for m in model.modules() if any(True for _ in m.parameters(recurse=False))
    ]
    spread = 0.0
    for round_ in range(2):
        tokens = [
            torch.randint(0, 9, (2, 5), generator=torch.Generator().manual_seed(100 * round_ + f)) for f in range(F)
        ]
        # Local step: every rank of facility f on f's tokens (its shard group averages the
        # identical gradients); plain model f the same.
        model(tokens[state.facility]).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        for m, opt, t in zip(plain, plain_opts, tokens):
            m(t).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        aggregate(strategy, state, weights)
        with torch.no_grad():  # the aggregation, done here: the weighted mean in float64
            per_param = [torch.stack([p.double() for p in ps]) for ps in zip(*(m.parameters() for m in plain))]
            spread = max(spread, max(float((x - x[0]).abs().max()) for x in per_param))
            means = [(x * w.view(-1, *[1] * (x.dim() - 1))).sum(0) / w.sum() for x in per_param]
            for m in plain:
                for p, mean in zip(m.parameters(), means):
                    p.copy_(mean)
        for name, p, mean in zip(names, model.parameters(), means):
            chunks = torch.chunk(mean, S)
            want = chunks[state.shard] if state.shard < len(chunks) else mean[:0]
            if not torch.allclose(p.to_local().double(), want, rtol=1e-5, atol=1e-6):
                raise AssertionError(f"round {round_}: local shard of {name} is not the weighted mean")
        seen.clear()
        with torch.no_grad():
            got, ref = model(probe), plain[0](probe)
        model.reshard()  # the root keeps its parameters unsharded after a forward without backward
        for name, p, mean in zip(names, model.parameters(), means):
            full = seen.get(name)
            if full is None or isinstance(full, DTensor) or full.shape != mean.shape:
                raise AssertionError(f"round {round_}: the forward did not see {name} unsharded")
            mine = torch.chunk(full, S)[state.shard] if state.shard < len(torch.chunk(full, S)) else full[:0]
            if not torch.equal(mine, p.to_local()):
                raise AssertionError(
                    f"round {round_}: FSDP's forward sees stale values of {name}, not what the aggregation wrote"
                )
            if not torch.allclose(full.double(), mean, rtol=1e-5, atol=1e-6):
                raise AssertionError(f"round {round_}: FSDP's forward sees {name} away from the weighted mean")
        if not torch.allclose(got, ref, rtol=1e-5, atol=1e-6):
            raise AssertionError(f"round {round_}: FSDP's forward differs from the unsharded mean model")
    for h in hooks:
        h.remove()
    if spread < 1e-3:
        raise AssertionError(f"the facilities did not differ before aggregating (spread {spread:.3g})")
    return {"moved_bytes": moved, "even": sum(even), "padded": len(even) - sum(even)}
