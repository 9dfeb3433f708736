"""The closed loop, in memory: the daemon's decisions and actuator against a simulated Slurm.

``Loop`` is what ``artemisd/service.py`` does with an incident once the
analysis confirmed it — decide, act, verify, roll back, take the next rung —
with the daemon's storage and I/O replaced by plain Python lists and a
``SimSlurm``.  The decisions are the daemon's own pure code
(``decide.plan``, ``decide.after_drain``, ``decide.after_requeue``,
``decide.drain_budget``, ``verify.verdict``), and drains, requeues,
constraints and undrains go through the real ``act.Actuator``, so what a
fleet simulation or ``artemis replay --policy`` scores is what the daemon
would do, NHC manners and budgets included.

What the daemon does over time (a queued action run on the next turn, a
correction the node check reports back) happens here at once: an action is
performed in the tick (or the approval) that decided it.  Corrections and
rebalances change nothing in Slurm; ``on_action`` lets the simulation apply
their physical effect (and any action's), and may answer a correction's or
rebalance's ``Outcome``.  Time is the caller's: ``now`` is passed in, and
the Loop never moves the SimSlurm's clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from artemisd import decide, policy, verify
from artemisd.act import Actuator, Outcome
from artemisd.config import Config
from artemisd.incident import Action, Incident, IncidentState, Result
from artemisd.slurm.api import NodeInfo, SlurmBackend, SlurmError

S = IncidentState
# The daemon's (service.VERIFY_SILENCE_S): a verifying job silent this long is judged unmeasurable.
VERIFY_SILENCE_S = 3600.0
DECIDABLE = (S.CONFIRMED, S.UNRESOLVED, S.ESCALATED)
FINAL = (S.RESOLVED, S.DISMISSED)
OPEN = ("queued", "running")
# Rows the drain budget counts (store.drain_actions).
BUDGET_STATUSES = ("pending_approval", "queued", "running", "done", "rolled_back")
AUTO_APPROVER = "approve-all"

OnAction = Callable[[str, str | None, dict[str, Any], Incident], Outcome | None]


@dataclass
class ActionRow:
    """One action, as the daemon's ``actions`` table holds it."""

    id: int
    incident: str
    kind: str
    target: str | None
    params: dict[str, Any]
    status: str
    created: float
    approved_at: float | None = None
    approved_by: str | None = None
    detail: str = ""


@dataclass(frozen=True)
class Note:
    """One audit line."""

    time: float
    incident: str | None
    who: str
    what: str
    why: str = ""
    result: str = ""

    def __str__(self) -> str:
        why = f" — {self.why}" if self.why else ""
        result = f" → {self.result}" if self.result else ""
        return f"{self.who}: {self.what}{why}{result}"


@dataclass(frozen=True)
class Refusal:
    """A drain the budget refused: when deciding (``at`` "decide") or when a person approved it ("approve")."""

    time: float
    incident: str
    kind: str
    target: str | None
    why: str
    at: str


@dataclass
class Tracked:
    """One incident and what the loop knows of it (the daemon's ``StoredIncident``)."""

    inc: Incident
    opened_at: float
    step: str = "0"
    plan_step: int = 0
    decide: bool = False
    gpus: int | None = None
    time_left: tuple[float, float] | None = None  # (when observed, seconds left then)
    node_evidence: tuple[float, dict[str, Any]] | None = None
    gpu: int | None = None
    rebalance_opt_in: bool = False
    measured_loss_pct: float | None = None
    acted_at: float | None = None
    held_noted: bool = False
    not_back_noted: bool = False
    plans: list[decide.Plan] = field(default_factory=list)
    escalations: list[str] = field(default_factory=list)


