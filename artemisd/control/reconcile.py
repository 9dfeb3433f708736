"""The acting half's decisions on one incident, pure: facts in, the incident as it is to be saved and the
effects to carry out.

The daemon (``acting.Acting``) and the simulated loop (``sim/loop.py``, under ``artemis replay
--policy`` and the fleet benchmark) both call these, and each carries the effects out its own way: the
daemon through its ledger, the actuator and mail on its next turns, the simulated loop at once against
a simulated Slurm.  What is decided — which rung, what it becomes once done, what a verdict undoes,
when a recovered incident closes, what an approval does, what a person is told — is decided here once.

Each function takes the incident (never changed: a copy is returned), its action rows and what was
gathered for it, and returns a ``Change``.  No I/O, no clock: ``now`` is the caller's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from artemisd import decide, loss, verify
from artemisd.config import PartitionPolicy
from artemisd.decide import Note
from artemisd.control import actions
from artemisd.control.escalation import Message, Row, all_clear, escalation, job_end_notice, where
from artemisd.incident import Action, EndedWithJob, Evidence, Incident, IncidentState, Result

S = IncidentState
DECIDABLE = (S.CONFIRMED, S.UNRESOLVED, S.ESCALATED)


def rounded(value: float | None) -> float | None:
    """How a throughput is kept in an incident's result (samples/s)."""
    return round(value, 3) if value is not None else None


# --- effects (and ``decide.Note``: an audit line) -------------------------------------------------------

@dataclass(frozen=True)
class Queue:
    """A new action row (``status`` queued, or pending_approval: it waits for a person)."""

    kind: str
    target: str | None
    params: Mapping[str, Any]
    status: str = "queued"


@dataclass(frozen=True)
class Move:
    """An action row moves along its life cycle."""

    action_id: int
    status: str
    detail: str = ""


@dataclass(frozen=True)
class Tell:
    """A message to a person, queued as an ``escalate`` (AdminComment and mail) or ``notify`` (mail) row.
    ``headline``: what it is about, for the audit line of a dry run (which tells nobody)."""

    kind: str
    message: Message
    headline: str = ""
    recommended: tuple[str, ...] = ()


@dataclass(frozen=True)
class ResetShares:
    """A rebalance that did not help is undone: its job step's ranks go back to equal shares."""

    action_id: int
    job: str
    step: str
    why: str


@dataclass(frozen=True)
class Approved:
    """An action row records who approved it and when (the drain budget counts it from then):
    ``params`` are the row's, with ``approved_by`` and ``approved_at`` added."""

    action_id: int
    params: Mapping[str, Any]
    who: str
    at: float


Effect = Note | Queue | Move | Tell | ResetShares | Approved


@dataclass
class Change:
    """The incident as it is to be saved, what to carry out, and the loop's own marks on it.

    ``decide``: decide it again on the next turn (None: as it was); ``plan_step``: its ladder position
    (None: as it was); ``acted``: its rung was done now (verification starts after the newest window);
    ``held``/``not_back``: the "not escalated yet" / "healthy, throughput not back" lines were written
    (True: each once per spell) or may be written again (False); ``confirmed``: the analysis confirmed it
    now (its healthy baseline is taken); ``reopened``: a resolved incident recurred and is open again,
    the one way out of ``resolved`` (the ledger writes it as such).
    """

    incident: Incident
    effects: list[Effect] = field(default_factory=list)
    decide: bool | None = None
    plan_step: int | None = None
    acted: bool = False
    held: bool | None = None
    not_back: bool | None = None
    confirmed: bool = False
    reopened: bool = False
    saved: bool = True  # False: nothing of the incident changed, nothing to save


def _copy(inc: Incident) -> Incident:
    return inc.model_copy(deep=True)


@dataclass(frozen=True)
class _Planned:
    """A row about to be queued, as the escalation text reads rows."""

    id: int
    kind: str
    target: str | None
    status: str
    params: Mapping[str, Any]


# --- what the analysis says ---------------------------------------------------------------------------

def diagnosis(inc: Incident) -> tuple[str, str, str | None, str | None]:
    return inc.kind.value, inc.cause.value, inc.node, inc.link


