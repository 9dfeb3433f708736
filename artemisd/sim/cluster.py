"""A simulated Slurm: the ``SlurmBackend`` protocol over plain Python state.

``SimSlurm`` answers every call the daemon's ``Actuator`` and the decision
code make (``artemisd/slurm/api.py``) with the semantics design.md §5 records
for Slurm 22.05, so the closed loop (``artemisd/sim/loop.py``), ``artemis
replay --policy`` and the fleet simulation act on something that behaves like
the real controller instead of on a mock that agrees with whatever it is told:

* a node has a base state (IDLE, MIXED, ALLOCATED: from the GPUs its running
  jobs hold) and a DRAIN flag with a reason; draining does not stop the jobs
  on it (DRAINING), it only keeps new ones off;
* a reason that starts with ``artemis:`` is Artemis' (``NodeInfo.
  drained_by_artemis``); any other is a person's, and the simulation side
  (``person_drain``, ``person_resume``) writes those;
* ``requeue_hold`` works only on running requeueable batch jobs and leaves the
  job PENDING and held, its nodes freed; ``ExcNodeList`` and ``Features``
  change only while a job is pending, and a write *replaces* the old value
  (the Actuator reads and merges);
* ``release`` lifts the hold; the job starts at the next scheduling pass
  (``schedule``, run by ``advance_to``) on nodes of its partition that are not
  excluded, not drained, free, and have its features — slurmctld's next
  cycle, so a ``Features=`` written right after the release still applies;
* a finished job stays readable (sacct), and its AdminComment is stored
  lower-cased (sacctmgr 22.05 does that).

Everything is deterministic: no randomness, nodes and jobs in name order, a
clock that moves only when told (``advance_to``).  Every change is written to
a bounded event log (``events``), saying who made it: ``artemis`` for the
protocol's writes (what the daemon does), ``person`` for the simulation side's.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from artemisd.slurm.api import JobInfo, NodeInfo, SlurmError

RUNNING = "RUNNING"
PENDING = "PENDING"
FINISHED = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL"})
EVENT_LOG_SIZE = 10_000


@dataclass(frozen=True)
class SimEvent:
    """One change in the simulated cluster: when, by whom, what, on which node or job."""

    time: float
    who: str  # "artemis" (a protocol write), "person", or "slurm" (the scheduler itself)
    what: str
    target: str
    detail: str = ""

    def __str__(self) -> str:
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.time:.1f} {self.who}: {self.what} {self.target}{detail}"


@dataclass
class _Node:
    name: str
    partitions: tuple[str, ...]
    gpus: int
    features: frozenset[str]
    drain: bool = False
    down: bool = False
    reason: str = ""
    used: dict[str, int] = field(default_factory=dict)  # job -> GPUs it holds here

    def info(self) -> NodeInfo:
        held = sum(self.used.values())
        base = "IDLE" if held == 0 else ("ALLOCATED" if held >= self.gpus else "MIXED")
        states = {base}
        if self.drain:
            states.add("DRAIN")
        if self.down:
            states.add("DOWN")
        return NodeInfo(self.name, frozenset(states), self.reason if (self.drain or self.down) else "",
                        self.partitions)


@dataclass
class _Job:
    job_id: str
    user_id: int
    partition: str
    node_count: int
    gpus_per_node: int | None  # None: whole nodes
    time_limit_s: float | None
    batch: bool
    requeue: bool
    tasks: int | None
    state: str = PENDING
    held: bool = False
    nodes: tuple[str, ...] = ()
    last_nodes: tuple[str, ...] = ()  # where it ran before a requeue
    excluded: tuple[str, ...] = ()
    features: str = ""
    admin_comment: str = ""
    started_at: float | None = None
    not_before: float = 0.0
    restarts: int = 0
    ended_at: float | None = None

    def info(self) -> JobInfo:
        return JobInfo(job_id=self.job_id, user_id=self.user_id, state=self.state, partition=self.partition,
                       nodes=self.nodes, batch=self.batch, requeue=self.requeue, held=self.held,
                       excluded_nodes=self.excluded, features=self.features, admin_comment=self.admin_comment,
                       tasks=self.tasks, cpus=self.tasks, end_time=self.end_time(),
                       extra={"restarts": str(self.restarts)})

    def end_time(self) -> float | None:
        """When a running job reaches its time limit (squeue's end_time)."""
        if self.state != RUNNING or self.time_limit_s is None or self.started_at is None:
            return None
        return self.started_at + self.time_limit_s


class SimSlurm:
    """A deterministic simulated Slurm controller (see the module doc)."""

    def __init__(self, start: float = 0.0, users: dict[str, int] | None = None,
                 log_size: int = EVENT_LOG_SIZE, start_delay_s: float = 0.0):
        self._now = float(start)
        # A released job is startable this long after its release (slurmctld's cycle, a prolog).
        self.start_delay_s = float(start_delay_s)
        self._nodes: dict[str, _Node] = {}
        self._jobs: dict[str, _Job] = {}
        # Jobs not finished: what scheduling passes walk (a fleet accumulates thousands of finished ones).
        self._live: set[str] = set()
        self._users = dict(users or {})
        self._log: deque[SimEvent] = deque(maxlen=log_size)
        self.logged = 0  # events ever logged (the log keeps the last ``log_size``)

    # --- clock ------------------------------------------------------------------

    def clock(self) -> float:
        """The simulated time (s); it moves only with ``advance_to``."""
        return self._now

    def advance_to(self, now: float) -> None:
        """Move the clock forward (never back), end jobs past their time limit, run a scheduling pass."""
        self._now = max(self._now, float(now))
        for job in self._sorted_jobs():
            if job.state == RUNNING and job.time_limit_s is not None and job.started_at is not None \
                    and self._now - job.started_at >= job.time_limit_s:
                self._finish(job, "TIMEOUT", "slurm")
        self.schedule()

    # --- the simulation side ----------------------------------------------------

    def add_node(self, name: str, partitions: str | Sequence[str] = ("gpu",), gpus: int = 8,
                 features: Iterable[str] = ()) -> None:
        if name in self._nodes:
            raise ValueError(f"node {name} already exists")
        parts = (partitions,) if isinstance(partitions, str) else tuple(partitions)
        self._nodes[name] = _Node(name, parts, max(1, int(gpus)), frozenset(features))

    def add_job(self, job_id: str, nodes: Sequence[str] | int, partition: str, *, user_id: int = 1000,
                time_limit_s: float | None = None, start: float | None = None, batch: bool = True,
                requeue: bool = True, gpus_per_node: int | None = None, tasks: int | None = None,
                features: str = "") -> JobInfo:
        """A job: on the named ``nodes`` (started at ``start``, default now), or, given a count,
        pending until a scheduling pass finds that many nodes for it."""
        if job_id in self._jobs:
            raise ValueError(f"job {job_id} already exists")
        count = nodes if isinstance(nodes, int) else len(nodes)
        if count < 1:
            raise ValueError(f"job {job_id} needs at least one node")
        job = _Job(job_id, user_id, partition, count, gpus_per_node, time_limit_s, batch, requeue, tasks,
                   features=features)
        if isinstance(nodes, int):
            self._jobs[job_id] = job
            self._live.add(job_id)
            self._event("slurm", "submit", job_id, f"{count} node(s) in {partition}")
            self.schedule()
            return job.info()
        names = tuple(nodes)
        for name in names:
            node = self._node(name)
            if partition not in node.partitions:
                raise ValueError(f"node {name} is not in partition {partition}")
            if node.drain or node.down:
                raise ValueError(f"node {name} is drained ({node.reason!r}): Slurm starts no job there")
            if self._free_gpus(node) < self._need(job, node):
                raise ValueError(f"node {name} has no free GPUs for job {job_id}")
        self._jobs[job_id] = job
        self._live.add(job_id)
        self._start(job, names, self._now if start is None else float(start))
        return job.info()

    def end_job(self, job_id: str, state: str = "COMPLETED") -> None:
        """The job ends (its nodes are freed); ending a job that is not running changes nothing."""
        job = self._jobs.get(job_id)
        if job is None:
            raise KeyError(job_id)
        if job.state in FINISHED:
            return
        self._finish(job, state, "slurm")
        self.schedule()

    def person_drain(self, node: str, reason: str) -> None:
        """A person's ``scontrol update NodeName=… State=DRAIN Reason=…``."""
        n = self._node(node)
        n.drain, n.reason = True, reason
        self._event("person", "drain", node, reason)

    def person_resume(self, node: str) -> None:
        """A person's ``scontrol update NodeName=… State=RESUME``: whoever drained it."""
        n = self._node(node)
        n.drain, n.down, n.reason = False, False, ""
        self._event("person", "resume", node)
        self.schedule()

    def person_down(self, node: str, reason: str) -> None:
        """The node fails (or a person sets it DOWN): its jobs end NODE_FAIL, Slurm requeues none here."""
        n = self._node(node)
        n.down, n.reason = True, reason
        self._event("person", "down", node, reason)
        for job_id in sorted(n.used):
            self._finish(self._jobs[job_id], "NODE_FAIL", "slurm")

    def time_left_s(self, job_id: str) -> float | None:
        """Until the job's time limit (None: no limit, or not running)."""
        job = self._jobs.get(job_id)
        if job is None or job.state != RUNNING or job.time_limit_s is None or job.started_at is None:
            return None
        return max(0.0, job.time_limit_s - (self._now - job.started_at))

    def restarts(self, job_id: str) -> int:
        """How often the job was requeued (0: still its first run)."""
        return self._jobs[job_id].restarts

    def nodes(self) -> tuple[NodeInfo, ...]:
        return tuple(self._nodes[n].info() for n in sorted(self._nodes))

    def jobs(self) -> tuple[JobInfo, ...]:
        """Every job, finished ones too, in job id order."""
        return tuple(self._jobs[j].info() for j in sorted(self._jobs, key=_job_key))

    def events(self) -> list[SimEvent]:
        """The last events (bounded), oldest first."""
        return list(self._log)

    # --- SlurmBackend: reads -----------------------------------------------------

    def node(self, name: str) -> NodeInfo:
        return self._node(name).info()

    def partition_nodes(self, partition: str) -> tuple[NodeInfo, ...]:
        return tuple(self._nodes[n].info() for n in sorted(self._nodes) if partition in self._nodes[n].partitions)

    def job(self, job_id: str) -> JobInfo | None:
        job = self._jobs.get(job_id)
        return job.info() if job is not None else None

    def uid_of(self, user: str) -> int | None:
        if user in self._users:
            return self._users[user]
        return int(user) if user.isdigit() else None

    # --- SlurmBackend: writes (Artemis') ----------------------------------------------

    def drain(self, node: str, reason: str) -> None:
        n = self._node(node)
        n.drain, n.reason = True, reason
        self._event("artemis", "drain", node, reason)

    def resume(self, node: str) -> None:
        n = self._node(node)
        n.drain, n.reason = False, ""
        self._event("artemis", "resume", node)
        self.schedule()

    def requeue_hold(self, job_id: str) -> None:
        job = self._job(job_id)
        if job.state in FINISHED:
            raise SlurmError(f"scontrol requeuehold {job_id}: Job is already completing or completed",
                             transient=False)
        if not job.batch:
            raise SlurmError(f"scontrol requeuehold {job_id}: Only batch jobs are accepted or processed",
                             transient=False)
        if not job.requeue:
            raise SlurmError(f"scontrol requeuehold {job_id}: Requested operation is presently disabled",
                             transient=False)
        if job.state == RUNNING:
            self._free(job)
            job.restarts += 1
            job.last_nodes, job.nodes = job.nodes, ()
        job.state, job.held, job.started_at = PENDING, True, None
        self._event("artemis", "requeuehold", job_id)

    def release(self, job_id: str) -> None:
        job = self._job(job_id)
        if job.state != PENDING:
            raise SlurmError(f"scontrol release {job_id}: Job is no longer pending execution", transient=False)
        job.held = False
        job.not_before = self._now + self.start_delay_s
        self._event("artemis", "release", job_id)

    def set_excluded_nodes(self, job_id: str, nodes: tuple[str, ...]) -> None:
        job = self._pending(job_id)
        job.excluded = tuple(dict.fromkeys(nodes))
        self._event("artemis", "exclude", job_id, ",".join(job.excluded))

    def set_features(self, job_id: str, features: str) -> None:
        job = self._pending(job_id)
        _features_match(features, frozenset())  # refuse what Slurm would refuse
        job.features = features
        self._event("artemis", "features", job_id, features)

    def set_admin_comment(self, job_id: str, comment: str, finished: bool) -> None:
        job = self._job(job_id)
        job.admin_comment = comment.lower() if finished else comment
        self._event("artemis", "admin_comment", job_id, comment[:120])

    # --- scheduler ------------------------------------------------------------------

    def schedule(self) -> list[str]:
        """One scheduling pass: start every released pending job that fits (job id order); the started ids."""
        started = []
        for job in self._sorted_jobs():
            if job.state != PENDING or job.held or job.not_before > self._now:
                continue
            nodes = self._fit(job)
            if nodes is not None:
                self._start(job, nodes, self._now)
                started.append(job.job_id)
        return started

    def _fit(self, job: _Job) -> tuple[str, ...] | None:
        # The nodes it ran on come first (a requeued job that excluded one node keeps the others).
        ran = [n for n in job.last_nodes if n in self._nodes]
        order = ran + [n for n in sorted(self._nodes) if n not in ran]
        chosen = []
        for name in order:
            node = self._nodes[name]
            if job.partition not in node.partitions or node.drain or node.down or name in job.excluded:
                continue
            if not _features_match(job.features, node.features) or self._free_gpus(node) < self._need(job, node):
                continue
            chosen.append(name)
            if len(chosen) == job.node_count:
                return tuple(chosen)
        return None

    # --- plumbing -------------------------------------------------------------------

    def _start(self, job: _Job, nodes: tuple[str, ...], at: float) -> None:
        for name in nodes:
            node = self._nodes[name]
            node.used[job.job_id] = self._need(job, node)
        job.nodes, job.state, job.started_at, job.ended_at = nodes, RUNNING, at, None
        what = "start" if job.restarts == 0 else f"restart {job.restarts}"
        self._event("slurm", what, job.job_id, ",".join(nodes))

    def _finish(self, job: _Job, state: str, who: str) -> None:
        self._free(job)
        self._live.discard(job.job_id)
        job.state, job.held, job.ended_at = state, False, self._now
        self._event(who, "end", job.job_id, state)

    def _free(self, job: _Job) -> None:
        for name in job.nodes:
            node = self._nodes.get(name)
            if node is not None:
                node.used.pop(job.job_id, None)

    def _need(self, job: _Job, node: _Node) -> int:
        return node.gpus if job.gpus_per_node is None else min(node.gpus, job.gpus_per_node)

    @staticmethod
    def _free_gpus(node: _Node) -> int:
        return node.gpus - sum(node.used.values())

    def _node(self, name: str) -> _Node:
        node = self._nodes.get(name)
        if node is None:
            raise SlurmError(f"scontrol update NodeName={name}: Invalid node name specified", transient=False)
        return node

    def _job(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise SlurmError(f"scontrol {job_id}: Invalid job id specified", transient=False)
        return job

    def _pending(self, job_id: str) -> _Job:
        job = self._job(job_id)
        if job.state != PENDING:
            raise SlurmError(f"scontrol update JobId={job_id}: Job is no longer pending execution",
                             transient=False)
        return job

    def _sorted_jobs(self) -> list[_Job]:
        """The jobs not finished, in job id order."""
        return [self._jobs[j] for j in sorted(self._live, key=_job_key)]

    def _event(self, who: str, what: str, target: str, detail: str = "") -> None:
        self._log.append(SimEvent(self._now, who, what, target, detail))
        self.logged += 1


def _job_key(job_id: str) -> tuple[int, int | str]:
    return (0, int(job_id)) if job_id.isdigit() else (1, job_id)


_TOKEN = re.compile(r"\s*([A-Za-z0-9_.:-]+|[&|()])")


def _features_match(expression: str, features: frozenset[str]) -> bool:
    """Does a node with ``features`` satisfy ``expression`` (names, ``&``, ``|``, parentheses)?

    ``&`` binds tighter than ``|``, as in Slurm's ``--constraint``.  A
    malformed expression raises ``SlurmError`` (Slurm: "Invalid feature
    specification").
    """
    text = expression.strip()
    if not text or text == "(null)":
        return True
    tokens: list[str] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise SlurmError(f"Invalid feature specification: {expression!r}", transient=False)
        tokens.append(m.group(1))
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1

    def alternatives(i: int) -> tuple[bool, int]:
        value, i = conjunction(i)
        while i < len(tokens) and tokens[i] == "|":
            right, i = conjunction(i + 1)
            value = value or right
        return value, i

    def conjunction(i: int) -> tuple[bool, int]:
        value, i = atom(i)
        while i < len(tokens) and tokens[i] == "&":
            right, i = atom(i + 1)
            value = value and right
        return value, i

    def atom(i: int) -> tuple[bool, int]:
        if i >= len(tokens):
            raise SlurmError(f"Invalid feature specification: {expression!r}", transient=False)
        if tokens[i] == "(":
            value, i = alternatives(i + 1)
            if i >= len(tokens) or tokens[i] != ")":
                raise SlurmError(f"Invalid feature specification: {expression!r}", transient=False)
            return value, i + 1
        if tokens[i] in "&|)":
            raise SlurmError(f"Invalid feature specification: {expression!r}", transient=False)
        return tokens[i] in features, i + 1

    value, end = alternatives(0)
    if end != len(tokens):
        raise SlurmError(f"Invalid feature specification: {expression!r}", transient=False)
    return value
