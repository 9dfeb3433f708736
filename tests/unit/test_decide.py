"""decide.plan: the whole decision on plain values, with the numbers it must produce."""

from __future__ import annotations

import pytest

from artemisd import decide, policy
from artemisd.config import parse_config_text
from artemisd.incident import Cause, Evidence, Incident, IncidentKind, IncidentState, Recurrence
from artemisd.slurm.api import NodeInfo

S = IncidentState
NOW = 10_000.0
HOT = {"time": NOW - 10, "gpus": [{"index": 0, "util_pct": 98, "throttle": ["sw_thermal"], "temp_c": 91}]}
SLOW_CLOCK = {"time": NOW - 10, "gpus": [{"index": 0, "util_pct": 97, "throttle": [], "sm_clock_mhz": 1100,
                                          "max_sm_clock_mhz": 1980}]}


def config(line: str, **daemon: str):
    extra = "".join(f"{k}={v}\n" for k, v in daemon.items())
    return parse_config_text(extra + line + "\n")


def nodes(count: int = 20, drained: dict[str, str] | None = None) -> tuple[NodeInfo, ...]:
    drained = drained or {}
    return tuple(NodeInfo(f"n{i}", frozenset({"ALLOCATED", "DRAIN"} if f"n{i}" in drained else {"ALLOCATED"}),
                          drained.get(f"n{i}", ""), ("gpu",)) for i in range(count))


def incident(cause: Cause, *, node: str = "n2", kind: IncidentKind = IncidentKind.RANK, loss: float = 12.0,
             state: IncidentState = S.CONFIRMED, evidence: list[Evidence] | None = None) -> Incident:
    return Incident(id="INC-1", job="7", kind=kind, rank=2 if kind is IncidentKind.RANK else None, node=node,
                    cause=cause, state=state, ratio=1.2, excess_ms=20.0, loss_pct=loss,
                    evidence=evidence or [Evidence(signal="temp_c", value=91, peers=60)])


def facts(**kw) -> decide.Facts:
    base = dict(now=NOW, partition="gpu", nodes=nodes(), node_evidence=(NOW - 5, HOT), gpu=0, gpus=64,
                opened_at=NOW - 60)
    return decide.Facts(**{**base, **kw})


def test_the_ladder_walks_from_the_remedy_to_a_person():
    conf = config("PartitionPolicy=gpu Auto=correct,drain,requeue,escalate Cooldown=0")
    clocks = incident(Cause.GPU_CLOCKS)
    first = decide.plan(clocks, 0, conf, facts(node_evidence=(NOW - 5, SLOW_CLOCK)))
    assert (first.action.kind, first.action.target, first.action.mode) == ("correct", "n2", "auto")
    assert first.state is S.ACTING and first.plan_step == 1
    assert first.action.params == {"node": "n2", "kind": "reset_clocks", "gpu": 0}
    assert [s.kind for s in first.rest] == ["drain", "escalate"]
    # The correction did not help: verify made it unresolved, the next rung is the drain.
    second = decide.plan(clocks.model_copy(update={"state": S.UNRESOLVED}), first.plan_step, conf,
                         facts(node_evidence=(NOW - 5, SLOW_CLOCK)))
    assert (second.action.kind, second.action.params["reason"]) == ("drain", "artemis: INC-1 gpu.clocks rank 2 1.20x")
    third = decide.plan(clocks.model_copy(update={"state": S.UNRESOLVED}), second.plan_step, conf, facts())
    assert third.action is None and third.escalate == "needs a person" and third.state is S.ESCALATED