def on_analysis(inc: Incident, update: Incident, was: IncidentState, plan_step: int, rows: Sequence[Row],
                closed: bool = False) -> Change:
    """The analyzer's latest word on an incident (``update``) merged into it.

    The analysis owns suspect -> confirmed | dismissed and the analysis fields; from confirmed on the
    loop owns the state.  ``was``: the state the incident was last saved in (a new one: suspect), so a
    confirmation is seen once and makes it decidable.  A recurrence (the subject recovered and was
    confirmed slow again) reopens a resolved incident, decided again from the start of its ladder
    (``decide.plan`` sends it to a person once ``RecurEscalate`` recurrences say the fix does not
    hold); one still open that waits for a person or a next rung is decided again.  A diagnosis that
    changed after a person was told (the matched probes named the link) is decided again from the new
    cause's ladder.  ``closed``: it ended with its job, nothing more is decided.
    """
    out = Change(_copy(inc))
    new = out.incident
    told, seen = diagnosis(new), len(new.recurrences)
    for key, value in update.model_dump(exclude={"id", "state", "action", "result"}).items():
        setattr(new, key, value)
    waiting = any(r.status in actions.OPEN for r in rows)
    if len(new.recurrences) > seen and update.state is S.CONFIRMED:
        latest = new.recurrences[-1]
        why = (f"recurrence {len(new.recurrences)}: slow again from window {latest.onset_window}, confirmed at "
               f"{latest.confirmed_window}" + (f", {latest.ratio:.2f}x" if latest.ratio is not None else ""))
        out.held = out.not_back = False
        if new.state is S.RESOLVED:
            new.state = S.CONFIRMED  # the one way out of resolved: ``reopened``
            new.action, new.result = None, None
            out.reopened, out.decide, out.plan_step = True, True, 0
            plan_step = 0
        elif new.state in DECIDABLE and not closed and not waiting:
            out.decide = True
        out.effects.append(Note("analyzer", "recurred", why))
    if diagnosis(new) != told and new.state in (S.ESCALATED, S.UNRESOLVED) and not waiting:
        out.decide, out.plan_step = True, 0
        plan_step = 0
        out.effects.append(Note("analyzer", "diagnosis changed",
                                f"was {told[1]} {told[0]}; now {new.cause.value} {where(new)}"))
    if new.state is S.SUSPECT and update.state is not new.state:
        new.advance(update.state)
    if new.action is None or (new.action.status == "proposed" and plan_step == 0):
        new.action = update.action
    loss_as_the_result_shows(new)  # the analysis' own figure spans only the windows up to confirmation
    if new.state is S.CONFIRMED and was is S.SUSPECT:
        out.decide, out.confirmed = True, True
        out.effects.append(Note("analyzer", "confirmed", f"{new.cause.value} confidence {new.confidence}",
                                json.dumps([e.model_dump() for e in new.evidence])[:2000]))
    return out


# --- deciding ------------------------------------------------------------------------------------------

def on_plan(inc: Incident, plan: decide.Plan, rows: Sequence[Row], held: bool) -> Change:
    """Apply ``decide.plan``'s decision: the rung queued (or waiting for approval), the escalation, the
    state.  A plan that waits only writes its notes, once per spell (``held``)."""
    if plan.wait is not None:
        if plan.notes and not held:
            return Change(_copy(inc), list(plan.notes), held=True, saved=False)
        return Change(_copy(inc), saved=False)
    out = Change(_copy(inc), list(plan.notes), decide=False,
                 plan_step=plan.plan_step)
    new = out.incident
    if plan.evidence:  # the latest root-side readings stand for the earlier ones
        shown = {e.signal for e in plan.evidence}
        new.evidence = [*(e for e in new.evidence if e.signal not in shown), *plan.evidence]
    step = plan.action
    if plan.dry_run:
        if step is not None:
            new.action = Action(kind=step.kind, target=step.target, status="proposed", reversible=step.reversible)
        return out
    planned: list[Row] = []
    if step is not None:
        status = "queued" if step.mode == "auto" else "pending_approval"
        out.effects.append(Queue(step.kind, step.target, dict(step.params), status))
        planned.append(_Planned(0, step.kind, step.target, status, step.params))
        new.action = Action(kind=step.kind, target=step.target, reversible=step.reversible,
                            status="running" if status == "queued" else "pending_approval")
    elif plan.escalate is not None:
        new.action = Action(kind="escalate", target=new.job, status="running")
    if plan.state is not None:
        new.advance(plan.state)
    if plan.escalate is not None:
        out.effects.append(Tell("escalate", escalation(new, plan.escalate, plan.recommended, [*rows, *planned]),
                                plan.escalate, tuple(plan.recommended)))
    return out


