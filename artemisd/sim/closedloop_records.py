"""The whole loop at fleet scale, its records: what the simulation keeps of each fault (``Fault``), of
each fault a job's run meets and what the modelled analysis makes of it (``Encounter``), and of each job
(``Job``) and each of its runs (``Run``: a requeue starts the next one)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from artemisd import verify
from artemisd.incident import IncidentKind
from artemisd.sim.closedloop_scenario import HEALTHY_STEP_MS, JobSpec

@dataclass
class Fault:
    """A fault as it is now: on a node (hardware, until fixed) or on a job's run (transient)."""

    id: str
    cause: str
    magnitude: float
    node: int
    gpu: int
    onset: float
    end: float = math.inf  # transient: when it ends by itself
    fixed_at: float | None = None
    fixed_by: str | None = None
    job: str | None = None  # transient: the job (run) it belongs to
    run: int = 0

    def active(self, now: float) -> bool:
        return self.fixed_at is None and now < self.end


@dataclass
class Encounter:
    """One fault met by one run of one job: what the analysis would see, and what came of it."""

    fault: Fault | None  # None: a false alarm on a healthy job
    job: str
    run: int
    onset: float
    rank: int
    named: str
    kind: IncidentKind
    due: float | None  # when the analysis confirms it (None: never)
    incident: str | None = None
    detected_at: float | None = None
    ended_at: float | None = None  # the job stopped suffering from it
    ended_by: str | None = None  # "itself", "job end", or the action that ended it
    verified_at: float | None = None
    alarm_end: float = math.inf


@dataclass
class Run:
    """One run of a job (a requeue starts the next one)."""

    number: int
    nodes: tuple[int, ...]
    start: float
    windows_from: float  # training (and windows) resume after the restart
    segments: list[tuple[float, float, float, float]] = field(default_factory=list)  # (t, step, pace, coll)
    ended: float | None = None
    windows: dict[int, verify.WindowShape] = field(default_factory=dict)  # complete windows, as measured


@dataclass
class Job:
    spec: JobSpec
    state: str = "queued"  # queued | running | requeued | done | timeout
    runs: list[Run] = field(default_factory=list)
    progress: float = 0.0  # healthy seconds of work done in the simulation
    shares: dict[int, float] = field(default_factory=dict)
    step_ms: float = HEALTHY_STEP_MS
    first_start: float | None = None
    excluded: set[int] = field(default_factory=set)
    cause_now: str | None = None
    run: Run = None  # type: ignore[assignment]  # the current (or last) run: runs[-1]
    # Each requeue: (when, work done before it, work thrown away: what was done since the last checkpoint).
    requeue_losses: list[tuple[float, float, float]] = field(default_factory=list)