def test_a_drain_beyond_the_budget_is_refused_by_name_and_the_next_rung_taken():
    conf = config("PartitionPolicy=gpu Auto=drain,requeue,escalate MaxDrainFraction=0.1 Cooldown=0")
    full = facts(nodes=nodes(20, {"n5": "artemis: INC-0 gpu.thermal", "n6": "artemis: INC-9 gpu.thermal"}))
    plan = decide.plan(incident(Cause.GPU_THERMAL), 0, conf, full)
    assert plan.action is None and plan.escalate == "needs a person"
    [drain] = [s for s in plan.walked if s.kind == "drain"]
    assert drain.mode == "recommend" and drain.contract_status() == "refused"
    assert drain.why.startswith("drain budget: MaxDrainFraction=0.1 reached: 2 of 20 nodes")
    assert drain.as_json()["reason"] == drain.why
    # A node a person drained uses none of Artemis' budget.
    by_person = facts(nodes=nodes(20, {"n5": "artemis: INC-0 gpu.thermal", "n6": "PSU swap"}))
    assert decide.plan(incident(Cause.GPU_THERMAL), 0, conf, by_person).action.kind == "drain"


def test_drains_per_hour_count_our_own_drains_in_flight_and_done():
    conf = config("PartitionPolicy=gpu Auto=drain,escalate MaxDrainFraction=0.5 MaxDrainsPerHour=2 Cooldown=0")
    two = (policy.DrainRecord(1, "n7", "done", NOW - 1200), policy.DrainRecord(2, "n8", "rolled_back", NOW - 600))
    plan = decide.plan(incident(Cause.GPU_THERMAL), 0, conf, facts(drains=two))
    assert plan.action is None
    assert "MaxDrainsPerHour=2 reached: 2 drains in the last hour" in plan.walked[0].why
    later = facts(drains=two, now=NOW + 3000, node_evidence=(NOW + 2990, {**HOT, "time": NOW + 2990}))
    assert decide.plan(incident(Cause.GPU_THERMAL), 0, conf, later).action.kind == "drain"


def test_cooldown_is_between_incidents_and_names_the_seconds_left():
    conf = config("PartitionPolicy=gpu Auto=drain,escalate Cooldown=15m")
    plan = decide.plan(incident(Cause.GPU_THERMAL), 0, conf, facts(last_action={"n2": NOW - 300}))
    assert plan.walked[0].why == "n2 is in its cooldown for 600 s more"
    assert decide.plan(incident(Cause.GPU_THERMAL), 0, conf,
                       facts(last_action={"n2": NOW - 901})).action.kind == "drain"


def test_an_approval_rung_waits_for_a_person_and_tells_them_how():
    conf = config("PartitionPolicy=gpu Auto=escalate Approve=drain,requeue")
    plan = decide.plan(incident(Cause.GPU_THERMAL), 0, conf, facts())
    assert plan.action.mode == "approve" and plan.action.contract_status() == "pending_approval"
    assert plan.state is S.ESCALATED and plan.escalate == "drain n2 awaits approval (artemis approve INC-1)"
    # Denied: the incident is decided again from the next rung.
    denied = decide.plan(incident(Cause.GPU_THERMAL, state=S.ESCALATED), plan.plan_step, conf, facts())
    assert denied.action is None and denied.escalate == "needs a person" and denied.state is None


def test_hard_actions_need_root_side_evidence_under_load():
    conf = config("PartitionPolicy=gpu Auto=drain,escalate Cooldown=0")
    idle = {"time": NOW - 10, "gpus": [{"index": 0, "util_pct": 0, "throttle": ["idle", "sw_thermal"]}]}
    for evidence in (None, (NOW - 5, idle), (NOW - 2000, {**HOT, "time": NOW - 2000})):
        # Past the wait for the node check to look (corroboration_due): judged on what there is.
        plan = decide.plan(incident(Cause.GPU_THERMAL), 0, conf,
                           facts(node_evidence=evidence, opened_at=NOW - decide.CORROBORATION_WAIT_S))
        assert plan.action is None and "root-side" in plan.walked[0].why