# --- after an action ------------------------------------------------------------------------------------

# The job's healthy throughput and its throughput from the onset to the action (samples/s): what
# ``slowed_result`` freezes into the incident's result.  None: not known to this caller (yet).
Throughput = tuple[float | None, float | None]


def follows_up(kind: str, status: str) -> bool:
    """Whether an action's end may queue a follow-up — a done drain's requeue, a done requeue's
    constraint — and so needs the partition's policy (and, after a drain, the decision's facts)."""
    return status == "done" and kind in ("drain", "requeue")


def after_action(inc: Incident, row: Row, status: str, rows: Sequence[Row], pol: PartitionPolicy | None = None,
                 facts: decide.Facts | None = None, throughput: Throughput | None = None) -> Change:
    """An action ended with ``status`` (done, failed, skipped): what the incident becomes.

    A done drain is followed by the requeue that moves the job off the node, or a person is told;
    a done requeue may be narrowed (``Constraint=``).  A rung that happened is verified next; one that
    did not leaves the incident unresolved, and the next rung is decided.  ``pol`` and ``facts``: read
    by a follow-up only (``follows_up``; a drain's requeue is priced on the facts ``decide.plan``
    reads); ``throughput``: frozen into the result when the rung happened (``slowed_result``).
    """
    out = Change(_copy(inc))
    new = out.incident
    if row.kind == "escalate":
        if new.action is not None and new.action.kind == "escalate":
            new.action.status = "done" if status == "done" else "failed"
            return out
        out.saved = False
        return out
    if row.kind not in actions.RUNGS or new.state is not S.ACTING:
        out.saved = False  # the daemon's own follow-up (an undrain, a mail), or closed while it was in flight
        return out
    if follows_up(row.kind, status):
        if pol is None or (row.kind == "drain" and facts is None):
            raise ValueError(f"after a done {row.kind}: the partition's policy and the facts are needed")
        if row.kind == "drain":
            # Approving the drain rung approves its requeue too (one decision per rung).
            approved = any(r.kind == "drain" and r.params.get("approved_by") for r in rows)
            follow = decide.after_drain(new, pol, facts, approved)
        else:
            follow = decide.after_requeue(new, pol)
        if follow.kind is not None:
            out.effects.append(Queue(follow.kind, follow.params.get("job", new.job), dict(follow.params)))
            out.saved = False
            return out
        if row.kind == "drain":
            if new.action is not None:
                new.action.status = "done"
            new.advance(S.ESCALATED)
            headline = follow.escalate or "needs a person"
            out.effects.append(Tell("escalate", escalation(new, headline, (), rows), headline))
            return out
    if decide.rung_happened(row.kind, status):
        if throughput is not None:
            new = out.incident = slowed_result(new, *throughput)
        if new.action is not None:
            new.action.status = "done"
        new.advance(S.VERIFYING)
        out.acted = True
        return out
    # Failed or skipped: this rung did not happen; the next one is decided.
    if new.action is not None:
        new.action.status = "failed" if status == "failed" else "skipped"
    new.advance(S.UNRESOLVED)
    out.decide = True
    return out


# --- verification -------------------------------------------------------------------------------------

def slowed_result(inc: Incident, healthy: float | None, slowed: float | None) -> Incident:
    """The incident with its healthy and slowed throughput recorded, once (a copy).

    After a requeue the job's windows are another run's: the slowed throughput comes from the first
    run, taken when the action completed, never recomputed.  The incident's measured loss is then the
    one of those two numbers, and its loss evidence line says so.
    """
    new = _copy(inc)
    if new.result is None or new.result.throughput_before is None:
        new.result = Result(throughput_healthy=rounded(healthy), throughput_before=rounded(slowed))
    loss_as_the_result_shows(new)
    return new


