"""The incident: what Artemis concluded, why, what it did and what came of it.

This is the output contract of the daemon and of ``artemis replay --json``
(design.md §4).  Field names and meanings are fixed.

Measures, per step, of the incident's subject against the median of its island
peers in the windows that confirmed it:

* ``ratio``      busy(subject) / median busy(peers).  1.0 = as fast as its peers;
                 1.19 = 19 % slower.  For job-, link- and island-wide incidents
                 (no peers to compare with) it is busy or step time against the
                 job's own healthy baseline.
* ``excess_ms``  busy(subject) - median busy(peers), milliseconds per step: how
                 long every other rank waits for the subject at each step.
* ``loss_pct``   100 * excess_ms / step_ms: the share of the whole job's
                 throughput lost to the subject.
* ``measured_loss_pct``  (additive) 100 * (1 - slowed / healthy): the share
                 of the job's samples/s actually lost, from the job's own
                 throughput (``loss.measured_loss``): healthy = median of the
                 last windows before the onset, slowed = the samples over the
                 seconds from the onset to confirmation (``loss.during``).  When it and ``loss_pct`` disagree by more
                 than ``loss.LOSS_TOLERANCE_PCT`` points, a ``samples_per_s``
                 evidence line says why.  Both are 0..100.
* ``confidence`` 0..1, how strongly the evidence supports ``cause``; below
                 the configured floor the cause is reported as ``unknown``.
* ``ended_with_job`` (additive) the job ended while the incident was still
                 open: when, in what state, Slurm's word on the job, and
                 whether a person who had been paged was told
                 (``EndedWithJob``).  Absent otherwise.
* ``recurrences`` (additive) each time the subject recovered and was confirmed
                 again within ``RecurWindows`` (an intermittent fault that
                 comes back): when, and how slow that time.  The onset,
                 flagged and confirmed windows stay the first occurrence's;
                 ratio, excess, loss, cause and evidence are the latest's.

In an island of two ranks (a 2-rank job, or a pair of one make in a mixed job)
the peers of a rank are the other rank: ``ratio`` = busy / the other rank's
busy, ``excess_ms`` = busy − the other rank's busy.  Such a rank is flagged
from its own history and the wait it causes the other (detect.py, rule 3).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class IncidentKind(StrEnum):
    RANK = "rank"
    NODE = "node"
    LINK = "link"
    ISLAND = "island"
    JOB = "job"  # whole-job slowdown against its own history
    CHANGE = "change"


class Cause(StrEnum):
    GPU_THERMAL = "gpu.thermal"
    GPU_POWER = "gpu.power"
    GPU_CLOCKS = "gpu.clocks"
    COMM_LINK = "comm.link"
    COMM_ISLAND = "comm.island"
    HOST_CPU = "host.cpu"
    INPUT_LOADER = "input.loader"
    INPUT_STORAGE = "input.storage"
    CHANGE_DRIVER = "change.driver"
    CHANGE_COMM_LIB = "change.comm_lib"
    CHANGE_CONFIG = "change.config"
    UNKNOWN = "unknown"


class IncidentState(StrEnum):
    """Life cycle of an incident.

    Allowed transitions (``TRANSITIONS``)::

        suspect   -> confirmed | dismissed
        confirmed -> acting | escalated | resolved | unresolved
        acting    -> verifying | escalated | unresolved
        verifying -> resolved | unresolved
        escalated -> acting | resolved | unresolved | dismissed
        unresolved -> acting | escalated | resolved

    ``dismissed`` and ``resolved`` are final.  A confirmed incident may resolve
    without an action when the slowdown ends by itself (recorded as such), and
    an unresolved one may be retried with the next action the policy allows.
    """

    SUSPECT = "suspect"
    CONFIRMED = "confirmed"
    ACTING = "acting"
    VERIFYING = "verifying"
    RESOLVED = "resolved"
    UNRESOLVED = "unresolved"
    DISMISSED = "dismissed"
    ESCALATED = "escalated"


S = IncidentState
TRANSITIONS: dict[IncidentState, frozenset[IncidentState]] = {
    S.SUSPECT: frozenset({S.CONFIRMED, S.DISMISSED}),
    S.CONFIRMED: frozenset({S.ACTING, S.ESCALATED, S.RESOLVED, S.UNRESOLVED}),
    S.ACTING: frozenset({S.VERIFYING, S.ESCALATED, S.UNRESOLVED}),
    S.VERIFYING: frozenset({S.RESOLVED, S.UNRESOLVED}),
    S.ESCALATED: frozenset({S.ACTING, S.RESOLVED, S.UNRESOLVED, S.DISMISSED}),
    S.UNRESOLVED: frozenset({S.ACTING, S.ESCALATED, S.RESOLVED}),
    S.RESOLVED: frozenset(),
    S.DISMISSED: frozenset(),
}
del S


class IllegalTransition(RuntimeError):
    def __init__(self, incident_id: str, current: IncidentState, wanted: IncidentState):
        super().__init__(f"{incident_id}: cannot go from {current.value} to {wanted.value}")
        self.current = current
        self.wanted = wanted


def check_transition(incident_id: str, current: IncidentState, wanted: IncidentState) -> None:
    if wanted not in TRANSITIONS[current]:
        raise IllegalTransition(incident_id, current, wanted)


def _without_unset(out: dict[str, Any], key: str) -> dict[str, Any]:
    # Readers written before an additive field existed compare what they read as it was: no key when unset.
    if out.get(key) is None:
        out.pop(key, None)
    return out


class Evidence(BaseModel):
    """One measurement behind a conclusion: the subject's value against its peers'.

    ``signal`` names what was measured (a wire field such as ``sm_clock_mhz`` or
    ``ms.data``, or ``missing`` for evidence that was needed but absent).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    signal: str
    value: Any = None
    peers: Any = None
    note: str = ""


