"""Workers for tests/test_federation.py: every federated algorithm against a computation done
here, by hand, in float64 (never with the code under test).

Each facility's values of each shard are drawn from seeds, so every rank knows every
facility's values of its own shard and forms the expected result itself.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from workers.strategy import BUCKET_MB, Net, digest, identical_across_peers
from xffl_like.aggregation import aggregate, build_strategy
from xffl_like.config.schema import FederationConfig, StrategyConfig, build_section
from xffl_like.distributed.layout import plan_layout
from xffl_like.distributed.state import build_state, read_env
from xffl_like.federation import Federation, NoHooks, build_federation, round_clock
from xffl_like.train.parallelize import contiguous_shards

STRATEGY = StrategyConfig(name="fused", streams=1, bucket_mb=BUCKET_MB, mode="split")


def plain_spec(**kw) -> dict:
    """The ``federation`` section as a plain dict (``every=1``, the rest the defaults) with ``kw`` over it."""
    base = dict(
        algorithm="federated",
        every=1,
        weights="uniform",
        topology="complete",
        outer=dict(name="average", lr=1.0, momentum=0.0, betas=[0.9, 0.99], eps=1e-8, offload=False),
        compression="none",
        chunk_size=4096,
        error_feedback=False,
    )
    outer = {**base["outer"], **kw.pop("outer", {})}
    return {**base, **kw, "outer": outer}


def spec(**kw) -> FederationConfig:
    """The typed ``federation`` section of :func:`plain_spec` (what the launcher hands workers)."""
    return build_section(FederationConfig, plain_spec(**kw))


def make(state, wide: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)) if wide else Net()
    if not wide:
        for block in model.blocks:
            fully_shard(block, mesh=state.mesh)
    fully_shard(model, mesh=state.mesh)
    contiguous_shards(model, state.shard_size)
    return model


def locals_(model):
    return [p.to_local() for p in model.parameters()]


def values(model, state, tag: int, facility: int) -> list[torch.Tensor]:
    """Facility ``facility``'s values of this rank's shard (facility -1: the common start)."""
    out = []
    for i, t in enumerate(locals_(model)):
        gen = torch.Generator().manual_seed(((tag * 31 + facility + 1) * 97 + i) * 13 + state.shard)
        out.append(torch.randn(t.shape, generator=gen, dtype=torch.float64) * (0.1 + 0.05 * facility))
    return out


def assign(model, vals) -> None:
    with torch.no_grad():
        for t, v in zip(locals_(model), vals):
            t.copy_(v)


def close(model, expected, what, tol=1e-5) -> None:
    for k, (t, e) in enumerate(zip(locals_(model), expected)):
        if not torch.allclose(t.double(), e, rtol=tol, atol=tol):
            raise AssertionError(f"{what}: parameter {k} off by {(t.double() - e).abs().max().item():.3g}")


def weighted(per_facility, w):
    return [sum(wf / sum(w) * vals[i] for wf, vals in zip(w, per_facility)) for i in range(len(per_facility[0]))]


# ----------------------------------------------------------------------------- outer step by hand
def outer_by_hand(o: dict, theta, mean, st: dict, t: int):
    """One outer step of rule ``o`` (float64 lists), written from the papers' formulas."""
    out = []
    for k, (th, mu) in enumerate(zip(theta, mean)):
        d = th - mu
        if o["name"] == "average":
            out.append(th - o["lr"] * d)
        elif o["name"] in ("momentum", "nesterov"):
            buf = o["momentum"] * st.get(k, torch.zeros_like(d)) + d
            st[k] = buf
            out.append(th - o["lr"] * (buf if o["name"] == "momentum" else d + o["momentum"] * buf))
        else:
            b1, b2 = o["betas"]
            m, v = st.get(("m", k), torch.zeros_like(d)), st.get(("v", k), torch.zeros_like(d))
            m, v = b1 * m + (1 - b1) * d, b2 * v + (1 - b2) * d * d
            st[("m", k)], st[("v", k)] = m, v
            out.append(th - o["lr"] * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + o["eps"]))
    return out


