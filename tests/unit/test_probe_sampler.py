"""WeightedDistributedSampler: equal step counts, proportional batches, full coverage."""

from __future__ import annotations

import pytest

from torch_hook.sampler import WeightedDistributedSampler, split_counts


@pytest.mark.parametrize(("total", "shares"), [(32, [1, 1, 0.5, 1]), (64, [1] * 4), (10, [3, 1]), (7, [1, 1, 1, 0.01])])
def test_split_counts(total, shares):
    counts = split_counts(total, shares)
    assert sum(counts) == total and min(counts) >= 1
    heavy, light = shares.index(max(shares)), shares.index(min(shares))
    assert counts[heavy] >= counts[light]


def test_ranks_cover_the_epoch_exactly_once_with_shares():
    shares = {2: 0.5}
    samplers = [WeightedDistributedSampler(range(100), 4, num_replicas=4, rank=r, shares=lambda: shares, seed=3)
                for r in range(4)]
    batches = [list(s) for s in samplers]
    assert len({len(b) for b in batches}) == 1 == len({len(s) for s in samplers})  # same step count
    seen = [i for b in batches for batch in b for i in batch]
    assert len(seen) == len(set(seen)) == 6 * 16
    assert len(batches[2][0]) < len(batches[0][0])
    assert samplers[2].loss_scale() < 1 < samplers[0].loss_scale()


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank=4"):
        WeightedDistributedSampler(range(100), 4, num_replicas=4, rank=4)
    with pytest.raises(ValueError, match="smaller than one global batch"):
        WeightedDistributedSampler(range(10), 4, num_replicas=4, rank=0)
