"""Verify: did the action bring useful throughput back?  Pure.

Throughput is the whole job's samples per second in one window (the sum of
every rank's ``samples`` over the window's wall time), the quantity the user
pays for.  The *baseline* is the median of the job's last healthy windows
before the incident's onset; *after* is the median of the first
``VerifyWindows`` windows measured once the action completed.  Medians, so a
single checkpoint or evaluation window does not decide the verdict.

    recovered  <=>  after >= RecoveryFraction x baseline

The incident's ``result`` records ``throughput_before`` as the throughput
*during* the slowdown, just before the action (``during``), and
``throughput_after`` as above: the gain the action bought, side by side.

Without a baseline (the job was slow from its first window) recovery cannot
be judged; the verdict says so and the incident ends unresolved with that note.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from artemisd.control import actions
from artemisd.control.actions import ActionKind
from artemisd.detect import MAD_TO_SIGMA
from artemisd.loss import BASELINE_WINDOWS

# Causes whose fault lives in a rank's own work, not in the collectives it joins:
# their verification may count the collectives' own time as the machine's pace.
# A host's CPU starvation also slows its share of every gloo collective, and a
# link or island fault is in the collectives: those are judged on busy time alone.
WORK_ONLY_CAUSES = frozenset({"gpu.thermal", "gpu.power", "gpu.clocks", "input.loader", "input.storage"})


@dataclass(frozen=True)
class WindowShape:
    """One job window's throughput and what it was measured under: like is compared with like.

    ``samples_per_step`` is the job's global batch: samples of all ranks per
    step (a rebalance moves samples between ranks, not this); ``steps`` the
    median steps in the window (a window closed early by the time limit has
    fewer: it is not a full window).  ``pace`` is the busy ms per step of the
    job's fast ranks (the lower quartile over ranks): how fast this machine ran
    work a subject's fault does not slow (``verify``'s load correction).
    ``collectives`` is the ms per step every rank spends in the collectives
    themselves: the window's wall time per step minus the slowest rank's busy
    time, i.e. the time that is not waiting for a slower rank
    (``collective_time``).  ``seconds`` is the window's wall time (None:
    not measured), what ``VerifySeconds`` adds up.
    """

    seq: int
    throughput: float
    world: int
    samples_per_step: float | None
    steps: float
    pace: float | None = None
    collectives: float | None = None
    seconds: float | None = None

    @classmethod
    def of(cls, seq: int, throughput: float, world: int, samples: np.ndarray, steps: np.ndarray,
           busy: np.ndarray | None = None, step: np.ndarray | None = None) -> WindowShape:
        counted = samples[np.isfinite(samples)]
        median_steps = float(np.median(steps)) if steps.size else 0.0
        total = float(np.sum(counted)) if counted.size else 0.0
        batch = round(total / median_steps, 3) if total > 0 and median_steps > 0 else None
        # The wall time the throughput was measured over (the ranks' median t1 - t0): the
        # steps and the probe's work at the window's boundary.
        seconds = total / throughput if total > 0 and np.isfinite(throughput) and throughput > 0 else None
        wall_ms = 1e3 * seconds / median_steps if seconds is not None and median_steps > 0 else None
        return cls(seq, float(throughput), int(world), batch, median_steps, fast_pace(busy),
                   collective_time(step, busy, wall_ms), seconds)

    def like(self, other: WindowShape) -> bool:
        """Same rank count and the same global batch, give or take one short batch in the window.

        A sampler's last batch of an epoch is short (8192 samples over 3 ranks
        at 64 a batch: 43 samples every 43rd step), so the global batch of a
        window that holds an epoch's end is up to one step's worth (1/steps)
        below the others: the same workload.  A changed batch size or rank
        count is far outside that.
        """
        if self.world != other.world or self.samples_per_step is None or other.samples_per_step is None:
            return self.world == other.world and self.samples_per_step == other.samples_per_step
        steps = max(1.0, min(self.steps, other.steps))
        tolerance = other.samples_per_step / steps + 1e-6
        return abs(self.samples_per_step - other.samples_per_step) <= tolerance


def fast_pace(busy: np.ndarray | None) -> float | None:
    """Busy ms per step of the job's fast ranks (lower quartile, an actual rank's value); None if unmeasured.

    The lower quartile, not the median: in a two-rank job the median is half
    the straggler's own time.  A one-rank job has no rank the fault spares.
    """
    if busy is None:
        return None
    finite = busy[np.isfinite(busy)]
    if finite.size < 2:
        return None
    return float(np.quantile(finite, 0.25, method="lower"))


def collective_time(step: np.ndarray | None, busy: np.ndarray | None, wall_ms: float | None = None) -> float | None:
    """ms per step every rank spends outside the slowest rank's own work (>= 0): the collectives themselves.

    Measured from ``wall_ms``, the window's wall time per step, when known:
    the throughput is samples over that wall time, which also holds the work
    at window boundaries outside any step (the probe's agreement, a report
    handed to its sender).  On a loaded machine that work slows as the
    collectives do; a pace taken from the steps alone would leave it out and
    blame the job's throughput for it.  Without it, the job's median step.
    """
    if busy is None:
        return None
    busies = busy[np.isfinite(busy)]
    if not busies.size:
        return None
    if wall_ms is None:
        if step is None:
            return None
        steps = step[np.isfinite(step)]
        if not steps.size:
            return None
        wall_ms = float(np.median(steps))
    return max(0.0, wall_ms - float(np.max(busies)))


def healthy_shape(shapes: Sequence[WindowShape], onset_window: int | None,
                  depth: int = BASELINE_WINDOWS) -> WindowShape | None:
    """The job's healthy shape before the onset (what verification compares with).

    Its world and global batch are the last healthy window's; its batch, steps
    and pace the median of the last ``depth`` windows of that shape, so one
    window holding an epoch's short batch does not set the shape, nor one slow
    window the pace.
    """
    before = [w for w in shapes if onset_window is None or w.seq < onset_window]
    # A window whose throughput was not measured (a rank's report missed it) does not
    # set the shape either: its global batch counts only the ranks that reported.
    before = [w for w in before if np.isfinite(w.throughput)] or before
    if not before:
        return None
    last = before[-1]
    same = [w for w in before if w.world == last.world][-depth:]
    batches = [w.samples_per_step for w in same if w.samples_per_step is not None]
    paces = [w.pace for w in same if w.pace is not None]
    collectives = [w.collectives for w in same if w.collectives is not None]
    return WindowShape(last.seq, float(np.median([w.throughput for w in same])), last.world,
                       round(float(np.median(batches)), 3) if batches else last.samples_per_step,
                       float(np.median([w.steps for w in same])),
                       float(np.median(paces)) if paces else None,
                       float(np.median(collectives)) if collectives else None)


def after_windows(shapes: Sequence[WindowShape], action_window: int | None, healthy: WindowShape | None,
                  skip: int) -> tuple[list[WindowShape], list[WindowShape], str]:
    """The windows that may judge an action: (the like ones, the unlike ones, a note).

    ``shapes`` are the windows of the run being judged: the same run after
    ``action_window``, or a requeued job's new run (``action_window`` None).
    The first ``skip`` of them are left out (the window straddling the action;
    a restarted job's warm-up), then every window that is not full (fewer
    steps than a healthy window) is left out, and windows of another shape
    (rank count, samples per step) are set aside: they cannot be compared
    with the healthy throughput.
    """
    after = [w for w in shapes if action_window is None or w.seq > action_window][skip:]
    if healthy is not None:
        after = [w for w in after if w.steps >= healthy.steps]
    measured = [w for w in after if np.isfinite(w.throughput)]
    if healthy is None:
        return measured, [], ""
    like = [w for w in measured if w.like(healthy)]
    unlike = [w for w in measured if not w.like(healthy)]
    note = ""
    if unlike:
        w = unlike[-1]
        note = (f"{len(unlike)} window(s) after the action ran {w.world} ranks, {w.samples_per_step} samples "
                f"per step; the healthy windows ran {healthy.world} ranks, {healthy.samples_per_step}: "
                f"not comparable")
    return like, unlike, note


@dataclass(frozen=True)
class Verification:
    """``done`` False: not enough windows yet.  ``recovered`` None: could not be judged.

    ``expected`` is what recovery was judged against: the healthy throughput,
    corrected for the machine's pace during verification when it was measured.
    """

    done: bool
    recovered: bool | None = None
    before: float | None = None
    after: float | None = None
    note: str = ""
    expected: float | None = None
    # Recovered only at the machine's pace: below RecoveryFraction of the healthy throughput as it
    # was, at or above it of what a healthy job makes on the machine as loaded then.
    load_corrected: bool | None = None
    # Recovered although the median stayed below the bar: by less than the windows' noise can tell
    # from a full recovery, after VERIFY_SPAN_CAP times the windows (``verify``).
    within_noise: bool | None = None

    def result_fields(self, rounded: Callable[[float | None], float | None]) -> dict[str, Any]:
        """The fields of the incident's ``Result`` this verification measured (the caller rounds)."""
        return {"throughput_after": rounded(self.after), "throughput_expected": rounded(self.expected),
                "recovered": self.recovered, "recovered_after_load_correction": self.load_corrected,
                "recovered_within_noise": self.within_noise}