OUTERS = [
    dict(name="average", lr=0.5),
    dict(name="momentum", lr=0.3, momentum=0.8),
    dict(name="nesterov", lr=0.7, momentum=0.9),
    dict(name="adam", lr=0.01, betas=[0.8, 0.95], eps=1e-6),
]


def check_outer(state, digests, report) -> None:
    n = state.num_facilities
    for o in OUTERS:
        for weights in ("uniform", [1.0, 3.0] if n == 2 else [1.0] * n):
            for offload in (False, True):
                model = make(state)
                strategy = build_strategy(model, state, STRATEGY)
                start = values(model, state, 0, -1)
                assign(model, start)
                fed = Federation(spec(outer={**o, "offload": offload}, weights=weights), model, strategy, state)
                w = [1.0] * n if weights == "uniform" else weights
                theta, st = start, {}
                for r in range(1, 4):
                    per_facility = [values(model, state, r, f) for f in range(n)]
                    assign(model, per_facility[state.facility])  # as if each facility trained locally
                    fed.round()
                    theta = outer_by_hand(
                        {**OUTERS[0], **o, "momentum": o.get("momentum", 0.0)}, theta, weighted(per_facility, w), st, r
                    )
                    close(model, theta, f"outer {o['name']} weights={weights} offload={offload} round {r}")
                    digests.append((f"outer {o['name']} {weights} {offload} {r}", digest(model)))
                report["outer_cases"] += 1
                if o["name"] == "adam" and not offload:
                    check_state_dict(fed, model, strategy, state, o)


def check_state_dict(fed, model, strategy, state, o) -> None:
    """The federation's state survives a save/load through DTensors of the parameters' shapes."""
    from torch.distributed.tensor import DTensor

    sd = fed.state_dict()
    names = [n for n, _ in model.named_parameters()]
    for name, p in model.named_parameters():
        t = sd["theta_global"][name]
        if not isinstance(t, DTensor) or t.shape != p.shape or t.to_local().shape != p.to_local().shape:
            raise AssertionError(f"state_dict: theta_global[{name}] is not a DTensor shaped like the parameter")
    if (
        set(sd["outer"]) != {"steps", "exp_avg", "exp_avg_sq"}
        or sd["outer"]["steps"] != 3
        or set(sd["theta_global"]) != set(names)
    ):
        raise AssertionError(f"state_dict: unexpected outer state {sorted(sd['outer'])}")
    saved = {
        k: {n: t.to_local().clone() for n, t in v.items()}
        for k, v in (("theta", sd["theta_global"]), ("m", sd["outer"]["exp_avg"]))
    }
    other = Federation(spec(outer=o), model, strategy, state)
    other.load_state_dict(sd)
    back = other.state_dict()
    for name in names:
        if not (
            torch.equal(back["theta_global"][name].to_local(), saved["theta"][name])
            and torch.equal(back["outer"]["exp_avg"][name].to_local(), saved["m"][name])
        ):
            raise AssertionError(f"state_dict: {name} did not survive load_state_dict")
    if back["outer"]["steps"] != 3 or back["rounds"] != 3:
        raise AssertionError("state_dict: counters did not survive")


# ----------------------------------------------------------------------------- plain mean, tokens
def check_plain_mean_bitwise(state, report) -> None:
    """average/lr 1 is bitwise the strategy's mean (the pre-outer-optimizer rounds), and
    ``weights=tokens`` weighs each facility by the tokens counted since the last round."""
    n = state.num_facilities
    a, b = make(state), make(state)
    sa, sb = build_strategy(a, state, STRATEGY), build_strategy(b, state, STRATEGY)
    fed = Federation(spec(weights="tokens"), a, sa, state)
    if fed.theta is not None:
        raise AssertionError("average with lr 1 keeps a copy of the weights it never needs")
    for r in range(1, 4):
        # Facility f's ranks train r + f steps of (f + 1) * 10 tokens each since the last round.
        for _ in range(r + state.facility):
            fed.trained((state.facility + 1) * 10)
        tokens = [(r + f) * (f + 1) * 10 * state.layout.facility_sizes[f] for f in range(n)]
        per_facility = [values(a, state, 10 + r, f) for f in range(n)]
        assign(a, per_facility[state.facility])
        assign(b, per_facility[state.facility])
        fed.round()
        aggregate(sb, state, [float(t) for t in tokens])
        if not all(torch.equal(x, y) for x, y in zip(locals_(a), locals_(b))):
            raise AssertionError("average lr 1 differs bitwise from the strategy's mean")
        close(a, weighted(per_facility, tokens), f"tokens weights round {r}")
        report["plain_cases"] += 1


