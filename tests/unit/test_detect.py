"""Detect: robust peer comparison on busy time, and job-wide slowdowns."""

import numpy as np

from artemisd.baseline import JobHistory, RankBaseline
from artemisd.config import AnalysisSettings
from artemisd.detect import detect_job, detect_ranks, island_statistics, island_typical, summarize, training_window
from artemisd.frame import WindowFrame
from tests.unit.windows import lockstep

SETTINGS = AnalysisSettings()


def frame(busy, **kw) -> WindowFrame:
    return WindowFrame.from_reports(lockstep(0, busy, **kw))


def test_straggler_is_flagged_and_waiting_ranks_are_not():
    f = frame([100, 101, 99, 120, 100, 100, 101, 99])
    flags = detect_ranks(f, SETTINGS)
    assert list(flags.rows) == [3]
    # The healthy ranks wait ~20 ms more than the straggler, yet none is flagged.
    assert np.all(f.comm_wait[[0, 1, 2]] > f.comm_wait[3])
    assert flags.ratio[3] == 120 / np.median(f.busy)


def test_median_and_mad_ignore_the_outlier():
    f = frame([100, 100, 100, 100, 100, 100, 100, 500])
    median, sigma = island_statistics(f)
    assert median[0] == 100
    assert sigma[0] == 0.5  # MAD is 0, so sigma takes its floor of 0.5 % of the median


def test_slowdown_below_min_slowdown_is_not_flagged():
    f = frame([100, 100.5, 99.5, 103, 100, 100.2, 99.8, 100])
    assert detect_ranks(f, SETTINGS).rows.size == 0


def test_large_relative_excess_inside_noise_is_not_flagged():
    # 6 % slower, but the island's own spread is far wider: not an outlier.
    f = frame([100, 80, 120, 106, 90, 110, 85, 115])
    assert detect_ranks(f, SETTINGS).rows.size == 0


def test_ranks_are_only_compared_within_their_island():
    # AMD ranks are 30 % slower than NVIDIA ranks by nature: no one is flagged.
    busy = [100, 100, 101, 99, 130, 131, 129, 130]
    f = frame(busy, island=["nvidia"] * 4 + ["amd"] * 4)
    assert detect_ranks(f, SETTINGS).rows.size == 0


def test_island_of_two_is_not_judged_by_peers():
    # No median of one peer: without the pair's own history (test_small_islands.py) nothing is flagged.
    f = frame([100, 100, 100, 100, 100, 100, 130, 100], island=["a"] * 6 + ["b"] * 2)
    assert detect_ranks(f, SETTINGS).rows.size == 0
    assert detect_ranks(f, SETTINGS, baseline_for(8, usual=[1.0] * 8, busy=[100] * 8)).rows.size == 0


def baseline_for(world, usual=None, busy=None, spread=0.005):
    return RankBaseline(
        usual_ratio=np.array(usual if usual is not None else [np.nan] * world, dtype=float),
        busy=np.array(busy if busy is not None else [np.nan] * world, dtype=float),
        spread=np.full(world, spread))


def test_usual_ratio_discounts_a_persistently_slower_gpu_only_up_to_min_slowdown():
    f = frame([100, 100, 100, 105, 100, 100, 100, 100])
    assert list(detect_ranks(f, SETTINGS).rows) == [3]
    usual = [np.nan] * 8
    usual[3] = 1.03
    assert detect_ranks(f, SETTINGS, baseline_for(8, usual)).rows.size == 0
    usual[3] = 1.5  # a straggler from the start cannot excuse itself
    g = frame([100, 100, 100, 150, 100, 100, 100, 100])
    assert list(detect_ranks(g, SETTINGS, baseline_for(8, usual)).rows) == [3]


def test_half_an_island_slowing_together_is_caught_by_its_own_history():
    # One node of a two-node job (4 of 8 ranks) is 8 % slower: the island
    # median sits between the two halves, so peers alone cannot tell.
    f = frame([100, 101, 99, 100, 108, 109, 107, 108])
    assert detect_ranks(f, SETTINGS).rows.size == 0
    history = baseline_for(8, busy=[100] * 8)
    assert list(detect_ranks(f, SETTINGS, history).rows) == [4, 5, 6, 7]


