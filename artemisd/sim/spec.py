"""What to simulate: the fleet, its jobs and the faults injected into them.

Specs are pydantic models so a scenario can be kept as data (JSON) and a bad
one is rejected with the field that is wrong.  Defaults are calibrated against
published characterisations of slow training jobs:

* **Per-step noise.**  Dense models with fixed-shape batches vary ~1-2 % per
  step; variable-length sequence batches ~7 % (issue 2; the spread
  sequence-length imbalance causes is one of the straggler sources Lin et al.,
  "Understanding Stragglers in Large Model Training Using What-if Analysis",
  arXiv:2505.05713, measure).  ``DENSE_NOISE`` / ``VARLEN_NOISE``.
* **Persistent per-GPU spread.**  GPUs of one model differ in speed by a few
  percent for good (Sinha et al., "Not All GPUs Are Created Equal", SC'22).
  Every GPU gets a fixed speed factor (sd ``gpu_spread``); a few are made 2-3 %
  slower on purpose and listed in the ground truth as *healthy*: an analyser
  that turns them into incidents is wrong.
* **GC pauses and transient spikes.**  Unsynchronised Python garbage
  collection stalls one rank for 100 ms-1 s (another straggler source Lin et
  al. identify); short thermal or noisy-neighbour blips slow a rank for a few
  steps; cross-job network congestion slows all-reduce for a few steps.
  None of them may become an incident.  No published rate exists for the
  short per-rank blips; ``spike_rate`` (a 20-60 % slowdown for 2-15 steps,
  about once per 500 rank-windows by default) is a stress knob, and two
  blips on one rank in neighbouring windows do happen at scale.
* **Fail-slow faults.**  Greyhound/FALCON (Wu et al., USENIX ATC'25) report
  fail-slow durations of 10 min on average for compute, 24 min for network,
  72 min at scale, and slowdowns of 20-46 %.  ``FAULT_MEAN_MINUTES`` and the
  5-40 % magnitude range come from there.
* **How often.**  Lin et al. find 42.5 % of jobs straggle (10.4 % of GPU-hours
  lost); scenario suites make roughly that share of jobs faulty.

Magnitude ``m`` always means the slowdown the analyser is asked to see:

* rank and node faults (``gpu.*``, ``host.cpu``, ``input.*``): the subject's
  busy time rises by ``m`` (busy ratio to healthy peers ~ 1 + m);
* job-wide faults (``comm.link``, ``comm.island``, ``change.*``): the job's
  step time rises by ``m`` against its healthy run.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DENSE_NOISE = 0.015
VARLEN_NOISE = 0.07

# FALCON (ATC'25): mean fail-slow duration by kind, minutes.
FAULT_MEAN_MINUTES = {"compute": 10.0, "network": 24.0, "at_scale": 72.0}

Pattern = Literal["steady", "intermittent", "ramp"]
SimCause = Literal[
    "gpu.thermal",
    "gpu.power",
    "gpu.clocks",
    "comm.link",
    "comm.island",
    "host.cpu",
    "input.loader",
    "input.storage",
    "change.driver",
    "change.comm_lib",
    "change.config",
]

RANK_CAUSES = ("gpu.thermal", "gpu.power", "gpu.clocks", "host.cpu", "input.loader", "input.storage")
CHANGE_CAUSES = ("change.driver", "change.comm_lib", "change.config")
# Causes whose default scope is every rank of one node rather than one rank.
NODE_DEFAULT_CAUSES = ("host.cpu", "input.storage")


def describe(err: ValidationError) -> str:
    """A spec error as ``field.path: reason`` lines (pydantic's text buries them)."""
    lines = []
    for e in err.errors(include_url=False):
        where = ".".join(str(p) for p in e["loc"])
        reason = e["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {reason}" if where else reason)
    return "; ".join(lines)


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class IslandSpec(_Spec):
    """Ranks of one device vendor and model; they are only compared with each other."""

    name: str = "nvidia"
    vendor: str = "nvidia"
    model: str = "NVIDIA H100 80GB HBM3"
    ranks: int = Field(default=64, gt=0)
    compute_ms: float = Field(default=420.0, gt=0)  # per step, healthy median GPU
    max_sm_clock_mhz: float = Field(default=1980.0, gt=0)
    power_limit_w: float = Field(default=700.0, gt=0)


NVIDIA_H100 = IslandSpec()
AMD_MI300X = IslandSpec(
    name="amd", vendor="amd", model="AMD Instinct MI300X", compute_ms=465.0,
    max_sm_clock_mhz=2100.0, power_limit_w=750.0,
)


class EnvSpec(_Spec):
    driver: str = "550.54.15"
    comm_lib: str = "nccl 2.21.5"
    torch: str = "2.5.1"
    config: str = "sha256:6f1c0c2e"


class FaultSpec(_Spec):
    """One injected fault.

    Targets are resolved by the simulator when left out: ``rank`` (a rank
    fault), ``node`` (index of the job's node; a node fault hits
    ``node_ranks`` of its ranks, all by default), ``island`` (comm.island).
    ``onset`` is a window index; ``duration`` in windows (None: to the end).
    Patterns: ``steady``; ``intermittent`` (on/off bursts of ``burst_steps``
    mean length, on a ``duty`` share of steps); ``ramp`` (grows linearly to
    ``magnitude`` over ``ramp_windows``).  ``change.*`` faults slow the whole
    job from its first window and need an earlier job of the same workload
    under the old fingerprint (``artemisd.sim.scenarios.change_pair``).
    """

    cause: SimCause
    magnitude: float = Field(default=0.2, gt=0.0, le=3.0)
    onset: int = Field(default=10, ge=0)
    duration: int | None = Field(default=None, gt=0)
    pattern: Pattern = "steady"
    rank: int | None = Field(default=None, ge=0)
    node: int | None = Field(default=None, ge=0)
    node_ranks: int | None = Field(default=None, gt=0)
    island: str | None = None
    duty: float = Field(default=0.6, gt=0.0, le=1.0)
    burst_steps: float = Field(default=25.0, ge=1.0)
    ramp_windows: int = Field(default=6, ge=1)
    # Cause-specific flavour: host.cpu "steal" | "contention"; gpu.thermal "sw" | "hw".
    variant: str | None = None

    @model_validator(mode="after")
    def _targets(self) -> FaultSpec:
        if self.cause in CHANGE_CAUSES and self.onset != 0:
            raise ValueError(f"onset: a {self.cause} fault starts with the job (onset 0), got {self.onset}")
        if self.cause not in RANK_CAUSES and (self.rank is not None or self.node_ranks is not None):
            raise ValueError(f"rank: {self.cause} is job-wide; it takes no rank")
        if self.rank is not None and self.node is not None:
            raise ValueError("node: give a rank or a node, not both")
        return self

    @property
    def scope(self) -> Literal["rank", "node", "link", "island", "change"]:
        if self.cause in CHANGE_CAUSES:
            return "change"
        if self.cause == "comm.link":
            return "link"
        if self.cause == "comm.island":
            return "island"
        if self.rank is not None:
            return "rank"
        if self.node is not None or self.node_ranks is not None:
            return "node"
        return "node" if self.cause in NODE_DEFAULT_CAUSES else "rank"


class NoiseSpec(_Spec):
    """Everything that slows ranks without being a fault (see module docstring)."""

    step: float = Field(default=DENSE_NOISE, ge=0.0, le=0.5)  # per-rank per-step relative sd
    common: float = Field(default=0.004, ge=0.0, le=0.5)  # shared by all ranks of a step
    comm: float = Field(default=0.02, ge=0.0, le=0.5)  # collective time, per step
    gpu_spread: float = Field(default=0.004, ge=0.0, le=0.1)  # persistent, per GPU
    healthy_slow: int = Field(default=0, ge=0)  # GPUs made persistently 2-3 % slower
    gc_rate: float = Field(default=1 / 3000, ge=0.0, le=1.0)  # pauses per rank-step
    gc_ms: float = Field(default=150.0, ge=0.0)  # median pause
    spike_rate: float = Field(default=0.002, ge=0.0, le=1.0)  # per rank-window
    comm_spike_rate: float = Field(default=0.03, ge=0.0, le=1.0)  # per window
    checkpoint_every: int | None = Field(default=None, gt=0)  # windows
    checkpoint_ms: float = Field(default=4000.0, ge=0.0)
    benign_power_cap: float = Field(default=0.05, ge=0.0, le=1.0)  # healthy GPU-windows showing sw_power_cap


class JobSpec(_Spec):
    """One training job (one job step) running in lockstep."""

    job: str = Field(min_length=1)
    islands: tuple[IslandSpec, ...] = (NVIDIA_H100,)
    ranks_per_node: int = Field(default=8, gt=0)
    windows: int = Field(default=40, gt=0)
    window_steps: int = Field(default=50, gt=0)
    start_s: float = Field(default=0.0, ge=0.0)  # after the fleet's start
    first_node: int | None = Field(default=None, ge=0)  # None: the fleet allocates fresh nodes
    data_ms: float = Field(default=4.0, ge=0.0)
    comm_ms: float = Field(default=90.0, ge=0.0)  # exposed world all-reduce per step
    island_comm_ms: float = Field(default=25.0, ge=0.0)  # intra-island stage, mixed jobs only
    batch: int = Field(default=8, gt=0)  # samples per rank per step
    env: EnvSpec = EnvSpec()
    noise: NoiseSpec = NoiseSpec()
    faults: tuple[FaultSpec, ...] = ()
    gpu_telemetry: bool = True
    host_telemetry: bool = True
    probe_after: int | None = Field(default=None, ge=0)  # matched-probe block N windows after each onset

    @property
    def world(self) -> int:
        return sum(i.ranks for i in self.islands)

    @property
    def nodes(self) -> int:
        return -(-self.world // self.ranks_per_node)

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        names = [i.name for i in self.islands]
        if len(set(names)) != len(names):
            raise ValueError(f"islands: names must differ, got {names}")
        for i, isl in enumerate(self.islands[:-1]):
            if isl.ranks % self.ranks_per_node:
                raise ValueError(f"islands.{i}.ranks: {isl.ranks} is not a multiple of "
                                 f"ranks_per_node {self.ranks_per_node} (islands own whole nodes)")
        if self.noise.healthy_slow > self.world:
            raise ValueError(f"noise.healthy_slow: {self.noise.healthy_slow} exceeds world {self.world}")
        for i, f in enumerate(self.faults):
            where = f"faults.{i}"
            if f.onset >= self.windows:
                raise ValueError(f"{where}.onset: {f.onset} is not below windows {self.windows}")
            if f.rank is not None and f.rank >= self.world:
                raise ValueError(f"{where}.rank: {f.rank} is not below world {self.world}")
            if f.node is not None and f.node >= self.nodes:
                raise ValueError(f"{where}.node: {f.node} is not below the job's {self.nodes} nodes")
            if f.node_ranks is not None and f.node_ranks > self.ranks_per_node:
                raise ValueError(f"{where}.node_ranks: {f.node_ranks} exceeds ranks_per_node {self.ranks_per_node}")
            if f.cause == "comm.island":
                if len(self.islands) < 2:
                    raise ValueError(f"{where}.cause: comm.island needs a job with two or more islands")
                if f.island is not None and f.island not in names:
                    raise ValueError(f"{where}.island: {f.island!r} is not one of {names}")
        return self


class FleetSpec(_Spec):
    """Jobs simulated into one trace, records merged in arrival order."""

    seed: int = 0
    start_time: float = 1764680000.0  # epoch seconds of the fleet's t = 0
    jobs: tuple[JobSpec, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_jobs(self) -> FleetSpec:
        ids = [j.job for j in self.jobs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"jobs: job ids must be unique, got {ids}")
        return self