def seconds_by_window(shapes: Sequence[WindowShape]) -> dict[int, float | None]:
    """Each window's wall time by seq: what ``loss.during`` weighs the slowed windows by."""
    return {shape.seq: shape.seconds for shape in shapes}


def span(windows: Sequence[float | WindowShape], need: int, min_seconds: float = 0.0) -> list | None:
    """The first windows that may judge: at least ``need`` of them and, where every window's wall
    time is known, at least ``min_seconds`` of it (None: not that many yet).

    Window count is scale-free, OS scheduling is not: a few windows of a few
    steps of a few ms last a second or two, long enough for the scheduler
    alone to hold one rank back in all of them.  At real window lengths
    (seconds or more) ``need`` windows already last longer and the count
    decides.
    """
    windows = list(windows)
    if len(windows) < need:
        return None
    timed = all(isinstance(w, WindowShape) and w.seconds is not None for w in windows)
    if not timed or min_seconds <= 0:
        return windows[:need]
    total = 0.0
    for i, w in enumerate(windows):
        total += w.seconds  # type: ignore[union-attr,operator]
        if i + 1 >= need and total >= min_seconds:
            return windows[:i + 1]
    return None


@dataclass(frozen=True)
class Rules:
    """How an action's outcome is judged, one value wherever the loop runs (live, replay, simulators).

    ``windows`` (VerifyWindows) windows after the action, lasting at least
    ``seconds`` (VerifySeconds: ``span``); recovered at ``fraction``
    (RecoveryFraction) of the healthy throughput; a requeued job's first
    ``warmup`` (VerifyWarmupWindows) windows skipped.
    """

    windows: int
    fraction: float
    warmup: int = 0
    seconds: float = 0.0

    @classmethod
    def of(cls, settings: Any) -> Rules:
        """From the daemon's settings (``config.DaemonSettings``, read by name: this module stays pure)."""
        return cls(settings.verify_windows, settings.recovery_fraction, settings.verify_warmup_windows,
                   settings.verify_seconds)

    def windows_lasting(self, window_s: float) -> int:
        """How many windows of ``window_s`` seconds each ``span`` reads under these rules."""
        if window_s <= 0 or self.seconds <= 0:
            return self.windows
        return max(self.windows, math.ceil(self.seconds / window_s))


