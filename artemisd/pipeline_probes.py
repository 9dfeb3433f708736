"""The Analyzer's matched probes (active confirmation): when a subject under watch asks for one, and what comes back.

A subject is probed once it has been flagged in ``PROBE_AFTER_FLAGS`` windows
or confirms; a job-wide slowdown has no suspect rank, so its probe is about the
links, and a link is named only when two probes agree on it (``confirm.py``).
The requests wait here until the daemon takes them (``pending``); the results
come back inside the ranks' window reports, wait in the job step's state
(at most ``MAX_PENDING_PROBES``) and are judged when their subject's window is
analysed.  A verdict that comes back after the incident confirmed is applied
to it at once.  Pure: plain data in, plain data out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from artemisd import detect, group
from artemisd.config import AnalysisSettings
from artemisd.confirm import agree_on_link, ask_again_about_link, judge_probe, take_probe_verdict
from artemisd.frame import WindowFrame
from artemisd.incident import Incident, IncidentState
from artemisd.pipeline_assembly import JobState
from artemisd.pipeline_watch import Watched
from artemisd.wire import ProbeResult

# A matched probe is asked for once a suspect is flagged in this many windows (or confirms): a
# job's probes are few (ProbeMinInterval, ProbeMaxPerHour), and a suspect flagged once is more
# often a start-up or scheduling blip, dismissed a window later, than a fault.  Spent on it, the
# probe was not there for the degraded link flagged a minute later (issue 28).
PROBE_AFTER_FLAGS = 2
MAX_PENDING_PROBES = 16  # probe results of a job step waiting for their subject


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


class ProbeDesk:
    """The probe requests raised (when ``active``) and the judging of the results that come back."""

    def __init__(self, settings: AnalysisSettings, active: bool):
        self.settings = settings
        self.active = active
        self._next = 1
        self._requests: list[ProbeRequest] = []

    def pending(self) -> list[ProbeRequest]:
        """Probe requests raised since the last call (each returned once)."""
        requests, self._requests = self._requests, []
        return requests

    @staticmethod
    def outstanding(states: Iterable[JobState], incident_id: str) -> bool:
        """A matched probe was requested for this incident and its results are not judged yet."""
        for state in states:
            for watched in state.open.values():
                if watched.incident.id == incident_id:
                    return watched.probe_waiting
        return False

    def ask_first(self, state: JobState, watched: Watched, frame: WindowFrame, rows: np.ndarray,
                  flagged: int, confirmed: bool) -> None:
        """The subject's first probe, once it is flagged in ``PROBE_AFTER_FLAGS`` windows or confirms."""
        if (self.active and watched.probe_id is None and watched.subject[0] in ("rank", "node", "job")
                and (flagged >= PROBE_AFTER_FLAGS or confirmed)):
            # A job-wide slowdown has no suspect rank; its probe is about the links.
            self._request(state, watched, frame, rows)

    def ask_about_links_again(self, state: JobState, watched: Watched, frame: WindowFrame,
                              flag: detect.JobFlag | None) -> None:
        """A confirmed job-wide incident whose rise was in the ranks' own work, now in the collectives:
        a new question, about the links, with probes of its own.

        Seen at the shipped defaults on the test cluster: a job-wide slowdown of the
        loaded box confirmed in the job's first windows (every rank's work rose),
        its probe answered "normal"; a link degraded a minute later only made that
        incident's job slower still, and no probe asked about the link again.  The
        request waits for ``ProbeMinInterval`` like any first probe.
        """
        if not self.active or flag is None or not flag.comm_bound or watched.comm_bound is not False:
            return
        watched.comm_bound = True
        watched.judgements = []
        watched.probe = None
        if not watched.probe_waiting:  # one still out answers the new question when it comes
            self._request(state, watched, frame, np.array([], dtype=int))

    def take_results(self, state: JobState, frame: WindowFrame,
                     probes: dict[str, dict[int, ProbeResult]], changed: dict[str, Incident]) -> None:
        """Judge the results that came back for the subjects under watch (a confirmed incident's verdict
        is applied to it now, a suspect's when it confirms)."""
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
                if reason is not None and self.active:
                    self._request(state, watched, frame, np.array([], dtype=int), reason=reason)
            else:
                watched.probe = judgement
            if watched.incident.state is IncidentState.SUSPECT:
                continue  # the verdicts are used when the incident is confirmed
            take_probe_verdict(watched.incident, judgement, watched.probe, watched.comm_bound)
            changed[watched.incident.id] = watched.incident

    def _request(self, state: JobState, watched: Watched, frame: WindowFrame, rows: np.ndarray,
                 reason: str | None = None) -> None:
        probe_id = f"PRB-{self._next}"
        self._next += 1
        watched.probe_id = probe_id
        watched.probe_waiting = True
        ranks = tuple(int(r) for r in frame.rank[rows])
        self._requests.append(ProbeRequest(
            probe_id, state.job, state.step, ranks,
            reason or f"{group.subject_label(watched.subject)} flagged in window {frame.seq}", watched.incident.id,
            corroborates=reason is not None))
