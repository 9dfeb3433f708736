"""The whole loop at fleet scale: a cluster of GPU nodes running a stream of jobs for days,
faults arriving at published rates, and the daemon's own decisions acting on it.

One ``Scenario`` (the jobs, their checkpoints, the faults, the false alarms:
everything drawn from the seed) is run under four *modes*:

* ``none``          nothing acts: the GPU-hours a fleet loses without Artemis;
* ``person``        Artemis detects, a person acts ``person_response_s`` later
                    with the natural remedy of the fault (detect-only);
* ``artemis``       the loop with the site's policy (default: the shipped
                    ``Auto=rebalance,escalate``; drains, corrections and
                    requeues wait for the same person's approval);
* ``artemis-auto``  the loop with ``Auto=rebalance,correct,drain,requeue,escalate``.

What is simulated and what is not:

* **The cluster** is a ``SimSlurm`` (``sim/cluster.py``); jobs are placed by
  a FIFO scheduler with EASY backfill (``_schedule``) that respects drained
  nodes, and a requeued job is restarted by SimSlurm's own pass, away from
  its excluded nodes.
* **The decisions** are the daemon's: ``sim/loop.Loop`` runs ``decide.plan``,
  the real ``Actuator`` over the SimSlurm, and ``verify.verdict`` on
  throughput windows built from the simulated job's state.
* **The analysis is modelled, not run** (the per-rank analyzer on a
  thousand nodes for days would take hours): each fault a job meets is
  detected with the probability, latency and cause accuracy the accuracy
  benchmark measured for its cause (``MEASURED_DETECTION``), and healthy jobs
  get false ``unknown`` incidents at the rate the healthy-job run measured.
* **Physics.**  A job runs in lockstep: a slowed rank (busy time up by the
  fault's magnitude) or a slowed link (step time up by it) slows every rank;
  a rebalance moves work off the named rank; a correction fixes clocks and
  power caps and nothing else; a requeue loses the work since the job's last
  checkpoint plus a restart; a drained node is repaired and resumed by a
  person after ``repair_s`` (a healthy node drained by mistake comes back
  after the same delay, its capacity lost meanwhile).

Every parameter, its value and its source is in ``FleetParams`` and
docs/benchmarks.md, "The whole loop at fleet scale".
"""

from __future__ import annotations

import heapq
import math
import random
import time
from bisect import bisect_right
from collections import Counter, deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from artemisd import decide, verify
from artemisd.act import Outcome
from artemisd.config import DEFAULT_POLICY, Config
from artemisd.incident import Cause, Evidence, Incident, IncidentKind, IncidentState
from artemisd.sim.closedloop_adapter import (
    AUTO_POLICY,
    DETECT_ONLY_POLICY,
    MODES,
    PARTITION,
    PERSON,
    FleetLoop,
    LoopSlurm,
    mode_config,
)
from artemisd.sim.closedloop_records import Encounter, Fault, Job, Run
from artemisd.sim.closedloop_results import ModeResult, summary
from artemisd.sim.closedloop_scenario import (
    BUSY_MS,
    COMM_MS,
    FALSE_INCIDENT_WINDOWS,
    FALSE_INCIDENTS_PER_WINDOW,
    HARDWARE_CAUSES,
    HEALTHY_STEP_MS,
    MEASURED_DETECTION,
    NODE_SCOPED,
    PROBES_TO_NAME_A_LINK_S,
    QUICK,
    SAMPLES_PER_RANK,
    STEPS_PER_WINDOW,
    TRANSIENT_CAUSES,
    TRANSIENT_MEAN_S,
    WINDOW_NOISE,
    FleetParams,
    JobSpec,
    NodeFaultSpec,
    Scenario,
    TransientSpec,
    draw_scenario,
)
from artemisd.sim.cluster import SimSlurm

__all__ = [
    "AUTO_POLICY", "BUSY_MS", "COMM_MS", "CORRECTION_FIXES", "DETECT_ONLY_POLICY", "FALSE_INCIDENTS_PER_WINDOW",
    "FALSE_INCIDENT_WINDOWS", "HARDWARE_CAUSES", "HEALTHY_CLOCK_MHZ", "HEALTHY_POWER_W", "HEALTHY_STEP_MS",
    "MEASURED_DETECTION", "MODES", "NODE_SCOPED", "PARTITION", "PERSON", "PROBES_TO_NAME_A_LINK_S", "QUICK",
    "SAMPLES_PER_RANK", "STEPS_PER_WINDOW", "TRANSIENT_CAUSES", "TRANSIENT_MEAN_S", "WINDOW_NOISE", "Encounter",
    "Fault", "FleetParams", "FleetSim", "Job", "JobSpec", "ModeResult", "NodeFaultSpec", "Run", "Scenario",
    "TransientSpec", "draw_scenario", "mode_config", "run_fleet", "summary",
]

S = IncidentState
HEALTHY_CLOCK_MHZ, HEALTHY_POWER_W = 1980, 700
# What a correction of each kind undoes.  Heat and a bad link are not settings: no correction helps.
CORRECTION_FIXES = {"reset_clocks": "gpu.clocks", "restore_power_limit": "gpu.power"}


