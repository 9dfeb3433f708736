"""Confirm: persistence under matched conditions, and the matched probe's verdicts."""

from artemisd.confirm import Persistence, ProbeVerdict, Verdict, judge_probe
from artemisd.wire import P2PTiming, ProbeResult


def test_needs_consecutive_or_nearly_consecutive_flags():
    p = Persistence(confirm_windows=2)
    assert p.observe("r2", 5, "c")[0] is Verdict.PENDING
    assert p.observe("r2", 6, "c")[0] is Verdict.CONFIRMED


def test_one_off_spike_is_dismissed():
    p = Persistence(confirm_windows=2)
    p.observe("r2", 5, "c")
    assert p.close_window(6) == []
    assert p.close_window(7) == ["r2"]


def test_intermittent_fault_flagged_most_windows_confirms():
    p = Persistence(confirm_windows=3)
    p.observe("r2", 1, "c")
    p.observe("r2", 2, "c")
    p.close_window(3)  # not flagged in window 3
    assert p.observe("r2", 4, "c")[0] is Verdict.CONFIRMED  # 3 of the last 4


def test_recurring_fault_confirms_over_the_longer_horizon():
    p = Persistence(confirm_windows=2)
    p.observe("r2", 1, "c")
    assert p.close_window(1) == [] and p.close_window(2) == []
    assert p.close_window(3) == ["r2"]  # a lone flag: dismissed ...
    assert p.observe("r2", 4, "c")[0] is Verdict.PENDING  # ... but remembered
    for seq in (4, 5, 6):
        assert p.close_window(seq) == []  # two flags in the horizon: keep watching
    assert p.observe("r2", 7, "c")[0] is Verdict.CONFIRMED  # 3 flags within 8 windows


def test_flags_age_out_of_the_horizon():
    p = Persistence(confirm_windows=2)
    p.observe("r2", 1, "c")
    p.observe("r2", 4, "c")
    dismissed = [seq for seq in range(4, 14) if p.close_window(seq) == ["r2"]]
    # Once the first flag ages out, the second is a lone spike: dismissed.
    assert dismissed == [9]


def test_changed_conditions_restart_the_count():
    p = Persistence(confirm_windows=2)
    p.observe("r2", 1, ("world", 8))
    verdict, streak = p.observe("r2", 2, ("world", 16))
    assert verdict is Verdict.PENDING and streak.first_seq == 2


def probe(pid, gemm, hops=()):
    return ProbeResult(id=pid, gemm_ms=gemm, p2p=tuple(P2PTiming(peer=p, ms=ms) for p, ms in hops))


NODES = {0: "n0", 1: "n1", 2: "n2", 3: "n3"}


def test_slow_identical_gemm_means_the_device():
    results = {0: probe("P", 10.0), 1: probe("P", 10.1), 2: probe("P", 13.0), 3: probe("P", 9.9)}
    judgement = judge_probe(results, {2}, NODES, 0.04)
    assert judgement.verdict is ProbeVerdict.DEVICE
    assert judgement.evidence[0].signal == "probe.gemm_ms"


def test_slow_transfers_touching_one_node_mean_its_link():
    # Ring 0→1→2→3→0: the hops into and out of n2 are slow.
    results = {0: probe("P", 10, [(1, 5.0)]), 1: probe("P", 10, [(2, 20.0)]),
               2: probe("P", 10, [(3, 21.0)]), 3: probe("P", 10, [(0, 5.1)])}
    judgement = judge_probe(results, {2}, NODES, 0.04)
    assert judgement.verdict is ProbeVerdict.LINK and judgement.node == "n2"


def test_normal_on_identical_work_points_at_host_or_input():
    results = {r: probe("P", 10.0, [((r + 1) % 4, 5.0)]) for r in range(4)}
    assert judge_probe(results, {2}, NODES, 0.04).verdict is ProbeVerdict.NORMAL


def test_missing_results_are_incomplete_not_a_verdict():
    assert judge_probe({2: probe("P", 10)}, {2}, NODES, 0.04).verdict is ProbeVerdict.INCOMPLETE


def test_job_wide_slowdown_probe_judges_the_links_alone():
    results = {0: probe("P", 10, [(1, 5.0)]), 1: probe("P", 10, [(2, 20.0)]),
               2: probe("P", 10, [(3, 21.0)]), 3: probe("P", 10, [(0, 5.1)])}
    judgement = judge_probe(results, set(), NODES, 0.04)
    assert judgement.verdict is ProbeVerdict.LINK and judgement.node == "n2"


def test_link_on_a_three_node_ring():
    # Pairs (0,1) n0-n1, (1,2) n1-n2, (2,0) n2-n0: n1's link is slow.
    results = {0: probe("P", 10, [(1, 200.0)]), 1: probe("P", 10, [(2, 210.0)]), 2: probe("P", 10, [(0, 1.0)])}
    judgement = judge_probe(results, set(), {0: "n0", 1: "n1", 2: "n2"}, 0.5)
    assert judgement.verdict is ProbeVerdict.LINK and judgement.node == "n1"


