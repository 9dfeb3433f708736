"""Confirm: a flag becomes an incident only if it persists under matched conditions.

*Passive* confirmation (always on, the only kind in replay): the same subject
must be flagged under the same *conditions* — the job's workload signature
(world size, island make-up), the subject's island and node — either

* *steadily* in at least ``ConfirmWindows`` of the last ``ConfirmWindows + 1``
  windows (a steady fault: confirmed one window after onset with the default
  2), or
* at all in at least ``ConfirmWindows + 1`` of the last ``4 × ConfirmWindows``
  windows (an intermittent fault that keeps coming back).

A flag is *steady* when the window's per-step medians (``ms_p50``) show the
slowdown too, not only its means: a GC pause, a spike of a few steps or a
checkpoint write moves a window's mean but not its median, so such a *bursty*
flag — even two in a row when the spike straddles a window boundary — can only
confirm through the intermittent rule.  Where the probe sent no medians every
flag counts as steady.

A subject with no healthy history yet (the first windows of a job) needs one
steady window more: until a rank's usual speed is known, a GPU that is always
a little slower can look like a straggler for a window or two.

Either rule also needs ``ConfirmSeconds`` of wall time flagged (the windows'
own t1 − t0, the median over the job's ranks): the steady rule over its
current run of flags, the intermittent rule over its flags in the horizon.
A window count alone is scale-free, and OS scheduling is not: on a shared
host a neighbour's burst, a pinned process or a GC storm slows one process
for a fraction of a second to a second or two, which is several windows when
windows are short (8 steps of 10 ms on the 2-core test bed: one rank 1.6x
slower for three 0.1 s windows, in an otherwise healthy job).  At the default
``WindowSteps`` of real training a window is longer than that floor, and
the window count decides as before.

A change of conditions restarts the count: a window measured under other
conditions proves nothing about this one.  A lone flag is dismissed once its
steady window has passed, but remembered over the horizon, so a fault that
keeps coming back is still confirmed.

*Active* confirmation (the daemon's seam): while a subject is suspect, the
pipeline can ask the job's probes to run identical work on every rank (a
fixed GEMM, a fixed island all-reduce, a point-to-point ring).
``judge_probe`` reads those results: slow on identical GEMM work → the device;
slow transfers on every link touching one node, and on no other → that link (for a rank or node
subject only when it is the subject's node: evidence is about the incident's
subject); normal on identical work yet slow in training → host or input.  The verdict is evidence for
localisation and the root-independent corroboration the daemon needs before a
hard action; persistence still decides confirmation.  A job-wide slowdown has
no suspect rank: its probes are about the links, and one is named only when two
in a row agree (``agree_on_link``, ``ask_again_about_link``).  A verdict that
comes back after its incident confirmed is taken into it
(``take_probe_verdict``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from artemisd.incident import Cause, Evidence, Incident, IncidentKind
from artemisd.remedy import propose
from artemisd.wire import ProbeResult

# A node's ring pairs wait this many times the others' share of their time or more: a loaded host
# (``judge_probe``).
HOST_WAIT_SHARE = 2.0
MAX_LINK_PROBES = 3  # matched probes asked about one job-wide slowdown's link before a person is told


@dataclass
class Streak:
    """Recent flagged windows of one subject under one set of conditions."""

    conditions: Hashable
    first_seq: int
    flagged: list[int] = field(default_factory=list)
    steady: list[int] = field(default_factory=list)
    dismissed: bool = False  # its suspect was dismissed; flags kept for the intermittent rule
    run_start: int = -1  # first window of the latest run of flags (gaps of one window allowed)
    run_seconds: float = 0.0  # wall time of the flagged windows of that run
    seconds: dict[int, float] = field(default_factory=dict)  # wall time of each window in ``flagged``
    intermittent: bool = False  # confirmed by the intermittent rule, not by steady windows

    @property
    def onset(self) -> int:
        """Where the slowdown now in force began.  A steady slowdown began with its
        latest run of flags: an earlier blip, remembered for the intermittent rule,
        is not its start.  An intermittent one began with its first flag in the horizon."""
        if self.intermittent and self.flagged:
            return self.flagged[0]
        return self.run_start if self.run_start >= 0 else self.first_seq

    @property
    def last_seq(self) -> int:
        return self.flagged[-1]


class Verdict(StrEnum):
    PENDING = "pending"  # flagged, not yet persistent
    CONFIRMED = "confirmed"
    DISMISSED = "dismissed"  # stopped being flagged before it persisted


class Persistence:
    """Tracks flags per subject and says when one is confirmed or dismissed.

    ``observe`` is called for subjects flagged in a window; ``close_window``
    for every window, to dismiss subjects whose flags stopped.
    """

    def __init__(self, confirm_windows: int, confirm_seconds: float = 0.0):
        self.need = confirm_windows
        self.min_seconds = confirm_seconds
        self.span = 4 * confirm_windows  # horizon of the intermittent rule
        self.streaks: dict[Hashable, Streak] = {}

    def observe(self, subject: Hashable, seq: int, conditions: Hashable,
                steady: bool = True, strict: bool = False, seconds: float = 0.0,
                explained: Callable[[], bool] | None = None,
                need_seconds: tuple[float, float] | None = None) -> tuple[Verdict, Streak]:
        """Record a flag of a window that lasted ``seconds``; ``strict`` (a
        subject with no healthy history yet to judge it by) asks one steady
        window more.

        ``explained`` says whether a counter names the slowdown's cause in this
        window (``localize.counter_explains``).  ``ConfirmSeconds`` is there
        because a few short windows of a process the scheduler set back cannot
        be told from a fault by their statistics, only by their length; when
        the kernel or the GPU itself says why the subject is slow, the steady
        windows suffice.  Asked only when the seconds are what is missing.
        ``need_seconds``: (unexplained, explained) seconds this subject needs
        instead of (``ConfirmSeconds``, none)."""
        streak = self.streaks.get(subject)
        if streak is None or streak.conditions != conditions or seq - streak.last_seq >= self.span:
            streak = self.streaks[subject] = Streak(conditions, seq)
        if not streak.flagged or seq - streak.flagged[-1] > 2:
            streak.run_start = seq
            streak.run_seconds = 0.0
        if streak.flagged[-1:] != [seq]:
            streak.flagged.append(seq)
            streak.run_seconds += seconds
            streak.seconds[seq] = seconds
        if steady and streak.steady[-1:] != [seq]:
            streak.steady.append(seq)
        streak.dismissed = False
        streak.flagged = [s for s in streak.flagged if s > seq - self.span]
        streak.seconds = {s: streak.seconds[s] for s in streak.flagged}
        need = self.need + 1 if strict else self.need
        streak.steady = [s for s in streak.steady if s > seq - (self.need + 2)]
        steady = sum(1 for s in streak.steady if s > seq - (need + 1))
        unexplained_s, explained_s = need_seconds if need_seconds is not None else (self.min_seconds, 0.0)
        steadily = steady >= need and (streak.run_seconds >= unexplained_s or (
            streak.run_seconds >= explained_s and explained is not None and explained()))
        again_and_again = len(streak.flagged) >= need + 1 and sum(streak.seconds.values()) >= unexplained_s
        if steadily or again_and_again:
            streak.intermittent = not steadily
            return Verdict.CONFIRMED, streak
        return Verdict.PENDING, streak

    def close_window(self, seq: int) -> list[Hashable]:
        """Subjects that just became hopeless (a lone flag whose steady window
        has passed): the caller dismisses them.  Their flags are remembered
        until they age out of the horizon, so a fault that keeps coming back
        is still confirmed by the intermittent rule."""
        hopeless = []
        for subject, streak in list(self.streaks.items()):
            recent = [s for s in streak.flagged if s > seq - self.span]
            if not recent:
                del self.streaks[subject]
                if not streak.dismissed:
                    hopeless.append(subject)
                continue
            if not streak.dismissed and seq - streak.last_seq >= self.need and len(recent) < self.need:
                streak.dismissed = True
                hopeless.append(subject)
        return hopeless

    def forget(self, subject: Hashable) -> None:
        self.streaks.pop(subject, None)


class ProbeVerdict(StrEnum):
    DEVICE = "device"  # slow on identical compute
    LINK = "link"  # transfers touching one node slow
    NORMAL = "normal"  # identical work runs at peer speed: host or input
    INCOMPLETE = "incomplete"


@dataclass(frozen=True)
class ProbeJudgement:
    verdict: ProbeVerdict
    evidence: tuple[Evidence, ...]
    node: str | None = None


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def judge_probe(
    results: Mapping[int, ProbeResult],
    suspects: set[int],
    node_of: Mapping[int, str],
    slowdown: float,
) -> ProbeJudgement:
    """Judge a matched probe's results for the suspect ranks (see module docstring)."""
    peers = [r for r in results if r not in suspects]
    subject = [r for r in results if r in suspects]
    evidence: list[Evidence] = []
    # No suspect ranks (a job-wide slowdown): only the links are in question.
    gemm_subject = _median([results[r].gemm_ms for r in subject if results[r].gemm_ms is not None])
    gemm_peers = _median([results[r].gemm_ms for r in peers if results[r].gemm_ms is not None])
    if np.isfinite(gemm_subject) and np.isfinite(gemm_peers) and gemm_peers > 0:
        slow_gemm = gemm_subject / gemm_peers >= 1.0 + slowdown
        evidence.append(Evidence(
            signal="probe.gemm_ms", value=round(gemm_subject, 3), peers=round(gemm_peers, 3),
            note=("identical GEMM is slower on the suspect: the device" if slow_gemm
                  else "identical GEMM runs at peer speed"),
        ))
        if slow_gemm:
            return ProbeJudgement(ProbeVerdict.DEVICE, tuple(evidence))
    # Ring pairs between two nodes: a node is the common end of the slow links
    # when *every* pair touching it is slower than *every* pair that does not
    # (by 1 + 2 x MinSlowdown).  A bad link slows each transfer over it; one
    # pair slowed by a preempted end (a loaded host) slows only itself, and
    # must not be read as the link of whichever of its two ends the medians
    # happen to favour.  (A pair within one node crosses no network link:
    # left out.)  A node whose own rank is preempted slows *every* pair it
    # takes part in, though, as its link would.  Its ends' run-queue waits
    # (``wait_ms``, ``served_wait_ms``: time the hosts could not run them)
    # tell the two apart by their *share* of the pairs' time.  On a shared
    # host every end waits for a core now and then, and a transfer a slow link
    # stretches wakes its ends more often, each wakeup waiting too: the slow
    # pairs then wait about the same share of their time as the others do
    # (benchmarks/links.py, a degraded link on this 2-core box: shares 0.68
    # against 0.77).  A loaded host's pairs spend a far larger share of
    # their time waiting (the noisy-neighbour test's n1: 0.7 against 0.18).
    # Only then (HOST_WAIT_SHARE x the others' share or more) is their wait
    # beyond the others' taken off their time, and only the rest counts
    # against the link.  The pairs they are compared with keep their full
    # time, so the waits can only withhold a verdict, never make one.
    hops: list[tuple[frozenset[str], float, float]] = []
    for rank, result in results.items():
        for hop in result.p2p:
            ends = {node_of.get(rank), hop.node or node_of.get(hop.peer)}
            if None not in ends and len(ends) == 2:
                answering = results.get(hop.peer)
                waited = (hop.wait_ms or 0.0) + ((answering.served_wait_ms or 0.0) if answering else 0.0)
                hops.append((frozenset(ends), hop.ms, waited))
    nodes = set().union(*(ends for ends, _, _ in hops)) if hops else set()
    if len(nodes) >= 3:
        contrast, preempted = {}, {}
        subject_nodes = {node_of.get(r) for r in suspects}
        for node in nodes:
            far = [ms for ends, ms, _ in hops if node not in ends]
            near = [(ms, ms) for ends, ms, _ in hops if node in ends]
            usual_share = _median([waited / ms for ends, ms, waited in hops if node not in ends and ms > 0])
            near_share = _median([waited / ms for ends, ms, waited in hops if node in ends and ms > 0])
            if near_share >= HOST_WAIT_SHARE * usual_share and near_share > 0:
                usual_wait = _median([waited for ends, _, waited in hops if node not in ends])
                near = [(ms, max(0.0, ms - max(0.0, waited - usual_wait))) for ends, ms, waited in hops
                        if node in ends]
            if not (near and far and max(far) > 0):
                continue
            touching, elsewhere = _median([ms for ms, _ in near]), _median(far)
            if min(link_ms for _, link_ms in near) / max(far) >= 1.0 + 2 * slowdown:
                contrast[node] = (touching / elsewhere, touching, elsewhere)
            elif (not suspects or node in subject_nodes) and min(ms for ms, _ in near) / max(far) >= 1.0 + 2 * slowdown:
                # Said only of a node the incident is about, as a link is (below).
                preempted[node] = (touching / elsewhere, touching, elsewhere,
                                   _median([ms - link_ms for ms, link_ms in near]))
        if preempted and not contrast:
            node = max(preempted, key=lambda n: preempted[n][0])
            factor, touching, elsewhere, waited = preempted[node]
            evidence.append(Evidence(
                signal="probe.p2p_ms", value=round(touching, 3), peers=round(elsewhere, 3),
                note=f"ring transfers touching {node} are {factor:.1f}x slower than the others, but its hosts "
                     f"could not run the ranks for {waited:.2f} ms of each beyond what the other pairs' ends waited "
                     f"(run-queue wait): a loaded host, "
                     f"not its link"))
        if contrast:
            worst = max(contrast, key=lambda n: contrast[n][0])
            factor, touching, elsewhere = contrast[worst]
            if not suspects or worst in subject_nodes:
                # A slow link elsewhere is not evidence about this subject (a GPU
                # clock incident on n2 must not carry "n1's link"); a job-wide
                # slowdown, with no suspects, is about the links themselves.
                evidence.append(Evidence(
                    signal="probe.p2p_ms", value=round(touching, 3), peers=round(elsewhere, 3),
                    note=f"ring transfers touching {worst} are {factor:.1f}x slower than the others, each "
                         f"slower than any other: its link"))
                return ProbeJudgement(ProbeVerdict.LINK, tuple(evidence), node=worst)
    if evidence:
        return ProbeJudgement(ProbeVerdict.NORMAL, tuple(evidence))
    return ProbeJudgement(ProbeVerdict.INCOMPLETE, (Evidence(
        signal="missing", value="probe timings",
        note="the matched probe returned no comparable GEMM or cross-node ring timings"),))


