"""Scoring an analyser's incidents against the simulator's ground truth.

Matching rule (an incident *matches* a fault when all hold):

* same job;
* the right subject: for a fault on one rank or several ranks of a node, a
  ``rank`` incident naming one of the fault's ranks or a ``node`` incident
  naming its node; for a job-wide fault (``comm.link``, ``comm.island``,
  ``change.*``) a ``link``, ``island``, ``job`` or ``change`` incident (or, for
  a link fault, a ``node`` incident naming the link's node);
* in time: confirmed no earlier than the fault's onset and no later than
  ``GRACE_WINDOWS`` after its last window.

Only *reported* incidents count: confirmed at some point (``confirmed_window``
set) and not dismissed.  Then:

* recall          = faults with at least one match / faults
* precision       = incidents matching some fault / incidents
* cause accuracy  = detected faults whose first match names the true cause
* duplicates      = matches beyond the first, summed over faults
* latency         = confirmed_window - visible_window of the first match
                    (faults whose effective slowdown is >= 5 %), in windows;
                    ``visible_window`` is the onset, or for a ramp the window
                    where it reached 5 %.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from statistics import median
from typing import Any

GRACE_WINDOWS = 5
LATENCY_MIN_SLOWDOWN = 0.05
JOB_WIDE_KINDS = frozenset({"link", "island", "job", "change"})
NOT_REPORTED_STATES = frozenset({"suspect", "dismissed"})


def reported(incidents: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [i for i in incidents
            if i.get("confirmed_window") is not None and i.get("state") not in NOT_REPORTED_STATES]


def subject_matches(fault: Mapping[str, Any], inc: Mapping[str, Any]) -> bool:
    if inc["job"] != fault["job"]:
        return False
    kind = inc["kind"]
    if fault["kind"] in ("rank", "node"):
        return ((kind == "rank" and inc.get("rank") in fault["ranks"])
                or (kind == "node" and inc.get("node") == fault["node"]))
    if fault["cause"] == "comm.link" and kind == "node":
        return inc.get("node") == fault["node"]
    return kind in JOB_WIDE_KINDS


def time_matches(fault: Mapping[str, Any], inc: Mapping[str, Any]) -> bool:
    confirmed = inc["confirmed_window"]
    return fault["onset_window"] <= confirmed <= fault["end_window"] + GRACE_WINDOWS


@dataclass
class FaultOutcome:
    fault: Mapping[str, Any]
    matches: list[Mapping[str, Any]] = field(default_factory=list)

    @property
    def detected(self) -> bool:
        return bool(self.matches)

    @property
    def first(self) -> Mapping[str, Any] | None:
        return min(self.matches, key=lambda i: i["confirmed_window"]) if self.matches else None

    @property
    def cause_correct(self) -> bool:
        return self.first is not None and self.first.get("cause") == self.fault["cause"]

    @property
    def latency(self) -> int | None:
        first = self.first
        if first is None or self.fault["effective_magnitude"] < LATENCY_MIN_SLOWDOWN:
            return None
        return int(first["confirmed_window"]) - int(self.fault["visible_window"])

    @property
    def localized(self) -> bool:
        """For a link fault: the incident names the link's node."""
        first = self.first
        node = self.fault.get("node")
        if first is None or node is None:
            return False
        return first.get("node") == node or node in str(first.get("link") or "")


@dataclass
class Score:
    outcomes: list[FaultOutcome]
    incidents: list[Mapping[str, Any]]
    false_positives: list[tuple[Mapping[str, Any], str]]  # incident, why it may have happened

    @property
    def recall(self) -> float:
        return _ratio(sum(o.detected for o in self.outcomes), len(self.outcomes))

    @property
    def precision(self) -> float:
        return _ratio(len(self.incidents) - len(self.false_positives), len(self.incidents))

    @property
    def cause_accuracy(self) -> float:
        detected = [o for o in self.outcomes if o.detected]
        return _ratio(sum(o.cause_correct for o in detected), len(detected))

    @property
    def duplicates(self) -> int:
        return sum(max(0, len(o.matches) - 1) for o in self.outcomes)

    @property
    def median_latency(self) -> float | None:
        values = [o.latency for o in self.outcomes if o.latency is not None]
        return float(median(values)) if values else None

    @property
    def misses(self) -> list[FaultOutcome]:
        return [o for o in self.outcomes if not o.detected]

    def by_cause(self) -> dict[str, Score]:
        groups: dict[str, list[FaultOutcome]] = defaultdict(list)
        for o in self.outcomes:
            groups[o.fault["cause"]].append(o)
        out = {}
        for cause, outcomes in sorted(groups.items()):
            matched = [i for o in outcomes for i in o.matches]
            out[cause] = Score(outcomes, _unique(matched), [])
        return out


def _ratio(num: float, den: float) -> float:
    return num / den if den else float("nan")


def _unique(incidents: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    seen, out = set(), []
    for inc in incidents:
        if inc["id"] not in seen:
            seen.add(inc["id"])
            out.append(inc)
    return out


def _explain(inc: Mapping[str, Any], truth: Mapping[str, Any]) -> str:
    """Why an unmatched incident may have been raised (for tuning), or ''."""
    job = inc["job"]
    for slow in truth.get("healthy_slow", ()):
        if slow["job"] == job and inc.get("rank") == slow["rank"]:
            return f"healthy-slow GPU (ratio {slow['ratio']})"
    for f in truth["faults"]:
        if f["job"] == job and subject_matches(f, inc):
            return f"fault {f['id']} outside its windows {f['onset_window']}-{f['end_window']}"
        if f["job"] == job:
            return f"wrong subject for fault {f['id']} ({f['cause']} {f['kind']})"
    seq = inc["confirmed_window"]
    near = [t for t in truth.get("transients", ())
            if t["job"] == job and seq - 4 <= t["window"] <= seq
            and (t["rank"] is None or t["rank"] == inc.get("rank"))]
    if near:
        kinds = sorted({t["kind"] for t in near})
        return "near transient " + ",".join(kinds)
    return ""


def score(truth: Mapping[str, Any], incidents: Iterable[Mapping[str, Any]]) -> Score:
    """Score one trace's incidents (contract dicts) against its truth sidecar."""
    shown = reported(incidents)
    outcomes = [FaultOutcome(f) for f in truth["faults"]]
    false_positives = []
    for inc in shown:
        candidates = [o for o in outcomes if subject_matches(o.fault, inc) and time_matches(o.fault, inc)]
        if candidates:
            min(candidates, key=lambda o: abs(inc["confirmed_window"] - o.fault["onset_window"])).matches.append(inc)
        else:
            false_positives.append((inc, _explain(inc, truth)))
    return Score(outcomes, shown, false_positives)


def combine(scores: Iterable[Score]) -> Score:
    outcomes, incidents, fps = [], [], []
    for s in scores:
        outcomes += s.outcomes
        incidents += s.incidents
        fps += s.false_positives
    return Score(outcomes, incidents, fps)
