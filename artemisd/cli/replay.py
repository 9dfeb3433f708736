"""``artemis replay TRACE.jsonl``: run the analysis over a recorded trace."""

from __future__ import annotations

import argparse
import sys
import time

from artemisd.config import ConfigError, load_config
from artemisd.incident import Incident
from artemisd.replay import replay_records
from artemisd.wire import TraceReader


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "replay",
        help="find incidents in a recorded trace (no actions taken)",
        description="Run detect → confirm → localize over a JSON Lines trace of window reports "
        "and node events, in arrival order, exactly as the daemon would live. Nothing is acted on: "
        "every action is reported as 'proposed'. Bad lines are reported as FILE:LINE and skipped.",
    )
    p.add_argument("trace", help="JSON Lines trace (probe ARTEMIS_ENDPOINT=file:…, or `artemis sim`)")
    p.add_argument("--config", metavar="FILE", help="artemis.conf for the analysis settings (default: built-in)")
    p.add_argument("--json", action="store_true", help="one incident JSON object per line (incident contract)")
    p.add_argument("--all", action="store_true", help="also list suspects that were never confirmed")
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
        config = load_config(args.config)
    except ConfigError as err:
        print(f"artemis replay: {err}", file=sys.stderr)
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