def latest_since(windows: Sequence[WindowShape], rules: Rules) -> int | None:
    """The window just before the job's latest span (``span``'s rule, counted back from the newest):
    ``measure(..., since=)`` judges the windows after it.  None: not enough windows yet."""
    need = rules.windows
    if len(windows) <= need:
        return None
    back = span(list(reversed(windows[1:])), need, rules.seconds)
    if back is None:
        return None
    return windows[len(windows) - len(back) - 1].seq


# An inconclusive measurement (below the bar, by less than its own noise can tell) goes on, up to
# this many times VerifyWindows; below the bar by CLEAR_BELOW_SE standard errors
# of the difference is a verdict at once.
VERIFY_SPAN_CAP = 4
CLEAR_BELOW_SE = 2.0
# The standard error of a median, in standard deviations over sqrt(n), for normal noise.
MEDIAN_SE = 1.2533


def relative_noise(throughputs: Sequence[float]) -> float | None:
    """How much one window's throughput scatters, relative to the median: 1.4826 x MAD / median
    (a robust standard deviation).  None for fewer than 3 measured windows."""
    values = np.asarray([t for t in throughputs if np.isfinite(t)], dtype=float)
    if values.size < 3:
        return None
    middle = float(np.median(values))
    if middle <= 0:
        return None
    return float(MAD_TO_SIGMA * np.median(np.abs(values - middle)) / middle)


