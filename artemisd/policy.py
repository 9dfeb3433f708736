"""Policy: which action an incident gets, under the site's rules.  Pure.

The analyzer proposes a remedy (``remedy.py``); the daemon walks a *ladder*
that starts at it and falls back to the next, more disruptive rung when a rung
is not allowed, not possible, or did not help (verify said unresolved)::

    correct   -> drain -> escalate
    rebalance -> escalate
    drain     -> escalate
    escalate

The ``drain`` rung drains the node and then, when the policy allows
``requeue``, requeues the job excluding that node (and, with ``constrain``
and a ``Constraint=``, narrows its Features).  Draining alone does not help the
running job, so without a requeue the incident is escalated: the job needs a
restart by a person.

For each rung ``decide`` answers one of:

* ``auto``      the partition policy lists it under ``Auto=``: do it;
* ``approve``   listed under ``Approve=``: wait for ``artemis approve``;
* ``recommend`` not allowed, or refused for a stated reason (budget spent,
  cooldown, no root-side corroboration, kill switch): written into the
  escalation, never silently dropped.

Hard actions (drain, requeue) need corroboration a job owner cannot fake
(``corroborated``): telemetry from a node event sent with root or SlurmUser
credentials showing the fault on a GPU under load (an idle GPU's low clocks
prove nothing), at most EvidenceMaxAge old, or — with ``HardActionEvidence=root_or_probe`` — the matched probe
agreeing.  A link also needs two matched probes that agree on it and, with ``root``, the node's
fabric readings on the receiving side (``fabric.py``): TCP retransmits are counted by the senders,
so they never say whose link it is.  Probe results travel in the job's own reports, so trusting them
means trusting the job's owner; the default is ``root``.

Drain budgets (``budget_use``, ``drain_budget``) count what Slurm shows
drained by Artemis plus our drains in flight or waiting for approval
(MaxDrainFraction), and every drain waiting, in flight, done or rolled back
in the last hour (MaxDrainsPerHour).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from artemisd import fabric
from artemisd.config import PartitionPolicy
from artemisd.control import actions
from artemisd.incident import Cause, Incident
from artemisd.slurm.api import NodeInfo
from artemisd.thresholds import (CLOCK_DROP, CLOCK_REASONS, LOAD_UTIL_PCT, POWER_LIMIT_DROP, POWER_REASONS,
                                 RETRANSMITS_PER_S, THERMAL_REASONS)

Mode = Literal["auto", "approve", "recommend"]

LADDERS: dict[str, tuple[str, ...]] = {
    "correct": ("correct", "drain", "escalate"),
    "rebalance": ("rebalance", "escalate"),
    "drain": ("drain", "escalate"),
    "requeue": ("drain", "escalate"),
    "constrain": ("drain", "escalate"),
    "escalate": ("escalate",),
    "recommend": ("escalate",),
    "none": ("escalate",),
}

# Root-side telemetry is judged by the thresholds localize uses (one table: thresholds.py).


@dataclass(frozen=True)
class Decision:
    kind: str
    mode: Mode
    why: str


def ladder(proposed: str | None) -> tuple[str, ...]:
    return LADDERS.get(proposed or "escalate", ("escalate",))


def mode_of(policy: PartitionPolicy, kind: str) -> Mode:
    if kind in policy.auto:
        return "auto"
    if kind in policy.approve:
        return "approve"
    return "recommend"


def decide(
    kind: str,
    policy: PartitionPolicy,
    *,
    target: str | None,
    corroboration: tuple[bool, str] = (True, ""),
    budget: tuple[bool, str] = (True, ""),
    cooldown_left: float = 0.0,
) -> Decision:
    """One rung, judged: may it run, wait for a person, or only be recommended?"""
    if kind != "escalate" and target is None:
        return Decision(kind, "recommend", f"{kind} needs a target the incident does not name")
    mode = mode_of(policy, kind)
    if kind == "escalate":
        # Escalation only tells people; it is never withheld.
        return Decision(kind, "auto", "escalation is always allowed")
    if mode == "recommend":
        return Decision(kind, mode, f"{kind} is not allowed by PartitionPolicy={policy.name}")
    if kind in actions.HARD and not corroboration[0]:
        return Decision(kind, "recommend", f"{kind} needs root-side corroboration: {corroboration[1]}")
    if kind == "drain" and not budget[0]:
        return Decision(kind, "recommend", budget[1])
    if cooldown_left > 0:
        return Decision(kind, "recommend", f"{target} is in its cooldown for {cooldown_left:.0f} s more")
    return Decision(kind, mode, f"{kind} is {'automatic' if mode == 'auto' else 'approval-only'} "
                                f"in PartitionPolicy={policy.name}")


@dataclass(frozen=True)
class DrainRecord:
    """One drain Artemis decided: its node, action status, and when it was decided or approved (s)."""

    id: int
    node: str
    status: str
    at: float


HOUR_S = 3600.0


@dataclass(frozen=True)
class BudgetUse:
    """How much of a partition's drain budget is used.

    ``held``: nodes counted against ``MaxDrainFraction`` — nodes of the
    partition Slurm shows drained with an ``artemis:`` reason, plus nodes whose
    drain is in flight (and, when deciding, waiting for approval).
    ``last_hour``: drains counted against ``MaxDrainsPerHour`` — every drain
    waiting, in flight, or done or rolled back within the last hour.
    """

    size: int
    held: int
    last_hour: int


def budget_use(nodes: tuple[NodeInfo, ...], drains: list[DrainRecord], now: float, *,
               waiting: bool = True, exclude: int | None = None) -> BudgetUse:
    """Count a partition's budget use from Slurm's node states and Artemis' own drains.

    ``waiting=False`` leaves the other drains waiting for approval out: when a
    person approves one, the others are not yet drains and must not block it.
    ``exclude`` is the drain being approved (it is the "one more").
    """
    names = {n.name for n in nodes}
    open_ = actions.OPEN if waiting else actions.IN_FLIGHT
    mine = [d for d in drains if d.node in names and d.id != exclude]
    # Slurm is the truth for what is drained: a node a person resumed frees its share at once.
    held = {n.name for n in nodes if n.drained_by_artemis} | {d.node for d in mine if d.status in open_}
    hour = sum(1 for d in mine if d.status in open_ or (d.status in actions.PERFORMED and now - d.at < HOUR_S))
    return BudgetUse(len(nodes), len(held), hour)


def drain_budget(policy: PartitionPolicy, use: BudgetUse) -> tuple[bool, str]:
    """May one more node of this partition be drained?  The refusal names the budget."""
    allowed = int(policy.max_drain_fraction * use.size)
    if use.held + 1 > allowed:
        return False, (f"drain budget: MaxDrainFraction={policy.max_drain_fraction:g} reached: {use.held} of "
                       f"{use.size} nodes drained or being drained by Artemis (allows {allowed})")
    if use.last_hour + 1 > policy.max_drains_per_hour:
        return False, (f"drain budget: MaxDrainsPerHour={policy.max_drains_per_hour} reached: {use.last_hour} "
                       f"drain{'' if use.last_hour == 1 else 's'} in the last hour")
    return True, ""


def _gpus_of(event: dict[str, Any], gpu: int | None) -> list[dict[str, Any]]:
    gpus = [g for g in event.get("gpus") or [] if isinstance(g, dict)]
    chosen = [g for g in gpus if gpu is not None and g.get("index") == gpu]
    return chosen or gpus


def _idle(gpu: dict[str, Any]) -> str | None:
    """Why this reading cannot show a fault under load, or None when the GPU was busy.

    An idle GPU drops its clocks (reason ``idle``) and shows low utilization:
    every idle GPU in the cluster "agrees" with a clock fault.  Utilization not
    measured is not proof of load, so it does not count either.
    """
    if "idle" in (gpu.get("throttle") or ()):
        return "throttle reason idle"
    util = gpu.get("util_pct")
    if not isinstance(util, int | float):
        return "utilization not measured"
    if util < LOAD_UTIL_PCT:
        return f"utilization {util:g} % < {LOAD_UTIL_PCT:g} %"
    return None


def _root_agrees(cause: Cause, event: dict[str, Any], gpu: int | None,
                 under_load: bool = True, peers: Sequence[dict[str, Any]] = ()) -> tuple[str | None, str | None]:
    """(what the root-side event shows for ``cause``, why a reading was set aside).

    ``under_load``: only readings of a busy GPU count (corroboration before an
    action).  ``peers``: the job's other nodes' latest root-side events, which a
    link's fabric counters are read against (``fabric.findings``).  Without it (is a drained, now idle node still faulty?) a throttle
    reason or a lowered power limit counts whatever the load, but a low clock
    still only under load: an idle GPU's clock is low by design.
    """
    idle = None
    for g in _gpus_of(event, gpu):
        idx = g.get("index")
        why = _idle(g)
        if why is not None and under_load:
            idle = idle or f"gpu {idx} idle ({why})"
            continue
        load = f" at {g['util_pct']:g} % load" if why is None else ""
        reasons = set(g.get("throttle") or ())
        clock, top = g.get("sm_clock_mhz"), g.get("max_sm_clock_mhz")
        limit, default = g.get("power_limit_w"), g.get("default_power_limit_w")
        if cause is Cause.GPU_THERMAL and reasons & THERMAL_REASONS:
            return f"gpu {idx} thermal throttle {sorted(reasons & THERMAL_REASONS)}{load}", None
        if cause is Cause.GPU_POWER:
            lowered = limit is not None and bool(default) and limit < POWER_LIMIT_DROP * default
            # sw_power_cap at the default limit is a healthy GPU at full load reaching its
            # design power (5 % of readings on healthy H100s, a third of an 8-GPU node's): it
            # corroborates only a lowered limit, or where the default is not reported.
            shown = reasons & POWER_REASONS if lowered or not default else reasons & {"hw_power_brake"}
            if shown:
                return f"gpu {idx} power throttle {sorted(shown)}{load}", None
            if lowered:
                return f"gpu {idx} power limit {limit} W below default {default} W", None
        if cause is Cause.GPU_CLOCKS:
            if reasons & CLOCK_REASONS:
                return f"gpu {idx} clock event {sorted(reasons & CLOCK_REASONS)}{load}", None
            if why is None and clock is not None and top and clock < CLOCK_DROP * top:
                return f"gpu {idx} SM clock {clock} MHz of {top} MHz{load}", None
    if cause is Cause.COMM_LINK:
        seen = fabric.shown(event, peers)
        if seen is not None:
            return f"fabric: {seen}", None
        # Retransmits rise on every sender to a slow link (and on a loaded host): never a finding alone.
        retrans = (event.get("host") or {}).get("net_retransmits_per_s")
        if retrans is not None and retrans >= RETRANSMITS_PER_S:
            return None, (f"{retrans:.0f} TCP retransmits/s, but retransmits are counted by the senders to a slow "
                          f"link, and no receive-side fabric counter, port or PCIe link shows this node's")
    return None, idle


def root_side_shows(cause: Cause, event: dict[str, Any], gpu: int | None = None,
                    peers: Sequence[dict[str, Any]] = ()) -> str | None:
    """What a root-side node event still shows of ``cause``, whatever the load (None: nothing).

    Asked of a node Artemis drained (so idle now) before undoing the drain: an idle link counts
    no errors, but a port down or trained slow, or a PCIe link below its width, still shows.
    """
    return _root_agrees(cause, event, gpu, under_load=False, peers=peers)[0]


def _probe_agrees(incident: Incident, slowdown: float) -> str | None:
    for item in incident.evidence:
        if item.signal == "probe.gemm_ms" and isinstance(item.value, int | float) and isinstance(item.peers, int | float) \
                and item.peers > 0 and item.value / item.peers >= 1.0 + slowdown:
            return f"matched probe probe.gemm_ms {item.value} vs peers {item.peers}"
    return None


def _probes_agree_on_link(incident: Incident, slowdown: float) -> tuple[int, str | None]:
    """How many of the latest matched probes in a row time the incident's link slow, and,
    if the latest names another node, that probe's note."""
    node = incident.link or incident.node
    agreeing, other = 0, None
    for item in reversed(incident.evidence):
        if item.signal != "probe.p2p_ms":
            continue
        if not (isinstance(item.value, int | float) and isinstance(item.peers, int | float) and item.peers > 0
                and item.value / item.peers >= 1.0 + slowdown):
            continue
        if f"touching {node} " not in item.note:
            other = item.note if agreeing == 0 else None
            break
        agreeing += 1
    return agreeing, other


