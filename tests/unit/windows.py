"""Hand-built lockstep windows for the pipeline's unit tests.

``lockstep`` builds one window of a job from each rank's busy time: the step
ends when the slowest rank arrives, so every rank's step time is the same and
``comm_wait = step − busy`` (as the probe measures it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from artemisd.wire import WindowReport, parse_record

HEALTHY_GPU = {"sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980, "power_w": 600, "power_limit_w": 700,
               "default_power_limit_w": 700, "temp_c": 60, "util_pct": 97, "throttle": []}
HEALTHY_HOST = {"cpu_pct": 100.0, "steal_pct": 0.0, "iowait_pct": 0.2, "ctx_invol_per_s": 5.0,
                "net_retransmits_per_s": 0.0, "cpu_throttled_pct": 0.0}


def lockstep(
    seq: int,
    busy: list[float],
    *,
    job: str = "100",
    comm_ms: float = 20.0,
    steps: int = 50,
    nodes: list[str] | None = None,
    data: list[float] | None = None,
    gpu: dict[int, dict[str, Any]] | None = None,
    host: dict[int, dict[str, Any]] | None = None,
    island: list[str] | None = None,
    env: dict[str, str] | None = None,
    samples_per_step: int = 32,
    telemetry: bool = True,
    rebalance_opt_in: bool = False,
) -> list[WindowReport]:
    step = max(busy) + comm_ms
    return _reports(seq, [step] * len(busy), busy, [step - b for b in busy], None, job=job, steps=steps,
                    nodes=nodes, data=data, gpu=gpu, host=host, island=island, env=env,
                    samples_per_step=samples_per_step, telemetry=telemetry, rebalance_opt_in=rebalance_opt_in)


def stepwise(seq: int, busy_steps: np.ndarray, *, comm_ms: float = 20.0, **kw: Any) -> list[WindowReport]:
    """One window from per-step busy times (steps × ranks), run in lockstep.

    Each step ends when its slowest rank arrives, so a rank's comm_wait per
    step is the slowest rank's busy − its own + ``comm_ms``; the report gets
    the window means and the per-step medians (``ms_p50``), as the probe sends.
    """
    step = busy_steps.max(axis=1) + comm_ms
    wait = step[:, None] - busy_steps
    world = busy_steps.shape[1]
    p50 = [{"step": float(np.median(step)), "busy": float(np.median(busy_steps[:, r]))} for r in range(world)]
    return _reports(seq, [float(step.mean())] * world, busy_steps.mean(axis=0).tolist(),
                    wait.mean(axis=0).tolist(), p50, steps=busy_steps.shape[0], **kw)


def _reports(seq, step, busy, wait, p50, *, job="100", steps=50, nodes=None, data=None, gpu=None, host=None,
             island=None, env=None, samples_per_step=32, telemetry=True,
             rebalance_opt_in=False) -> list[WindowReport]:
    world = len(busy)
    nodes = nodes or [f"n{r // 2}" for r in range(world)]
    t0 = 1_000_000.0 + seq * steps * step[0] / 1000.0
    reports = []
    for rank, b in enumerate(busy):
        d = data[rank] if data else 1.0
        record: dict[str, Any] = {
            "type": "window", "v": 1, "job": job, "step": "0", "rank": rank, "world": world,
            "node": nodes[rank],
            "device": {"vendor": "nvidia", "model": "H100", "index": rank % 2},
            "window": {"seq": seq, "first_step": seq * steps, "steps": steps, "t0": t0,
                       "t1": t0 + steps * step[rank] / 1000.0},
            "ms": {"step": step[rank], "busy": b, "compute": b - d, "data": d, "comm_wait": wait[rank]},
            "samples": samples_per_step * steps,
            "collectives": [{"op": "all_reduce", "group": "world", "calls": steps, "bytes": 1e8,
                             "ms": wait[rank] * steps}],
        }
        if p50 is not None:
            record["ms_p50"] = p50[rank]
        if island:
            record["island"] = island[rank]
        if telemetry:
            record["gpu"] = {**HEALTHY_GPU, **(gpu or {}).get(rank, {})}
            record["host"] = {**HEALTHY_HOST, **(host or {}).get(rank, {})}
        if env:
            record["env"] = env
        if rebalance_opt_in:
            record["rebalance_opt_in"] = True
        reports.append(parse_record(record))
    return reports


def run(analyzer, windows: list[list[WindowReport]]):
    updates = []
    for window in windows:
        for report in window:
            updates.extend(analyzer.ingest(report))
    updates.extend(analyzer.flush())
    return updates