def test_a_hard_rung_waits_for_the_node_check_to_look_after_the_incident_opened():
    conf = config("PartitionPolicy=gpu Auto=drain,escalate Cooldown=0")
    healthy_before = (NOW - 20, {"time": NOW - 20, "gpus": [{"index": 0, "util_pct": 97, "throttle": [],
                                                             "temp_c": 45, "sm_clock_mhz": 1980}]})
    # Confirmed 10 s after it opened; the node check last looked 20 s ago, before the fault.
    plan = decide.plan(incident(Cause.GPU_THERMAL), 0, conf, facts(node_evidence=healthy_before, opened_at=NOW - 10))
    assert plan.action is None and plan.escalate is None and "has not looked since" in plan.wait
    # Its next report shows the heat: drained.
    plan = decide.plan(incident(Cause.GPU_THERMAL), 0, conf, facts(node_evidence=(NOW - 1, {**HOT, "time": NOW - 1}),
                                                                    opened_at=NOW - 10))
    assert plan.action.kind == "drain"
    # A report since the incident opened that does not show it: not corroborated, a person is told.
    looked = (NOW - 2, {**healthy_before[1], "time": NOW - 2})
    plan = decide.plan(incident(Cause.GPU_THERMAL), 0, conf, facts(node_evidence=looked, opened_at=NOW - 10))
    assert plan.action is None and plan.escalate and plan.wait is None


def test_kill_switch_and_dry_run():
    off = config("PartitionPolicy=gpu Auto=drain,escalate", Enabled="no")
    plan = decide.plan(incident(Cause.GPU_THERMAL), 0, off, facts())
    assert plan.action is None and plan.walked[0].why == "Enabled=no: the kill switch is on"
    dry = config("PartitionPolicy=gpu Auto=drain,escalate", DryRun="yes")
    plan = decide.plan(incident(Cause.GPU_THERMAL), 0, dry, facts())
    assert plan.dry_run and plan.action.kind == "drain" and plan.state is None
    assert any(n.what == "dry-run: would drain n2" for n in plan.notes)


def test_rebalance_only_for_jobs_that_opted_in():
    conf = config("PartitionPolicy=gpu Auto=rebalance,escalate")
    plan = decide.plan(incident(Cause.INPUT_LOADER), 0, conf, facts())
    assert plan.action is None and plan.notes[0].what == "rebalance 7:2: skipped"
    plan = decide.plan(incident(Cause.INPUT_LOADER), 0, conf, facts(rebalance_opt_in=True))
    assert plan.action.params == {"job": "7", "step": "0", "shares": {"2": 0.833}}


def test_an_unknown_slowdown_is_held_until_it_lasts_and_costs():
    conf = config("PartitionPolicy=gpu Auto=escalate", UnknownEscalateAfter="10m", UnknownEscalateLoss="20")
    plain = incident(Cause.UNKNOWN, evidence=[Evidence(signal="ms.busy", value=120, peers=100)])
    held = decide.plan(plain, 0, conf, facts(opened_at=NOW - 300, measured_loss_pct=30.0))
    assert held.action is None and held.escalate is None and "lasted 300 s" in held.wait
    cheap = decide.plan(plain, 0, conf, facts(opened_at=NOW - 900, measured_loss_pct=5.0))
    assert cheap.wait is not None
    assert decide.plan(plain, 0, conf, facts(opened_at=NOW - 900, measured_loss_pct=30.0)).escalate


