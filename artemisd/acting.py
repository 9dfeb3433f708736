"""The acting half of the daemon, live: gather the facts, let the pure code decide, apply the effects.

Each step is ``apply(reconcile.X(gather()))``: what the incident, its action rows, Slurm, the analyzer
and the node evidence say is read here; ``decide``, ``verify`` and ``control/reconcile.py`` decide
what it makes of the incident; ``apply`` writes the action rows, messages and audit lines through the
ledger and then the incident.  The simulated loop (``sim/loop.py``) runs the same decisions with its
own gather and apply; ``tests/unit/test_loop_parity.py`` holds them to the same outcomes.

The steps, in a leader's turn (``turn``): the incidents to decide, the actions due (carried out by
``performing.Performer``, which calls back ``after_action``), the incidents verifying, and the ones
whose subject the analysis saw healthy again.  Between turns: the analyzer's updates (``publish``),
a person's approval or denial (``approve``), a job's end (``end_incidents``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from artemisd import decide, loss, policy, verify
from artemisd.act import Actuator, Outcome
from artemisd.auth import Principal
from artemisd.config import Config
from artemisd.control import apply as control_apply
from artemisd.control import reconcile
from artemisd.incident import Incident, IncidentKind, IncidentState
from artemisd.job_memory import JobMemory
from artemisd.ledger import Ledger, subject_of
from artemisd.metrics import Metrics
from artemisd.performing import AddDirective, Performer
from artemisd.pipeline import Analyzer
from artemisd.runs import split_run
from artemisd.slurm.api import JobInfo, NodeInfo, SlurmBackend, SlurmError
from artemisd.store import ActionRow, StateStore, StoredIncident

S = IncidentState
FINAL = (S.RESOLVED.value, S.DISMISSED.value)
VERIFY_SILENCE_S = 3600.0  # a verifying job silent this long is judged unresolved ("cannot be measured")

log = structlog.get_logger("artemisd")

JobInfoRead = Callable[..., Awaitable[JobInfo | None]]


def closed(stored: StoredIncident) -> bool:
    """Nothing more is decided or done about it: resolved, dismissed, or ended with its job (whose
    ``unresolved`` the life cycle would otherwise let act again)."""
    return stored.state in FINAL or stored.body.get("ended_with_job") is not None


class Acting:
    """The daemon's acting half (see the module doc).  ``bound`` (analyzer incident id -> the
    daemon's) and ``probe_due`` (analyzer incident id -> when its matched probe expires) are the
    daemon's, shared: intake binds incidents and issues probes, this reads them."""

    def __init__(self, config: Config, store: StateStore, ledger: Ledger, analyzer: Analyzer, slurm: SlurmBackend,
                 metrics: Metrics, memory: JobMemory, clock: Callable[[], float], job_info: JobInfoRead,
                 add_directive: AddDirective, bound: dict[str, str], probe_due: dict[str, float]):
        self.config = config
        self.store = store
        self.ledger = ledger
        self.analyzer = analyzer
        self.slurm = slurm
        self.metrics = metrics
        self.memory = memory
        self.clock = clock
        self._job_info = job_info
        self._add_directive = add_directive
        self._bound = bound
        self._probe_due = probe_due
        self.performer = Performer(lambda: self.config, store, ledger, Actuator(slurm), metrics, clock, add_directive,
                                   self.after_action)
        self._held: set[str] = set()  # incidents whose "not escalated yet" was audited
        self._not_back: set[str] = set()  # incidents whose "subject healthy, throughput not back" was audited

    async def turn(self, now: float) -> None:
        """A leader's turn of the acting half: decide, run what is due, verify, close what recovered."""
        for stored in self.store.incidents(states=[S.CONFIRMED, S.UNRESOLVED, S.ESCALATED], decide=True):
            await self.decide(stored, now)
        for row in self.store.due_actions(now):
            await self.performer.run(row)
        for stored in self.store.incidents(states=[S.VERIFYING]):
            self.verify(stored, now)
        analyzer_ids = {daemon_id: analyzer_id for analyzer_id, daemon_id in self._bound.items()}
        for stored in self.store.incidents(states=[S.CONFIRMED, S.ESCALATED, S.UNRESOLVED]):
            if stored.id in analyzer_ids and not closed(stored) \
                    and not self.analyzer.subject_active(analyzer_ids[stored.id]):
                self.close_recovered(stored, now)

    def _audit(self, incident: str | None, who: str, what: str, why: str = "", result: str = "",
               action: int | None = None, now: float | None = None) -> None:
        self.ledger.audit(incident, who, what, why, result, action, now)

    def publish(self, update: Incident, now: float) -> None:
        """The analyzer's latest word on an incident: opened, or merged into the stored one
        (``reconcile.on_analysis``)."""
        daemon_id = self._bound.get(update.id)
        stored = self.store.incident(daemon_id) if daemon_id else None
        if stored is None:
            if update.state is S.DISMISSED:
                return  # never published as suspect (e.g. absorbed before we saw it)
            # An ongoing incident whose history was pruned before a restart: same subject, not closed.
            bound = set(self._bound.values())
            for inc in self.store.incidents(job=update.job):
                if inc.subject == subject_of(update) and not closed(inc) and inc.id not in bound:
                    stored = inc
                    break
        new = stored is None
        if stored is None:
            stored = self.ledger.open(update, self.memory.steps.get(update.job, "0"), now)
        self._bound[update.id] = stored.id
        was = S.SUSPECT if new else IncidentState(stored.state)
        change = reconcile.on_analysis(Incident.model_validate(stored.body), update, was, stored.plan_step,
                                       self.store.actions_of(stored.id), closed(stored))
        if change.confirmed:
            stored.baseline = loss.baseline(self.analyzer.throughput(update.job, stored.step or "0"),
                                              update.onset_window)
        self.apply(stored, change, now)

    def end_incidents(self, job: str, info: JobInfo | None, now: float) -> None:
        """Each incident of an ended job still open gets its end state (``decide.after_job_end``), a
        record of it (``ended_with_job``) and an audit line; a person paged about it gets one mail.
        What the store says is all there is to it, so a restart neither closes nor mails twice."""
        job_state = info.state if info is not None else None
        for stored in self.store.incidents(job=job):
            if not closed(stored):
                self.apply(stored, reconcile.on_job_end(Incident.model_validate(stored.body),
                                                        self.store.actions_of(stored.id), job, job_state, now), now)

    async def decide(self, stored: StoredIncident, now: float) -> None:
        """Gather the facts, let ``decide.plan`` decide, apply the plan and record why."""
        # Ask Slurm first; then re-read the incident, which ingest may have updated meanwhile.
        # Slurm unreachable: the decision waits for the next turn (policy needs the partition).
        try:
            info = await self._job_info(stored.job, strict=True)
            partition = info.partition if info else self.store.job_partition(stored.job)
            nodes = await self._nodes_of(partition)
        except SlurmError as err:
            log.warning("decision postponed: Slurm unreachable", incident=stored.id, error=str(err))
            return
        fresh = self.store.incident(stored.id)
        if fresh is None or not fresh.decide:
            return
        stored = fresh
        inc = Incident.model_validate(stored.body)
        facts = self._facts(stored, inc, partition, nodes, now, info)
        step = split_run(stored.step or "0")[0]
        plan = decide.plan(inc, stored.plan_step, self.config, facts, step)
        self.apply(stored, reconcile.on_plan(inc, plan, self.store.actions_of(stored.id), stored.id in self._held),
                    now)

    def _facts(self, stored: StoredIncident, inc: Incident, partition: str | None,
               nodes: tuple[NodeInfo, ...], now: float, info: JobInfo | None = None) -> decide.Facts:
        """What the decision needs, read from the store, the analyzer and Slurm (``nodes``, read just now)."""
        evidence = self.store.node_evidence(inc.node) if inc.node else None
        peers = tuple(ev for n in decide.peer_nodes(inc, info.nodes if info is not None else ())
                      if (ev := self.store.node_evidence(n)) is not None)
        targets = {t for t in (inc.node, inc.link, inc.job, f"{inc.job}:{inc.rank}") if t}
        last = {t: when for t in targets if (when := self.store.last_action_on(t, inc.id)) is not None}
        series = self.analyzer.throughput(inc.job, self.memory.run_key(inc.job, stored.step or "0"))
        return decide.Facts(
            now=now, partition=partition, nodes=nodes,
            drains=self._drains(), last_action=last, rebalance_opt_in=inc.job in self.memory.rebalance_opt_in,
            node_evidence=evidence, peer_evidence=peers, gpu=self._gpu_of(inc),
            awaiting_probe=inc.kind is IncidentKind.JOB and self._awaiting_probe(stored, now),
            opened_at=stored.created,
            measured_loss_pct=loss.incident_loss(stored.baseline, series, inc.onset_window, bool(inc.recurrences)),
            gpus=self.memory.world.get(inc.job), time_left_s=info.time_left(now) if info is not None else None,
            unlimited=info is not None and info.unlimited)

    def _drains(self) -> tuple[policy.DrainRecord, ...]:
        return tuple(policy.DrainRecord(*row) for row in self.store.drain_actions())

    def _gpu_of(self, inc: Incident) -> int | None:
        return self.memory.gpu_of(inc.job, inc.rank)

    def _awaiting_probe(self, stored: StoredIncident, now: float) -> bool:
        """A matched probe was issued for this incident and has neither answered nor expired.

        A job-wide slowdown has no suspect to name until the probes time the
        links: deciding before they answer sends an escalation that says
        "unknown job" and is stale seconds later.
        """
        due = self._probe_due.get(stored.analyzer_id or "")
        if due is None or now >= due or not self.analyzer.probe_outstanding(stored.analyzer_id or ""):
            self._probe_due.pop(stored.analyzer_id or "", None)
            return False
        return True

    async def _nodes_of(self, partition: str | None) -> tuple[NodeInfo, ...]:
        """The partition's nodes and states, read from Slurm now (raises SlurmError): budgets
        must see a person's ``scontrol update State=RESUME`` at once, so this is never cached."""
        if not partition:
            return ()
        try:
            return await asyncio.to_thread(self.slurm.partition_nodes, partition)
        except SlurmError:
            self.metrics.backend_errors.labels("slurm").inc()
            raise

    async def after_action(self, row: ActionRow, outcome: Outcome, now: float) -> None:
        """What an action's outcome means for its incident (``reconcile.after_action``)."""
        # Slurm first (it awaits), then the incident as it is now.
        info = await self._job_info(row.params.get("job") or "", fresh=True) if row.kind in ("drain", "requeue") else None
        stored = self.store.incident(row.incident)
        if stored is None:
            return
        inc = Incident.model_validate(stored.body)
        pol = facts = None
        if reconcile.follows_up(row.kind, outcome.status):
            pol = self.config.policy_for(info.partition if info else self.store.job_partition(inc.job))
            if row.kind == "drain":  # its requeue is priced on the decision's facts
                facts = self._facts(stored, inc, info.partition if info else None, (), now, info)
        action_window = self._last_window(inc, stored)
        change = reconcile.after_action(inc, row, outcome.status, self.store.actions_of(stored.id), pol, facts,
                                        self._throughput(stored, inc, action_window))
        if change.acted:
            stored.action_window = action_window
        self.apply(stored, change, now)

    def _throughput(self, stored: StoredIncident, inc: Incident, action_window: int | None = None
                    ) -> reconcile.Throughput | None:
        """The healthy throughput and the slowed one, from the onset to the action, of the run the fault
        was seen in, for ``reconcile.slowed_result`` to freeze; None once the result holds them."""
        if inc.result is not None and inc.result.throughput_before is not None:
            return None
        step = stored.step or "0"
        window = action_window if action_window is not None else stored.action_window
        seconds = verify.seconds_by_window(self.analyzer.window_shapes(inc.job, step))
        return stored.baseline, loss.during(self.analyzer.throughput(inc.job, step), inc.onset_window, window, seconds)

    def apply(self, stored: StoredIncident, change: reconcile.Change, now: float) -> None:
        """Carry a ``reconcile.Change`` out through the ledger (``LedgerSink``)."""
        control_apply.apply(change, LedgerSink(self, stored, now))

    def _last_window(self, inc: Incident, stored: StoredIncident) -> int | None:
        """The newest window the job had begun before the action was done: verification starts after it.

        Not the newest *analysed* window: that can lag the job by the windows
        whose slowed rank has not reported yet, and those ran under the fault.
        """
        step = stored.step or "0"
        series = self.analyzer.throughput(inc.job, step)
        analysed = series[-1][0] if series else None
        newest = self.analyzer.newest_window(inc.job, step)
        return max((w for w in (analysed, newest) if w is not None), default=None)

    def verify(self, stored: StoredIncident, now: float) -> None:
        """Gather the windows and the nodes' evidence, let ``verify.verdict`` judge, apply it."""
        inc = Incident.model_validate(stored.body)
        rows = self.store.actions_of(inc.id)
        done = [(row.id, row.kind, row.target) for row in rows if row.status == "done"]
        still = {target: self._fault_still_shown(inc, target) for _, kind, target in done
                 if kind == "drain" and target}
        verdict = verify.verdict(inc.kind.value, inc.cause.value, self._evidence(stored, inc),
                                 verify.Rules.of(self.config.daemon), now, VERIFY_SILENCE_S, done, still, job=inc.job)
        self.apply(stored, reconcile.on_verdict(inc, verdict, rows, self._throughput(stored, inc),
                                                 self.config.daemon.dry_run), now)

    def _evidence(self, stored: StoredIncident, inc: Incident) -> verify.Evidence:
        """The windows verification reads: the run the fault was seen in, and the run being judged."""
        origin = stored.step or "0"
        current = self.memory.run_key(inc.job, origin)
        origin_shapes = self.analyzer.window_shapes(inc.job, origin)
        return verify.Evidence(stored.baseline, origin_shapes,
                               origin_shapes if current == origin else self.analyzer.window_shapes(inc.job, current),
                               current != origin, inc.onset_window, stored.action_window,
                               self.store.job_last_seen(inc.job))

    def _fault_still_shown(self, inc: Incident, node: str | None) -> str | None:
        """What the node's latest root-side evidence still shows of the incident's cause (None: nothing)."""
        evidence = self.store.node_evidence(node) if node else None
        if evidence is None:
            return None
        seen = policy.root_side_shows(inc.cause, evidence[1], self._gpu_of(inc))
        if seen is None:
            return None
        return (f"its latest root-side evidence ({self.clock() - evidence[0]:.0f} s old) still shows {seen}; "
                f"not resumed")

    def close_recovered(self, stored: StoredIncident, now: float) -> None:
        """The analyzer saw the subject healthy again: close it once the job's throughput agrees
        (``reconcile.on_recovered``), judged on the job's latest ``VerifyWindows`` windows as a
        verification would judge them."""
        rows = self.store.actions_of(stored.id)
        if reconcile.acting_on(rows):
            return
        inc = Incident.model_validate(stored.body)
        verdict = None
        if stored.baseline is not None:
            rules = verify.Rules.of(self.config.daemon)
            since = verify.latest_since(self.analyzer.window_shapes(inc.job, self.memory.run_key(inc.job, stored.step or "0")),
                                        rules)
            if since is None:
                return
            verdict = verify.measure(inc.kind.value, inc.cause.value, self._evidence(stored, inc), rules, since=since)
        self.apply(stored, reconcile.on_recovered(inc, verdict, rows, stored.id in self._not_back,
                                                   self._throughput(stored, inc), self.config.daemon.dry_run), now)

    async def approve(self, incident_id: str, principal: Principal, approve: bool) -> dict[str, Any]:
        """A person's decision on the action waiting for approval.

        Approving a drain re-checks the partition's drain budget against Slurm
        first; beyond it the approval is refused (``ValueError`` naming the
        budget) and the drain keeps waiting.  Slurm unreachable: refused too.
        """
        stored = self.store.incident(incident_id)
        if stored is None:
            raise KeyError(incident_id)
        pending = [r for r in self.store.actions_of(incident_id) if r.status == "pending_approval"]
        if not pending:
            raise ValueError(f"{incident_id} has no action waiting for approval")
        row = pending[-1]
        if approve and row.kind == "drain":
            await self._approval_budget(stored, row, principal)
            # The Slurm reads awaited: re-read what a concurrent request may have changed.
            stored = self.store.incident(incident_id)
            if stored is None or not any(r.id == row.id and r.status == "pending_approval"
                                         for r in self.store.actions_of(incident_id)):
                raise ValueError(f"{incident_id} has no action waiting for approval")
        now = self.clock()
        change = reconcile.on_approval(Incident.model_validate(stored.body), row, principal.who, approve, now)
        self.apply(stored, change, now)
        return change.incident.contract_dict()

    async def _approval_budget(self, stored: StoredIncident, row: ActionRow, principal: Principal) -> None:
        try:
            info = await self._job_info(stored.job, strict=True)
            partition = info.partition if info else self.store.job_partition(stored.job)
            nodes = await self._nodes_of(partition)
        except SlurmError as err:
            raise ValueError(f"cannot check the drain budget, Slurm is unreachable ({err}): "
                             f"{row.kind} {row.target} still waits for approval") from None
        # The budget is all an approval re-checks: Slurm's nodes and Artemis' drains.
        budget = decide.Facts(now=self.clock(), partition=partition, nodes=nodes, drains=self._drains())
        ok, why = decide.drain_budget(self.config.policy_for(partition), budget, approving=row.id)
        if not ok:
            self._audit(stored.id, principal.who, f"approval of {row.kind} {row.target} refused", why,
                        action=row.id)
            raise ValueError(f"approval refused: {why}; {row.kind} {row.target} still waits for approval")

    def _save(self, stored: StoredIncident, inc: Incident, reopening: bool = False) -> None:
        self.ledger.save(stored, inc, reopening)


