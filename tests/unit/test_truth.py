"""Every incident tells the truth: one definition of healthy, slowed and recovered
throughput everywhere, losses that agree with what was measured (or say why not),
percentages within 0..100, and evidence only about the incident's subject."""

from __future__ import annotations

import pytest

from artemisd.decide import CORROBORATION_WAIT_S
from artemisd.incident import Result
from artemisd.pipeline import Analyzer, analyze_records
from artemisd.loss import LOSS_TOLERANCE_PCT, loss_evidence, loss_summary, measured_loss
from tests.unit.test_server import HEALTHY, Clock, Harness, cluster, hot_gpu_confirmed, mail_text, run, smtp  # noqa: F401 - fixture
from tests.unit.windows import lockstep
from torch_hook.telemetry.host import HostCounters, host_block

WORLD = 8
SLOW = [62.0 if r == 2 else 50.0 for r in range(WORLD)]
STEP_MS = 62.0 + 20.0  # lockstep: the slowest rank's busy + 20 ms of communication


def test_measured_loss_is_the_share_of_healthy_samples_per_second_lost():
    assert measured_loss(1000.0, 550.0) == 45.0
    assert measured_loss(1000.0, 1100.0) == 0.0  # faster than healthy: nothing lost
    assert measured_loss(None, 500.0) is None and measured_loss(0.0, 500.0) is None


def test_loss_disagreement_is_explained_only_past_the_tolerance():
    assert loss_evidence(45.0, 1000.0, 560.0) is None  # 44 vs 45: the same cost
    # The demo's clocks incident: 45.21 % from the busy excess, 82 % of samples/s measured lost.
    line = loss_evidence(45.21, 5824.0, 1026.0)
    assert line["signal"] == "samples_per_s" and (line["value"], line["peers"]) == (1026.0, 5824.0)
    assert "82.4 %" in line["note"] and "more than" in line["note"]
    less = loss_evidence(40.0, 1000.0, 1000.0 * (1 - (40.0 - LOSS_TOLERANCE_PCT - 1) / 100))
    assert "less than" in less["note"]


def test_one_loss_figure_is_read_first_and_the_other_only_when_they_disagree():
    # Measured: the figure the result's samples/s add up to leads; an estimate within tolerance is not shown.
    assert loss_summary(14.6, 14.1) == "loss: 14.6 % of the job's samples/s, measured against healthy"
    # The demo's clocks incident: 82.4 % measured, 45.21 % from the busy excess; the gap is explained.
    apart = loss_summary(82.4, 45.21)
    assert apart.startswith("loss: 82.4 % of the job's samples/s") and "more than" in apart and "45.2 %" in apart
    assert "estimated" in loss_summary(None, 7.4) and loss_summary(None, None) is None


def test_confirmed_incident_carries_the_measured_loss_next_to_loss_pct():
    windows = [lockstep(s, [50.0] * WORLD) for s in range(10)] + [lockstep(s, SLOW) for s in range(10, 14)]
    [inc] = [i for i in analyze_records([r for w in windows for r in w], Analyzer()) if i.confirmed_window]
    expected = 100.0 * 12.0 / STEP_MS  # 14.6 %: lockstep, so both measures agree
    assert inc.loss_pct == pytest.approx(expected, abs=0.1)
    assert inc.measured_loss_pct == pytest.approx(expected, abs=0.1)
    assert not [e for e in inc.evidence if e.signal == "samples_per_s"]


def test_a_loss_the_busy_excess_does_not_explain_is_shown_and_explained():
    # The straggler's busy excess is 12 ms, but every rank also waits 40 ms longer
    # at the collectives: samples/s fall far more than loss_pct says.
    windows = [lockstep(s, [50.0] * WORLD) for s in range(10)] + \
              [lockstep(s, SLOW, comm_ms=40.0) for s in range(10, 14)]
    incs = [i for i in analyze_records([r for w in windows for r in w], Analyzer())
            if i.confirmed_window and i.rank == 2]
    inc = incs[-1]
    step = 62.0 + 40.0
    assert inc.loss_pct == pytest.approx(100.0 * 12.0 / step, abs=0.1)
    assert inc.measured_loss_pct == pytest.approx(100.0 * (1 - 70.0 / step), abs=0.1)
    [line] = [e for e in inc.evidence if e.signal == "samples_per_s"]
    assert "more than the subject's busy excess" in line.note


