"""A fleet of simulated jobs: wire-format records in arrival order, frames, ground truth.

``Fleet(spec).records()`` yields wire v1 dicts (window reports and node
events) merged across jobs by arrival time, exactly what ``artemis replay``
reads.  ``Fleet(spec).frames(job)`` is the columnar fast path: it yields one
``artemisd.frame.WindowFrame`` per window without building a single report,
for the analysis-cost benchmark at 100k ranks.  ``truth()`` is the sidecar
(``TRACE.truth.json``): the injected faults, the healthy-but-slow GPUs that
must not be flagged, and the transients that are not faults.

Each job draws from its own random stream (``SeedSequence(seed).spawn``), so a
job's trace does not depend on which other jobs share the fleet.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from artemisd.frame import THROTTLE_BIT, THROTTLE_UNMEASURED, TELEMETRY_COLUMNS, WindowFrame
from artemisd.sim.model import JobModel, WindowColumns
from artemisd.sim.spec import FleetSpec, JobSpec

TRUTH_VERSION = 1
_REASONS = tuple(THROTTLE_BIT.items())
_GPU_FIELDS = ("sm_clock_mhz", "max_sm_clock_mhz", "power_w", "power_limit_w", "default_power_limit_w",
               "temp_c", "util_pct")
_HOST_FIELDS = ("cpu_pct", "steal_pct", "iowait_pct", "ctx_invol_per_s", "net_retransmits_per_s")
_KERNEL = "6.1.0-28-amd64"
_GRAD_BYTES = 2.0e9  # all-reduce payload per step; only reported, never judged


def truth_path(trace: str | Path) -> Path:
    """``run.jsonl`` -> ``run.truth.json`` (the sidecar beside the trace)."""
    trace = Path(trace)
    stem = trace.name[: -len(".jsonl")] if trace.name.endswith(".jsonl") else trace.name
    return trace.with_name(f"{stem}.truth.json")


def _reasons(mask: int) -> list[str]:
    return [reason for reason, bit in _REASONS if mask & bit]


class Fleet:
    def __init__(self, spec: FleetSpec):
        self.spec = spec
        seeds = np.random.SeedSequence(spec.seed).spawn(len(spec.jobs))
        self.models: dict[str, JobModel] = {}
        next_node = 0
        for job, seed in zip(spec.jobs, seeds):
            first = job.first_node if job.first_node is not None else next_node
            next_node = max(next_node, first + job.nodes)
            rng = np.random.default_rng(seed)
            self.models[job.job] = JobModel(job, rng, first, spec.start_time + job.start_s)

    # --- records -----------------------------------------------------------

    def records(self) -> Iterator[dict[str, Any]]:
        """Every job's records (JSON-ready dicts), merged in arrival order."""
        streams = [self._job_records(model) for model in self.models.values()]
        for _, _, record in heapq.merge(*streams, key=lambda item: (item[0], item[1])):
            yield record

    def _job_records(self, model: JobModel) -> Iterator[tuple[float, int, dict[str, Any]]]:
        layout = model.layout
        order = 0
        start = model.t
        for node in range(layout.nodes):  # the prolog reports before the first step
            event = self._node_event(model, node, "job_start", start - 2.0)
            yield start - 2.0 + 0.01 * node / layout.nodes, order, event
            order += 1
        static = [self._static(model, r) for r in range(layout.world)]
        cols = None
        for cols in model.windows():
            rows = sorted(range(layout.world), key=lambda r: cols.arrival[r])
            for r in rows:
                yield cols.t1 + float(cols.arrival[r]), order, self._report(model, cols, r, static[r])
                order += 1
        end = cols.t1 if cols is not None else start
        for node in range(layout.nodes):
            yield end + 1.0, order, self._node_event(model, node, "job_end", end + 1.0)
            order += 1

    @staticmethod
    def _static(model: JobModel, rank: int) -> dict[str, Any]:
        spec, layout = model.spec, model.layout
        island = spec.islands[int(layout.island_of[rank])]
        node = layout.node_names[int(layout.node_of[rank])]
        local = int(layout.local_rank[rank])
        return {
            "node": node,
            "device": {"vendor": island.vendor, "model": island.model, "index": local,
                       "uuid": f"GPU-{node}-{local}"},
            "island": island.name,
            "env": spec.env.model_dump(),
        }

    @staticmethod
    def _report(model: JobModel, c: WindowColumns, r: int, static: dict[str, Any]) -> dict[str, Any]:
        spec = model.spec
        node = int(model.layout.node_of[r])
        step, busy = round(float(c.step[r]), 3), round(float(c.busy[r]), 3)
        collectives = [{"op": "all_reduce", "group": "world", "calls": c.steps,
                        "bytes": _GRAD_BYTES * c.steps, "ms": round(float(c.world_coll_ms[r]), 3)}]
        if c.island_coll_ms is not None:
            # The intra-island stage's process group is named after its island.
            collectives.append({"op": "reduce_scatter", "group": static["island"],
                                "calls": c.steps, "bytes": _GRAD_BYTES / 2 * c.steps,
                                "ms": round(float(c.island_coll_ms[r]), 3)})
        rec: dict[str, Any] = {
            "type": "window", "v": 1, "job": spec.job, "step": "0", "rank": r, "world": model.layout.world,
            "node": static["node"], "device": static["device"], "island": static["island"],
            "window": {"seq": c.seq, "first_step": c.first_step, "steps": c.steps,
                       "t0": round(c.t0, 3), "t1": round(c.t1, 3)},
            "ms": {"step": step, "busy": busy, "compute": round(float(c.compute[r]), 3),
                   "data": round(float(c.data[r]), 3), "comm_wait": round(step - busy, 3)},
            "ms_p50": {"step": round(float(c.step_p50[r]), 3), "busy": round(float(c.busy_p50[r]), 3)},
            "samples": float(c.samples[r]),
            "collectives": collectives,
            "env": static["env"],
        }
        t = c.telemetry
        if spec.gpu_telemetry:
            rec["gpu"] = {
                "sm_clock_mhz": round(float(t.sm_clock_mhz[r])),
                "max_sm_clock_mhz": round(float(t.max_sm_clock_mhz[r])),
                "power_w": round(float(t.power_w[r]), 1),
                "power_limit_w": round(float(t.power_limit_w[r]), 1),
                "default_power_limit_w": round(float(t.default_power_limit_w[r]), 1),
                "temp_c": round(float(t.temp_c[r]), 1),
                "util_pct": round(float(t.util_pct[r]), 1),
                "throttle": _reasons(int(t.throttle[r])),
                "ecc_uncorrected": 0,
                "pcie_replay": 0,
            }
        if spec.host_telemetry:
            rec["host"] = {name: round(float(getattr(t, name)[node]), 2) for name in _HOST_FIELDS}
        if c.probe is not None:
            p = c.probe
            peer = int(p.p2p_peer[r])
            rec["probe"] = {
                "id": p.id, "gemm_ms": round(float(p.gemm_ms[r]), 3),
                "gemm_tflops": round(2 * 8192**3 / (float(p.gemm_ms[r]) * 1e9), 1),
                "allreduce_ms": round(float(p.allreduce_ms[r]), 3),
                "p2p": [{"peer": peer, "ms": round(float(p.p2p_ms[r]), 3),
                         "node": model.layout.node_names[int(model.layout.node_of[peer])]}],
                "cost_ms": round(float(p.gemm_ms[r] + p.allreduce_ms[r] + p.p2p_ms[r]), 3),
            }
        return rec

    @staticmethod
    def _node_event(model: JobModel, node: int, event: str, time: float) -> dict[str, Any]:
        spec, layout = model.spec, model.layout
        env = spec.env
        rec: dict[str, Any] = {
            "type": "node", "v": 1, "event": event, "job": spec.job, "node": layout.node_names[node],
            "time": round(time, 3),
            "fingerprint": {"driver": env.driver, "comm_lib": env.comm_lib, "kernel": _KERNEL,
                            "firmware": "sim-fw-1"},
        }
        if event == "job_start":
            gpus = []
            for r in layout.node_ranks(node):
                island = spec.islands[int(layout.island_of[r])]
                gpus.append({"index": int(layout.local_rank[r]), "vendor": island.vendor, "model": island.model,
                             "uuid": f"GPU-{layout.node_names[node]}-{int(layout.local_rank[r])}",
                             "max_sm_clock_mhz": island.max_sm_clock_mhz,
                             "power_limit_w": island.power_limit_w, "default_power_limit_w": island.power_limit_w,
                             "temp_c": round(float(model.gpu_temp[r]) - 20.0, 1)})
            rec["gpus"] = gpus
        return rec

    # --- fast path ---------------------------------------------------------

    def frames(self, job: str) -> Iterator[WindowFrame]:
        """One WindowFrame per window of ``job``, straight from the model's columns."""
        model = self.models[job]
        for cols in model.windows():
            yield to_frame(model, cols)

    # --- ground truth ------------------------------------------------------

    def truth(self) -> dict[str, Any]:
        """The sidecar.  Transients are complete only after the records were generated."""
        faults, healthy, transients, jobs = [], [], [], []
        for model in self.models.values():
            spec, layout = model.spec, model.layout
            jobs.append({"job": spec.job, "world": layout.world, "windows": spec.windows,
                         "nodes": layout.node_names[0] + ".." + layout.node_names[-1],
                         "islands": {i.name: i.ranks for i in spec.islands}, "env": spec.env.model_dump()})
            for f in model.faults:
                ranks = [int(r) for r in f.ranks]
                faults.append({
                    "id": f.id, "job": spec.job, "kind": f.kind, "cause": f.cause,
                    "rank": ranks[0] if len(ranks) == 1 else None, "ranks": ranks,
                    "node": layout.node_names[f.node] if f.node is not None else None,
                    "link": f"{layout.node_names[f.node]}:uplink" if f.cause == "comm.link" else None,
                    "island": layout.island_names[f.island] if f.island is not None else None,
                    "onset_window": f.onset, "end_window": f.end, "visible_window": f.visible_window(),
                    "magnitude": f.magnitude, "effective_magnitude": round(f.effective_magnitude, 4),
                    "pattern": f.spec.pattern, "variant": f.variant,
                })
            for rank, ratio in sorted(model.healthy_slow.items()):
                healthy.append({"job": spec.job, "rank": rank,
                                "node": layout.node_names[int(layout.node_of[rank])], "ratio": round(float(ratio), 4)})
            transients += [{"job": spec.job, "kind": t.kind, "window": t.window, "rank": t.rank,
                            "rise": round(t.rise, 4)} for t in model.transients]
        return {"version": TRUTH_VERSION, "seed": self.spec.seed, "jobs": jobs, "faults": faults,
                "healthy_slow": healthy, "transients": transients}

    def write(self, trace: str | Path) -> tuple[int, Path]:
        """Write the trace (JSON Lines) and its truth sidecar; return (records, truth path)."""
        trace = Path(trace)
        count = 0
        with trace.open("w", encoding="utf-8") as out:
            for record in self.records():
                out.write(json.dumps(record, separators=(",", ":")))
                out.write("\n")
                count += 1
        side = truth_path(trace)
        side.write_text(json.dumps({"spec": self.spec.model_dump(mode="json"), **self.truth()}, indent=1) + "\n")
        return count, side