def healthy_noise(shapes: Sequence[WindowShape], onset_window: int | None,
                  depth: int = BASELINE_WINDOWS) -> tuple[float, int] | None:
    """(relative noise, windows) of the healthy windows the baseline is the median of: how well
    that median is known."""
    before = [w.throughput for w in shapes if (onset_window is None or w.seq < onset_window)
              and np.isfinite(w.throughput)][-depth:]
    noise = relative_noise(before)
    return None if noise is None else (noise, len(before))


def _standard_error(throughputs: Sequence[float], healthy: tuple[float, int] | None) -> float:
    """Relative standard error of (median after - healthy median): 0 where either noise is unknown,
    which leaves the verdict to the bar alone."""
    after = relative_noise(throughputs)
    if healthy is None or after is None:
        return 0.0
    noise, count = healthy
    return MEDIAN_SE * math.sqrt(after ** 2 / len(throughputs) + noise ** 2 / max(1, count))


def verify(before: float | None, after: Sequence[float | WindowShape], need: int, fraction: float,
           healthy_pace: float | None = None, healthy_collectives: float | None = None,
           min_seconds: float = 0.0, noise: tuple[float, int] | None = None) -> Verification:
    """``before`` is the job's *healthy* throughput (``baseline``), ``after`` the windows since the action.

    Judged on the median of the first ``need`` windows after the action
    (more, until they last ``min_seconds``: ``span``)::

        recovered  <=>  after >= fraction x expected
        expected   =    before x healthy_pace / pace after    (never above before)

    The pace factor is the load correction: on a shared machine the job's
    fast ranks, which the subject's fault never slowed, ran ``pace after /
    healthy_pace`` times slower (or faster) than in the healthy windows, and
    a healthy job would have lost that much throughput too.  A machine that ran
    faster does not raise the bar above ``before``: the correction excuses
    load, it never asks a recovered job for more than its healthy throughput.
    Without both paces (``healthy_pace`` None: a job-wide subject, whose fault
    may be exactly what slows every rank) ``expected`` is ``before``.

    With ``healthy_collectives`` the pace is a step's work the fault does
    not touch: the fast ranks' busy time *plus* the collectives' own time
    (``collective_time``).  On a loaded machine the collectives slow down
    as much as the work (gloo moves tensors on the CPU, a shared fabric
    gets busy), and a healthy job would lose that too.  The caller gives it
    only for a subject whose fault cannot be in the collectives (a GPU, an
    input pipeline); the slowest rank's excess over the fast ranks is never
    part of the pace, so a subject that is still slow is never excused.

    ``noise`` (``healthy_noise``: how much the healthy windows scatter, and
    how many there were) makes the verdict a measurement, not a coin toss:
    below the bar by more than ``CLEAR_BELOW_SE`` standard errors of the
    difference of the two medians is not recovered at once; below it by
    less, the measurement goes on, window by window, up to
    ``VERIFY_SPAN_CAP`` times as many windows.  Still within
    the noise then, the action is judged to have helped, and the note says
    by how much the windows scatter: the noise of this machine cannot tell
    it from a full recovery, and undoing a right action or paging a person
    for noise costs more than keeping it.  On a steady machine the standard
    error is small and the bar alone decides, as without ``noise``.
    """
    cap = need * VERIFY_SPAN_CAP
    count = need
    while True:
        window = span(after, count, min_seconds)
        if window is None:
            seconds = sum(w.seconds or 0.0 for w in after if isinstance(w, WindowShape))
            lasting = f" ({seconds:.1f} of {min_seconds:g} s)" if min_seconds > 0 else ""
            if count == need:
                return Verification(False, before=before,
                                    note=f"{len(after)} of {need} windows{lasting} measured after the action")
            return Verification(False, before=before,
                                note=f"{len(after)} windows{lasting} measured after the action: within their "
                                     f"noise of the bar so far, measuring on (up to {cap} windows)")
        throughputs = [w.throughput if isinstance(w, WindowShape) else float(w) for w in window]
        measured = float(np.median(throughputs))
        if before is None or before <= 0:
            return Verification(True, None, before, measured,
                                "no healthy baseline before the incident: recovery cannot be judged")
        expected, load = _expected(before, measured, window, healthy_pace, healthy_collectives)
        error = _standard_error(throughputs, noise)
        short = (fraction * expected - measured) / expected
        if short <= 0 or short > CLEAR_BELOW_SE * error:
            recovered, within = short <= 0, ""
            break
        if len(window) >= cap:
            recovered = True
            scatter = 100.0 * noise[0] if noise else 0.0
            within = (f"; {100.0 * short:.0f} points short of the bar, within the noise of {len(window)} windows "
                      f"against {noise[1] if noise else 0} healthy ones (a healthy window scatters "
                      f"±{scatter:.0f} %): judged to have helped")
            break
        count = len(window) + 1
    corrected = recovered and not within and measured < fraction * before
    if corrected:
        load += (f"; recovered only after that load correction: {100.0 * measured / before:.0f} % of the "
                 f"healthy throughput as it was")
    return Verification(True, recovered, before, measured,
                        f"throughput {measured:.1f} samples/s after vs {before:.1f} healthy "
                        f"({100.0 * measured / before:.0f} %{load}{within}; recovery needs {100.0 * fraction:.0f} %)",
                        expected, corrected, bool(within))