@pytest.mark.parametrize("gpus,loss,time_left_h,pays", [
    # requeue: 1,024 GPUs x (15 min since the checkpoint + 5 min restart) = 341 GPU-h
    (1024, 10.0, 0.5, False),   # 51 GPU-h of slowdown left: waiting is cheaper
    (1024, 10.0, 8.0, True),    # 819 GPU-h: acting pays
    (8, 40.0, 0.25, False),     # near its end even a small, badly slowed job finishes where it is
    (8, 40.0, None, True),      # no time limit known: the slowdown's cost is unbounded
])
def test_a_requeue_is_priced_against_the_slowdown(gpus, loss, time_left_h, pays):
    pol = config("PartitionPolicy=gpu Auto=drain,requeue,escalate Cooldown=0").policy_for("gpu")
    price = decide.rung_cost("requeue", incident(Cause.GPU_THERMAL, loss=loss), pol,
                             facts(gpus=gpus, time_left_s=None if time_left_h is None else time_left_h * 3600))
    assert price.pays is pays
    if gpus == 1024:
        assert f"= {gpus * 20 / 60:.2f} GPU-h" in price.why
        assert f"= {gpus * loss / 100 * time_left_h:.2f} GPU-h" in price.why


def test_a_person_is_never_paged_for_a_loss_below_the_floor_whatever_the_cause():
    """An innocent node's owner was paged for a host.cpu incident of ratio 1.13, 0.71 % estimated and
    0.0 % measured loss (issue 28).  Every page, for any cause and approvals too, needs EscalateLoss."""
    conf = config("PartitionPolicy=gpu Auto=escalate", EscalateLoss="2")
    innocent = incident(Cause.HOST_CPU, loss=0.71, evidence=[Evidence(signal="cpu_pct", value=99, peers=40)])
    held = decide.plan(innocent, 0, conf, facts(measured_loss_pct=0.0))
    assert held.escalate is None and held.action is None and held.plan_step == 0
    assert "costs 0.00 % of the job's throughput (measured), below EscalateLoss=2 %" in held.wait
    assert [n.what for n in held.notes] == ["not escalated: below EscalateLoss"]
    # measured ~0 wins over a large estimate: the job does not run slower
    assert decide.plan(incident(Cause.HOST_CPU, loss=30.0), 0, conf, facts(measured_loss_pct=0.4)).wait
    # at or above the floor, or with no loss known at all, the person is told
    assert decide.plan(innocent, 0, conf, facts(measured_loss_pct=2.5)).escalate
    assert decide.plan(incident(Cause.HOST_CPU, loss=0.71), 0, conf, facts()).wait  # the estimate when unmeasured
    approve = config("PartitionPolicy=gpu Auto=escalate Approve=drain", EscalateLoss="2")
    thermal = incident(Cause.GPU_THERMAL, loss=1.0)
    assert decide.plan(thermal, 0, approve, facts(measured_loss_pct=1.0)).wait  # no approval request either
    asked = decide.plan(thermal, 0, approve, facts(measured_loss_pct=8.0))
    assert asked.action.kind == "drain" and "awaits approval" in asked.escalate
    assert config("PartitionPolicy=gpu").daemon.escalate_loss == 2.0


def test_a_job_without_a_time_limit_is_priced_over_the_stated_horizon_never_a_year():
    """Slurm gives a job without a time limit an end a year after its start; priced over that, any
    slowdown "costs" thousands of GPU-hours (issue 28).  It is priced over UnlimitedJobHorizon, said so."""
    pol = config("PartitionPolicy=gpu Auto=drain,requeue,escalate UnlimitedJobHorizon=2h").policy_for("gpu")
    inc = incident(Cause.GPU_THERMAL, loss=10.0)
    price = decide.rung_cost("requeue", inc, pol, facts(gpus=1024, time_left_s=None, unlimited=True))
    assert "= 204.80 GPU-h" in price.why and "no time limit: over UnlimitedJobHorizon=2 h" in price.why
    assert not price.pays  # 1,024 GPU x 10 % x 2 h = 205 GPU-h < 341 GPU-h of requeue
    default = config("PartitionPolicy=gpu Auto=drain,requeue,escalate").policy_for("gpu")
    assert default.unlimited_job_horizon == 86_400.0
    assert decide.rung_cost("requeue", inc, default, facts(gpus=1024, unlimited=True)).pays  # 2,458 GPU-h a day