def _link_corroborated(incident: Incident, node_event: dict[str, Any] | None, age_s: float | None,
                       max_age_s: float, mode: str, slowdown: float,
                       peers: Sequence[dict[str, Any]] = ()) -> tuple[bool, str]:
    """A hard action on a link: evidence that points at this one link, from more than one measurement.

    Retransmits are counted by the senders to a slow link, so they never say
    whose link it is: the matched probes' ring timings name the link, two of
    them must agree, and with ``HardActionEvidence=root`` the node's root-side
    fabric readings must also convict its link, read on the receiving side and
    against its peers (``fabric.findings``; the probes run in the job, which its
    owner controls).
    """
    node = incident.link or incident.node
    agreeing, other = _probes_agree_on_link(incident, slowdown)
    if other is not None:
        return False, f"the latest matched probe names another link: {other}"
    if agreeing < 2:
        return False, (f"a link needs two matched probes that agree on it; {agreeing} timed {node}'s link slow")
    if mode == "root_or_probe":
        return True, f"{agreeing} matched probes agree: {node}'s link"
    if node_event is None:
        return False, f"no root-side node event from {node}"
    if age_s is not None and age_s > max_age_s:
        return False, f"root-side evidence from {node} is {age_s:.0f} s old (EvidenceMaxAge={max_age_s:.0f})"
    seen, why_not = _root_agrees(Cause.COMM_LINK, node_event, None, peers=peers)
    if seen is None:
        return False, (f"root-side node check on {node} does not show its link in trouble"
                       + (f": {why_not}" if why_not else ""))
    return True, f"{agreeing} matched probes agree on {node}'s link; root-side node check on {node}: {seen}"


