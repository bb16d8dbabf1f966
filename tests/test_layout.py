"""Tier 1: pure layout planning over many valid and invalid combinations."""

import itertools
import math

import pytest

from xffl_like.distributed.layout import plan_layout


def brute_force_valid(world, federated, hsdp):
    """An independent statement of the rules: sizes sum to the world, the shard size
    divides every facility, and FSDP over unequal facilities is ambiguous."""
    if federated is None:
        sizes = [world]
    elif isinstance(federated, int):
        if federated <= 0 or world % federated:
            return None
        sizes = [federated] * (world // federated)
    else:
        if sum(federated) != world or any(s <= 0 for s in federated):
            return None
        sizes = list(federated)
    if hsdp is None:
        return (sizes, sizes[0]) if len(set(sizes)) == 1 else None
    if hsdp <= 0 or any(s % hsdp for s in sizes):
        return None
    return sizes, hsdp


FEDERATED = [None, 1, 2, 3, 4, 0, -2, [4, 2], [2, 4], [3, 3], [2, 2, 2], [4, 1, 1], [5], [6, 0], [1, 2, 3]]
HSDP = [None, 1, 2, 3, 4, 6, 0, -1]


@pytest.mark.parametrize("world", [1, 2, 4, 6, 8])
def test_layouts_match_the_rules(world):
    for federated, hsdp in itertools.product(FEDERATED, HSDP):
        expected = brute_force_valid(world, federated, hsdp)
        if expected is None:
            with pytest.raises(ValueError):
                plan_layout(world, federated, hsdp)
            continue
        layout = plan_layout(world, federated, hsdp)
        sizes, shard = expected
        assert list(layout.facility_sizes) == sizes and layout.shard_size == shard
        assert layout.replicas == tuple(s // shard for s in sizes)
        # Rank formula: offset_f + replica * S + shard, every rank exactly once.
        seen = []
        for f, size in enumerate(sizes):
            for replica in range(size // shard):
                for s in range(shard):
                    rank = sum(sizes[:f]) + replica * shard + s
                    c = layout.coords(rank)
                    assert (c.facility, c.replica, c.shard) == (f, replica, s)
                    seen.append(rank)
        assert sorted(seen) == list(range(world))


def test_unequal_facilities_split_exchanges():
    layout = plan_layout(6, [4, 2], 2)
    assert layout.replicas == (2, 1) and layout.num_chunks == 2
    ex = layout.split_exchanges()
    # chunk c of shard s: replica c % R_f of each facility
    assert [(e.shard, e.chunk, e.ranks) for e in ex] == [(0, 0, (0, 4)), (0, 1, (2, 4)), (1, 0, (1, 5)), (1, 1, (3, 5))]
    assert [e.ranks for e in layout.sender_exchanges()] == [(0, 4), (1, 5)]


def test_replica_counts_with_lcm():
    layout = plan_layout(10, [4, 6], 2)
    assert layout.replicas == (2, 3) and layout.num_chunks == math.lcm(2, 3)
    for s in range(2):
        mine = [e for e in layout.split_exchanges() if e.shard == s]
        # every replica of every facility reduces the same share of the chunks
        for f, r_f in enumerate(layout.replicas):
            owners = [layout.coords(e.ranks[f]).replica for e in mine]
            assert sorted(owners) == sorted(list(range(r_f)) * (6 // r_f))


@pytest.mark.parametrize(
    "args, needle",
    [
        ((6, 4, None), "does not divide the world size 6"),
        ((6, [4, 4], None), "sums to 8"),
        ((6, [4, 2], None), "distributed.hsdp=2"),
        ((6, [4, 2], 4), "valid values are [1, 2]"),
        ((6, None, None, 4), "not a multiple of 4"),
        ((0, None, None), "positive"),
    ],
)
def test_errors_name_numbers_and_alternative(args, needle):
    with pytest.raises(ValueError) as info:
        plan_layout(*args)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_describe_is_a_table():
    text = plan_layout(6, [4, 2], 2).describe()
    assert "HSDP" in text and "0..3" in text and "4..5" in text
