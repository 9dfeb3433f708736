"""Scoring for benchmarks/peers.py: plain data in, plain data out (no torch, no I/O).

A system's output in one job is a list of ``Report``: when it was available
(iterations completed) and which ranks it named.  ``score`` turns each
system's reports in the healthy, slowed and intermittent jobs, plus the
overhead job's block times, into one table ``Row``.  tests/unit/test_peers_scoring.py
runs these functions on data recorded from a real run.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from collections.abc import Iterable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Report:
    """One report a system produced: ``done`` iterations had completed when it was
    available, it named ``ranks`` (empty: it named none), and ``cause`` is what it
    said caused the slowdown (None: it said nothing about a cause)."""

    system: str
    done: int
    ranks: tuple[int, ...]
    cause: str | None = None


def onset_iteration(ends: Sequence[float], fault_t0: float) -> int:
    """The first iteration (0-based) the fault touched: the first whose end time
    (``time.time()`` after ``optimizer.step()``) is later than the fault's start."""
    for i, t in enumerate(ends):
        if t > fault_t0:
            return i
    raise ValueError(f"fault_t0 {fault_t0:.3f} is after the last iteration ended ({ends[-1]:.3f})")


def latency_steps(reports: Iterable[Report], slow_rank: int, onset: int) -> int | None:
    """Iterations from the fault's first iteration to the first report naming the
    slowed rank that was available after it began; None if no report did."""
    hits = [r.done for r in reports if slow_rank in r.ranks and r.done > onset]
    return min(hits) - onset if hits else None


def first_cause(reports: Iterable[Report], slow_rank: int, onset: int) -> str | None:
    """The cause the first report naming the slowed rank (after onset) gave."""
    hits = sorted((r for r in reports if slow_rank in r.ranks and r.done > onset), key=lambda r: r.done)
    return hits[0].cause if hits else None


def false_blames(reports: Iterable[Report], slow_rank: int) -> int:
    """Names of ranks other than the slowed one: in these jobs they only waited."""
    return sum(1 for r in reports for rank in r.ranks if rank != slow_rank)


def healthy_flags(reports: Iterable[Report]) -> int:
    """Every name of a rank in a job where nothing was injected."""
    return sum(len(r.ranks) for r in reports)


def overhead_pct(blocks: Sequence[dict[str, float]], mode: str, base: str = "none") -> float:
    """Median over rounds of (``mode``'s block step time / ``base``'s of the same round) - 1, in %.

    ``blocks``: one dict per round, mode -> mean step time in ms over that block.
    """
    ratios = [b[mode] / b[base] for b in blocks if mode in b and base in b and b[base] > 0]
    if not ratios:
        raise ValueError(f"no round has both {mode!r} and {base!r} blocks")
    return 100.0 * (statistics.median(ratios) - 1.0)


def artemis_reports(incidents: Iterable[dict], window_end: dict[int, int]) -> list[Report]:
    """Incidents (``artemis replay --json``) as reports.

    ``window_end``: window seq -> iterations completed when that window closed.
    An incident counts from its ``confirmed_window`` (the window in which it
    became an incident, docs/incidents.md), not from the earlier flag.  A rank
    is named by ``rank`` or by its node ``n<rank>`` (one rank per emulated
    node); a link names the ranks of the nodes at its ends (the sentinel -1,
    never the slowed rank, if it names no node); an island or the whole job
    names no rank.
    """
    out = []
    for inc in incidents:
        window = inc.get("confirmed_window")
        if window is None:
            window = inc.get("flagged_window")
        if window is None or window not in window_end:
            raise ValueError(f"incident {inc.get('id')}: confirmed_window {window!r} is not a window of the trace")
        ranks: tuple[int, ...] = ()
        node = inc.get("node") or ""
        if inc.get("rank") is not None:
            ranks = (int(inc["rank"]),)
        elif re.fullmatch(r"n\d+", node):
            ranks = (int(node[1:]),)
        elif inc.get("link"):
            ranks = tuple(sorted({int(n) for n in re.findall(r"\bn(\d+)\b", inc["link"])})) or (-1,)
        cause = inc.get("cause")
        out.append(Report("artemis", window_end[window], ranks, None if cause in (None, "unknown") else cause))
    return out