def evidence_age(received: float, event: dict[str, Any], now: float) -> float:
    """Age of a root-side node event: since it was measured (its ``time``) or received, the older."""
    measured = event.get("time")
    taken = min(received, measured) if isinstance(measured, int | float) and measured > 0 else received
    return max(0.0, now - taken)


def corroborated(incident: Incident, node_event: dict[str, Any] | None, age_s: float | None,
                 max_age_s: float, mode: str, slowdown: float, gpu: int | None = None,
                 peers: Sequence[dict[str, Any]] = ()) -> tuple[bool, str]:
    """Is the incident's cause confirmed by evidence its job's owner cannot forge?

    Root-side evidence counts only when it is at most ``max_age_s`` old
    (EvidenceMaxAge) and shows the incident's own fault class on a GPU under
    load (``_idle``): an idle GPU's low clocks are what every idle GPU reports.
    A link needs more (``_link_corroborated``), read against ``peers``: the job's other nodes'
    latest root-side events.
    """
    if incident.cause is Cause.COMM_LINK:
        return _link_corroborated(incident, node_event, age_s, max_age_s, mode, slowdown, peers)
    if incident.cause in (Cause.GPU_THERMAL, Cause.GPU_POWER, Cause.GPU_CLOCKS):
        idle = None
        if node_event is not None and age_s is not None and age_s <= max_age_s:
            seen, idle = _root_agrees(incident.cause, node_event, gpu)
            if seen:
                return True, f"root-side node check on {incident.node}: {seen}"
        if mode == "root_or_probe":
            seen = _probe_agrees(incident, slowdown)
            if seen:
                return True, seen
        if node_event is None:
            return False, f"no root-side node event from {incident.node}"
        if age_s is None or age_s > max_age_s:
            age = f"{age_s:.0f} s" if age_s is not None else "of unknown age"
            return False, f"root-side evidence from {incident.node} is {age} old (EvidenceMaxAge={max_age_s:.0f})"
        if idle:
            return False, (f"root-side node check on {incident.node} does not show {incident.cause.value} under "
                           f"load: {idle}")
        return False, f"root-side node check on {incident.node} does not show {incident.cause.value}"
    return False, f"cause {incident.cause.value} is not a hardware fault a drain can fix"
