"""What artemisd needs from Slurm, as a protocol with plain frozen values.

Every method is blocking (the daemon calls them from a worker thread) and
raises ``SlurmError`` when Slurm cannot be reached or refuses; the caller
retries with backoff.  Methods that change state are written so that running
them twice is harmless: the actuator reads state first (``node``/``job``) and
only writes what is missing, so an action interrupted by a crash can be
re-run safely.
"""

from __future__ import annotations

import re
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


# --- what may reach Slurm ----------------------------------------------------
#
# Every value Artemis passes to a Slurm command comes, one way or another,
# from a report: a job id a user wrote, a node a probe named.  The commands
# parse their argv with getopt, where an option with an *optional* argument
# (squeue's ``--jobs``) reads a following "--iterate=1" as an option of its
# own, and where scontrol reads "NodeName=n1 n2" as a hostlist of two nodes.
# So each value is held to Slurm's own syntax for one object before any call,
# and passed as ``--opt=value`` besides: refused here, it never becomes argv.

# A job id as Slurm prints it: the job, an array task (``_N``) or a
# heterogeneous component (``+N``); uint32, no leading zeros (Slurm would read
# "0042" as job 42, and the daemon would key that answer under another id).
_JOB_ID = re.compile(r"([1-9][0-9]{0,9})(?:_(0|[1-9][0-9]{0,9})|\+(0|[1-9][0-9]{0,3}))?")
# One node or partition name (slurm.conf NodeName=/PartitionName=): no
# hostlist brackets, commas or blanks, so one name can only ever mean one node.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
# A job's feature constraint (``--constraint``): features and their operators.
_FEATURES = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:*!&|,()\[\]-]{0,1023}")
_UINT32_MAX = 0xFFFFFFFF


def job_id_problem(value: object) -> str | None:
    """Why ``value`` is not one Slurm job id, or None."""
    text = value if isinstance(value, str) else ""
    match = _JOB_ID.fullmatch(text)
    if match is None or any(int(part) > _UINT32_MAX for part in match.groups() if part is not None):
        shown = repr(value)[:40]
        return f"{shown} is not a Slurm job id (digits, with _N for an array task or +N for a het component)"
    return None


def check_job_id(value: str) -> str:
    """``value`` if it is one Slurm job id; else ``SlurmError`` (permanent), and no command runs."""
    problem = job_id_problem(value)
    if problem:
        raise SlurmError(f"job id {problem}", transient=False)
    return value


def check_name(kind: str, value: str) -> str:
    """``value`` if it is one node or partition name (``kind`` says which, for the message)."""
    if not isinstance(value, str) or _NAME.fullmatch(value) is None:
        raise SlurmError(f"{kind} {repr(value)[:40]} is not one Slurm {kind} name "
                         "(letters, digits, '.', '_', '-')", transient=False)
    return value


def check_features(value: str) -> str:
    """``value`` if it is a feature constraint Slurm can read (no blanks, '=' or leading '-')."""
    if not isinstance(value, str) or _FEATURES.fullmatch(value) is None:
        raise SlurmError(f"features {repr(value)[:40]} is not a Slurm constraint", transient=False)
    return value




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
    unlimited: bool = False  # the job has no time limit (Slurm then says it ends a year after it started)
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
        """Seconds until a running job's time limit; None: not known, or the job has none (``unlimited``:
        the year Slurm gives such a job as its end is no measure of how long it will run)."""
        if not self.running or self.unlimited or self.end_time is None or self.end_time <= 0:
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
