"""Scenario suites: many faulty and healthy jobs drawn from a suite definition.

A suite definition is data (``benchmarks/scenarios/*.json``, ``SuiteSpec``):
ranges for job sizes, noise, magnitudes and patterns, how many faults of each
cause, how many healthy jobs.  ``draw_suite`` turns it into fleet specs,
deterministically from the suite's seed, so the accuracy benchmark can keep a
*tuning* suite and *held-out* suites the analyser was never tuned on.

Fault durations follow FALCON's means (compute 10 min, network 24 min), as an
exponential distribution, cut at ``min_duration`` windows so each fault lasts
long enough to be confirmed, and at the end of the job.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field, ValidationError

from artemisd.sim.spec import (
    AMD_MI300X,
    CHANGE_CAUSES,
    DENSE_NOISE,
    FAULT_MEAN_MINUTES,
    NVIDIA_H100,
    VARLEN_NOISE,
    FaultSpec,
    FleetSpec,
    JobSpec,
    NoiseSpec,
    SimCause,
    _Spec,
    describe,
)

ALL_CAUSES: tuple[SimCause, ...] = (
    "gpu.thermal", "gpu.power", "gpu.clocks", "comm.link", "comm.island", "host.cpu",
    "input.loader", "input.storage", "change.driver", "change.comm_lib", "change.config",
)
NEW_ENV = {  # what each kind of change changes
    "change.driver": {"driver": "560.35.03"},
    "change.comm_lib": {"comm_lib": "nccl 2.23.4"},
    "change.config": {"config": "sha256:9a04d7b1"},
}
Range = tuple[float, float]


class SuiteSpec(_Spec):
    """A scenario suite; every range is ``[low, high]`` and drawn uniformly unless noted."""

    name: str
    description: str = ""
    seed: int
    job_id_base: int = Field(default=10000, ge=1)
    jobs_per_trace: int = Field(default=8, ge=1)
    faults_per_cause: int = Field(default=3, ge=0)
    causes: tuple[SimCause, ...] = ALL_CAUSES
    healthy_jobs: int = Field(default=30, ge=0)
    benign_changes: int = Field(default=2, ge=0)  # fingerprint changes that do not slow the job
    world: tuple[int, ...] = (16, 32, 64, 128)
    ranks_per_node: tuple[int, ...] = (8,)
    windows: tuple[int, int] = (40, 60)
    window_steps: tuple[int, ...] = (50,)
    batch: tuple[int, ...] = (1, 2, 4, 8, 16)  # samples per rank per step; differs between workloads
    compute_ms: Range = (300.0, 500.0)
    comm_share: Range = (0.15, 0.3)  # exposed comm per step / compute
    varlen_share: float = Field(default=0.4, ge=0, le=1)  # jobs with variable-length batches
    dense_noise: Range = (DENSE_NOISE * 0.67, DENSE_NOISE * 1.33)
    varlen_noise: Range = (VARLEN_NOISE * 0.9, VARLEN_NOISE * 1.1)
    mixed_islands: float = Field(default=0.2, ge=0, le=1)  # share of jobs with NVIDIA + AMD
    # Ranks of the AMD island of a mixed job, on nodes of its own, beside `world`
    # NVIDIA ranks (an island of two inside a larger job); None: the job's nodes
    # are split between the two at random.
    second_island_ranks: int | None = Field(default=None, gt=0)
    magnitude: Range = (0.05, 0.40)  # log-uniform; window-mean slowdown (intermittent peaks are higher)
    patterns: dict[str, float] = {"steady": 0.6, "intermittent": 0.2, "ramp": 0.2}
    duty: Range = (0.55, 0.85)
    node_scope: float = Field(default=0.25, ge=0, le=1)  # rank-cause faults hitting a whole node (or vice versa)
    healthy_slow: Range = (0.0, 0.03)  # share of a job's GPUs made 2-3 % slower
    gc_rate: Range = (1 / 5000, 1 / 2000)
    spike_rate: Range = (0.001, 0.003)
    comm_spike_rate: Range = (0.02, 0.05)
    checkpoint_share: float = Field(default=0.3, ge=0, le=1)  # jobs that checkpoint every 15-25 windows
    benign_power_cap: Range = (0.0, 0.08)
    probe_share: float = Field(default=0.0, ge=0, le=1)  # jobs whose probe reports a matched-probe block
    no_host_telemetry: float = Field(default=0.0, ge=0, le=1)
    onset_after: int = Field(default=8, ge=1)  # windows of healthy history before a fault
    min_duration: int = Field(default=8, ge=1)


def load_suite(path: str | Path) -> SuiteSpec:
    path = Path(path)
    try:
        return SuiteSpec.model_validate(json.loads(path.read_text()))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: not JSON: {err.msg}") from None
    except ValidationError as err:
        raise ValueError(f"{path}: {describe(err)}") from None


class _Drawer:
    def __init__(self, suite: SuiteSpec):
        self.s = suite
        self.rng = np.random.default_rng(suite.seed)
        self.next_id = suite.job_id_base

    def uniform(self, r: Range) -> float:
        return float(self.rng.uniform(r[0], r[1]))

    def job_id(self) -> str:
        self.next_id += 1
        return str(self.next_id)

    def base_job(self, mixed: bool) -> dict[str, Any]:
        s, rng = self.s, self.rng
        rpn = int(rng.choice(s.ranks_per_node))
        world = int(rng.choice(s.world))
        if not (mixed and s.second_island_ranks is not None):
            world = max(2 * rpn if mixed else rpn, world - world % rpn)
        compute = self.uniform(s.compute_ms)
        if mixed and s.second_island_ranks is not None:
            islands = (NVIDIA_H100.model_copy(update={"ranks": world, "compute_ms": compute}),
                       AMD_MI300X.model_copy(update={"ranks": s.second_island_ranks,
                                                     "compute_ms": compute * float(rng.uniform(1.05, 1.2))}))
        elif mixed:
            nv_nodes = int(rng.integers(1, world // rpn))
            islands = (NVIDIA_H100.model_copy(update={"ranks": nv_nodes * rpn, "compute_ms": compute}),
                       AMD_MI300X.model_copy(update={"ranks": world - nv_nodes * rpn,
                                                     "compute_ms": compute * float(rng.uniform(1.05, 1.2))}))
        else:
            islands = (NVIDIA_H100.model_copy(update={"ranks": world, "compute_ms": compute}),)
        varlen = rng.random() < s.varlen_share
        noise = NoiseSpec(
            step=self.uniform(s.varlen_noise if varlen else s.dense_noise),
            healthy_slow=int(round(world * self.uniform(s.healthy_slow))),
            gc_rate=self.uniform(s.gc_rate),
            spike_rate=self.uniform(s.spike_rate),
            comm_spike_rate=self.uniform(s.comm_spike_rate),
            checkpoint_every=int(rng.integers(15, 26)) if rng.random() < s.checkpoint_share else None,
            benign_power_cap=self.uniform(s.benign_power_cap),
        )
        return {
            "islands": islands, "ranks_per_node": rpn,
            "windows": int(rng.integers(s.windows[0], s.windows[1] + 1)),
            "window_steps": int(rng.choice(s.window_steps)),
            "batch": int(rng.choice(s.batch)),
            "comm_ms": compute * self.uniform(s.comm_share),
            "noise": noise,
            "host_telemetry": bool(rng.random() >= s.no_host_telemetry),
            "probe_after": 2 if rng.random() < s.probe_share else None,
        }

    def fault(self, cause: SimCause, job: dict[str, Any]) -> FaultSpec:
        s, rng = self.s, self.rng
        lo, hi = np.log(s.magnitude[0]), np.log(s.magnitude[1])
        magnitude = round(float(np.exp(rng.uniform(lo, hi))), 3)
        if cause in CHANGE_CAUSES:
            return FaultSpec(cause=cause, magnitude=magnitude, onset=0)
        windows = job["windows"]
        onset = int(rng.integers(s.onset_after, max(s.onset_after + 1, windows - s.min_duration)))
        step_s = job["islands"][0].compute_ms * 1.3 / 1000.0
        window_min = job["window_steps"] * step_s / 60.0
        mean = FAULT_MEAN_MINUTES["network" if cause.startswith("comm.") else "compute"] / window_min
        duration = max(s.min_duration, int(rng.exponential(mean)))
        names = list(s.patterns)
        weights = np.array([s.patterns[n] for n in names], dtype=float)
        pattern = names[int(rng.choice(len(names), p=weights / weights.sum()))]
        extra: dict[str, Any] = {}
        if pattern == "intermittent":
            # The suite's magnitude range is what a window mean shows: the
            # bursts themselves are stronger by 1 / duty.
            duty = round(self.uniform(s.duty), 3)
            magnitude = round(min(3.0, magnitude / duty), 3)
            extra = {"duty": duty, "burst_steps": round(float(rng.uniform(10, 60)), 1)}
        elif pattern == "ramp":
            extra = {"ramp_windows": int(rng.integers(3, 9))}
        rpn = job["ranks_per_node"]
        if cause in ("gpu.thermal", "gpu.power", "gpu.clocks", "input.loader", "host.cpu", "input.storage"):
            flip = rng.random() < s.node_scope and rpn > 1
            default_node = cause in ("host.cpu", "input.storage")
            if default_node != flip and rpn > 1:  # with one rank per node a node fault is a rank fault
                extra["node_ranks"] = int(rng.integers(2, rpn + 1))
            else:
                extra["rank"] = int(rng.integers(sum(i.ranks for i in job["islands"])))
        return FaultSpec(cause=cause, magnitude=magnitude, onset=onset,
                         duration=duration if onset + duration < windows else None,
                         pattern=pattern, **extra)


def change_pair(reference: JobSpec, cause: SimCause, magnitude: float, job_id: str, gap_s: float = 120.0,
                slowed: bool = True) -> JobSpec:
    """A job of ``reference``'s workload, on its nodes, after a ``cause`` change.

    With ``slowed`` false the change is benign: the fingerprint moves, the
    speed does not (an analyser must not report it).
    """
    env = reference.env.model_copy(update=NEW_ENV[cause])
    est_window_s = reference.window_steps * reference.islands[0].compute_ms * 1.4 / 1000.0
    return reference.model_copy(update={
        "job": job_id, "env": env,
        "start_s": reference.start_s + reference.windows * est_window_s + gap_s,
        "first_node": reference.first_node,
        "faults": (FaultSpec(cause=cause, magnitude=magnitude, onset=0),) if slowed else (),
    })


def draw_suite(suite: SuiteSpec) -> list[FleetSpec]:
    """The suite's fleets, deterministic in ``suite.seed``."""
    d = _Drawer(suite)
    rng = d.rng
    groups: list[list[JobSpec]] = []  # jobs that must share a trace (change pairs)
    causes = [c for c in suite.causes for _ in range(suite.faults_per_cause)]
    rng.shuffle(causes)
    for cause in causes:
        base = d.base_job(mixed=cause == "comm.island" or rng.random() < suite.mixed_islands)
        fault = d.fault(cause, base)
        if cause in CHANGE_CAUSES:
            ref = JobSpec(job=d.job_id(), **base)
            groups.append([ref, change_pair(ref, cause, fault.magnitude, d.job_id())])
        else:
            groups.append([JobSpec(job=d.job_id(), faults=(fault,), **base)])
    for _ in range(suite.healthy_jobs):
        groups.append([JobSpec(job=d.job_id(), **d.base_job(mixed=rng.random() < suite.mixed_islands))])
    for i in range(suite.benign_changes):
        ref = JobSpec(job=d.job_id(), **d.base_job(mixed=False))
        cause = CHANGE_CAUSES[i % len(CHANGE_CAUSES)]
        groups.append([ref, change_pair(ref, cause, 0.1, d.job_id(), slowed=False)])
    order = rng.permutation(len(groups))
    fleets: list[FleetSpec] = []
    current: list[JobSpec] = []
    node = 0
    for index in order:
        start = float(rng.uniform(0.0, 600.0))
        first = node
        for job in groups[index]:
            current.append(job.model_copy(update={"first_node": first, "start_s": job.start_s + start}))
        node += max(j.nodes for j in groups[index])
        if len(current) >= suite.jobs_per_trace:
            fleets.append(FleetSpec(seed=int(rng.integers(2**31)), jobs=tuple(current)))
            current, node = [], 0
    if current:
        fleets.append(FleetSpec(seed=int(rng.integers(2**31)), jobs=tuple(current)))
    return fleets
