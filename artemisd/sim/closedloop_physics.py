"""The whole loop at fleet scale, its physics: the faults a node or a job's run has (hardware faults
until fixed, transient ones until they end by themselves), the lockstep step they make (``Physics.restep``),
the throughput windows verification reads (``Physics.windows``), and the node checks the root side reports
(``Physics.node_check``).

A job runs in lockstep: a slowed rank (busy time up by the fault's magnitude) or a slowed link (step time
up by it) slows every rank; a rebalance moves work off the named rank.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from artemisd import verify
from artemisd.sim.closedloop_records import Fault, Job, Run
from artemisd.sim.closedloop_scenario import (
    BUSY_MS,
    COMM_MS,
    HEALTHY_STEP_MS,
    NODE_SCOPED,
    SAMPLES_PER_RANK,
    STEPS_PER_WINDOW,
    WINDOW_NOISE,
    NodeFaultSpec,
    TransientSpec,
)

if TYPE_CHECKING:
    from artemisd.sim.closedloop import FleetSim

HEALTHY_CLOCK_MHZ, HEALTHY_POWER_W = 1980, 700


class Physics:
    """The faults of one fleet and what they do to its jobs' steps, windows and node checks."""

    def __init__(self, sim: FleetSim):
        self.sim = sim
        self.p = sim.p
        self.node_faults: dict[int, list[Fault]] = {}  # hardware faults a node ever had
        self.job_faults: dict[str, list[Fault]] = {}  # the transient faults of each running job's run
        self._checks: dict[tuple[int, float], tuple[float, dict[str, Any]]] = {}

    # --- faults arriving and leaving -------------------------------------------------------------

    def node_fault(self, spec: NodeFaultSpec) -> None:
        """A hardware fault arrives on a node: it slows the job running there (and every later one) until fixed."""
        now = self.sim.now
        # Every drawn fault arrives, in every mode (a node may have a hot GPU and a bad link at once).
        f = Fault(f"HW-{spec.id}", spec.cause, spec.magnitude, spec.node, spec.gpu, now)
        self.node_faults.setdefault(spec.node, []).append(f)
        self.sim.result.faults += 1
        job_id = self.sim.sched.node_job.get(spec.node)
        if job_id is not None:
            job = self.sim.jobs[job_id]
            self.restep(job)
            self.sim.analysis.encounter(f, job, max(now, job.run.windows_from))

    def transient(self, payload: tuple[str, TransientSpec]) -> None:
        """A transient fault of a job's run begins (if the job runs now): it ends by itself."""
        job_id, tr = payload
        job = self.sim.jobs[job_id]
        if job.state != "running" or tr.node_index >= len(job.run.nodes):
            return  # the job is not running now: this one passes it by
        now = self.sim.now
        f = Fault(f"TR-{job_id}-{tr.offset_s:.0f}", tr.cause, tr.magnitude, job.run.nodes[tr.node_index], tr.gpu,
                  now, end=now + max(self.p.tick_s, tr.duration_s), job=job_id, run=job.run.number)
        self.job_faults.setdefault(job_id, []).append(f)
        self.restep(job)
        self.sim.push(f.end, "transient_end", (job_id, f))
        self.sim.analysis.encounter(f, job, max(now, job.run.windows_from))

    def transient_end(self, payload: tuple[str, Fault]) -> None:
        job_id, f = payload
        job = self.sim.jobs[job_id]
        if job.state == "running" and job.run.number == f.run:
            self.restep(job)
        self.sim.analysis.fault_over(f, "itself")


    def run_begins(self, job: Job) -> None:
        """A run of the job starts: the transient faults of its last run are gone."""
        self.job_faults[job.spec.id] = []

    def run_ends(self, job: Job) -> None:
        """The job's run ended: its transient faults end with it."""
        for f in self.job_faults.pop(job.spec.id, []):
            if f.active(self.sim.now):
                f.end = self.sim.now

    def active_on(self, node: int, at: float | None = None) -> list[Fault]:
        when = self.sim.now if at is None else at
        return [f for f in self.node_faults.get(node, ()) if f.active(when) and f.onset <= when]

    # --- the lockstep step ------------------------------------------------------------------------

    def _faults_on(self, job: Job) -> list[tuple[Fault, int | None]]:
        """Active faults slowing the job, with the rank they slow (None: node-wide or link)."""
        out: list[tuple[Fault, int | None]] = []
        for pos, n in enumerate(job.run.nodes):
            for f in self.active_on(n):
                out.append((f, None if f.cause == "comm.link" else pos * self.p.gpus_per_node + f.gpu))
        for f in self.job_faults.get(job.spec.id, ()):
            if f.active(self.sim.now):
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

    def restep(self, job: Job) -> None:
        """The running job's step as its faults and shares make it now: a new segment of its run if it changed."""
        if job.state != "running":
            return
        step, pace, coll, cause = self._shape(job)
        job.step_ms, job.cause_now = step, cause
        seg = (self.sim.now, step, pace, coll)
        segs = job.run.segments
        if segs and segs[-1][0] == self.sim.now:
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

    def window_of(self, run: Run, t: float) -> int:
        return int(math.floor((t - run.windows_from) / self.p.window_s))

    def windows(self, job: Job, run: Run, first: int, last: int) -> list[verify.WindowShape]:
        end = run.ended if run.ended is not None else self.sim.now
        last = min(last, self.window_of(run, end) - 1)  # whole windows only: they no longer change
        cache = run.windows
        out = []
        for seq in range(max(0, first), last + 1):
            w = cache.get(seq)
            if w is None:
                w = cache[seq] = self._window(job, run, seq)
            out.append(w)
        return out

    # --- what the root side reports ------------------------------------------------------------------

    def node_check(self, node: int) -> tuple[float, dict[str, Any]]:
        """The node's latest root-side health event (every ``health_check_s``): what its GPUs show now."""
        p = self.p
        taken = math.floor(self.sim.now / p.health_check_s) * p.health_check_s
        known = self._checks.get((node, taken))
        if known is not None:
            return known
        if len(self._checks) > 4096:
            self._checks.clear()
        loaded = node in self.sim.sched.node_job
        faults = self.active_on(node, taken)
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
        # A degraded link (a marginal cable or transceiver) counts symbol errors where its bits arrive,
        # and its senders retransmit; both need traffic, so an idle node shows neither.
        retransmits = 20.0 if link and loaded else 0.0
        symbol_errors = 20.0 if link and loaded else 0.0
        body = {"type": "node", "v": 1, "event": "health", "node": self.sim.names[node], "time": taken,
                "gpus": gpus, "host": {"net_retransmits_per_s": retransmits},
                "fabric": {"interval_s": 60.0, "ports": [{"name": "mlx5_0/1", "kind": "ib", "state": "ACTIVE",
                                                          "rate_gbps": 200.0,
                                                          "per_s": {"symbol_error": symbol_errors}}]}}
        self._checks[(node, taken)] = (taken, body)
        return taken, body
