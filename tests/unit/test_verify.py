"""Verify on numbers: baseline before the onset, median after, RecoveryFraction."""

from __future__ import annotations

from artemisd.verify import baseline, verify


def test_baseline_uses_only_windows_before_the_onset():
    series = [(s, 300.0) for s in range(10)] + [(s, 250.0) for s in range(10, 14)]
    assert baseline(series, onset_window=10) == 300.0
    assert baseline(series, onset_window=0) is None
    assert baseline(series[:3] + [(3, 900.0)], onset_window=4, depth=3) == 300.0


def test_waits_for_enough_windows():
    v = verify(300.0, [299.0], need=3, fraction=0.95)
    assert not v.done and "1 of 3" in v.note


def test_recovered_and_not():
    assert verify(300.0, [290.0, 300.0, 310.0], 3, 0.95).recovered is True
    v = verify(300.0, [250.0, 260.0, 400.0], 3, 0.95)
    assert v.done and v.recovered is False and v.after == 260.0
    assert "87 %" in v.note


def test_one_outlier_window_does_not_decide():
    assert verify(300.0, [120.0, 299.0, 301.0], 3, 0.95).recovered is True


def test_no_baseline_cannot_be_judged():
    v = verify(None, [300.0, 300.0], 2, 0.95)
    assert v.done and v.recovered is None and "cannot be judged" in v.note


def test_during_is_the_throughput_while_the_slowdown_was_in_force():
    from artemisd.verify import during

    series = [(0, 100.0), (1, 101.0), (2, 70.0), (3, 72.0), (4, 71.0), (5, 99.0)]
    assert during(series, onset_window=2, action_window=4) == 71.0
    assert during(series, onset_window=2, action_window=None) == 71.5
    assert during(series, onset_window=None, action_window=4) == 71.0  # the last windows before the action
    assert during(series, onset_window=9, action_window=4) == 71.0
    assert during([], onset_window=2, action_window=4) is None
