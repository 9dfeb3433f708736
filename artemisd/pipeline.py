"""Analyzer: window reports in, incidents out — detect → group → confirm → localize.

The Analyzer is pure: no I/O, no clock, no randomness.  It is driven only by
the records it is given, in arrival order, so the daemon (live), ``artemis
replay`` (recorded traces) and the simulator's benchmarks all run exactly this
code and reach the same conclusions from the same records.

Per job step it assembles each window from the ranks' reports.  A window is
analysed when every rank of the job has reported it, or when a report two
windows later arrives (a rank that is late is the straggler we are looking for;
its report must not hold the analysis back for ever), or on ``flush``.

Per window (``Analyzer._analyze``), each stage in its own module:

0. take the matched probes' results that came back (``confirm.py``);
1. **detect** ranks against island peers and the job against its history
   (``detect.py``);
2. **group** flagged ranks (``group.py``): two or more on one node are one
   **node** subject; a job-wide slowdown that stragglers do not explain is one
   **job** subject; a job of a known workload running slower than before a
   software change is one **change** subject (``change.py``);
3. **confirm** each subject by persistence under matched conditions
   (``confirm.py``): first flag → incident in state ``suspect``; persistent →
   ``confirmed`` and **localized** (``localize.py``), with a proposed remedy
   (``remedy.py``); stopped before persisting → ``dismissed``;
4. learn **baselines** from the window's healthy parts only (``baseline.py``).

What stays here is the incidents' state: their ids, the subjects under watch,
recovery and recurrences, the probe requests.

A subject healthy for ``RecoverWindows`` windows has recovered: its incident
ends (``subject_active`` turns False).  When the same subject is confirmed
again within ``RecurWindows`` windows of its last flag, that is the same fault
coming back, not a new one: the incident keeps its id, a ``Recurrence`` is
appended to its ``recurrences``, and its measures, cause and evidence become
the latest occurrence's (onset, flagged and confirmed windows stay the
first's).  ``ingest`` then returns the incident in state ``confirmed`` with
the grown list, and ``subject_active`` is True again until it recovers again.
While the recurrence is only suspect nothing is returned for it (a suspect
that never confirms is no recurrence); a matched probe asked for meanwhile
names the incident's id.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

import numpy as np

from artemisd import change, detect, group, verify
from artemisd.baseline import PAIR_MIN_WINDOWS, JobHistory, JobSummary, RankBaseline, RankHistory, WorkloadReference
from artemisd.config import AnalysisSettings
from artemisd.confirm import (Persistence, ProbeJudgement, Verdict, agree_on_link, ask_again_about_link, judge_probe,
                              take_probe_verdict)
from artemisd.frame import ENV_FIELDS, WindowFrame, env_values
from artemisd.incident import Cause, Evidence, Incident, IncidentKind, IncidentState, Recurrence
from artemisd.localize import (Diagnosis, IslandPeers, counter_explains, diagnose_change, diagnose_job,
                               diagnose_straggler, own_history_evidence, straggler_measures)
from artemisd.remedy import propose
from artemisd.wire import NodeEvent, ProbeResult, WindowReport

LATE_WINDOWS = 2  # a window is analysed once a report this many windows newer arrives
# Per-job state is bounded whatever the reports say: windows waiting for
# reports (a job normally has LATE_WINDOWS + 1), job steps analysed at once
# (the least recently reported is forgotten), probe results waiting for their
# subject.  Per-rank state grows with the ranks that report, never with `world`.
MAX_OPEN_WINDOWS = 8
MAX_STEPS_PER_JOB = 16
MAX_PENDING_PROBES = 16
# A matched probe is asked for once a suspect is flagged in this many windows (or confirms): a
# job's probes are few (ProbeMinInterval, ProbeMaxPerHour), and a suspect flagged once is more
# often a start-up or scheduling blip, dismissed a window later, than a fault.  Spent on it, the
# probe was not there for the degraded link flagged a minute later (issue 28).
PROBE_AFTER_FLAGS = 2
THROUGHPUT_DEPTH = 512  # windows of job throughput kept for verification
STRAGGLER_SLACK = 3.0  # a step rise up to 3x the stragglers' excess is theirs: a straggler that is slow
# at everything (CPU starved, say) is also slow in its collectives, so the step rises
# by more than its busy excess
# What a recurrence refreshes in its incident: the latest occurrence is the one in force.
LATEST_OCCURRENCE_FIELDS = ("ratio", "excess_ms", "loss_pct", "measured_loss_pct", "cause", "confidence",
                            "evidence", "action")


@dataclass(frozen=True)
class ProbeRequest:
    """Ask a job's probes for the matched micro-benchmark (active confirmation)."""

    id: str
    job: str
    step: str
    ranks: tuple[int, ...]
    reason: str
    incident: str
    corroborates: bool = False  # a second probe asked to confirm the first one's link verdict