def test_cpu_throttled_pct_is_a_share_of_quota_periods_never_above_100():
    # A two-CPU quota throttled in most periods of a 10 s window sums ~16 s of
    # throttled time over its CPUs, which the old accounting reported as 160 %.
    # Per quota period it is 90 %.
    before = HostCounters(wall_s=100.0, cgroup_periods=0, cgroup_throttled_periods=0)
    after = HostCounters(wall_s=110.0, cgroup_periods=1000, cgroup_throttled_periods=900)
    assert host_block(before, after)["cpu_throttled_pct"] == pytest.approx(90.0)
    idle = HostCounters(wall_s=120.0, cgroup_periods=1000, cgroup_throttled_periods=900)
    assert host_block(after, idle)["cpu_throttled_pct"] == 0.0  # no quota period ran: nothing held back


def test_show_names_healthy_slowed_and_after_once():
    text = Result(throughput_healthy=5824.0, throughput_before=1026.0, throughput_after=5700.0,
                  recovered=True).describe()
    assert text == ("throughput (samples/s): healthy 5824.0, slowed 1026.0, after 5700.0 (98 % of healthy); "
                    "recovered True")


def test_requeued_job_result_keeps_the_first_run_s_healthy_and_slowed_throughput(tmp_path):
    """Verification after a requeue compares the new run with the first run's healthy
    throughput; the slowed throughput is the first run's, not recomputed from the second."""
    async def scenario():
        conf = "PartitionPolicy=gpu Auto=drain,requeue,escalate MaxDrainFraction=0.5\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await hot_gpu_confirmed(h, range(8, 11))
            [inc] = await h.incidents()
            assert inc["state"] == "verifying", inc
            await h.windows(range(0, 12), HEALTHY, nodes=["n0", "n0", "n4", "n4", "n2", "n2", "n3", "n3"])
            [inc] = await h.incidents()
            result = inc["result"]
            samples = 32 * 50 * WORLD  # per window
            healthy = samples / (50 * 70.0 / 1000)
            slowed = samples / (50 * STEP_MS / 1000)
            assert result["throughput_healthy"] == pytest.approx(healthy, rel=1e-3)
            assert result["throughput_before"] == pytest.approx(slowed, rel=1e-3)
            assert result["throughput_after"] == pytest.approx(healthy, rel=1e-3)
            assert inc["state"] == "resolved" and result["recovered"] is True
            assert inc["measured_loss_pct"] == pytest.approx(100 * (1 - slowed / healthy), abs=0.1)
            shown = await h.show(inc["id"])
            [note] = [a["why"] for a in shown["audit"] if a["what"] == "resolved"]
            assert f"{healthy:.1f} healthy" in note and f"{healthy:.1f} samples/s after" in note
    run(scenario)


def test_a_slow_link_elsewhere_is_not_evidence_about_the_suspect():
    from artemisd.confirm import ProbeVerdict, judge_probe
    from tests.unit.test_confirm import NODES, probe

    # Ring 0→1→2→3→0 with n1's link slow, while the suspect is rank 2 (n2's GPU clocks).
    results = {0: probe("P", 10, [(1, 20.0)]), 1: probe("P", 10, [(2, 21.0)]),
               2: probe("P", 10, [(3, 5.0)]), 3: probe("P", 10, [(0, 5.1)])}
    judgement = judge_probe(results, {2}, NODES, 0.04)
    assert judgement.verdict is ProbeVerdict.NORMAL and judgement.node is None
    assert [e.signal for e in judgement.evidence] == ["probe.gemm_ms"]
    assert not any("n1" in e.note for e in judgement.evidence)
    # The same ring for a job-wide slowdown (no suspect): the link is the finding.
    assert judge_probe(results, set(), NODES, 0.04).node == "n1"


