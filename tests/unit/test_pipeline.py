"""The Analyzer end to end on hand-built lockstep windows, one scenario per cause."""

import math
import random

import pytest

from artemisd.baseline import PAIR_MIN_WINDOWS
from artemisd.config import AnalysisSettings
from artemisd.incident import Cause, IncidentKind, IncidentState
from artemisd.pipeline import Analyzer
from artemisd.wire import NodeEvent, ProbeResult, parse_record
from tests.unit.windows import lockstep, run


def noisy(rng, n=8, spread=0.005, base=100.0):
    return [base * (1 + rng.gauss(0, spread)) for _ in range(n)]


def analyze(windows, **kw):
    analyzer = Analyzer(**kw)
    updates = run(analyzer, windows)
    confirmed = [i for i in analyzer.incidents if i.state is IncidentState.CONFIRMED]
    return analyzer, confirmed, updates


def scenario(fault, windows=14, onset=6, seed=3, **kw):
    rng = random.Random(seed)
    out = []
    for seq in range(windows):
        busy = noisy(rng)
        extra = fault(seq, busy) if seq >= onset else {}
        out.append(lockstep(seq, busy, **{**kw, **(extra or {})}))
    return out


def test_gpu_clock_straggler_is_one_rank_incident_with_contract_measures():
    def fault(seq, busy):
        busy[2] *= 1.19
        return {"gpu": {2: {"sm_clock_mhz": 1410}}}

    _, [incident], _ = analyze(scenario(fault))
    assert (incident.kind, incident.rank, incident.node) == (IncidentKind.RANK, 2, "n1")
    assert incident.cause is Cause.GPU_CLOCKS
    assert incident.onset_window == 6 and incident.confirmed_window == 7
    assert incident.ratio == pytest.approx(1.19, abs=0.02)
    step = 100 * 1.19 + 20
    assert incident.excess_ms == pytest.approx(19, abs=2)
    assert incident.loss_pct == pytest.approx(100 * incident.excess_ms / step, abs=0.5)
    assert incident.evidence[1].signal == "sm_clock_mhz" and incident.evidence[1].peers == 1980
    assert incident.action.kind == "correct" and incident.action.status == "proposed"
    assert incident.result is None


@pytest.mark.parametrize(
    ("gpu", "cause"),
    [({"throttle": ["sw_thermal"], "temp_c": 92, "sm_clock_mhz": 1500}, Cause.GPU_THERMAL),
     ({"throttle": ["sw_power_cap"], "power_w": 450}, Cause.GPU_POWER),
     ({"power_limit_w": 450}, Cause.GPU_POWER),
     ({"throttle": ["applications_clocks"], "sm_clock_mhz": 1600}, Cause.GPU_CLOCKS)],
)
def test_gpu_causes(gpu, cause):
    def fault(seq, busy):
        busy[5] *= 1.25
        return {"gpu": {5: gpu}}

    _, [incident], _ = analyze(scenario(fault))
    assert incident.rank == 5 and incident.cause is cause


def test_two_slow_ranks_on_one_node_are_one_node_incident():
    def fault(seq, busy):
        busy[4] *= 1.15
        busy[5] *= 1.15
        return {"host": {4: {"ctx_invol_per_s": 400.0}, 5: {"ctx_invol_per_s": 400.0}}}

    _, [incident], _ = analyze(scenario(fault))
    assert (incident.kind, incident.node, incident.rank) == (IncidentKind.NODE, "n2", None)
    assert incident.cause is Cause.HOST_CPU


def test_rank_incident_grows_into_node_incident_instead_of_a_second_one():
    def fault(seq, busy):
        busy[4] *= 1.2
        if seq >= 9:
            busy[5] *= 1.2

    analyzer, confirmed, _ = analyze(scenario(fault))
    assert len(confirmed) == 1 and confirmed[0].kind is IncidentKind.NODE and confirmed[0].node == "n2"


def test_data_loader_stall():
    def fault(seq, busy):
        busy[3] += 20
        return {"data": [1.0, 1.0, 1.0, 21.0, 1.0, 1.0, 1.0, 1.0]}

    _, [incident], _ = analyze(scenario(fault))
    assert incident.rank == 3 and incident.cause is Cause.INPUT_LOADER
    assert incident.action.kind == "rebalance"


