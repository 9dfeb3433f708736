"""``artemis replay TRACE.jsonl``: run the analysis over a recorded trace."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from artemisd import decide
from artemisd.config import Config, ConfigError, load_config
from artemisd.control import actions
from artemisd.incident import Incident
from artemisd.replay import replay_records
from artemisd.sim.loop import AUTO_APPROVER
from artemisd.sim.policy_replay import PARTITION, PolicyReplay, replay_policy
from artemisd.wire import TraceReader


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "replay",
        help="find incidents in a recorded trace (no actions taken; --policy: what the loop would do)",
        description="Run detect → confirm → localize over a JSON Lines trace of window reports "
        "and node events, in arrival order, exactly as the daemon would live. Nothing is acted on: "
        "every action is reported as 'proposed'. With --policy the closed loop runs too, against a "
        "simulated Slurm built from the trace, and prints what it would have done. Bad lines are "
        "reported as FILE:LINE and skipped.",
    )
    p.add_argument("trace", help="JSON Lines trace (probe ARTEMIS_ENDPOINT=file:…, or `artemis sim`)")
    p.add_argument("--config", metavar="FILE", help="artemis.conf for the analysis settings (default: built-in)")
    p.add_argument("--json", action="store_true", help="one incident JSON object per line (incident contract)")
    p.add_argument("--all", action="store_true", help="also list suspects that were never confirmed")
    p.add_argument("--policy", metavar="FILE",
                   help="artemis.conf whose PartitionPolicy and daemon settings apply: also run the closed loop "
                        "(decide, act on a simulated Slurm, verify) and print what it would have done, what the "
                        "drain budgets refused and what needed approval. The trace names no partitions: the "
                        "PartitionPolicy matching every partition (* or DEFAULT) applies to every job. Node "
                        "events in the trace are taken as root-side evidence (a recorded trace is the admin's); "
                        "verification judges the recorded windows, which were recorded without the actions")
    p.add_argument("--approve-all", action="store_true",
                   help="with --policy: give every approval the policy asks for (default: they wait)")
    p.set_defaults(func=run)


def _subject(incident: Incident) -> str:
    if incident.rank is not None:
        return f"rank {incident.rank}@{incident.node}"
    if incident.link:
        return f"link {incident.link}"
    if incident.node:
        return f"node {incident.node}"
    if incident.island:
        return f"island {incident.island}"
    return "whole job"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(incidents: list[Incident]) -> str:
    header = ("ID", "JOB", "KIND", "STATE", "SUBJECT", "ONSET", "CONF'D", "RATIO", "EXCESS_MS",
              "LOSS%", "CAUSE", "CONF", "ACTION")
    rows = [header]
    for i in incidents:
        action = f"{i.action.kind} {i.action.target or ''}".strip() if i.action else "-"
        rows.append((i.id, i.job, i.kind.value, i.state.value, _subject(i), _fmt(i.onset_window, "d"),
                     _fmt(i.confirmed_window, "d"), _fmt(i.ratio, ".2f"), _fmt(i.excess_ms, "+.1f"),
                     _fmt(i.loss_pct, ".1f"), i.cause.value, f"{i.confidence:.2f}", action))
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(header))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    out = [lines[0]]
    for incident, line in zip(incidents, lines[1:]):
        out.append(line)
        for ev in incident.evidence[:4]:
            peers = f" (peers {ev.peers})" if ev.peers not in (None, [], "") else ""
            note = f" — {ev.note}" if ev.note else ""
            out.append(f"    {ev.signal}: {ev.value}{peers}{note}")
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)  # not secure=True: an offline replay acts on nothing
    except ConfigError as err:
        print(f"artemis replay: {err}", file=sys.stderr)
        return 2
    if args.policy is not None:
        return run_policy(args, config)
    if args.approve_all:
        print("artemis replay: --approve-all needs --policy", file=sys.stderr)
        return 2
    reader = TraceReader(args.trace)
    started = time.perf_counter()
    try:
        incidents = replay_records(reader, config, include_unconfirmed=args.all)
    except OSError as err:
        print(f"artemis replay: {args.trace}: {err.strerror}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - started
    for error in reader.errors:
        print(f"artemis replay: rejected {error}", file=sys.stderr)
    if args.json:
        for incident in incidents:
            print(incident.to_json())
    elif incidents:
        print(format_table(incidents))
    else:
        print("no incidents")
    print(f"artemis replay: {len(incidents)} incident(s); {reader.rejected} line(s) rejected; "
          f"{elapsed:.2f} s", file=sys.stderr)
    return 0


# --- artemis replay --policy ---------------------------------------------------------------------


def run_policy(args: argparse.Namespace, analysis_config: Config) -> int:
    """The analysis and the closed loop over the trace (artemisd/sim/policy_replay.py)."""
    try:
        config = load_config(args.policy)
    except ConfigError as err:
        print(f"artemis replay: {err}", file=sys.stderr)
        return 2
    # --config, when given, sets the analysis; the policy file sets the rest (it is an artemis.conf).
    analysis = analysis_config.analysis if args.config else config.analysis
    reader = TraceReader(args.trace)
    started = time.perf_counter()
    try:
        records = list(reader)
    except OSError as err:
        print(f"artemis replay: {args.trace}: {err.strerror}", file=sys.stderr)
        return 2
    result = replay_policy(records, config, approve_all=args.approve_all, analysis=analysis)
    elapsed = time.perf_counter() - started
    for error in reader.errors:
        print(f"artemis replay: rejected {error}", file=sys.stderr)
    incidents = result.incidents
    if args.all:
        incidents = result.loop.incidents()
    if args.json:
        for incident in incidents:
            print(json.dumps(policy_json(result, incident)))
    else:
        print(format_policy(result, incidents, args.policy, args.approve_all))
    print(f"artemis replay: {len(incidents)} incident(s); {reader.rejected} line(s) rejected; "
          f"{elapsed:.2f} s", file=sys.stderr)
    return 0


def _plan_steps(plan: decide.Plan, job: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(the first action the loop would take, the other rungs judged) of one plan, contract-shaped.

    The action is the rung taken (``proposed`` when automatic, ``pending_approval``);
    without one, the first rung refused (``refused``, with its ``reason``), else the
    escalation.  The rest keep their ladder order.
    """
    steps = list(plan.walked) + list(plan.rest)
    if plan.action is None and plan.escalate is not None and not any(s.kind == "escalate" for s in steps):
        steps.append(decide.Step("escalate", job, "auto", plan.escalate))
    first = plan.action
    if first is None:
        first = next((s for s in plan.walked if s.mode == "recommend"), None) \
            or next((s for s in steps if s.kind == "escalate"), None)
    if first is None:
        return None, [s.as_json() for s in steps]
    return first.as_json(), [s.as_json() for s in steps if s is not first]