def test_a_link_incident_with_only_its_link_is_drained_on_that_node():
    from artemisd.incident import Cause, IncidentKind
    from artemisd.remedy import propose

    action = propose(IncidentKind.LINK, Cause.COMM_LINK, None, "7", link="n3")
    assert (action.kind, action.target) == ("drain", "n3")
    assert propose(IncidentKind.JOB, Cause.COMM_LINK, None, "7").kind == "escalate"


def _answer(window, probe_id, slow_node):
    """Each rank's matched-probe result for ``probe_id``: ring pairs touching ``slow_node`` are slow."""
    from artemisd.wire import parse_record

    node_of = [r.node for r in window]
    world = len(window)
    out = []
    for r in window:
        peer = (r.rank + 1) % world
        ms = 30.0 if slow_node in (r.node, node_of[peer]) else 5.0
        probe = {"id": probe_id, "gemm_ms": 10.0, "p2p": [{"peer": peer, "node": node_of[peer], "ms": ms}]}
        out.append(parse_record({**r.model_dump(mode="json", exclude_none=True), "probe": probe}))
    return out


def link_conf(relay: str, extra: str = "") -> str:
    """Mail to the admins, probes may corroborate a drain, every rung automatic."""
    return (f"MailRelay={relay}\nMailTo=hpc-admins@example.org\nHardActionEvidence=root_or_probe\n{extra}"
            "PartitionPolicy=gpu Auto=drain,requeue,escalate MaxDrainFraction=0.5\n")


async def _degraded_link(h, slow_nodes, windows=range(0, 22), slowed_busy=None):
    """Healthy windows, then every collective slower; each probe directive answered with
    ring timings that are slow around the next node of ``slow_nodes``.  ``slowed_busy``:
    instead of the collectives, every rank's own work slows to it (the machine, not a link)."""
    answers = list(slow_nodes)
    pending: list[str] = []
    seen: set[str] = set()
    for seq in windows:
        h.clock.now += 10
        if slowed_busy is not None:
            window = lockstep(seq, [slowed_busy] * WORLD if seq >= 8 else HEALTHY)
        else:
            window = lockstep(seq, HEALTHY, comm_ms=40.0 if seq >= 8 else 20.0,
                              host={6: {"net_retransmits_per_s": 60.0}} if seq >= 8 else None)
        if pending and answers:
            window = _answer(window, pending.pop(0), answers.pop(0))
        reply = await h.post(window)
        for d in reply["directives"]:
            if d["type"] == "probe" and d["id"] not in seen:
                seen.add(d["id"])
                pending.append(d["id"])
        await h.daemon.run_once()
    return seen


def test_a_degraded_link_is_drained_once_two_probes_agree_and_nobody_was_told_unknown(tmp_path, smtp):
    box, relay = smtp

    async def scenario():
        conf = link_conf(relay)
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            probes = await _degraded_link(h, ["n2", "n2"], range(0, 13))
            assert len(probes) == 2  # the second one did not wait ProbeMinInterval (300 s)
            [inc] = [i for i in await h.incidents() if i["cause"] != "unknown" or i["state"] != "resolved"]
            assert (inc["kind"], inc["cause"], inc["link"]) == ("link", "comm.link", "n2"), inc
            # Drained on the node whose link it is (n3's retransmits stood out: not a reason).
            assert h.slurm.nodes["n2"].drained and not h.slurm.nodes["n3"].drained
            assert h.slurm.jobs["100"].excluded_nodes == ("n2",)
            assert box.messages == []  # nobody was told "unknown job" while the probes were out
    run(scenario)


def test_probes_that_agree_name_no_link_for_a_slowdown_of_every_rank_s_own_work(tmp_path, smtp):
    # Every rank's busy rose (a loaded machine), the collectives did not: two probes whose
    # ring timings agree on n2 (the loaded host's rank 0 is slow at its ping-pongs) name no link.
    box, relay = smtp

    async def scenario():
        conf = link_conf(relay)
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            # 18 windows of the rise: an unexplained job-wide one confirms once it lasted JobConfirmSeconds.
            probes = await _degraded_link(h, ["n2", "n2"], range(0, 26), slowed_busy=65.0)
            assert len(probes) == 2
            incidents = await h.incidents()
            assert [i["kind"] for i in incidents] == ["job"] and incidents[0]["link"] is None, incidents
            assert not any(n.drained for n in h.slurm.nodes.values()) and box.messages == []
    run(scenario)


