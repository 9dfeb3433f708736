"""Islands of two (issue 10): a 2-rank job, or two ranks of one make in a mixed job.

With one peer there is no median to compare with; a rank of a pair is judged
against its own healthy history and the wait it causes the other rank
(artemisd/detect.py, rule 3).  Frames and windows are built from numbers here.
"""

import numpy as np
import pytest

from artemisd.baseline import RankBaseline, RankHistory
from artemisd.config import AnalysisSettings
from artemisd.detect import detect_ranks
from artemisd.frame import WindowFrame
from artemisd.pipeline import Analyzer
from tests.unit.windows import lockstep, run, stepwise

SETTINGS = AnalysisSettings()


def frame(busy, **kw) -> WindowFrame:
    return WindowFrame.from_reports(lockstep(0, busy, **kw))


def history(usual, busy, wait, ratio_spread=0.01) -> RankBaseline:
    world = len(busy)
    return RankBaseline(usual_ratio=np.array(usual, dtype=float), busy=np.array(busy, dtype=float),
                        spread=np.full(world, 0.01), ratio_spread=np.full(world, ratio_spread),
                        comm_wait=np.array(wait, dtype=float))


HEALTHY_PAIR = history([1.0, 1.0], [100, 100], [20, 20])


def test_slow_rank_of_a_pair_is_flagged_and_the_waiting_rank_is_not():
    f = frame([100, 125])  # step 145: rank 0 now waits 45 ms, it used to wait 20
    flags = detect_ranks(f, SETTINGS, HEALTHY_PAIR)
    assert list(flags.rows) == [1]
    # The contract's peers of a rank of a pair: the other rank.
    assert flags.island_median[1] == 100 and flags.ratio[1] == 1.25
    assert flags.ratio[0] == pytest.approx(0.8)
    g = frame([125, 100])
    assert list(detect_ranks(g, SETTINGS, HEALTHY_PAIR).rows) == [0]


def test_load_that_slows_both_ranks_is_not_a_straggler():
    assert detect_ranks(frame([125, 127]), SETTINGS, HEALTHY_PAIR).rows.size == 0


def test_a_busy_rise_the_other_rank_does_not_wait_for_is_not_flagged():
    f = frame([100, 125])
    f.comm_wait[0] = 21.0  # the other rank's measured wait did not rise
    assert detect_ranks(f, SETTINGS, HEALTHY_PAIR).rows.size == 0


def test_the_other_rank_getting_faster_does_not_blame_this_one():
    # Rank 0's busy fell from 100 to 80; rank 1 is as it always was.
    assert detect_ranks(frame([80, 100]), SETTINGS, HEALTHY_PAIR).rows.size == 0


def test_the_pair_own_noise_sets_the_bar():
    f = frame([100, 125])
    assert detect_ranks(f, SETTINGS, history([1, 1], [100, 100], [20, 20], ratio_spread=0.08)).rows.size == 0
    assert list(detect_ranks(f, SETTINGS, history([1, 1], [100, 100], [20, 20], ratio_spread=0.05)).rows) == [1]


def test_a_rank_that_was_always_slower_is_judged_against_itself():
    # Rank 1 has always been 10 % slower: rank 0 always waited 30 ms.
    usual = history([1 / 1.1, 1.1], [100, 110], [30, 20])
    assert detect_ranks(frame([100, 112]), SETTINGS, usual).rows.size == 0
    assert list(detect_ranks(frame([100, 140]), SETTINGS, usual).rows) == [1]


def test_a_pair_is_not_judged_without_history_or_without_comm_wait():
    f = frame([100, 125])
    assert detect_ranks(f, SETTINGS).rows.size == 0
    young = RankBaseline(np.ones(2), np.full(2, 100.0), np.full(2, 0.01))  # no pair history yet
    assert detect_ranks(f, SETTINGS, young).rows.size == 0
    f.comm_wait[:] = np.nan  # not measured: nothing to corroborate with
    assert detect_ranks(f, SETTINGS, HEALTHY_PAIR).rows.size == 0


