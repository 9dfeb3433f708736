"""Performing an action that is due: through the ``Actuator`` (Slurm), the node check (a correction),
the probe (a rebalance's shares) or mail and AdminComment (telling people).

Intent first: the row is marked ``running`` before anything is done, so a crash re-runs it through
the idempotent path.  A transient Slurm or mail error is retried with backoff; a permanent one fails
the action.  What the outcome means for the incident is the acting half's business
(``Acting.after_action``, through ``reconcile.after_action``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from artemisd import mail
from artemisd.act import Actuator, Outcome
from artemisd.config import Config
from artemisd.control import actions
from artemisd.ledger import Ledger
from artemisd.metrics import Metrics
from artemisd.slurm.api import SlurmError
from artemisd.store import ActionRow, StateStore

CORRECTION_TIMEOUT_S = 900.0  # a correction no node check picked up is a failed one

AddDirective = Callable[[str, str, str, str, str | None, dict[str, Any], float, float | None], None]
AfterAction = Callable[[ActionRow, Outcome, float], Awaitable[None]]


class Performer:
    def __init__(self, config: Callable[[], Config], store: StateStore, ledger: Ledger, actuator: Actuator,
                 metrics: Metrics, clock: Callable[[], float], add_directive: AddDirective, after_action: AfterAction):
        self._config = config  # read at each use: a SIGHUP reload replaces the acting half's
        self.store = store
        self.ledger = ledger
        self.actuator = actuator
        self.metrics = metrics
        self.clock = clock
        self._add_directive = add_directive
        self._after_action = after_action

    def _audit(self, incident: str | None, who: str, what: str, why: str = "", result: str = "",
               action: int | None = None) -> None:
        self.ledger.audit(incident, who, what, why, result, action)

    async def run(self, row: ActionRow) -> None:
        """Carry out one action that is due; its outcome goes to the acting half's ``after_action``."""
        stored = self.store.incident(row.incident)
        if stored is None:
            self.ledger.update_action(row.id, "failed", "incident vanished")
            return
        now = self.clock()
        if row.kind not in actions.TELL and not self._config().daemon.enabled:
            self.ledger.update_action(row.id, "skipped", "Enabled=no: the kill switch is on")
            self._audit(row.incident, "daemon", f"{row.kind} {row.target} skipped", "kill switch", action=row.id)
            await self._after_action(row, Outcome("skipped", "kill switch"), now)
            return
        if row.kind == "correct" and row.status == "running":
            await self._check_correction(row, now)
            return
        # Intent first: a crash after this line re-runs the action through the idempotent path.
        self.ledger.update_action(row.id, "running", row.detail, attempt=True)
        try:
            outcome = await self._perform(row, now)
        except (SlurmError, mail.MailError) as err:
            backend = "smtp" if isinstance(err, mail.MailError) else "slurm"
            self.metrics.backend_errors.labels(backend).inc()
            permanent = isinstance(err, SlurmError) and not err.transient
            if permanent:
                outcome = Outcome("failed", str(err))
            else:
                daemon = self._config().daemon
                delay = min(daemon.retry_backoff * 2 ** row.attempts, daemon.retry_backoff_max)
                self.ledger.update_action(row.id, "running", str(err), next_try=now + delay)
                self._audit(row.incident, "daemon", f"{row.kind} {row.target} will be retried",
                            f"attempt {row.attempts + 1}", f"{err}; next try in {delay:.0f} s", action=row.id)
                self.metrics.actions.labels(row.kind, "retry").inc()
                return
        if outcome.status == "waiting":
            return
        self.ledger.update_action(row.id, outcome.status, outcome.detail)
        self.metrics.actions.labels(row.kind, outcome.status).inc()
        self._audit(row.incident, "daemon", f"{row.kind} {row.target}", "", f"{outcome.status}: {outcome.detail}",
                    action=row.id)
        await self._after_action(row, outcome, now)

    async def _perform(self, row: ActionRow, now: float) -> Outcome:
        p = row.params
        by_slurm = await asyncio.to_thread(self.actuator.perform, row.kind, p, row.incident)
        if by_slurm is not None:
            return by_slurm
        if row.kind == "rebalance":
            directive = {"type": "rebalance", "id": self.store.next_id("rebalance", "RBL-"),
                         "job": p["job"], "step": p["step"], "shares": p["shares"]}
            self._add_directive(directive["id"], "rebalance", p["job"], p["step"], row.incident,
                                directive, now, None)
            return Outcome("done", f"{directive['id']} shares {p['shares']}")
        if row.kind == "correct":
            cid = self.store.next_id("correction", "COR-")
            self.store.add_correction(cid, row.incident, p["node"], p["kind"], p.get("gpu"), now)
            self.ledger.set_action_params(row.id, {**p, "correction": cid, "queued_at": now})
            self._audit(row.incident, "daemon", f"correction {cid} queued", f"{p['kind']} on {p['node']}",
                        action=row.id)
            return Outcome("waiting", cid)  # the node check reports back (correction_result)
        if row.kind in actions.TELL:
            return await self._escalate(row)
        return Outcome("failed", f"unknown action kind {row.kind}")

    async def _escalate(self, row: ActionRow) -> Outcome:
        p = dict(row.params)
        details = []
        if not p.get("comment_done"):
            if self._config().daemon.enabled:
                out = await asyncio.to_thread(self.actuator.comment, p["job"], row.incident, p["comment"])
                details.append(f"AdminComment: {out.detail}")
            else:
                details.append("AdminComment not set: Enabled=no")
            p["comment_done"] = True
            self.ledger.set_action_params(row.id, p)
        if not p.get("mail_done"):
            sent = await asyncio.to_thread(mail.send, self._config().mail, p["subject"], p["text"],
                                           f"artemis.{row.incident}.{row.id}")
            details.append("mail sent" if sent else "no mail relay/recipients configured")
            p["mail_done"] = True
            self.ledger.set_action_params(row.id, p)
        return Outcome("done", "; ".join(details) or "already escalated")

    async def _check_correction(self, row: ActionRow, now: float) -> None:
        cid = row.params.get("correction")
        if cid is None:  # crashed between intent and queueing: queue it now
            self.ledger.update_action(row.id, "queued", row.detail)
            return
        queued_at = row.params.get("queued_at", now)
        if now - queued_at > CORRECTION_TIMEOUT_S and (self.store.correction(cid) or {}).get("status") == "pending":
            self.store.set_correction(cid, "expired", "no node check picked it up")
            await self.correction_result(cid, "failed",
                                         f"no node check applied it within {CORRECTION_TIMEOUT_S:.0f} s", "daemon")

    async def correction_result(self, correction_id: str, status: str, detail: str, who: str) -> bool:
        """The node check applied (or failed to apply) a correction; the action completes."""
        cor = self.store.correction(correction_id)
        if cor is None:
            return False
        self.store.set_correction(correction_id, status, detail)
        self._audit(cor["incident"], who, f"correction {correction_id} {status}", cor["kind"], detail)
        for row in self.store.actions_of(cor["incident"]):
            if row.kind == "correct" and row.params.get("correction") == correction_id and row.status == "running":
                outcome = Outcome("done" if status == "done" else "failed", detail)
                self.ledger.update_action(row.id, outcome.status, detail)
                self.metrics.actions.labels("correct", outcome.status).inc()
                await self._after_action(row, outcome, self.clock())
        return True