def test_probes_that_disagree_escalate_what_is_known_and_drain_nothing(tmp_path, smtp):
    box, relay = smtp

    async def scenario():
        conf = link_conf(relay, "UnknownEscalateAfter=2m\n")
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            # Two probes disagree, the third (asked for at once) never answers: no link is
            # named, and disagreeing ring timings are no deviating signal, so a person is
            # told what is known once the slowdown has lasted UnknownEscalateAfter and costs
            # UnknownEscalateLoss (comm 20 -> 40 ms: 22 % of samples/s).
            await _degraded_link(h, ["n2", "n1"], range(0, 40))
            assert not any(n.drained for n in h.slurm.nodes.values())
            [inc] = await h.incidents()
            assert inc["state"] == "escalated" and inc["link"] is None
            [mail] = box.messages
            text = mail_text(mail)
            assert "n2, n1" in text  # what is known: the probes named two different links
    run(scenario)


REQUEUED = ["n0", "n0", "n4", "n4", "n2", "n2", "n3", "n3"]


def test_requeued_job_is_judged_after_its_warm_up_and_a_hot_node_is_never_resumed(tmp_path):
    """The incident of the issue: drain n1 (hot GPU), requeue, and the restarted job's
    first windows are warm-up.  Judged on them the drain looked useless and was undone
    while n1 was still at 93 °C.  Warm-up windows are left out; and even when the job
    does not recover, a node whose node check still shows the fault is not resumed."""
    async def scenario():
        conf = "PartitionPolicy=gpu Auto=drain,requeue,escalate MaxDrainFraction=0.5\nVerifyWarmupWindows=3\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await hot_gpu_confirmed(h, range(8, 11))
            [inc] = await h.incidents()
            assert inc["state"] == "verifying"
            warm_up = [20.0 + 50.0] * WORLD  # imports, process groups: slow first windows
            await h.windows(range(0, 3), warm_up, nodes=REQUEUED)
            [inc] = await h.incidents()
            assert inc["state"] == "verifying"  # not judged on warm-up windows
            await h.windows(range(3, 5), HEALTHY, nodes=REQUEUED)
            [inc] = await h.incidents()
            assert inc["state"] == "resolved" and inc["result"]["recovered"] is True
            assert h.slurm.nodes["n1"].drained
    run(scenario)


def test_a_drain_that_did_not_help_keeps_a_node_that_still_shows_the_fault(tmp_path):
    async def scenario():
        conf = "PartitionPolicy=gpu Auto=drain,requeue,escalate MaxDrainFraction=0.5\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await hot_gpu_confirmed(h, range(8, 11))
            # Still slow after the requeue (something else is wrong too), while n1's
            # node check still reports the thermal throttle.
            await h.node_event("n1", gpus=[{"index": 0, "temp_c": 93, "throttle": ["hw_thermal"]}])
            await h.windows(range(0, 6), SLOW, nodes=REQUEUED)
            inc = (await h.incidents())[0]
            assert inc["result"]["recovered"] is False
            assert inc["state"] == "escalated" and inc["action"]["kind"] == "escalate", inc
            assert h.slurm.nodes["n1"].drained  # not resumed while it shows the fault
            shown = await h.show(inc["id"])
            [kept] = [a for a in shown["audit"] if a["what"] == "drain of n1 kept"]
            assert "hw_thermal" in kept["why"]
            assert "undrain" not in [a["kind"] for a in shown["actions"]]
    run(scenario)