def test_storage_stall_needs_iowait():
    def fault(seq, busy):
        busy[3] += 20
        return {"data": [1.0] * 3 + [21.0] + [1.0] * 4, "host": {3: {"iowait_pct": 35.0}}}

    _, [incident], _ = analyze(scenario(fault))
    assert incident.cause is Cause.INPUT_STORAGE


def test_retransmits_alone_do_not_name_a_link():
    # Retransmits are counted by the senders to a slow link: n3's counter standing
    # out does not say that n3's link is the bad one.
    def fault(seq, busy):
        return {"comm_ms": 40.0, "host": {6: {"net_retransmits_per_s": 80.0}, 7: {"net_retransmits_per_s": 80.0}}}

    _, [incident], _ = analyze(scenario(fault, windows=20))  # 14 windows of 7 s: past JobConfirmSeconds
    assert (incident.kind, incident.node, incident.link) == (IncidentKind.JOB, None, None)
    assert incident.cause is Cause.UNKNOWN
    [retrans] = [e for e in incident.evidence if e.signal == "net_retransmits_per_s"]
    assert retrans.value == 80.0 and "does not say whose link" in retrans.note
    assert incident.ratio == pytest.approx(140 / 120, abs=0.02)  # step time vs the job's baseline


def test_comm_slowdown_without_link_evidence_says_unknown_and_what_is_missing():
    _, [incident], _ = analyze(scenario(lambda seq, busy: {"comm_ms": 40.0}, windows=20))
    assert incident.kind is IncidentKind.JOB and incident.cause is Cause.UNKNOWN
    missing = [e for e in incident.evidence if e.signal == "missing"]
    assert missing and "matched probes" in missing[0].value


def test_one_island_collectives_slowing_is_an_island_incident():
    rng = random.Random(4)
    islands = ["nvidia"] * 4 + ["amd"] * 4
    windows = []
    for seq in range(14):
        reports = lockstep(seq, noisy(rng), island=islands, comm_ms=40.0 if seq >= 6 else 20.0)
        fixed = []
        for r in reports:
            raw = r.model_dump(exclude_none=True)
            # Hierarchical all-reduce: within the island first, then across islands.
            group_ms = (30.0 if seq >= 6 and r.island == "amd" else 10.0) * 50
            raw["collectives"] = list(raw["collectives"]) + [
                {"op": "all_reduce", "group": r.island, "calls": 50, "ms": group_ms}]
            fixed.append(parse_record(raw))
        windows.append(fixed)
    _, [incident], _ = analyze(windows)
    assert (incident.kind, incident.island, incident.cause) == (IncidentKind.ISLAND, "amd", Cause.COMM_ISLAND)


def test_a_job_wide_slowdown_that_a_signal_explains_confirms_at_once_one_nothing_explains_must_last():
    """Judged against the job's own past, not its peers in the same window, a job-wide rise is what
    the neighbours' load makes too (held-out stacks beside a busy neighbour confirmed a job-wide
    ``unknown`` in every control): nothing explaining it, it must last ``JobConfirmSeconds``;
    every rank's input waits rising explain it, and ``ConfirmSeconds`` suffices as for a rank."""
    def stalled(seq, busy):
        return {"data": [30.0] * 8} if seq >= 6 else None  # ms of each rank's busy spent waiting for data

    def busier(seq, busy):
        busy[:] = [b * 1.3 for b in busy]

    _, [loader], _ = analyze(scenario(lambda seq, busy: (busier(seq, busy), stalled(seq, busy))[1], windows=20))
    assert loader.cause is Cause.INPUT_LOADER and loader.confirmed_window == 7
    _, [unknown], _ = analyze(scenario(busier, windows=20))
    lasting = math.ceil(AnalysisSettings().job_confirm_seconds / (50 * 0.15))  # 50 steps of ~150 ms
    assert unknown.cause is Cause.UNKNOWN and unknown.confirmed_window == 6 + lasting - 1


def test_straggler_does_not_also_raise_a_job_incident():
    def fault(seq, busy):
        busy[1] *= 1.4

    _, confirmed, _ = analyze(scenario(fault, windows=20, onset=8))
    assert [i.kind for i in confirmed] == [IncidentKind.RANK]


