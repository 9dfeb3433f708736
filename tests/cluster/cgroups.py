"""One cgroup v1 ``cpu`` group per emulated node.

Each slurmd starts inside its node's group, so every job step, rank and data
loader on that node inherits it.  That gives teardown an exact list of the
processes a node ran (``cgroup.procs``), and the CPU-contention fault a knob
(``cpu.cfs_quota_us``) that slows exactly one node.
"""

from __future__ import annotations

import os
from pathlib import Path

from .procs import kill_pids

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000  # a short period so throttling is smooth at step granularity


def cgroup_v1_cpu_available() -> str | None:
    if not (CPU_ROOT / "cgroup.procs").exists() or not (CPU_ROOT / "cpu.cfs_quota_us").exists():
        return f"cgroup v1 cpu controller is not mounted at {CPU_ROOT}"
    return None


class NodeCgroup:
    def __init__(self, cluster_tag: str, node: str):
        self.path = CPU_ROOT / "artemis-test" / cluster_tag / node

    def create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.set_quota(None)

    def enter(self) -> None:
        """Move the calling process in (used between fork and exec of slurmd)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def set_quota(self, fraction_of_cpu: float | None) -> None:
        """Cap the node at ``fraction_of_cpu`` of one CPU in total; None lifts the cap."""
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        quota = -1 if fraction_of_cpu is None else max(1000, int(PERIOD_US * fraction_of_cpu))
        (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    def remove(self) -> None:
        for _ in range(5):  # bounded: processes may fork while we kill
            pids = self.pids()
            if not pids:
                break
            kill_pids(pids)
        for directory in (self.path, self.path.parent, self.path.parent.parent):
            try:
                directory.rmdir()
            except OSError:
                # Not empty (another node or cluster still uses it) or already gone.
                break
