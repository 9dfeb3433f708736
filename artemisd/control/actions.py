"""The action table: every kind of action Artemis takes, what it is, and how its rows move.

One table, read by everything that needs to know a kind's nature: the policy
vocabulary (``config``), what counts as a hard action (``policy``), what is
reversible and how verification undoes it (``decide``, ``verify``), what still
runs after a job ended, what counts toward a cooldown or a drain budget, the
stores' SQL, and the simulated cluster's physics (which causes a kind fixes).
Changing a rung's nature is a change to this file; its behaviour lives in
``decide`` (when), the actuator (how) and the daemon's apply (what is written).

Statuses are those of an action row (the incident contract's ``action.status``
plus ``queued``).  ``NEXT`` is the row's life cycle; the stores refuse an update
that does not follow it (``came_from``), so no path, however reached, can run a
denied drain or mark a rolled-back one done.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from artemisd.incident import Cause


class ActionKind(StrEnum):
    REBALANCE = "rebalance"
    CORRECT = "correct"
    DRAIN = "drain"
    REQUEUE = "requeue"
    CONSTRAIN = "constrain"
    ESCALATE = "escalate"
    UNDRAIN = "undrain"
    NOTIFY = "notify"


class ActionStatus(StrEnum):
    PROPOSED = "proposed"  # planned only (replay, DryRun): never a row
    REFUSED = "refused"  # planned only: policy or a budget refused the rung
    PENDING_APPROVAL = "pending_approval"
    DENIED = "denied"
    QUEUED = "queued"
    RUNNING = "running"  # intent recorded, result not yet: re-run through the idempotent path after a crash
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"
    ROLLED_BACK = "rolled_back"


K, St = ActionKind, ActionStatus


@dataclass(frozen=True)
class KindRule:
    """What one kind of action is.

    ``rung``: a site policy names it (``Auto=``, ``Approve=``); the others are
    the daemon's own follow-ups.  ``reversible``: verification undoes it when
    throughput did not come back, ``undone_by`` says how (a reset rebalance
    directive, an undrain).  ``hard``: it moves a job or a node, and needs the
    node's own root-side evidence to agree (``policy.corroborated``).
    ``on_target``: it acts on its target, so it starts that target's cooldown
    (mail and AdminComment do not).  ``after_job_end``: still due once the job
    ended (undoing a drain, telling people).  ``fixes``: the causes it removes
    when it works (the simulated cluster's physics, and a rung's price).
    """

    rung: bool
    reversible: bool = False
    undone_by: ActionKind | None = None
    hard: bool = False
    on_target: bool = True
    after_job_end: bool = False
    fixes: frozenset[Cause] = frozenset()


C = Cause
TABLE: dict[ActionKind, KindRule] = {
    K.REBALANCE: KindRule(rung=True, reversible=True, undone_by=K.REBALANCE,
                          fixes=frozenset({C.HOST_CPU, C.INPUT_LOADER})),
    # A correction restores a device's defaults (clocks, power limit): there is nothing to undo.
    K.CORRECT: KindRule(rung=True, fixes=frozenset({C.GPU_CLOCKS, C.GPU_POWER})),
    K.DRAIN: KindRule(rung=True, reversible=True, undone_by=K.UNDRAIN, hard=True,
                      fixes=frozenset({C.GPU_CLOCKS, C.GPU_POWER, C.GPU_THERMAL, C.COMM_LINK})),
    K.REQUEUE: KindRule(rung=True, hard=True,
                        fixes=frozenset({C.GPU_CLOCKS, C.GPU_POWER, C.GPU_THERMAL, C.COMM_LINK, C.HOST_CPU})),
    K.CONSTRAIN: KindRule(rung=True),
    K.ESCALATE: KindRule(rung=True, on_target=False),
    K.UNDRAIN: KindRule(rung=False, after_job_end=True),
    K.NOTIFY: KindRule(rung=False, on_target=False, after_job_end=True),
}

# An action row's life cycle: status -> the statuses it may move to.
NEXT: dict[ActionStatus, frozenset[ActionStatus]] = {
    St.PENDING_APPROVAL: frozenset({St.QUEUED, St.DENIED, St.SKIPPED}),
    # skipped: the kill switch, the job ended first; failed: the incident vanished.
    St.QUEUED: frozenset({St.RUNNING, St.SKIPPED, St.FAILED}),
    # running again: a retry after a transient error; queued: a correction whose intent was
    # recorded but never queued (a crash between the two) is queued again.
    St.RUNNING: frozenset({St.RUNNING, St.QUEUED, St.DONE, St.FAILED, St.SKIPPED}),
    St.DONE: frozenset({St.ROLLED_BACK}),
    St.DENIED: frozenset(), St.FAILED: frozenset(), St.SKIPPED: frozenset(), St.ROLLED_BACK: frozenset(),
    St.PROPOSED: frozenset(), St.REFUSED: frozenset(),
}

# Rows in these statuses are not over: the turn runs them (``due``), or they wait for a person.
IN_FLIGHT = frozenset({St.QUEUED, St.RUNNING})
OPEN = IN_FLIGHT | {St.PENDING_APPROVAL}
# What a drain budget counts: drains waiting, in flight, or performed (each within its hour).
PERFORMED = frozenset({St.DONE, St.ROLLED_BACK})
BUDGETED = OPEN | PERFORMED
# Rows that never acted on their target: they start no cooldown.
NEVER_ACTED = frozenset({St.DENIED, St.SKIPPED, St.PROPOSED, St.REFUSED})

RUNGS: tuple[str, ...] = tuple(k.value for k, rule in TABLE.items() if rule.rung)
HARD: frozenset[str] = frozenset(k.value for k, rule in TABLE.items() if rule.hard)
# Kinds that run however the kill switch is set: they tell people, they do not touch Slurm's state.
TELL: frozenset[str] = frozenset(k.value for k, rule in TABLE.items() if not rule.on_target)
STILL_DUE_AFTER_THE_JOB: frozenset[str] = frozenset(k.value for k, rule in TABLE.items() if rule.after_job_end)


def rule(kind: str) -> KindRule:
    """The rule of ``kind`` (a ``ValueError`` naming it when it is no kind of action)."""
    return TABLE[ActionKind(kind)]


def reversible(kind: str) -> bool:
    """Whether verification undoes ``kind`` when it did not help; an unknown kind (``none``,
    ``recommend`` in the incident contract) is not."""
    try:
        return rule(kind).reversible
    except ValueError:
        return False


def came_from(status: str) -> tuple[str, ...]:
    """The statuses a row may be in to move to ``status`` (the stores' guard on an update)."""
    target = ActionStatus(status)
    return tuple(sorted(s.value for s, nxt in NEXT.items() if target in nxt))


def sql_list(values: Iterable[str]) -> str:
    """Statuses or kinds of this table as an SQL list literal (its fixed vocabulary, never user input)."""
    vocabulary = {*ActionStatus, *ActionKind}
    values = sorted(str(v) for v in values)
    unknown = [v for v in values if v not in vocabulary]
    if unknown:
        raise ValueError(f"not a status or kind of the action table: {unknown}")
    return "(" + ", ".join(f"'{v}'" for v in values) + ")"


# The SQL both stores use, from this table.
SQL_DUE = sql_list(IN_FLIGHT)
SQL_BUDGETED = sql_list(BUDGETED)
SQL_NEVER_ACTED = sql_list(NEVER_ACTED)
SQL_TELL = sql_list(TELL)
