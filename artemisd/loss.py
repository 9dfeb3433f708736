"""What a slowdown costs a job: its samples/s before the onset (healthy), while the slowdown was in
force (slowed), and the share lost, as every incident shows them and verification compares.  Pure.

Throughput is the whole job's samples per second in one window (the sum of every rank's
``samples`` over the window's wall time), the quantity the user pays for.  The healthy figure is a
median, so a single checkpoint or evaluation window does not move it; the slowed one weighs each
window by its wall time (``during``), because a fault lengthens the very windows it is measured in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

BASELINE_WINDOWS = 10
# loss_pct (the subject's busy excess per step) and the measured loss of the
# job's samples/s are two measures of one cost; past this many points apart
# the incident says why (``loss_evidence``).
LOSS_TOLERANCE_PCT = 10.0


def window_throughput(samples: Sequence[float | None], seconds: Sequence[float]) -> float | None:
    """samples/s of one job window from its ranks' reports (None if no rank counted samples)."""
    counted = [s for s in samples if s is not None]
    spans = [t for t in seconds if t > 0]
    if not counted or not spans:
        return None
    return float(sum(counted) / float(np.median(spans)))


def _measured(series: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """Windows whose throughput was measured (NaN: no rank counted samples)."""
    return [(seq, value) for seq, value in series if value is not None and np.isfinite(value)]


def baseline(series: Sequence[tuple[int, float]], onset_window: int | None,
             depth: int = BASELINE_WINDOWS) -> float | None:
    """Median throughput of the last ``depth`` windows before ``onset_window``."""
    before = [value for seq, value in _measured(series) if onset_window is None or seq < onset_window]
    before = before[-depth:]
    return float(np.median(before)) if before else None


def during(series: Sequence[tuple[int, float]], onset_window: int | None,
           action_window: int | None, seconds: Mapping[int, float | None] | None = None) -> float | None:
    """The job's throughput while the slowdown was in force: from its onset to the action.

    Where every window of that span has its wall time (``seconds``, by window seq), it is the span's
    samples over its seconds — each window weighs what it lasted.  A fault that slows a step tenfold
    makes its windows ten times as long as a healthy one: a median by count would let the short
    healthy windows at the span's ends (the one the fault began in, those between the fault's end
    and the action's "done") outvote the few long ones the job actually spent slowed, and report a
    job that lost most of its samples/s as one that lost none.  Without the wall times, the median.
    """
    upto = [(seq, value) for seq, value in _measured(series) if action_window is None or seq <= action_window]
    span = [(seq, value) for seq, value in upto if onset_window is not None and seq >= onset_window]
    if not span:
        # The windows between onset and action are no longer (or not yet) in the
        # series: the last windows before the action stand for them.
        span = upto[-3:]
    if not span:
        return None
    lasted = [seconds.get(seq) for seq, _ in span] if seconds is not None else []
    if lasted and all(t is not None and t > 0 for t in lasted):
        total = sum(lasted)  # type: ignore[arg-type]
        return float(sum(value * t for (_, value), t in zip(span, lasted)) / total)  # type: ignore[operator]
    return float(np.median([value for _, value in span]))


def over_life(series: Sequence[tuple[int, float]], onset_window: int | None) -> float | None:
    """Mean throughput from ``onset_window`` on: what a slowdown that comes and goes cost over its
    whole life (its quiet spells included), where the median of its last windows says only what the
    latest spell cost."""
    values = [value for seq, value in _measured(series) if onset_window is not None and seq >= onset_window]
    return float(np.mean(values)) if values else None


def incident_loss(healthy: float | None, series: Sequence[tuple[int, float]], onset_window: int | None,
                  recurring: bool) -> float | None:
    """What an incident costs the job now, in % of its healthy samples/s: over its last windows, or,
    for one that came back (a slowdown that comes and goes), over its whole life since its first
    onset, so one bad spell of a noisy neighbour is not read as what it costs (issue 28)."""
    if recurring:
        life = over_life(series, onset_window)
        if life is not None:
            return measured_loss(healthy, life)
    return measured_loss(healthy, during(series, None, None))


def measured_loss(healthy: float | None, slowed: float | None) -> float | None:
    """100 * (1 - slowed / healthy): the share of the job's samples/s lost, in 0..100.

    A slowed throughput at or above the healthy one is a loss of 0 (the job did
    not measurably lose samples/s); the evidence line shows both numbers, so
    nothing is hidden by the floor.
    """
    if healthy is None or slowed is None or healthy <= 0:
        return None
    return round(100.0 * max(0.0, 1.0 - slowed / healthy), 2)


def _why_apart(measured: float, loss_pct: float) -> str:
    """Why the job's measured loss and the subject's busy excess disagree (past the tolerance)."""
    if measured > loss_pct:
        return (f"the job's samples/s fell {measured:.1f} %, more than the subject's busy excess per step "
                f"explains ({loss_pct:.1f} %): the rest of the fall is in the other ranks' own work or in "
                f"the collectives, not in this subject's busy time")
    return (f"the job's samples/s fell only {measured:.1f} %, less than the subject's busy excess per step "
            f"({loss_pct:.1f} %): the others overlap part of the wait with their own work")


def loss_evidence(loss_pct: float | None, healthy: float | None, slowed: float | None) -> dict | None:
    """The ``samples_per_s`` evidence line when the measured loss and ``loss_pct`` disagree (else None)."""
    measured = measured_loss(healthy, slowed)
    if measured is None or loss_pct is None or abs(measured - loss_pct) <= LOSS_TOLERANCE_PCT:
        return None
    return {"signal": "samples_per_s", "value": round(slowed, 1), "peers": round(healthy, 1),
            "note": f"job throughput slowed vs healthy; {_why_apart(measured, loss_pct)}"}


def loss_summary(measured_loss_pct: float | None, loss_pct: float | None) -> str | None:
    """The one loss figure a person reads first, as the mail, ``artemis show`` and the demo print it.

    The job's samples/s below healthy where measured: the figure the result's
    samples/s add up to.  The busy-excess estimate (``loss_pct``) only where
    nothing was measured, or beside it where the two disagree past
    ``LOSS_TOLERANCE_PCT``, with why.
    """
    if measured_loss_pct is None:
        return None if loss_pct is None else (
            f"loss: {loss_pct:.1f} % of the job's throughput, estimated from the subject's busy excess per step "
            f"(the job's samples/s not measured against healthy yet)")
    line = f"loss: {measured_loss_pct:.1f} % of the job's samples/s, measured against healthy"
    if loss_pct is not None and abs(measured_loss_pct - loss_pct) > LOSS_TOLERANCE_PCT:
        line += f"; {_why_apart(measured_loss_pct, loss_pct)}"
    return line