def test_windows_of_another_shape_are_not_compared_with_the_healthy_throughput(tmp_path):
    async def scenario():
        conf = "PartitionPolicy=gpu Auto=drain,requeue,escalate MaxDrainFraction=0.5\nVerifyWarmupWindows=1\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await hot_gpu_confirmed(h, range(8, 11))
            # The requeued job came back with 6 ranks instead of 8: fewer samples/s, no matter the node.
            await h.windows(range(0, 4), [50.0] * 6, nodes=REQUEUED[:6])
            [inc] = await h.incidents()
            assert inc["state"] == "escalated" and inc["result"]["recovered"] is None
            shown = await h.show(inc["id"])
            [note] = [a["why"] for a in shown["audit"] if a["what"] == "unresolved"]
            assert "ran 6 ranks" in note and "healthy windows ran 8" in note and "like with like" in note
            assert h.slurm.nodes["n1"].drained  # unmeasurable: nothing is undone
    run(scenario)


def test_a_job_that_did_not_opt_in_is_never_rebalanced(tmp_path):
    async def scenario():
        conf = "PartitionPolicy=gpu Auto=rebalance,escalate\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            data = [1.0] * WORLD
            data[2] = 13.0
            await h.windows(range(0, 8), HEALTHY)
            replies = await h.windows(range(8, 12), SLOW, data=data)
            [inc] = await h.incidents()
            assert inc["cause"] == "input.loader"
            assert inc["state"] == "escalated" and inc["action"]["kind"] == "escalate", inc
            assert not [d for r in replies for d in r["directives"] if d["type"] == "rebalance"]
            shown = await h.show(inc["id"])
            assert [a["kind"] for a in shown["actions"]] == ["escalate"]
            assert any("did not opt in" in a["why"] for a in shown["audit"])
    run(scenario)


def test_the_weighted_sampler_opts_the_job_in_and_a_plain_job_does_not(monkeypatch):
    import torch_hook
    from torch_hook.sampler import WeightedDistributedSampler

    class Probe:
        rebalance_opt_in = False

        def work_shares(self):
            return {}

    probe = Probe()
    monkeypatch.setattr(torch_hook, "_probe", probe)
    WeightedDistributedSampler(range(100), 4, num_replicas=2, rank=0, shares=lambda: {})  # its own shares
    assert probe.rebalance_opt_in is False
    WeightedDistributedSampler(range(100), 4, num_replicas=2, rank=0)
    assert probe.rebalance_opt_in is True


def test_looking_at_the_probes_counters_opts_nothing_in(monkeypatch):
    """``torch_hook.stats()`` is for debugging: it shows the shares without reading them to apply
    them, so it never makes the daemon rebalance a job that does not apply shares (issue 28)."""
    import torch_hook
    from torch_hook.config import ProbeConfig
    from torch_hook.probe import Probe

    probe = Probe(ProbeConfig(endpoint=None, job="7", job_step="0", node="n1"))
    monkeypatch.setattr(torch_hook, "_probe", probe)
    assert torch_hook.stats()["shares"] == {} and probe.rebalance_opt_in is False
    assert torch_hook.work_share() == 1.0 and probe.rebalance_opt_in is True  # reading to apply opts in


def test_mail_offers_only_what_exists_and_a_resolved_escalation_sends_its_all_clear(tmp_path, smtp):
    box, relay = smtp

    async def scenario():
        conf = (f"MailRelay={relay}\nMailTo=hpc-admins@example.org\n"
                "PartitionPolicy=gpu Auto=drain,requeue,escalate\n")
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await hot_gpu_confirmed(h, evidence=False)  # no root-side evidence: escalated, nothing pending
            h.clock.now += CORROBORATION_WAIT_S  # ... once the node check had its time to look
            await h.daemon.run_once()
            [inc] = await h.incidents()
            assert inc["state"] == "escalated"
            [first] = [mail_text(m) for m in box.messages]
            assert "approve" not in first and "deny" not in first
            assert f"artemis show {inc['id']}" in first and "scontrol update NodeName=n1 State=DRAIN" in first
            # The GPU cools down by itself: the person who was told hears that it is over.
            await h.windows(range(12, 20), HEALTHY)
            [inc] = await h.incidents()
            assert inc["state"] == "resolved"
            subjects = [m.content.decode(errors="replace") for m in box.messages]
            assert len(box.messages) == 2 and f"resolved: {inc['id']}" in subjects[1]
            assert "Nothing is needed from you" in mail_text(box.messages[1])
            comment = h.slurm.jobs["100"].admin_comment
            assert comment.count(inc["id"]) == 1  # AdminComment: only what a person must act on
    run(scenario)