def window_ends(trace_records: Iterable[dict]) -> dict[int, int]:
    """Window seq -> iterations completed when it closed, from the probe's own reports.

    Probe step p is iteration p + 1 (its first step boundary only starts the
    clock), so a window whose last step is p closes when iteration p + 1 ends:
    p + 2 iterations are done.
    """
    ends: dict[int, int] = {}
    for rec in trace_records:
        if rec.get("type") != "window":
            continue
        w = rec["window"]
        ends[w["seq"]] = max(ends.get(w["seq"], 0), w["first_step"] + w["steps"] + 1)
    return ends


def nvrx_names(stragglers: dict[str, Any]) -> tuple[tuple[int, ...], str | None]:
    """Ranks in NVRx's ``identify_stragglers()`` result (as plain data: key ->
    list of ranks, or section -> list of ranks) and what it says about where.

    NVRx names the section whose time fell below the threshold (or the GPU
    score); a section is where the time went, not why, so ``cause`` stays None
    and the section is kept for the record.
    """
    ranks: set[int] = set()
    for value in stragglers.values():
        if isinstance(value, dict):
            for rs in value.values():
                ranks.update(rs)
        else:
            ranks.update(value)
    return tuple(sorted(ranks)), None


def megatron_names(line: str) -> tuple[int, ...]:
    """The rank a StragglerDetector log line calls slowest: ``MxRtt/Rnk: 12.30ms/2``."""
    m = re.search(r"MxRtt/Rnk: [^/|]+/(\d+)", line)
    return (int(m.group(1)),) if m else ()


@dataclasses.dataclass(frozen=True)
class Row:
    system: str
    latency_steps: int | None
    latency_intermittent: int | None
    false_blames: int
    healthy_flags: int
    cause: str | None
    overhead_pct: float | None
    ran: bool = True  # False: the tool switched itself off, so its zeros mean "never looked"
    note: str = ""


def score(system: str, runs: dict[str, dict], overhead: Sequence[dict[str, float]] | None, *, ran: bool = True,
          note: str = "") -> Row:
    """One system's row from its reports in each job.

    ``runs``: job name -> {"reports": [Report], "slow_rank": int, "onset": int};
    the healthy job has no slow rank.
    """
    slowed, inter, healthy = runs["slowed"], runs["intermittent"], runs["healthy"]
    lat = latency_steps(slowed["reports"], slowed["slow_rank"], slowed["onset"])
    lat_i = latency_steps(inter["reports"], inter["slow_rank"], inter["onset"])
    blames = sum(false_blames(run["reports"], run["slow_rank"]) for run in (slowed, inter))
    cause = first_cause(slowed["reports"], slowed["slow_rank"], slowed["onset"])
    pct = overhead_pct(overhead, system) if overhead else None
    return Row(system, lat, lat_i, blames, healthy_flags(healthy["reports"]), cause, pct, ran, note)


def format_table(rows: Sequence[Row]) -> str:
    header = ("system", "latency_steps", "false_blames", "healthy_flags", "cause", "overhead_pct",
              "latency_intermittent")
    def cell(row: Row, value: Any) -> str:
        if not row.ran:
            return "off"
        return "-" if value is None else str(value)

    cells = [header] + [(r.system, cell(r, r.latency_steps), cell(r, r.false_blames), cell(r, r.healthy_flags),
                         cell(r, r.cause), "-" if r.overhead_pct is None else f"{r.overhead_pct:+.1f}",
                         cell(r, r.latency_intermittent)) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip() for c in cells)
