"""The whole loop at fleet scale, its analysis, modelled and not run (the per-rank analyzer on a thousand
nodes for days would take hours): each fault a job's run meets is an ``Encounter``, detected with the
probability, latency and cause accuracy the accuracy benchmark measured for its cause
(``MEASURED_DETECTION``); healthy jobs get false ``unknown`` incidents at the rate the healthy-job run
measured.  A detection is handed to the daemon's side (``closedloop_incidents``) as an incident."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from artemisd.incident import IncidentKind
from artemisd.sim.closedloop_records import Encounter, Fault, Job, Run
from artemisd.sim.closedloop_scenario import MEASURED_DETECTION, NODE_SCOPED, PROBES_TO_NAME_A_LINK_S, link_naming

if TYPE_CHECKING:
    from artemisd.sim.closedloop import FleetSim


class Analysis:
    """Every encounter of a fault with a job's run (and every false alarm): when the analysis confirms
    it, what it names, and when the job stopped suffering from it."""

    def __init__(self, sim: FleetSim):
        self.sim = sim
        self.p = sim.p
        self.encounters: list[Encounter] = []
        self.faulty_jobs: set[str] = set()  # jobs that met at least one fault
        self._by_fault: dict[str, list[Encounter]] = {}
        self._by_job: dict[str, list[Encounter]] = {}

    def encounter(self, f: Fault, job: Job, onset: float) -> None:
        """The analysis meets this fault in this run: detected (measured rate), when, and named as what."""
        for e in self._by_fault.get(f.id, ()):
            if e.job == job.spec.id and e.run == job.run.number:
                return
        model = MEASURED_DETECTION[f.cause]
        rng = random.Random(f"{self.p.seed}:{f.id}:{job.spec.id}:{job.run.number}")
        detected = rng.random() < model["detected"] / model["faults"]
        latency = max(0, int(rng.choice(model["latency"])))
        named = rng.choices(list(model["named"]), weights=list(model["named"].values()))[0]
        pos = job.run.nodes.index(f.node)
        rank = pos * self.p.gpus_per_node + f.gpu
        # Confirmed at the end of the window ``latency`` windows after the one it became visible in.
        due = onset + (latency + 1) * self.p.window_s if detected else None
        # The probes' ring compares pairs of nodes: a link is named in a job of three nodes or more
        # (``confirm.judge_probe``), on the right node or a wrong one as often as measured.
        probes = rng.random() if f.cause == "comm.link" and self.sim.link_probes else None
        right, wrong = link_naming(f.magnitude) if probes is not None else (0.0, 0.0)
        if probes is not None and probes < right + wrong and len(job.run.nodes) >= 3:
            named, kind = "comm.link", IncidentKind.LINK
            due = due + PROBES_TO_NAME_A_LINK_S if due is not None else None
            if probes >= right:
                rank = rng.choice([i for i in range(len(job.run.nodes)) if i != pos]) * self.p.gpus_per_node
        elif f.cause == "comm.link" or (f.cause in NODE_SCOPED and len(job.run.nodes) == 1):
            # Every rank slower, none to compare with: a slowdown against the job's own history.
            kind = IncidentKind.JOB
        elif f.cause in NODE_SCOPED:
            kind = IncidentKind.NODE
        else:
            kind = IncidentKind.RANK
        enc = Encounter(f, job.spec.id, job.run.number, onset, rank, named, kind, due)
        self.encounters.append(enc)
        self._by_fault.setdefault(f.id, []).append(enc)
        self._by_job.setdefault(job.spec.id, []).append(enc)
        self.sim.result.encounters += 1
        self.faulty_jobs.add(job.spec.id)
        if due is not None:
            self.sim.push(due, "detect", enc)

    def false_alarm(self, payload: tuple[str, float, int]) -> None:
        """A healthy job's rank looks slow for a few windows (a noisy neighbour): confirmed two windows on."""
        job_id, duration, rank = payload
        job = self.sim.jobs[job_id]
        now = self.sim.now
        if job.state != "running" or now < job.run.windows_from or rank >= job.spec.nodes * self.p.gpus_per_node:
            return
        enc = Encounter(None, job_id, job.run.number, now, rank, "unknown", IncidentKind.RANK,
                        now + self.p.window_s * 2, alarm_end=now + duration)
        self.encounters.append(enc)
        self.sim.push(enc.due, "detect", enc)
        self.sim.push(enc.alarm_end, "alarm_end", enc)

    def detect(self, enc: Encounter) -> None:
        """The analysis confirms the encounter: an incident for the loop (unless no loop runs)."""
        job = self.sim.jobs[enc.job]
        if enc.ended_at is not None or job.state != "running" or job.run.number != enc.run:
            return  # gone before the analysis confirmed it
        enc.detected_at = self.sim.now
        if enc.fault is None:
            self.sim.result.false_alarms += 1
        else:
            self.sim.result.detected += 1
        if self.sim.mode == "none":
            return
        self.sim.incidents.observe(enc, job)

    # --- when a job stops suffering ----------------------------------------------------------------

    def alarm_end(self, enc: Encounter) -> None:
        enc.ended_at, enc.ended_by = self.sim.now, "itself"
        if enc.incident is not None:
            self._seen_healthy_later(enc)

    def fault_over(self, f: Fault, by: str) -> None:
        """The fault stopped slowing whatever job met it."""
        for enc in self.of_fault(f):
            self.encounter_over(enc, by)

    def encounter_over(self, enc: Encounter, by: str) -> None:
        """The job stopped suffering from the fault: by itself, with the job's end, or by an action."""
        if enc.ended_at is not None:
            return
        now = self.sim.now
        enc.ended_at, enc.ended_by = now, by
        self.sim.books.recovered(enc, by, now)
        if enc.incident is not None:
            self._seen_healthy_later(enc)

    def run_ended(self, job: Job, run: Run, state: str) -> None:
        """The job's run ended (done, timeout, requeued): what it still suffered from ends with it."""
        for enc in self.of_run(job.spec.id, run.number):
            if enc.ended_at is None:
                enc.ended_at, enc.ended_by = self.sim.now, ("requeue" if state == "requeued" else "job end")

    def _seen_healthy_later(self, enc: Encounter) -> None:
        """The analysis sees the incident's subject healthy again ``RecoverWindows`` windows on."""
        self.sim.push(self.sim.now + self.p.window_s * self.recover_windows(), "subject_healthy", enc)

    def recover_windows(self) -> int:
        return self.sim.config.analysis.recover_windows if self.sim.config is not None else 3

    # --- look-ups ------------------------------------------------------------------------------------

    def of_fault(self, f: Fault) -> list[Encounter]:
        """The encounters of the fault that still go on."""
        return [e for e in self._by_fault.get(f.id, ()) if e.ended_at is None]

    def of_run(self, job_id: str, run: int) -> list[Encounter]:
        return [e for e in self._by_job.get(job_id, ()) if e.run == run]
