"""The whole loop at fleet scale, its jobs: the queue and the nodes they run on.  ``Scheduler`` places
queued jobs FIFO with EASY backfill on the nodes that are free (not drained, not busy), starts and ends
their runs (done, killed at the time limit, requeued), and hands a requeued job back to SimSlurm, which
restarts it away from its excluded nodes."""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

from artemisd.sim.closedloop_adapter import PARTITION
from artemisd.sim.closedloop_records import Job, Run

if TYPE_CHECKING:
    from artemisd.sim.closedloop import FleetSim


class Scheduler:
    """Where each job is (queued, running, requeued, ended) and which nodes are free, drained or busy."""

    def __init__(self, sim: FleetSim):
        self.sim = sim
        self.p = sim.p
        self.arrivals = deque(sim.sc.jobs)  # submitted later, in submission order
        self.queue: deque[str] = deque()
        self.running: dict[str, Job] = {}
        self.requeued: dict[str, Job] = {}
        self.free: set[int] = set(range(sim.p.nodes))
        self.drained: dict[int, tuple[str, float, bool]] = {}  # node -> (who drained it, when, healthy then)
        self.node_job: dict[int, str] = {}

    @property
    def idle(self) -> bool:
        """No job runs, waits or is still to arrive."""
        return not (self.running or self.queue or self.requeued or self.arrivals)

    def arrive(self, now: float) -> None:
        """The jobs submitted by ``now`` join the queue."""
        while self.arrivals and self.arrivals[0].submit <= now:
            self.queue.append(self.arrivals.popleft().id)

    # --- placement -----------------------------------------------------------------------------------

    def schedule(self) -> None:
        """FIFO with EASY backfill: the first job that does not fit gets the earliest start the running
        jobs' time limits promise; later jobs start now only if they do not delay it."""
        # A requeued job keeps its place ahead of the queue (Slurm keeps its priority); SimSlurm places it.
        for job in list(self.requeued.values()):
            usable = len(self.free - job.excluded)
            if usable >= job.spec.nodes:
                self.sim.slurm.schedule()
                self.sync_requeued()
        blocked: Job | None = next(iter(self.requeued.values()), None)
        shadow, extra = self._shadow(blocked.spec.nodes) if blocked is not None else (math.inf, 0)
        scanned = 0
        queue = self.queue
        now = self.sim.now
        i = 0
        while i < len(queue) and scanned < 200:
            job = self.sim.jobs[queue[i]]
            need = job.spec.nodes
            if blocked is None:
                if need <= len(self.free):
                    self._start(job)
                    del queue[i]
                    continue
                blocked = job
                shadow, extra = self._shadow(need)
                i += 1
                continue
            scanned += 1
            if need <= len(self.free) and (now + job.spec.limit_s <= shadow or need <= extra):
                if now + job.spec.limit_s > shadow:
                    extra -= need
                self._start(job)
                del queue[i]
                continue
            i += 1

    def _shadow(self, need: int) -> tuple[float, int]:
        """When ``need`` nodes will be free at the latest (the running jobs' limits), and how many spare then."""
        avail = len(self.free)
        for end, n in sorted((j.run.start + j.spec.limit_s, len(j.run.nodes)) for j in self.running.values()):
            avail += n
            if avail >= need:
                return end, avail - need
        return math.inf, 0

    def _start(self, job: Job) -> None:
        now = self.sim.now
        nodes = tuple(sorted(self.free)[:job.spec.nodes])
        self.sim.slurm.add_job(job.spec.id, [self.sim.names[n] for n in nodes], PARTITION, time_limit_s=None,
                               start=now)
        self.begin_run(job, nodes, restart_s=0.0)
        if job.first_start is None:
            job.first_start = now
            self.sim.result.jobs_started += 1
            # Its transient faults and false alarms come in its own time, from its first start.
            for tr in job.spec.transients:
                self.sim.push(now + tr.offset_s, "transient", (job.spec.id, tr))
            for offset, duration, rank in job.spec.false_alarms:
                self.sim.push(now + offset, "false_alarm", (job.spec.id, duration, rank))

    # --- runs ------------------------------------------------------------------------------------------

    def begin_run(self, job: Job, nodes: tuple[int, ...], restart_s: float) -> None:
        """The job's next run starts on ``nodes`` (training resumes ``restart_s`` later)."""
        now = self.sim.now
        for n in nodes:
            self.free.discard(n)
            self.node_job[n] = job.spec.id
        job.run = Run(len(job.runs), nodes, now, now + restart_s)
        job.runs.append(job.run)
        job.state = "running"
        self.running[job.spec.id] = job
        physics = self.sim.physics
        physics.run_begins(job)
        physics.restep(job)
        # A node that is already faulty slows the new run from its first window.
        for n in nodes:
            for f in physics.active_on(n):
                self.sim.analysis.encounter(f, job, job.run.windows_from)

    def sync_requeued(self) -> None:
        """A requeued job SimSlurm started again: its next run begins (after its restart time)."""
        for job_id in list(self.requeued):
            info = self.sim.slurm.job(job_id)
            if info is not None and info.state == "RUNNING":
                job = self.requeued.pop(job_id)
                self.begin_run(job, tuple(self.sim.index[n] for n in info.nodes), job.spec.restart_s)

    def end_run(self, job: Job, state: str) -> None:
        """The job's run ends (``state``: done, timeout or requeued): its nodes are free unless drained."""
        run = job.run
        run.ended = self.sim.now
        for n in run.nodes:
            self.node_job.pop(n, None)
            if n not in self.drained:
                self.free.add(n)
        self.running.pop(job.spec.id, None)
        self.sim.physics.run_ends(job)
        self.sim.analysis.run_ended(job, run, state)
        job.state = state

    def ends(self) -> None:
        """Jobs whose work is done end; jobs past their time limit are killed (TIMEOUT)."""
        for job in [j for j in self.running.values() if j.progress >= j.spec.work_s
                    or self.sim.now - j.run.start >= j.spec.limit_s]:
            self._end(job, "COMPLETED" if job.progress >= job.spec.work_s else "TIMEOUT")

    def _end(self, job: Job, state: str) -> None:
        self.end_run(job, "done" if state == "COMPLETED" else "timeout")
        self.sim.slurm.end_job(job.spec.id, state)
        if state == "COMPLETED":
            self.sim.result.jobs_finished += 1
        else:
            self.sim.books.timed_out(job)
        self.sync_requeued()

    def job_requeued(self, job: Job, by: str) -> None:
        """Slurm requeued the running job (the loop's requeue or a person's): the work since its last
        checkpoint is lost, the faults it met end for it, and it waits to be started again elsewhere."""
        if job.state != "running":
            return
        now = self.sim.now
        self.sim.books.requeued(job, now)
        analysis = self.sim.analysis
        for enc in analysis.of_run(job.spec.id, job.run.number):
            if enc.ended_at is None and enc.fault is not None and enc.fault.active(now):
                analysis.encounter_over(enc, f"requeue by {by}")
        self.end_run(job, "requeued")
        info = self.sim.slurm.job(job.spec.id)
        job.excluded = {self.sim.index[n] for n in (info.excluded_nodes if info is not None else ())}
        job.shares = {}
        self.requeued[job.spec.id] = job

    # --- drained nodes ---------------------------------------------------------------------------------

    def drain(self, node: int, who: str, healthy: bool) -> None:
        """The node is out of service: no new job is placed on it (a job running there goes on)."""
        self.drained[node] = (who, self.sim.now, healthy)
        self.free.discard(node)

    def undrain(self, node: int) -> tuple[str, float, bool]:
        """The node is back in service; (who drained it, when, healthy then)."""
        return self.drained.pop(node)

    def free_if_idle(self, node: int) -> None:
        if node not in self.node_job:
            self.free.add(node)