class FleetSim:
    """One mode over one scenario (see the module doc)."""

    def __init__(self, scenario: Scenario, mode: str, config: Config | None = None, link_probes: bool = False):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        self.sc = scenario
        self.p = p = scenario.params
        self.mode = mode
        self.link_probes = link_probes
        self.config = config if config is not None else mode_config(mode)
        self.result = ModeResult(mode)
        self.now = 0.0
        self.slurm = SimSlurm(start=0.0)
        self.names = [f"n{i:04d}" for i in range(p.nodes)]
        self.index = {n: i for i, n in enumerate(self.names)}
        for name in self.names:
            self.slurm.add_node(name, PARTITION, gpus=p.gpus_per_node)
        self.loop: FleetLoop | None = None
        self.loop_slurm: LoopSlurm | None = None
        if mode != "none":
            assert self.config is not None
            self.loop_slurm = LoopSlurm(self.slurm)
            self.loop = FleetLoop(self.config, self.loop_slurm, on_action=self.on_action)
        self.jobs: dict[str, Job] = {j.id: Job(j) for j in scenario.jobs}
        self.arrivals = deque(scenario.jobs)
        self.queue: deque[str] = deque()
        self.running: dict[str, Job] = {}
        self.requeued: dict[str, Job] = {}
        self.free: set[int] = set(range(p.nodes))
        self.drained: dict[int, tuple[str, float, bool]] = {}  # node -> (who drained it, when, healthy then)
        self.node_job: dict[int, str] = {}
        self.node_faults: dict[int, list[Fault]] = {}  # hardware faults a node ever had
        self.job_faults: dict[str, list[Fault]] = {}
        self.events: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self.encounters: list[Encounter] = []
        self.by_incident: dict[str, Encounter] = {}
        self.open_incidents: set[str] = set()
        self._incident_no = 0
        self._faulty_jobs: set[str] = set()
        self._escalated_seen: dict[str, int] = {}
        self._by_fault: dict[str, list[Encounter]] = {}
        self._by_job: dict[str, list[Encounter]] = {}
        self._last_decide = -math.inf
        self._to_decide: set[str] = set()
        self._touched: set[str] = set()  # approved or denied since the last turn
        self._verifying: set[str] = set()
        self._dormant: set[str] = set()
        self._checks: dict[tuple[int, float], tuple[float, dict[str, Any]]] = {}
        self._tick = 0
        for f in scenario.node_faults:
            self._push(f.time, "node_fault", f)

    # --- events ----------------------------------------------------------------------------------

    def _push(self, when: float, kind: str, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self.events, (when, self._seq, kind, payload))

    def run(self) -> ModeResult:
        """Until every job submitted within the horizon has ended, then the read-outs."""
        self.run_until(self.p.end_s)
        return self.finish()

    def run_until(self, until: float) -> None:
        """Advance tick by tick while the next tick starts before ``until`` (and within the horizon)."""
        started = time.process_time()
        p = self.p
        ticks = int(round(p.end_s / p.tick_s))
        arrivals_end = p.horizon_s
        hour = max(1, int(round(3600.0 / p.tick_s)))
        while self._tick < ticks and self._tick * p.tick_s < until:
            if self._tick * p.tick_s >= arrivals_end and not (self.running or self.queue or self.requeued
                                                              or self.arrivals):
                break
            tick = self._tick
            self.now = now = tick * p.tick_s
            if tick % hour == 0:
                self.result.cumulative.append((now / 3600.0, self.result.lost_gpu_hours))
            self.slurm.advance_to(now)
            self._sync_requeued()
            self._ends()
            while self.arrivals and self.arrivals[0].submit <= now:
                self.queue.append(self.arrivals.popleft().id)
            while self.events and self.events[0][0] <= now:
                _, _, kind, payload = heapq.heappop(self.events)
                getattr(self, f"_ev_{kind}")(payload)
            self._schedule()
            if self.loop is not None:
                self._loop_turn()
            self._advance_jobs(p.tick_s)
            self._tick += 1
            self.now = self._tick * p.tick_s
        self.result.seconds += time.process_time() - started

    def finish(self) -> ModeResult:
        """The read-outs, at the time reached."""
        hours = self.now / 3600.0
        if not self.result.cumulative or self.result.cumulative[-1][0] < hours:
            self.result.cumulative.append((hours, self.result.lost_gpu_hours))
        self._finish()
        return self.result

    # --- jobs --------------------------------------------------------------------------------------

    def _schedule(self) -> None:
        """FIFO with EASY backfill: the first job that does not fit gets the earliest start the running
        jobs' time limits promise; later jobs start now only if they do not delay it."""
        # A requeued job keeps its place ahead of the queue (Slurm keeps its priority); SimSlurm places it.
        for job in list(self.requeued.values()):
            usable = len(self.free - job.excluded)
            if usable >= job.spec.nodes:
                self.slurm.schedule()
                self._sync_requeued()
        blocked: Job | None = next(iter(self.requeued.values()), None)
        shadow, extra = self._shadow(blocked.spec.nodes) if blocked is not None else (math.inf, 0)
        scanned = 0
        queue = self.queue
        i = 0
        while i < len(queue) and scanned < 200:
            job = self.jobs[queue[i]]
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
            if need <= len(self.free) and (self.now + job.spec.limit_s <= shadow or need <= extra):
                if self.now + job.spec.limit_s > shadow:
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
        nodes = tuple(sorted(self.free)[:job.spec.nodes])
        self.slurm.add_job(job.spec.id, [self.names[n] for n in nodes], PARTITION, time_limit_s=None, start=self.now)
        self._begin_run(job, nodes, restart_s=0.0)
        if job.first_start is None:
            job.first_start = self.now
            self.result.jobs_started += 1
            for tr in job.spec.transients:
                self._push(self.now + tr.offset_s, "transient", (job.spec.id, tr))
            for offset, duration, rank in job.spec.false_alarms:
                self._push(self.now + offset, "false_alarm", (job.spec.id, duration, rank))

    def _begin_run(self, job: Job, nodes: tuple[int, ...], restart_s: float) -> None:
        for n in nodes:
            self.free.discard(n)
            self.node_job[n] = job.spec.id
        job.run = Run(len(job.runs), nodes, self.now, self.now + restart_s)
        job.runs.append(job.run)
        job.state = "running"
        self.running[job.spec.id] = job
        self.job_faults[job.spec.id] = []
        self._restep(job)
        # A node that is already faulty slows the new run from its first window.
        for n in nodes:
            for f in self._active_on(n):
                self._encounter(f, job, job.run.windows_from)

    def _sync_requeued(self) -> None:
        """A requeued job SimSlurm started again: its next run begins (after its restart time)."""
        for job_id in list(self.requeued):
            info = self.slurm.job(job_id)
            if info is not None and info.state == "RUNNING":
                job = self.requeued.pop(job_id)
                self._begin_run(job, tuple(self.index[n] for n in info.nodes), job.spec.restart_s)

    def _end_run(self, job: Job, state: str) -> None:
        run = job.run
        run.ended = self.now
        for n in run.nodes:
            self.node_job.pop(n, None)
            if n not in self.drained:
                self.free.add(n)
        self.running.pop(job.spec.id, None)
        for f in self.job_faults.pop(job.spec.id, []):
            if f.active(self.now):
                f.end = self.now
        for enc in self._encounters_of(job.spec.id, run.number):
            if enc.ended_at is None:
                enc.ended_at, enc.ended_by = self.now, ("requeue" if state == "requeued" else "job end")
        job.state = state

    def _advance_jobs(self, dt: float) -> None:
        r = self.result
        g = self.p.gpus_per_node
        for job in self.running.values():
            gpus = job.spec.nodes * g
            r.gpu_hours_total += gpus * dt / 3600.0
            if self.now + dt <= job.run.windows_from:
                continue  # restarting: booked as the requeue's cost
            rate = HEALTHY_STEP_MS / job.step_ms
            job.progress += dt * rate
            if rate < 1.0:
                lost = gpus * (1.0 - rate) * dt / 3600.0
                r.slow_gpu_hours += lost
                # No fault left: the rebalance still in place makes the others carry the moved work.
                cause = job.cause_now or "rebalance left in place"
                r.slow_by_cause[cause] = r.slow_by_cause.get(cause, 0.0) + lost

    def _ends(self) -> None:
        """Jobs whose work is done end; jobs past their time limit are killed (TIMEOUT)."""
        for job in [j for j in self.running.values() if j.progress >= j.spec.work_s
                    or self.now - j.run.start >= j.spec.limit_s]:
            self._end(job, "COMPLETED" if job.progress >= job.spec.work_s else "TIMEOUT")

    def _end(self, job: Job, state: str) -> None:
        self._end_run(job, "done" if state == "COMPLETED" else "timeout")
        self.slurm.end_job(job.spec.id, state)
        if state == "COMPLETED":
            self.result.jobs_finished += 1
        else:
            # Killed at its limit: resubmitted, it starts again from its last checkpoint.
            self.result.timeouts += 1
            self.result.timeout_gpu_hours += job.spec.nodes * self.p.gpus_per_node * \
                ((job.spec.done_s + job.progress) % job.spec.checkpoint_s) / 3600.0
        self._sync_requeued()

    # --- the lockstep step ----------------------------------------------------------------------

    def _faults_on(self, job: Job) -> list[tuple[Fault, int | None]]:
        """Active faults slowing the job, with the rank they slow (None: node-wide or link)."""
        out: list[tuple[Fault, int | None]] = []
        for pos, n in enumerate(job.run.nodes):
            for f in self._active_on(n):
                out.append((f, None if f.cause == "comm.link" else pos * self.p.gpus_per_node + f.gpu))
        for f in self.job_faults.get(job.spec.id, ()):
            if f.active(self.now):
                rank = job.run.nodes.index(f.node) * self.p.gpus_per_node + f.gpu \
                    if f.node in job.run.nodes else None
                out.append((f, None if f.cause in NODE_SCOPED else rank))
        return out

    def _shape(self, job: Job) -> tuple[float, float, float, str | None]:
        """(step ms, the fast ranks' busy ms, the collectives' ms, the cause slowing it most)."""
        g = self.p.gpus_per_node
        world = job.spec.nodes * g
        slow: dict[int, float] = {}
        link = 0.0
        worst, worst_cause = 0.0, None
        for f, rank in self._faults_on(job):
            if f.cause == "comm.link":
                link = max(link, f.magnitude)
                ranks: Iterable[int] = ()
            elif rank is None:  # every rank of the node
                pos = job.run.nodes.index(f.node)
                ranks = range(pos * g, pos * g + g)
            else:
                ranks = (rank,)
            for r_ in ranks:
                slow[r_] = max(slow.get(r_, 0.0), f.magnitude)
            if f.magnitude > worst:
                worst, worst_cause = f.magnitude, f.cause
        listed = {r_: s for r_, s in job.shares.items() if 0 <= r_ < world}
        others = 1.0 + (sum(1.0 - s for s in listed.values()) / max(1, world - len(listed)))
        fast = BUSY_MS * others
        levels: list[float] = []
        for r_ in set(slow) | set(listed):
            b = BUSY_MS * listed.get(r_, others) * (1.0 + slow.get(r_, 0.0))
            levels.append(b)
        unlisted = world - len(set(slow) | set(listed))
        busy_max = max([*levels, fast if unlisted else 0.0])
        # The fast ranks' pace: the lower quartile of the ranks' busy time (verify.fast_pace).
        ordered = sorted(levels + [fast] * min(unlisted, world))
        q = int(math.floor(0.25 * (len(ordered) - 1))) if len(ordered) > 1 else 0
        pace = ordered[q] if ordered else fast
        collectives = COMM_MS + link * HEALTHY_STEP_MS
        return busy_max + collectives, pace, collectives, worst_cause

    def _restep(self, job: Job) -> None:
        if job.state != "running":
            return
        step, pace, coll, cause = self._shape(job)
        job.step_ms, job.cause_now = step, cause
        seg = (self.now, step, pace, coll)
        segs = job.run.segments
        if segs and segs[-1][0] == self.now:
            segs[-1] = seg
        elif not segs or segs[-1][1:] != seg[1:]:
            segs.append(seg)

    # --- throughput windows (what verification reads) ------------------------------------------------

    def _window(self, job: Job, run: Run, seq: int) -> verify.WindowShape:
        w = self.p.window_s
        a = run.windows_from + seq * w
        b = a + w
        segs = run.segments
        times = [s[0] for s in segs]
        i = max(0, bisect_right(times, a) - 1)
        steps = pace = 0.0
        coll = 0.0
        t = a
        while t < b and i < len(segs):
            nxt = segs[i + 1][0] if i + 1 < len(segs) else math.inf
            span = min(b, nxt) - t
            if span > 0:
                steps += span / (segs[i][1] / 1000.0)
                pace += span * segs[i][2]
                coll += span * segs[i][3]
            t = min(b, nxt)
            i += 1
        world = job.spec.nodes * self.p.gpus_per_node
        # Uniform, sd WINDOW_NOISE; a hash of ints is the same in every process (no string hashing).
        u = (hash((self.p.seed, int(job.spec.id), run.number, seq)) & 0xFFFFFFFF) / 2.0 ** 32
        noise = (2.0 * u - 1.0) * WINDOW_NOISE * math.sqrt(3.0)
        throughput = steps * world * SAMPLES_PER_RANK / w * (1.0 + noise)
        return verify.WindowShape(seq, throughput, world, float(world * SAMPLES_PER_RANK), float(STEPS_PER_WINDOW),
                                  pace / w, coll / w, w)

    def _window_of(self, run: Run, t: float) -> int:
        return int(math.floor((t - run.windows_from) / self.p.window_s))

    def _windows(self, job: Job, run: Run, first: int, last: int) -> list[verify.WindowShape]:
        end = run.ended if run.ended is not None else self.now
        last = min(last, self._window_of(run, end) - 1)  # whole windows only: they no longer change
        cache = run.windows
        out = []
        for seq in range(max(0, first), last + 1):
            w = cache.get(seq)
            if w is None:
                w = cache[seq] = self._window(job, run, seq)
            out.append(w)
        return out

    # --- faults ------------------------------------------------------------------------------------------

    def _active_on(self, node: int, at: float | None = None) -> list[Fault]:
        when = self.now if at is None else at
        return [f for f in self.node_faults.get(node, ()) if f.active(when) and f.onset <= when]

    def _ev_node_fault(self, spec: NodeFaultSpec) -> None:
        # Every drawn fault arrives, in every mode (a node may have a hot GPU and a bad link at once).
        f = Fault(f"HW-{spec.id}", spec.cause, spec.magnitude, spec.node, spec.gpu, self.now)
        self.node_faults.setdefault(spec.node, []).append(f)
        self.result.faults += 1
        job_id = self.node_job.get(spec.node)
        if job_id is not None:
            job = self.jobs[job_id]
            self._restep(job)
            self._encounter(f, job, max(self.now, job.run.windows_from))

    def _ev_transient(self, payload: tuple[str, TransientSpec]) -> None:
        job_id, tr = payload
        job = self.jobs[job_id]
        if job.state != "running" or tr.node_index >= len(job.run.nodes):
            return  # the job is not running now: this one passes it by
        f = Fault(f"TR-{job_id}-{tr.offset_s:.0f}", tr.cause, tr.magnitude, job.run.nodes[tr.node_index], tr.gpu,
                  self.now, end=self.now + max(self.p.tick_s, tr.duration_s), job=job_id, run=job.run.number)
        self.job_faults.setdefault(job_id, []).append(f)
        self._restep(job)
        self._push(f.end, "transient_end", (job_id, f))
        self._encounter(f, job, max(self.now, job.run.windows_from))

    def _ev_transient_end(self, payload: tuple[str, Fault]) -> None:
        job_id, f = payload
        job = self.jobs[job_id]
        if job.state == "running" and job.run.number == f.run:
            self._restep(job)
        self._fault_over(f, "itself")

    def _ev_false_alarm(self, payload: tuple[str, float, int]) -> None:
        job_id, duration, rank = payload
        job = self.jobs[job_id]
        if job.state != "running" or self.now < job.run.windows_from or rank >= job.spec.nodes * self.p.gpus_per_node:
            return
        enc = Encounter(None, job_id, job.run.number, self.now, rank, "unknown", IncidentKind.RANK,
                        self.now + self.p.window_s * 2, alarm_end=self.now + duration)
        self.encounters.append(enc)
        self._push(enc.due, "detect", enc)
        self._push(enc.alarm_end, "alarm_end", enc)

    def _ev_alarm_end(self, enc: Encounter) -> None:
        enc.ended_at, enc.ended_by = self.now, "itself"
        if enc.incident is not None:
            self._push(self.now + self.p.window_s * self._recover_windows(), "subject_healthy", enc)

    def _recover_windows(self) -> int:
        return self.config.analysis.recover_windows if self.config is not None else 3

    def _fault_over(self, f: Fault, by: str) -> None:
        """The fault stopped slowing whatever job met it."""
        for enc in self.encounters_of_fault(f):
            self._encounter_over(enc, by)

    def encounters_of_fault(self, f: Fault) -> list[Encounter]:
        return [e for e in self._by_fault.get(f.id, ()) if e.ended_at is None]

    def _encounter_over(self, enc: Encounter, by: str) -> None:
        if enc.ended_at is not None:
            return
        enc.ended_at, enc.ended_by = self.now, by
        if by not in ("itself", "job end") and enc.fault is not None:
            self.result.recovery_minutes.append((self.now - enc.onset) / 60.0)
            self.result.recovery_by_cause.setdefault(enc.fault.cause, []).append((self.now - enc.onset) / 60.0)
        if enc.incident is not None:
            self._push(self.now + self.p.window_s * self._recover_windows(), "subject_healthy", enc)

    def _encounters_of(self, job_id: str, run: int) -> list[Encounter]:
        return [e for e in self._by_job.get(job_id, ()) if e.run == run]

    def _encounter(self, f: Fault, job: Job, onset: float) -> None:
        """The analysis meets this fault in this run: detected (measured rate), when, and named as what."""
        for e in self._by_fault.get(f.id, ()):
            if e.job == job.spec.id and e.run == job.run.number:
                return
        m = self.sc.params
        model = MEASURED_DETECTION[f.cause]
        rng = random.Random(f"{m.seed}:{f.id}:{job.spec.id}:{job.run.number}")
        detected = rng.random() < model["detected"] / model["faults"]
        latency = max(0, int(rng.choice(model["latency"])))
        named = rng.choices(list(model["named"]), weights=list(model["named"].values()))[0]
        pos = job.run.nodes.index(f.node)
        rank = pos * self.p.gpus_per_node + f.gpu
        # Confirmed at the end of the window ``latency`` windows after the one it became visible in.
        due = onset + (latency + 1) * self.p.window_s if detected else None
        if f.cause == "comm.link" and self.link_probes:
            named, kind = "comm.link", IncidentKind.LINK
            due = due + PROBES_TO_NAME_A_LINK_S if due is not None else None
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
        self.result.encounters += 1
        self._faulty_jobs.add(job.spec.id)
        if due is not None:
            self._push(due, "detect", enc)

    # --- detection -> incidents ------------------------------------------------------------------------

    def _ev_detect(self, enc: Encounter) -> None:
        job = self.jobs[enc.job]
        if enc.ended_at is not None or job.state != "running" or job.run.number != enc.run:
            return  # gone before the analysis confirmed it
        enc.detected_at = self.now
        if enc.fault is None:
            self.result.false_alarms += 1
        else:
            self.result.detected += 1
        if self.mode == "none":
            return
        inc = self._incident(enc, job)
        enc.incident = inc.id
        self.by_incident[inc.id] = enc
        self.open_incidents.add(inc.id)
        assert self.loop is not None
        node = job.run.nodes[enc.rank // self.p.gpus_per_node]
        # The loop reads node evidence only for a hard action; a false alarm is held (no signal deviates)
        # and never takes one, so its node check is left out (a fleet has tens of thousands of them).
        evidence = self._node_check(node) if enc.fault is not None else None
        self.loop.observe(inc, self.now, gpus=job.spec.nodes * self.p.gpus_per_node,
                          time_left_s=max(0.0, job.run.start + job.spec.limit_s - self.now),
                          node_evidence=evidence,
                          # The daemon knows a rank's GPU from its reports; a node or job incident names none.
                          gpu=enc.rank % self.p.gpus_per_node if inc.kind is IncidentKind.RANK else None,
                          rebalance_opt_in=job.spec.opt_in, measured_loss_pct=inc.measured_loss_pct)
        self._to_decide.add(inc.id)

    def _incident(self, enc: Encounter, job: Job) -> Incident:
        self._incident_no += 1
        run = job.run
        g = self.p.gpus_per_node
        node = self.names[run.nodes[enc.rank // g]]
        f = enc.fault
        magnitude = f.magnitude if f is not None else 0.0
        loss = 100.0 * (1.0 - HEALTHY_STEP_MS / job.step_ms) if f is not None else 0.0
        onset_w, confirmed_w = max(0, self._window_of(run, enc.onset)), max(0, self._window_of(run, self.now) - 1)
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
            id=f"INC-{self._incident_no}", job=job.spec.id, kind=kind, state=S.CONFIRMED,
            rank=enc.rank if kind is IncidentKind.RANK else None,
            node=node if kind in (IncidentKind.RANK, IncidentKind.NODE, IncidentKind.LINK) else None,
            link=node if kind is IncidentKind.LINK else None, island="nvidia",
            onset_window=onset_w, flagged_window=max(onset_w, confirmed_w - 1), confirmed_window=confirmed_w,
            ratio=round(1.0 + magnitude, 3) if f is not None and f.cause != "comm.link"
            else round(job.step_ms / HEALTHY_STEP_MS, 3),
            excess_ms=round(BUSY_MS * magnitude, 1), loss_pct=round(loss, 2), measured_loss_pct=round(loss, 2),
            cause=cause, confidence=0.8 if cause is not Cause.UNKNOWN else 0.0, evidence=evidence)

    def _node_check(self, node: int) -> tuple[float, dict[str, Any]]:
        """The node's latest root-side health event (every ``health_check_s``): what its GPUs show now."""
        p = self.p
        taken = math.floor(self.now / p.health_check_s) * p.health_check_s
        known = self._checks.get((node, taken))
        if known is not None:
            return known
        if len(self._checks) > 4096:
            self._checks.clear()
        loaded = node in self.node_job
        faults = self._active_on(node, taken)
        decoy = random.Random(f"{p.seed}:decoy:{node}:{taken:.0f}")
        gpus = []
        for i in range(p.gpus_per_node):
            g: dict[str, Any] = {"index": i, "vendor": "nvidia", "model": "NVIDIA H100 80GB HBM3",
                                 "sm_clock_mhz": HEALTHY_CLOCK_MHZ if loaded else 210,
                                 "max_sm_clock_mhz": HEALTHY_CLOCK_MHZ, "power_limit_w": HEALTHY_POWER_W,
                                 "default_power_limit_w": HEALTHY_POWER_W, "temp_c": 70 if loaded else 35,
                                 "util_pct": 97 if loaded else 0, "throttle": [] if loaded else ["idle"]}
            if loaded and decoy.random() < p.decoy_rate:
                g["throttle"] = ["sw_power_cap"]  # the benign cap healthy GPUs show at full load
            for f in faults:
                if f.gpu != i or f.cause == "comm.link":
                    continue
                slowed = round(HEALTHY_CLOCK_MHZ / (1.0 + f.magnitude))
                if f.cause == "gpu.thermal":
                    g.update(temp_c=90, throttle=["sw_thermal"], sm_clock_mhz=slowed if loaded else 210)
                elif f.cause == "gpu.power":
                    g.update(power_limit_w=round(HEALTHY_POWER_W / (1.0 + f.magnitude)),
                             throttle=["sw_power_cap"] if loaded else ["idle"],
                             sm_clock_mhz=slowed if loaded else 210)
                elif f.cause == "gpu.clocks" and loaded:
                    g.update(sm_clock_mhz=slowed, throttle=[])
            gpus.append(g)
        link = any(f.cause == "comm.link" for f in faults)
        retransmits = 20.0 if link and loaded else 0.0  # retransmits need traffic
        body = {"type": "node", "v": 1, "event": "health", "node": self.names[node], "time": taken,
                "gpus": gpus, "host": {"net_retransmits_per_s": retransmits}}
        self._checks[(node, taken)] = (taken, body)
        return taken, body

    # --- the loop and its person -----------------------------------------------------------------------

    def _loop_turn(self) -> None:
        loop = self.loop
        assert loop is not None
        now = self.now
        decided: list[str] = []
        if now - self._last_decide >= self.p.decide_every_s:
            self._last_decide = now
            decided = sorted(self._live_incidents(now), key=_incident_no)
            # The node checks of the nodes these incidents are about arrive (every HealthCheckInterval).
            for inc_id in decided:
                enc = self.by_incident[inc_id]
                job = self.jobs[enc.job]
                if enc.fault is not None and job.state == "running" and job.run.number == enc.run:
                    node = job.run.nodes[enc.rank // self.p.gpus_per_node]
                    received, body = self._node_check(node)
                    loop.node_event(self.names[node], received, body)
        elif self._to_decide:
            decided = sorted(self._to_decide & self.open_incidents, key=_incident_no)
        if decided:
            loop.decide(decided, now)
        # Only a decision, an approval or a verdict changes an incident's state: look at those.
        watch = set(decided) | self._verifying | self._touched
        self._to_decide.clear()
        self._touched.clear()
        for inc_id in sorted(watch, key=_incident_no):
            if inc_id not in self.open_incidents:
                continue
            t = loop.tracked(inc_id)
            state = t.inc.state
            if state is S.VERIFYING:
                self._verifying.add(inc_id)
                self._verify(inc_id)
            elif state in (S.RESOLVED, S.DISMISSED):
                self._closed(inc_id)
            if len(t.escalations) > self._escalated_seen.get(inc_id, 0):
                self._escalated_seen[inc_id] = len(t.escalations)
                self.result.escalations += 1
                self._push(now + self.p.person_response_s, "person_visits", inc_id)

    def _closed(self, inc_id: str) -> None:
        self.open_incidents.discard(inc_id)
        self._verifying.discard(inc_id)

    def _live_incidents(self, now: float) -> list[str]:
        """Open incidents whose decision may still change with time.

        The daemon closes an incident when its subject is seen healthy again;
        an incident whose job ended (or moved) first is never seen again and
        stays open, held or escalated, for good.  Once it has been decided past
        ``UnknownEscalateAfter`` nothing it is decided on changes any more, so
        it is left out of the periodic turn (it is still verified, approved,
        closed like any other).
        """
        wait = self.config.daemon.unknown_escalate_after + self.p.decide_every_s
        live = []
        for inc_id in self.open_incidents - self._dormant:
            enc = self.by_incident[inc_id]
            job = self.jobs[enc.job]
            if (job.state != "running" or job.run.number != enc.run) and self.loop is not None \
                    and now - self.loop.tracked(inc_id).opened_at > wait:
                self._dormant.add(inc_id)
                continue
            live.append(inc_id)
        return live

    def _evidence(self, enc: Encounter, inc_id: str) -> verify.Evidence:
        """The windows verification reads: the healthy ones before the onset and the slowed ones up to the
        action (the run the fault was seen in), and those after the action (that run, or the next one)."""
        job = self.jobs[enc.job]
        origin_run = job.runs[enc.run]
        onset_w = max(0, self._window_of(origin_run, enc.onset))
        acted = self.loop.acted_at(inc_id) if self.loop is not None else None
        acted = acted if acted is not None else self.now
        current_run = job.runs[-1]
        restarted = current_run.number != enc.run
        action_w = self._window_of(origin_run, acted)
        rules = verify.Rules.of(self.config.daemon)
        # During the slowdown only its median is read (verify.during): the last hour of it is plenty.
        origin = self._windows(job, origin_run, onset_w - verify.BASELINE_WINDOWS, onset_w - 1) + \
            self._windows(job, origin_run, max(onset_w, action_w - 60), action_w)
        after = rules.warmup + rules.windows_lasting(self.p.window_s) + 2
        if restarted:
            current = self._windows(job, current_run, 0, after)
        else:
            current = origin + self._windows(job, origin_run, action_w + 1, action_w + after)
        end = current_run.ended if current_run.ended is not None else self.now
        last_seen = None
        if end > current_run.windows_from:
            last_seen = current_run.windows_from + self._window_of(current_run, end) * self.p.window_s
        elif origin_run.ended is not None:
            last_seen = origin_run.ended
        series = [(w.seq, w.throughput) for w in origin]
        return verify.Evidence(verify.baseline(series, onset_w), origin, current, restarted, onset_w,
                               None if restarted else action_w, last_seen)

    def _verify(self, inc_id: str) -> None:
        loop = self.loop
        assert loop is not None
        enc = self.by_incident[inc_id]
        v = loop.verify(inc_id, self._evidence(enc, inc_id), self.now)
        if v is None or v.state is None:
            return
        r = self.result
        r.verdicts += 1
        if v.verification.recovered:
            r.verdicts_recovered += 1
            if enc.fault is not None:
                r.verified_minutes.append((self.now - enc.onset) / 60.0)
                enc.verified_at = self.now
        self._verifying.discard(inc_id)
        if v.state == "resolved":
            self._closed(inc_id)
        else:
            self._to_decide.add(inc_id)

    def _ev_subject_healthy(self, enc: Encounter) -> None:
        """The analysis saw the subject healthy again for RecoverWindows windows: the loop closes the
        incident if the job's latest VerifyWindows windows say its throughput is back (the daemon's
        ``_close_recovered``)."""
        if self.loop is None or enc.incident is None or enc.incident not in self.open_incidents:
            return
        job = self.jobs[enc.job]
        if job.run.number != enc.run or job.state != "running":
            return  # the job ended or moved: no windows of this run to judge
        run = job.run
        rules = verify.Rules.of(self.config.daemon)
        last = self._window_of(run, self.now) - 1
        since = last - rules.windows_lasting(self.p.window_s)
        onset_w = max(0, self._window_of(run, enc.onset))
        origin = self._windows(job, run, onset_w - verify.BASELINE_WINDOWS, onset_w - 1)
        baseline = verify.baseline([(w.seq, w.throughput) for w in origin], onset_w)
        measured = None
        if baseline is not None:
            ev = verify.Evidence(baseline, origin, self._windows(job, run, since + 1, last), False, onset_w, None,
                                 self.now)
            measured = verify.measure(enc.kind.value, enc.named, ev, rules, since=since)
        if self.loop.subject_recovered(enc.incident, self.now, measured):
            self._closed(enc.incident)
        elif self.now - (enc.ended_at or self.now) < 3600.0:
            # Not back yet (or not enough windows): the analysis keeps looking.
            self._push(self.now + self.p.window_s * rules.windows, "subject_healthy", enc)

    def _ev_person_visits(self, inc_id: str) -> None:
        """The person paged by an escalation looks, ``person_response_s`` later."""
        loop = self.loop
        assert loop is not None
        t = loop.tracked(inc_id)
        waiting = [r for r in loop.actions(inc_id) if r.status == "pending_approval"]
        if waiting:
            try:
                loop.approve(inc_id, PERSON, self.now)
                self.result.approvals += 1
            except ValueError:
                # The drain budget refused it: the person looks again later.
                self._push(self.now + self.p.person_response_s, "person_visits", inc_id)
            self._to_decide.add(inc_id)
            self._touched.add(inc_id)
            return
        if t.inc.state is not S.ESCALATED:
            return
        enc = self.by_incident[inc_id]
        # Artemis priced a requeue and found waiting cheaper: the person who reads that leaves the job be.
        # Detect-only, nothing was priced: the person requeues as people do.
        requeue = not any("waiting is cheaper" in e for e in t.escalations)
        self._natural_remedy(enc, requeue)

    def _natural_remedy(self, enc: Encounter, requeue: bool) -> None:
        """What a person does for the fault they find: reset clocks or the power limit, drain a hot node
        or a node with a bad link and requeue its job elsewhere; a transient host or input stall gets nothing."""
        f = enc.fault
        if f is None or not f.active(self.now) or enc.ended_at is not None:
            return
        if f.cause in ("gpu.clocks", "gpu.power"):
            self._fix(f, "person correction")
            self.result.corrections += 1
        elif f.cause in ("gpu.thermal", "comm.link"):
            self._person_drain(f.node, f"{PERSON}: {f.cause} {self.names[f.node]}")
            job = self.jobs[enc.job]
            if requeue and job.state == "running" and job.run.number == enc.run and f.node in job.run.nodes:
                self._price_person_requeue(job, f)
                self._requeue(job, f.node, by=PERSON)

    def _price_person_requeue(self, job: Job, f: Fault) -> None:
        """What the loop's price (``decide.rung_cost``, default policy) says of this requeue: when waiting
        would have been cheaper than the person's restart."""
        loss = 100.0 * (1.0 - HEALTHY_STEP_MS / job.step_ms)
        inc = Incident(id="price", job=job.spec.id, kind=IncidentKind.NODE, cause=Cause(f.cause), loss_pct=loss)
        facts = decide.Facts(now=self.now, gpus=job.spec.nodes * self.p.gpus_per_node, measured_loss_pct=loss,
                             time_left_s=max(0.0, job.run.start + job.spec.limit_s - self.now))
        price = decide.rung_cost("requeue", inc, DEFAULT_POLICY, facts)
        gpus = facts.gpus or 1
        cost = gpus * (DEFAULT_POLICY.checkpoint_interval / 2.0 + DEFAULT_POLICY.restart_cost) / 3600.0
        saved = gpus * loss / 100.0 * (facts.time_left_s or 0.0) / 3600.0
        self.result.person_requeue_prices.append((price.pays, round(cost, 2), round(saved, 2)))

    def _person_drain(self, node: int, reason: str) -> None:
        info = self.slurm.node(self.names[node])
        if info.drained:
            return
        self.slurm.person_drain(self.names[node], reason)
        if self.loop_slurm is not None:
            self.loop_slurm.changed()
        self._drained(node, PERSON)

    def _requeue(self, job: Job, node: int, by: str) -> None:
        """A person's requeue excluding ``node`` (scontrol requeuehold, ExcNodeList, release)."""
        info = self.slurm.job(job.spec.id)
        if info is None or info.state != "RUNNING":
            return
        self.slurm.requeue_hold(job.spec.id)
        self.slurm.set_excluded_nodes(job.spec.id, tuple(dict.fromkeys((*info.excluded_nodes, self.names[node]))))
        self.slurm.release(job.spec.id)
        self._requeued(job, by)

    # --- physical effects of actions -------------------------------------------------------------------

    def on_action(self, kind: str, target: str | None, params: dict[str, Any], inc: Incident | None = None
                  ) -> Outcome | None:
        """An action's physical effect on the simulated fleet (the loop's ``on_action`` hook): what Slurm
        does not do itself.  A correction fixes what it can fix and nothing else."""
        if kind == "rebalance":
            job = self.jobs[params["job"]]
            job.shares = {int(r): float(s) for r, s in (params.get("shares") or {}).items()}
            if params.get("shares"):
                self.result.rebalances += 1
            self._restep(job)
            self._rebalanced(job)
        elif kind == "correct":
            self.result.corrections += 1
            node = self.index[params["node"]]
            fixes = CORRECTION_FIXES.get(params.get("kind", ""))
            for f in self._active_on(node):
                if f.cause == fixes and params.get("gpu") in (None, f.gpu):
                    self._fix(f, "correction")
        elif kind == "drain":
            self._drained(self.index[params["node"]], "artemis")
        elif kind == "undrain":
            node = self.index[params["node"]]
            if node in self.drained:
                self._undrained(node)
                if node not in self.node_job:
                    self.free.add(node)
        elif kind == "requeue":
            self._requeued(self.jobs[params["job"]], "artemis")
        return None

    def _fix(self, f: Fault, by: str) -> None:
        f.fixed_at, f.fixed_by = self.now, by
        job_id = self.node_job.get(f.node) if f.job is None else f.job
        if job_id is not None:
            self._restep(self.jobs[job_id])
        self._fault_over(f, by)

    def _rebalanced(self, job: Job) -> None:
        """A rebalance that brought the step back to within 5 % of healthy ended the job's suffering."""
        if job.step_ms > HEALTHY_STEP_MS * 1.05:
            return
        for enc in self._encounters_of(job.spec.id, job.run.number):
            if enc.fault is not None and enc.ended_at is None and enc.fault.active(self.now):
                self._encounter_over(enc, "rebalance")

    def _drained(self, node: int, who: str) -> None:
        if node in self.drained:
            return
        healthy = not self._active_on(node)
        self.drained[node] = (who, self.now, healthy)
        self.free.discard(node)
        r = self.result
        r.drains += 1
        r.drains_by[who] = r.drains_by.get(who, 0) + 1
        if healthy:
            r.healthy_drains += 1
        self._push(self.now + self.p.repair_s, "repair", (node, self.now))

    def _undrained(self, node: int) -> None:
        _, at, healthy = self.drained.pop(node)
        if healthy:
            self.result.healthy_drain_node_hours += (self.now - at) / 3600.0

    def _ev_repair(self, payload: tuple[int, float]) -> None:
        """A person repaired the drained node (whatever was wrong with it) and resumes it, once its
        last job left (a drain does not stop the job running there)."""
        node, at = payload
        if node not in self.drained or self.drained[node][1] != at:
            return  # resumed (rolled back) meanwhile
        if node in self.node_job:
            self._push(self.now + 600.0, "repair", payload)
            return
        for f in self._active_on(node):
            self._fix(f, "repair")
        self._undrained(node)
        info = self.slurm.node(self.names[node])
        if info.drained:
            self.slurm.person_resume(self.names[node])
            if self.loop_slurm is not None:
                self.loop_slurm.changed()
        if node not in self.node_job:
            self.free.add(node)
        self._sync_requeued()

    def _requeued(self, job: Job, by: str) -> None:
        if job.state != "running":
            return
        # Checkpoints fall every checkpoint_s of the job's work, counted from its very start (a job
        # already running at t = 0 brought done_s with it).
        lost = (job.spec.done_s + job.progress) % job.spec.checkpoint_s
        job.requeue_losses.append((self.now, job.progress, lost))
        job.progress -= lost
        gpus = job.spec.nodes * self.p.gpus_per_node
        r = self.result
        r.requeues += 1
        r.requeue_gpu_hours += gpus * (lost + job.spec.restart_s) / 3600.0
        run = job.run
        for enc in self._encounters_of(job.spec.id, run.number):
            if enc.ended_at is None and enc.fault is not None and enc.fault.active(self.now):
                self._encounter_over(enc, f"requeue by {by}")
        self._end_run(job, "requeued")
        info = self.slurm.job(job.spec.id)
        job.excluded = {self.index[n] for n in (info.excluded_nodes if info is not None else ())}
        job.shares = {}
        self.requeued[job.spec.id] = job

    # --- the end -------------------------------------------------------------------------------------------

    def _finish(self) -> None:
        r = self.result
        for node in list(self.drained):
            self._undrained(node)  # still drained at the end: its hours so far
        r.faulty_jobs = len(self._faulty_jobs)
        if self.loop is not None:
            r.budget_refusals = self.loop.budget_refusals
            states = Counter(self.loop.tracked(i).inc.state.value for i in self.by_incident)
            r.incident_states = dict(sorted(states.items()))
            for note in self.loop.notes():
                if note.what == "escalated" and "waiting is cheaper" in note.why:
                    enc = self.by_incident.get(note.incident or "")
                    cause = enc.fault.cause if enc is not None and enc.fault is not None else "none (false alarm)"
                    r.waits[cause] += 1
                    if len(r.wait_examples) < 6:
                        r.wait_examples.append(f"{note.incident} ({cause}): {note.why}")


_SIGNAL = {"gpu.thermal": "temp_c", "gpu.power": "power_limit_w", "gpu.clocks": "sm_clock_mhz",
           "comm.link": "probe.p2p_ms", "host.cpu": "cpu_pct", "input.loader": "ms.data",
           "input.storage": "iowait_pct"}


def run_fleet(params: FleetParams, modes: Iterable[str] = MODES, policy: str | Path | None = None,
              link_probes: bool = False) -> dict[str, ModeResult]:
    """Every mode over the same scenario (same jobs, same faults, same seed)."""
    scenario = draw_scenario(params)
    out = {}
    for mode in modes:
        config = mode_config(mode, policy) if mode == "artemis" else None
        out[mode] = FleetSim(scenario, mode, config, link_probes=link_probes).run()
    return out


def _incident_no(incident_id: str) -> int:
    return int(incident_id.rpartition("-")[2])