@dataclass
class _Open:
    """An incident whose subject is still being watched."""

    incident: Incident
    subject: Hashable
    rows_key: tuple  # ("rank", r) | ("node", name) | ("job",) | ("change",)
    measures: list[tuple[float, float, float]] = field(default_factory=list)
    healthy_windows: int = 0
    probe: ProbeJudgement | None = None
    probe_id: str | None = None
    probe_waiting: bool = False  # requested, results not yet judged
    judgements: list[ProbeJudgement] = field(default_factory=list)  # job-wide subjects: every probe's
    comm_bound: bool | None = None  # a job-wide subject: its rise was in the collectives (set when confirmed)
    last_flagged: int = -1
    # The ended incident this subject may be coming back as; until it confirms,
    # ``incident`` is a draft under that incident's id that nobody is shown.
    recurrence_of: Incident | None = None


@dataclass
class _JobState:
    job: str
    step: str
    world: int
    ranks: RankHistory
    history: JobHistory
    persistence: Persistence
    buffers: dict[int, dict[int, WindowReport]] = field(default_factory=dict)
    closed_through: int = -1
    open: dict[Hashable, _Open] = field(default_factory=dict)
    throughput: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=THROUGHPUT_DEPTH))
    shapes: deque[verify.WindowShape] = field(default_factory=lambda: deque(maxlen=THROUGHPUT_DEPTH))
    env: dict[str, str | None] = field(default_factory=dict)
    late_reports: int = 0
    topology: int | None = None
    probes: dict[str, dict[int, ProbeResult]] = field(default_factory=dict)
    touched: int = 0  # the analyzer's ingest count when this step last reported
    reference_key: Hashable | None = None  # the workload its reference is kept under
    # Subjects whose confirmed incident ended, with the last window they were
    # flagged in; kept RecurWindows windows, while coming back is a recurrence.
    ended: dict[Hashable, tuple[Incident, int]] = field(default_factory=dict)