def test_the_whole_island_drifting_together_is_not_a_straggler():
    f = frame([110, 111, 109, 110, 110, 111, 109, 110])
    assert detect_ranks(f, SETTINGS, baseline_for(8, busy=[100] * 8)).rows.size == 0


def test_own_history_respects_the_rank_own_spread():
    f = frame([100, 100, 100, 100, 100, 100, 100, 107])
    noisy = baseline_for(8, busy=[100] * 8, spread=0.05)  # this rank varies 5 % window to window
    flags = detect_ranks(f, AnalysisSettings(robust_z=100), noisy)
    assert flags.rows.size == 0


def test_job_slowdown_against_history_splits_comm_from_busy():
    history = JobHistory(depth=10)
    for seq in range(4):
        history.record(summarize(frame([100] * 8, comm_ms=20)))
    assert detect_job(summarize(frame([100] * 8, comm_ms=21)), history, SETTINGS) is None
    flag = detect_job(summarize(frame([100] * 8, comm_ms=40)), history, SETTINGS)
    assert flag is not None and flag.comm_bound
    assert flag.step_ratio == 140 / 120
    assert flag.comm_rise_ms == 20 and flag.busy_rise_ms == 0


def test_job_needs_a_baseline_before_judging():
    history = JobHistory(depth=10)
    history.record(summarize(frame([100] * 8)))
    assert detect_job(summarize(frame([200] * 8)), history, SETTINGS) is None


def _without_collectives(busy, measured=True):
    reports = lockstep(0, busy, comm_ms=0.0)
    return WindowFrame.from_reports([r.model_copy(update={"collectives": () if measured else None}) for r in reports])


def test_a_window_without_the_jobs_collectives_is_no_training_window():
    history = JobHistory(depth=10)
    for _ in range(4):
        history.record(summarize(frame([100] * 8)))
    assert training_window(summarize(frame([130] * 8, comm_ms=40)), history)  # slower, collectives kept
    assert not training_window(summarize(_without_collectives([400] * 8)), history)  # every rank away
    assert training_window(summarize(_without_collectives([400] * 8, measured=False)), history)  # not measured
    unmeasured = JobHistory(depth=10)
    for _ in range(4):
        unmeasured.record(summarize(_without_collectives([100] * 8, measured=False)))
    assert training_window(summarize(_without_collectives([400] * 8)), unmeasured)  # no usual calls to compare


def test_throughput_is_samples_per_second_of_the_whole_job():
    f = frame([100] * 4, comm_ms=0, samples_per_step=10)
    # 4 ranks × 10 samples per 100 ms step = 400 samples/s.
    assert summarize(f).throughput == 400.0


def test_a_small_excess_behind_a_far_slower_rank_waits_until_that_rank_is_fixed():
    # Rank 5 is 6 % slower than its peers (3 ms); rank 2 is 100 ms slower.  The
    # job waits for rank 2: rank 5 costs nothing yet and is not confirmed on it.
    # Once rank 2 is healthy again, rank 5's excess is what holds the job back.
    from artemisd.pipeline import Analyzer
    from tests.unit.windows import lockstep, run

    healthy = [50.0] * 8
    both = [150.0 if r == 2 else 53.0 if r == 5 else 50.0 for r in range(8)]
    only_5 = [53.0 if r == 5 else 50.0 for r in range(8)]
    windows = [lockstep(s, healthy) for s in range(8)] + [lockstep(s, both) for s in range(8, 14)]
    analyzer = Analyzer()
    run(analyzer, windows)
    assert [i.rank for i in analyzer.incidents if i.confirmed_window is not None] == [2]
    analyzer = Analyzer()
    run(analyzer, windows + [lockstep(s, only_5) for s in range(14, 20)])
    confirmed = {i.rank: i for i in analyzer.incidents if i.confirmed_window is not None}
    assert sorted(confirmed) == [2, 5] and confirmed[5].onset_window >= 14, analyzer.incidents


