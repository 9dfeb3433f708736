"""The subjects under watch: a flag observed, confirmed and localized, recurring, recovered; and the incidents' ids.

Each window's flagged subjects are observed (``Watch.observe_window``): the
first flag opens an incident in state ``suspect``; persistence under matched
conditions (``confirm.Persistence``) confirms it, and it is **localized**
(``localize.py``) with a proposed remedy (``remedy.py``); a suspect that stops
before persisting is ``dismissed``.  A rank's incident grows into its node's
when a second rank of the node is flagged (``Watch.regroup``).

A subject healthy for ``RecoverWindows`` windows has recovered: its incident
ends (``IncidentBook.active`` turns False).  When the same subject is
confirmed again within ``RecurWindows`` windows of its last flag, that is the
same fault coming back, not a new one: the incident keeps its id, a
``Recurrence`` is appended to its ``recurrences``, and its measures, cause and
evidence become the latest occurrence's (onset, flagged and confirmed windows
stay the first's).  The window then returns the incident in state
``confirmed`` with the grown list, and it is active again until it recovers
again.  While the recurrence is only suspect nothing is returned for it (a
suspect that never confirms is no recurrence); a matched probe asked for
meanwhile names the incident's id.

Pure: plain data in, plain data out.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from artemisd import group, loss, verify
from artemisd.baseline import PAIR_MIN_WINDOWS
from artemisd.config import AnalysisSettings
from artemisd.confirm import ProbeJudgement, Verdict
from artemisd.frame import WindowFrame
from artemisd.incident import Cause, Evidence, Incident, IncidentKind, IncidentState, Recurrence
from artemisd.localize import (Diagnosis, IslandPeers, counter_explains, diagnose_change, diagnose_job,
                               diagnose_straggler, own_history_evidence, straggler_measures)
from artemisd.pipeline_assembly import JobState
from artemisd.remedy import propose

if TYPE_CHECKING:
    from artemisd.pipeline_probes import ProbeDesk
    from artemisd.pipeline_stages import Window

# What a recurrence refreshes in its incident: the latest occurrence is the one in force.
LATEST_OCCURRENCE_FIELDS = ("ratio", "excess_ms", "loss_pct", "measured_loss_pct", "cause", "confidence",
                            "evidence", "action")


@dataclass
class Watched:
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


class IncidentBook:
    """Every incident reported, under its own id, and those whose subject recovered (ended)."""

    def __init__(self, id_prefix: str, first_id: int):
        self.id_prefix = id_prefix
        self._next_id = first_id
        self.incidents: list[Incident] = []
        self.ended: dict[str, int] = {}  # incident id -> the window its subject recovered in

    def new(self, job: str, kind: IncidentKind, seq: int, onset: int, **subject) -> Incident:
        incident = Incident(id="", job=job, kind=kind, onset_window=onset, flagged_window=seq, **subject)
        self.register(incident)
        return incident

    def register(self, incident: Incident) -> None:
        """Give an incident its own id and report it from now on."""
        incident.id = f"{self.id_prefix}{self._next_id}"
        self._next_id += 1
        self.incidents.append(incident)

    def active(self, incident_id: str) -> bool:
        """False once the incident's subject has been healthy for RecoverWindows windows."""
        return incident_id not in self.ended

    def forget_job(self, job: str) -> list[str]:
        """Drop the job's incidents; their ids."""
        gone = [incident.id for incident in self.incidents if incident.job == job]
        if gone:
            self.incidents = [incident for incident in self.incidents if incident.job != job]
            for incident_id in gone:
                self.ended.pop(incident_id, None)
        return gone


