"""The whole loop at fleet scale, what actions do to the fleet: ``Effects`` applies an action's physical
effect (the loop's ``on_action`` hook: what Slurm does not do itself), fixes faults, and keeps the
drained nodes' life cycle: out of service until a person repairs and resumes them ``repair_s`` later (a
healthy node drained by mistake comes back after the same delay, its capacity lost meanwhile).

A rebalance moves work off the named rank; a correction fixes clocks and power caps and nothing else; a
requeue loses the work since the job's last checkpoint plus a restart."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from artemisd.act import Outcome
from artemisd.incident import Incident
from artemisd.sim.closedloop_records import Fault, Job
from artemisd.sim.closedloop_scenario import HEALTHY_STEP_MS

if TYPE_CHECKING:
    from artemisd.sim.closedloop import FleetSim

# What a correction of each kind undoes.  Heat and a bad link are not settings: no correction helps.
CORRECTION_FIXES = {"reset_clocks": "gpu.clocks", "restore_power_limit": "gpu.power"}


class Effects:
    """What the loop's actions, a person's and a repair do to the nodes, the faults and the jobs."""

    def __init__(self, sim: FleetSim):
        self.sim = sim
        self.p = sim.p

    def on_action(self, kind: str, target: str | None, params: dict[str, Any], inc: Incident | None = None
                  ) -> Outcome | None:
        """An action's physical effect on the simulated fleet (the loop's ``on_action`` hook): what Slurm
        does not do itself.  A correction fixes what it can fix and nothing else."""
        sim = self.sim
        if kind == "rebalance":
            job = sim.jobs[params["job"]]
            job.shares = {int(r): float(s) for r, s in (params.get("shares") or {}).items()}
            if params.get("shares"):
                sim.result.rebalances += 1
            sim.physics.restep(job)
            self._rebalanced(job)
        elif kind == "correct":
            sim.result.corrections += 1
            node = sim.index[params["node"]]
            fixes = CORRECTION_FIXES.get(params.get("kind", ""))
            for f in sim.physics.active_on(node):
                if f.cause == fixes and params.get("gpu") in (None, f.gpu):
                    self.fix(f, "correction")
        elif kind == "drain":
            self.node_drained(sim.index[params["node"]], "artemis")
        elif kind == "undrain":
            node = sim.index[params["node"]]
            if node in sim.sched.drained:
                self.node_undrained(node)
                sim.sched.free_if_idle(node)
        elif kind == "requeue":
            sim.sched.job_requeued(sim.jobs[params["job"]], "artemis")
        return None

    def fix(self, f: Fault, by: str) -> None:
        """The fault is fixed (a correction, a person's, a repair): the job it slowed steps as before."""
        sim = self.sim
        f.fixed_at, f.fixed_by = sim.now, by
        job_id = sim.sched.node_job.get(f.node) if f.job is None else f.job
        if job_id is not None:
            sim.physics.restep(sim.jobs[job_id])
        sim.analysis.fault_over(f, by)

    def _rebalanced(self, job: Job) -> None:
        """A rebalance that brought the step back to within 5 % of healthy ended the job's suffering."""
        if job.step_ms > HEALTHY_STEP_MS * 1.05:
            return
        analysis = self.sim.analysis
        for enc in analysis.of_run(job.spec.id, job.run.number):
            if enc.fault is not None and enc.ended_at is None and enc.fault.active(self.sim.now):
                analysis.encounter_over(enc, "rebalance")

    # --- drained nodes -----------------------------------------------------------------------------------

    def node_drained(self, node: int, who: str) -> None:
        """``who`` drained the node: out of service (healthy or not) until a person repairs it."""
        sim = self.sim
        if node in sim.sched.drained:
            return
        healthy = not sim.physics.active_on(node)
        sim.sched.drain(node, who, healthy)
        sim.books.drained(who, healthy)
        sim.push(sim.now + self.p.repair_s, "repair", (node, sim.now))

    def node_undrained(self, node: int) -> None:
        _, at, healthy = self.sim.sched.undrain(node)
        self.sim.books.undrained(at, healthy, self.sim.now)

    def repair(self, payload: tuple[int, float]) -> None:
        """A person repaired the drained node (whatever was wrong with it) and resumes it, once its
        last job left (a drain does not stop the job running there)."""
        sim = self.sim
        node, at = payload
        if node not in sim.sched.drained or sim.sched.drained[node][1] != at:
            return  # resumed (rolled back) meanwhile
        if node in sim.sched.node_job:
            sim.push(sim.now + 600.0, "repair", payload)
            return
        for f in sim.physics.active_on(node):
            self.fix(f, "repair")
        self.node_undrained(node)
        info = sim.slurm.node(sim.names[node])
        if info.drained:
            sim.slurm.person_resume(sim.names[node])
            if sim.loop_slurm is not None:
                sim.loop_slurm.changed()
        sim.sched.free_if_idle(node)
        sim.sched.sync_requeued()

    def undrain_all(self) -> None:
        """At the end: nodes still drained count their hours so far."""
        for node in list(self.sim.sched.drained):
            self.node_undrained(node)