def test_slurms_no_limit_is_read_as_no_limit_not_as_a_year_left():
    from artemisd.slurm.cli import _job_from_json

    year = NOW + 365 * 86_400
    for limit in (None, 0xFFFFFFFF, 0xFFFFFFFE, {"set": True, "infinite": True, "number": 0}):  # None: 22.05
        job = _job_from_json({"job_id": 7, "user_id": 1, "job_state": "RUNNING", "end_time": int(year),
                              "time_limit": limit})
        assert job.unlimited and job.time_left(NOW) is None
    timed = _job_from_json({"job_id": 7, "user_id": 1, "job_state": "RUNNING", "end_time": int(NOW + 3600),
                            "time_limit": 60})
    assert not timed.unlimited and timed.time_left(NOW) == 3600
    unsaid = _job_from_json({"job_id": 7, "user_id": 1, "job_state": "RUNNING", "end_time": int(NOW + 3600)})
    assert not unsaid.unlimited and unsaid.time_left(NOW) == 3600  # no time_limit at all: end_time stands


def test_a_requeue_that_does_not_pay_leaves_the_job_on_the_drained_node_and_says_why():
    pol = config("PartitionPolicy=gpu Auto=drain,requeue,escalate").policy_for("gpu")
    inc = incident(Cause.GPU_THERMAL, loss=10.0)
    near_end = decide.after_drain(inc, pol, facts(gpus=1024, time_left_s=1800), rung_approved=False)
    assert near_end.kind is None and "waiting is cheaper" in near_end.escalate
    early = decide.after_drain(inc, pol, facts(gpus=1024, time_left_s=8 * 3600), rung_approved=False)
    assert (early.kind, early.params) == ("requeue", {"job": "7", "node": "n2"})
    # A transient cause is expected to last TransientFaultTime at most, however long the job runs.
    host = incident(Cause.HOST_CPU, loss=10.0)
    assert not decide.rung_cost("requeue", host, pol, facts(gpus=16, time_left_s=8 * 3600)).pays


def test_a_device_that_keeps_coming_back_goes_to_a_person():
    conf = config("PartitionPolicy=gpu Auto=correct,drain,escalate", RecurEscalate="3")
    twice = incident(Cause.GPU_CLOCKS).model_copy(update={
        "recurrences": [Recurrence(onset_window=w, confirmed_window=w + 1) for w in (10, 20)]})
    assert decide.plan(twice, 0, conf, facts(node_evidence=(NOW - 5, SLOW_CLOCK))).action.kind == "correct"
    thrice = twice.model_copy(update={"recurrences": twice.recurrences + [Recurrence(onset_window=30)]})
    plan = decide.plan(thrice, 0, conf, facts(node_evidence=(NOW - 5, SLOW_CLOCK)))
    assert plan.action is None and plan.escalate == "needs a person"
    assert plan.notes[0].what == "escalated: keeps coming back" and "3 recurrences" in plan.notes[0].why


def test_the_time_left_comes_from_slurm_s_end_time_for_a_running_job():
    from artemisd.slurm.api import JobInfo
    from artemisd.slurm.cli import _job_from_json
    # squeue --json of Slurm 22.05, as recorded on the test cluster: no time limit is a null
    # time_limit and an end a year after the start, which is no time left to price with.
    entry = {"job_id": 4, "user_id": 0, "job_state": "RUNNING", "partition": "debug", "nodes": "n[1-3]",
             "time_limit": None, "start_time": 1796382266, "end_time": 1827918266}
    info = _job_from_json(entry)
    assert info.unlimited and info.time_left(1796382266 + 3600) is None
    limited = _job_from_json(entry | {"time_limit": 120, "end_time": 1796382266 + 7200})
    assert not limited.unlimited and limited.time_left(1796382266 + 3600) == 3600
    assert JobInfo("5", 0, "PENDING", end_time=1827918266).time_left(0) is None
    assert JobInfo("6", 0, "RUNNING").time_left(0) is None