def test_island_of_two_in_a_mixed_job():
    island = ["nvidia"] * 6 + ["amd"] * 2
    usual = history([1.0] * 8, [90] * 6 + [100, 100], [30] * 6 + [20, 20])
    f = frame([90] * 6 + [100, 125], island=island)
    assert list(detect_ranks(f, SETTINGS, usual).rows) == [7]
    # The NVIDIA island is the slower one now: the AMD rank's slowdown costs the
    # job little today, but its GPU is as broken, and it is still named.
    slower = history([1.0] * 8, [130] * 6 + [100, 100], [20] * 6 + [50, 50])
    g = frame([130] * 6 + [100, 125], island=island)
    assert list(detect_ranks(g, SETTINGS, slower).rows) == [7]


def noisy_job(windows, rng, *, world=2, slow=None, factor=1.3, onset=12, end=None, load_levels=False,
              island=None, gpu=None):
    """Windows of a job on a loaded machine: every step swings ±25 % for all
    ranks together and ±8 % per rank, and with ``load_levels`` each window's
    load level moves the whole job by up to ±20 % more."""
    out = []
    for seq in range(windows):
        level = rng.uniform(0.8, 1.2) if load_levels else 1.0
        common = rng.uniform(-0.25, 0.25, size=(50, 1))
        busy = 100.0 * level * (1 + common) * (1 + rng.uniform(-0.08, 0.08, size=(50, world)))
        hit = slow is not None and seq >= onset and (end is None or seq < end)
        if hit:
            busy[:, slow] *= factor
        out.append(stepwise(seq, busy, comm_ms=20.0, nodes=[f"n{r}" for r in range(world)], island=island,
                            gpu=gpu if hit else None))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_healthy_two_rank_job_on_a_noisy_machine_raises_nothing(seed):
    analyzer = Analyzer()
    run(analyzer, noisy_job(40, np.random.default_rng(seed)))
    # Not even a suspect for a rank; a job-wide suspect may open on a window
    # the whole job was slow in, and must be dismissed.
    assert [i for i in analyzer.incidents if i.rank is not None] == []
    assert all(i.state.value == "dismissed" for i in analyzer.incidents), analyzer.incidents


@pytest.mark.parametrize("seed", range(4))
def test_load_shifting_between_windows_never_makes_a_rank_incident(seed):
    analyzer = Analyzer()
    run(analyzer, noisy_job(40, np.random.default_rng(100 + seed), load_levels=True))
    assert [i for i in analyzer.incidents if i.rank is not None] == []


THROTTLED = {1: {"sm_clock_mhz": 1500, "throttle": ["sw_thermal"], "temp_c": 92}}


@pytest.mark.parametrize("seed", range(4))
def test_slowed_rank_of_a_two_rank_job_is_one_rank_incident_with_contract_measures(seed):
    analyzer = Analyzer()
    windows = noisy_job(30, np.random.default_rng(seed), slow=1, gpu=THROTTLED)
    run(analyzer, windows)
    reported = [i for i in analyzer.incidents if i.confirmed_window is not None]
    assert [(i.kind.value, i.rank) for i in reported] == [("rank", 1)], analyzer.incidents
    inc = reported[0]
    assert 12 <= inc.onset_window and inc.confirmed_window <= 14
    assert inc.cause.value == "gpu.thermal"
    assert inc.ratio == pytest.approx(1.3, abs=0.05)  # busy / the other rank's busy
    # excess = how long the other rank waits for it per step; loss = its share of the step.
    confirming = [WindowFrame.from_reports(w) for w in windows[inc.onset_window:inc.confirmed_window + 1]]
    excess = np.mean([f.busy[1] - f.busy[0] for f in confirming])
    step = np.mean([np.median(f.step) for f in confirming])
    assert inc.excess_ms == pytest.approx(excess, rel=0.02)
    assert inc.loss_pct == pytest.approx(100 * excess / step, rel=0.03)
    signals = {e.signal: e for e in inc.evidence}
    assert "rank 0" in signals["ms.comm_wait"].note
    assert signals["ms.comm_wait"].value > signals["ms.comm_wait"].peers