class Watch:
    """Confirms, localizes, regroups and recovers the subjects under watch in each job step."""

    def __init__(self, settings: AnalysisSettings, book: IncidentBook, probes: ProbeDesk,
                 fingerprint: Callable[[JobState], dict[str, str | None]]):
        self.settings = settings
        self.book = book
        self.probes = probes
        self.fingerprint = fingerprint  # the job's software fingerprint, for a change incident's diagnosis

    def observe_window(self, state: JobState, frame: WindowFrame, window: Window,
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
            loss_pct = 100.0 * (job_flag.step_ms - job_flag.baseline_step_ms) / max(job_flag.step_ms, 1e-9)
            watched = state.open.get(key)
            self._observe(state, key, seq, conditions, (True, False), frame, changed,
                          lambda: (job_flag.step_ratio, job_flag.step_ms - job_flag.baseline_step_ms, loss_pct),
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

    def regroup(self, state: JobState, grouping: group.Grouping) -> None:
        """Apply the window's regrouping: rank incidents grown into their node's, or absorbed by it."""
        for rank_key, node_key in grouping.grown:
            self._rekey(state, rank_key, node_key)
        for rank_key in grouping.absorbed:
            self._absorb(state, rank_key)

    def recover(self, state: JobState, seq: int, flagged: set[Hashable], changed: dict[str, Incident]) -> None:
        """The window is closed: suspects that stopped are dismissed, subjects healthy long enough end."""
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
                self.book.ended[watched.incident.id] = seq
                if self.settings.recur_windows > 0:
                    state.ended[key] = (watched.incident, watched.last_flagged)
                state.persistence.forget(key)
                del state.open[key]
        for key, (_, last_flagged) in list(state.ended.items()):
            if seq - last_flagged > self.settings.recur_windows and key not in state.open:
                del state.ended[key]

    # -- one subject ---------------------------------------------------------------

    def _observe(self, state: JobState, key: Hashable, seq: int, conditions: Hashable,
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
            self.probes.ask_about_links_again(state, watched, frame, context.get("job_flag"))
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
                incident = self.book.new(state.job, kind, seq, streak.onset, **subject)
            else:
                incident = Incident(id=recurring.id, job=state.job, kind=kind, onset_window=streak.onset,
                                    flagged_window=seq, **subject)
            watched = state.open[key] = Watched(incident, key, key, recurrence_of=recurring)
        watched.measures.append(measures())
        self.probes.ask_first(state, watched, frame, context.get("rows", np.array([], dtype=int)),
                              len(streak.flagged), verdict is Verdict.CONFIRMED)
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

    def _recurring(self, state: JobState, key: Hashable, seq: int) -> Incident | None:
        """The subject's ended incident, when it was last flagged within RecurWindows of ``seq``."""
        ended = state.ended.get(key)
        if ended is None or seq - ended[1] > self.settings.recur_windows:
            return None
        return ended[0]

    def _recur(self, state: JobState, watched: Watched, changed: dict[str, Incident]) -> None:
        """A subject whose incident had ended is confirmed again: record the recurrence in that incident."""
        first, latest = watched.recurrence_of, watched.incident
        assert first is not None
        watched.recurrence_of = None
        subject = ("kind", "rank", "node", "link", "island")
        if any(getattr(latest, f) != getattr(first, f) for f in subject):
            # A job-wide slowdown localised elsewhere this time (another link,
            # another island): another subject, so another incident.
            self.book.register(latest)
            changed[latest.id] = latest
            return
        first.recurrences.append(Recurrence(onset_window=latest.onset_window, confirmed_window=latest.confirmed_window,
                                            ratio=latest.ratio, loss_pct=latest.loss_pct))
        for name in LATEST_OCCURRENCE_FIELDS:
            setattr(first, name, getattr(latest, name))
        watched.incident = first
        state.ended.pop(watched.subject, None)
        self.book.ended.pop(first.id, None)
        changed[first.id] = first

    def _confirm(self, state: JobState, watched: Watched, seq: int, frame: WindowFrame,
                 diagnose: Callable[..., Diagnosis] | None, context: dict) -> None:
        """The subject persisted: localize it, measure the job's loss, propose a remedy."""
        incident = watched.incident
        ratio, excess, lost = (float(np.mean([m[i] for m in watched.measures])) for i in range(3))
        incident.ratio, incident.excess_ms, incident.loss_pct = round(ratio, 3), round(excess, 2), round(lost, 2)
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
            diagnosis = diagnose_change(context["reference"], self.fingerprint(state), context["summary"])
        incident.cause = diagnosis.cause
        incident.confidence = diagnosis.confidence
        incident.evidence = list(diagnosis.evidence)
        if kind == "job":
            incident.evidence.extend(_pair_too_young(state))
        healthy = loss.baseline(state.throughput, incident.onset_window)
        slowed = loss.during(state.throughput, incident.onset_window, seq, verify.seconds_by_window(state.shapes))
        incident.measured_loss_pct = loss.measured_loss(healthy, slowed)
        disagreement = loss.loss_evidence(incident.loss_pct, healthy, slowed)
        if disagreement is not None:
            incident.evidence.append(Evidence(**disagreement))
        incident.confirmed_window = seq
        incident.action = propose(incident.kind, incident.cause, incident.node, incident.job, link=incident.link)
        incident.advance(IncidentState.CONFIRMED)

    def _rekey(self, state: JobState, old: Hashable, new: Hashable) -> None:
        """A rank incident grows into its node's: same incident, node subject."""
        watched = state.open.pop(old)
        watched.subject = new
        watched.rows_key = new
        incident = watched.incident
        if watched.recurrence_of is not None:
            # It came back as a rank and grew into its node: a node is another
            # subject than the rank whose incident had ended.
            watched.recurrence_of = None
            self.book.register(incident)
        incident.kind = IncidentKind.NODE
        incident.rank = None
        streak = state.persistence.streaks.pop(old, None)
        if streak is not None:
            state.persistence.streaks[new] = streak
        state.open[new] = watched

    @staticmethod
    def _absorb(state: JobState, old: Hashable) -> None:
        """A second rank incident on a node that already has a node incident: drop it."""
        watched = state.open.pop(old)
        state.persistence.forget(old)
        if watched.incident.state is IncidentState.SUSPECT:
            watched.incident.advance(IncidentState.DISMISSED)


def _pair_too_young(state: JobState) -> list[Evidence]:
    """Why a job-wide incident of a job with an island of two names no rank, when the reason is
    that the pair is too young: a rank of two is named against its own healthy windows, and
    until it has ``PAIR_MIN_WINDOWS`` of them a slowed rank reads as the whole job slowing."""
    known = state.ranks.pair_windows()
    if known is None or known >= PAIR_MIN_WINDOWS:
        return []
    return [Evidence(signal="missing", value="which rank of an island of two is slow",
                     note=f"each rank of two is judged against its own healthy windows: {known} of the "
                          f"{PAIR_MIN_WINDOWS} needed so far; a rank is named once it has them")]
