"""Baselines that learn only from healthy windows.

A baseline answers "what is normal for this rank / this job / this workload".
It is the reference every later window is judged against, so a window that is
under suspicion must never enter it: otherwise a slow rank becomes its own
excuse.  The pipeline decides what is healthy; these classes only remember.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np


class RankHistory:
    """Per-rank ratio to the island median over the last ``depth`` healthy windows.

    Stored as a ring buffer of shape (depth, world) so a 100k-rank window is one
    row write; medians are computed on demand for the few ranks that need them.
    A persistently 2-3 % slower but healthy GPU shows here as a ratio of ~1.03,
    which the detector discounts instead of flagging it forever.
    """

    def __init__(self, world: int, depth: int):
        self.depth = depth
        self._ratios = np.full((depth, world), np.nan, dtype=np.float32)
        self._next = 0
        self.windows = 0

    def record(self, ranks: np.ndarray, ratios: np.ndarray, healthy: np.ndarray) -> None:
        row = self._ratios[self._next]
        row[:] = np.nan
        row[ranks[healthy]] = ratios[healthy]
        self._next = (self._next + 1) % self.depth
        self.windows += 1

    def usual_ratio(self, ranks: np.ndarray, min_windows: int = 3) -> np.ndarray:
        """Median healthy ratio of each rank; NaN where fewer than ``min_windows`` are known."""
        cols = self._ratios[:, ranks]
        known = np.sum(~np.isnan(cols), axis=0)
        out = np.full(len(ranks), np.nan)
        enough = known >= min_windows
        if np.any(enough):
            out[enough] = np.nanmedian(cols[:, enough], axis=0)
        return out


@dataclass
class JobSummary:
    """One window of a job reduced to job-wide medians (ms per step) and throughput."""

    seq: int
    step: float
    busy: float
    comm_wait: float
    data: float
    step_p50: float  # median over ranks of the per-step median step time; NaN if not measured
    throughput: float  # samples/s of the whole job; NaN when samples are not measured
    collectives: dict[str, float] = field(default_factory=dict)  # group -> ms per step


@dataclass
class JobHistory:
    """Healthy window summaries of one job (bounded)."""

    depth: int
    healthy: deque[JobSummary] = field(default_factory=deque)

    def record(self, summary: JobSummary) -> None:
        self.healthy.append(summary)
        while len(self.healthy) > self.depth:
            self.healthy.popleft()

    def ready(self, min_windows: int = 3) -> bool:
        return len(self.healthy) >= min_windows

    def median(self, attr: str) -> float:
        values = [getattr(s, attr) for s in self.healthy]
        values = [v for v in values if not np.isnan(v)]
        return float(np.median(values)) if values else float("nan")

    def collective_median(self, group: str) -> float:
        values = [s.collectives[group] for s in self.healthy if group in s.collectives]
        return float(np.median(values)) if values else float("nan")


@dataclass
class WorkloadReference:
    """What a workload signature ran like under one software fingerprint.

    Kept across jobs so that a new job of the same workload, running under a new
    driver, communication library or configuration, can be compared with the
    last healthy run (change regressions).
    """

    fingerprint: dict[str, str | None]
    step: float
    busy: float
    comm_wait: float
    job: str
    windows: int