def test_healthy_noise_spikes_and_a_slightly_slower_gpu_raise_no_incident():
    rng = random.Random(5)
    windows = []
    for seq in range(60):
        busy = noisy(rng, spread=0.01)
        busy[1] *= 1.03  # a healthy GPU that is always 3 % slower
        if seq in (10, 30, 31 + 10):
            busy[rng.randrange(8)] *= 1.4  # GC pause / transient spike, one window
        windows.append(lockstep(seq, busy))
    analyzer, confirmed, _ = analyze(windows)
    assert confirmed == []
    assert all(i.state is IncidentState.DISMISSED for i in analyzer.incidents)


def away_from_training(seq, ms, steps=4, **kw):
    """A window every rank spends outside training (evaluation, a checkpoint, a long data wait): a few
    long steps, each rank on its own work, no collective made."""
    reports = lockstep(seq, [ms] * 8, comm_ms=0.0, steps=steps, **kw)
    return [parse_record({**r.model_dump(mode="json", exclude_none=True), "collectives": []}) for r in reports]


@pytest.mark.parametrize("noise_at", [10, 15], ids=["noisy window before", "noisy window after"])
@pytest.mark.parametrize("stretch", [3, 5])
def test_a_stretch_away_from_training_and_one_noisy_window_confirm_no_job_incident(stretch, noise_at):
    """Issue 28: every rank evaluating at once for a few windows (no collectives, step time up fourfold)
    plus one ordinary noisy window confirmed a false job-wide incident.  The stretch is no training: it
    neither counts as flagged nor teaches the job's baseline, and the one noisy window alone confirms
    nothing."""
    rng = random.Random(8)
    windows = []
    for seq in range(24):
        if 11 <= seq < 11 + stretch:
            windows.append(away_from_training(seq, 1500.0 * (1 + rng.gauss(0, 0.05))))
        elif seq == noise_at + (stretch if noise_at > 10 else 0):
            windows.append(lockstep(seq, [b * 1.15 for b in noisy(rng)]))  # a noisy window, job-wide
        else:
            windows.append(lockstep(seq, noisy(rng)))
    analyzer, confirmed, _ = analyze(windows)
    assert confirmed == []
    assert all(i.state is IncidentState.DISMISSED for i in analyzer.incidents)


def test_a_job_wide_slowdown_that_keeps_its_collectives_still_confirms_around_a_stretch_away():
    rng = random.Random(8)
    windows = [lockstep(seq, noisy(rng)) for seq in range(10)]
    windows += [away_from_training(seq, 1500.0) for seq in range(10, 13)]  # the job's usual evaluation
    windows += [lockstep(seq, [b * 1.2 for b in noisy(rng)]) for seq in range(13, 30)]  # every rank 20 % slower
    _, [incident], _ = analyze(windows)
    # Nothing explains the rise: confirmed once its windows (50 steps of ~140 ms) last JobConfirmSeconds.
    lasting = math.ceil(AnalysisSettings().job_confirm_seconds / (50 * 0.14))
    assert incident.kind is IncidentKind.JOB and incident.onset_window == 13
    assert incident.confirmed_window == 13 + lasting - 1
    assert incident.ratio == pytest.approx(140 / 120, abs=0.02)  # against the training windows, not the stretch


def test_change_regression_names_the_change():
    rng = random.Random(6)
    old = {"driver": "550.54.15", "comm_lib": "nccl 2.21.5"}
    new = {"driver": "555.42.02", "comm_lib": "nccl 2.21.5"}
    windows = [lockstep(seq, noisy(rng), job="200", env=old) for seq in range(10)]
    windows += [lockstep(seq, [b * 1.15 for b in noisy(rng)], job="201", env=new) for seq in range(10)]
    _, [incident], _ = analyze(windows)
    assert (incident.kind, incident.job, incident.cause) == (IncidentKind.CHANGE, "201", Cause.CHANGE_DRIVER)
    changed = [e for e in incident.evidence if e.signal == "env.driver"]
    assert changed[0].value == "555.42.02" and changed[0].peers == "550.54.15"


def test_same_software_running_slower_is_not_a_change():
    rng = random.Random(6)
    env = {"driver": "550.54.15", "comm_lib": "nccl 2.21.5"}
    windows = [lockstep(seq, noisy(rng), job="200", env=env) for seq in range(10)]
    windows += [lockstep(seq, [b * 1.15 for b in noisy(rng)], job="201", env=env) for seq in range(10)]
    _, confirmed, _ = analyze(windows)
    assert confirmed == []


