"""The whole loop at fleet scale, its results: what one mode did to the fleet (``ModeResult``), how the
GPU-hours and minutes in it are booked as the fleet runs (``Accounting``), and the table the benchmark
and ``artemis sim --fleet`` print (``summary``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from artemisd.sim.closedloop_records import Encounter, Job
from artemisd.sim.closedloop_scenario import HARDWARE_CAUSES, HEALTHY_STEP_MS

if TYPE_CHECKING:
    from artemisd.sim.closedloop_adapter import FleetLoop


@dataclass
class ModeResult:
    """What one mode did to the fleet; every number the benchmark reports comes from here."""

    mode: str
    gpu_hours_total: float = 0.0  # GPU-hours jobs held (running)
    slow_gpu_hours: float = 0.0  # lost to slowed steps
    slow_by_cause: dict[str, float] = field(default_factory=dict)
    requeues: int = 0
    requeue_gpu_hours: float = 0.0  # work since the last checkpoint + the restart, every GPU
    timeouts: int = 0
    timeout_gpu_hours: float = 0.0  # work since the last checkpoint of jobs killed at their time limit
    jobs_started: int = 0
    jobs_finished: int = 0
    faults: int = 0  # hardware faults that arrived
    encounters: int = 0  # (fault, job run) pairs
    faulty_jobs: int = 0  # jobs that met at least one fault
    detected: int = 0
    false_alarms: int = 0
    drains: int = 0
    healthy_drains: int = 0
    healthy_drain_node_hours: float = 0.0
    drains_by: dict[str, int] = field(default_factory=dict)
    corrections: int = 0
    rebalances: int = 0
    budget_refusals: int = 0
    verdicts: int = 0
    verdicts_recovered: int = 0
    recovery_minutes: list[float] = field(default_factory=list)  # onset -> fixed, faults an action ended
    recovery_by_cause: dict[str, list[float]] = field(default_factory=dict)
    verified_minutes: list[float] = field(default_factory=list)  # onset -> verified recovery (artemis)
    waits: Counter = field(default_factory=Counter)  # requeues the price refused, by the fault's true cause
    # A person's requeues priced as the loop would have (decide.rung_cost, the default policy):
    # (pays, requeue cost GPU-h, slowdown cost GPU-h while it lasts).
    person_requeue_prices: list[tuple[bool, float, float]] = field(default_factory=list)
    wait_examples: list[str] = field(default_factory=list)
    escalations: int = 0
    approvals: int = 0
    cumulative: list[tuple[float, float]] = field(default_factory=list)  # (hours, GPU-hours lost so far)
    incident_states: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def median_recovery(self, causes: Iterable[str]) -> float | None:
        return _median([m for c in causes for m in self.recovery_by_cause.get(c, ())])

    @property
    def lost_gpu_hours(self) -> float:
        return self.slow_gpu_hours + self.requeue_gpu_hours + self.timeout_gpu_hours

    def as_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("recovery_minutes", "verified_minutes",
                                                                   "cumulative", "waits", "recovery_by_cause")}
        out["median_recovery_minutes_by_cause"] = {c: _median(v) for c, v in sorted(self.recovery_by_cause.items())}
        out["median_recovery_minutes_hardware"] = self.median_recovery(HARDWARE_CAUSES)
        out["waits"] = dict(self.waits)
        out["lost_gpu_hours"] = self.lost_gpu_hours
        out["median_recovery_minutes"] = _median(self.recovery_minutes)
        out["median_verified_minutes"] = _median(self.verified_minutes)
        out["cumulative"] = [(round(h, 3), round(v, 2)) for h, v in self.cumulative]
        return out


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


class Accounting:
    """Books into a mode's ``ModeResult`` the GPU-hours its jobs hold and lose (slowed steps, work a
    requeue or a time limit throws away), the node-hours of healthy nodes drained, and the minutes from
    a fault's onset to its end; and, at the end, what the loop did (``read_out``).  Plain counts
    (faults, detections, actions) are counted where they happen."""

    def __init__(self, result: ModeResult, gpus_per_node: int):
        self.result = result
        self.gpus_per_node = gpus_per_node

    def sample(self, now: float) -> None:
        """A point of the curve of GPU-hours lost so far."""
        self.result.cumulative.append((now / 3600.0, self.result.lost_gpu_hours))

    def last_sample(self, now: float) -> None:
        """The curve's last point, at the time reached (unless one was taken then)."""
        hours = now / 3600.0
        if not self.result.cumulative or self.result.cumulative[-1][0] < hours:
            self.result.cumulative.append((hours, self.result.lost_gpu_hours))

    def advance(self, running: Iterable[Job], now: float, dt: float) -> None:
        """``dt`` seconds of the running jobs: the GPU-hours they hold, the work they do at their step's
        pace, and what a slowed step loses, by the cause slowing it most."""
        r = self.result
        g = self.gpus_per_node
        for job in running:
            gpus = job.spec.nodes * g
            r.gpu_hours_total += gpus * dt / 3600.0
            if now + dt <= job.run.windows_from:
                continue  # restarting: booked as the requeue's cost
            rate = HEALTHY_STEP_MS / job.step_ms
            job.progress += dt * rate
            if rate < 1.0:
                lost = gpus * (1.0 - rate) * dt / 3600.0
                r.slow_gpu_hours += lost
                # No fault left: the rebalance still in place makes the others carry the moved work.
                cause = job.cause_now or "rebalance left in place"
                r.slow_by_cause[cause] = r.slow_by_cause.get(cause, 0.0) + lost

    def requeued(self, job: Job, now: float) -> None:
        """A requeue throws away the job's work since its last checkpoint and pays its restart."""
        # Checkpoints fall every checkpoint_s of the job's work, counted from its very start (a job
        # already running at t = 0 brought done_s with it).
        lost = (job.spec.done_s + job.progress) % job.spec.checkpoint_s
        job.requeue_losses.append((now, job.progress, lost))
        job.progress -= lost
        gpus = job.spec.nodes * self.gpus_per_node
        r = self.result
        r.requeues += 1
        r.requeue_gpu_hours += gpus * (lost + job.spec.restart_s) / 3600.0

    def timed_out(self, job: Job) -> None:
        """Killed at its limit: resubmitted, it starts again from its last checkpoint."""
        self.result.timeouts += 1
        self.result.timeout_gpu_hours += job.spec.nodes * self.gpus_per_node * \
            ((job.spec.done_s + job.progress) % job.spec.checkpoint_s) / 3600.0

    def drained(self, who: str, healthy: bool) -> None:
        r = self.result
        r.drains += 1
        r.drains_by[who] = r.drains_by.get(who, 0) + 1
        if healthy:
            r.healthy_drains += 1

    def undrained(self, since: float, healthy: bool, now: float) -> None:
        """A drained node back in service (or still drained at the end): a healthy one's hours were lost."""
        if healthy:
            self.result.healthy_drain_node_hours += (now - since) / 3600.0

    def recovered(self, enc: Encounter, by: str, now: float) -> None:
        """A fault stopped slowing a job: the minutes since its onset, if an action (not time, not the
        job's end) ended it."""
        if by not in ("itself", "job end") and enc.fault is not None:
            self.result.recovery_minutes.append((now - enc.onset) / 60.0)
            self.result.recovery_by_cause.setdefault(enc.fault.cause, []).append((now - enc.onset) / 60.0)

    def verdict(self, enc: Encounter, recovered: bool, now: float) -> None:
        """The loop's verification judged an action: recovered or not, and when."""
        r = self.result
        r.verdicts += 1
        if recovered:
            r.verdicts_recovered += 1
            if enc.fault is not None:
                r.verified_minutes.append((now - enc.onset) / 60.0)

    def read_out(self, faulty_jobs: int, loop: FleetLoop | None, by_incident: Mapping[str, Encounter]) -> None:
        """At the end: the jobs that met a fault, and what the loop did (budget refusals, the incidents'
        states, the requeues its price refused and the faults they were about)."""
        r = self.result
        r.faulty_jobs = faulty_jobs
        if loop is not None:
            r.budget_refusals = loop.budget_refusals
            states = Counter(loop.tracked(i).inc.state.value for i in by_incident)
            r.incident_states = dict(sorted(states.items()))
            for note in loop.notes():
                if note.what == "escalated" and "waiting is cheaper" in note.why:
                    enc = by_incident.get(note.incident or "")
                    cause = enc.fault.cause if enc is not None and enc.fault is not None else "none (false alarm)"
                    r.waits[cause] += 1
                    if len(r.wait_examples) < 6:
                        r.wait_examples.append(f"{note.incident} ({cause}): {note.why}")