def test_one_slow_pair_on_a_loaded_host_names_no_link():
    # Three nodes, pairs n0-n1, n1-n2, n2-n0.  Only the n0-n1 round trip is slow (an end
    # was preempted): n0 and n1 each have a normal pair too, so neither link is bad.
    three = {0: "n0", 1: "n1", 2: "n2"}
    results = {0: probe("P", 10, [(1, 12.5)]), 1: probe("P", 10, [(2, 5.0)]), 2: probe("P", 10, [(0, 5.2)])}
    judgement = judge_probe(results, set(), three, 0.04)
    assert judgement.verdict is not ProbeVerdict.LINK, judgement
    # Both pairs of n1 slow, the third not: that is n1's link.
    results = {0: probe("P", 10, [(1, 12.5)]), 1: probe("P", 10, [(2, 11.0)]), 2: probe("P", 10, [(0, 5.2)])}
    judgement = judge_probe(results, set(), three, 0.04)
    assert judgement.verdict is ProbeVerdict.LINK and judgement.node == "n1"


def test_short_windows_confirm_only_after_confirm_seconds_of_wall_time():
    # 0.1 s windows (8 steps of ~12 ms): OS scheduling alone can flag one
    # rank for a few of them; two windows are not two seconds.
    p = Persistence(confirm_windows=2, confirm_seconds=2.0)
    verdicts = [p.observe("r2", seq, "c", seconds=0.1)[0] for seq in range(25)]
    assert verdicts.index(Verdict.CONFIRMED) == 19  # the 20th flagged window makes 2.0 s
    # Windows of a second or more: the window count decides, as before.
    q = Persistence(confirm_windows=2, confirm_seconds=2.0)
    assert [q.observe("r2", seq, "c", seconds=1.5)[0] for seq in (5, 6)] == [Verdict.PENDING, Verdict.CONFIRMED]


def test_a_new_run_of_flags_starts_its_wall_time_again():
    p = Persistence(confirm_windows=2, confirm_seconds=2.0)
    for seq in range(5):
        p.observe("r2", seq, "c", seconds=0.3)  # 1.5 s flagged ...
    p.close_window(5), p.close_window(6), p.close_window(7)  # ... then quiet
    verdict, streak = p.observe("r2", 8, "c", seconds=0.3)
    assert verdict is Verdict.PENDING and streak.run_start == 8 and streak.run_seconds == 0.3


def test_intermittent_flags_need_the_wall_time_too():
    p = Persistence(confirm_windows=2, confirm_seconds=2.0)
    for seq in (1, 3, 5, 7):
        verdict, _ = p.observe("r2", seq, "c", steady=False, seconds=0.2)
    assert verdict is Verdict.PENDING  # four flags in the horizon, 0.8 s of them
    p2 = Persistence(confirm_windows=2, confirm_seconds=2.0)
    for seq in (1, 3, 5):
        verdict, streak = p2.observe("r2", seq, "c", steady=False, seconds=1.0)
    assert verdict is Verdict.CONFIRMED and streak.intermittent


def test_a_preempted_rank_slows_its_pairs_but_names_no_link():
    # The noisy-neighbour test's probes (3 ranks on n1-n3, two busy loops on the
    # same cores): both pairs touching n1 ~3x slower, and n1's rank spent most
    # of each round trip waiting for a core.  That is its host, not its link.
    three = {0: "n1", 1: "n2", 2: "n3"}
    preempted = {0: ProbeResult(id="P", gemm_ms=10, served_wait_ms=2.9,
                                p2p=(P2PTiming(peer=1, ms=4.79, wait_ms=3.1),)),
                 1: ProbeResult(id="P", gemm_ms=10, served_wait_ms=0.1,
                                p2p=(P2PTiming(peer=2, ms=1.63, wait_ms=0.1),)),
                 2: ProbeResult(id="P", gemm_ms=10, served_wait_ms=0.2,
                                p2p=(P2PTiming(peer=0, ms=4.57, wait_ms=0.3),))}
    judgement = judge_probe(preempted, set(), three, 0.1)
    assert judgement.verdict is ProbeVerdict.NORMAL, judgement
    assert "run-queue wait" in judgement.evidence[-1].note and "n1" in judgement.evidence[-1].note
    # The same timings with hosts that ran the ranks at once: n1's link.
    prompt = {rank: r.model_copy(update={"served_wait_ms": 0.0, "p2p": tuple(
        hop.model_copy(update={"wait_ms": 0.05}) for hop in r.p2p)}) for rank, r in preempted.items()}
    judgement = judge_probe(prompt, set(), three, 0.1)
    assert judgement.verdict is ProbeVerdict.LINK and judgement.node == "n1"
    # About a rank on n2, the preempted n1 is not evidence either way.
    judgement = judge_probe(preempted, {1}, three, 0.1)
    assert not any(e.signal == "probe.p2p_ms" for e in judgement.evidence), judgement


def test_waits_every_pair_shares_do_not_explain_a_slow_link_away():
    # Recorded by benchmarks/links.py (5 nodes on this 2-core box, n3's link degraded): the two
    # pairs touching n3 are 3x slower and waited for a core about the share of their time that
    # every pair waited (a transfer a slow link stretches wakes its ends more often).  Taking
    # their whole wait off, as before, left nothing against the link.
    five = {r: f"n{r + 1}" for r in range(5)}
    pairs = [(1.4815, 1.61), (4.7869, 4.45), (4.6524, 4.78), (1.9303, 3.3), (1.3127, 1.02)]  # n1-n2 ... n5-n1
    results = {r: ProbeResult(id="P", gemm_ms=10, served_wait_ms=0.0,
                              p2p=(P2PTiming(peer=(r + 1) % 5, ms=ms, wait_ms=wait),))
               for r, (ms, wait) in enumerate(pairs)}
    judgement = judge_probe(results, set(), five, 0.04)
    assert judgement.verdict is ProbeVerdict.LINK and judgement.node == "n3", judgement