def test_pending_approval_mail_says_how_to_approve(tmp_path, smtp):
    box, relay = smtp

    async def scenario():
        conf = (f"MailRelay={relay}\nMailTo=hpc-admins@example.org\n"
                "PartitionPolicy=gpu Auto=escalate Approve=drain,requeue MaxDrainFraction=0.5\n")
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await hot_gpu_confirmed(h, range(8, 12))
            [inc] = await h.incidents()
            [text] = [mail_text(m) for m in box.messages]
            assert f"drain n1 awaits your decision: artemis approve {inc['id']}" in text
            # One loss figure first, the one the result's samples/s add up to.
            assert loss_summary(inc["measured_loss_pct"], inc["loss_pct"]) in text.splitlines()
    run(scenario)


def test_an_unknown_with_no_deviating_signal_waits_until_it_lasts_and_costs(tmp_path, smtp):
    box, relay = smtp

    async def scenario():
        conf = (f"MailRelay={relay}\nMailTo=hpc-admins@example.org\nUnknownEscalateAfter=2m\n"
                "UnknownEscalateLoss=20\nPartitionPolicy=gpu Auto=escalate\n")
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await h.windows(range(0, 8), HEALTHY)
            # Rank 2 is 12 ms slower and nothing it measures differs: 14.6 % of samples/s.
            await h.windows(range(8, 30), SLOW)
            [inc] = await h.incidents()
            assert inc["cause"] == "unknown" and inc["state"] == "confirmed"
            assert box.messages == [] and h.slurm.jobs["100"].admin_comment in ("", None)
            shown = await h.show(inc["id"])
            [held] = [a for a in shown["audit"] if a["what"] == "not escalated yet"]
            assert "UnknownEscalateLoss=20" in held["why"]
            # A matched probe that ran identical work at peer speed is no deviating signal either.
            from artemisd.decide import deviates as deviates_at
            from artemisd.incident import Evidence

            def deviates(e, ratio=None):
                return deviates_at(e, ratio, h.daemon.config.analysis.min_slowdown)
            assert not deviates(Evidence(signal="probe.gemm_ms", value=10.1, peers=10.0))
            assert deviates(Evidence(signal="probe.gemm_ms", value=13.0, peers=10.0))
            # ... unless it explains under half of the subject's excess (a rank 1.35x its peers).
            assert not deviates(Evidence(signal="probe.gemm_ms", value=10.6, peers=10.0), 1.35)
            assert deviates(Evidence(signal="probe.gemm_ms", value=12.0, peers=10.0), 1.35)
            assert deviates(Evidence(signal="cpu_throttled_pct", value=90.0, peers=0.0))
            # Nor do ring timings that no second probe agreed with (agreeing ones name comm.link),
            # nor a node's retransmit counter (the senders to a slow link count them).
            assert not deviates(Evidence(signal="probe.p2p_ms", value=30.0, peers=5.0,
                                                   note="ring transfers touching n1 are 6.0x slower"))
            assert not deviates(Evidence(signal="net_retransmits_per_s", value=10.4, peers=1.8))
            # Now it costs 30 % (busy 80 vs 50: step 100 ms vs 70) and has lasted > 2 min: a person is told.
            await h.windows(range(30, 34), [80.0 if r == 2 else 50.0 for r in range(WORLD)])
            [inc] = await h.incidents()
            assert inc["state"] == "escalated" and len(box.messages) == 1
    run(scenario)