def _expected(before: float, measured: float, window: Sequence[float | WindowShape], healthy_pace: float | None,
              healthy_collectives: float | None) -> tuple[float, str]:
    """What a healthy job makes at the machine's pace in ``window`` (``verify``'s load correction), and
    the note that says so."""
    expected, load = before, ""
    shapes = [w for w in window if isinstance(w, WindowShape)]
    paces = [w.pace for w in shapes if w.pace is not None and w.pace > 0]
    if healthy_pace is None or healthy_pace <= 0 or len(paces) != len(window):
        return expected, load
    what, healthy = "busy time", healthy_pace
    if healthy_collectives is not None and all(w.collectives is not None for w in shapes):
        what, healthy = "busy time plus collectives", healthy_pace + healthy_collectives
        paces = [w.pace + w.collectives for w in shapes]  # type: ignore[operator]
    pace = float(np.median(paces))
    factor = pace / healthy
    load = f"; the job's fast ranks ran {factor:.2f}x the healthy {what} per step ({pace:.1f} vs {healthy:.1f} ms)"
    if factor >= 1.0:
        expected = before / factor
        load += (f": at that pace a healthy job makes {expected:.1f}, and {measured:.1f} is "
                 f"{100.0 * measured / expected:.0f} % of it")
    else:
        # The machine ran faster than in the healthy windows (a load gone, a requeue onto
        # quieter nodes).  The correction only excuses: demanding more than the healthy
        # throughput would call a job running above it unrecovered and undo a right action,
        # and a fault still present shows again as a straggler against its own peers.
        load += ", faster: judged against the healthy throughput as it was"
    return expected, load


# --- the verdict on an incident's action -----------------------------------------------------------

# Subjects the job's other ranks do not share: their recovery is judged at the machine's pace.
LOCAL_KINDS = frozenset({"rank", "node", "link"})


@dataclass(frozen=True)
class Evidence:
    """What verification measures from: the windows of the run the fault was seen in (``origin``),
    those of the run being judged (``current``: the same list unless the job was requeued), the
    healthy throughput, the window the action was done after, and the job's last report (s)."""

    baseline: float | None
    origin: Sequence[WindowShape]
    current: Sequence[WindowShape]
    restarted: bool
    onset_window: int | None
    action_window: int | None
    last_seen: float | None = None