def test_a_rank_that_strays_from_its_peers_in_healthy_windows_needs_more_than_a_small_excursion():
    # An island of three: the other two agree to 0.2 ms, so the window's MAD is tiny and a
    # 5 % excursion looks like 10 sigma.  This rank's ratio to its peers wandered ±5 % in
    # its healthy windows (a loaded host): 5 % is its noise, 30 % is not.
    def with_peer_spread(value):
        from dataclasses import replace

        # Its busy wanders at least as much as its ratio does (the load moves both).
        return replace(baseline_for(3, usual=[1.0] * 3, busy=[100] * 3, spread=value), peer_spread=np.full(3, value))

    f = frame([100.0, 105.5, 100.2])
    assert list(detect_ranks(f, SETTINGS, baseline_for(3, usual=[1.0] * 3, busy=[100] * 3)).rows) == [1]
    assert detect_ranks(f, SETTINGS, with_peer_spread(0.05)).rows.size == 0
    assert list(detect_ranks(frame([100.0, 130.0, 100.2]), SETTINGS, with_peer_spread(0.05)).rows) == [1]


def test_peer_spread_is_the_rank_s_own_ratio_noise():
    from artemisd.baseline import RankHistory

    history = RankHistory(depth=20)
    rng = np.random.default_rng(1)
    ranks = np.arange(3)
    for _ in range(12):
        ratios = np.array([1.0, 1.0 + rng.uniform(-0.05, 0.05), 1.0])
        history.record(ranks, 100 * ratios, ratios, np.ones(3, dtype=bool))
    spread = history.baseline().peer_spread
    assert spread[0] == 0.0 and spread[2] == 0.0 and 0.01 < spread[1] < 0.06


def test_no_rank_is_assumed_quieter_than_its_island():
    # Three windows gave rank 0 a spread of 1.8 % by chance; its peers' are 10-30 %.
    f = frame([100, 100, 100, 100, 100, 100, 100, 100])
    spread = np.array([0.018, 0.10, 0.20, 0.30, 0.12, 0.15, 0.11, np.nan])
    typical = island_typical(f, spread)
    assert typical[0] == np.median(spread[:7]) and typical[3] == 0.30 and np.isnan(typical[7])
    # Two islands pool separately.
    g = frame([100, 100, 100, 100, 130, 131, 129, 130], island=["nvidia"] * 4 + ["amd"] * 4)
    two = island_typical(g, np.array([0.01, 0.02, 0.03, 0.04, 0.2, 0.2, 0.2, 0.2]))
    assert list(two[:4]) == [0.025, 0.025, 0.03, 0.04] and list(two[4:]) == [0.2] * 4


def test_a_quiet_history_does_not_make_an_ordinary_excursion_an_outlier():
    # 14 % above its own past: ten sigma for a rank whose three healthy windows
    # varied 1.4 %, under one sigma for the island's typical 20 %.
    busy = [114, 100, 100, 100, 100, 100, 100, 100]
    base = baseline_for(8, usual=[1.0] * 8, busy=[100] * 8, spread=0.2)
    base = RankBaseline(base.usual_ratio, base.busy, np.array([0.014] + [0.2] * 7), peer_spread=np.full(8, 0.2))
    assert detect_ranks(frame(busy), SETTINGS, base).rows.size == 0


def test_a_rank_slow_only_against_its_past_is_not_flagged_while_a_healthy_peer_outlasts_it():
    # Rank 0's healthy windows fell in a light phase (baseline 80): 100 now
    # reads 25 % slow against its own past, but ranks 2 and 5 (unflagged) are
    # slower still; the job waits for them, not for rank 0.
    busy = [100, 90, 104, 95, 99, 105, 92, 97]  # a noisy island: no rank stands out from its peers
    own = [80, 90, 104, 95, 99, 105, 92, 97]
    base = baseline_for(8, usual=[1.0] * 8, busy=own)
    assert detect_ranks(frame(busy), SETTINGS, base).rows.size == 0
    # The same excess with rank 0 the slowest of its island: flagged by its history.
    busy[0] = 106
    assert list(detect_ranks(frame(busy), SETTINGS, base).rows) == [0]
