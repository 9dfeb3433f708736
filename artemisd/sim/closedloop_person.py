"""The whole loop at fleet scale, the person: paged by an escalation, they look ``person_response_s``
later (Minder, NSDI'25: 30+ min on average to find a faulty machine), approve what waits for approval,
or do what people do for the fault they find: reset clocks or the power limit, drain a hot node or one
with a bad link and requeue its job elsewhere."""

from __future__ import annotations

from typing import TYPE_CHECKING

from artemisd import decide
from artemisd.config import DEFAULT_POLICY
from artemisd.incident import Cause, Incident, IncidentKind, IncidentState
from artemisd.sim.closedloop_adapter import PERSON
from artemisd.sim.closedloop_records import Encounter, Fault, Job
from artemisd.sim.closedloop_scenario import HEALTHY_STEP_MS

if TYPE_CHECKING:
    from artemisd.sim.closedloop import FleetSim

S = IncidentState


class Person:
    """The person an escalation pages, and what they do on their visit."""

    def __init__(self, sim: FleetSim):
        self.sim = sim
        self.p = sim.p

    def visits(self, inc_id: str) -> None:
        """The person paged by an escalation looks, ``person_response_s`` later."""
        sim = self.sim
        loop = sim.loop
        assert loop is not None
        t = loop.tracked(inc_id)
        waiting = [r for r in loop.actions(inc_id) if r.status == "pending_approval"]
        if waiting:
            try:
                loop.approve(inc_id, PERSON, sim.now)
                sim.result.approvals += 1
            except ValueError:
                # The drain budget refused it: the person looks again later.
                sim.push(sim.now + self.p.person_response_s, "person_visits", inc_id)
            sim.incidents.wake(inc_id)
            return
        if t.inc.state is not S.ESCALATED:
            return
        enc = sim.incidents.by_incident[inc_id]
        # Artemis priced a requeue and found waiting cheaper: the person who reads that leaves the job be.
        # Detect-only, nothing was priced: the person requeues as people do.
        requeue = not any("waiting is cheaper" in e for e in t.escalations)
        self._natural_remedy(enc, requeue)

    def _natural_remedy(self, enc: Encounter, requeue: bool) -> None:
        """What a person does for the fault they find: reset clocks or the power limit, drain a hot node
        or a node with a bad link and requeue its job elsewhere; a transient host or input stall gets nothing."""
        sim = self.sim
        f = enc.fault
        if f is None or not f.active(sim.now) or enc.ended_at is not None:
            return
        if f.cause in ("gpu.clocks", "gpu.power"):
            sim.effects.fix(f, "person correction")
            sim.result.corrections += 1
        elif f.cause in ("gpu.thermal", "comm.link"):
            self._drain(f.node, f"{PERSON}: {f.cause} {sim.names[f.node]}")
            job = sim.jobs[enc.job]
            if requeue and job.state == "running" and job.run.number == enc.run and f.node in job.run.nodes:
                self._price_requeue(job, f)
                self._requeue(job, f.node, by=PERSON)

    def _price_requeue(self, job: Job, f: Fault) -> None:
        """What the loop's price (``decide.rung_cost``, default policy) says of this requeue: when waiting
        would have been cheaper than the person's restart."""
        now = self.sim.now
        loss = 100.0 * (1.0 - HEALTHY_STEP_MS / job.step_ms)
        inc = Incident(id="price", job=job.spec.id, kind=IncidentKind.NODE, cause=Cause(f.cause), loss_pct=loss)
        facts = decide.Facts(now=now, gpus=job.spec.nodes * self.p.gpus_per_node, measured_loss_pct=loss,
                             time_left_s=max(0.0, job.run.start + job.spec.limit_s - now))
        price = decide.rung_cost("requeue", inc, DEFAULT_POLICY, facts)
        gpus = facts.gpus or 1
        cost = gpus * (DEFAULT_POLICY.checkpoint_interval / 2.0 + DEFAULT_POLICY.restart_cost) / 3600.0
        saved = gpus * loss / 100.0 * (facts.time_left_s or 0.0) / 3600.0
        self.sim.result.person_requeue_prices.append((price.pays, round(cost, 2), round(saved, 2)))

    def _drain(self, node: int, reason: str) -> None:
        """A person's drain (scontrol update state=drain): a reason of their own, never the loop's."""
        sim = self.sim
        info = sim.slurm.node(sim.names[node])
        if info.drained:
            return
        sim.slurm.person_drain(sim.names[node], reason)
        if sim.loop_slurm is not None:
            sim.loop_slurm.changed()
        sim.effects.node_drained(node, PERSON)

    def _requeue(self, job: Job, node: int, by: str) -> None:
        """A person's requeue excluding ``node`` (scontrol requeuehold, ExcNodeList, release)."""
        slurm = self.sim.slurm
        info = slurm.job(job.spec.id)
        if info is None or info.state != "RUNNING":
            return
        slurm.requeue_hold(job.spec.id)
        slurm.set_excluded_nodes(job.spec.id, tuple(dict.fromkeys((*info.excluded_nodes, self.sim.names[node]))))
        slurm.release(job.spec.id)
        self.sim.sched.job_requeued(job, by)
