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
  a FIFO scheduler with EASY backfill (``Scheduler.schedule``) that respects drained
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

The parts, one module each beside this one:

===========================  ======================================================================
``closedloop_scenario``      ``FleetParams``, the measured rates, ``draw_scenario``
``closedloop_records``       ``Fault``, ``Encounter``, ``Job``, ``Run``: what is kept of each
``closedloop_results``       ``ModeResult``, ``Accounting`` (GPU-hours booked), ``summary``
``closedloop_adapter``       the modes (``mode_config``), the Slurm and the ``Loop`` as they plug in
``closedloop_jobs``          ``Scheduler``: the queue, placement, runs, requeues, drained nodes
``closedloop_physics``       ``Physics``: faults, the lockstep step, throughput windows, node checks
``closedloop_analysis``      ``Analysis``: the modelled analysis, encounters and their detection
``closedloop_incidents``     ``Incidents``: the daemon's side, incidents fed to the loop, its turn
``closedloop_effects``       ``Effects``: what actions do (the loop's ``on_action``), repairs
``closedloop_person``        ``Person``: the person an escalation pages
===========================  ======================================================================

``FleetSim`` (here) holds the clock and the event queue, and wires the parts: each holds its own
state and reaches the others through it.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from artemisd.act import Outcome
from artemisd.config import Config
from artemisd.incident import Incident
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
from artemisd.sim.closedloop_analysis import Analysis
from artemisd.sim.closedloop_effects import CORRECTION_FIXES, Effects
from artemisd.sim.closedloop_incidents import Incidents
from artemisd.sim.closedloop_jobs import Scheduler
from artemisd.sim.closedloop_person import Person
from artemisd.sim.closedloop_physics import HEALTHY_CLOCK_MHZ, HEALTHY_POWER_W, Physics
from artemisd.sim.closedloop_records import Encounter, Fault, Job, Run
from artemisd.sim.closedloop_results import Accounting, ModeResult, summary
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


class FleetSim:
    """One mode over one scenario (see the module doc): the clock, the events, and the parts that share them."""

    def __init__(self, scenario: Scenario, mode: str, config: Config | None = None, link_probes: bool = False):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        self.sc = scenario
        self.p = p = scenario.params
        self.mode = mode
        self.link_probes = link_probes
        self.config = config if config is not None else mode_config(mode)
        self.result = ModeResult(mode)
        self.books = Accounting(self.result, p.gpus_per_node)
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
        self.sched = Scheduler(self)
        self.physics = Physics(self)
        self.analysis = Analysis(self)
        self.incidents = Incidents(self)
        self.effects = Effects(self)
        self.person = Person(self)
        self._events: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self._handlers: dict[str, Callable[[Any], None]] = {
            "node_fault": self.physics.node_fault, "transient": self.physics.transient,
            "transient_end": self.physics.transient_end, "false_alarm": self.analysis.false_alarm,
            "alarm_end": self.analysis.alarm_end, "detect": self.analysis.detect,
            "subject_healthy": self.incidents.subject_healthy, "person_visits": self.person.visits,
            "repair": self.effects.repair,
        }
        self._tick = 0
        for f in scenario.node_faults:
            self.push(f.time, "node_fault", f)

    # --- the clock and the events --------------------------------------------------------------------

    def push(self, when: float, kind: str, payload: Any) -> None:
        """An event of ``kind`` at ``when``: handled on the first tick at or after it, in the order pushed."""
        self._seq += 1
        heapq.heappush(self._events, (when, self._seq, kind, payload))

    def run(self) -> ModeResult:
        """Until every job submitted within the horizon has ended, then the read-outs."""
        self.run_until(self.p.end_s)
        return self.finish()

    def run_until(self, until: float) -> None:
        """Advance tick by tick while the next tick starts before ``until`` (and within the horizon)."""
        started = time.process_time()
        p = self.p
        sched = self.sched
        ticks = int(round(p.end_s / p.tick_s))
        arrivals_end = p.horizon_s
        hour = max(1, int(round(3600.0 / p.tick_s)))
        while self._tick < ticks and self._tick * p.tick_s < until:
            if self._tick * p.tick_s >= arrivals_end and sched.idle:
                break
            tick = self._tick
            self.now = now = tick * p.tick_s
            if tick % hour == 0:
                self.books.sample(now)
            self.slurm.advance_to(now)
            sched.sync_requeued()
            sched.ends()
            sched.arrive(now)
            events = self._events
            while events and events[0][0] <= now:
                _, _, kind, payload = heapq.heappop(events)
                self._handlers[kind](payload)
            sched.schedule()
            if self.loop is not None:
                self.incidents.turn()
            self.books.advance(sched.running.values(), now, p.tick_s)
            self._tick += 1
            self.now = self._tick * p.tick_s
        self.result.seconds += time.process_time() - started

    def finish(self) -> ModeResult:
        """The read-outs, at the time reached."""
        self.books.last_sample(self.now)
        self.effects.undrain_all()  # still drained at the end: its hours so far
        self.books.read_out(len(self.analysis.faulty_jobs), self.loop, self.incidents.by_incident)
        return self.result

    def on_action(self, kind: str, target: str | None, params: dict[str, Any], inc: Incident | None = None
                  ) -> Outcome | None:
        """An action's physical effect on the simulated fleet (``Effects.on_action``)."""
        return self.effects.on_action(kind, target, params, inc)

    # --- what tests and benchmarks read ------------------------------------------------------------------

    @property
    def queue(self) -> Any:
        """The ids of the jobs waiting to start, in order."""
        return self.sched.queue

    @property
    def running(self) -> dict[str, Job]:
        return self.sched.running

    @property
    def drained(self) -> dict[int, tuple[str, float, bool]]:
        return self.sched.drained

    @property
    def node_faults(self) -> dict[int, list[Fault]]:
        return self.physics.node_faults

    @property
    def encounters(self) -> list[Encounter]:
        return self.analysis.encounters

    @property
    def by_incident(self) -> dict[str, Encounter]:
        return self.incidents.by_incident

    def encounters_of_fault(self, f: Fault) -> list[Encounter]:
        return self.analysis.of_fault(f)


def run_fleet(params: FleetParams, modes: Iterable[str] = MODES, policy: str | Path | None = None,
              link_probes: bool = False) -> dict[str, ModeResult]:
    """Every mode over the same scenario (same jobs, same faults, same seed)."""
    scenario = draw_scenario(params)
    out = {}
    for mode in modes:
        config = mode_config(mode, policy) if mode == "artemis" else None
        out[mode] = FleetSim(scenario, mode, config, link_probes=link_probes).run()
    return out