def agree_on_link(judgements: list[ProbeJudgement]) -> ProbeJudgement:
    """Several matched probes of one job-wide slowdown, taken together.

    A link is named only when the latest two probes name the same node: one
    probe's ring timings on a shared network are one noisy measurement, and a
    probe asked for when the slowdown was first flagged may have run before
    the fault did.  Otherwise the verdict is incomplete, with every probe's
    evidence and a ``missing`` line saying what would name the link.
    """
    named = [j.node if j.verdict is ProbeVerdict.LINK else None for j in judgements]
    evidence = tuple(e for j in judgements for e in j.evidence)
    if len(named) >= 2 and named[-1] is not None and named[-2] == named[-1]:
        return ProbeJudgement(ProbeVerdict.LINK, evidence, node=named[-1])
    if len(named) < 2:
        what = (f"a second matched probe that names {named[0]}'s link too" if named and named[0]
                else "a matched probe that names one link")
    else:
        what = ("matched probes that agree on one link (they named "
                + ", ".join(n or "no link" for n in named) + ")")
    return ProbeJudgement(ProbeVerdict.INCOMPLETE, evidence + (Evidence(
        signal="missing", value=what, note="needed before a link is named"),))


def ask_again_about_link(judgements: list[ProbeJudgement], combined: ProbeJudgement, seq: int) -> str | None:
    """Why another matched probe should be asked about a job-wide slowdown's link, or None.

    One probe is one noisy measurement (and the first may have run before the
    fault did): ask again until two in a row agree, up to ``MAX_LINK_PROBES``.
    """
    latest = judgements[-1]
    if latest.verdict is not ProbeVerdict.LINK or combined.verdict is ProbeVerdict.LINK \
            or len(judgements) >= MAX_LINK_PROBES:
        return None
    named = ", ".join(j.node or "no link" for j in judgements)
    return f"another matched probe to confirm {latest.node}'s link (probes so far named {named}; window {seq})"