def loss_as_the_result_shows(inc: Incident) -> None:
    """Once the slowed throughput is frozen in the result, the incident's measured loss is the one
    of those two numbers, and the loss evidence line says so: one incident never shows two losses.

    The analysis measured the loss from the onset to the confirming window; the
    result's slowed throughput spans the onset to the action, a few windows more.
    """
    result = inc.result
    if result is None or result.throughput_before is None or not result.throughput_healthy:
        return
    inc.measured_loss_pct = loss.measured_loss(result.throughput_healthy, result.throughput_before)
    line = loss.loss_evidence(inc.loss_pct, result.throughput_healthy, result.throughput_before)
    evidence = [e for e in inc.evidence if e.signal != "samples_per_s"]
    inc.evidence = evidence + ([Evidence(**line)] if line else [])


def on_verdict(inc: Incident, verdict: verify.Verdict, rows: Sequence[Row], throughput: Throughput | None,
               dry_run: bool = False) -> Change:
    """Apply ``verify.verdict``: resolved (and the all-clear to a person told), or unresolved with what
    it undoes — a drain's node goes back in service, a rebalance's shares are reset — and what it keeps,
    and the next rung decided.  ``throughput`` is frozen into the result first, where it was not yet
    (``slowed_result``).  A verdict not reached yet changes nothing."""
    if verdict.state is None:
        return Change(_copy(inc), saved=False)
    measured = verdict.verification
    new = slowed_result(inc, *throughput) if throughput is not None else _copy(inc)
    out = Change(new)
    new.result = (new.result or Result()).model_copy(update=measured.result_fields(rounded))
    if verdict.state == S.RESOLVED.value:
        new.advance(S.RESOLVED)
        out.effects.append(Note("verify", "resolved", measured.note))
        out.effects += _all_clear(new, measured.note, rows, dry_run)
        return out
    new.advance(S.UNRESOLVED)
    out.decide = True
    out.effects.append(Note("verify", "unresolved", measured.note))
    out.effects += rollbacks(verdict.rollbacks, rows)
    if verdict.rolled_back and measured.recovered is False and new.action is not None and new.action.reversible:
        new.action.status = "rolled_back"
    return out


def rollbacks(undos: Sequence[verify.Undo], rows: Sequence[Row]) -> list[Effect]:
    """What undoing (or keeping) each of ``undos`` takes: a drain's node goes back in service (an
    undrain queued), a rebalance's shares are reset; one kept is said in the audit log."""
    by_id = {r.id: r for r in rows}
    out: list[Effect] = []
    for undo in undos:
        row = by_id.get(undo.action_id)
        if row is None:
            continue
        if not undo.undo:
            out.append(Note("daemon", f"{row.kind} of {row.target} kept", undo.why))
        elif actions.rule(row.kind).undone_by is actions.ActionKind.REBALANCE:
            out.append(ResetShares(row.id, row.params["job"], row.params["step"], undo.why))
        elif actions.rule(row.kind).undone_by is actions.ActionKind.UNDRAIN:
            out += [Move(row.id, "rolled_back", "undrain queued"), Queue("undrain", row.target, {"node": row.target}),
                    Note("daemon", f"{row.kind} of {row.target} rolled back", undo.why)]
    return out


def acting_on(rows: Sequence[Row]) -> bool:
    """An action of the incident is queued or running on its target (a mail is not acting on it)."""
    return any(r.status in actions.IN_FLIGHT and r.kind not in actions.TELL for r in rows)