def test_an_escalation_is_followed_up_when_the_probes_name_the_link_later(tmp_path, smtp):
    box, relay = smtp

    async def scenario():
        # Retransmits name no link: the unknown slowdown (22 % of samples/s) is escalated
        # once it has lasted UnknownEscalateAfter.
        conf = (f"MailRelay={relay}\nMailTo=hpc-admins@example.org\nHardActionEvidence=root_or_probe\n"
                "UnknownEscalateAfter=2m\nPartitionPolicy=gpu Auto=escalate\n")
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            pending: list[str] = []
            seen: set[str] = set()
            for seq in range(0, 30):
                h.clock.now += 10
                window = lockstep(seq, HEALTHY, comm_ms=40.0 if seq >= 8 else 20.0,
                                  host={6: {"net_retransmits_per_s": 60.0}} if seq >= 8 else None)
                if seq >= 24 and pending:  # the probes answer late, after ProbeTimeout (120 s)
                    window = _answer(window, pending.pop(0), "n2")
                reply = await h.post(window)
                for d in reply["directives"]:
                    if d["type"] == "probe" and d["id"] not in seen:
                        seen.add(d["id"])
                        pending.append(d["id"])
                await h.daemon.run_once()
                if seq == 23:
                    [inc] = await h.incidents()
                    assert inc["cause"] == "unknown" and inc["state"] == "escalated"
                    assert len(box.messages) == 1  # told what was known: a job-wide slowdown
            [inc] = await h.incidents()
            assert (inc["kind"], inc["link"], inc["state"]) == ("link", "n2", "escalated"), inc
            texts = [mail_text(m) for m in box.messages]
            assert len(texts) == 2, texts
            subject = box.messages[1].content.decode(errors="replace")
            assert f"update: {inc['id']} comm.link" in subject
            assert "This updates the earlier message" in texts[1]
            assert f"drain n2 awaits your decision: artemis approve {inc['id']}" in texts[1]
            assert "approve" not in texts[0]  # the first one had nothing to approve
            shown = await h.show(inc["id"])
            assert any(a["what"] == "diagnosis changed" for a in shown["audit"])
    run(scenario)


def test_onset_is_the_start_of_the_slowdown_not_an_earlier_blip():
    # One slow window at 4 (a blip, dismissed), then the real fault from window 10.
    windows = [lockstep(s, SLOW if s == 4 or s >= 10 else [50.0] * WORLD) for s in range(16)]
    incs = [i for i in analyze_records([r for w in windows for r in w], Analyzer()) if i.confirmed_window]
    assert incs and all(i.onset_window == 10 for i in incs), [(i.onset_window, i.confirmed_window) for i in incs]


def test_an_intermittent_slowdown_begins_with_its_first_flag():
    from artemisd.confirm import Persistence, Verdict

    p = Persistence(2)
    for seq in (10, 13):
        assert p.observe("r2", seq, "c", steady=True)[0] is Verdict.PENDING
        p.close_window(seq)
    verdict, streak = p.observe("r2", 16, "c", steady=True)
    assert verdict is Verdict.CONFIRMED and streak.intermittent and streak.onset == 10
    q = Persistence(2)
    q.observe("r2", 4, "c")
    q.close_window(4)
    q.observe("r2", 10, "c")
    verdict, streak = q.observe("r2", 11, "c")
    assert verdict is Verdict.CONFIRMED and not streak.intermittent and streak.onset == 10


def test_a_job_whose_daemon_is_unreachable_is_told_once_and_once_more_when_it_answers(capsys):
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from torch_hook.transport import Sender

    class Ok(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    with socket.socket() as s:  # a loopback port nothing listens on (yet)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = {"type": "window", "v": 1, "job": "1", "rank": 0, "world": 1, "node": "n1",
              "window": {"seq": 0, "first_step": 0, "steps": 1, "t0": 1.0, "t1": 2.0}, "ms": {"step": 1.0}}
    sender = Sender(f"http://127.0.0.1:{port}", timeout_s=1.0)
    try:
        for _ in range(3):
            sender.submit(dict(report))
            assert sender.flush(5.0)
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and "cannot reach the Artemis daemon" in err[0] and "unwatched" in err[0]
        server = ThreadingHTTPServer(("127.0.0.1", port), Ok)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            for _ in range(2):
                sender.submit(dict(report))
                assert sender.flush(5.0)
        finally:
            server.shutdown()
            server.server_close()
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and "answers again" in err[0] and "3 window reports were dropped" in err[0]
    finally:
        sender.close()


