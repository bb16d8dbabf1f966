"""The independent check of a job's aggregation values, from the shards its ranks recorded.

A job run with ``XFFL_TEST_DUMP_ROUNDS=<dir>`` leaves every rank's local shard of every
parameter right before and right after each aggregation (``tests/plugins/hook_round_dump.py``).
Here, with nothing but torch: reassemble each facility's full tensors from its shards
(FSDP2's ``Shard(0)`` cuts dim 0 like ``torch.chunk``; the replicas of a facility hold
the same values), compute the weighted mean over facilities in float64, and require every
rank's post-round shard to be its piece of that mean. A job that broadcast one facility's
weights, skipped a facility, forgot to divide, or scattered pieces to the wrong shard
fails here, although all its copies would agree.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

# The fp32 weighted mean of F facilities errs by at most ~4 F 2^-24 max|x| (a few roundings
# per facility of values no larger than the largest input: see rounding_bound in
# workers/strategy.py); the Llama weights here are at most ~1.1 in magnitude (norms near 1,
# the rest ~0.02), so 1e-6 covers F <= 3 with room. After a few local AdamW steps the
# facilities differ by far more than that (1e-4 is required below, ~1e-2 is typical).
ATOL = 1e-6
MIN_FACILITY_SPREAD = 1e-4


def load_rounds(directory: Path) -> dict[tuple[int, str], list[dict]]:
    """``(round, phase) -> [record of every rank]`` from the files the job wrote."""
    out: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for path in sorted(Path(directory).glob("round*_rank*.pt")):
        record = torch.load(path, weights_only=True)
        out[(record["round"], record["phase"])].append(record)
    return out


def facility_tensors(records: list[dict], name: str) -> dict[int, torch.Tensor]:
    """Facility -> the full tensor ``name``, reassembled from replica 0's shards; every other
    replica must hold exactly the same shard."""
    by_place = {(r["facility"], r["replica"], r["shard"]): r for r in records}
    full = {}
    for f in sorted({r["facility"] for r in records}):
        shards = sorted((s, r) for (ff, rep, s), r in by_place.items() if ff == f and rep == 0)
        shard_size = shards[0][1]["shard_size"]
        assert [s for s, _ in shards] == list(range(shard_size)), f"facility {f}: missing shards"
        shape = shards[0][1]["shapes"][name]
        pieces = [r["params"][name] for _, r in shards]
        # Shard(0) = torch.chunk: ceil(n / S) rows per shard, the last ones short or empty.
        rows = [len(c) for c in torch.chunk(torch.empty(shape[0]), shard_size)]
        rows += [0] * (shard_size - len(rows))
        assert [p.shape[0] for p in pieces] == rows, f"{name}: shard rows {[tuple(p.shape) for p in pieces]}"
        full[f] = torch.cat(pieces).view(shape).double()
        for (ff, rep, s), r in by_place.items():
            if ff == f and rep > 0:
                assert torch.equal(r["params"][name], pieces[s]), (
                    f"{name}: facility {f} replica {rep} differs from replica 0"
                )
    return full


def check_round_values(directory: Path, weights: list[float], rounds: int, cross_facility_bytes: list[int]) -> dict:
    """Every round: after == weighted mean (``weights``: one per facility) of the facilities'
    values before, on every rank; the bytes the ranks sent add up to the summary's. Returns
    figures for the caller's own asserts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: on a busy machine the thread pool costs 30x the work
    try:
        return _check_round_values(directory, weights, rounds, cross_facility_bytes)
    finally:
        torch.set_num_threads(threads)


def _check_round_values(directory: Path, weights: list[float], rounds: int, cross_facility_bytes: list[int]) -> dict:
    recorded = load_rounds(directory)
    assert sorted({r for r, _ in recorded}) == list(range(rounds)), f"rounds recorded: {sorted(recorded)}"
    w = torch.tensor(weights, dtype=torch.float64)
    spread = 0.0
    for r in range(rounds):
        before, after = recorded[(r, "before")], recorded[(r, "after")]
        assert len(before) == len(after) and {x["rank"] for x in before} == {x["rank"] for x in after}
        assert len({x["facility"] for x in before}) == len(weights)
        names = list(before[0]["params"])
        for name in names:
            per_facility = facility_tensors(before, name)
            stacked = torch.stack([per_facility[f] for f in range(len(weights))])
            spread = max(spread, float((stacked - stacked[0]).abs().max()))
            mean = (stacked * w.view(-1, *[1] * (stacked.dim() - 1))).sum(0) / w.sum()
            for rec in after:
                S = rec["shard_size"]
                placements = rec["placements"][name]
                assert placements[-1] == "Shard(dim=0)" and all(p == "Replicate()" for p in placements[:-1]), placements
                chunks = torch.chunk(mean, S)
                want = chunks[rec["shard"]] if rec["shard"] < len(chunks) else mean[:0]
                got = rec["params"][name].double()
                assert got.shape == want.shape, (name, got.shape, want.shape)
                err = float((got - want).abs().max()) if got.numel() else 0.0
                assert err <= ATOL, f"round {r}, rank {rec['rank']}: {name} is {err:.3g} from the weighted mean"
        sent = sum(x["bytes_per_rank"] for x in after)
        model_bytes = sum(4 * torch.Size(s).numel() for s in before[0]["shapes"].values())  # fp32 weights
        assert sent == cross_facility_bytes[r] == len(weights) * model_bytes > 0, (sent, cross_facility_bytes[r])
    # Facilities trained apart before each round: otherwise any copy would look like the mean.
    assert spread > MIN_FACILITY_SPREAD, f"facilities hold the same values before aggregating (spread {spread:.3g})"
    return {"spread": spread}