def summary(results: dict[str, ModeResult]) -> str:
    """The table the benchmark and ``artemis sim --fleet`` print."""
    base = results.get("none")
    rows = [("mode", "GPU-h lost", "slow", "requeue", "timeout", "recovered vs none", "healthy drains /1k jobs",
             "drains", "budget refusals", "median onset->fixed min (hardware)", "median onset->verified min",
             "verified recovered", "requeues", "jobs")]
    for mode, r in results.items():
        recovered = "-" if base is None or base.lost_gpu_hours <= 0 or mode == "none" else \
            f"{100.0 * (1.0 - r.lost_gpu_hours / base.lost_gpu_hours):.1f} %"
        per_k = 1000.0 * r.healthy_drains / max(1, r.jobs_started)
        verified = f"{r.verdicts_recovered}/{r.verdicts}" if r.verdicts else "-"
        rows.append((mode, f"{r.lost_gpu_hours:.1f}", f"{r.slow_gpu_hours:.1f}", f"{r.requeue_gpu_hours:.1f}",
                     f"{r.timeout_gpu_hours:.1f}",
                     recovered, f"{per_k:.2f} ({r.healthy_drains})", str(r.drains), str(r.budget_refusals),
                     f"{_fmt(_median(r.recovery_minutes))} ({_fmt(r.median_recovery(HARDWARE_CAUSES))})",
                     _fmt(_median(r.verified_minutes)), verified,
                     str(r.requeues), str(r.jobs_started)))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
