"""What artemisd needs from Slurm, as a protocol with plain frozen values.

Every method is blocking (the daemon calls them from a worker thread) and
raises ``SlurmError`` when Slurm cannot be reached or refuses; the caller
retries with backoff.  Methods that change state are written so that running
them twice is harmless: the actuator reads state first (``node``/``job``) and
only writes what is missing, so an action interrupted by a crash can be
re-run safely.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

# Every reason and comment Artemis writes starts with this (NHC manners): a
# drain reason without it was written by a person and is never touched.
REASON_PREFIX = "artemis:"


class SlurmError(RuntimeError):
    """A Slurm command failed; ``transient`` is True when retrying may help."""

    def __init__(self, message: str, transient: bool = True):
        super().__init__(message)
        self.transient = transient


@dataclass(frozen=True)
class NodeInfo:
    name: str
    states: frozenset[str]  # upper-case base state and flags: IDLE, ALLOCATED, DRAIN, DOWN, ...
    reason: str = ""
    partitions: tuple[str, ...] = ()

    @property
    def drained(self) -> bool:
        """Drain requested (DRAINING or DRAINED), or down: no new jobs land here."""
        return bool(self.states & {"DRAIN", "DRAINED", "DRAINING", "DOWN", "FAIL"})

    @property
    def drained_by_artemis(self) -> bool:
        return self.drained and self.reason.startswith(REASON_PREFIX)

    @property
    def drained_by_person(self) -> bool:
        return self.drained and not self.reason.startswith(REASON_PREFIX)


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    user_id: int
    state: str  # upper case: PENDING, RUNNING, COMPLETED, ...
    partition: str = ""
    nodes: tuple[str, ...] = ()
    batch: bool = True
    requeue: bool = False
    held: bool = False
    excluded_nodes: tuple[str, ...] = ()
    features: str = ""
    admin_comment: str = ""
    tasks: int | None = None  # task count Slurm gave the job; None: not known (e.g. from sacct)
    cpus: int | None = None  # CPUs allocated to the job
    end_time: float | None = None  # when a running job reaches its time limit (epoch s); None: not known
    extra: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def pending(self) -> bool:
        return self.state == "PENDING"

    @property
    def running(self) -> bool:
        return self.state in ("RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING")

    @property
    def finished(self) -> bool:
        return not (self.pending or self.running or self.state in ("REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"))

    def time_left(self, now: float) -> float | None:
        """Seconds until a running job's time limit (a job without one ends in a year, as Slurm says)."""
        if not self.running or self.end_time is None or self.end_time <= 0:
            return None
        return max(0.0, self.end_time - now)

    @property
    def max_world(self) -> int | None:
        """The most ranks this job can run: one per task (srun), or several per task
        (torchrun: one per GPU), each needing a CPU of the allocation.  None: unknown."""
        known = [n for n in (self.tasks, self.cpus) if n]
        return max(known) if known else None


class SlurmBackend(Protocol):
    def node(self, name: str) -> NodeInfo: ...

    def partition_nodes(self, partition: str) -> tuple[NodeInfo, ...]:
        """Every node of the partition with its state and reason, as Slurm has them now."""
        ...

    def job(self, job_id: str) -> JobInfo | None:
        """The job, running or finished (from the accounting database); None if Slurm never heard of it."""
        ...

    def drain(self, node: str, reason: str) -> None: ...

    def resume(self, node: str) -> None: ...

    def requeue_hold(self, job_id: str) -> None: ...

    def release(self, job_id: str) -> None: ...

    def set_excluded_nodes(self, job_id: str, nodes: tuple[str, ...]) -> None: ...

    def set_features(self, job_id: str, features: str) -> None: ...

    def set_admin_comment(self, job_id: str, comment: str, finished: bool) -> None: ...

    def uid_of(self, user: str) -> int | None: ...
