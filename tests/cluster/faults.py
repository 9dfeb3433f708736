"""Fault injectors for the emulated nodes of a ``SlurmCluster``.

Each injector is a context manager: the fault is on inside the ``with`` and
off after it (also on error), so a failing test never leaves a slow node for
the next one.

* ``CpuContention``  — cgroup v1 ``cpu.cfs_quota_us`` (10 ms period) on every
  process of one node: the host is contended, the "GPU" fine.
* ``DegradedLink``   — ``tc qdisc … tbf`` on both ends of one node's veth: its
  collectives slow down, and with them every rank's (needs the netns layout).
* ``LoaderStall``    — the training script's stall file for one node: each
  batch waits in the data loader.
* ``EmulatedGpuFault`` — the node's emulated telemetry file shows lowered
  clocks / thermal throttling / a power cap, while the node's compute is slowed
  to match (the CPU quota).  Like a real GPU, it recovers when a correction
  restores its clocks or power limit — the node check edits the file, and a
  watcher lifts the slowdown — and not otherwise: a hot GPU stays slow.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

from .procs import ClusterError, run
from .slurm import SlurmCluster

HEALTHY_GPU = {"sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980, "power_w": 420,
               "power_limit_w": 700, "default_power_limit_w": 700, "temp_c": 45,
               "util_pct": 97, "throttle": []}

# What each emulated fault looks like to NVML.
GPU_FAULTS: dict[str, dict[str, Any]] = {
    "thermal": {"sm_clock_mhz": 1230, "temp_c": 93, "power_w": 380, "throttle": ["hw_thermal", "sw_thermal"]},
    "power": {"sm_clock_mhz": 1290, "power_limit_w": 350, "power_w": 348, "throttle": ["sw_power_cap"]},
    "clocks": {"sm_clock_mhz": 1110, "throttle": ["applications_clocks"]},
}


def write_healthy_gpus(cluster: SlurmCluster, gpus_per_node: int = 1) -> None:
    """Every node's emulated telemetry file, healthy (an atomic write per node)."""
    for name in cluster.node_names:
        write_gpu_file(cluster.emulated_gpu_dir / f"{name}.json", {
            "vendor": "nvidia", "model": "Emulated GPU", "driver": "550.54.15",
            "gpus": {str(i): dict(HEALTHY_GPU, uuid=f"GPU-{name}-{i}") for i in range(gpus_per_node)}})


def write_gpu_file(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)  # ranks re-read this file every window


class CpuContention:
    """A noisy neighbour on one node: busy processes sharing the node's capped CPU.

    The cap (``cpu_fraction`` of one CPU for the whole node) makes the node slow
    without touching the others on this shared machine; the ``hogs`` inside the
    cap are what real contention looks like to the rank — preempted (involuntary
    context switches) and getting a smaller CPU share than its peers.
    """

    def __init__(self, cluster: SlurmCluster, node: str, cpu_fraction: float = 0.1, hogs: int = 1):
        self.group = cluster.nodes[node].cgroup
        self.netns = cluster.nodes[node].netns
        self.fraction = cpu_fraction
        self.hog_count = hogs
        self.hogs: list[subprocess.Popen] = []

    def __enter__(self) -> CpuContention:
        self.group.set_quota(self.fraction)
        for _ in range(self.hog_count):
            self.hogs.append(subprocess.Popen(["sh", "-c", "while :; do :; done"],
                                              preexec_fn=self.group.enter))
        return self

    def __exit__(self, *exc: Any) -> None:
        for hog in self.hogs:
            hog.kill()
            hog.wait(timeout=10)
        self.hogs.clear()
        self.group.set_quota(None)


class DegradedLink:
    """Token-bucket limit on both directions of one node's link."""

    def __init__(self, cluster: SlurmCluster, node: str, rate: str = "40mbit",
                 burst: str = "32kb", latency: str = "50ms"):
        target = cluster.nodes[node]
        if target.netns is None or target.host_veth is None:
            raise ClusterError("a degraded link needs the netns layout (one link per node)")
        self.ends = [(["tc"], target.host_veth), (["tc", "-n", target.netns], target.iface)]
        self.spec = ["tbf", "rate", rate, "burst", burst, "latency", latency]

    def __enter__(self) -> DegradedLink:
        try:
            for tc, dev in self.ends:
                run([*tc, "qdisc", "replace", "dev", dev, "root", *self.spec])
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for tc, dev in self.ends:
            run([*tc, "qdisc", "del", "dev", dev, "root"], check=False)


class LoaderStall:
    def __init__(self, stall_dir: Path, node: str, seconds_per_batch: float = 0.15):
        self.path = stall_dir / node
        self.seconds = seconds_per_batch

    def __enter__(self) -> LoaderStall:
        self.path.write_text(f"{self.seconds}\n")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.path.unlink(missing_ok=True)


class EmulatedGpuFault:
    def __init__(self, cluster: SlurmCluster, node: str, kind: str, cpu_fraction: float = 0.1):
        if kind not in GPU_FAULTS:
            raise ValueError(f"kind must be one of {', '.join(GPU_FAULTS)}, not {kind!r}")
        self.path = cluster.emulated_gpu_dir / f"{node}.json"
        self.kind = kind
        self.slowdown = CpuContention(cluster, node, cpu_fraction, hogs=0)
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name=f"gpu-fault-{node}")
        self.recovered = threading.Event()
        self._healthy: dict[str, Any] | None = None

    def __enter__(self) -> EmulatedGpuFault:
        data = json.loads(self.path.read_text())
        self._healthy = copy.deepcopy(data)
        for gpu in data["gpus"].values():
            gpu.update(GPU_FAULTS[self.kind])
        write_gpu_file(self.path, data)
        self.slowdown.__enter__()
        self._watcher.start()
        return self

    def _gpu_recovered(self) -> bool:
        try:
            gpus = json.loads(self.path.read_text())["gpus"].values()
        except (OSError, ValueError, KeyError):
            return False
        return all(g.get("sm_clock_mhz") == g.get("max_sm_clock_mhz") and not g.get("throttle")
                   for g in gpus)

    def _watch(self) -> None:
        # Bounded by the fault's lifetime; polls a small file twice a second.
        while not self._stop.wait(0.5):
            if self._gpu_recovered():
                self.slowdown.__exit__()
                self.recovered.set()
                return

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._watcher.join(timeout=5)
        self.slowdown.__exit__()
        if self._healthy is not None:
            write_gpu_file(self.path, self._healthy)