def test_workload_references_stay_bounded_over_many_jobs_and_still_tell_a_change():
    """A daemon that has seen thousands of jobs of one workload keeps one reference per software
    fingerprint (the newest job's), and at most MAX_WORKLOADS workloads; what check() says is the same."""
    from artemisd import change
    from artemisd.baseline import JobHistory, JobSummary

    history = JobHistory(depth=10)
    for seq in range(5):
        history.record(JobSummary(seq, 100.0, 80.0, 20.0, 0.0, 100.0, float("nan")))
    old = {"driver": "550.54.15", "comm_lib": "nccl 2.21.5"}
    new = {"driver": "555.42.02", "comm_lib": "nccl 2.21.5"}
    references: change.References = {}
    for job in range(1000):
        change.remember(references, str(job), None, "llm-8x8", old, history)
    assert [r.job for r in references["llm-8x8"]] == ["999"]
    slower = JobSummary(0, 130.0, 110.0, 20.0, 0.0, 130.0, float("nan"))
    assert change.check(references, "new", "llm-8x8", lambda: old, slower, 5.0, 0.05) is None  # same software
    found = change.check(references, "new", "llm-8x8", lambda: new, slower, 5.0, 0.05)
    assert found is not None and found[0].job == "999" and found[1] == pytest.approx(1.3)
    for workload in range(change.MAX_WORKLOADS + 10):
        change.remember(references, f"w{workload}", None, ("other", workload), old, history)
    assert len(references) == change.MAX_WORKLOADS and "llm-8x8" not in references  # the oldest went


def test_change_seen_through_node_events():
    rng = random.Random(7)
    windows = [lockstep(seq, noisy(rng), job="300", env={"comm_lib": "nccl 2.21.5"}) for seq in range(10)]
    analyzer = Analyzer()
    for node in ("n0", "n1", "n2", "n3"):
        analyzer.ingest(NodeEvent(type="node", v=1, event="job_start", job="300", node=node, time=1.0,
                                  fingerprint={"driver": "550.54.15"}))
    run(analyzer, windows)
    for node in ("n0", "n1", "n2", "n3"):
        analyzer.ingest(NodeEvent(type="node", v=1, event="job_start", job="301", node=node, time=2.0,
                                  fingerprint={"driver": "560.28.03"}))
    run(analyzer, [lockstep(seq, [b * 1.2 for b in noisy(rng)], job="301", env={"comm_lib": "nccl 2.21.5"})
                   for seq in range(10)])
    [incident] = [i for i in analyzer.incidents if i.state is IncidentState.CONFIRMED]
    assert incident.cause is Cause.CHANGE_DRIVER and incident.job == "301"


def test_suspect_window_never_enters_the_baseline():
    # Rank 2 is slow in one window only (dismissed); the job baseline must not move.
    analyzer = Analyzer()
    rng = random.Random(8)
    for seq in range(8):
        busy = noisy(rng)
        if seq == 5:
            busy = [b * 1.5 for b in busy]  # whole job slow in one window
        run(analyzer, [lockstep(seq, busy)])
    state = next(iter(analyzer._jobs.values()))
    assert all(s.step < 130 for s in state.history.healthy)


def test_late_reports_do_not_hold_analysis_back():
    # Rank 3 never reports window 0; it is analysed once window 2 arrives.
    analyzer = Analyzer()
    windows = [lockstep(seq, [100.0] * 4) for seq in range(3)]
    for report in windows[0][:3] + windows[1] + windows[2][:1]:
        analyzer.ingest(report)
    state = next(iter(analyzer._jobs.values()))
    assert state.closed_through == 1 and 0 not in state.buffers
    analyzer.ingest(windows[0][3])  # arrives after its window was analysed
    assert state.late_reports == 1


