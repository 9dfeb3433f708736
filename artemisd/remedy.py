"""Remedy: the action each diagnosis calls for, before any site policy is applied.

This is what ``artemis replay`` proposes (``action.status = "proposed"``) and
the first choice the daemon hands to its policy, which may downgrade it (to
an escalation or a recommendation) or forbid it.  Preference runs from the
least disruptive fix that addresses the cause to the most disruptive:

* a clock or power-limit problem is *corrected* in place (reset application
  clocks, restore the default power limit) — no restart, nothing to undo;
* an input-pipeline or host-side straggler gets its work *rebalanced* —
  reversible, the job keeps running;
* a hot GPU or a bad link is hardware: *drain* the node so no new job lands
  on it (the running job may be requeued excluding it, by policy);
* a software change, or a cause we could not name, goes to a person:
  *escalate*.
"""

from __future__ import annotations

from artemisd.control import actions
from artemisd.incident import Action, Cause, IncidentKind

_BY_CAUSE: dict[Cause, str] = {
    Cause.GPU_CLOCKS: "correct",
    Cause.GPU_POWER: "correct",
    Cause.GPU_THERMAL: "drain",
    Cause.COMM_LINK: "drain",
    Cause.COMM_ISLAND: "escalate",
    Cause.HOST_CPU: "rebalance",
    Cause.INPUT_LOADER: "rebalance",
    Cause.INPUT_STORAGE: "escalate",
    Cause.CHANGE_DRIVER: "escalate",
    Cause.CHANGE_COMM_LIB: "escalate",
    Cause.CHANGE_CONFIG: "escalate",
    Cause.UNKNOWN: "escalate",
}


def propose(kind: IncidentKind, cause: Cause, node: str | None, job: str, link: str | None = None) -> Action:
    """The remedy for a diagnosis, as a proposed action on its natural target.

    A link incident acts on the node whose link it is (``link`` names that
    node): a bad link is drained like a bad GPU.
    """
    action = _BY_CAUSE[cause]
    node = node or link
    if action in ("drain", "correct") and node is None:
        # Hardware with no node to name: nothing to drain or reset; a person decides.
        action = "escalate"
    if action == "rebalance" and kind not in (IncidentKind.RANK, IncidentKind.NODE):
        action = "escalate"
    target = node if action in ("drain", "correct") else job
    return Action(kind=action, target=target, status="proposed", reversible=actions.reversible(action))
