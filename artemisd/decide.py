"""Decide: what a confirmed incident gets now, under the site's policy.  Pure.

``plan(incident, config, facts)`` is the whole decision.  It takes plain data —
the incident, the settings, and ``Facts``: what Slurm says of the partition's
nodes, Artemis' own drains, when other incidents last acted on each target,
root-side node evidence, the job's size and time left — and returns a ``Plan``:
the action to take now (or none), the incident's transition, the position on
the ladder, and the audit lines that explain it.  It reads no clock, no store
and no Slurm, so the daemon, ``artemis replay --policy`` and the closed-loop
fleet simulation run the same decisions (docs/architecture.md, "Decide").

The ladder (``policy.LADDERS``) starts at the analysis' remedy and walks to
more disruptive rungs; each rung is judged by ``policy.decide`` (allowed,
corroborated, within budget, out of cooldown) and by its *price*
(``rung_cost``): a rung is taken only when what it costs is less than what the
slowdown is expected to cost while it lasts.  The rungs are ordered cheapest
first (a rebalance or a clock reset costs nothing to undo; a drain with its
requeue throws away the work since the last checkpoint and pays a restart on
every GPU of the job), so the first rung that is allowed and pays is the
cheapest that pays.  Every rung walked past is written down with why.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from artemisd import fabric, policy
from artemisd.control import actions
from artemisd.config import Config, PartitionPolicy
from artemisd.incident import TRANSITIONS, Action, Cause, Evidence, Incident, IncidentKind, IncidentState
from artemisd.remedy import propose
from artemisd.slurm.api import REASON_PREFIX, NodeInfo

S = IncidentState

MAX_REASON = 240  # a drain reason longer than this is cut: sinfo -R shows the start

# Evidence that only restates the slowdown itself; anything else is a signal that deviates.
SLOWDOWN_SIGNALS = frozenset({"ms.step", "ms.busy", "ms.comm_wait", "samples_per_s", "missing"})
# Hardware does not heal by itself: a GPU that stopped boosting, runs hot or
# under a lowered cap, or a degraded link, slows the job for as long as it runs.
PERSISTENT_CAUSES = frozenset({Cause.GPU_CLOCKS, Cause.GPU_POWER, Cause.GPU_THERMAL, Cause.COMM_LINK})
# The longest a drain or requeue waits for the node's root-side check to look at the node after the
# incident opened (``corroboration_due``): a site's node check runs every few seconds to minutes.
CORROBORATION_WAIT_S = 300.0
PEERS_READ = 64


@dataclass(frozen=True)
class Facts:
    """What the caller knows when it decides, read just before: Slurm is the truth for nodes.

    ``nodes``: the partition's nodes with state and reason (for the drain
    budget); ``drains``: every drain Artemis decided, any incident;
    ``last_action``: target -> when *another* incident last acted on it
    (cooldowns are between incidents); ``node_evidence``: (received, body) of
    the incident node's latest root-side node event, ``peer_evidence`` the
    job's other nodes' (a link's fabric counters are read against them); ``gpu``: the subject
    rank's device index; ``opened_at``: when the incident was opened;
    ``measured_loss_pct``: the job's samples/s below healthy now; ``gpus``:
    the job's GPU (rank) count; ``time_left_s``: until the job's time limit
    (None: not known, the slowdown's cost is then unbounded); ``unlimited``: the
    job has no time limit (priced over the partition's ``UnlimitedJobHorizon``).
    """

    now: float
    partition: str | None = None
    nodes: tuple[NodeInfo, ...] = ()
    drains: tuple[policy.DrainRecord, ...] = ()
    last_action: Mapping[str, float] = field(default_factory=dict)
    rebalance_opt_in: bool = False
    node_evidence: tuple[float, dict[str, Any]] | None = None
    peer_evidence: tuple[tuple[float, dict[str, Any]], ...] = ()
    gpu: int | None = None
    awaiting_probe: bool = False
    opened_at: float | None = None
    measured_loss_pct: float | None = None
    gpus: int | None = None
    time_left_s: float | None = None
    unlimited: bool = False


@dataclass(frozen=True)
class Step:
    """One rung as judged: ``mode`` auto (do it), approve (wait for a person) or recommend (refused: ``why``)."""

    kind: str
    target: str | None
    mode: policy.Mode
    why: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def reversible(self) -> bool:
        return actions.reversible(self.kind)

    def contract_status(self) -> str:
        """The incident contract's ``action.status`` for a rung that was only planned."""
        return {"auto": "proposed", "approve": "pending_approval"}.get(self.mode, "refused")

    def as_action(self) -> Action:
        """The incident contract's ``action`` for a rung that was only planned (replay, the plan list)."""
        return Action(kind=self.kind, target=self.target, status=self.contract_status(),
                      reversible=self.reversible, reason=self.why or None)

    def as_json(self) -> dict[str, Any]:
        return self.as_action().model_dump(mode="json")


@dataclass(frozen=True)
class Note:
    """One audit line: who decided what, and why (``result``: what came of it; ``action``: the row)."""

    who: str
    what: str
    why: str = ""
    result: str = ""
    action: int | None = None


@dataclass(frozen=True)
class Plan:
    """The decision on one incident.

    ``action``: the rung to take now (queued when ``mode`` is auto, waiting
    for approval when approve); None with ``escalate`` set: tell a person
    (``headline``); None with neither: nothing now (``wait`` says why).
    ``walked``: every rung judged, in ladder order (refused ones with their
    reason), and ``rest`` the rungs after ``action`` that the loop would try
    next if it does not help: what ``artemis replay --policy`` prints.
    ``state``: the incident's new state (None: unchanged); ``plan_step``:
    the ladder position after this plan.  ``evidence``: root-side readings the
    decision read that the incident's evidence should show (a link's fabric
    counters, with the peers' values).
    """

    plan_step: int
    action: Step | None = None
    escalate: str | None = None
    recommended: tuple[str, ...] = ()
    state: IncidentState | None = None
    wait: str | None = None
    dry_run: bool = False
    walked: tuple[Step, ...] = ()
    rest: tuple[Step, ...] = ()
    notes: tuple[Note, ...] = ()
    evidence: tuple[Evidence, ...] = ()


def drain_reason(incident_id: str, cause: str, rank: int | None, ratio: float | None) -> str:
    """``artemis: INC-17 gpu.clocks rank 2 1.19x``"""
    parts = [REASON_PREFIX, incident_id, cause]
    if rank is not None:
        parts.append(f"rank {rank}")
    if ratio is not None:
        parts.append(f"{ratio:.2f}x")
    return " ".join(parts)[:MAX_REASON]


def target_of(inc: Incident, kind: str) -> str | None:
    if kind in ("drain", "correct"):
        return inc.node or inc.link  # a link incident acts on the node whose link it is
    if kind == "rebalance":
        return f"{inc.job}:{inc.rank}" if inc.rank is not None else None
    return inc.job


def params_of(inc: Incident, kind: str, step: str, gpu: int | None) -> dict[str, Any]:
    """What an action needs to be performed (stored with its intent)."""
    if kind == "rebalance" and inc.rank is not None:
        share = round(min(1.0, 1.0 / max(inc.ratio or 1.0, 1e-6)), 3)
        return {"job": inc.job, "step": step, "shares": {str(inc.rank): share}}
    if kind == "correct":
        kind_name = "restore_power_limit" if inc.cause is Cause.GPU_POWER else "reset_clocks"
        return {"node": inc.node, "kind": kind_name, "gpu": gpu}
    if kind == "drain":
        return {"node": inc.node or inc.link, "job": inc.job,
                "reason": drain_reason(inc.id, inc.cause.value, inc.rank, inc.ratio)}
    return {"job": inc.job}


def deviates(e: Evidence, ratio: float | None, min_slowdown: float) -> bool:
    """Is this evidence line a signal that differs, beyond the slowdown itself?

    ``ratio`` is the incident's (busy / the peers' busy): slower identical
    work on the subject is a finding only when it explains at least half of
    that excess, as a clock drop must (localize): one GEMM a few percent
    slower on a loaded host explains nothing of a rank 35 % slower.
    """
    if e.signal in SLOWDOWN_SIGNALS:
        return False
    if e.signal in ("probe.p2p_ms", "net_retransmits_per_s"):
        # Link hints that name no link.  Probes that agree on one make the
        # cause comm.link; on an unknown incident these are ring timings no
        # second probe agreed with (confirm.agree_on_link), or a node's
        # retransmit counter, which the *senders* to a slow link count (a
        # loaded host's TCP retransmits too): not a finding.
        return False
    if e.signal == "probe.gemm_ms" and isinstance(e.value, int | float) and isinstance(e.peers, int | float):
        # Identical work at peer speed says what is *not* wrong.
        excess = max(0.0, (ratio or 1.0) - 1.0)
        return e.peers > 0 and e.value / e.peers - 1.0 >= max(min_slowdown, 0.5 * excess)
    return True


def unknown_held(inc: Incident, config: Config, facts: Facts) -> str | None:
    """Why an ``unknown`` with no deviating signal is not (yet) worth a person's time; None once it is.

    Such an incident says only "this is slower": on a shared or loaded
    machine that is often the machine, not a fault.  It goes to a person
    once it has lasted ``UnknownEscalateAfter`` and still costs at least
    ``UnknownEscalateLoss`` % of the job's healthy samples/s.
    """
    if inc.cause is not Cause.UNKNOWN or any(deviates(e, inc.ratio, config.analysis.min_slowdown)
                                             for e in inc.evidence):
        return None
    d = config.daemon
    lasted = facts.now - (facts.opened_at if facts.opened_at is not None else facts.now)
    loss = facts.measured_loss_pct if facts.measured_loss_pct is not None else inc.loss_pct
    if lasted >= d.unknown_escalate_after and loss is not None and loss >= d.unknown_escalate_loss:
        return None
    return (f"cause unknown and no signal deviates; lasted {lasted:.0f} s of UnknownEscalateAfter="
            f"{d.unknown_escalate_after:.0f}, costs {loss if loss is not None else '?'} % of "
            f"UnknownEscalateLoss={d.unknown_escalate_loss:g} %")


def page_held(inc: Incident, config: Config, facts: Facts) -> str | None:
    """Why paging a person about this incident is not worth their time, or None.

    A page (an escalation, or a request to approve) spends a person's
    attention; below ``EscalateLoss`` % of the job's throughput it is not
    spent, whatever the cause.  The loss is the job's measured samples/s below
    healthy where it is measured — a subject whose measured loss is ~0 costs
    nobody anything, whatever its ratio — else the analysis' estimate; where
    neither is known, the person is told.
    """
    loss = facts.measured_loss_pct if facts.measured_loss_pct is not None else inc.loss_pct
    floor = config.daemon.escalate_loss
    if loss is None or loss >= floor:
        return None
    which = "measured" if facts.measured_loss_pct is not None else "estimated"
    return (f"costs {loss:.2f} % of the job's throughput ({which}), below EscalateLoss={floor:g} %: "
            "not worth a person's time while it stays there")


# --- price -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Price:
    """A rung's cost against the slowdown's, in GPU-hours; ``pays`` when acting costs less."""

    pays: bool
    why: str


def slowdown_loss(inc: Incident, facts: Facts) -> float | None:
    """The share of the job's throughput the slowdown costs (0..1): measured if known, else loss_pct."""
    pct = facts.measured_loss_pct if facts.measured_loss_pct is not None else inc.loss_pct
    return None if pct is None else max(0.0, min(100.0, pct)) / 100.0


def rung_cost(kind: str, inc: Incident, pol: PartitionPolicy, facts: Facts) -> Price:
    """Does this rung pay?  Compared in GPU-hours, with the numbers in ``why``.

    A rebalance and a correction cost nothing worth weighing (undone by a
    directive; a clock or power-limit reset takes seconds, no restart).  A
    drain costs the running job nothing (it keeps the next jobs off a faulty
    node, within the drain budget); the requeue that follows it throws away,
    on every GPU of the job, the work since the last checkpoint (half a
    ``CheckpointInterval`` expected) plus a ``RestartCost``.  The slowdown
    costs its loss on every GPU for as long as it is expected to last: for
    hardware (``PERSISTENT_CAUSES``) until the job ends, for anything else no
    longer than ``TransientFaultTime``.  Without a known time left the
    slowdown's cost is unbounded and any rung pays.
    """
    if kind != "requeue":
        return Price(True, "")
    gpus = facts.gpus or 1
    lost_h = (pol.checkpoint_interval / 2.0 + pol.restart_cost) / 3600.0
    cost = gpus * lost_h
    cost_text = (f"requeue costs {gpus} GPU x ({pol.checkpoint_interval / 2.0 / 60:.0f} min since the last "
                 f"checkpoint + {pol.restart_cost / 60:.0f} min restart) = {cost:.2f} GPU-h")
    loss = slowdown_loss(inc, facts)
    if loss is None:
        return Price(True, f"{cost_text}; the slowdown's loss is not measured: acting")
    horizon = facts.time_left_s
    if horizon is None and facts.unlimited:
        horizon = pol.unlimited_job_horizon  # never the year Slurm gives such a job as its end
    if inc.cause not in PERSISTENT_CAUSES:
        horizon = pol.transient_fault_time if horizon is None else min(horizon, pol.transient_fault_time)
    if horizon is None:
        return Price(True, f"{cost_text}; the job's time left is not known: the slowdown's cost is unbounded")
    saved = gpus * loss * horizon / 3600.0
    verdict = "acting pays" if saved > cost else "waiting is cheaper"
    over = (f" (no time limit: over UnlimitedJobHorizon={pol.unlimited_job_horizon / 3600.0:g} h)"
            if facts.time_left_s is None and facts.unlimited and horizon == pol.unlimited_job_horizon else "")
    return Price(saved > cost, f"{cost_text}; the slowdown costs {gpus} GPU x {100 * loss:.1f} % x "
                               f"{horizon / 3600.0:.2f} h{over} = {saved:.2f} GPU-h: {verdict}")


# --- the plan ------------------------------------------------------------------------------------


def ladder_of(inc: Incident, recur_escalate: int) -> tuple[str, ...]:
    """The ladder for this incident: from the analysis' remedy, or straight to a person for a
    device that keeps coming back (its correction or its rebalance does not hold)."""
    if recur_escalate and len(inc.recurrences) >= recur_escalate:
        return ("escalate",)
    return policy.ladder(propose(inc.kind, inc.cause, inc.node, inc.job, link=inc.link).kind)


def judge(kind: str, inc: Incident, config: Config, pol: PartitionPolicy, facts: Facts, step: str) -> Step:
    """One rung judged against the policy, the evidence, the budgets, the cooldowns and its price."""
    target = target_of(inc, kind)
    if kind == "rebalance" and not facts.rebalance_opt_in:
        # Rebalancing is opt-in (the user guide): a job that does not read
        # its work shares would only lose time to it.
        return Step(kind, target, "recommend", f"job {inc.job} did not opt in to rebalancing (no "
                                               f"WeightedDistributedSampler or work_share() in its ranks)")
    d = config.daemon
    if not d.enabled and kind != "escalate":
        return Step(kind, target, "recommend", "Enabled=no: the kill switch is on")
    corroboration = (True, "")
    if kind in actions.HARD:
        ev = facts.node_evidence
        corroboration = policy.corroborated(
            inc, ev[1] if ev else None, policy.evidence_age(ev[0], ev[1], facts.now) if ev else None,
            d.evidence_max_age, d.hard_action_evidence, config.analysis.min_slowdown, facts.gpu,
            fresh_peers(facts, d.evidence_max_age))
    budget = (True, "")
    if kind == "drain":
        budget = drain_budget(pol, facts)
    cooldown_left = 0.0
    if target is not None and target in facts.last_action:
        cooldown_left = max(0.0, facts.last_action[target] + pol.cooldown - facts.now)
    decision = policy.decide(kind, pol, target=target, corroboration=corroboration, budget=budget,
                             cooldown_left=cooldown_left)
    params = params_of(inc, kind, step, facts.gpu)
    if decision.mode == "recommend":
        return Step(kind, target, "recommend", decision.why, params)
    # A drain's price is its requeue's: said now, weighed once the node is drained (``after_drain``).
    price = rung_cost("requeue" if kind == "drain" and policy.mode_of(pol, "requeue") != "recommend" else kind,
                      inc, pol, facts)
    if not price.pays and kind != "drain":
        return Step(kind, target, "recommend", price.why, params)
    why = f"{decision.why}; {price.why}" if price.why else decision.why
    return Step(kind, target, decision.mode, why, params)


def peer_nodes(inc: Incident, job_nodes: Sequence[str]) -> tuple[str, ...]:
    """The job's other nodes whose root-side events a decision reads (``Facts.peer_evidence``): only a
    link's fabric counters are judged against peers, and a median of ``PEERS_READ`` of them is plenty."""
    if inc.cause is not Cause.COMM_LINK:
        return ()
    return tuple(n for n in job_nodes if n != inc.node and n != inc.link)[:PEERS_READ]


def fabric_evidence(inc: Incident, facts: Facts, max_age_s: float) -> tuple[Evidence, ...]:
    """A link incident's node's fabric readings that convict its link, each with the peers' value, as
    the incident shows them (from its latest root-side event at most ``max_age_s`` old)."""
    ev = facts.node_evidence
    if inc.cause is not Cause.COMM_LINK or ev is None or policy.evidence_age(ev[0], ev[1], facts.now) > max_age_s:
        return ()
    return tuple(Evidence(signal=f.signal, value=f.value, peers=f.peers,
                          note=f"root-side node check on {inc.link or inc.node}: {f.where} {f.note}")
                 for f in fabric.findings(ev[1], fresh_peers(facts, max_age_s)))


def fresh_peers(facts: Facts, max_age_s: float) -> tuple[dict[str, Any], ...]:
    """The job's other nodes' root-side events at most ``max_age_s`` old (EvidenceMaxAge)."""
    return tuple(body for received, body in facts.peer_evidence
                 if policy.evidence_age(received, body, facts.now) <= max_age_s)


def corroboration_due(inc: Incident, config: Config, pol: PartitionPolicy, facts: Facts,
                      kind: str | None) -> str | None:
    """Why a hard rung waits for the node's root-side check to look again (None: it does not).

    A node check runs every few seconds to minutes; an incident confirmed two
    windows after its fault began can be decided before the check has looked
    at the node since.  Its latest report then predates the fault, and a
    "not corroborated" from it says nothing about the fault: the rung waits for
    a report measured after the incident opened, at most
    ``CORROBORATION_WAIT_S``, and is then judged on what there is (seen on the
    test cluster at the shipped ``ConfirmWindows``: a hot GPU confirmed 3 s
    after its fault, 2 s before the node check looked, was escalated instead of
    drained).  Only for a rung the policy would run or ask approval for.
    """
    if kind not in actions.HARD or facts.opened_at is None or inc.node is None:
        return None
    if policy.mode_of(pol, kind) == "recommend" or not config.daemon.enabled:
        return None  # the rung will not run whatever the check says: nothing to wait for
    if facts.now - facts.opened_at >= CORROBORATION_WAIT_S:
        return None
    ev = facts.node_evidence
    age = policy.evidence_age(ev[0], ev[1], facts.now) if ev is not None else None
    if age is not None and facts.now - age >= facts.opened_at:
        return None  # the check has looked since the incident opened: its word stands
    d = config.daemon
    seen, _ = policy.corroborated(inc, ev[1] if ev else None, age, d.evidence_max_age, d.hard_action_evidence,
                                  config.analysis.min_slowdown, facts.gpu, fresh_peers(facts, d.evidence_max_age))
    if seen:
        return None
    return (f"{kind} {target_of(inc, kind) or ''} needs root-side corroboration, and the node check on {inc.node} "
            f"has not looked since the incident opened: decided with its next report (at most "
            f"{CORROBORATION_WAIT_S:.0f} s)")


def drain_budget(pol: PartitionPolicy, facts: Facts, approving: int | None = None) -> tuple[bool, str]:
    """The partition's drain budget, from Slurm's node states and Artemis' drains.

    Deciding counts drains waiting for approval; approving one (``approving``)
    does not count the others that still wait.
    """
    if not facts.nodes:
        return False, f"drain budget unknown: the nodes of partition {facts.partition!r} could not be listed"
    use = policy.budget_use(facts.nodes, list(facts.drains), facts.now, waiting=approving is None,
                            exclude=approving)
    return policy.drain_budget(pol, use)


def plan(inc: Incident, plan_step: int, config: Config, facts: Facts, step: str = "0") -> Plan:
    """The decision for a confirmed, unresolved, denied or escalated incident (see the module doc).

    A plan that would page a person (``escalate``) for a loss below
    ``EscalateLoss`` waits instead (``page_held``), its ladder where it was.
    """
    decided = _plan(inc, plan_step, config, facts, step)
    if decided.wait is None:
        decided = replace(decided, evidence=fabric_evidence(inc, facts, config.daemon.evidence_max_age))
    if decided.escalate is None:
        return decided
    held = page_held(inc, config, facts)
    if held is None:
        return decided
    return Plan(plan_step, wait=held, notes=(Note("policy", "not escalated: below EscalateLoss", held),))


def _plan(inc: Incident, plan_step: int, config: Config, facts: Facts, step: str) -> Plan:
    if inc.kind is IncidentKind.JOB and facts.awaiting_probe:
        return Plan(plan_step, wait="the matched probe that may name the link is due: decided with its answer")
    held = unknown_held(inc, config, facts)
    if held:
        return Plan(plan_step, wait=held, notes=(Note("policy", "not escalated yet", held),))
    pol = config.policy_for(facts.partition)
    rungs = ladder_of(inc, config.daemon.recur_escalate)
    due = corroboration_due(inc, config, pol, facts, rungs[plan_step] if plan_step < len(rungs) else None)
    if due:
        return Plan(plan_step, wait=due, notes=(Note("policy", "waiting for the node check", due),))
    notes: list[Note] = []
    if rungs == ("escalate",) and inc.recurrences:
        notes.append(Note("policy", "escalated: keeps coming back",
                          f"{len(inc.recurrences)} recurrences (RecurEscalate={config.daemon.recur_escalate})"))
    walked: list[Step] = []
    recommended: list[str] = []
    position = plan_step
    while position < len(rungs):
        kind = rungs[position]
        position += 1
        if kind == "escalate":
            walked.append(Step("escalate", inc.job, "auto", "escalation is always allowed"))
            rest = tuple(judge(k, inc, config, pol, facts, step) for k in rungs[position:])
            return _escalation(inc, position, notes, walked, recommended, "needs a person", rest)
        rung = judge(kind, inc, config, pol, facts, step)
        walked.append(rung)
        if kind == "rebalance" and not facts.rebalance_opt_in:
            notes.append(Note("policy", f"rebalance {rung.target or ''}: skipped", rung.why))
            continue
        notes.append(Note("policy", f"{kind} {rung.target or ''}: {rung.mode}", rung.why))
        if rung.mode == "recommend":
            recommended.append(f"{kind} {rung.target or ''}".strip() + f" ({rung.why})")
            continue
        rest = tuple(judge(k, inc, config, pol, facts, step) for k in rungs[position:])
        if config.daemon.dry_run:
            notes.append(Note("daemon", f"dry-run: would {kind} {rung.target}", rung.why))
            return Plan(position, action=rung, recommended=tuple(recommended), dry_run=True,
                        walked=tuple(walked), rest=rest, notes=tuple(notes))
        if rung.mode == "auto":
            return Plan(position, action=rung, recommended=tuple(recommended), state=S.ACTING,
                        walked=tuple(walked), rest=rest, notes=tuple(notes))
        headline = f"{kind} {rung.target} awaits approval (artemis approve {inc.id})"
        return Plan(position, action=rung, escalate=headline, recommended=tuple(recommended),
                    state=None if inc.state is S.ESCALATED else S.ESCALATED,
                    walked=tuple(walked), rest=rest, notes=tuple(notes))
    # Every rung used (the escalation included): a person has it; never leave it silent.
    if inc.state is S.ESCALATED:
        return Plan(position, recommended=tuple(recommended), walked=tuple(walked), notes=tuple(notes))
    return _escalation(inc, position, notes, walked, recommended, "needs a person", ())


def _escalation(inc: Incident, position: int, notes: list[Note], walked: list[Step], recommended: list[str],
                headline: str, rest: tuple[Step, ...]) -> Plan:
    # A dry run escalates too: it tells people what it would have done (the escalation says so).
    return Plan(position, action=None, escalate=headline, recommended=tuple(recommended),
                state=None if inc.state is S.ESCALATED else S.ESCALATED,
                walked=tuple(walked), rest=rest, notes=tuple(notes))


# --- after an action -------------------------------------------------------------------------------


@dataclass(frozen=True)
class FollowUp:
    """What comes after an action completed: another action (``kind`` with ``params``), an
    escalation (``escalate`` headline), or verification (neither)."""

    kind: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    escalate: str | None = None


def after_drain(inc: Incident, pol: PartitionPolicy, facts: Facts, rung_approved: bool) -> FollowUp:
    """The node is drained; the running job still sits on it: requeue it elsewhere, or tell a person.

    Approving the drain rung approves its requeue too (one decision per rung).
    A requeue that costs more than the slowdown (``rung_cost``) is not done: the
    drain keeps the next jobs off the node and the job finishes where it is.
    """
    node = inc.node or inc.link
    mode = policy.mode_of(pol, "requeue")
    if mode == "auto" or (mode == "approve" and rung_approved):
        price = rung_cost("requeue", inc, pol, facts)
        if price.pays:
            return FollowUp("requeue", {"job": inc.job, "node": node})
        return FollowUp(escalate=f"drained {node}; the job keeps running on it: {price.why}")
    why = "requeue is not allowed" if mode == "recommend" else "requeue needs approval"
    return FollowUp(escalate=f"drained {node}; the job still runs on it and needs a restart ({why})")


def rung_happened(kind: str, status: str) -> bool:
    """Does the rung count as done (verify it) after this action ended with ``status``?

    A ``constrain`` is the tail of a drain and a requeue that did happen: when it
    cannot narrow the job (a released job can start before the next turn, and
    Features change only while it is pending) the rung is still verified on what
    was done; any other action that did not complete did not happen.
    """
    return status == "done" or kind == "constrain"


def after_requeue(inc: Incident, pol: PartitionPolicy) -> FollowUp:
    """A requeued job may also be narrowed to nodes with the site's health feature (``Constraint=``)."""
    if pol.constraint and policy.mode_of(pol, "constrain") != "recommend":
        return FollowUp("constrain", {"job": inc.job, "feature": pol.constraint})
    return FollowUp()


# --- when the job ends -------------------------------------------------------------------------------




@dataclass(frozen=True)
class JobEnd:
    """What an incident still open when Slurm says its job ended becomes (``after_job_end``).

    ``state``: its end state, a legal transition from where it was (or the
    same state, for one already ``unresolved``); ``tell``: a person was paged
    about it and gets one mail saying it ended with its job; ``withdrawn``: its
    actions that never began (or waited for approval) and no longer apply.
    """

    state: IncidentState
    tell: bool
    withdrawn: tuple[int, ...] = ()


def told_a_person(kind: str, status: str, params: Mapping[str, Any]) -> bool:
    """An escalation reached someone: it was sent, or its AdminComment or mail went out before a retry."""
    return kind == "escalate" and (status == "done" or bool(params.get("comment_done") or params.get("mail_done")))


def after_job_end(state: IncidentState, rows: Iterable[tuple[int, str, str, Mapping[str, Any]]]
                  ) -> JobEnd | None:
    """An incident of a job that ended: its end state, whether to tell a person, what is withdrawn.
    None where it is closed already.  ``rows``: its actions' (id, kind, status, params).

    Never ``resolved``: nothing showed the fault gone, only the job stopped
    running on it.  A suspect was never confirmed: ``dismissed``.  Anything
    confirmed ends ``unresolved`` (escalated, acting and verifying may go
    there; unresolved stays), which is what a person reading it should
    believe: the cause, if it was the machine, may still be there.
    """
    if not TRANSITIONS[state]:
        return None
    rows = list(rows)
    # An escalation waiting to be retried (its AdminComment or mail failed, status running) has told
    # nobody yet: it is withdrawn like a queued one, else it pages a person about a closed incident
    # after the job ended (seen on the test cluster: "Job has already finished", retried 5 s later).
    withdrawn = tuple(action_id for action_id, kind, status, params in rows
                      if status == "pending_approval"
                      or (status == "queued" and kind not in actions.STILL_DUE_AFTER_THE_JOB)
                      or (status == "running" and kind == "escalate" and not told_a_person(kind, status, params)))
    if state is S.SUSPECT:
        return JobEnd(S.DISMISSED, tell=False, withdrawn=withdrawn)
    told = any(told_a_person(kind, status, params) for _, kind, status, params in rows)
    return JobEnd(S.UNRESOLVED, tell=told, withdrawn=withdrawn)