def on_recovered(inc: Incident, verification: verify.Verification | None, rows: Sequence[Row],
                 not_back: bool, throughput: Throughput | None = None, dry_run: bool = False) -> Change:
    """The analysis saw the subject healthy again: close it once the job's throughput agrees.

    Resolved always means recovered: ``verification`` judges the job's latest windows as a
    verification would.  Back: resolved with that result.  Not back (an action judged unresolved whose
    subject is healthy now, yet the job still slow): it stays as it is, said once (``not_back``).
    None: no healthy baseline to judge against; the subject's recovery closes it (``recovered`` stays
    null).  An action of its still in flight keeps it open.
    """
    if inc.state not in DECIDABLE or acting_on(rows):
        return Change(_copy(inc), saved=False)
    out = Change(_copy(inc))
    new = out.incident
    if verification is not None:
        if not verification.done or verification.recovered is False:
            out.saved = False
            if verification.done and not not_back:
                out.effects.append(Note("verify", "subject healthy, job throughput not back", verification.note))
                out.not_back = True
            return out
        if new.result is not None or verification.recovered:
            if throughput is not None:
                new = out.incident = slowed_result(new, *throughput)
            new.result = (new.result or Result()).model_copy(update=verification.result_fields(rounded))
        why = f"the subject has been healthy again for RecoverWindows windows; {verification.note}"
    else:
        why = "the subject has been healthy again for RecoverWindows windows (no healthy baseline to measure)"
    out.effects += [Move(r.id, "skipped", "subject recovered before approval")
                    for r in rows if r.status == "pending_approval"]
    new.advance(S.RESOLVED)
    out.decide = False
    out.effects.append(Note("analyzer", "resolved", why))
    out.effects += _all_clear(new, why, rows, dry_run)
    return out


def _all_clear(inc: Incident, why: str, rows: Sequence[Row], dry_run: bool) -> list[Effect]:
    message = all_clear(inc, why, rows)
    return [Tell("notify", message)] if message is not None and not dry_run else []


# --- when the job ends ---------------------------------------------------------------------------------

def on_job_end(inc: Incident, rows: Sequence[Row], job: str, job_state: str | None, now: float) -> Change:
    """Slurm says the incident's job ended (``job_state``; None: it no longer knows it): its end state
    (``decide.after_job_end``), its actions that never began withdrawn, a record of it
    (``ended_with_job``), and one mail to a person paged about it.  Closed already: nothing."""
    end = decide.after_job_end(inc.state, [(r.id, r.kind, r.status, r.params) for r in rows])
    if end is None:
        return Change(_copy(inc), saved=False)
    out = Change(_copy(inc), decide=False)
    new = out.incident
    withdrawn = [r for r in rows if r.id in end.withdrawn]
    for row in withdrawn:
        waited = "was approved" if row.status == "pending_approval" else "ran"
        out.effects.append(Move(row.id, "skipped", f"the job ended before it {waited}"))
    if new.action is not None and any((r.kind, r.target) == (new.action.kind, new.action.target) for r in withdrawn):
        new.action.status = "skipped"
    before = new.state
    if end.tell:
        notice = job_end_notice(new, before, job_state, rows, withdrawn)
        if notice is not None:
            out.effects.append(Tell("notify", notice))
    if end.state is not before:
        new.advance(end.state)
    new.ended_with_job = EndedWithJob(at=now, state_before=before, job_state=job_state, person_told=end.tell)
    out.effects.append(Note("daemon", f"ended with its job: {end.state.value}",
                            f"Slurm says job {job} {'is ' + job_state if job_state else 'is no longer known'}; "
                            f"the incident was {before.value}",
                            "the person paged about it is mailed" if end.tell else "nobody was paged about it"))
    return out


# --- people ---------------------------------------------------------------------------------------------

def on_approval(inc: Incident, row: Row, who: str, approve: bool, now: float) -> Change:
    """A person's decision on the action waiting: approved, it is queued and the incident acts; denied,
    the next rung is decided.  (A drain's budget is checked before: ``decide.drain_budget``.)"""
    out = Change(_copy(inc))
    new = out.incident
    action_id = row.id
    reversible = actions.reversible(row.kind)
    if approve:
        params = {**row.params, "approved_by": who, "approved_at": now}
        out.effects += [Approved(action_id, params, who, now), Move(action_id, "queued", f"approved by {who}")]
        new.action = Action(kind=row.kind, target=row.target, status="running", reversible=reversible)
        new.advance(S.ACTING)
    else:
        out.effects.append(Move(action_id, "denied", f"denied by {who}"))
        new.action = Action(kind=row.kind, target=row.target, status="denied", reversible=reversible)
        out.decide = True
    out.effects.append(Note(who, f"{'approved' if approve else 'denied'} {row.kind} {row.target}", action=action_id))
    return out
