"""Tier 2: the reference average equals the weighted mean computed here, on every rank."""

import pytest
import torch

from xffl_like.distributed.launch import launch_local

import workers

WEIGHT_CASES = [None, [3.0, 1.0], [0.0, 2.0]]


@pytest.mark.parametrize("world, federated, hsdp, sizes", [(4, 2, None, [2, 2]), (6, [4, 2], 2, [4, 2])])
def test_reference_average_is_the_weighted_mean(world, federated, hsdp, sizes):
    results = launch_local(workers.reference_average, (federated, hsdp, WEIGHT_CASES), world)
    offsets = [sum(sizes[:f]) for f in range(len(sizes))]
    shapes = [(6, 5), (6,), (3, 6)]
    for case, weights in enumerate(WEIGHT_CASES):
        w = torch.tensor(weights or [1.0] * len(sizes), dtype=torch.float64)
        expected = []
        for i, shape in enumerate(shapes):
            per_facility = torch.stack([workers.facility_values(o * 10 + i, shape).double() for o in offsets])
            expected.append((per_facility * w.view(-1, *[1] * len(shape))).sum(0) / w.sum())
        for shard, n_shards, out in results:
            for local, full in zip(out[case], expected):
                want = torch.chunk(full, n_shards)[shard].float()  # FSDP2 Shard(0) is torch.chunk
                torch.testing.assert_close(local, want, rtol=1e-6, atol=1e-6)
