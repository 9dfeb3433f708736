"""The incident ledger: the one writer of incident state, action rows, and the audit lines that explain them.

Every change of an incident the daemon makes — a transition, a new action
on it, a result — is saved here, and only here.  Action rows are written
here too, each carrying the leader lease's token (``fence``, bound once when
this instance takes or loses the lease): a deposed leader's write is refused
by the store (``Fenced``), and a row's move its life cycle does not allow
(``control/actions.py``) is not written and is logged.  ``save`` refuses a stored
state the life cycle does not allow (``incident.TRANSITIONS``, from the state
as it was last saved), so no code path, however it was reached, can write a
resolved incident back to acting or skip verification.  The one way out of a
final state is a reopening (``save(..., reopening=True)``): the same device slow again within ``RecurWindows``
(an intermittent fault is one incident that records each recurrence), said
in the audit log.
"""

from __future__ import annotations

from typing import Any

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
        self.fence: int | None = None  # the leader lease's token while this instance leads

    # --- action rows ---------------------------------------------------------------

    def add_action(self, incident: str, kind: str, target: str | None, params: dict[str, Any], status: str,
                   now: float) -> int:
        return self.store.add_action(incident, kind, target, params, status, now, fence=self.fence)

    def update_action(self, action_id: int, status: str, detail: str = "", next_try: float | None = None,
                      attempt: bool = False) -> bool:
        """Move an action row to ``status``; False where its life cycle refused the move (logged)."""
        moved = self.store.update_action(action_id, status, detail, next_try=next_try, attempt=attempt,
                                         fence=self.fence)
        if not moved:
            log.warning("action row not moved: its life cycle does not allow it from where it is now",
                        action=action_id, to=status, detail=detail)
        return moved

    def set_action_params(self, action_id: int, params: dict[str, Any]) -> None:
        self.store.set_action_params(action_id, params)

    # --- incidents -------------------------------------------------------------------

    def open(self, update: Incident, step: str, now: float) -> StoredIncident:
        """A new incident from the analyzer, under the daemon's own id (not saved until ``save``)."""
        incident_id = self.store.next_id("incident", "INC-")
        body = update.model_copy(update={"id": incident_id}).contract_dict()
        return StoredIncident(incident_id, update.job, step, update.state.value, subject_of(update), update.id,
                              0, None, None, False, body, now, now)

    def save(self, stored: StoredIncident, inc: Incident, reopening: bool = False) -> None:
        """Save ``inc`` as ``stored``'s body.  ``reopening``: a resolved incident recurred and is confirmed
        again (``reconcile.on_analysis``), the one move out of a final state allowed."""
        before = IncidentState(stored.state)
        reopened = reopening and before is S.RESOLVED and inc.state is S.CONFIRMED
        if inc.state is not before and inc.state not in TRANSITIONS[before] and not reopened:
            raise IllegalStoredTransition(f"{inc.id}: {before.value} -> {inc.state.value} is not a transition "
                                          f"of the incident life cycle")
        self._write(stored, inc)

    def audit(self, incident: str | None, who: str, what: str, why: str = "", result: str = "",
              action: int | None = None, now: float | None = None) -> None:
        self.store.audit(who, what, why, result, incident=incident, action=action, now=now)
        log.info(what, incident=incident, who=who, why=why, result=result)

    def _write(self, stored: StoredIncident, inc: Incident) -> None:
        stored.state = inc.state.value
        stored.subject = subject_of(inc)
        stored.body = inc.contract_dict()
        self.store.save_incident(stored)