# ----------------------------------------------------------------------------- gossip
# Mixing matrices written out from the topologies' definitions (pairs average; the rest keep).
def pairs_matrix(n, pairs):
    m = torch.eye(n, dtype=torch.float64)
    for i, j in pairs:
        m[i, i] = m[j, j] = m[i, j] = m[j, i] = 0.5
    return m


GOSSIP = [  # (name, facilities, with HSDP replicas, matrices of rounds 0, 1, 2, ...)
    ("ring", 4, False, [pairs_matrix(4, [(0, 1), (2, 3)]), pairs_matrix(4, [(0, 3), (1, 2)])]),
    ("one-peer-exp", 4, False, [pairs_matrix(4, [(0, 1), (2, 3)]), pairs_matrix(4, [(0, 2), (1, 3)])]),
    ("complete", 4, False, [torch.full((4, 4), 0.25, dtype=torch.float64)]),
    # 2 facilities x 2 replicas: the first replica mixes and hands the result to the second.
    ("ring", 2, True, [pairs_matrix(2, [(0, 1)])]),
    # 2 facilities x 2 replicas: first inside each facility (replicas agree: no change), then all copies.
    (
        "alternating-exp-ring",
        2,
        True,
        [torch.eye(2, dtype=torch.float64), torch.full((2, 2), 0.5, dtype=torch.float64)],
    ),
]


def check_gossip(state, digests, report) -> None:
    n = state.num_facilities
    for name, facilities, replicas, matrices in GOSSIP:
        if facilities != n or replicas != (state.num_replicas > 1):
            continue
        for o in (dict(name="average", lr=1.0), dict(name="nesterov", lr=0.7, momentum=0.9)):
            model = make(state)
            start = values(model, state, 0, -1)
            assign(model, start)
            fed = Federation(spec(topology=name, outer=o), model, build_strategy(model, state, STRATEGY), state)
            current = [list(start) for _ in range(n)]  # every facility's theta_global
            st = [dict() for _ in range(n)]
            for r in range(5):
                per_facility = [values(model, state, 20 + r, f) for f in range(n)]
                assign(model, per_facility[state.facility])
                fed.round()
                mix = matrices[r % len(matrices)]
                mixed = [
                    [sum(mix[f, j] * per_facility[j][i] for j in range(n)) for i in range(len(start))] for f in range(n)
                ]
                current = [
                    outer_by_hand({**o, "momentum": o.get("momentum", 0.0)}, current[f], mixed[f], st[f], r + 1)
                    for f in range(n)
                ]
                close(model, current[state.facility], f"gossip {name} outer {o['name']} round {r}")
            report["gossip_cases"] += 1


