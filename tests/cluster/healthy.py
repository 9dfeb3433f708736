"""A healthy job beside a noisy neighbour, and what the daemon did about it.

Shared by tests/cluster/test_healthy_defaults.py (a short run that asserts) and
benchmarks/healthy_soak.py (a long one, past every timer, that reports).
Nothing in the job is slow: every action, page, drain, AdminComment or
incident that names a cause for a rank, node or link is a false alarm.
"""

from __future__ import annotations

import random
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .artemis import ArtemisDaemon, Mailbox
from .procs import ClusterError, wait_until
from .scenario import TrainingJob
from .slurm import SlurmCluster

# Actions that change something or tell a person; a matched probe does neither.
PAGING = ("correct", "rebalance", "drain", "requeue", "constrain", "escalate", "notify")


class NoisyNeighbour:
    """Up to ``max_hogs`` busy processes outside every job, switched on and off at seeded random times.

    Bounded: each phase lasts ``phase_s`` (a range, seconds), and ``__exit__`` kills what runs (by PID).
    """

    def __init__(self, seed: int, max_hogs: int = 2, phase_s: tuple[float, float] = (2.0, 8.0)):
        self.rng = random.Random(seed)
        self.max_hogs = max_hogs
        self.phase_s = phase_s
        self.hogs: list[subprocess.Popen] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="noisy-neighbour")
        self.phases: list[tuple[float, int]] = []

    def _set(self, count: int) -> None:
        while len(self.hogs) > count:
            hog = self.hogs.pop()
            hog.kill()
            hog.wait(timeout=10)
        while len(self.hogs) < count:
            self.hogs.append(subprocess.Popen(["sh", "-c", "while :; do :; done"]))

    def _run(self) -> None:
        while not self._stop.is_set():
            count = self.rng.randint(0, self.max_hogs)
            self._set(count)
            self.phases.append((time.monotonic(), count))
            self._stop.wait(self.rng.uniform(*self.phase_s))

    def __enter__(self) -> NoisyNeighbour:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)
        self._set(0)


@dataclass
class HealthyRun:
    """What the daemon did about one healthy job (read once the job has ended)."""

    job_id: str
    state: str
    phases: list[tuple[float, int]]
    incidents: list[dict[str, Any]] = field(default_factory=list)
    acted: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # incident -> paging actions
    mails: list[str] = field(default_factory=list)
    drained: dict[str, str] = field(default_factory=dict)
    admin_comment: str = ""

    @property
    def blamed(self) -> list[dict[str, Any]]:
        """Incidents past suspect that name a cause: a healthy job has none to name."""
        return [i for i in self.incidents if i["state"] not in ("suspect", "dismissed") and i["cause"] != "unknown"]

    @property
    def confirmed(self) -> list[dict[str, Any]]:
        return [i for i in self.incidents if i.get("confirmed_window") is not None]

    @property
    def left_open(self) -> list[dict[str, Any]]:
        return still_open(self.incidents)


def still_open(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Incidents still open although their job ended."""
    return [i for i in incidents if i["state"] not in ("resolved", "dismissed") and not i.get("ended_with_job")]


def run_healthy_job(cluster: SlurmCluster, daemon: ArtemisDaemon, mailbox: Mailbox, train_s: float,
                    seed: int | None = None, phase_s: tuple[float, float] = (2.0, 8.0)) -> HealthyRun:
    """One healthy job of ``train_s`` seconds under a ``NoisyNeighbour``, judged once it completed."""
    job = TrainingJob.submit(cluster, daemon, seconds=train_s)
    job.wait_running()
    with NoisyNeighbour(seed=int(job.job_id) if seed is None else seed, phase_s=phase_s) as load:
        # Checked while it runs: a job that ends with no open incident has its history
        # forgotten once its epilog says job_end (a healthy job with no suspect at all).
        wait_until(lambda: daemon.records_of(job.job_id) > 0, "the job's reports to reach artemisd",
                   timeout_s=train_s)
        state = cluster.wait_job(job.job_id, timeout_s=train_s + 180)
    seen = HealthyRun(job.job_id, state, load.phases)

    def of_the_job() -> list[dict[str, Any]]:
        return [i for i in daemon.incidents(everything=True) if i.get("job") == job.job_id]

    # The job's end reaches the daemon with its epilog, and its leader then asks Slurm before it
    # closes what is still open: read once that has happened (bounded; what is open after stays so).
    try:
        wait_until(lambda: not still_open(of_the_job()),
                   "the job's open incidents to end with it", timeout_s=60, interval_s=1.0)
    except ClusterError:
        pass  # judged below, with what is still open named
    seen.incidents = of_the_job()
    for incident in seen.incidents:
        detail = daemon.get(f"/v1/incidents/{incident['id']}")
        seen.acted[incident["id"]] = [(a["kind"], a["status"]) for a in detail["actions"] if a["kind"] in PAGING]
    seen.mails = mailbox.subjects()
    seen.drained = cluster.drain_reasons()
    seen.admin_comment = job.info().get("AdminComment", "").strip()
    return seen