def policy_json(result: PolicyReplay, incident: Incident) -> dict[str, Any]:
    """The incident contract, with ``action`` the first action the loop would take and the
    additive ``plan`` (the other rungs judged) and ``actions`` (what the loop did over the trace)."""
    out = incident.contract_dict()
    loop = result.loop
    plans = loop.plans(incident.id) if incident.id in loop.incident_ids() else []
    if plans:
        out["action"], out["plan"] = _plan_steps(plans[0], incident.job)
    else:
        out["action"], out["plan"] = None, []
        waits = [n.why for n in loop.notes(incident.id) if n.who == "policy" and n.what == "not escalated yet"]
        if waits:
            out["wait"] = waits[-1]
    out["actions"] = [{"kind": r.kind, "target": r.target, "status": r.status, "detail": r.detail}
                      for r in loop.actions(incident.id)]
    return out


def _offset(result: PolicyReplay, when: float) -> str:
    return f"+{when - result.started:.0f} s"


def format_policy(result: PolicyReplay, incidents: list[Incident], policy_file: str, approve_all: bool) -> str:
    pol, loop = result.policy, result.loop
    size = len(result.slurm.partition_nodes(PARTITION))
    which = (f"PartitionPolicy={pol.name} (from {policy_file})" if result.policy_matched
             else f"no PartitionPolicy in {policy_file} matches every partition (* or DEFAULT): the built-in "
                  f"defaults")
    out = [f"policy: {which} applies to every job: the trace names no partitions; its {size} node(s) form "
           f"partition {PARTITION!r}",
           f"  Auto={','.join(pol.auto) or '-'}  Approve={','.join(pol.approve) or '-'}  "
           f"MaxDrainFraction={pol.max_drain_fraction:g} ({int(pol.max_drain_fraction * size)} of {size} nodes)  "
           f"MaxDrainsPerHour={pol.max_drains_per_hour}  Cooldown={pol.cooldown:.0f} s",
           "node events in the trace are taken as root-side evidence (a recorded trace is the admin's)",
           "verification judges the recorded windows: the trace was recorded without these actions",
           "approvals: " + ("every one given (--approve-all)" if approve_all else "none given; they wait"), ""]
    if not incidents:
        out.append("no incidents")
        return "\n".join(out)
    out += [format_table(incidents), ""]
    for incident in incidents:
        if incident.id not in loop.incident_ids():
            continue
        out.append(f"{incident.id}  job {incident.job}  {incident.cause.value} {_subject(incident)}: "
                   f"{incident.state.value}")
        for note in loop.notes(incident.id):
            out.append(f"  {_offset(result, note.time):>8}  {note}")
        if incident.result is not None and incident.result.recovered is not None:
            out.append(f"  {incident.result.describe()}")
        out.append("")
    rows = [r for r in loop.actions() if r.kind not in actions.TELL]
    out.append("would have done:" if rows else "would have done: nothing but escalations")
    for r in rows:
        approved = f", approved by {r.approved_by}" if r.approved_by else ""
        out.append(f"  {r.incident} {r.kind} {r.target or ''}: {r.status}{approved}"
                   + (f" ({r.detail})" if r.detail else ""))
    escalations = [r for r in loop.actions() if r.kind == "escalate"]
    out.append(f"escalated to a person: {len(escalations)}")
    for r in escalations:
        out.append(f"  {r.incident} ({_offset(result, r.created)}): {r.params.get('headline', '')}")
    cleared = [r for r in loop.actions() if r.kind == "notify"]
    if cleared:
        out.append(f"told it resolved (all-clear mail): {len(cleared)}")
        for r in cleared:
            out.append(f"  {r.incident} ({_offset(result, r.created)}): {r.params.get('subject', '')}")
    refusals = loop.refusals()
    out.append(f"refused by the drain budget: {len(refusals) or 'none'}")
    for ref in refusals:
        when = "when deciding" if ref.at == "decide" else "at approval"
        out.append(f"  {ref.incident} {ref.kind} {ref.target} ({_offset(result, ref.time)}, {when}): {ref.why}")
    waiting = loop.pending_approvals()
    auto = [r for r in loop.actions() if r.approved_by == AUTO_APPROVER]
    if approve_all:
        out.append(f"approved automatically (--approve-all): {len(auto) or 'none'}")
        for r in auto:
            out.append(f"  {r.incident} {r.kind} {r.target}: {r.status}")
    out.append(f"waiting for approval: {len(waiting) or 'none'}")
    for r in waiting:
        out.append(f"  {r.incident} {r.kind} {r.target}: artemis approve {r.incident}  (or artemis deny {r.incident})")
    return "\n".join(out)
