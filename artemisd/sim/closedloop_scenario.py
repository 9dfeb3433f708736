"""The whole loop at fleet scale, its inputs: every parameter and measured rate of the fleet, and the
``Scenario`` drawn from them (``draw_scenario``): the jobs, their checkpoints, the transient faults and
false alarms they will meet, the hardware faults nodes will have.  Everything is drawn from the seed, so
every mode of ``closedloop.py`` meets the same scenario.

Every parameter, its value and its source is in ``FleetParams`` and docs/benchmarks.md, "The whole loop
at fleet scale".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

# --- the job's lockstep step, in ms (the shape verification reads; only ratios matter) ---------
BUSY_MS = 700.0  # a rank's own work per step
COMM_MS = 300.0  # the collectives' own time per step
HEALTHY_STEP_MS = BUSY_MS + COMM_MS
STEPS_PER_WINDOW = 50
SAMPLES_PER_RANK = 32  # per step
WINDOW_NOISE = 0.005  # sd of one window's throughput (1.5 % per step over 50 steps, plus load)

HARDWARE_CAUSES = ("gpu.thermal", "gpu.power", "gpu.clocks", "comm.link")
TRANSIENT_CAUSES = ("host.cpu", "input.loader", "input.storage")
# Every rank of one node (the simulator's NODE_DEFAULT_CAUSES): the analysis names the node.
NODE_SCOPED = frozenset({"host.cpu", "input.storage"})
# Greyhound/FALCON (Wu et al., USENIX ATC'25): fail-slows last 10 min (compute) / 24 min (network)
# on average; storage input is read over the network.
TRANSIENT_MEAN_S = {"host.cpu": 600.0, "input.loader": 600.0, "input.storage": 1440.0}

# The accuracy benchmark's held-out suites (heldout-a, heldout-b, heldout-c: 7 faults per cause,
# none of them tuned on), at commit f73dcb6, per cause: faults detected of faults, the latency of
# each detection (confirmed window minus the window the fault became visible), and the cause the
# first matching incident named.  Regenerate with `benchmarks/fleet.py --measure-detection`.
MEASURED_DETECTION: dict[str, dict[str, Any]] = {
    "gpu.thermal": {"detected": 7, "faults": 7, "latency": (1, 1, 0, 1, 1, 1, 1), "named": {"gpu.thermal": 7}},
    "gpu.power": {"detected": 7, "faults": 7, "latency": (2, 1, 1, 1, 1, 1, 1), "named": {"gpu.power": 7}},
    "gpu.clocks": {"detected": 7, "faults": 7, "latency": (1, 1, 1, 1, 1, 1, 1), "named": {"gpu.clocks": 7}},
    # Replay runs no matched probes, so a degraded link is a job-wide incident with cause unknown.
    "comm.link": {"detected": 7, "faults": 7, "latency": (1, 1, 1, 0, 1, 1, 1), "named": {"unknown": 7}},
    "host.cpu": {"detected": 7, "faults": 7, "latency": (1, 2, 1, 1, 1, 3, 1),
                 "named": {"host.cpu": 6, "gpu.power": 1}},
    "input.loader": {"detected": 7, "faults": 7, "latency": (1, -1, 4, 0, 1, 0, 1), "named": {"input.loader": 7}},
    "input.storage": {"detected": 7, "faults": 7, "latency": (1, 1, 1, 1, 1, 1, 0), "named": {"input.storage": 7}},
}

# Confirmed `unknown` incidents of a healthy job under a noisy neighbour (docs/benchmarks.md, "A
# healthy job under a noisy neighbour", the three runs at 936f706): 6, 8 and 10 in 150 s runs of
# ~166 windows each (20-step windows of 20-70 ms steps) = 0.048 per analysed window.  The rate is
# per window (each needs ConfirmWindows flagged windows in a row), so at this fleet's 60 s windows:
FALSE_INCIDENTS_PER_WINDOW = 24 / (3 * 166)
# They lasted as long as the neighbour's phases: a few windows.
FALSE_INCIDENT_WINDOWS = (2, 8)
# With ``link_probes``: the live daemon asks matched probes about a job-wide slowdown and names a
# link once two in a row agree (pipeline.py), ProbeMinInterval (300 s) apart.  Replay runs no
# probes; how often they name the right node is measured on the test cluster's links:
# `benchmarks/links.py --trials 10` at 2026-12-08 (docs/benchmarks.md, "Degraded links named"), per
# degradation (% of the link's rate): (right node, wrong node, none) of 20 trials, half of them
# beside a busy host.
PROBES_TO_NAME_A_LINK_S = 2 * 300.0
MEASURED_LINK_NAMING: dict[float, tuple[int, int, int]] = {
    5.0: (0, 0, 20), 10.0: (18, 0, 2), 20.0: (20, 0, 0), 40.0: (20, 0, 0)}


def link_naming(step_rise: float) -> tuple[float, float]:
    """P(the probes name the right node), P(a wrong one) for a link that slows a job's step by
    ``step_rise`` (the fleet's magnitude).  Its transfers are slowed by at least as much, as by a link
    at 1 / (1 + step_rise) of its rate, degraded by step_rise / (1 + step_rise): the measured rates
    at that degradation, linear between the measured ones, the nearest one's beyond them."""
    cut = 100.0 * step_rise / (1.0 + step_rise)
    measured = sorted(MEASURED_LINK_NAMING)
    lo = max((m for m in measured if m <= cut), default=measured[0])
    hi = min((m for m in measured if m >= cut), default=measured[-1])

    def rates(m: float) -> tuple[float, float]:
        right, wrong, none = MEASURED_LINK_NAMING[m]
        total = right + wrong + none
        return right / total, wrong / total

    (r_lo, w_lo), (r_hi, w_hi) = rates(lo), rates(hi)
    t = 0.0 if hi == lo else (cut - lo) / (hi - lo)
    return r_lo + t * (r_hi - r_lo), w_lo + t * (w_hi - w_lo)


@dataclass(frozen=True)
class FleetParams:
    """The fleet and every rate in it (docs/benchmarks.md, "The whole loop at fleet scale", gives sources)."""

    nodes: int = 1024
    gpus_per_node: int = 8
    days: float = 3.0
    seed: int = 1
    tick_s: float = 60.0  # one analysis window; every event lands on a tick
    window_s: float = 60.0  # 50 steps of ~1.2 s
    # Job sizes in nodes, heavy-tailed: most jobs are small, most GPU-hours are in the big ones
    # (Kokolis et al., "Revisiting Reliability in Large-Scale ML Research Clusters", HPCA'25).
    sizes: tuple[tuple[int, float], ...] = ((1, 0.40), (2, 0.20), (4, 0.14), (8, 0.10), (16, 0.07),
                                           (32, 0.05), (64, 0.025), (128, 0.015))
    duration_median_h: float = 4.0  # log-normal run time
    duration_sigma: float = 0.8
    duration_h: tuple[float, float] = (0.5, 48.0)
    limit_factor: tuple[float, float] = (1.2, 2.0)  # time limit / run time, rounded up to the hour
    offered_load: float = 0.95  # node-hours submitted per node-hour of the cluster
    checkpoint_min: tuple[float, float] = (15.0, 60.0)  # per job, uniform
    restart_min: tuple[float, float] = (3.0, 10.0)  # per job, uniform
    hardware_per_node_day: float = 0.016  # gpu.thermal, gpu.power, gpu.clocks, comm.link together
    transient_per_job_hour: float = 0.09  # host.cpu, input.loader, input.storage together
    false_per_window: float = FALSE_INCIDENTS_PER_WINDOW
    magnitude: tuple[float, float] = (0.05, 0.40)  # log-uniform: busy (or step) time rises by m
    person_response_s: float = 1800.0  # Minder (NSDI'25): 30+ min on average to find a faulty machine
    repair_s: float = 8 * 3600.0  # drained node back in service (assumed: no published figure)
    health_check_s: float = 300.0  # the root-side node check's interval (Slurm HealthCheckInterval)
    decoy_rate: float = 0.05  # healthy GPU readings with sw_power_cap at the default limit (sim spec)
    rebalance_opt_in: float = 0.5  # jobs whose ranks read work shares (assumed)
    decide_every_s: float = 300.0  # the loop's turn for incidents that wait (held, cooldown)
    # Jobs submitted within ``days`` run to their end (no new arrivals after it), so an action's cost
    # and what it saves later are both counted; at most this long after ``days``.
    tail_days: float = 5.0

    @property
    def horizon_s(self) -> float:
        """Jobs arrive until then."""
        return self.days * 86400.0

    @property
    def end_s(self) -> float:
        """The simulation stops when every job has ended, or at the latest then."""
        return (self.days + self.tail_days) * 86400.0


QUICK = FleetParams(nodes=64, days=0.5, sizes=((1, 0.45), (2, 0.25), (4, 0.15), (8, 0.1), (16, 0.05)),
                    hardware_per_node_day=0.04, transient_per_job_hour=0.3)


# --- the scenario: everything drawn from the seed, the same in every mode -----------------------


@dataclass(frozen=True)
class TransientSpec:
    offset_s: float  # after the job's first start
    cause: str
    duration_s: float
    magnitude: float
    node_index: int  # which of the job's nodes
    gpu: int


@dataclass(frozen=True)
class JobSpec:
    id: str
    nodes: int
    work_s: float  # healthy run time still to do at submission
    limit_s: float
    checkpoint_s: float
    restart_s: float
    submit: float
    opt_in: bool
    done_s: float = 0.0  # work already done before the simulation started (the prefill)
    transients: tuple[TransientSpec, ...] = ()
    false_alarms: tuple[tuple[float, float, int], ...] = ()  # (offset s, duration s, rank)


@dataclass(frozen=True)
class NodeFaultSpec:
    id: int
    time: float
    node: int
    cause: str
    magnitude: float
    gpu: int


@dataclass(frozen=True)
class Scenario:
    params: FleetParams
    jobs: tuple[JobSpec, ...]
    node_faults: tuple[NodeFaultSpec, ...]


def _log_uniform(rng: np.random.Generator, low: float, high: float) -> float:
    return float(math.exp(rng.uniform(math.log(low), math.log(high))))


def draw_scenario(p: FleetParams) -> Scenario:
    """The jobs and faults of one fleet, from ``p.seed``: every mode meets the same ones."""
    # One stream per kind of draw, so a change to one rate leaves the other draws as they were.
    rng, rng_tr, rng_fa, rng_hw = (np.random.default_rng(s) for s in np.random.SeedSequence(p.seed).spawn(4))
    sizes = np.array([s for s, _ in p.sizes if s <= p.nodes])
    weights = np.array([w for s, w in p.sizes if s <= p.nodes], dtype=float)
    weights /= weights.sum()
    mean_h = p.duration_median_h * math.exp(p.duration_sigma ** 2 / 2)
    job_rate_per_s = p.offered_load * p.nodes / (float(sizes @ weights) * mean_h * 3600.0)

    def job(index: int, submit: float, prefill: bool) -> JobSpec:
        nodes = int(rng.choice(sizes, p=weights))
        hours = float(np.clip(p.duration_median_h * math.exp(rng.normal(0.0, p.duration_sigma)), *p.duration_h))
        run_s = hours * 3600.0
        limit_s = math.ceil(run_s * rng.uniform(*p.limit_factor) / 3600.0) * 3600.0
        done = float(rng.uniform(0.0, run_s)) if prefill else 0.0
        # Transient faults and false alarms arrive in the job's own time (Poisson), whatever the mode.
        span = limit_s * 2.0  # a requeued or slowed job may run past its first limit
        transients = []
        t = float(rng_tr.exponential(3600.0 / p.transient_per_job_hour)) if p.transient_per_job_hour > 0 \
            else math.inf
        while t < span:
            cause = str(rng_tr.choice(TRANSIENT_CAUSES))
            transients.append(TransientSpec(t, cause, float(rng_tr.exponential(TRANSIENT_MEAN_S[cause])),
                                            _log_uniform(rng_tr, *p.magnitude), int(rng_tr.integers(nodes)),
                                            int(rng_tr.integers(p.gpus_per_node))))
            t += float(rng_tr.exponential(3600.0 / p.transient_per_job_hour))
        alarms = []
        rate = p.false_per_window / p.window_s
        t = float(rng_fa.exponential(1.0 / rate)) if rate > 0 else math.inf
        while t < span:
            windows = int(rng_fa.integers(FALSE_INCIDENT_WINDOWS[0], FALSE_INCIDENT_WINDOWS[1] + 1))
            alarms.append((t, windows * p.window_s, int(rng_fa.integers(nodes * p.gpus_per_node))))
            t += float(rng_fa.exponential(1.0 / rate))
        return JobSpec(str(index), nodes, run_s - done, limit_s, 60.0 * float(rng.uniform(*p.checkpoint_min)),
                       60.0 * float(rng.uniform(*p.restart_min)), submit, bool(rng.random() < p.rebalance_opt_in),
                       done, tuple(transients), tuple(alarms))

    jobs: list[JobSpec] = []
    # A cluster already busy at t = 0: jobs part-way through, as many as fill it.
    filled = 0
    while True:
        j = job(1000 + len(jobs), 0.0, prefill=True)
        if filled + j.nodes > p.nodes:
            break
        filled += j.nodes
        jobs.append(j)
    t = float(rng.exponential(1.0 / job_rate_per_s))
    while t < p.horizon_s:
        jobs.append(job(1000 + len(jobs), t, prefill=False))
        t += float(rng.exponential(1.0 / job_rate_per_s))
    faults: list[NodeFaultSpec] = []
    rate = p.hardware_per_node_day * p.nodes / 86400.0
    t = float(rng_hw.exponential(1.0 / rate)) if rate > 0 else math.inf
    while t < p.end_s:
        faults.append(NodeFaultSpec(len(faults) + 1, t, int(rng_hw.integers(p.nodes)),
                                    str(rng_hw.choice(HARDWARE_CAUSES)), _log_uniform(rng_hw, *p.magnitude),
                                    int(rng_hw.integers(p.gpus_per_node))))
        t += float(rng_hw.exponential(1.0 / rate))
    return Scenario(p, tuple(jobs), tuple(faults))