class Loop:
    """The daemon's loop over a ``SlurmBackend`` (a ``SimSlurm``), in memory; see the module doc."""

    def __init__(self, config: Config, slurm: SlurmBackend, approve_all: bool = False,
                 on_action: OnAction | None = None, silence_s: float = VERIFY_SILENCE_S):
        self.config = config
        self.slurm = slurm
        self.actuator = Actuator(slurm)
        self.approve_all = approve_all
        self.on_action = on_action
        self.silence_s = silence_s
        self._tracked: dict[str, Tracked] = {}
        # Incidents not closed, in the order seen: what a tick walks (closed ones leave it lazily).
        self._open: dict[str, Tracked] = {}
        self._rows: list[ActionRow] = []
        self._notes: list[Note] = []
        self._refusals: list[Refusal] = []
        self._node_evidence: dict[str, tuple[float, dict[str, Any]]] = {}

    # --- input ---------------------------------------------------------------------------

    def observe(self, inc: Incident, now: float, *, gpus: int | None = None, time_left_s: float | None = None,
                node_evidence: tuple[float, dict[str, Any]] | None = None, gpu: int | None = None,
                rebalance_opt_in: bool = False, measured_loss_pct: float | None = None,
                step: str = "0") -> None:
        """An incident from the analysis, new or updated (the daemon's ``_publish``).

        The analysis owns suspect → confirmed | dismissed and the analysis
        fields; from confirmed on the loop owns the state.  A confirmed
        incident becomes decidable.  ``None`` for a fact keeps what was known.
        """
        t = self._tracked.get(inc.id)
        if t is None:
            if inc.state is S.DISMISSED:
                return
            t = Tracked(inc.model_copy(deep=True), now, step=step)
            self._tracked[inc.id] = t
            self._open[inc.id] = t
            if t.inc.state is S.CONFIRMED:
                self._confirmed(t, now)
        else:
            told, seen = _diagnosis(t.inc), len(t.inc.recurrences)
            for key, value in inc.model_dump(exclude={"id", "state", "action", "result"}).items():
                setattr(t.inc, key, value)
            if len(t.inc.recurrences) > seen and inc.state is S.CONFIRMED:
                self._recurred(t, now)
            if _diagnosis(t.inc) != told and t.inc.state in (S.ESCALATED, S.UNRESOLVED) and not any(
                    r.status in (*OPEN, "pending_approval") for r in self._rows_of(inc.id)):
                # The person was told one cause and the analysis now names another: decide afresh.
                t.decide, t.plan_step = True, 0
                self._note(now, inc.id, "analyzer", "diagnosis changed",
                           f"was {told[1]} {told[0]}; now {t.inc.cause.value}")
            if t.inc.state is S.SUSPECT and inc.state in (S.CONFIRMED, S.DISMISSED):
                t.inc.advance(inc.state)
                if inc.state is S.CONFIRMED:
                    self._confirmed(t, now)
            if t.inc.action is None or (t.inc.action.status == "proposed" and t.plan_step == 0):
                t.inc.action = inc.action
        if gpus is not None:
            t.gpus = gpus
        if time_left_s is not None:
            t.time_left = (now, time_left_s)
        if node_evidence is not None:
            t.node_evidence = node_evidence
        if gpu is not None:
            t.gpu = gpu
        t.rebalance_opt_in = t.rebalance_opt_in or rebalance_opt_in
        if measured_loss_pct is not None:
            t.measured_loss_pct = measured_loss_pct

    def _recurred(self, t: Tracked, now: float) -> None:
        """The subject recovered and was confirmed slow again: the same incident, one more recurrence.

        As the daemon does (``Daemon._recurred``, ``Ledger.reopen``): a resolved
        incident is reopened and decided again from the start of its ladder
        (``decide.plan`` sends it to a person once ``RecurEscalate`` recurrences
        say the fix does not hold); one still open that waits for a person or
        a next rung is decided again.
        """
        inc = t.inc
        latest = inc.recurrences[-1]
        why = (f"recurrence {len(inc.recurrences)}: slow again from window {latest.onset_window}, confirmed at "
               f"{latest.confirmed_window}" + (f", {latest.ratio:.2f}x" if latest.ratio is not None else ""))
        t.held_noted = t.not_back_noted = False
        self._note(now, inc.id, "analyzer", "recurred", why)
        if inc.state is S.RESOLVED:
            # The one way out of resolved (the life cycle has no transition for it).
            inc.state = S.CONFIRMED
            inc.action, inc.result = None, None
            t.decide, t.plan_step, t.acted_at = True, 0, None
            self._open[inc.id] = t
            return
        if inc.state in DECIDABLE and not any(r.status in (*OPEN, "pending_approval") for r in self._rows_of(inc.id)):
            t.decide = True

    def node_event(self, node: str, received: float, body: dict[str, Any]) -> None:
        """A root-side node event (the node check's, the prolog's): evidence for hard actions and rollbacks."""
        known = self._node_evidence.get(node)
        if known is None or received >= known[0]:
            self._node_evidence[node] = (received, body)

    def _confirmed(self, t: Tracked, now: float) -> None:
        t.decide = True
        t.opened_at = now
        self._note(now, t.inc.id, "analyzer", "confirmed", f"{t.inc.cause.value} confidence {t.inc.confidence}")

    # --- decide and act ---------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Decide every incident that needs a decision, and perform what was decided."""
        for incident_id, t in list(self._open.items()):
            if t.inc.state in FINAL:
                del self._open[incident_id]
            elif t.decide and t.inc.state in DECIDABLE:
                self._decide(t, now)

    def _decide(self, t: Tracked, now: float) -> None:
        inc = t.inc
        partition, nodes = self._partition(inc.job)
        facts = self._facts(t, partition, nodes, now)
        plan = decide.plan(inc, t.plan_step, self.config, facts, t.step)
        if plan.wait is not None:
            if plan.notes and not t.held_noted:
                t.held_noted = True
                for note in plan.notes:
                    self._note(now, inc.id, note.who, note.what, note.why)
            return
        for note in plan.notes:
            self._note(now, inc.id, note.who, note.what, note.why)
        t.plans.append(plan)
        for rung in plan.walked:
            if rung.mode == "recommend" and rung.why.startswith("drain budget"):
                self._refusals.append(Refusal(now, inc.id, rung.kind, rung.target, rung.why, "decide"))
        t.plan_step, t.decide = plan.plan_step, False
        action = plan.action
        if plan.dry_run:
            if action is not None:
                inc.action = Action(kind=action.kind, target=action.target, status="proposed",
                                    reversible=action.reversible)
            return
        if action is not None and action.mode == "auto":
            row = self._add(inc.id, action.kind, action.target, action.params, "queued", now)
            inc.action = Action(kind=action.kind, target=action.target, status="running",
                                reversible=action.reversible)
            if plan.state is not None:
                inc.advance(plan.state)
            self._run(row, t, now)
            return
        if action is not None:
            row = self._add(inc.id, action.kind, action.target, action.params, "pending_approval", now)
            inc.action = Action(kind=action.kind, target=action.target, status="pending_approval",
                                reversible=action.reversible)
            if plan.state is not None:
                inc.advance(plan.state)
            if self.approve_all:
                self._note(now, inc.id, AUTO_APPROVER, f"{action.kind} {action.target}: approved automatically",
                           "replayed with --approve-all: every approval is given")
                if self._approve(row, t, AUTO_APPROVER, now):
                    return
            # Waiting for a person (or refused at approval by the budget): they are told.
            self._escalate(t, plan.escalate or "", plan.recommended, now)
            return
        if plan.escalate is not None:
            inc.action = Action(kind="escalate", target=inc.job, status="done")
            if plan.state is not None:
                inc.advance(plan.state)
            self._escalate(t, plan.escalate, plan.recommended, now)

    def _escalate(self, t: Tracked, headline: str, recommended: tuple[str, ...] | list[str], now: float) -> None:
        """AdminComment and mail, recorded (the simulation sends nothing)."""
        params = {"job": t.inc.job, "headline": headline, "recommended": list(recommended)}
        row = self._add(t.inc.id, "escalate", t.inc.job, params, "done", now)
        row.detail = "recorded: AdminComment and mail"
        t.escalations.append(headline)
        self._note(now, t.inc.id, "daemon", "escalated", headline,
                   "; ".join(f"recommended: {r}" for r in recommended))
        if self.on_action is not None:
            self.on_action("escalate", t.inc.job, params, t.inc)

    def _run(self, row: ActionRow, t: Tracked, now: float) -> None:
        row.status = "running"
        outcome = self._perform(row, t)
        row.status, row.detail = outcome.status, outcome.detail
        self._note(now, row.incident, "daemon", f"{row.kind} {row.target}", "", f"{outcome.status}: {outcome.detail}")
        self._after(row, outcome, t, now)

    def _perform(self, row: ActionRow, t: Tracked) -> Outcome:
        p = row.params
        try:
            if row.kind == "drain":
                outcome = self.actuator.drain(p["node"], p["reason"])
            elif row.kind == "requeue":
                outcome = self.actuator.requeue_excluding(p["job"], p["node"])
            elif row.kind == "constrain":
                outcome = self.actuator.constrain(p["job"], p["feature"])
            elif row.kind == "undrain":
                outcome = self.actuator.undrain(p["node"], row.incident)
            elif row.kind in ("correct", "rebalance"):
                outcome = Outcome("done", "recorded: the simulated cluster applies it")
            else:
                outcome = Outcome("failed", f"unknown action kind {row.kind}")
        except SlurmError as err:
            # The daemon retries a transient error with backoff; a simulated Slurm has no
            # outages to wait out, so any refusal is this rung's failure.
            outcome = Outcome("failed", str(err))
        if outcome.status == "done" and self.on_action is not None:
            answer = self.on_action(row.kind, row.target, dict(p), t.inc)
            if isinstance(answer, Outcome) and row.kind in ("correct", "rebalance"):
                outcome = answer
        return outcome

    def _after(self, row: ActionRow, outcome: Outcome, t: Tracked, now: float) -> None:
        inc = t.inc
        if row.kind == "undrain" or inc.state is not S.ACTING:
            return
        if outcome.status == "done" and row.kind in ("drain", "requeue"):
            partition, nodes = self._partition(inc.job)
            pol = self.config.policy_for(partition)
            if row.kind == "drain":
                rung_approved = any(r.kind == "drain" and r.approved_by for r in self._rows_of(inc.id))
                follow = decide.after_drain(inc, pol, self._facts(t, partition, nodes, now), rung_approved)
            else:
                follow = decide.after_requeue(inc, pol)
            if follow.kind is not None:
                target = follow.params.get("job", inc.job)
                self._run(self._add(inc.id, follow.kind, target, follow.params, "queued", now), t, now)
                return
            if follow.escalate is not None:
                if inc.action is not None:
                    inc.action.status = "done"
                inc.advance(S.ESCALATED)
                self._escalate(t, follow.escalate, (), now)
                return
        if decide.rung_happened(row.kind, outcome.status):
            if inc.action is not None:
                inc.action.status = "done"
            t.acted_at = now
            inc.advance(S.VERIFYING)
            return
        # Failed or skipped: this rung did not happen; the next one is decided.
        if inc.action is not None:
            inc.action.status = "failed" if outcome.status == "failed" else "skipped"
        inc.advance(S.UNRESOLVED)
        t.decide = True

    # --- people ---------------------------------------------------------------------------------

    def approve(self, incident_id: str, who: str, now: float | None = None) -> None:
        """A person approves the action waiting: performed at once.  A drain beyond the budget
        is refused (``ValueError`` naming the budget) and keeps waiting."""
        t, row = self._waiting(incident_id)
        when = self._now(now)
        if not self._approve(row, t, who, when):
            raise ValueError(f"approval refused: {self._refusals[-1].why}; {row.kind} {row.target} still waits "
                             f"for approval")

    def deny(self, incident_id: str, who: str, now: float | None = None) -> None:
        """A person denies the action waiting: the next rung is decided on the next tick."""
        t, row = self._waiting(incident_id)
        when = self._now(now)
        row.status, row.detail = "denied", f"denied by {who}"
        t.inc.action = Action(kind=row.kind, target=row.target, status="denied",
                              reversible=decide.REVERSIBLE.get(row.kind, False))
        t.decide = True
        self._note(when, incident_id, who, f"denied {row.kind} {row.target}")

    def _approve(self, row: ActionRow, t: Tracked, who: str, now: float) -> bool:
        if row.kind == "drain":
            partition, nodes = self._partition(t.inc.job)
            facts = self._facts(t, partition, nodes, now)
            ok, why = decide.drain_budget(self.config.policy_for(partition), facts, approving=row.id)
            if not ok:
                self._refusals.append(Refusal(now, t.inc.id, row.kind, row.target, why, "approve"))
                self._note(now, t.inc.id, who, f"approval of {row.kind} {row.target} refused", why)
                return False
        row.params = {**row.params, "approved_by": who, "approved_at": now}
        row.approved_by, row.approved_at = who, now
        row.status, row.detail = "queued", f"approved by {who}"
        t.inc.action = Action(kind=row.kind, target=row.target, status="running",
                              reversible=decide.REVERSIBLE.get(row.kind, False))
        t.inc.advance(S.ACTING)
        self._note(now, t.inc.id, who, f"approved {row.kind} {row.target}")
        self._run(row, t, now)
        return True

    def _waiting(self, incident_id: str) -> tuple[Tracked, ActionRow]:
        t = self._tracked.get(incident_id)
        if t is None:
            raise KeyError(incident_id)
        pending = [r for r in self._rows_of(incident_id) if r.status == "pending_approval"]
        if not pending:
            raise ValueError(f"{incident_id} has no action waiting for approval")
        return t, pending[-1]

    # --- verify -------------------------------------------------------------------------------

    def verifying(self) -> list[str]:
        """Incidents whose action is done and waits for its verdict."""
        return [i for i, t in self._tracked.items() if t.inc.state is S.VERIFYING]

    def acted_at(self, incident_id: str) -> float | None:
        """When the incident's action (the whole rung: drain, requeue, constrain) completed."""
        return self._tracked[incident_id].acted_at

    def verify(self, incident_id: str, evidence: verify.Evidence, now: float,
               still_shown: dict[str, str | None] | None = None) -> verify.Verdict | None:
        """Judge a verifying incident (``verify.verdict``) and apply the verdict.

        Resolved: closed.  Unresolved: the reversible actions the verdict
        undoes are undone (a drain through ``Actuator.undrain``, a rebalance
        reset through ``on_action``), the ones it keeps are noted, and the next
        rung is decided on the next tick.  ``still_shown``: what each drained
        node's root-side evidence still shows of the cause; by default from
        the latest node events the loop was given.  Returns None when the
        incident is not verifying, the verdict otherwise (``state`` None: too
        few windows yet).
        """
        t = self._tracked.get(incident_id)
        if t is None or t.inc.state is not S.VERIFYING:
            return None
        inc = t.inc
        done = [(r.id, r.kind, r.target) for r in self._rows_of(incident_id) if r.status == "done"]
        if still_shown is None:
            still_shown = {target: self._still_shown(t, target, now)
                           for _, kind, target in done if kind == "drain" and target}
        v = verify.verdict(inc.kind.value, inc.cause.value, evidence, verify.Rules.of(self.config.daemon), now,
                           self.silence_s, done, still_shown)
        if v.state is None:
            return v
        m = v.verification
        series = [(w.seq, w.throughput) for w in evidence.origin]
        slowed = verify.during(series, inc.onset_window, evidence.action_window)
        inc.result = Result(throughput_healthy=_rounded(evidence.baseline), throughput_before=_rounded(slowed),
                            **m.result_fields(_rounded))
        if v.state == "resolved":
            inc.advance(S.RESOLVED)
            self._note(now, incident_id, "verify", "resolved", m.note)
            return v
        inc.advance(S.UNRESOLVED)
        t.decide = True
        self._note(now, incident_id, "verify", "unresolved", m.note)
        rows = {r.id: r for r in self._rows_of(incident_id)}
        for undo in v.rollbacks:
            row = rows[undo.action_id]
            if not undo.undo:
                self._note(now, incident_id, "daemon", f"{undo.kind} of {undo.target} kept", undo.why)
                continue
            row.status, row.detail = "rolled_back", undo.why
            if undo.kind == "drain":
                self._note(now, incident_id, "daemon", f"drain of {undo.target} rolled back", undo.why)
                self._run(self._add(incident_id, "undrain", undo.target, {"node": undo.target}, "queued", now),
                          t, now)
            else:
                self._note(now, incident_id, "daemon", f"{undo.kind} {undo.target} rolled back", undo.why)
                if self.on_action is not None and undo.kind == "rebalance":
                    self.on_action("rebalance", undo.target, {**row.params, "shares": {}}, inc)
        if v.rolled_back and inc.action is not None and inc.action.reversible and v.rollbacks:
            inc.action.status = "rolled_back"
        return v

    def subject_recovered(self, incident_id: str, now: float,
                          verification: verify.Verification | None = None) -> bool:
        """The analysis saw the subject healthy again: close the incident if the job's throughput
        agrees (``verification`` of its latest windows; None: no baseline to judge against)."""
        t = self._tracked.get(incident_id)
        if t is None or t.inc.state not in DECIDABLE:
            return False
        if any(r.status in OPEN and r.kind != "escalate" for r in self._rows_of(incident_id)):
            return False
        inc = t.inc
        if verification is not None:
            if not verification.done or verification.recovered is False:
                if verification.done and not t.not_back_noted:
                    t.not_back_noted = True
                    self._note(now, incident_id, "verify", "subject healthy, job throughput not back",
                               verification.note)
                return False
            why = f"the subject has been healthy again for RecoverWindows windows; {verification.note}"
            inc.result = (inc.result or Result()).model_copy(update=verification.result_fields(_rounded))
        else:
            why = "the subject has been healthy again for RecoverWindows windows (no healthy baseline to measure)"
        for row in self._rows_of(incident_id):
            if row.status == "pending_approval":
                row.status, row.detail = "skipped", "subject recovered before approval"
        inc.advance(S.RESOLVED)
        t.decide = False
        self._note(now, incident_id, "analyzer", "resolved", why)
        return True

    def _still_shown(self, t: Tracked, node: str, now: float) -> str | None:
        evidence = self._evidence_of(t, node)
        if evidence is None:
            return None
        seen = policy.root_side_shows(t.inc.cause, evidence[1], t.gpu)
        if seen is None:
            return None
        return f"its latest root-side evidence ({now - evidence[0]:.0f} s old) still shows {seen}; not resumed"

    # --- read-outs --------------------------------------------------------------------------------

    def incidents(self) -> list[Incident]:
        """Every incident the loop has seen, in the order it saw them (copies)."""
        return [t.inc.model_copy(deep=True) for t in self._tracked.values()]

    def incident_ids(self, states: tuple[IncidentState, ...] | None = None) -> list[str]:
        """The ids of the incidents seen (in that order), only those in ``states`` if given."""
        return [i for i, t in self._tracked.items() if states is None or t.inc.state in states]

    def incident(self, incident_id: str) -> Incident:
        return self._tracked[incident_id].inc.model_copy(deep=True)

    def tracked(self, incident_id: str) -> Tracked:
        """The loop's own record of an incident (read it; do not change it)."""
        return self._tracked[incident_id]

    def actions(self, incident_id: str | None = None) -> list[ActionRow]:
        return [replace(r, params=dict(r.params)) for r in self._rows
                if incident_id is None or r.incident == incident_id]

    def notes(self, incident_id: str | None = None) -> list[Note]:
        return [n for n in self._notes if incident_id is None or n.incident == incident_id]

    def plans(self, incident_id: str) -> list[decide.Plan]:
        """Every plan decided for the incident, in order (the first is what replay's JSON shows)."""
        return list(self._tracked[incident_id].plans)

    def escalations(self, incident_id: str) -> list[str]:
        return list(self._tracked[incident_id].escalations)

    def refusals(self) -> list[Refusal]:
        """Every drain the budget refused, when deciding or approving."""
        return list(self._refusals)

    @property
    def budget_refusals(self) -> int:
        return len(self._refusals)

    def pending_approvals(self) -> list[ActionRow]:
        return [replace(r) for r in self._rows if r.status == "pending_approval"]

    def drain_records(self) -> tuple[policy.DrainRecord, ...]:
        """The drains the budget counts, as ``policy.DrainRecord`` (when: approved, else decided)."""
        return tuple(policy.DrainRecord(r.id, r.target or "", r.status,
                                        r.approved_at if r.approved_at is not None else r.created)
                     for r in self._rows if r.kind == "drain" and r.status in BUDGET_STATUSES)

    # --- plumbing ---------------------------------------------------------------------------------

    def _facts(self, t: Tracked, partition: str | None, nodes: tuple[NodeInfo, ...], now: float) -> decide.Facts:
        inc = t.inc
        job = self.slurm.job(inc.job)
        targets = {x for x in (inc.node, inc.link, inc.job, f"{inc.job}:{inc.rank}" if inc.rank is not None
                               else None) if x}
        last: dict[str, float] = {}
        for row in self._rows:
            if row.target in targets and row.incident != inc.id and row.kind not in ("escalate", "notify") \
                    and row.status not in ("denied", "skipped", "proposed"):
                last[row.target] = max(last.get(row.target, row.created), row.created)
        time_left = None
        if t.time_left is not None:
            time_left = max(0.0, t.time_left[1] - (now - t.time_left[0]))
        elif job is not None:
            time_left = job.time_left(now)  # as the daemon reads it: the job's end_time in Slurm
        return decide.Facts(
            now=now, partition=partition, nodes=nodes, drains=self.drain_records(), last_action=last,
            rebalance_opt_in=t.rebalance_opt_in, node_evidence=self._evidence_of(t, inc.node),
            gpu=t.gpu, opened_at=t.opened_at, measured_loss_pct=t.measured_loss_pct, gpus=t.gpus,
            time_left_s=time_left)

    def _evidence_of(self, t: Tracked, node: str | None) -> tuple[float, dict[str, Any]] | None:
        """The newest root-side evidence of ``node``: given with the incident, or as a node event."""
        if node is None:
            return None
        seen = [e for e in (self._node_evidence.get(node), t.node_evidence if node == t.inc.node else None)
                if e is not None]
        return max(seen, key=lambda e: e[0]) if seen else None

    def _partition(self, job_id: str) -> tuple[str | None, tuple[NodeInfo, ...]]:
        """The job's partition and its nodes as Slurm has them now (never cached: budgets need the truth)."""
        info = self.slurm.job(job_id)
        partition = info.partition if info is not None and info.partition else None
        return partition, (self.slurm.partition_nodes(partition) if partition else ())

    def _add(self, incident: str, kind: str, target: str | None, params: dict[str, Any], status: str,
             now: float) -> ActionRow:
        row = ActionRow(len(self._rows) + 1, incident, kind, target, dict(params), status, now)
        self._rows.append(row)
        return row

    def _rows_of(self, incident_id: str) -> list[ActionRow]:
        return [r for r in self._rows if r.incident == incident_id]

    def _note(self, now: float, incident: str | None, who: str, what: str, why: str = "",
              result: str = "") -> None:
        self._notes.append(Note(now, incident, who, what, why, result))

    def _now(self, now: float | None) -> float:
        if now is not None:
            return now
        clock = getattr(self.slurm, "clock", None)
        if not callable(clock):
            raise ValueError("no time given and the Slurm backend has no clock")
        return float(clock())


def _diagnosis(inc: Incident) -> tuple[str, str, str | None, str | None]:
    return inc.kind.value, inc.cause.value, inc.node, inc.link


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
