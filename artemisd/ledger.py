"""The incident ledger: the one writer of incident state, and of the audit lines that explain it.

Every change of an incident the daemon makes — a transition, a new action
on it, a result — is saved here, and only here.  ``save`` refuses a stored
state the life cycle does not allow (``incident.TRANSITIONS``, from the state
as it was last saved), so no code path, however it was reached, can write a
resolved incident back to acting or skip verification.  The one way out of a
final state is ``reopen``: the same device slow again within ``RecurWindows``
(an intermittent fault is one incident that records each recurrence), said
in the audit log.
"""

from __future__ import annotations

import structlog

from artemisd.incident import TRANSITIONS, Incident, IncidentState
from artemisd.store import Store, StoredIncident

S = IncidentState
log = structlog.get_logger("artemisd")


class IllegalStoredTransition(RuntimeError):
    """A stored incident would move in a way its life cycle does not allow."""


def subject_of(inc: Incident) -> str:
    return "|".join(str(x) for x in (inc.job, inc.kind.value, inc.rank, inc.node, inc.link, inc.island))


class Ledger:
    def __init__(self, store: Store):
        self.store = store

    def open(self, update: Incident, step: str, now: float) -> StoredIncident:
        """A new incident from the analyzer, under the daemon's own id (not saved until ``save``)."""
        incident_id = self.store.next_id("incident", "INC-")
        body = update.model_copy(update={"id": incident_id}).contract_dict()
        return StoredIncident(incident_id, update.job, step, update.state.value, subject_of(update), update.id,
                              0, None, None, False, body, now, now)

    def save(self, stored: StoredIncident, inc: Incident) -> None:
        before = IncidentState(stored.state)
        if inc.state is not before and inc.state not in TRANSITIONS[before]:
            raise IllegalStoredTransition(f"{inc.id}: {before.value} -> {inc.state.value} is not a transition "
                                          f"of the incident life cycle")
        self._write(stored, inc)

    def reopen(self, stored: StoredIncident, inc: Incident, why: str, now: float) -> None:
        """The subject of a resolved incident was confirmed slow again: it is decided again, from the start."""
        inc.state = S.CONFIRMED
        inc.action, inc.result = None, None
        stored.decide, stored.plan_step, stored.action_window = True, 0, None
        self._write(stored, inc)
        self.audit(inc.id, "analyzer", "recurred", why, now=now)

    def audit(self, incident: str | None, who: str, what: str, why: str = "", result: str = "",
              action: int | None = None, now: float | None = None) -> None:
        self.store.audit(who, what, why, result, incident=incident, action=action, now=now)
        log.info(what, incident=incident, who=who, why=why, result=result)

    def _write(self, stored: StoredIncident, inc: Incident) -> None:
        stored.state = inc.state.value
        stored.subject = subject_of(inc)
        stored.body = inc.contract_dict()
        self.store.save_incident(stored)
