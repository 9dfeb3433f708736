"""One window's own stages: detect, the job-wide and change checks, and learning the baselines.

``detect_window`` judges the ranks against their island's peers and their own
past, and the job against its history (``detect.py``), into a ``Window``;
``job_wide`` keeps the job-wide flag, or finds a change regression
(``change.py``), unless the window's stragglers explain the rise; ``learn``
teaches the baselines (``baseline.py``) the window's healthy parts only.  What
the subjects under watch make of the window is ``pipeline_watch``'s.  Pure:
plain data in, plain data out.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np

from artemisd import detect, group, verify
from artemisd.baseline import JobSummary, RankBaseline, WorkloadReference
from artemisd.config import AnalysisSettings
from artemisd.frame import WindowFrame
from artemisd.incident import IncidentState
from artemisd.pipeline_assembly import JobState

STRAGGLER_SLACK = 3.0  # a step rise up to 3x the stragglers' excess is theirs: a straggler that is slow
# at everything (CPU starved, say) is also slow in its collectives, so the step rises
# by more than its busy excess


@dataclass
class Window:
    """One window as detect saw it, and what the job-wide checks made of it."""

    conditions: Hashable  # world size and island make-up: what a flag is confirmed under
    counts: np.ndarray  # ranks per island
    baseline: RankBaseline | None  # the ranks' healthy history, aligned with the frame's rows
    flags: detect.RankFlags
    masked: np.ndarray  # flagged rows hidden behind a far larger straggler
    rows: np.ndarray  # flagged rows that are subjects
    summary: JobSummary
    job_flag: detect.JobFlag | None
    bursty_job: bool  # the job's mean step rose and its median did not
    training: bool  # the ranks ran the job's training steps (``detect.training_window``)
    change: tuple[WorkloadReference, float] | None = None
    host_busy: bool = False  # a job-wide rise that the ranks' wait for a CPU explains (``JobFlag.host_busy``)
    inconclusive: set[Hashable] = field(default_factory=set)  # subjects neither flagged nor healthy


ChangeCheck = Callable[[JobState, WindowFrame, JobSummary, Hashable, float], tuple[WorkloadReference, float] | None]


def detect_window(state: JobState, frame: WindowFrame, s: AnalysisSettings) -> Window:
    """Ranks against their island's peers and their own past; the job against its history.

    The window's throughput and shape are kept in the job step's state (what verification reads)."""
    seq = frame.seq
    counts = np.bincount(frame.island, minlength=len(frame.island_names))
    conditions = (frame.world, tuple(sorted(zip(map(str, frame.island_names), counts.tolist()))))
    baseline = state.ranks.baseline()
    if baseline is not None:
        baseline = baseline.at(frame.rank)
    flags = detect.detect_ranks(frame, s, baseline)
    masked = detect.masked_rows(frame, flags)
    rows = np.flatnonzero(flags.flagged & ~masked) if masked.any() else flags.rows

    summary = detect.summarize(frame, frame.collectives)
    state.throughput.append((seq, summary.throughput))
    state.shapes.append(verify.WindowShape.of(seq, summary.throughput, frame.world, frame.samples, frame.steps,
                                              frame.busy, frame.step))

    training = detect.training_window(summary, state.history)
    job_flag = detect.detect_job(summary, state.history, s) if training else None
    bursty_job = job_flag is not None and not job_flag.steady
    if bursty_job:
        # A checkpoint write or a few steps of network congestion moved the
        # mean, not the median: not a job-wide slowdown, and not a window to
        # learn the job's baseline from either.
        job_flag = None
    return Window(conditions, counts, baseline, flags, masked, rows, summary, job_flag, bursty_job, training)


def job_wide(state: JobState, frame: WindowFrame, window: Window, change_check: ChangeCheck) -> None:
    """Keep the job-wide flag, or find a change regression, unless the stragglers explain the rise."""
    flags, rows = window.flags, window.rows
    # Stragglers — flagged now or already under watch — make every other
    # rank wait, which looks job-wide; a rise they explain is theirs.
    excess = [float(np.max(frame.busy[rows] - flags.island_median[rows]))] if rows.size else []
    excess += [w.incident.excess_ms or 0.0 for w in state.open.values()
               if w.rows_key[0] in ("rank", "node") and w.incident.state is not IncidentState.SUSPECT]
    straggler_ms = STRAGGLER_SLACK * max(excess, default=0.0)
    # A masked rank under watch is neither flagged nor healthy this window.
    window.inconclusive = {key for row in np.flatnonzero(window.masked).tolist()
                           for key in (("rank", int(frame.rank[row])),
                                       ("node", frame.node_names[int(frame.node[row])]))}
    if not window.training:
        # Every rank was away from training: no evidence for or against a job-wide or change
        # subject (one under watch neither confirms nor recovers on it).
        window.inconclusive |= {("job",), ("change",)}
        return
    job_flag = window.job_flag
    if job_flag is not None and job_flag.host_busy:
        # The host's load, not a fault (``JobFlag.host_busy``): conditions that do not match the
        # healthy windows', so evidence for nothing job-wide, and taught to no baseline.
        window.host_busy = True
        window.job_flag = None
        window.inconclusive |= {("job",), ("change",)}
        return
    if job_flag is not None and job_flag.step_ms - job_flag.baseline_step_ms <= straggler_ms:
        window.job_flag = None
        window.inconclusive.add(("job",))
    if window.job_flag is None:
        window.change = change_check(state, frame, window.summary, window.conditions, straggler_ms)
        if window.change is None and straggler_ms > 0:
            window.inconclusive.add(("change",))


def learn(state: JobState, frame: WindowFrame, window: Window,
          remember: Callable[[JobState, WindowFrame, Hashable], None]) -> None:
    """Baselines learn from healthy windows only: no flag, no open subject.

    ``remember`` keeps a clean window's workload reference (``ChangeMemory.remember``)."""
    flags, summary = window.flags, window.summary
    watched_rows = np.zeros(frame.size, dtype=bool)
    for key in state.open:
        if key[0] in ("rank", "node"):
            watched_rows |= group.rows_of(frame, key)
    healthy = ~flags.flagged & ~watched_rows
    job_clean = window.job_flag is None and window.change is None and not any(
        k[0] in ("job", "change") for k in state.open)
    paired = flags.partner >= 0
    if np.any(paired):
        # A rank of an island of two is measured against the other rank:
        # its ratio and its wait are its own only while the other is healthy.
        reference_healthy = np.ones(frame.size, dtype=bool)
        reference_healthy[paired] = healthy[flags.partner[paired]]
        state.ranks.record(frame.rank, frame.busy, flags.ratio, healthy, job_clean,
                           comm_wait=frame.comm_wait, reference_healthy=reference_healthy)
    else:
        state.ranks.record(frame.rank, frame.busy, flags.ratio, healthy, job_clean)
    # The job's own baseline: a window where no rank stood out and no
    # confirmed straggler is in force (a suspect that is quiet this window
    # does not slow it; at 10k ranks some suspect is nearly always open).
    stragglers_in_force = any(w.rows_key[0] in ("rank", "node") and w.incident.state is not IncidentState.SUSPECT
                              for w in state.open.values())
    if (job_clean and window.training and not window.host_busy and not window.bursty_job and not window.rows.size
            and not stragglers_in_force):
        state.history.record(summary)
        remember(state, frame, window.conditions)
