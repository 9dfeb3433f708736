"""Hand-built lockstep windows for the pipeline's unit tests.

``lockstep`` builds one window of a job from each rank's busy time: the step
ends when the slowest rank arrives, so every rank's step time is the same and
``comm_wait = step − busy`` (as the probe measures it).
"""

from __future__ import annotations

from typing import Any

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
    world = len(busy)
    step = max(busy) + comm_ms
    nodes = nodes or [f"n{r // 2}" for r in range(world)]
    t0 = 1_000_000.0 + seq * steps * step / 1000.0
    reports = []
    for rank, b in enumerate(busy):
        d = data[rank] if data else 1.0
        record: dict[str, Any] = {
            "type": "window", "v": 1, "job": job, "step": "0", "rank": rank, "world": world,
            "node": nodes[rank],
            "device": {"vendor": "nvidia", "model": "H100", "index": rank % 2},
            "window": {"seq": seq, "first_step": seq * steps, "steps": steps, "t0": t0,
                       "t1": t0 + steps * step / 1000.0},
            "ms": {"step": step, "busy": b, "compute": b - d, "data": d, "comm_wait": step - b},
            "samples": samples_per_step * steps,
            "collectives": [{"op": "all_reduce", "group": "world", "calls": steps, "bytes": 1e8,
                             "ms": (step - b) * steps}],
        }
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