ActionKind = Literal[
    "none", "rebalance", "correct", "drain", "requeue", "constrain", "escalate", "recommend"
]
ActionStatus = Literal[
    "proposed", "pending_approval", "denied", "refused", "running", "done", "failed", "rolled_back", "skipped"
]


class Action(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: ActionKind
    target: str | None = None
    status: ActionStatus = "proposed"
    reversible: bool = False
    # Additive (design.md §4): what refused it (a budget, a rule), or why it was done as it was.
    reason: str | None = None

    @model_serializer(mode="wrap")
    def _without_empty_reason(self, handler):
        return _without_unset(handler(self), "reason")


class Result(BaseModel):
    """Useful throughput (samples/s of the whole job): healthy, slowed, after the action.

    One definition of each, used by every view (``artemis show``, audit, mail):

    * ``throughput_healthy`` (additive): the job's healthy throughput, median of
      its last windows before the onset (``loss.baseline``);
    * ``throughput_before``: the *slowed* throughput, the job's samples over its
      seconds from the onset up to the action (``loss.during``: each window
      weighs what it lasted), frozen when the action completes;
    * ``throughput_after``: median of ``VerifyWindows`` steady windows after the
      action (``verify.verify``).

    * ``throughput_expected`` (additive): what a healthy job makes at the
      machine's pace during verification (``throughput_healthy`` x the job's
      fast ranks' healthy busy time / their busy time then); null for a
      job-wide subject, judged against ``throughput_healthy`` as it was.

    ``recovered`` <=> after >= RecoveryFraction x expected (healthy where
    expected is null; artemis.conf).  ``recovered_after_load_correction``
    (additive): recovered only at the machine's pace, after being below
    RecoveryFraction x healthy as it was — a person reading ``recovered:
    true`` at half speed is told it rests on the load correction.
    ``recovered_within_noise`` (additive): recovered although after stayed
    below the bar, by less than the windows' own scatter can tell from a full
    recovery after ``verify.VERIFY_SPAN_CAP`` x VerifyWindows windows.  The
    result is set (after and recovered still null) once the action
    completes, and completed by verification.
    """

    model_config = ConfigDict(extra="forbid")

    throughput_healthy: float | None = None
    throughput_before: float | None = None
    throughput_after: float | None = None
    throughput_expected: float | None = None
    recovered: bool | None = None
    recovered_after_load_correction: bool | None = None
    recovered_within_noise: bool | None = None

    def describe(self) -> str:
        """One line, the same in ``artemis show`` and in mail: healthy, slowed, after."""
        def num(value: float | None) -> str:
            return "-" if value is None else f"{value:.1f}"

        line = (f"throughput (samples/s): healthy {num(self.throughput_healthy)}, "
                f"slowed {num(self.throughput_before)}, after {num(self.throughput_after)}")
        if self.throughput_after is not None and self.throughput_healthy:
            line += f" ({100.0 * self.throughput_after / self.throughput_healthy:.0f} % of healthy)"
        if self.throughput_after is not None and self.throughput_expected:
            line += (f", expected at the machine's pace then {self.throughput_expected:.1f} "
                     f"({100.0 * self.throughput_after / self.throughput_expected:.0f} %)")
        judged = self.recovered is not None or self.throughput_after is not None
        line += f"; recovered {self.recovered if judged else 'not yet judged'}"
        if self.recovered and self.recovered_after_load_correction:
            line += " only after the load correction: below the healthy throughput as it was"
        if self.recovered and self.recovered_within_noise:
            line += " within the noise: below the bar by less than the windows scatter"
        return line


class Recurrence(BaseModel):
    """The subject was healthy, then slow again and confirmed again: one more occurrence of the same fault.

    ``confirmed_window`` is set by the analyzer for every recurrence it records
    (a recurrence that never confirmed is not one); it is optional so that a
    record written by other means still parses.
    """

    model_config = ConfigDict(extra="forbid")

    onset_window: int
    confirmed_window: int | None = None
    ratio: float | None = None
    loss_pct: float | None = None


class EndedWithJob(BaseModel):
    """(additive) The job ended while the incident was still open, and it closed with it.

    Slurm said the job had ended (``job_state``: its state then, e.g.
    ``COMPLETED``, ``TIMEOUT``; null where Slurm no longer knew the job) at
    ``at``, while the incident was ``state_before``.  Nothing more is decided
    or done about it; its ``state`` says how far it got (``unresolved``: the
    fault was never shown gone; ``dismissed``: it was never confirmed).
    ``person_told``: a person had been paged about it (escalation mail or
    AdminComment) and was mailed that it ended with its job.
    """

    model_config = ConfigDict(extra="forbid")

    at: float
    state_before: IncidentState
    job_state: str | None = None
    person_told: bool = False


class Incident(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    id: str
    job: str
    kind: IncidentKind
    state: IncidentState = IncidentState.SUSPECT
    rank: int | None = None
    node: str | None = None
    island: str | None = None
    link: str | None = None
    onset_window: int | None = None
    flagged_window: int | None = None
    confirmed_window: int | None = None
    ratio: float | None = None
    excess_ms: float | None = None
    loss_pct: float | None = None
    measured_loss_pct: float | None = None
    cause: Cause = Cause.UNKNOWN
    confidence: float = Field(default=0.0, ge=0.0, le=1.0)
    evidence: list[Evidence] = Field(default_factory=list)
    action: Action | None = None
    result: Result | None = None
    recurrences: list[Recurrence] = Field(default_factory=list)
    ended_with_job: EndedWithJob | None = None

    @model_serializer(mode="wrap")
    def _without_open_end(self, handler):
        return _without_unset(handler(self), "ended_with_job")

    def advance(self, wanted: IncidentState) -> None:
        """Move along the life cycle; an illegal transition raises IllegalTransition."""
        check_transition(self.id, self.state, wanted)
        self.state = wanted

    def to_json(self) -> str:
        return self.model_dump_json()

    def contract_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