def test_the_daemon_counts_and_logs_reports_a_probe_dropped_when_it_comes_back(tmp_path):
    async def scenario():
        async with Harness(tmp_path, "", cluster(), Clock()) as h:
            await h.windows(range(0, 2), HEALTHY)
            late = [r.model_copy(update={"dropped_reports": 5 if r.rank == 3 else 0})
                    for r in lockstep(7, HEALTHY)]
            await h.post(late)
            await h.post([r.model_copy(update={"dropped_reports": 5 if r.rank == 3 else 0})
                          for r in lockstep(8, HEALTHY)])  # the same total: nothing new
            metrics = await (await h.client.get("/metrics")).text()
            assert "artemis_probe_reports_dropped_total 5.0" in metrics
            # A node's relay (local rank 0) counts its siblings' reports it could not deliver apart.
            await h.post([r.model_copy(update={"dropped_reports": 5 if r.rank == 3 else 0,
                                               "relay_dropped": 7 if r.rank == 0 else None})
                          for r in lockstep(9, HEALTHY)])
            metrics = await (await h.client.get("/metrics")).text()
            assert "artemis_probe_reports_dropped_total 12.0" in metrics
    run(scenario)


def test_a_first_probe_taken_before_the_fault_is_outvoted_by_the_next_two(tmp_path):
    """Seen on the loaded test cluster: the job was flagged by noise before the link was
    degraded, so the first probe timed a healthy ring (n1 'slow': 9 ms vs 1.7); the next
    two, after the fault, agree on n2 (437 ms vs 45)."""
    async def scenario():
        conf = ("HardActionEvidence=root_or_probe\n"
                "PartitionPolicy=gpu Auto=drain,requeue,escalate MaxDrainFraction=0.5\n")
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            probes = await _degraded_link(h, ["n1", "n2", "n2"], range(0, 15))
            assert len(probes) == 3
            [inc] = await h.incidents()
            assert (inc["kind"], inc["cause"], inc["link"]) == ("link", "comm.link", "n2"), inc
            assert h.slurm.nodes["n2"].drained and not h.slurm.nodes["n1"].drained
    run(scenario)


def test_one_incident_shows_one_measured_loss_the_one_its_result_shows(tmp_path):
    """The analysis measures the loss from the onset to the confirming window; the result's slowed
    throughput spans the onset to the action.  When the job slows further while an approval waits,
    the incident's measured_loss_pct (and its samples/s evidence) follow the result's two numbers."""
    from tests.unit.test_server import HOT, SLOW_BUSY

    async def scenario():
        conf = "PartitionPolicy=gpu Auto=escalate Approve=drain,requeue MaxDrainFraction=0.5\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await hot_gpu_confirmed(h, range(8, 10))
            [inc] = await h.incidents()
            confirmed_loss = inc["measured_loss_pct"]
            slower = [80.0 if busy > 50.0 else busy for busy in SLOW_BUSY]
            await h.windows(range(10, 14), slower, gpu=HOT)  # a person takes a while to approve
            assert (await h.client.post(f"/v1/incidents/{inc['id']}/approve", data=b"")).status == 200
            for _ in range(3):  # queued, drained, requeued
                await h.daemon.run_once()
            [inc] = await h.incidents()
            result = inc["result"]
            assert result["throughput_before"] is not None, inc
            shown = measured_loss(result["throughput_healthy"], result["throughput_before"])
            assert inc["measured_loss_pct"] == shown and shown > confirmed_loss + 1.0, (shown, confirmed_loss)
            line = [e for e in inc["evidence"] if e["signal"] == "samples_per_s"]
            assert line == ([] if abs(inc["loss_pct"] - shown) <= LOSS_TOLERANCE_PCT else line[:1]) and \
                all(e["value"] == round(result["throughput_before"], 1) for e in line)
    run(scenario)
