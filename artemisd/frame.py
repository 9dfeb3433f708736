"""WindowFrame: one job's window as columns, the input of the analysis stages.

Window reports arrive one per rank; the stages judge a whole window at once,
vectorised with numpy, so a 100k-rank window costs a few array passes rather
than 100k Python objects.  A value a rank did not measure is NaN here (the
wire contract's "absent"), never zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter

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
    "run_wait_ms_per_s": ("host", "run_wait_ms_per_s"),
}


def _codes(values: Sequence[str | None]) -> tuple[np.ndarray, list[str | None]]:
    """Each value's code, numbered in order of first appearance, and the names the codes index."""
    index: dict[str | None, int] = {}
    codes = [index.setdefault(value, len(index)) for value in values]
    return np.array(codes, dtype=np.int32), list(index)


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
    # The most collective calls per step any rank made (all groups); NaN where no rank measured them.
    collective_calls: float = float("nan")

    @property
    def size(self) -> int:
        return int(self.rank.shape[0])

    def run_wait_per_step(self) -> np.ndarray:
        """Each rank's run-queue wait (all its threads' time runnable, not running), ms per step; NaN if unmeasured."""
        wait = self.telemetry.get("run_wait_ms_per_s")
        if wait is None:
            return np.full(self.size, np.nan)
        return wait * self.seconds / np.maximum(self.steps, 1)

    @classmethod
    def from_reports(cls, reports: Sequence[WindowReport]) -> WindowFrame:
        if not reports:
            raise ValueError("a window frame needs at least one report")
        # One pass over the reports gathering tuples (attrgetter reads several
        # fields in one C call), then one array per block: walking the records
        # once per column cost more than the whole analysis of the window.
        first = reports[0]
        n = len(reports)
        ranks, islands, nodes, samples, p50 = [], [], [], [], []
        times, spans, gpus, hosts, envs = [], [], [], [], []
        throttle = np.full(n, THROTTLE_UNMEASURED, dtype=np.int64)
        per_group: dict[str, list[float]] = {}
        calls: list[float] = []
        for i, r in enumerate(reports):
            ranks.append(r.rank)
            nodes.append(r.node)
            islands.append(r.island or (f"{r.device.vendor}:{r.device.model}" if r.device is not None
                                        else "default"))
            samples.append(r.samples)
            p50.append(_P50_NONE if r.ms_p50 is None else (r.ms_p50.get("busy"), r.ms_p50.get("step")))
            times.append(_times(r.ms))
            span = r.window
            spans.append(_span(span))
            gpu = r.gpu
            if gpu is None:
                gpus.append(_GPU_NONE)
            else:
                gpus.append(_gpu(gpu))
                if gpu.throttle is not None:
                    mask = 0
                    for reason in gpu.throttle:
                        mask |= THROTTLE_BIT[reason]
                    throttle[i] = mask
            hosts.append(_HOST_NONE if r.host is None else _host(r.host))
            envs.append(_ENV_NONE if r.env is None else env_values(r.env))
            if r.collectives is not None:
                made = 0
                for c in r.collectives:
                    per_group.setdefault(c.group, []).append(c.ms / span.steps)
                    made += c.calls
                calls.append(made / span.steps)
        # None -> NaN: the wire contract's "not measured".
        busy, step, comm_wait, compute, data = _columns(times, np.float64)
        t0, t1 = _columns([s[:2] for s in spans], np.float64)
        steps, first_step = _columns([s[2:] for s in spans], np.int64)
        telemetry = dict(zip(_GPU_COLUMNS, _columns(gpus, np.float64)))
        telemetry |= dict(zip(_HOST_COLUMNS, _columns(hosts, np.float64)))
        telemetry = {column: telemetry[column] for column in TELEMETRY_COLUMNS}
        island, island_names = _codes(islands)
        node, node_names = _codes(nodes)
        env = {attr: _codes([e[k] for e in envs]) for k, attr in enumerate(ENV_FIELDS)}
        busy_p50, step_p50 = _columns(p50, np.float64)
        collectives = {group: float(np.median(v)) for group, v in per_group.items()}
        return cls(
            job=first.job,
            job_step=first.step,
            seq=first.window.seq,
            world=first.world,
            rank=np.array(ranks, dtype=np.int64),
            busy=busy,
            step=step,
            comm_wait=comm_wait,
            compute=compute,
            data=data,
            samples=np.array(samples, dtype=np.float64),
            busy_p50=busy_p50,
            step_p50=step_p50,
            seconds=t1 - t0,
            steps=steps,
            first_step=first_step,
            island=island,
            island_names=island_names,
            node=node,
            node_names=node_names,
            throttle=throttle,
            telemetry=telemetry,
            env=env,
            collectives=collectives,
            collective_calls=max(calls, default=float("nan")),
        )


_GPU_COLUMNS = tuple(column for column, (block, _) in TELEMETRY_COLUMNS.items() if block == "gpu")
_HOST_COLUMNS = tuple(column for column, (block, _) in TELEMETRY_COLUMNS.items() if block == "host")
ENV_FIELDS = ("driver", "comm_lib", "torch", "config")
_gpu = attrgetter(*(TELEMETRY_COLUMNS[c][1] for c in _GPU_COLUMNS))
_host = attrgetter(*(TELEMETRY_COLUMNS[c][1] for c in _HOST_COLUMNS))
env_values = attrgetter(*ENV_FIELDS)
_times = attrgetter("busy", "step", "comm_wait", "compute", "data")
_span = attrgetter("t0", "t1", "steps", "first_step")
_GPU_NONE = (None,) * len(_GPU_COLUMNS)
_HOST_NONE = (None,) * len(_HOST_COLUMNS)
_ENV_NONE = (None,) * len(ENV_FIELDS)
_P50_NONE = (None, None)


def _columns(rows: list[tuple], dtype: type) -> np.ndarray:
    """Rows of equal-length tuples -> one contiguous array per position (None is NaN for floats)."""
    width = len(rows[0])
    return np.array(rows, dtype=dtype).reshape(len(rows), width).T.copy()
