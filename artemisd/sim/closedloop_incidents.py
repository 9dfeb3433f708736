"""The whole loop at fleet scale, the daemon's side: ``Incidents`` turns each detection of the modelled
analysis into the ``Incident`` the daemon would have confirmed, feeds it to the loop with the facts the
daemon knows (GPUs, time left, the node's check), and drives the loop's turn: deciding the incidents
that may change, verifying an action on the throughput windows, closing an incident whose subject is
healthy again, and paging the person on an escalation."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from artemisd import loss, verify
from artemisd.incident import Cause, Evidence, Incident, IncidentKind, IncidentState
from artemisd.sim.closedloop_records import Encounter, Job
from artemisd.sim.closedloop_scenario import BUSY_MS, HEALTHY_STEP_MS

if TYPE_CHECKING:
    from artemisd.sim.closedloop import FleetSim

S = IncidentState
_SIGNAL = {"gpu.thermal": "temp_c", "gpu.power": "power_limit_w", "gpu.clocks": "sm_clock_mhz",
           "comm.link": "probe.p2p_ms", "host.cpu": "cpu_pct", "input.loader": "ms.data",
           "input.storage": "iowait_pct"}


class Incidents:
    """The incidents the loop was told of, which are open, and which it must look at on its next turn."""

    def __init__(self, sim: FleetSim):
        self.sim = sim
        self.p = sim.p
        self.by_incident: dict[str, Encounter] = {}
        self.open: set[str] = set()
        self._numbered = 0
        self._escalated_seen: dict[str, int] = {}
        self._last_decide = -math.inf
        self._to_decide: set[str] = set()
        self._touched: set[str] = set()  # approved or denied since the last turn
        self._verifying: set[str] = set()
        self._dormant: set[str] = set()

    # --- what the loop is told -------------------------------------------------------------------------

    def observe(self, enc: Encounter, job: Job) -> None:
        """The analysis confirmed the encounter: its incident goes to the loop, to be decided this turn."""
        loop = self.sim.loop
        assert loop is not None
        inc = self._incident(enc, job)
        enc.incident = inc.id
        self.by_incident[inc.id] = enc
        self.open.add(inc.id)
        g = self.p.gpus_per_node
        node = job.run.nodes[enc.rank // g]
        # The loop reads node evidence only for a hard action; a false alarm is held (no signal deviates)
        # and never takes one, so its node check is left out (a fleet has tens of thousands of them).
        evidence = self.sim.physics.node_check(node) if enc.fault is not None else None
        now = self.sim.now
        loop.observe(inc, now, gpus=job.spec.nodes * g, time_left_s=max(0.0, job.run.start + job.spec.limit_s - now),
                     node_evidence=evidence,
                     # The daemon knows a rank's GPU from its reports; a node or job incident names none.
                     gpu=enc.rank % g if inc.kind is IncidentKind.RANK else None,
                     rebalance_opt_in=job.spec.opt_in, measured_loss_pct=inc.measured_loss_pct)
        self._to_decide.add(inc.id)

    def _incident(self, enc: Encounter, job: Job) -> Incident:
        """The incident the analysis would have confirmed: its windows, loss, cause and evidence."""
        self._numbered += 1
        run = job.run
        g = self.p.gpus_per_node
        node = self.sim.names[run.nodes[enc.rank // g]]
        f = enc.fault
        magnitude = f.magnitude if f is not None else 0.0
        loss = 100.0 * (1.0 - HEALTHY_STEP_MS / job.step_ms) if f is not None else 0.0
        window_of = self.sim.physics.window_of
        onset_w, confirmed_w = max(0, window_of(run, enc.onset)), max(0, window_of(run, self.sim.now) - 1)
        cause = Cause(enc.named)
        evidence = [Evidence(signal="ms.busy", value=round(BUSY_MS * (1 + magnitude), 1), peers=BUSY_MS,
                             note="busy time against the island's median")]
        if f is not None and f.cause == "comm.link":
            evidence = [Evidence(signal="ms.step", value=round(job.step_ms, 1), peers=HEALTHY_STEP_MS,
                                 note="every rank's step rose against the job's history"),
                        Evidence(signal="net_retransmits_per_s", value=20.0, peers=0.0, note=f"{node}")]
            if cause is Cause.COMM_LINK:
                slow = round(2.0 * (1.0 + f.magnitude), 3)
                evidence += [Evidence(signal="probe.p2p_ms", value=slow, peers=2.0,
                                      note=f"ring transfers touching {node} are {slow / 2.0:.1f}x slower than the "
                                           f"others (matched probe {i})") for i in (1, 2)]
            else:
                evidence.append(Evidence(signal="missing", note="no two matched probes agree on a link"))
        elif cause is not Cause.UNKNOWN:
            evidence.append(Evidence(signal=_SIGNAL[cause.value], value="differs", peers="peers",
                                     note=f"what {cause.value} looks like"))
        kind = enc.kind
        return Incident(
            id=f"INC-{self._numbered}", job=job.spec.id, kind=kind, state=S.CONFIRMED,
            rank=enc.rank if kind is IncidentKind.RANK else None,
            node=node if kind in (IncidentKind.RANK, IncidentKind.NODE, IncidentKind.LINK) else None,
            link=node if kind is IncidentKind.LINK else None, island="nvidia",
            onset_window=onset_w, flagged_window=max(onset_w, confirmed_w - 1), confirmed_window=confirmed_w,
            ratio=round(1.0 + magnitude, 3) if f is not None and f.cause != "comm.link"
            else round(job.step_ms / HEALTHY_STEP_MS, 3),
            excess_ms=round(BUSY_MS * magnitude, 1), loss_pct=round(loss, 2), measured_loss_pct=round(loss, 2),
            cause=cause, confidence=0.8 if cause is not Cause.UNKNOWN else 0.0, evidence=evidence)

    def wake(self, inc_id: str) -> None:
        """A person approved (or the budget refused) the incident's action: the next turn looks at it."""
        self._to_decide.add(inc_id)
        self._touched.add(inc_id)

    # --- the loop's turn -------------------------------------------------------------------------------

    def turn(self) -> None:
        """Every ``decide_every_s`` the incidents that may still change are decided (with their nodes'
        checks); in between, only the new ones and those a verdict or a person touched."""
        loop = self.sim.loop
        assert loop is not None
        now = self.sim.now
        decided: list[str] = []
        if now - self._last_decide >= self.p.decide_every_s:
            self._last_decide = now
            decided = sorted(self._live(now), key=_incident_no)
            # The node checks of the nodes these incidents are about arrive (every HealthCheckInterval).
            for inc_id in decided:
                enc = self.by_incident[inc_id]
                job = self.sim.jobs[enc.job]
                if enc.fault is not None and job.state == "running" and job.run.number == enc.run:
                    node = job.run.nodes[enc.rank // self.p.gpus_per_node]
                    received, body = self.sim.physics.node_check(node)
                    loop.node_event(self.sim.names[node], received, body)
        elif self._to_decide:
            decided = sorted(self._to_decide & self.open, key=_incident_no)
        if decided:
            loop.decide(decided, now)
        # Only a decision, an approval or a verdict changes an incident's state: look at those.
        watch = set(decided) | self._verifying | self._touched
        self._to_decide.clear()
        self._touched.clear()
        for inc_id in sorted(watch, key=_incident_no):
            if inc_id not in self.open:
                continue
            t = loop.tracked(inc_id)
            state = t.inc.state
            if state is S.VERIFYING:
                self._verifying.add(inc_id)
                self._verify(inc_id)
            elif state in (S.RESOLVED, S.DISMISSED):
                self.closed(inc_id)
            if len(t.escalations) > self._escalated_seen.get(inc_id, 0):
                self._escalated_seen[inc_id] = len(t.escalations)
                self.sim.result.escalations += 1
                self.sim.push(now + self.p.person_response_s, "person_visits", inc_id)

    def closed(self, inc_id: str) -> None:
        self.open.discard(inc_id)
        self._verifying.discard(inc_id)

    def _live(self, now: float) -> list[str]:
        """Open incidents whose decision may still change with time.

        The daemon closes an incident when its subject is seen healthy again;
        an incident whose job ended (or moved) first is never seen again and
        stays open, held or escalated, for good.  Once it has been decided past
        ``UnknownEscalateAfter`` nothing it is decided on changes any more, so
        it is left out of the periodic turn (it is still verified, approved,
        closed like any other).
        """
        loop = self.sim.loop
        wait = self.sim.config.daemon.unknown_escalate_after + self.p.decide_every_s
        live = []
        for inc_id in self.open - self._dormant:
            enc = self.by_incident[inc_id]
            job = self.sim.jobs[enc.job]
            if (job.state != "running" or job.run.number != enc.run) and loop is not None \
                    and now - loop.tracked(inc_id).opened_at > wait:
                self._dormant.add(inc_id)
                continue
            live.append(inc_id)
        return live

    # --- verification and closing ------------------------------------------------------------------------

    def _evidence(self, enc: Encounter, inc_id: str) -> verify.Evidence:
        """The windows verification reads: the healthy ones before the onset and the slowed ones up to the
        action (the run the fault was seen in), and those after the action (that run, or the next one)."""
        physics = self.sim.physics
        now = self.sim.now
        job = self.sim.jobs[enc.job]
        origin_run = job.runs[enc.run]
        onset_w = max(0, physics.window_of(origin_run, enc.onset))
        acted = self.sim.loop.acted_at(inc_id) if self.sim.loop is not None else None
        acted = acted if acted is not None else now
        current_run = job.runs[-1]
        restarted = current_run.number != enc.run
        action_w = physics.window_of(origin_run, acted)
        rules = verify.Rules.of(self.sim.config.daemon)
        # During the slowdown only its median is read (loss.during): the last hour of it is plenty.
        origin = physics.windows(job, origin_run, onset_w - loss.BASELINE_WINDOWS, onset_w - 1) + \
            physics.windows(job, origin_run, max(onset_w, action_w - 60), action_w)
        after = rules.warmup + rules.windows_lasting(self.p.window_s) + 2
        if restarted:
            current = physics.windows(job, current_run, 0, after)
        else:
            current = origin + physics.windows(job, origin_run, action_w + 1, action_w + after)
        end = current_run.ended if current_run.ended is not None else now
        last_seen = None
        if end > current_run.windows_from:
            last_seen = current_run.windows_from + physics.window_of(current_run, end) * self.p.window_s
        elif origin_run.ended is not None:
            last_seen = origin_run.ended
        series = [(w.seq, w.throughput) for w in origin]
        return verify.Evidence(loss.baseline(series, onset_w), origin, current, restarted, onset_w,
                               None if restarted else action_w, last_seen)

    def _verify(self, inc_id: str) -> None:
        loop = self.sim.loop
        assert loop is not None
        enc = self.by_incident[inc_id]
        now = self.sim.now
        v = loop.verify(inc_id, self._evidence(enc, inc_id), now)
        if v is None or v.state is None:
            return
        recovered = v.verification.recovered
        self.sim.books.verdict(enc, recovered, now)
        if recovered and enc.fault is not None:
            enc.verified_at = now
        self._verifying.discard(inc_id)
        if v.state == "resolved":
            self.closed(inc_id)
        else:
            self._to_decide.add(inc_id)

    def subject_healthy(self, enc: Encounter) -> None:
        """The analysis saw the subject healthy again for RecoverWindows windows: the loop closes the
        incident if the job's latest VerifyWindows windows say its throughput is back (the daemon's
        ``_close_recovered``)."""
        loop = self.sim.loop
        if loop is None or enc.incident is None or enc.incident not in self.open:
            return
        job = self.sim.jobs[enc.job]
        if job.run.number != enc.run or job.state != "running":
            return  # the job ended or moved: no windows of this run to judge
        physics = self.sim.physics
        now = self.sim.now
        run = job.run
        rules = verify.Rules.of(self.sim.config.daemon)
        last = physics.window_of(run, now) - 1
        since = last - rules.windows_lasting(self.p.window_s)
        onset_w = max(0, physics.window_of(run, enc.onset))
        origin = physics.windows(job, run, onset_w - loss.BASELINE_WINDOWS, onset_w - 1)
        baseline = loss.baseline([(w.seq, w.throughput) for w in origin], onset_w)
        measured = None
        if baseline is not None:
            ev = verify.Evidence(baseline, origin, physics.windows(job, run, since + 1, last), False, onset_w, None,
                                 now)
            measured = verify.measure(enc.kind.value, enc.named, ev, rules, since=since)
        if loop.subject_recovered(enc.incident, now, measured):
            self.closed(enc.incident)
        elif now - (enc.ended_at or now) < 3600.0:
            # Not back yet (or not enough windows): the analysis keeps looking.
            self.sim.push(now + self.p.window_s * rules.windows, "subject_healthy", enc)


def _incident_no(incident_id: str) -> int:
    return int(incident_id.rpartition("-")[2])