def to_frame(model: JobModel, c: WindowColumns) -> WindowFrame:
    """The frame ``WindowFrame.from_reports`` would build from this window's reports (rank order)."""
    spec, layout = model.spec, model.layout
    world = layout.world
    t = c.telemetry
    node_of = layout.node_of
    telemetry: dict[str, np.ndarray] = {}
    for column, (block, attr) in TELEMETRY_COLUMNS.items():
        if block == "gpu":
            telemetry[column] = getattr(t, attr).astype(np.float64) if spec.gpu_telemetry else np.full(world, np.nan)
        elif spec.host_telemetry and hasattr(t, attr):
            telemetry[column] = getattr(t, attr)[node_of]
        else:  # not simulated (e.g. cgroup throttling): not measured, as in the reports
            telemetry[column] = np.full(world, np.nan)
    throttle = t.throttle.astype(np.int64) if spec.gpu_telemetry else np.full(world, THROTTLE_UNMEASURED, np.int64)
    zeros = np.zeros(world, dtype=np.int32)
    collectives = {"world": float(np.median(c.world_coll_ms)) / c.steps}
    if c.island_coll_ms is not None:
        for k, name in enumerate(layout.island_names):
            collectives[name] = float(np.median(c.island_coll_ms[layout.island_of == k])) / c.steps
    return WindowFrame(
        job=spec.job,
        job_step="0",
        seq=c.seq,
        world=world,
        rank=np.arange(world, dtype=np.int64),
        busy=c.busy,
        step=c.step,
        comm_wait=c.step - c.busy,
        compute=c.compute,
        data=c.data,
        samples=c.samples,
        busy_p50=c.busy_p50,
        step_p50=c.step_p50,
        seconds=np.full(world, c.t1 - c.t0),
        steps=np.full(world, c.steps, dtype=np.int64),
        first_step=np.full(world, c.first_step, dtype=np.int64),
        island=layout.island_of.astype(np.int32),
        island_names=list(layout.island_names),
        node=node_of.astype(np.int32),
        node_names=list(layout.node_names),
        throttle=throttle,
        telemetry=telemetry,
        env={attr: (zeros, [getattr(spec.env, attr)]) for attr in ("driver", "comm_lib", "torch", "config")},
        collectives=collectives,
        collective_calls=1.0 if c.island_coll_ms is None else 2.0,  # as each rank reports: a call per step per stage
    )


def simulate_records(spec: FleetSpec) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """All records (in arrival order) and the truth, for tests and benchmarks."""
    fleet = Fleet(spec)
    records = list(fleet.records())
    return records, fleet.truth()


def single_job(job: JobSpec, seed: int = 0) -> FleetSpec:
    """A fleet of one job."""
    return FleetSpec(seed=seed, jobs=(job,))
