"""Window assembly: a job step's window reports in, its windows out, and what the analysis holds of each job step.

Per job step the reports are buffered by window ``seq``.  A window is closed
(handed to the analysis) when every rank of the job has reported it, or when a
report ``LATE_WINDOWS`` windows newer arrives (a rank that is late is the
straggler we are looking for; its report must not hold the analysis back for
ever), or when the Analyzer says so (``flush``, a ``job_end`` node event).  A
report for a window already closed is counted (``late_reports``) and dropped:
re-opening a judged window would make the result depend on arrival timing.

``JobState`` is the one record of a job step that the analysis' parts share:
its waiting windows (here), its histories and baselines (``pipeline_stages``),
its subjects under watch (``pipeline_watch``), its probes' results
(``pipeline_probes``).  Pure: plain data in, plain data out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from artemisd import verify
from artemisd.baseline import JobHistory, RankHistory
from artemisd.config import AnalysisSettings
from artemisd.confirm import Persistence
from artemisd.frame import ENV_FIELDS, WindowFrame, env_values
from artemisd.incident import Incident
from artemisd.wire import ProbeResult, WindowReport

if TYPE_CHECKING:
    from artemisd.pipeline_watch import Watched

LATE_WINDOWS = 2  # a window is analysed once a report this many windows newer arrives
# Per-job state is bounded whatever the reports say: windows waiting for
# reports (a job normally has LATE_WINDOWS + 1), job steps analysed at once
# (the least recently reported is forgotten), probe results waiting for their
# subject (``pipeline_probes.MAX_PENDING_PROBES``).  Per-rank state grows with
# the ranks that report, never with `world`.
MAX_OPEN_WINDOWS = 8
MAX_STEPS_PER_JOB = 16
THROUGHPUT_DEPTH = 512  # windows of job throughput kept for verification


@dataclass
class JobState:
    """What the analysis holds of one job step."""

    job: str
    step: str
    world: int
    ranks: RankHistory
    history: JobHistory
    persistence: Persistence
    buffers: dict[int, dict[int, WindowReport]] = field(default_factory=dict)
    closed_through: int = -1
    open: dict[Hashable, Watched] = field(default_factory=dict)
    throughput: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=THROUGHPUT_DEPTH))
    shapes: deque[verify.WindowShape] = field(default_factory=lambda: deque(maxlen=THROUGHPUT_DEPTH))
    env: dict[str, str | None] = field(default_factory=dict)
    late_reports: int = 0
    topology: int | None = None
    probes: dict[str, dict[int, ProbeResult]] = field(default_factory=dict)
    touched: int = 0  # the assembly's report count when this step last reported
    reference_key: Hashable | None = None  # the workload its reference is kept under
    # Subjects whose confirmed incident ended, with the last window they were
    # flagged in; kept RecurWindows windows, while coming back is a recurrence.
    ended: dict[Hashable, tuple[Incident, int]] = field(default_factory=dict)


class Assembly:
    """The job steps under analysis, keyed by (job, step), and the assembly of their windows from reports."""

    def __init__(self, settings: AnalysisSettings):
        self.settings = settings
        self.states: dict[tuple[str, str], JobState] = {}
        self._reports = 0

    def state(self, job: str, step: str, world: int) -> JobState:
        """The job step's state, new if it has none (forgetting the job's least recently reported step
        when it has ``MAX_STEPS_PER_JOB``)."""
        state = self.states.get((job, step))
        if state is not None:
            return state
        s = self.settings
        steps = [st for (j, _), st in self.states.items() if j == job]
        if len(steps) >= MAX_STEPS_PER_JOB:
            oldest = min(steps, key=lambda st: st.touched)
            del self.states[(job, oldest.step)]
        state = JobState(job, step, world, RankHistory(s.history_windows),
                         JobHistory(s.history_windows), Persistence(s.confirm_windows, s.confirm_seconds))
        self.states[(job, step)] = state
        return state

    def add(self, report: WindowReport) -> tuple[JobState, list[int]]:
        """Buffer one report; its job step and the windows now ready, oldest first (close each through
        ``close_through``).  A report for a window already closed is only counted."""
        state = self.state(report.job, report.step, report.world)
        self._reports += 1
        state.touched = self._reports
        seq = report.window.seq
        if seq <= state.closed_through:
            state.late_reports += 1
            return state, []
        state.buffers.setdefault(seq, {})[report.rank] = report
        ready = [s for s in state.buffers if s <= seq - LATE_WINDOWS]
        if len(state.buffers[seq]) >= state.world:
            ready.append(seq)
        if len(state.buffers) > MAX_OPEN_WINDOWS:  # windows arriving out of any order: judge the oldest
            ready.append(sorted(state.buffers)[-MAX_OPEN_WINDOWS - 1])
        return state, sorted(set(ready))

    @staticmethod
    def close_through(state: JobState, seq: int) -> Iterator[tuple[WindowFrame, dict[str, dict[int, ProbeResult]]]]:
        """Close the job step's windows up to ``seq``, oldest first: each as a frame, with the matched
        probes' results its reports carried.

        A generator, and the caller analyses each window before it asks for the
        next: a window's software fingerprint (``state.env``) must not be seen
        by the windows before it."""
        for s in sorted(k for k in state.buffers if k <= seq):
            reports = list(state.buffers.pop(s).values())
            state.closed_through = max(state.closed_through, s)
            probes: dict[str, dict[int, ProbeResult]] = {}
            for r in reports:
                if r.probe is not None:
                    probes.setdefault(r.probe.id, {})[r.rank] = r.probe
                if r.env is not None:
                    # the fingerprint's own fields (all plain strings), read by attribute: a wire model
                    # or the ingest fast path's Struct, without a serializer pass per rank
                    state.env.update({k: v for k, v in zip(ENV_FIELDS, env_values(r.env)) if v is not None})
            reports.sort(key=lambda r: r.rank)
            yield WindowFrame.from_reports(reports), probes

    def of_job(self, job: str) -> list[JobState]:
        """The job's steps."""
        return [state for (j, _), state in self.states.items() if j == job]

    def get(self, job: str, step: str) -> JobState | None:
        return self.states.get((job, step))

    def jobs(self) -> set[str]:
        return {job for job, _ in self.states}

    def forget_job(self, job: str) -> None:
        for key in [key for key in self.states if key[0] == job]:
            del self.states[key]

    def newest_window(self, job: str, step: str) -> int | None:
        """The newest window any rank of the job step has reported, closed or still waiting for its other ranks."""
        state = self.states.get((job, step))
        if state is None:
            return None
        newest = max([*state.buffers, state.closed_through])
        return newest if newest >= 0 else None
