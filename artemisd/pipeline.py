"""Analyzer: window reports in, incidents out — detect → group → confirm → localize.

The Analyzer is pure: no I/O, no clock, no randomness.  It is driven only by
the records it is given, in arrival order, so the daemon (live), ``artemis
replay`` (recorded traces) and the simulator's benchmarks all run exactly this
code and reach the same conclusions from the same records.

Per job step it assembles each window from the ranks' reports
(``pipeline_assembly.py``).  A window is analysed when every rank of the job
has reported it, or when a report two windows later arrives (a rank that is
late is the straggler we are looking for; its report must not hold the
analysis back for ever), or on ``flush``.

Per window (``Analyzer._analyze``), each stage in its own module:

0. take the matched probes' results that came back (``pipeline_probes.py``,
   ``confirm.py``);
1. **detect** ranks against island peers and the job against its history
   (``pipeline_stages.py``, ``detect.py``);
2. **group** flagged ranks (``group.py``): two or more on one node are one
   **node** subject; a job-wide slowdown that stragglers do not explain is one
   **job** subject; a job of a known workload running slower than before a
   software change is one **change** subject (``change.py``, its memory across
   jobs ``pipeline_change.py``);
3. **confirm** each subject by persistence under matched conditions
   (``pipeline_watch.py``, ``confirm.py``): first flag → incident in state
   ``suspect``; persistent → ``confirmed`` and **localized** (``localize.py``),
   with a proposed remedy (``remedy.py``); stopped before persisting →
   ``dismissed``; healthy long enough → recovered, and a recurrence when it
   comes back soon (``pipeline_watch.py`` says how);
4. learn **baselines** from the window's healthy parts only
   (``pipeline_stages.py``, ``baseline.py``).

What stays here is the wiring of those parts and the Analyzer's surface: the
records in, the incidents (``incidents``, ``subject_active``), the probe
requests (``pending_probes``) and each job's recent throughput out.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from artemisd import detect, group, verify
from artemisd.baseline import WorkloadReference
from artemisd.config import AnalysisSettings
from artemisd.frame import WindowFrame
from artemisd.incident import Incident
from artemisd.pipeline_assembly import LATE_WINDOWS, MAX_OPEN_WINDOWS, MAX_STEPS_PER_JOB, Assembly, JobState
from artemisd.pipeline_change import ChangeMemory
from artemisd.pipeline_probes import MAX_PENDING_PROBES, PROBE_AFTER_FLAGS, ProbeDesk, ProbeRequest
from artemisd.pipeline_stages import detect_window, job_wide, learn
from artemisd.pipeline_watch import IncidentBook, Watch
from artemisd.wire import NodeEvent, ProbeResult, WindowReport

# What other modules and the tests import from here, wherever it is defined.
__all__ = ["Analyzer", "ProbeRequest", "analyze_records", "LATE_WINDOWS", "MAX_OPEN_WINDOWS", "MAX_STEPS_PER_JOB",
           "MAX_PENDING_PROBES", "PROBE_AFTER_FLAGS"]


class Analyzer:
    """Pure detect → group → confirm → localize over a stream of wire records."""

    def __init__(
        self,
        settings: AnalysisSettings | None = None,
        id_prefix: str = "INC-",
        first_id: int = 1,
        active_probe: bool = False,
    ):
        self.settings = settings or AnalysisSettings()
        self._assembly = Assembly(self.settings)  # the job steps' state and their windows' reports
        self._book = IncidentBook(id_prefix, first_id)  # the incidents reported and their ids
        self._changes = ChangeMemory(self.settings)  # workload references, nodes' fingerprints
        self._probes = ProbeDesk(self.settings, active_probe)  # matched probes asked for and judged
        self._watch = Watch(self.settings, self._book, self._probes, self._changes.fingerprint)

    @property
    def incidents(self) -> list[Incident]:
        """Every incident reported, in the order they were given their ids (the live objects)."""
        return self._book.incidents

    @property
    def id_prefix(self) -> str:
        return self._book.id_prefix

    @property
    def active_probe(self) -> bool:
        return self._probes.active

    # -- input ---------------------------------------------------------------

    def ingest(self, record: WindowReport | NodeEvent) -> list[Incident]:
        """Take one record; return copies of the incidents it created or changed."""
        if isinstance(record, NodeEvent):
            return self._node_event(record)
        state, ready = self._assembly.add(record)
        updates: list[Incident] = []
        for seq in ready:
            updates.extend(self._close_through(state, seq))
        return updates

    def flush(self) -> list[Incident]:
        """End of input: analyse every window still waiting for reports."""
        return self._close_all(self._assembly.states.values())

    def analyze_frame(self, frame: WindowFrame) -> list[Incident]:
        """Analyse one assembled window (the cost benchmark's entry point)."""
        state = self._assembly.state(frame.job, frame.job_step, frame.world)
        state.closed_through = max(state.closed_through, frame.seq)
        return self._analyze(state, frame, {})

    # -- output ----------------------------------------------------------------

    def pending_probes(self) -> list[ProbeRequest]:
        """Probe requests raised since the last call (each returned once)."""
        return self._probes.pending()

    def probe_outstanding(self, incident_id: str) -> bool:
        """A matched probe was requested for this incident and its results are not judged yet."""
        return self._probes.outstanding(self._assembly.states.values(), incident_id)

    def subject_active(self, incident_id: str) -> bool:
        """False once the incident's subject has been healthy for RecoverWindows windows."""
        return self._book.active(incident_id)

    def throughput(self, job: str, step: str = "0") -> list[tuple[int, float]]:
        """(window seq, samples/s of the whole job) for the job's recent windows."""
        state = self._assembly.get(job, step)
        return list(state.throughput) if state else []

    def window_shapes(self, job: str, step: str = "0") -> list[verify.WindowShape]:
        """What each recent window of the job measured, and under which shape (ranks, work per step)."""
        state = self._assembly.get(job, step)
        return list(state.shapes) if state else []

    def newest_window(self, job: str, step: str = "0") -> int | None:
        """The newest window any rank of the job has reported, analysed or still waiting for its other ranks.

        A slowed rank's reports can arrive up to ``LATE_WINDOWS`` windows after
        its peers'; the windows its peers already reported had started by then.
        """
        return self._assembly.newest_window(job, step)

    def jobs(self) -> set[str]:
        """The jobs whose state this analyzer holds."""
        return self._assembly.jobs()

    def forget_job(self, job: str) -> list[str]:
        """Drop everything held of a job that ended with its incidents closed; the ids of its incidents.

        A daemon runs for months: what it holds of the jobs it has seen end
        would grow without bound (about 1 kB a rank), and the scans over it
        (the job's fingerprint, ``probe_outstanding``) with it.  What is learnt
        across jobs (the workload references) stays."""
        self._assembly.forget_job(job)
        self._changes.forget_job(job)
        return self._book.forget_job(job)

    # What the tests look inside: the job steps' state, the workload references.

    @property
    def _jobs(self) -> dict[tuple[str, str], JobState]:
        return self._assembly.states

    @property
    def _references(self) -> dict[Hashable, list[WorkloadReference]]:
        return self._changes.references

    # -- windows -----------------------------------------------------------------

    def _node_event(self, event: NodeEvent) -> list[Incident]:
        self._changes.note(event)
        if event.event == "job_end" and event.job is not None:
            return self._close_all(self._assembly.of_job(event.job))
        return []

    def _close_all(self, states: Iterable[JobState]) -> list[Incident]:
        """Analyse every window the job steps are still waiting for reports of."""
        updates: list[Incident] = []
        for state in states:
            if state.buffers:
                updates.extend(self._close_through(state, max(state.buffers)))
        return updates

    def _close_through(self, state: JobState, seq: int) -> list[Incident]:
        updates: list[Incident] = []
        for frame, probes in self._assembly.close_through(state, seq):  # each analysed before the next closes
            updates.extend(self._analyze(state, frame, probes))
        return updates

    def _analyze(self, state: JobState, frame: WindowFrame,
                 probes: dict[str, dict[int, ProbeResult]]) -> list[Incident]:
        """One window through the stages; copies of the incidents it created or changed."""
        changed: dict[str, Incident] = {}
        # A rank held off a CPU inside its collectives slows everyone there: that wait is its own time.
        frame = detect.with_own_cpu_wait(
            frame, detect.own_cpu_wait(frame, self.settings, state.history.reference("comm_wait")))
        self._probes.take_results(state, frame, probes, changed)
        window = detect_window(state, frame, self.settings)
        grouping = group.straggler_subjects(frame, window.rows, state.open.keys())
        self._watch.regroup(state, grouping)
        job_wide(state, frame, window, self._changes.check)
        flagged = self._watch.observe_window(state, frame, window, grouping.subjects, changed)
        self._watch.recover(state, frame.seq, flagged | window.inconclusive, changed)
        learn(state, frame, window, self._changes.remember)
        return [inc.model_copy(deep=True) for inc in changed.values()]


def analyze_records(records: Iterable[WindowReport | NodeEvent], analyzer: Analyzer) -> list[Incident]:
    """Feed records through an analyzer and flush; return every update in order."""
    updates: list[Incident] = []
    for record in records:
        updates.extend(analyzer.ingest(record))
    updates.extend(analyzer.flush())
    return updates