def test_a_probes_backlog_after_an_outage_is_not_read_as_lost_throughput():
    # The daemon was unreachable for 20 windows (a PostgreSQL restart, a failover): each
    # rank's probe kept its reports and sends them when it is answered again, one rank's
    # backlog seconds before the other's.  The windows analysed before the second rank's
    # reports came in hold one rank's samples: they are no measure of the job's throughput.
    import math

    from artemisd import loss, verify

    rng = random.Random(1)
    windows = [lockstep(seq, noisy(rng, n=2, spread=0.02)) for seq in range(40)]
    analyzer = Analyzer()
    for seq in range(12):
        run(analyzer, [windows[seq]])
    for rank in range(2):
        for seq in range(12, 32):
            analyzer.ingest(windows[seq][rank])
    run(analyzer, windows[32:])
    series = analyzer.throughput("100")
    healthy = loss.baseline(series, 12)
    measured = [t for _, t in series if math.isfinite(t)]
    assert len(measured) >= 20 and min(measured) > 0.9 * healthy, (healthy, measured)
    assert loss.baseline(series, None) == pytest.approx(healthy, rel=0.05)
    shape = verify.healthy_shape(analyzer.window_shapes("100"), None)
    assert shape.samples_per_step == 64 and math.isfinite(shape.throughput)
    assert not analyzer.incidents


def test_updates_are_copies_and_follow_the_life_cycle():
    def fault(seq, busy):
        busy[2] *= 1.3

    analyzer, [incident], updates = analyze(scenario(fault))
    states = [u.state for u in updates if u.id == incident.id]
    assert states[0] is IncidentState.SUSPECT and states[-1] is IncidentState.CONFIRMED
    updates[0].rank = 99
    assert analyzer.incidents[0].rank == 2


def test_active_probe_is_requested_and_its_verdict_becomes_evidence():
    analyzer = Analyzer(active_probe=True)
    rng = random.Random(9)
    confirmed = None
    for seq in range(10):
        busy = noisy(rng)
        if seq >= 4:
            busy[2] *= 1.3
        reports = lockstep(seq, busy, telemetry=False)
        if seq == 5:
            # Asked for once the suspect is flagged a second time (PROBE_AFTER_FLAGS), not at its first flag.
            assert analyzer.pending_probes() == []
        if seq == 6:
            request = analyzer.pending_probes()[0]
            assert request.ranks == (2,) and request.job == "100"
            reports = [parse_record({**r.model_dump(exclude_none=True), "probe": ProbeResult(
                id=request.id, gemm_ms=13.0 if r.rank == 2 else 10.0).model_dump()}) for r in reports]
        for r in reports:
            for update in analyzer.ingest(r):
                if update.state is IncidentState.CONFIRMED:
                    confirmed = update
    assert confirmed is not None
    assert any(e.signal == "probe.gemm_ms" for e in confirmed.evidence)
    assert confirmed.cause.value.startswith("gpu.")


def test_a_suspect_flagged_once_spends_no_probe_of_the_jobs_few():
    analyzer = Analyzer(active_probe=True)
    rng = random.Random(9)
    requested = []
    for seq in range(12):
        busy = noisy(rng)
        if seq == 4:
            busy[2] *= 1.5  # one slow window: a start-up or scheduling blip
        for r in lockstep(seq, busy, telemetry=False):
            analyzer.ingest(r)
        requested += analyzer.pending_probes()
    assert requested == []


def test_settings_change_the_thresholds():
    def fault(seq, busy):
        busy[2] *= 1.06

    _, found, _ = analyze(scenario(fault))
    assert len(found) == 1
    _, found, _ = analyze(scenario(fault), settings=AnalysisSettings(min_slowdown=0.08))
    assert found == []


def test_cgroup_cpu_quota_throttling_names_the_host():
    def fault(seq, busy):
        busy[3] *= 1.3
        return {"host": {3: {"cpu_throttled_pct": 45.0}}}

    _, [incident], _ = analyze(scenario(fault))
    assert incident.rank == 3 and incident.cause is Cause.HOST_CPU
    assert any(e.signal == "cpu_throttled_pct" and e.value == 45.0 for e in incident.evidence)


def _ring_answer(reports, request, slow_node):
    """Every rank's matched-probe result: ring pairs (r, r+1); pairs touching ``slow_node`` are slow."""
    node_of = [r.node for r in reports]
    return [parse_record({**r.model_dump(exclude_none=True), "probe": ProbeResult(
        id=request.id, gemm_ms=10.0, p2p=[{"peer": (r.rank + 1) % 8, "node": node_of[(r.rank + 1) % 8],
                                           "ms": 30.0 if slow_node in (r.node, node_of[(r.rank + 1) % 8])
                                           else 5.0}]).model_dump()}) for r in reports]