# ----------------------------------------------------------------------------- streaming, phases
def full_values(records: list[dict]) -> dict[str, dict[int, torch.Tensor]]:
    """name -> facility -> full float64 tensor, from one phase's records of every rank."""
    return {name: facility_tensors(records, name) for name in records[0]["params"]}


def hand_fragments(names: list[str], num_layers: int, fragments: int) -> dict[str, int]:
    """Written out from the documented rule: block b of L -> b * K // L; the embeddings with the
    first fragment, the final norm and the head with the last."""
    out = {}
    for name in names:
        if name.startswith("layers."):
            out[name] = int(name.split(".")[1]) * fragments // num_layers
        else:
            out[name] = 0 if name.startswith("tok_embeddings") else fragments - 1
    return out


def _mean(per_facility: dict[int, torch.Tensor], weights: list[float]) -> torch.Tensor:
    return sum(w * per_facility[f] for f, w in enumerate(weights)) / sum(weights)


def _assert_shards(records: list[dict], name: str, want: dict[int, torch.Tensor], atol: float, what: str) -> None:
    """Every rank's shard of ``name`` is its piece of ``want[facility]``."""
    for rec in records:
        full = want[rec["facility"]]
        chunks = torch.chunk(full, rec["shard_size"])
        piece = chunks[rec["shard"]] if rec["shard"] < len(chunks) else full[:0]
        got = rec["params"][name].double()
        err = float((got - piece).abs().max()) if got.numel() else 0.0
        assert got.shape == piece.shape and err <= atol, f"{what}: {name} on rank {rec['rank']} is {err:.3g} off"


def check_streaming_values(
    directory: Path, summary: dict, phases: list[dict], num_layers: int, atol: float = 1e-5
) -> dict:
    """Replay a job's rounds in float64 from its recorded values: phase switches (the weighted
    mean, identical on every facility), fragment syncs (the outer Nesterov step of the fragment's
    theta_global on the facilities' weighted mean of the snapshot; the fragment becomes
    theta_global, or ``alpha * local + (1 - alpha) * theta_global`` when its exchange overlapped
    local steps; other parameters untouched). ``phases[i]``: ``weights``, ``fragments``,
    ``overlap_steps``, ``merge_alpha``, ``lr``, ``momentum`` of phase ``i`` (the test's own copy).
    Returns figures for the caller's asserts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        recorded = load_rounds(directory)
        theta = {n: v[0] for n, v in full_values(recorded[(0, "init")]).items()}
        buf: dict[str, torch.Tensor] = {}
        spread, worst = 0.0, 0.0
        for r, rd in enumerate(summary["round_records"]):
            step, fragment, phase, switch = rd["step"], rd["fragment"], rd["phase"], rd["switch"]
            p = phases[phase]
            before = full_values(recorded[(r, "before")])
            after_records = recorded[(r, "after")]
            n = len(next(iter(before.values())))
            weights = p["weights"] or [1.0] * n
            for per in before.values():
                spread = max(spread, float((per[1] - per[0]).abs().max()))
            if switch:  # the copies' mean; the next phase starts from it with fresh outer state
                for name, per in before.items():
                    mean = _mean(per, weights)
                    _assert_shards(after_records, name, {f: mean for f in per}, atol, f"round {r} (switch)")
                after = full_values(after_records)
                for per in after.values():
                    assert all(torch.equal(per[0], per[f]) for f in per), f"round {r}: copies differ after the switch"
                theta, buf = {n_: v[0] for n_, v in after.items()}, {}
                continue
            owner = hand_fragments(list(before), num_layers, p["fragments"])
            final = step == summary["steps"]
            overlapped = p["overlap_steps"] > 0 and not final
            snapshot = full_values(recorded[(r, "start")]) if overlapped else before
            for name, per in before.items():
                if owner[name] != fragment:  # not this fragment: untouched
                    _assert_shards(after_records, name, per, 0.0, f"round {r} (fragment {fragment})")
                    continue
                delta = theta[name] - _mean(snapshot[name], weights)
                buf[name] = p["momentum"] * buf.get(name, torch.zeros_like(delta)) + delta
                theta[name] = theta[name] - p["lr"] * (delta + p["momentum"] * buf[name])
                a = p["merge_alpha"]
                want = {f: (a * per[f] + (1 - a) * theta[name]) if overlapped else theta[name] for f in per}
                _assert_shards(after_records, name, want, atol, f"round {r} (fragment {fragment})")
                worst = max(worst, max(float((want[f] - per[f]).abs().max()) for f in per))
        return {"spread": spread, "largest_change": worst}
    finally:
        torch.set_num_threads(threads)