class LedgerSink:
    """Where the daemon carries a change out (``control.apply``): the action rows, messages to people and
    audit lines through the ledger first, then the incident that refers to them.  Intent first: a crash
    between the two decides or closes the incident again after the restart, which may say a thing twice
    (an escalation's "update:"; a job-end notice finds its own and is not queued again) but never loses
    one.  Queued actions are performed on later turns (``Performer``)."""

    def __init__(self, acting: Acting, stored: StoredIncident, now: float):
        self.acting = acting
        self.stored = stored
        self.now = now
        self.incident = stored.id

    def marks(self, change: reconcile.Change) -> None:
        if change.decide is not None:
            self.stored.decide = change.decide
        if change.plan_step is not None:
            self.stored.plan_step = change.plan_step
        for marks, mark in ((self.acting._held, change.held), (self.acting._not_back, change.not_back)):
            if mark:
                marks.add(self.stored.id)
            elif mark is False:
                marks.discard(self.stored.id)
        if change.reopened:
            self.stored.action_window = None

    def note(self, note: reconcile.Note) -> None:
        self.acting.ledger.audit(self.incident, note.who, note.what, note.why, note.result, note.action, self.now)

    def queue(self, queue: reconcile.Queue) -> None:
        self.acting.ledger.add_action(self.incident, queue.kind, queue.target, dict(queue.params), queue.status,
                                      self.now)

    def move(self, move: reconcile.Move) -> None:
        self.acting.ledger.update_action(move.action_id, move.status, move.detail)

    def approved(self, approved: reconcile.Approved) -> None:
        self.acting.ledger.set_action_params(approved.action_id, dict(approved.params))

    def reset_shares(self, reset: reconcile.ResetShares) -> None:
        directive_id = self.acting.store.next_id("rebalance", "RBL-")
        directive = {"type": "rebalance", "id": directive_id, "job": reset.job, "step": reset.step, "shares": {}}
        self.acting._add_directive(directive_id, "rebalance", reset.job, reset.step, self.incident, directive,
                                   self.now, None)
        self.acting.ledger.update_action(reset.action_id, "rolled_back", f"reset by {directive_id}")
        self.acting.ledger.audit(self.incident, "daemon", f"rebalance rolled back ({directive_id})", reset.why,
                                 now=self.now)

    def tell(self, tell: reconcile.Tell) -> None:
        if tell.kind == "escalate" and self.acting.config.daemon.dry_run:
            self.acting.ledger.audit(self.incident, "daemon", "dry-run: would escalate", tell.headline, now=self.now)
            return
        job = self.stored.job
        self.acting.ledger.add_action(self.incident, tell.kind, job, tell.message.params(job), "queued", self.now)

    def finish(self, change: reconcile.Change) -> None:
        if change.saved:
            self.acting._save(self.stored, change.incident, change.reopened)