def _link_run(second_slow_node):
    analyzer = Analyzer(active_probe=True)
    rng = random.Random(11)
    incident = None
    requests = []
    for seq in range(18):
        reports = lockstep(seq, noisy(rng), comm_ms=40.0 if seq >= 6 else 20.0, telemetry=False)
        requests += analyzer.pending_probes()
        if seq == 12:
            reports = _ring_answer(reports, requests[0], "n2")
        elif seq == 14:
            assert len(requests) == 2 and requests[1].corroborates and requests[1].ranks == ()
            reports = _ring_answer(reports, requests[1], second_slow_node)
        for r in reports:
            for update in analyzer.ingest(r):
                incident = update
        if seq == 13:
            # One probe named n2: not a finding yet, a second one is asked for.
            assert incident.kind is IncidentKind.JOB and incident.node is None
            assert analyzer.probe_outstanding(incident.id)
    assert requests[0].ranks == ()
    return incident


def test_job_wide_slowdown_becomes_a_link_incident_when_two_matched_probes_agree_on_the_link():
    incident = _link_run("n2")
    assert (incident.kind, incident.cause, incident.node, incident.link) == (
        IncidentKind.LINK, Cause.COMM_LINK, "n2", "n2")
    assert len([e for e in incident.evidence if e.signal == "probe.p2p_ms"]) == 2
    assert not any(e.signal == "missing" for e in incident.evidence)
    assert incident.action.kind == "drain" and incident.action.target == "n2"


def test_probes_that_disagree_name_no_link():
    incident = _link_run("n1")
    assert (incident.kind, incident.cause, incident.node, incident.link) == (IncidentKind.JOB, Cause.UNKNOWN, None, None)
    [missing] = [e for e in incident.evidence if e.signal == "missing"]
    assert "n2, n1" in missing.value
    assert incident.action.kind == "escalate"


def test_a_young_pair_says_why_it_names_the_job_and_not_the_rank():
    # Two ranks, three healthy windows, then rank 1 slows 1.3x: too young for the pair rule.
    updates = []
    analyzer = Analyzer()
    for seq in range(12):
        busy = [50.0, 65.0 if seq >= 3 else 50.0]
        for r in lockstep(seq, busy, nodes=["n0", "n1"], telemetry=False):
            updates += analyzer.ingest(r)
    updates += analyzer.flush()
    confirmed = {u.id: u for u in updates if u.confirmed_window is not None}
    jobs = [u for u in confirmed.values() if u.kind.value == "job"]
    for job in jobs:
        [why] = [e for e in job.evidence if e.signal == "missing" and "island of two" in str(e.value)]
        assert f"of the {PAIR_MIN_WINDOWS} needed" in why.note
    ranks = [u for u in confirmed.values() if u.kind.value == "rank"]
    assert ranks and all(u.rank == 1 for u in ranks), updates  # named once the pair knows its own past


def test_a_job_slowdown_that_moves_into_the_collectives_asks_about_the_links_again():
    analyzer = Analyzer(active_probe=True)
    requested = []

    def window(seq, busy, comm_ms, answer=None):
        reports = lockstep(seq, busy, comm_ms=comm_ms, telemetry=False)
        if answer is not None:  # every rank ran the identical work at the same speed: "normal"
            reports = [parse_record({**r.model_dump(exclude_none=True),
                                     "probe": ProbeResult(id=answer, gemm_ms=10.0).model_dump()}) for r in reports]
        for r in reports:
            analyzer.ingest(r)
        requested.extend(analyzer.pending_probes())

    for seq in range(8):
        window(seq, [50.0] * 8, 20.0)
    # Every rank's own work rises (the machine's load) for 18 windows of ~4 s: a job-wide incident,
    # confirmed once it lasted JobConfirmSeconds.
    for seq in range(8, 26):
        window(seq, [65.0] * 8, 20.0, answer=requested[0].id if requested and seq == 12 else None)
    first = list(requested)
    assert len(first) == 1  # its probe, about the job's slowdown, answered "normal"
    assert [i.state for i in analyzer.incidents] == [IncidentState.CONFIRMED]
    for seq in range(26, 32):  # then the collectives slow (a link degrades) while the work stays up
        window(seq, [65.0] * 8, 60.0)
    assert len(requested) == 2 and requested[1].incident == first[0].incident
    assert not requested[1].corroborates  # a new question: it waits for ProbeMinInterval like any first
