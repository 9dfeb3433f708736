"""A batch sampler that follows the rebalance directive's work shares.

DDP needs every rank to run the same number of steps, so rebalancing cannot
give a slow rank fewer batches; it gives it *smaller* ones.  Each step takes
``batch_size * world`` samples of the epoch's permutation and splits them
among the ranks in proportion to their shares (``torch_hook.work_shares()``;
absent ranks 1.0).  Every rank computes the same split from the same shares,
so the ranks together still cover each sample exactly once per epoch.

Shares are read when an epoch starts (``__iter__``): the probe applies new
shares at the same window boundary on all ranks, but a DataLoader prefetches
indices ahead of the step, so reading them mid-epoch could split one step
differently on two ranks.

The gradient DDP averages is then a mean of unequal per-rank means; scale each
rank's loss by ``local_batch / mean_local_batch`` (``loss_scale()``) to keep it
the global mean.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized

import torch
from torch.utils.data import Sampler


def split_counts(total: int, shares: list[float]) -> list[int]:
    """``total`` items split proportionally to ``shares`` (largest remainder), each ≥ 1."""
    n = len(shares)
    weight = sum(shares)
    raw = [total * s / weight for s in shares]
    counts = [max(1, int(r)) for r in raw]
    order = sorted(range(n), key=lambda i: raw[i] - int(raw[i]), reverse=True)
    i = 0
    while sum(counts) < total:
        counts[order[i % n]] += 1
        i += 1
    while sum(counts) > total:
        j = max(range(n), key=lambda k: counts[k] - raw[k])
        counts[j] -= 1
    return counts


class WeightedDistributedSampler(Sampler[list[int]]):
    """Use as ``DataLoader(dataset, batch_sampler=WeightedDistributedSampler(...))``.

    ``batch_size`` is the per-rank batch at equal shares.  ``shares`` defaults
    to ``torch_hook.work_shares``; pass a callable to drive it yourself.
    """

    def __init__(self, dataset: Sized, batch_size: int, *, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 shares: Callable[[], dict[int, float]] | None = None):
        import torch.distributed as dist

        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be at least 1")
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} is not in [0, {num_replicas})")
        if batch_size * num_replicas > len(dataset):
            raise ValueError(f"dataset of {len(dataset)} samples is smaller than one global batch "
                             f"({batch_size} x {num_replicas})")
        self.dataset, self.batch_size = dataset, batch_size
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        if shares is None:
            from torch_hook import opt_in_to_rebalancing
            from torch_hook import work_shares as shares

            opt_in_to_rebalancing()
        self._shares = shares
        self.local_batch = batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset) // (self.batch_size * self.num_replicas)

    def _split(self) -> list[int]:
        table = self._shares() or {}
        return split_counts(self.batch_size * self.num_replicas,
                            [float(table.get(r, 1.0)) for r in range(self.num_replicas)])

    def loss_scale(self) -> float:
        """Factor that makes this rank's mean loss weigh by its sample count."""
        return self.local_batch / self.batch_size

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=g).tolist()
        else:
            order = list(range(len(self.dataset)))
        counts = self._split()
        start = sum(counts[: self.rank])
        self.local_batch = counts[self.rank]
        glob = self.batch_size * self.num_replicas
        for step in range(len(self)):
            base = step * glob + start
            yield order[base: base + counts[self.rank]]