def measure(kind: str, cause: str, ev: Evidence, rules: Rules, since: int | None = None) -> Verification:
    """The verdict on an action from the windows measured since (``done`` False: too few yet).

    Like with like: windows of the healthy shape (rank count, global batch),
    full ones, past the window that straddles the action (same run) or the
    warm-up of a requeued job's new run.  Recovery is judged against the
    healthy throughput at the machine's pace then (``verify``) for a subject
    the job's other ranks do not share (a rank, node or link), the
    collectives' own time counted in that pace when the cause cannot be in
    them (``WORK_ONLY_CAUSES``); a job-wide subject is judged against the
    healthy throughput as it was.  ``since`` (a window of the current run):
    judge on the windows after it instead, e.g. the subject's latest healthy
    stretch.
    """
    healthy = healthy_shape(ev.origin, ev.onset_window)
    if since is not None:
        after, unlike, unlike_note = after_windows(ev.current, since, healthy, 0)
    elif not ev.restarted:
        # The same run goes on: the first window after the action may straddle it.
        after, unlike, unlike_note = after_windows(ev.current, ev.action_window, healthy, 1)
    else:
        # A requeued job started again: judge it once back in steady state,
        # after its warm-up windows (imports, process groups, first batches).
        after, unlike, unlike_note = after_windows(ev.current, None, healthy, rules.warmup)
    pace = healthy.pace if healthy is not None and kind in LOCAL_KINDS else None
    collectives = healthy.collectives if pace is not None and cause in WORK_ONLY_CAUSES else None
    verdict = verify(ev.baseline, after, rules.windows, rules.fraction, pace, collectives, rules.seconds,
                     healthy_noise(ev.origin, ev.onset_window))
    if not verdict.done and span(unlike, rules.windows, rules.seconds) is not None:
        verdict = Verification(True, None, ev.baseline, None,
                               f"{unlike_note}: recovery cannot be judged like with like")
    return verdict


@dataclass(frozen=True)
class Undo:
    """A rollback verification asks for: ``undo`` the action ``action_id``, or keep it (``why``)."""

    action_id: int
    kind: str
    target: str | None
    undo: bool
    why: str


@dataclass(frozen=True)
class Verdict:
    """``state``: resolved, unresolved, or None (not judged yet).  ``rollbacks``: what to undo or keep;
    ``rolled_back``: the incident's action counts as rolled back (every reversible one was undone)."""

    state: str | None
    verification: Verification
    rollbacks: tuple[Undo, ...] = ()
    rolled_back: bool = False


def verdict(kind: str, cause: str, ev: Evidence, rules: Rules, now: float, silence_s: float,
            done_actions: Sequence[tuple[int, str, str | None]], still_shown: dict[str, str | None] | None = None,
            job: str = "") -> Verdict:
    """Judge a verifying incident: resolved when throughput came back, unresolved (and what to roll back) when not.

    ``done_actions``: (id, kind, target) of the incident's actions that were
    performed.  A reversible one that did not help is undone — except a drain
    whose node still shows the fault (``still_shown[node]``, from its latest
    root-side evidence): resuming it would put a faulty node back in service,
    so it stays, and the incident's action is not counted as rolled back.  A
    verdict that could not be measured (the job went silent for
    ``silence_s``, or its windows are not comparable) undoes nothing.
    """
    measured = measure(kind, cause, ev, rules)
    if not measured.done:
        if ev.last_seen is None or now - ev.last_seen < silence_s:
            return Verdict(None, measured)
        # The job stopped reporting (ended, or never came back from a requeue): say so.
        measured = Verification(True, None, ev.baseline, None,
                                f"no windows from job {job} for {now - ev.last_seen:.0f} s after the action: "
                                f"recovery cannot be measured")
    if measured.recovered:
        return Verdict("resolved", measured)
    if measured.recovered is None:
        return Verdict("unresolved", measured)
    undos: list[Undo] = []
    for action_id, action_kind, target in done_actions:
        if not actions.reversible(action_kind):
            continue
        # Undoing a drain puts its node back in service: not while the node still shows the fault.
        seen = (still_shown or {}).get(target or "") if actions.rule(action_kind).undone_by is ActionKind.UNDRAIN \
            else None
        undos.append(Undo(action_id, action_kind, target, seen is None, seen or "no recovery"))
    return Verdict("unresolved", measured, tuple(undos), all(u.undo for u in undos))