@dataclass
class _Window:
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
        self.id_prefix = id_prefix
        self._next_id = first_id
        self._next_probe = 1
        self.active_probe = active_probe
        self.incidents: list[Incident] = []
        self._jobs: dict[tuple[str, str], _JobState] = {}
        self._node_fingerprints: dict[tuple[str, str], dict[str, str | None]] = {}
        self._references: dict[Hashable, list[WorkloadReference]] = {}
        self._probe_requests: list[ProbeRequest] = []
        self._ended: dict[str, int] = {}
        self._ingested = 0

    # -- input ---------------------------------------------------------------

    def ingest(self, record: WindowReport | NodeEvent) -> list[Incident]:
        """Take one record; return copies of the incidents it created or changed."""
        if isinstance(record, NodeEvent):
            return self._node_event(record)
        state = self._job(record)
        self._ingested += 1
        state.touched = self._ingested
        seq = record.window.seq
        if seq <= state.closed_through:
            state.late_reports += 1
            return []
        state.buffers.setdefault(seq, {})[record.rank] = record
        updates: list[Incident] = []
        ready = [s for s in state.buffers if s <= seq - LATE_WINDOWS]
        if len(state.buffers[seq]) >= state.world:
            ready.append(seq)
        if len(state.buffers) > MAX_OPEN_WINDOWS:  # windows arriving out of any order: judge the oldest
            ready.append(sorted(state.buffers)[-MAX_OPEN_WINDOWS - 1])
        for s in sorted(set(ready)):
            updates.extend(self._close_through(state, s))
        return updates

    def flush(self) -> list[Incident]:
        """End of input: analyse every window still waiting for reports."""
        updates: list[Incident] = []
        for state in self._jobs.values():
            if state.buffers:
                updates.extend(self._close_through(state, max(state.buffers)))
        return updates

    def pending_probes(self) -> list[ProbeRequest]:
        """Probe requests raised since the last call (each returned once)."""
        requests, self._probe_requests = self._probe_requests, []
        return requests

    def throughput(self, job: str, step: str = "0") -> list[tuple[int, float]]:
        """(window seq, samples/s of the whole job) for the job's recent windows."""
        state = self._jobs.get((job, step))
        return list(state.throughput) if state else []

    def newest_window(self, job: str, step: str = "0") -> int | None:
        """The newest window any rank of the job has reported, analysed or still waiting for its other ranks.

        A slowed rank's reports can arrive up to ``LATE_WINDOWS`` windows after
        its peers'; the windows its peers already reported had started by then.
        """
        state = self._jobs.get((job, step))
        if state is None:
            return None
        newest = max([*state.buffers, state.closed_through])
        return newest if newest >= 0 else None

    def window_shapes(self, job: str, step: str = "0") -> list[verify.WindowShape]:
        """What each recent window of the job measured, and under which shape (ranks, work per step)."""
        state = self._jobs.get((job, step))
        return list(state.shapes) if state else []

    def probe_outstanding(self, incident_id: str) -> bool:
        """A matched probe was requested for this incident and its results are not judged yet."""
        for state in self._jobs.values():
            for watched in state.open.values():
                if watched.incident.id == incident_id:
                    return watched.probe_waiting
        return False

    def subject_active(self, incident_id: str) -> bool:
        """False once the incident's subject has been healthy for RecoverWindows windows."""
        return incident_id not in self._ended

    def jobs(self) -> set[str]:
        """The jobs whose state this analyzer holds."""
        return {job for job, _ in self._jobs}

    def forget_job(self, job: str) -> list[str]:
        """Drop everything held of a job that ended with its incidents closed; the ids of its incidents.

        A daemon runs for months: what it holds of the jobs it has seen end
        would grow without bound (about 1 kB a rank), and the scans over it
        (``_fingerprint``, ``probe_outstanding``) with it.  What is learnt
        across jobs (the workload references) stays."""
        for key in [key for key in self._jobs if key[0] == job]:
            del self._jobs[key]
        for key in [key for key in self._node_fingerprints if key[0] == job]:
            del self._node_fingerprints[key]
        gone = [incident.id for incident in self.incidents if incident.job == job]
        if gone:
            self.incidents = [incident for incident in self.incidents if incident.job != job]
            for incident_id in gone:
                self._ended.pop(incident_id, None)
        return gone

    def analyze_frame(self, frame: WindowFrame) -> list[Incident]:
        """Analyse one assembled window (the cost benchmark's entry point)."""
        state = self._jobs.get((frame.job, frame.job_step))
        if state is None:
            state = self._new_job(frame.job, frame.job_step, frame.world)
        state.closed_through = max(state.closed_through, frame.seq)
        return self._analyze(state, frame, {})

    # -- bookkeeping -----------------------------------------------------------

    def _new_job(self, job: str, step: str, world: int) -> _JobState:
        s = self.settings
        steps = [st for (j, _), st in self._jobs.items() if j == job]
        if len(steps) >= MAX_STEPS_PER_JOB:
            oldest = min(steps, key=lambda st: st.touched)
            del self._jobs[(job, oldest.step)]
        state = _JobState(job, step, world, RankHistory(s.history_windows),
                          JobHistory(s.history_windows), Persistence(s.confirm_windows, s.confirm_seconds))
        self._jobs[(job, step)] = state
        return state

    def _job(self, report: WindowReport) -> _JobState:
        state = self._jobs.get((report.job, report.step))
        if state is None:
            state = self._new_job(report.job, report.step, report.world)
        return state

    def _node_event(self, event: NodeEvent) -> list[Incident]:
        if event.job is not None and event.fingerprint is not None:
            self._node_fingerprints[(event.job, event.node)] = event.fingerprint.model_dump()
        updates: list[Incident] = []
        if event.event == "job_end" and event.job is not None:
            for state in [s for (job, _), s in self._jobs.items() if job == event.job]:
                if state.buffers:
                    updates.extend(self._close_through(state, max(state.buffers)))
        return updates

    def _new_incident(self, state: _JobState, kind: IncidentKind, seq: int, onset: int, **subject) -> Incident:
        incident = Incident(id="", job=state.job, kind=kind, onset_window=onset, flagged_window=seq, **subject)
        self._register(incident)
        return incident

    def _register(self, incident: Incident) -> None:
        """Give an incident its own id and report it from now on."""
        incident.id = f"{self.id_prefix}{self._next_id}"
        self._next_id += 1
        self.incidents.append(incident)

    def _recurring(self, state: _JobState, key: Hashable, seq: int) -> Incident | None:
        """The subject's ended incident, when it was last flagged within RecurWindows of ``seq``."""
        ended = state.ended.get(key)
        if ended is None or seq - ended[1] > self.settings.recur_windows:
            return None
        return ended[0]

    def _close_through(self, state: _JobState, seq: int) -> list[Incident]:
        updates: list[Incident] = []
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
            updates.extend(self._analyze(state, WindowFrame.from_reports(reports), probes))
        return updates

    # -- analysis --------------------------------------------------------------

    def _analyze(self, state: _JobState, frame: WindowFrame,
                 probes: dict[str, dict[int, ProbeResult]]) -> list[Incident]:
        changed: dict[str, Incident] = {}
        # A rank held off a CPU inside its collectives slows everyone there: that wait is its own time.
        frame = detect.with_own_cpu_wait(
            frame, detect.own_cpu_wait(frame, self.settings, state.history.reference("comm_wait")))
        self._take_probe_results(state, frame, probes, changed)
        window = self._detect(state, frame)
        grouping = group.straggler_subjects(frame, window.rows, state.open.keys())
        self._regroup(state, grouping)
        self._job_wide(state, frame, window)
        flagged = self._observe_subjects(state, frame, window, grouping.subjects, changed)
        self._watch_recovery(state, frame.seq, flagged | window.inconclusive, changed)
        self._learn(state, frame, window)
        return [inc.model_copy(deep=True) for inc in changed.values()]

    def _detect(self, state: _JobState, frame: WindowFrame) -> _Window:
        """Ranks against their island's peers and their own past; the job against its history."""
        s = self.settings
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
        return _Window(conditions, counts, baseline, flags, masked, rows, summary, job_flag, bursty_job, training)

    def _regroup(self, state: _JobState, grouping: group.Grouping) -> None:
        for rank_key, node_key in grouping.grown:
            self._rekey(state, rank_key, node_key)
        for rank_key in grouping.absorbed:
            self._absorb(state, rank_key)

    def _job_wide(self, state: _JobState, frame: WindowFrame, window: _Window) -> None:
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
            window.change = self._change_check(state, frame, window.summary, window.conditions, straggler_ms)
            if window.change is None and straggler_ms > 0:
                window.inconclusive.add(("change",))

    def _observe_subjects(self, state: _JobState, frame: WindowFrame, window: _Window,
                          subjects: dict[Hashable, np.ndarray], changed: dict[str, Incident]) -> set[Hashable]:
        """Confirm each flagged subject by persistence, localizing it once it is; return their keys."""
        s = self.settings
        seq = frame.seq
        flags, baseline, summary, conditions = window.flags, window.baseline, window.summary, window.conditions
        flagged_keys: set[Hashable] = set()
        step_ms = float(np.median(frame.step))
        for key, subject_rows in subjects.items():
            flagged_keys.add(key)
            island = frame.island_names[int(frame.island[subject_rows[0]])]
            peers = IslandPeers(frame, subject_rows, int(window.counts[frame.island[subject_rows[0]]]))
            steady = bool(np.mean(flags.steady[subject_rows]) >= 0.5)
            node = frame.node_names[int(frame.node[subject_rows[0]])]
            # Until the rank's usual ratio and its own noise are known, one steady window more.
            strict = baseline is None or bool(np.isnan(baseline.usual_ratio[subject_rows]).any()) or (
                baseline.peer_spread is not None and bool(np.isnan(baseline.peer_spread[subject_rows]).any()))
            self._observe(state, key, seq, (conditions, island, node), (steady, strict), frame, changed,
                          lambda r=subject_rows, p=peers: straggler_measures(frame, r, p, flags, step_ms),
                          lambda r=subject_rows, p=peers, o=None: diagnose_straggler(
                              frame, r, p.rows, s.confidence_floor, o, own_history_evidence(frame, r, flags, baseline)),
                          island=island, rows=subject_rows,
                          explained=lambda r=subject_rows, p=peers: counter_explains(frame, r, p.rows))
        job_flag = window.job_flag
        if job_flag is not None:
            key = ("job",)
            flagged_keys.add(key)
            loss = 100.0 * (job_flag.step_ms - job_flag.baseline_step_ms) / max(job_flag.step_ms, 1e-9)
            watched = state.open.get(key)
            self._observe(state, key, seq, conditions, (True, False), frame, changed,
                          lambda: (job_flag.step_ratio, job_flag.step_ms - job_flag.baseline_step_ms, loss),
                          None, job_flag=job_flag, summary=summary,
                          explained=lambda: diagnose_job(job_flag, frame, summary, state.history, s.confidence_floor,
                                                         watched.probe if watched is not None else None
                                                         ).diagnosis.cause is not Cause.UNKNOWN,
                          need_seconds=(max(s.job_confirm_seconds, s.confirm_seconds), s.confirm_seconds))
        if window.change is not None:
            key = ("change",)
            flagged_keys.add(key)
            reference, ratio = window.change
            excess = summary.step - reference.step
            self._observe(state, key, seq, conditions, (True, False), frame, changed,
                          lambda: (ratio, excess, 100.0 * excess / max(summary.step, 1e-9)),
                          None, reference=reference, summary=summary)
        return flagged_keys

    def _learn(self, state: _JobState, frame: WindowFrame, window: _Window) -> None:
        """Baselines learn from healthy windows only: no flag, no open subject."""
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
        if job_clean and window.training and not window.host_busy and not window.bursty_job and not window.rows.size and not stragglers_in_force:
            state.history.record(summary)
            self._remember_reference(state, frame, window.conditions)

    def _rekey(self, state: _JobState, old: Hashable, new: Hashable) -> None:
        """A rank incident grows into its node's: same incident, node subject."""
        watched = state.open.pop(old)
        watched.subject = new
        watched.rows_key = new
        incident = watched.incident
        if watched.recurrence_of is not None:
            # It came back as a rank and grew into its node: a node is another
            # subject than the rank whose incident had ended.
            watched.recurrence_of = None
            self._register(incident)
        incident.kind = IncidentKind.NODE
        incident.rank = None
        streak = state.persistence.streaks.pop(old, None)
        if streak is not None:
            state.persistence.streaks[new] = streak
        state.open[new] = watched

    def _absorb(self, state: _JobState, old: Hashable) -> None:
        """A second rank incident on a node that already has a node incident: drop it."""
        watched = state.open.pop(old)
        state.persistence.forget(old)
        if watched.incident.state is IncidentState.SUSPECT:
            watched.incident.advance(IncidentState.DISMISSED)

    def _observe(self, state: _JobState, key: Hashable, seq: int, conditions: Hashable,
                 steadiness: tuple[bool, bool],
                 frame: WindowFrame, changed: dict[str, Incident],
                 measures: Callable[[], tuple[float, float, float]],
                 diagnose: Callable[..., Diagnosis] | None, explained: Callable[[], bool] | None = None,
                 need_seconds: tuple[float, float] | None = None, **context) -> None:
        verdict, streak = state.persistence.observe(key, seq, conditions, *steadiness,
                                                    seconds=float(np.median(frame.seconds)), explained=explained,
                                                    need_seconds=need_seconds)
        watched = state.open.get(key)
        if watched is None and verdict is not Verdict.CONFIRMED and not steadiness[0] and len(streak.flagged) < 2:
            # A lone bursty flag (a GC pause, a blip of a few steps) is only
            # remembered: it opens no suspect, which at 100k ranks would mean
            # hundreds of incidents a window that all end dismissed.
            return
        if watched is not None and watched.incident.state is not IncidentState.SUSPECT:
            watched.healthy_windows = 0  # a confirmed incident still in force
            watched.last_flagged = seq
            self._ask_about_links_again(state, watched, frame, context.get("job_flag"))
            return
        if watched is None:
            kind = {"rank": IncidentKind.RANK, "node": IncidentKind.NODE,
                    "job": IncidentKind.JOB, "change": IncidentKind.CHANGE}[key[0]]
            subject: dict = {}
            if key[0] == "rank":
                row = int(context["rows"][0])
                subject = {"rank": key[1], "node": frame.node_names[int(frame.node[row])]}
            elif key[0] == "node":
                subject = {"node": key[1]}
            if "island" in context:
                subject["island"] = context["island"]
            recurring = self._recurring(state, key, seq)
            if recurring is None:
                incident = self._new_incident(state, kind, seq, streak.onset, **subject)
            else:
                incident = Incident(id=recurring.id, job=state.job, kind=kind, onset_window=streak.onset,
                                    flagged_window=seq, **subject)
            watched = state.open[key] = _Open(incident, key, key, recurrence_of=recurring)
        watched.measures.append(measures())
        if (self.active_probe and watched.probe_id is None and key[0] in ("rank", "node", "job")
                and (len(streak.flagged) >= PROBE_AFTER_FLAGS or verdict is Verdict.CONFIRMED)):
            # A job-wide slowdown has no suspect rank; its probe is about the links.
            self._request_probe(state, watched, frame, context.get("rows", np.array([], dtype=int)))
        watched.last_flagged = seq
        incident = watched.incident
        incident.flagged_window = seq
        if watched.recurrence_of is None:
            changed[incident.id] = incident
        if verdict is not Verdict.CONFIRMED:
            return
        incident.onset_window = streak.onset
        self._confirm(state, watched, seq, frame, diagnose, context)
        if watched.recurrence_of is not None:
            self._recur(state, watched, changed)

    def _recur(self, state: _JobState, watched: _Open, changed: dict[str, Incident]) -> None:
        """A subject whose incident had ended is confirmed again: record the recurrence in that incident."""
        first, latest = watched.recurrence_of, watched.incident
        assert first is not None
        watched.recurrence_of = None
        subject = ("kind", "rank", "node", "link", "island")
        if any(getattr(latest, f) != getattr(first, f) for f in subject):
            # A job-wide slowdown localised elsewhere this time (another link,
            # another island): another subject, so another incident.
            self._register(latest)
            changed[latest.id] = latest
            return
        first.recurrences.append(Recurrence(onset_window=latest.onset_window, confirmed_window=latest.confirmed_window,
                                            ratio=latest.ratio, loss_pct=latest.loss_pct))
        for name in LATEST_OCCURRENCE_FIELDS:
            setattr(first, name, getattr(latest, name))
        watched.incident = first
        state.ended.pop(watched.subject, None)
        self._ended.pop(first.id, None)
        changed[first.id] = first

    def _confirm(self, state: _JobState, watched: _Open, seq: int, frame: WindowFrame,
                 diagnose: Callable[..., Diagnosis] | None, context: dict) -> None:
        incident = watched.incident
        ratio, excess, loss = (float(np.mean([m[i] for m in watched.measures])) for i in range(3))
        incident.ratio, incident.excess_ms, incident.loss_pct = round(ratio, 3), round(excess, 2), round(loss, 2)
        kind = watched.rows_key[0]
        if kind in ("rank", "node"):
            diagnosis = diagnose(o=watched.probe) if watched.probe is not None else diagnose()
        elif kind == "job":
            watched.comm_bound = context["job_flag"].comm_bound
            job_diag = diagnose_job(context["job_flag"], frame, context["summary"], state.history,
                                    self.settings.confidence_floor, watched.probe)
            diagnosis = job_diag.diagnosis
            incident.kind = IncidentKind(job_diag.kind)
            incident.node, incident.island, incident.link = job_diag.node, job_diag.island, job_diag.link
        else:
            diagnosis = diagnose_change(context["reference"], self._fingerprint(state), context["summary"])
        incident.cause = diagnosis.cause
        incident.confidence = diagnosis.confidence
        incident.evidence = list(diagnosis.evidence)
        if kind == "job":
            incident.evidence.extend(self._pair_too_young(state))
        healthy = verify.baseline(state.throughput, incident.onset_window)
        slowed = verify.during(state.throughput, incident.onset_window, seq)
        incident.measured_loss_pct = verify.measured_loss(healthy, slowed)
        disagreement = verify.loss_evidence(incident.loss_pct, healthy, slowed)
        if disagreement is not None:
            incident.evidence.append(Evidence(**disagreement))
        incident.confirmed_window = seq
        incident.action = propose(incident.kind, incident.cause, incident.node, incident.job, link=incident.link)
        incident.advance(IncidentState.CONFIRMED)

    @staticmethod
    def _pair_too_young(state: _JobState) -> list[Evidence]:
        """Why a job-wide incident of a job with an island of two names no rank, when the reason is
        that the pair is too young: a rank of two is named against its own healthy windows, and
        until it has ``PAIR_MIN_WINDOWS`` of them a slowed rank reads as the whole job slowing."""
        known = state.ranks.pair_windows()
        if known is None or known >= PAIR_MIN_WINDOWS:
            return []
        return [Evidence(signal="missing", value="which rank of an island of two is slow",
                         note=f"each rank of two is judged against its own healthy windows: {known} of the "
                              f"{PAIR_MIN_WINDOWS} needed so far; a rank is named once it has them")]

    def _watch_recovery(self, state: _JobState, seq: int, flagged: set[Hashable],
                        changed: dict[str, Incident]) -> None:
        for key in state.persistence.close_window(seq):
            watched = state.open.get(key)
            if watched is not None and watched.incident.state is IncidentState.SUSPECT:
                watched.incident.advance(IncidentState.DISMISSED)
                if watched.recurrence_of is None:  # a recurrence's draft was never shown
                    changed[watched.incident.id] = watched.incident
                del state.open[key]
        for key, watched in list(state.open.items()):
            if key in flagged or watched.incident.state is IncidentState.SUSPECT:
                continue
            watched.healthy_windows += 1
            if watched.healthy_windows >= self.settings.recover_windows:
                self._ended[watched.incident.id] = seq
                if self.settings.recur_windows > 0:
                    state.ended[key] = (watched.incident, watched.last_flagged)
                state.persistence.forget(key)
                del state.open[key]
        for key, (_, last_flagged) in list(state.ended.items()):
            if seq - last_flagged > self.settings.recur_windows and key not in state.open:
                del state.ended[key]

    # -- active probe ------------------------------------------------------------

    def _ask_about_links_again(self, state: _JobState, watched: _Open, frame: WindowFrame,
                               flag: detect.JobFlag | None) -> None:
        """A confirmed job-wide incident whose rise was in the ranks' own work, now in the collectives:
        a new question, about the links, with probes of its own.

        Seen at the shipped defaults on the test cluster: a job-wide slowdown of the
        loaded box confirmed in the job's first windows (every rank's work rose),
        its probe answered "normal"; a link degraded a minute later only made that
        incident's job slower still, and no probe asked about the link again.  The
        request waits for ``ProbeMinInterval`` like any first probe.
        """
        if not self.active_probe or flag is None or not flag.comm_bound or watched.comm_bound is not False:
            return
        watched.comm_bound = True
        watched.judgements = []
        watched.probe = None
        if not watched.probe_waiting:  # one still out answers the new question when it comes
            self._request_probe(state, watched, frame, np.array([], dtype=int))

    def _request_probe(self, state: _JobState, watched: _Open, frame: WindowFrame, rows: np.ndarray,
                       reason: str | None = None) -> None:
        probe_id = f"PRB-{self._next_probe}"
        self._next_probe += 1
        watched.probe_id = probe_id
        watched.probe_waiting = True
        ranks = tuple(int(r) for r in frame.rank[rows])
        self._probe_requests.append(ProbeRequest(
            probe_id, state.job, state.step, ranks,
            reason or f"{group.subject_label(watched.subject)} flagged in window {frame.seq}", watched.incident.id,
            corroborates=reason is not None))

    def _take_probe_results(self, state: _JobState, frame: WindowFrame,
                            probes: dict[str, dict[int, ProbeResult]], changed: dict[str, Incident]) -> None:
        for probe_id, results in probes.items():
            state.probes.setdefault(probe_id, {}).update(results)
        while len(state.probes) > MAX_PENDING_PROBES:  # ids nothing waits for (oldest first)
            del state.probes[next(iter(state.probes))]
        if not state.probes:
            return
        node_of = {int(r): frame.node_names[int(n)] for r, n in zip(frame.rank, frame.node)}
        for watched in state.open.values():
            if watched.probe_id is None or watched.probe_id not in state.probes:
                continue
            results = state.probes.pop(watched.probe_id)
            watched.probe_waiting = False
            job_wide = watched.subject[0] not in ("rank", "node")
            suspects = set() if job_wide else {int(r) for r in frame.rank[group.rows_of(frame, watched.subject)]}
            judgement = judge_probe(results, suspects, node_of, self.settings.min_slowdown)
            if job_wide:
                # A job-wide slowdown: a link is named only when two probes agree on it.
                watched.judgements.append(judgement)
                watched.probe = agree_on_link(watched.judgements)
                reason = ask_again_about_link(watched.judgements, watched.probe, frame.seq)
                if reason is not None and self.active_probe:
                    self._request_probe(state, watched, frame, np.array([], dtype=int), reason=reason)
            else:
                watched.probe = judgement
            if watched.incident.state is IncidentState.SUSPECT:
                continue  # the verdicts are used when the incident is confirmed
            take_probe_verdict(watched.incident, judgement, watched.probe, watched.comm_bound)
            changed[watched.incident.id] = watched.incident

    # -- change regressions -------------------------------------------------------

    def _fingerprint(self, state: _JobState) -> dict[str, str | None]:
        return change.fingerprint(state.env, (fp for (job, _), fp in self._node_fingerprints.items()
                                              if job == state.job))

    def _workload(self, state: _JobState, frame: WindowFrame, conditions: Hashable) -> Hashable:
        if state.topology is None:  # the nodes the job was first judged on
            state.topology = change.topology(frame)
        return change.workload(frame, conditions, state.topology)

    def _remember_reference(self, state: _JobState, frame: WindowFrame, conditions: Hashable) -> None:
        fingerprint = self._fingerprint(state)
        if not change.worth_remembering(fingerprint, state.history):
            return
        key = self._workload(state, frame, conditions)
        change.remember(self._references, state.job, state.reference_key, key, fingerprint, state.history)
        state.reference_key = key

    def _change_check(self, state: _JobState, frame: WindowFrame, summary: JobSummary,
                      conditions: Hashable, straggler_ms: float) -> tuple[WorkloadReference, float] | None:
        return change.check(self._references, state.job, self._workload(state, frame, conditions),
                            lambda: self._fingerprint(state), summary, straggler_ms, self.settings.job_slowdown)


def analyze_records(records: Iterable[WindowReport | NodeEvent], analyzer: Analyzer) -> list[Incident]:
    """Feed records through an analyzer and flush; return every update in order."""
    updates: list[Incident] = []
    for record in records:
        updates.extend(analyzer.ingest(record))
    updates.extend(analyzer.flush())
    return updates