def take_probe_verdict(incident: Incident, judgement: ProbeJudgement, combined: ProbeJudgement,
                       comm_bound: bool | None) -> None:
    """A confirmed incident takes a matched probe's verdict that came back after it confirmed.

    ``judgement`` is this probe's; ``combined`` what all the subject's probes
    say together (``agree_on_link`` for a job-wide slowdown, else the same).
    """
    if incident.kind is IncidentKind.JOB and combined.verdict is ProbeVerdict.LINK and comm_bound:
        # Confirmed before the probes came back, with no node to name: the
        # matched rings have now found the link.  Only for a rise in the
        # collectives: a link cannot explain every rank's own work rising
        # (diagnose_job never names one there either).
        node = combined.node
        incident.kind, incident.cause, incident.confidence = IncidentKind.LINK, Cause.COMM_LINK, 0.85
        incident.node = incident.link = node
        incident.evidence = [e for e in incident.evidence if e.signal != "missing"]
        incident.action = propose(incident.kind, incident.cause, node, incident.job, link=node)
        incident.evidence = incident.evidence + list(judgement.evidence)
    elif incident.kind is IncidentKind.JOB:
        # Every probe's evidence replaces the last one's: what they say together is the finding.
        incident.evidence = [e for e in incident.evidence if not e.signal.startswith("probe.")
                             and not (e.signal == "missing" and "probe" in str(e.value))] \
            + list(combined.evidence)
    else:
        incident.evidence = incident.evidence + list(judgement.evidence)
