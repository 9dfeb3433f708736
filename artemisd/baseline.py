"""Baselines that learn only from healthy windows.

A baseline answers "what is normal for this rank / this job / this workload".
It is the reference every later window is judged against, so a window that is
under suspicion must never enter it: otherwise a slow rank becomes its own
excuse.  The pipeline decides what is healthy; these classes only remember.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class RankBaseline:
    """What is normal for each rank, from its healthy windows.

    The arrays are per column: column ``i`` is rank ``ranks[i]``, or rank ``i``
    when ``ranks`` is None.  ``at(frame.rank)`` aligns them with a frame's rows.

    ``usual_ratio``  median of busy / island median: ~1.03 for a GPU that has
                     always been 3 % slower than its peers.
    ``busy``         median busy time, ms per step.
    ``spread``       the rank's own window-to-window variability of busy, as a
                     relative robust sigma (1.4826 x MAD / median).
    ``peer_spread``  the window-to-window variability of the rank's ratio to
                     its island median, relative robust sigma: how far this
                     rank strays from its peers in healthy windows (on a
                     loaded host, ±5-10 % from one window to the next).
    NaN where fewer than ``min_windows`` healthy windows are known (the two
    spreads: fewer than ``SPREAD_MIN_WINDOWS``).

    Kept only for jobs with an island of two (``RankHistory.record`` given
    ``comm_wait``), None otherwise; NaN below ``PAIR_MIN_WINDOWS`` windows:

    ``ratio_spread`` the window-to-window variability of the rank's ratio to
                     its island reference (in an island of two: to the other
                     rank), relative robust sigma.  Load that slows both ranks
                     of a pair cancels in the ratio, so this is the pair's
                     own noise, not the machine's.
    ``comm_wait``    median comm_wait, ms per step, from windows where the
                     rank's island partner was healthy too.
    """

    usual_ratio: np.ndarray
    busy: np.ndarray
    spread: np.ndarray
    ranks: np.ndarray | None = None  # sorted
    ratio_spread: np.ndarray | None = None
    comm_wait: np.ndarray | None = None
    peer_spread: np.ndarray | None = None

    def at(self, ranks: np.ndarray) -> RankBaseline:
        """The baseline of ``ranks`` (NaN for a rank never seen healthy), row for row."""
        if self.ranks is None or (self.ranks.size == ranks.size and np.array_equal(self.ranks, ranks)):
            return self
        if self.ranks.size == 0:
            empty = np.full(ranks.size, np.nan)
            pairs = empty if self.comm_wait is not None else None
            return RankBaseline(empty, empty, empty, None, pairs, pairs, empty)
        idx = np.minimum(np.searchsorted(self.ranks, ranks), self.ranks.size - 1)
        hit = self.ranks[idx] == ranks

        def pick(values: np.ndarray | None) -> np.ndarray | None:
            if values is None:
                return None
            out = np.full(ranks.size, np.nan)
            out[hit] = values[idx[hit]]
            return out
        return RankBaseline(pick(self.usual_ratio), pick(self.busy), pick(self.spread), None,
                            pick(self.ratio_spread), pick(self.comm_wait), pick(self.peer_spread))


# An island of two is judged only against the ranks' own histories: a spread
# taken from three windows can be near zero by chance, so ask for a few more.
PAIR_MIN_WINDOWS = 5
# The same holds for every rank's own spreads: a robust sigma of three windows
# is the smaller of two deviations (the third is the median itself).  Until a
# rank has this many, its own past does not judge it and its peer spread is
# unknown (the window's MAD alone sets sigma).
SPREAD_MIN_WINDOWS = 5


class RankHistory:
    """Per-rank busy time and ratio to the island median over the last ``depth`` healthy windows.

    Ring buffers of shape (depth, ranks seen) with a write position per
    column: a window writes only the ranks it has something to say about, so
    a rank that stays slow for longer than ``depth`` windows keeps the healthy
    past it is judged against instead of aging it out.  A column is added for
    each rank the first time it reports, never for the world size a report
    claims: memory follows the ranks that really sent something.  The medians behind ``baseline()`` cost a sort of
    the whole buffer; past the first few windows they move slowly, so they
    are then recomputed only every ``refresh`` recorded windows.
    """

    _BUFFERS = ("_ratios", "_busy", "_wait")

    def __init__(self, depth: int, min_windows: int = 3, refresh: int = 4):
        self.depth = depth
        self.min_windows = min_windows
        self.refresh = refresh
        self._ranks = np.empty(0, dtype=np.int64)  # the rank of each column, sorted
        self._every = np.empty(0, dtype=np.intp)  # columns of a frame with every known rank
        self._ratios = np.full((depth, 0), np.nan, dtype=np.float32)
        self._busy = np.full((depth, 0), np.nan, dtype=np.float32)
        self._wait: np.ndarray | None = None  # allocated for jobs with an island of two
        self._next = {name: np.zeros(0, dtype=np.int64) for name in self._BUFFERS}
        self.windows = 0
        self._cached: RankBaseline | None = None
        self._cached_at = -1

    def record(self, ranks: np.ndarray, busy: np.ndarray, ratios: np.ndarray, healthy: np.ndarray,
               job_clean: bool = True, comm_wait: np.ndarray | None = None,
               reference_healthy: np.ndarray | None = None) -> None:
        """Remember the healthy ranks of one window.

        Ratios to the island median are immune to what slows the whole job, so
        they are kept even while a job-wide incident is open; absolute busy
        times are not, and are kept only from windows where the job was clean.
        A pair's comm_wait is kept like the ratios: a job-wide rise can only
        raise the usual wait the pair rule subtracts, which makes that rule
        harder to meet, never easier; and on a loaded machine the job-wide
        check fires often enough in a young job that a pair would otherwise
        not collect ``PAIR_MIN_WINDOWS`` of them before its fault.

        ``reference_healthy`` narrows ``healthy`` for the ratios and comm_wait:
        in an island of two the reference is the other rank, and a healthy rank
        measured against a slow partner has a low ratio and a long wait that
        say nothing about itself.  ``comm_wait`` is given for jobs with an
        island of two (the only ones whose baselines use it).
        """
        columns = self._columns(ranks)
        ref = healthy if reference_healthy is None else healthy & reference_healthy
        if comm_wait is not None and self._wait is None:
            self._wait = np.full(self._busy.shape, np.nan, dtype=np.float32)
            self._next["_wait"] = np.zeros(self._busy.shape[1], dtype=np.int64)
        for name, values, keep, rows in (("_ratios", ratios, True, ref), ("_busy", busy, job_clean, healthy),
                                         ("_wait", comm_wait, True, ref)):
            buffer = getattr(self, name)
            if buffer is None or values is None or not keep:
                continue
            cols = columns[rows]
            at = self._next[name]
            buffer[at[cols], cols] = values[rows]
            at[cols] = (at[cols] + 1) % self.depth
        self.windows += 1

    def pair_windows(self) -> int | None:
        """Healthy windows the less-known rank of an island of two has (what the pair rule needs
        ``PAIR_MIN_WINDOWS`` of before it can name either rank); None for a job without such an island."""
        if self._wait is None or self._wait.shape[1] == 0:
            return None
        counts = np.sum(~np.isnan(self._wait), axis=0)
        known = counts[counts > 0]
        return int(known.min()) if known.size else 0

    def _columns(self, ranks: np.ndarray) -> np.ndarray:
        """Column of each rank (sorted, unique, as a frame's are), adding columns for new ranks."""
        if ranks.size == self._ranks.size and np.array_equal(ranks, self._ranks):
            return self._every
        known = np.union1d(self._ranks, ranks)
        if known.size != self._ranks.size:
            where = np.searchsorted(known, self._ranks)
            for name in self._BUFFERS:
                if getattr(self, name) is None:
                    continue
                grown = np.full((self.depth, known.size), np.nan, dtype=np.float32)
                grown[:, where] = getattr(self, name)
                setattr(self, name, grown)
                at = np.zeros(known.size, dtype=np.int64)
                at[where] = self._next[name]
                self._next[name] = at
            self._ranks, self._every, self._cached = known, np.arange(known.size), None
        return np.searchsorted(self._ranks, ranks)

    def baseline(self) -> RankBaseline | None:
        if self.windows < self.min_windows:
            return None
        # A young history changes with every window; an older one slowly.
        every = 1 if self.windows < 2 * self.min_windows else self.refresh
        if self._cached is None or self.windows - self._cached_at >= every:
            self._cached = self._compute()
            self._cached_at = self.windows
        return self._cached

    def _compute(self) -> RankBaseline:
        world = self._busy.shape[1]
        usual, busy, spread = (np.full(world, np.nan) for _ in range(3))
        usual[:] = _column_medians(self._ratios, self.min_windows)
        busy[:] = _column_medians(self._busy, self.min_windows)
        known = np.isfinite(busy)
        if np.any(known):
            deviation = np.abs(self._busy[:, known] - busy[known])
            spread[known] = 1.4826 * _column_medians(deviation, SPREAD_MIN_WINDOWS) / np.maximum(busy[known], 1e-9)
        peer_spread = 1.4826 * _column_medians(np.abs(self._ratios - usual), SPREAD_MIN_WINDOWS) \
            / np.maximum(usual, 1e-9)
        if self._wait is None:
            return RankBaseline(usual, busy, spread, self._ranks, peer_spread=peer_spread)
        wait = _column_medians(self._wait, PAIR_MIN_WINDOWS)
        ratio_spread = np.full(world, np.nan)
        paired = np.sum(~np.isnan(self._ratios), axis=0) >= PAIR_MIN_WINDOWS
        if np.any(paired):
            deviation = np.abs(self._ratios[:, paired] - usual[paired])
            ratio_spread[paired] = 1.4826 * _column_medians(deviation, 1) / np.maximum(usual[paired], 1e-9)
        return RankBaseline(usual, busy, spread, self._ranks, ratio_spread, wait, peer_spread)


def _column_medians(values: np.ndarray, min_count: int) -> np.ndarray:
    """Median of each column over its non-NaN entries; NaN below ``min_count`` entries.

    One sort along the short axis (NaN sorts last) and a gather of the middle
    element(s) by each column's count: ~10x faster than np.nanmedian, which
    goes through masked arrays, on a (20, 100k) history.
    """
    counts = np.sum(~np.isnan(values), axis=0)
    ordered = np.sort(values, axis=0)
    low = np.clip((counts - 1) // 2, 0, None)
    high = np.clip(counts // 2, 0, None)
    cols = np.arange(values.shape[1])
    out = 0.5 * (ordered[low, cols].astype(np.float64) + ordered[high, cols])
    out[counts < max(min_count, 1)] = np.nan
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
    calls: float = float("nan")  # the most collective calls per step of any rank; NaN if not measured
    # The ranks' wait for a CPU (run-queue wait of all threads), ms per step: the mean over ranks
    # and the median rank.  NaN where the probe does not measure it.
    run_wait: float = float("nan")
    run_wait_p50: float = float("nan")


@dataclass
class JobHistory:
    """Healthy window summaries of one job: the most recent ones and the first ones.

    ``reference`` compares against the better of the two medians.  Recent
    windows alone would let a slow ramp drag the baseline along with it (a
    link degrading over half an hour never looks 5 % worse than the last ten
    minutes); the first healthy windows anchor what this job ran like.
    """

    depth: int
    healthy: deque[JobSummary] = field(default_factory=deque)
    anchor: list[JobSummary] = field(default_factory=list)

    def record(self, summary: JobSummary) -> None:
        self.healthy.append(summary)
        while len(self.healthy) > self.depth:
            self.healthy.popleft()
        if len(self.anchor) < self.depth:
            self.anchor.append(summary)

    def ready(self, min_windows: int = 3) -> bool:
        return len(self.healthy) >= min_windows

    @staticmethod
    def _median(summaries: Iterable[JobSummary], attr: str) -> float:
        values = [v for v in (getattr(s, attr) for s in summaries) if not np.isnan(v)]
        return float(np.median(values)) if values else float("nan")

    def median(self, attr: str) -> float:
        return self._median(self.healthy, attr)

    def reference(self, attr: str) -> float:
        """The faster of the recent and the anchoring medians (ms per step)."""
        recent, first = self.median(attr), self._median(self.anchor, attr)
        return float(np.nanmin([recent, first])) if np.isfinite([recent, first]).any() else float("nan")

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
    step_p50: float
    busy: float
    comm_wait: float
    job: str
    windows: int
