"""WindowFrame: one job's window as columns, the input of the analysis stages.

Window reports arrive one per rank; the stages judge a whole window at once,
vectorised with numpy, so a 100k-rank window costs a few array passes rather
than 100k Python objects.  A value a rank did not measure is NaN here (the
wire contract's "absent"), never zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from artemisd.wire import THROTTLE_REASONS, WindowReport

THROTTLE_BIT = {reason: 1 << i for i, reason in enumerate(THROTTLE_REASONS)}
THROTTLE_UNMEASURED = -1

# Telemetry columns copied from the report: column name -> (block, field).
TELEMETRY_COLUMNS: dict[str, tuple[str, str]] = {
    "sm_clock_mhz": ("gpu", "sm_clock_mhz"),
    "max_sm_clock_mhz": ("gpu", "max_sm_clock_mhz"),
    "power_w": ("gpu", "power_w"),
    "power_limit_w": ("gpu", "power_limit_w"),
    "default_power_limit_w": ("gpu", "default_power_limit_w"),
    "temp_c": ("gpu", "temp_c"),
    "util_pct": ("gpu", "util_pct"),
    "cpu_pct": ("host", "cpu_pct"),
    "steal_pct": ("host", "steal_pct"),
    "iowait_pct": ("host", "iowait_pct"),
    "ctx_invol_per_s": ("host", "ctx_invol_per_s"),
    "net_retransmits_per_s": ("host", "net_retransmits_per_s"),
    "cpu_throttled_pct": ("host", "cpu_throttled_pct"),
}


def _codes(values: Sequence[str | None]) -> tuple[np.ndarray, list[str | None]]:
    names: list[str | None] = []
    index: dict[str | None, int] = {}
    out = np.empty(len(values), dtype=np.int32)
    for i, value in enumerate(values):
        code = index.get(value)
        if code is None:
            code = index[value] = len(names)
            names.append(value)
        out[i] = code
    return out, names


def _num(value: float | None) -> float:
    return np.nan if value is None else float(value)


@dataclass
class WindowFrame:
    """Columns of one (job, step, window seq); row i is one rank's report.

    Times are per-step means in ms (wire contract).  ``island``/``node`` and the
    env columns are integer codes into their ``*_names`` lists.  ``throttle`` is
    a bitmask over ``THROTTLE_REASONS`` (``THROTTLE_UNMEASURED`` when absent).
    """

    job: str
    job_step: str
    seq: int
    world: int
    rank: np.ndarray
    busy: np.ndarray
    step: np.ndarray
    comm_wait: np.ndarray
    compute: np.ndarray
    data: np.ndarray
    samples: np.ndarray
    busy_p50: np.ndarray  # per-step medians (NaN where the probe sent none)
    step_p50: np.ndarray
    seconds: np.ndarray
    steps: np.ndarray
    first_step: np.ndarray
    island: np.ndarray
    island_names: list[str | None]
    node: np.ndarray
    node_names: list[str | None]
    throttle: np.ndarray
    telemetry: dict[str, np.ndarray] = field(default_factory=dict)
    env: dict[str, tuple[np.ndarray, list[str | None]]] = field(default_factory=dict)
    # Median over ranks of each process group's collective time, ms per step.
    collectives: dict[str, float] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.rank.shape[0])

    @classmethod
    def from_reports(cls, reports: Sequence[WindowReport]) -> WindowFrame:
        if not reports:
            raise ValueError("a window frame needs at least one report")
        first = reports[0]
        n = len(reports)
        island, island_names = _codes([r.island_key for r in reports])
        node, node_names = _codes([r.node for r in reports])
        throttle = np.full(n, THROTTLE_UNMEASURED, dtype=np.int64)
        for i, r in enumerate(reports):
            if r.gpu is not None and r.gpu.throttle is not None:
                mask = 0
                for reason in r.gpu.throttle:
                    mask |= THROTTLE_BIT[reason]
                throttle[i] = mask
        telemetry = {}
        for column, (block, attr) in TELEMETRY_COLUMNS.items():
            telemetry[column] = np.array(
                [_num(getattr(getattr(r, block), attr)) if getattr(r, block) is not None else np.nan
                 for r in reports],
                dtype=np.float64,
            )
        env = {
            attr: _codes([getattr(r.env, attr) if r.env is not None else None for r in reports])
            for attr in ("driver", "comm_lib", "torch", "config")
        }
        per_group: dict[str, list[float]] = {}
        for r in reports:
            for c in r.collectives or ():
                per_group.setdefault(c.group, []).append(c.ms / r.window.steps)
        collectives = {group: float(np.median(v)) for group, v in per_group.items()}
        return cls(
            job=first.job,
            job_step=first.step,
            seq=first.window.seq,
            world=first.world,
            rank=np.array([r.rank for r in reports], dtype=np.int64),
            busy=np.array([r.ms.busy for r in reports], dtype=np.float64),
            step=np.array([r.ms.step for r in reports], dtype=np.float64),
            comm_wait=np.array([_num(r.ms.comm_wait) for r in reports], dtype=np.float64),
            compute=np.array([_num(r.ms.compute) for r in reports], dtype=np.float64),
            data=np.array([_num(r.ms.data) for r in reports], dtype=np.float64),
            samples=np.array([_num(r.samples) for r in reports], dtype=np.float64),
            busy_p50=np.array([_num((r.ms_p50 or {}).get("busy")) for r in reports], dtype=np.float64),
            step_p50=np.array([_num((r.ms_p50 or {}).get("step")) for r in reports], dtype=np.float64),
            seconds=np.array([r.window.seconds for r in reports], dtype=np.float64),
            steps=np.array([r.window.steps for r in reports], dtype=np.int64),
            first_step=np.array([r.window.first_step for r in reports], dtype=np.int64),
            island=island,
            island_names=island_names,
            node=node,
            node_names=node_names,
            throttle=throttle,
            telemetry=telemetry,
            env=env,
            collectives=collectives,
        )
