"""The whole loop at fleet scale, its results: what one mode did to the fleet (``ModeResult``) and the
table the benchmark and ``artemis sim --fleet`` print (``summary``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from artemisd.sim.closedloop_scenario import HARDWARE_CAUSES


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