def test_slow_for_longer_than_the_history_stays_one_incident_and_the_waiting_rank_is_learnt_again():
    # Rank 1 slow for 30 windows (the history keeps 20), then healthy; later
    # rank 0 slows.  Rank 0's ratio and wait while it waited for rank 1 must
    # not have become its baseline.
    rng = np.random.default_rng(7)
    windows = noisy_job(44, rng, slow=1, onset=8, end=38)
    late = noisy_job(70, np.random.default_rng(8), slow=0, onset=55)[44:]
    analyzer = Analyzer()
    run(analyzer, windows + late)
    reported = [(i.kind.value, i.rank) for i in analyzer.incidents if i.confirmed_window is not None]
    assert reported == [("rank", 1), ("rank", 0)], analyzer.incidents


def test_island_of_two_inside_a_larger_mixed_job_names_its_slow_rank():
    island = ["nvidia"] * 6 + ["amd"] * 2
    analyzer = Analyzer()
    run(analyzer, noisy_job(30, np.random.default_rng(3), world=8, slow=6, island=island))
    reported = [(i.kind.value, i.rank, i.island) for i in analyzer.incidents if i.confirmed_window is not None]
    assert reported == [("rank", 6, "amd")], analyzer.incidents


def test_history_keeps_a_rank_healthy_past_however_long_it_is_unhealthy():
    h = RankHistory(depth=6, min_windows=3, refresh=1)
    ranks = np.array([0, 1])
    for _ in range(5):
        h.record(ranks, np.array([100.0, 100.0]), np.array([1.0, 1.0]), np.array([True, True]),
                 comm_wait=np.array([20.0, 20.0]))
    for _ in range(15):  # rank 1 slow for longer than the depth; rank 0 waits for it
        h.record(ranks, np.array([100.0, 130.0]), np.array([0.77, 1.3]), np.array([True, False]),
                 comm_wait=np.array([50.0, 20.0]), reference_healthy=np.array([False, True]))
    b = h.baseline()
    assert list(b.busy) == [100.0, 100.0] and list(b.usual_ratio) == [1.0, 1.0]
    assert list(b.comm_wait) == [20.0, 20.0]  # rank 0's long waits were not learnt


def test_pair_history_follows_ranks_that_report_late():
    h = RankHistory(depth=8, min_windows=3, refresh=1)
    for _ in range(5):  # rank 1's reports have not arrived yet
        h.record(np.array([0]), np.array([100.0]), np.array([1.0]), np.array([True]), comm_wait=np.array([20.0]))
    for _ in range(5):
        h.record(np.array([0, 1]), np.array([100.0, 90.0]), np.array([1.1, 0.9]), np.array([True, True]),
                 comm_wait=np.array([20.0, 30.0]))
    b = h.baseline().at(np.array([0, 1]))
    assert list(b.comm_wait) == [20.0, 30.0] and list(b.busy) == [100.0, 90.0]
    assert b.ratio_spread is not None and np.isfinite(b.ratio_spread).all()


def test_a_young_pair_whose_job_was_briefly_slow_still_names_its_slowed_rank():
    # Six healthy windows, as in the probe's 2-rank stack test, of which the
    # 4th and 5th ran 30 % slower on both ranks (the machine was busy): the
    # job-wide check flags them, yet they are healthy windows of the pair.
    # Rank 1 then sleeps 100 ms before every step.
    rng = np.random.default_rng(3)
    windows = []
    for seq in range(10):
        busy = 10.0 * (1 + rng.uniform(-0.05, 0.05, size=(8, 2)))
        if seq in (3, 4):
            busy *= 1.3
        if seq >= 6:
            busy[:, 1] += 100.0
        windows.append(stepwise(seq, busy, comm_ms=2.0, nodes=["n0", "n1"]))
    analyzer = Analyzer()
    run(analyzer, windows)
    named = [(i.kind.value, i.rank) for i in analyzer.incidents
             if i.confirmed_window is not None and i.kind.value != "job"]
    assert named == [("rank", 1)], analyzer.incidents
