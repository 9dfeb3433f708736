"""The closed loop, in memory: the daemon's decisions and actuator against a simulated Slurm.

``Loop`` does with an incident what the daemon does once the analysis
confirmed it — decide, act, verify, roll back, take the next rung, close it
when the subject recovers, tell people — by the same code: ``decide.plan``
chooses, ``control/reconcile.py`` says what each step makes of the incident
and which effects follow, and this loop's ``apply`` carries the effects out
in memory (the daemon's carries them out through its ledger, the actuator and
mail).  Drains, requeues, constraints and undrains go through the real
``act.Actuator``, so what a fleet simulation or ``artemis replay --policy``
scores is what the daemon would do, NHC manners and budgets included; the
parity test (tests/unit/test_loop_parity.py) runs one stream through both.

What the daemon does over time (a queued action run on the next turn, a
correction the node check reports back) happens here at once: an action is
performed in the tick (or the approval) that decided it.  Corrections and
rebalances change nothing in Slurm; ``on_action`` lets the simulation apply
their physical effect (and any action's), and may answer a correction's or
rebalance's ``Outcome``.  Messages to people are recorded, not sent.  Time is
the caller's: ``now`` is passed in, and the Loop never moves the SimSlurm's
clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from artemisd import decide, loss, policy, verify
from artemisd.control import actions, reconcile
from artemisd.control import apply as control_apply
from artemisd.act import Actuator, Outcome
from artemisd.config import Config
from artemisd.incident import Incident, IncidentState
from artemisd.slurm.api import NodeInfo, SlurmBackend, SlurmError

S = IncidentState
# The daemon's (service.VERIFY_SILENCE_S): a verifying job silent this long is judged unmeasurable.
VERIFY_SILENCE_S = 3600.0
DECIDABLE = (S.CONFIRMED, S.UNRESOLVED, S.ESCALATED)
FINAL = (S.RESOLVED, S.DISMISSED)
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
        was = S.SUSPECT
        if t is None:
            if inc.state is S.DISMISSED:
                return
            t = Tracked(inc.model_copy(deep=True), now, step=step)
            self._tracked[inc.id] = t
            self._open[inc.id] = t
        else:
            was = t.inc.state
        self.apply(t, reconcile.on_analysis(t.inc, inc, was, t.plan_step, self._rows_of(inc.id)), now)
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

    def node_event(self, node: str, received: float, body: dict[str, Any]) -> None:
        """A root-side node event (the node check's, the prolog's): evidence for hard actions and rollbacks."""
        known = self._node_evidence.get(node)
        if known is None or received >= known[0]:
            self._node_evidence[node] = (received, body)

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
        change = reconcile.on_plan(inc, plan, self._rows_of(inc.id), t.held_noted)
        if plan.wait is None:
            t.plans.append(plan)
            for rung in plan.walked:
                if rung.mode == "recommend" and rung.why.startswith("drain budget"):
                    self._refusals.append(Refusal(now, inc.id, rung.kind, rung.target, rung.why, "decide"))
        waiting = [e for e in change.effects if isinstance(e, reconcile.Queue) and e.status == "pending_approval"]
        if not (self.approve_all and waiting):
            self.apply(t, change, now)
            return
        # --approve-all: the approval is given at once; the page asking for it goes only if the budget
        # refuses it then (the person is told it waits).
        tells = [e for e in change.effects if isinstance(e, reconcile.Tell)]
        change.effects = [e for e in change.effects if not isinstance(e, reconcile.Tell)]
        self.apply(t, change, now)
        row = self._rows_of(inc.id)[-1]
        self._note(now, inc.id, AUTO_APPROVER, f"{row.kind} {row.target}: approved automatically",
                   "replayed with --approve-all: every approval is given")
        if not self._approve(row, t, AUTO_APPROVER, now):
            self.apply(t, reconcile.Change(t.inc, list(tells), saved=False), now)

    def apply(self, t: Tracked, change: reconcile.Change, now: float) -> None:
        """Carry a ``reconcile.Change`` out in memory, at once (``MemorySink``)."""
        control_apply.apply(change, MemorySink(self, t, now))

    def _tell(self, t: Tracked, tell: reconcile.Tell, now: float) -> None:
        """AdminComment and mail (``escalate``) or mail (``notify``), the daemon's text, recorded: the
        simulation sends nothing.  Recorded done, as the daemon's row ends once sent."""
        if tell.kind == "escalate" and self.config.daemon.dry_run:
            self._note(now, t.inc.id, "daemon", "dry-run: would escalate", tell.headline)
            return
        params = tell.message.params(t.inc.job)
        if tell.kind == "escalate":
            params.update(headline=tell.headline, recommended=list(tell.recommended))
        row = self._add(t.inc.id, tell.kind, t.inc.job, params, "done", now)
        row.detail = "recorded: AdminComment and mail" if tell.kind == "escalate" else "recorded: mail"
        if tell.kind != "escalate":
            return
        t.escalations.append(tell.headline)
        self._note(now, t.inc.id, "daemon", "escalated", tell.headline,
                   "; ".join(f"recommended: {r}" for r in tell.recommended))
        if self.on_action is not None:
            self.on_action("escalate", t.inc.job, params, t.inc)
        self.apply(t, reconcile.after_action(t.inc, row, "done", self._rows_of(t.inc.id)), now)

    def _run(self, row: ActionRow, t: Tracked, now: float) -> None:
        self._move(row.id, "running", row.detail)
        outcome = self._perform(row, t)
        self._move(row.id, outcome.status, outcome.detail)
        self._note(now, row.incident, "daemon", f"{row.kind} {row.target}", "", f"{outcome.status}: {outcome.detail}")
        self._after(row, outcome, t, now)

    def _perform(self, row: ActionRow, t: Tracked) -> Outcome:
        p = row.params
        try:
            outcome = self.actuator.perform(row.kind, p, row.incident)
            if outcome is None and row.kind in ("correct", "rebalance"):
                outcome = Outcome("done", "recorded: the simulated cluster applies it")
            elif outcome is None:
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
        pol = facts = None
        if reconcile.follows_up(row.kind, outcome.status):
            partition, nodes = self._partition(t.inc.job)
            pol = self.config.policy_for(partition)
            if row.kind == "drain":  # its requeue is priced on the decision's facts
                facts = self._facts(t, partition, nodes, now)
        self.apply(t, reconcile.after_action(t.inc, row, outcome.status, self._rows_of(t.inc.id), pol, facts), now)

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
        self.apply(t, reconcile.on_approval(t.inc, row, who, False, when), when)

    def _approve(self, row: ActionRow, t: Tracked, who: str, now: float) -> bool:
        if row.kind == "drain":
            partition, nodes = self._partition(t.inc.job)
            facts = self._facts(t, partition, nodes, now)
            ok, why = decide.drain_budget(self.config.policy_for(partition), facts, approving=row.id)
            if not ok:
                self._refusals.append(Refusal(now, t.inc.id, row.kind, row.target, why, "approve"))
                self._note(now, t.inc.id, who, f"approval of {row.kind} {row.target} refused", why)
                return False
        change = reconcile.on_approval(t.inc, row, who, True, now)
        self.apply(t, change, now)
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
        series = [(w.seq, w.throughput) for w in evidence.origin]
        slowed = loss.during(series, inc.onset_window, evidence.action_window, verify.seconds_by_window(evidence.origin))
        self.apply(t, reconcile.on_verdict(inc, v, self._rows_of(incident_id), (evidence.baseline, slowed),
                                            self.config.daemon.dry_run), now)
        return v

    def subject_recovered(self, incident_id: str, now: float,
                          verification: verify.Verification | None = None) -> bool:
        """The analysis saw the subject healthy again: close the incident if the job's throughput
        agrees (``verification`` of its latest windows; None: no baseline to judge against)."""
        t = self._tracked.get(incident_id)
        if t is None:
            return False
        change = reconcile.on_recovered(t.inc, verification, self._rows_of(incident_id), t.not_back_noted,
                                        dry_run=self.config.daemon.dry_run)
        self.apply(t, change, now)
        return t.inc.state is S.RESOLVED and change.saved

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
                     for r in self._rows if r.kind == "drain" and r.status in actions.BUDGETED)

    # --- plumbing ---------------------------------------------------------------------------------

    def _facts(self, t: Tracked, partition: str | None, nodes: tuple[NodeInfo, ...], now: float) -> decide.Facts:
        inc = t.inc
        job = self.slurm.job(inc.job)
        targets = {x for x in (inc.node, inc.link, inc.job, f"{inc.job}:{inc.rank}" if inc.rank is not None
                               else None) if x}
        last: dict[str, float] = {}
        for row in self._rows:
            if row.target in targets and row.incident != inc.id and row.kind not in actions.TELL \
                    and row.status not in actions.NEVER_ACTED:
                last[row.target] = max(last.get(row.target, row.created), row.created)
        time_left = None
        if t.time_left is not None:
            time_left = max(0.0, t.time_left[1] - (now - t.time_left[0]))
        elif job is not None:
            time_left = job.time_left(now)  # as the daemon reads it: the job's end_time in Slurm
        return decide.Facts(
            now=now, partition=partition, nodes=nodes, drains=self.drain_records(), last_action=last,
            rebalance_opt_in=t.rebalance_opt_in, node_evidence=self._evidence_of(t, inc.node),
            peer_evidence=tuple(ev for n in decide.peer_nodes(inc, job.nodes if job is not None else ())
                                if (ev := self._node_evidence.get(n)) is not None),
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

    def _row(self, action_id: int) -> ActionRow:
        return self._rows[action_id - 1]

    def _move(self, action_id: int, status: str, detail: str) -> bool:
        """A row moves along the action table's life cycle, as the stores enforce it (else nothing)."""
        row = self._row(action_id)
        if row.status not in actions.came_from(status):
            return False
        row.status, row.detail = status, detail
        return True

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


class MemorySink:
    """Where the simulated loop carries a change out (``control.apply``): rows and notes in memory;
    messages to people are recorded (nothing is sent) once every other effect is in, and the actions
    queued are performed at once against the simulated Slurm."""

    def __init__(self, loop: Loop, t: Tracked, now: float):
        self.loop = loop
        self.t = t
        self.now = now
        self.to_run: list[ActionRow] = []
        self.told: list[reconcile.Tell] = []

    def marks(self, change: reconcile.Change) -> None:
        t = self.t
        t.inc = change.incident
        if change.decide is not None:
            t.decide = change.decide
        if change.plan_step is not None:
            t.plan_step = change.plan_step
        if change.held is not None:
            t.held_noted = change.held
        if change.not_back is not None:
            t.not_back_noted = change.not_back
        if change.acted:
            t.acted_at = self.now
        if change.reopened:
            t.acted_at = None
            self.loop._open[t.inc.id] = t

    def note(self, note: reconcile.Note) -> None:
        self.loop._note(self.now, self.t.inc.id, note.who, note.what, note.why, note.result)

    def queue(self, queue: reconcile.Queue) -> None:
        row = self.loop._add(self.t.inc.id, queue.kind, queue.target, dict(queue.params), queue.status, self.now)
        if queue.status == "queued":
            self.to_run.append(row)

    def move(self, move: reconcile.Move) -> None:
        self.loop._move(move.action_id, move.status, move.detail)

    def approved(self, approved: reconcile.Approved) -> None:
        row = self.loop._row(approved.action_id)
        row.params = dict(approved.params)
        row.approved_by, row.approved_at = approved.who, approved.at

    def reset_shares(self, reset: reconcile.ResetShares) -> None:
        row = self.loop._row(reset.action_id)
        self.loop._move(row.id, "rolled_back", "shares reset to equal")
        self.loop._note(self.now, self.t.inc.id, "daemon", f"rebalance {row.target} rolled back", reset.why)
        if self.loop.on_action is not None:
            self.loop.on_action("rebalance", row.target, {**row.params, "shares": {}}, self.t.inc)

    def tell(self, tell: reconcile.Tell) -> None:
        self.told.append(tell)

    def finish(self, change: reconcile.Change) -> None:
        for tell in self.told:
            self.loop._tell(self.t, tell, self.now)
        for row in self.to_run:
            self.loop._run(row, self.t, self.now)