def test_a_constraint_that_comes_too_late_does_not_undo_a_drain_and_requeue_that_happened():
    # A released job may be running before the next turn; Features change only while pending.
    assert decide.rung_happened("constrain", "failed") and decide.rung_happened("requeue", "done")
    assert not decide.rung_happened("drain", "failed") and not decide.rung_happened("correct", "skipped")


def test_a_planned_rung_is_a_contract_action_with_its_reason():
    conf = config("PartitionPolicy=gpu Auto=escalate Approve=drain MaxDrainFraction=0.1")
    full = facts(nodes=nodes(10, {"n5": "artemis: INC-0 gpu.thermal"}))
    [drain, escalate] = decide.plan(incident(Cause.GPU_THERMAL), 0, conf, full).walked
    assert drain.as_json() == {"kind": "drain", "target": "n2", "status": "refused", "reversible": True,
                               "reason": drain.why}
    assert escalate.as_action().status == "proposed"


def _fabric(symbol_errors: float, time: float = NOW - 10) -> dict:
    return {"time": time, "host": {"net_retransmits_per_s": 60.0},
            "fabric": {"interval_s": 60.0, "ports": [{"name": "mlx5_0/1", "kind": "ib", "state": "ACTIVE",
                                                      "rate_gbps": 200.0, "per_s": {"symbol_error": symbol_errors}}]}}


def test_a_link_is_drained_on_its_receive_side_counters_and_the_incident_shows_them_beside_the_peers():
    probes = [Evidence(signal="probe.p2p_ms", value=v, peers=5.0,
                       note=f"ring transfers touching n2 are {v / 5:.1f}x slower than the others: its link")
              for v in (30.0, 28.0)]
    link = incident(Cause.COMM_LINK, kind=IncidentKind.LINK, evidence=probes).model_copy(update={"link": "n2"})
    conf = config("PartitionPolicy=gpu Auto=drain,escalate Cooldown=0")
    peers = tuple((NOW - 5, _fabric(0.0)) for _ in range(3))
    drained = decide.plan(link, 0, conf, facts(node_evidence=(NOW - 5, _fabric(9.0)), peer_evidence=peers))
    assert (drained.action.kind, drained.action.mode) == ("drain", "auto")
    [shown] = drained.evidence
    assert (shown.signal, shown.value, shown.peers) == ("fabric.symbol_error", 9.0, 0.0)
    assert "mlx5_0/1" in shown.note and "n2" in shown.note
    from artemisd.control import reconcile
    saved = reconcile.on_plan(link, drained, [], False).incident
    assert [e.signal for e in saved.evidence] == ["probe.p2p_ms", "probe.p2p_ms", "fabric.symbol_error"]
    unresolved = saved.model_copy(update={"state": S.UNRESOLVED})
    again = decide.plan(unresolved, 0, conf, facts(node_evidence=(NOW - 5, _fabric(11.0)), peer_evidence=peers))
    latest = reconcile.on_plan(unresolved, again, [], False).incident
    assert [e.value for e in latest.evidence if e.signal == "fabric.symbol_error"] == [11.0]  # the latest stands
    # The same node sending 60 retransmits/s with a clean receive side: its link is not shown at fault.
    held = decide.plan(link, 0, conf, facts(node_evidence=(NOW - 5, _fabric(0.0)), peer_evidence=peers))
    assert held.action is None or held.action.kind != "drain"
    assert any("retransmits are counted by the senders" in s.why for s in held.walked if s.kind == "drain")
    assert held.evidence == ()
    # A fabric-wide storm (every peer counts as many errors) convicts no one.
    storm = tuple((NOW - 5, _fabric(8.0)) for _ in range(3))
    stormy = decide.plan(link, 0, conf, facts(node_evidence=(NOW - 5, _fabric(9.0)), peer_evidence=storm))
    assert stormy.action is None or stormy.action.kind != "drain"