# ----------------------------------------------------------------------------- compression
def chunk_bounds(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """Half a quantization step per element: chunks of ``chunk`` values, (max - min) / 255 / 2."""
    out = torch.empty_like(x)
    for a in range(0, x.numel(), chunk):
        piece = x[a : a + chunk]
        out[a : a + chunk] = (piece.max() - piece.min()) / 255 / 2
    return out


def split_bounds(x: torch.Tensor, n: int, chunk_size: int) -> torch.Tensor:
    """Bounds of a flat update cut into ``n`` parts of ceil(N/n) values (last padded with its last
    value), each in ceil(part/chunk_size) equal chunks."""
    part = math.ceil(x.numel() / n)
    per = math.ceil(part / math.ceil(part / chunk_size))
    padded = torch.cat([x, x[-1:].expand(n * part - x.numel())])
    return torch.cat([chunk_bounds(p, per) for p in padded.split(part)])[: x.numel()]


def check_compression(state, digests, report) -> None:
    n = state.num_facilities
    for kind in ("uint8", "bf16"):
        for ef in (False, True):
            model = make(state, wide=True)
            strategy = build_strategy(model, state, STRATEGY)
            start = values(model, state, 0, -1)
            assign(model, start)
            fed = Federation(spec(compression=kind, chunk_size=24, error_feedback=ef), model, strategy, state)
            flat = lambda vals: torch.cat([v.reshape(-1) for v in vals])  # noqa: E731
            theta = flat(start)
            carried = [torch.zeros_like(theta) for _ in range(n)]  # bound on each facility's residual
            for r in range(1, 4):
                per_facility = [values(model, state, 30 + r, f) for f in range(n)]
                assign(model, per_facility[state.facility])
                fed.round()
                updates = [theta - flat(p) for p in per_facility]
                exact = sum(updates) / n
                new = torch.cat([t.reshape(-1).double() for t in locals_(model)])
                got = theta - new  # the mean update as applied (outer average, lr 1)
                # First quantization, per facility: half a step of what it sends (update + residual,
                # whose range grows by at most twice the residual), plus the residual itself.
                first = torch.zeros_like(theta)
                for f, u in enumerate(updates):
                    if kind == "uint8":
                        q = split_bounds(u, n, 24) + carried[f].max() / 255
                    else:  # round to nearest bf16: relative error <= 2^-9, taken as 2^-8
                        q = (u.abs() + carried[f]) * 2**-8
                    first += (q + carried[f]) / n
                    carried[f] = q if ef else torch.zeros_like(q)
                if kind == "uint8":
                    second = split_bounds(exact, n, 24) + 2 * first.max() / 255
                else:
                    second = (exact.abs() + first) * 2**-8
                bound = first + second + 1e-7
                if not bool(((got - exact).abs() <= bound).all()):
                    raise AssertionError(
                        f"compression {kind} ef={ef} round {r}: error "
                        f"{(got - exact).abs().max().item():.3g} beyond the quantization bound"
                    )
                theta = new
                digests.append((f"compression {kind} {ef} {r}", digest(model)))
            report["compression_cases"] += 1
    # Bytes per round with the default chunk size, against the uncompressed mean of the same model.
    for kind in ("uint8", "bf16", "none"):
        model = make(state, wide=True)
        fed = Federation(spec(compression=kind), model, build_strategy(model, state, STRATEGY), state)
        report["compressed_bytes"][kind] = fed.round()["bytes_per_rank"]


# ----------------------------------------------------------------------------- synchronous
def batch(rank: int, step: int):
    gen = torch.Generator().manual_seed(1000 + 17 * rank + step)
    tokens = torch.randint(0, 9, (2, 5), generator=gen)
    return tokens, torch.randint(0, 3, (2, 5), generator=gen)


def check_synchronous(state, report) -> None:
    """Gradients after ``after_backward`` = the (weighted) mean over facilities of the facilities'
    mean gradients, computed here on an unsharded copy of the model."""
    n, layout = state.num_facilities, state.layout
    for weights in ("uniform", [1.0, 3.0] if n == 2 else [1.0] * n):
        model = make(state)
        fed = Federation(
            spec(algorithm="synchronous", weights=weights), model, build_strategy(model, state, STRATEGY), state
        )
        tokens, targets = batch(state.rank, 0)
        fed.trained(targets.numel())
        F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        fed.after_backward()
        torch.manual_seed(0)
        ref = Net().double()
        w = [1.0] * n if weights == "uniform" else weights
        full = [torch.zeros_like(p) for p in ref.parameters()]
        for f in range(n):
            ranks = layout.facility_ranks(f)
            for r in ranks:
                ref.zero_grad()
                x, y = batch(r, 0)
                F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
                for acc, p in zip(full, ref.parameters()):
                    acc += w[f] / sum(w) / len(ranks) * p.grad
        for (name, p), g in zip(model.named_parameters(), full):
            chunks = torch.chunk(g, state.shard_size, dim=0)
            mine = chunks[state.shard] if state.shard < len(chunks) else g[:0]
            got = p.grad.to_local().double()
            if got.shape != mine.shape or not torch.allclose(got, mine, rtol=1e-5, atol=1e-7):
                raise AssertionError(f"synchronous weights={weights}: gradient of {name} differs")
        report["sync_cases"] += 1


# ----------------------------------------------------------------------------- streaming
class LayersNet(nn.Module):
    """Blocks named like the Llama's (``layers.<i>.``): fragments are groups of them."""

    def __init__(self):
        super().__init__()
        from workers.strategy import Block

        self.embed = nn.Embedding(9, 6)
        self.layers = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(6, 3)


def check_streaming(state, digests, report) -> None:
    """fragments=2, overlap_steps=1, every=4 over 12 steps, DiLoCo's outer rule, weights=tokens,
    and a guard that leaves facility 1 out of one exchange: every step's values by hand."""
    n = state.num_facilities
    torch.manual_seed(0)
    model = LayersNet()
    for layer in model.layers:
        fully_shard(layer, mesh=state.mesh)
    fully_shard(model, mesh=state.mesh)
    contiguous_shards(model, state.shard_size)
    names = [name for name, _ in model.named_parameters()]
    # Fragment 0: the embedding and blocks 0, 1; fragment 1: blocks 2, 3 and the head.
    owner = [0 if name.startswith(("embed", "layers.0.", "layers.1.")) else 1 for name in names]
    o = dict(name="nesterov", lr=0.7, momentum=0.9)
    start = values(model, state, 0, -1)
    assign(model, start)
    skip_at = 2  # the exchange that ends as record 2 leaves facility 1 out

    class Guard(NoHooks):  # as the non-finite guard would
        def weights_for_round(self, weights, round_index, done):
            return ([weights[0], 0.0] + weights[2:], [1]) if round_index == skip_at else (weights, [])

    cfg = spec(every=4, fragments=2, overlap_steps=1, merge_alpha=0.25, weights="tokens", outer=o)
    fed = build_federation(cfg, model, build_strategy(model, state, STRATEGY), state, hooks=Guard())
    clock = round_clock(cfg, state, 12, end=12)  # what each step is: the fragments synced and started there

    def per_rank_tokens(f, done):  # rates that change over time: weights over the right window only
        return 10 * (f + 1) + 7 * f * done

    counted = {k: [0.0] * n for k in (0, 1)}  # tokens since each fragment's exchange last started
    theta, buf = list(start), {}
    pending = {}  # fragment -> (weights, snapshot per facility)
    index, cur = 0, None

    def launch(k, done, round_index):
        w, counted[k] = counted[k], [0.0] * n
        if round_index == skip_at:  # facility 1 restarts every fragment from theta_global
            cur[1] = list(theta)
            w[1] = 0.0
        pending[k] = (w, [list(c) for c in cur])

    def apply(k, blend):
        w, snap = pending.pop(k)
        for i in range(len(theta)):
            if owner[i] != k:
                continue
            mean = sum(w[f] * snap[f][i] for f in range(n)) / sum(w)
            d = theta[i] - mean
            buf[i] = o["momentum"] * buf.get(i, torch.zeros_like(d)) + d
            theta[i] = theta[i] - o["lr"] * (d + o["momentum"] * buf[i])
            for f in range(n):
                cur[f][i] = 0.25 * cur[f][i] + 0.75 * theta[i] if blend else theta[i]

    for done in range(1, 13):
        cur = [values(model, state, 50 + done, f) for f in range(n)]  # as if each facility trained a step
        assign(model, cur[state.facility])
        fed.trained(per_rank_tokens(state.facility, done))
        for k in counted:
            counted[k] = [
                c + per_rank_tokens(f, done) * state.layout.facility_sizes[f] for f, c in enumerate(counted[k])
            ]
        boundary = clock.at(done)
        records = fed.finish(boundary, index)
        synced = {2: [0], 4: [1], 6: [0], 8: [1], 10: [0], 12: [0, 1]}.get(done, [])  # offsets 2 and 4, by hand
        if [r.fragment for r in records] != synced:
            raise AssertionError(f"step {done}: fragments {[r.fragment for r in records]} synced, not {synced}")
        for k, r in zip(synced, records):
            if done == 12:
                launch(k, done, index)
            apply(k, blend=done < 12)
            want = 2 * 4 * sum(p.numel() for p, f in zip(model.parameters(), owner) if f == k)
            if r.cross_facility_bytes != want or r.started_step != (done if done == 12 else done - 1):
                raise AssertionError(f"step {done}: record {r}")
            index += 1
        close(model, cur[state.facility], f"streaming step {done} after the rounds")
        fed.start(boundary, index)
        starts = {1: [0], 3: [1], 5: [0], 7: [1], 9: [0]}.get(done, [])  # one step before, never at the end
        for k in starts:
            launch(k, done, index)
        close(model, cur[state.facility], f"streaming step {done} after starting {starts}")
    digests.append(("streaming, after the last step", digest(model)))  # in between, merged copies differ
    fed.wait()
    report["streaming_cases"] += 1


# ----------------------------------------------------------------------------- divergence
def check_divergence(state, report) -> None:
    """The end-of-run divergence check against max - min over each piece's holders, by hand.

    Every rank holds exact values (multiples of 1/8) plus ``(rank + 1) / 1024`` at one element
    of its shard (exact in float32); the holders of shard ``s`` (all ranks with that shard index,
    every facility and replica) then differ by ``(max rank - min rank) / 1024`` there, and the
    job's value is the largest over the shards."""
    from xffl_like.train.summary import max_param_divergence

    model = make(state)
    holders: dict[int, list[int]] = {}
    for r in range(state.world_size):
        holders.setdefault(state.layout.coords(r).shard, []).append(r)
    base = [torch.arange(t.numel(), dtype=torch.float32).remainder(16).div(8).view_as(t) for t in locals_(model)]
    first = next(i for i, t in enumerate(base) if t.numel())  # the same on every holder of a shard

    def with_element(value):
        vals = [b.clone() for b in base]
        vals[first].view(-1)[0] = value
        assign(model, vals)
        got = max_param_divergence(model, state)
        for t, v in zip(locals_(model), vals):  # measured, not changed
            assert torch.equal(t, v), "the divergence check changed the parameters"
        return got

    got = with_element(0.0)
    assert got == 0.0, f"identical copies: divergence {got}"
    got = with_element((state.rank + 1) / 1024)
    expected = max(max(h) - min(h) for h in holders.values()) / 1024
    assert got == expected, f"divergence {got}, by hand {expected}"
    got = with_element(-0.0 if state.rank % 2 else 0.0)  # other bits, equal values
    assert got == 0.0, f"+0.0 against -0.0: divergence {got}"
    report["divergence_cases"] = report.get("divergence_cases", 0) + 3


# ----------------------------------------------------------------------------- entry
def run_layouts(layouts: list[dict]) -> dict:
    env = read_env()
    report = {}
    for lay in layouts:
        # overlap=True: the streaming checks build a StreamingFederation with overlap_steps > 0
        overlap = "streaming" in lay["checks"]
        state = build_state(plan_layout(env.world_size, lay["federated"], lay["hsdp"]), env, overlap=overlap)
        out = {
            "outer_cases": 0,
            "plain_cases": 0,
            "gossip_cases": 0,
            "compression_cases": 0,
            "sync_cases": 0,
            "streaming_cases": 0,
            "compressed_bytes": {},
        }
        digests: list = []
        for what in lay["checks"]:
            if what == "outer":
                check_outer(state, digests, out)
            elif what == "plain":
                check_plain_mean_bitwise(state, out)
            elif what == "gossip":
                check_gossip(state, digests, out)
            elif what == "compression":
                check_compression(state, digests, out)
            elif what == "synchronous":
                check_synchronous(state, out)
            elif what == "streaming":
                check_streaming(state, digests, out)
            elif what == "divergence":
                check_divergence(state, out)
        identical_across_peers(state, digests)
        dist.barrier()
        report[lay["name"]] = out
    return report
