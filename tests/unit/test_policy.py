"""Policy: ladders, modes, corroboration and budgets, on plain values."""

from __future__ import annotations

import pytest

from artemisd import policy
from artemisd.config import PartitionPolicy, parse_config_text
from artemisd.incident import Cause, Evidence, Incident, IncidentKind
from artemisd.slurm.api import NodeInfo

GPU = PartitionPolicy(name="gpu", auto=("rebalance", "drain", "escalate"), approve=("requeue",))


def incident(cause: Cause, evidence: list[Evidence] | None = None) -> Incident:
    return Incident(id="INC-1", job="7", kind=IncidentKind.RANK, rank=2, node="n2", cause=cause,
                    evidence=evidence or [])


def test_ladders_fall_back_to_more_disruptive_then_to_a_person():
    assert policy.ladder("correct") == ("correct", "drain", "escalate")
    assert policy.ladder("rebalance") == ("rebalance", "escalate")
    assert policy.ladder(None) == ("escalate",)


def test_first_matching_partition_policy_wins():
    config = parse_config_text("PartitionPolicy=gpu* Auto=drain\nPartitionPolicy=gpu-big Auto=rebalance\n"
                               "PartitionPolicy=DEFAULT Auto=escalate\n")
    assert config.policy_for("gpu-big").name == "gpu*"
    assert config.policy_for("cpu").name == "DEFAULT"
    assert config.policy_for(None).name == "DEFAULT"
    assert parse_config_text("").policy_for("x").name == "DEFAULT"


@pytest.mark.parametrize("kind,mode", [("drain", "auto"), ("requeue", "approve"), ("correct", "recommend")])
def test_modes_follow_the_lists(kind, mode):
    assert policy.decide(kind, GPU, target="n2").mode == mode


def test_hard_action_without_corroboration_is_only_recommended():
    d = policy.decide("drain", GPU, target="n2", corroboration=(False, "no root-side node event from n2"))
    assert d.mode == "recommend" and "root-side" in d.why
    assert policy.decide("rebalance", GPU, target="7:2", corroboration=(False, "x")).mode == "auto"


def test_budget_and_cooldown_refuse_with_reasons():
    assert "budget" in policy.decide("drain", GPU, target="n2", budget=(False, "drain budget spent")).why
    assert "cooldown" in policy.decide("drain", GPU, target="n2", cooldown_left=30).why
    assert policy.decide("escalate", GPU, target=None).mode == "auto"
    assert policy.decide("drain", GPU, target=None).mode == "recommend"


@pytest.mark.parametrize("size,held,hour,ok", [
    (20, 1, 0, True), (20, 2, 0, False),  # 0.1 x 20 = 2 nodes: the second is the last
    (20, 0, 2, False), (5, 0, 0, False),  # 0.1 x 5 rounds down to 0: never drain a tiny partition
])
def test_drain_budget(size, held, hour, ok):
    pol = PartitionPolicy(name="p", max_drain_fraction=0.1, max_drains_per_hour=2)
    assert policy.drain_budget(pol, policy.BudgetUse(size, held, hour))[0] is ok


def test_budget_refusals_name_the_budget_and_the_count():
    pol = PartitionPolicy(name="p", max_drain_fraction=0.1, max_drains_per_hour=3)
    ok, why = policy.drain_budget(pol, policy.BudgetUse(40, 0, 3))
    assert not ok and "MaxDrainsPerHour=3 reached: 3 drains in the last hour" in why
    ok, why = policy.drain_budget(pol, policy.BudgetUse(40, 4, 0))
    assert not ok and "MaxDrainFraction=0.1 reached: 4 of 40 nodes" in why and "allows 4" in why


def nodes(n: int, artemis: tuple[int, ...] = (), person: tuple[int, ...] = ()) -> tuple[NodeInfo, ...]:
    def one(i: int) -> NodeInfo:
        if i in artemis:
            return NodeInfo(f"n{i}", frozenset({"IDLE", "DRAIN"}), "artemis: INC-1 gpu.thermal", ("p",))
        if i in person:
            return NodeInfo(f"n{i}", frozenset({"IDLE", "DRAIN"}), "PSU swap", ("p",))
        return NodeInfo(f"n{i}", frozenset({"ALLOCATED"}), "", ("p",))
    return tuple(one(i) for i in range(n))


NOW = 100_000.0


def test_budget_use_counts_waiting_in_flight_done_and_rolled_back_drains_of_the_hour():
    drains = [policy.DrainRecord(1, "n1", "pending_approval", NOW - 7200),  # waiting: counts however old
              policy.DrainRecord(2, "n2", "queued", NOW - 10),
              policy.DrainRecord(3, "n3", "done", NOW - 600),  # Slurm shows n3 drained by us
              policy.DrainRecord(4, "n4", "rolled_back", NOW - 1200),  # undone, but it happened this hour
              policy.DrainRecord(5, "n5", "done", NOW - 3700),  # an hour and more ago
              policy.DrainRecord(6, "n6", "done", NOW - 100),  # a person resumed n6 since
              policy.DrainRecord(7, "x9", "queued", NOW)]  # another partition's node
    use = policy.budget_use(nodes(40, artemis=(3, 5), person=(8,)), drains, NOW)
    # held: n3, n5 (Slurm, artemis: reason) + n1 waiting + n2 in flight; not n6 (resumed), n8 (a person's)
    assert use == policy.BudgetUse(40, 4, 5)  # hour: n1, n2, n3, n4, n6
    approving = policy.budget_use(nodes(40, artemis=(3, 5)), drains, NOW, waiting=False, exclude=1)
    assert approving == policy.BudgetUse(40, 3, 4)


def test_a_person_s_resume_frees_the_fraction_at_once_but_not_the_hourly_rate():
    pol = PartitionPolicy(name="p", max_drain_fraction=0.1, max_drains_per_hour=5)
    drains = [policy.DrainRecord(i, f"n{i}", "done", NOW - 60) for i in range(4)]
    assert not policy.drain_budget(pol, policy.budget_use(nodes(40, artemis=(0, 1, 2, 3)), drains, NOW))[0]
    use = policy.budget_use(nodes(40, artemis=(0, 1, 2)), drains, NOW)  # n3 resumed by a person
    assert use == policy.BudgetUse(40, 3, 4) and policy.drain_budget(pol, use)[0]


@pytest.mark.parametrize("cause,gpu,agrees", [
    (Cause.GPU_THERMAL, {"index": 0, "util_pct": 97, "throttle": ["hw_thermal"]}, True),
    (Cause.GPU_THERMAL, {"index": 0, "util_pct": 97, "throttle": []}, False),
    (Cause.GPU_POWER, {"index": 0, "util_pct": 97, "power_limit_w": 500, "default_power_limit_w": 700}, True),
    (Cause.GPU_CLOCKS, {"index": 0, "util_pct": 97, "sm_clock_mhz": 1200, "max_sm_clock_mhz": 1980}, True),
    (Cause.GPU_CLOCKS, {"index": 0, "util_pct": 97, "sm_clock_mhz": 1950, "max_sm_clock_mhz": 1980}, False),
])
def test_root_side_corroboration_must_show_the_cause(cause, gpu, agrees):
    ok, why = policy.corroborated(incident(cause), {"gpus": [gpu]}, 10.0, 900.0, "root", 0.04)
    assert ok is agrees, why


@pytest.mark.parametrize("gpu,why", [
    # What every idle GPU reports: clocks far below max, reason idle, no utilization.
    ({"index": 0, "util_pct": 0, "sm_clock_mhz": 345, "max_sm_clock_mhz": 1980, "throttle": ["idle"]},
     "throttle reason idle"),
    ({"index": 0, "util_pct": 3, "sm_clock_mhz": 345, "max_sm_clock_mhz": 1980, "throttle": []}, "utilization 3 %"),
    ({"index": 0, "util_pct": 49.9, "sm_clock_mhz": 1200, "max_sm_clock_mhz": 1980}, "utilization 49.9 %"),
    ({"index": 0, "sm_clock_mhz": 345, "max_sm_clock_mhz": 1980, "throttle": []}, "utilization not measured"),
    ({"index": 0, "util_pct": 97, "sm_clock_mhz": 345, "max_sm_clock_mhz": 1980, "throttle": ["idle"]},
     "throttle reason idle"),
])
def test_idle_readings_never_corroborate(gpu, why):
    ok, text = policy.corroborated(incident(Cause.GPU_CLOCKS), {"gpus": [gpu]}, 10.0, 900.0, "root", 0.04)
    assert not ok and "under load" in text and why in text, text
    hot_idle = dict(gpu, throttle=[*gpu.get("throttle", []), "hw_thermal"])
    assert not policy.corroborated(incident(Cause.GPU_THERMAL), {"gpus": [hot_idle]}, 10.0, 900.0, "root", 0.04)[0]


def test_the_rank_s_own_gpu_must_show_it_under_load():
    event = {"gpus": [{"index": 0, "util_pct": 0, "sm_clock_mhz": 300, "max_sm_clock_mhz": 1980, "throttle": ["idle"]},
                      {"index": 1, "util_pct": 96, "sm_clock_mhz": 1300, "max_sm_clock_mhz": 1980}]}
    assert policy.corroborated(incident(Cause.GPU_CLOCKS), event, 1.0, 900.0, "root", 0.04, gpu=1)[0]
    assert not policy.corroborated(incident(Cause.GPU_CLOCKS), event, 1.0, 900.0, "root", 0.04, gpu=0)[0]


def test_evidence_age_is_since_it_was_measured_or_received_whichever_is_older():
    assert policy.evidence_age(1000.0, {"time": 400.0}, 1100.0) == 700.0  # sent late: measured long ago
    assert policy.evidence_age(1000.0, {"time": 1050.0}, 1100.0) == 100.0  # a node clock ahead: receipt
    assert policy.evidence_age(1000.0, {}, 1100.0) == 100.0
    event = {"time": 100.0, "gpus": [{"index": 0, "util_pct": 97, "throttle": ["hw_thermal"]}]}
    ok, why = policy.corroborated(incident(Cause.GPU_THERMAL), event, policy.evidence_age(1000.0, event, 1001.0),
                                  900.0, "root", 0.04)
    assert not ok and "901 s old (EvidenceMaxAge=900)" in why


def test_stale_or_missing_root_evidence_does_not_count():
    event = {"gpus": [{"index": 0, "util_pct": 97, "throttle": ["hw_thermal"]}]}
    assert not policy.corroborated(incident(Cause.GPU_THERMAL), event, 1000.0, 900.0, "root", 0.04)[0]
    ok, why = policy.corroborated(incident(Cause.GPU_THERMAL), None, None, 900.0, "root", 0.04)
    assert not ok and "no root-side" in why


def test_probe_counts_only_when_the_site_trusts_it():
    ev = [Evidence(signal="probe.gemm_ms", value=13.0, peers=10.0)]
    assert not policy.corroborated(incident(Cause.GPU_CLOCKS, ev), None, None, 900.0, "root", 0.04)[0]
    assert policy.corroborated(incident(Cause.GPU_CLOCKS, ev), None, None, 900.0, "root_or_probe", 0.04)[0]
    normal = [Evidence(signal="probe.gemm_ms", value=10.1, peers=10.0)]
    assert not policy.corroborated(incident(Cause.GPU_CLOCKS, normal), None, None, 900.0, "root_or_probe", 0.04)[0]


def _p2p(node, value=30.0):
    return Evidence(signal="probe.p2p_ms", value=value, peers=5.0,
                    note=f"ring transfers touching {node} are {value / 5.0:.1f}x slower than the others: its link")


def test_link_needs_two_agreeing_probes_and_root_side_trouble_and_software_causes_are_never_drained():
    one = Incident(id="INC-2", job="7", kind=IncidentKind.LINK, node="n3", link="n3", cause=Cause.COMM_LINK,
                   evidence=[_p2p("n3")])
    trouble = {"fabric": {"interval_s": 60.0, "ports": [
        {"name": "mlx5_0/1", "kind": "ib", "state": "ACTIVE", "rate_gbps": 200.0, "per_s": {"symbol_error": 4.0}}]}}
    # One probe: not enough.
    ok, why = policy.corroborated(one, trouble, 1.0, 900.0, "root", 0.04)
    assert not ok and "two matched probes" in why
    two = one.model_copy(update={"evidence": [_p2p("n3"), _p2p("n3", 28.0)]})
    ok, why = policy.corroborated(two, trouble, 1.0, 900.0, "root", 0.04)
    assert ok and "mlx5_0/1 symbol_error 4/s" in why
    # Retransmits alone are counted by every sender to a slow link: never the node's link at fault.
    retransmits = {"host": {"net_retransmits_per_s": 80.0}}
    ok, why = policy.corroborated(two, retransmits, 1.0, 900.0, "root", 0.04)
    assert not ok and "80 TCP retransmits/s" in why and "senders" in why
    assert not policy.corroborated(two, {"host": {"net_retransmits_per_s": 0.0}}, 1.0, 900.0, "root", 0.04)[0]
    # Errors the peers count as much (a fabric-wide storm) are no evidence against this node's link.
    storm = [{"fabric": {"ports": [{"name": "mlx5_0/1", "kind": "ib", "state": "ACTIVE", "per_s": {"symbol_error": 3.5}}]}}]
    assert not policy.corroborated(two, trouble, 1.0, 900.0, "root", 0.04, peers=storm * 3)[0]
    assert policy.corroborated(two, None, None, 900.0, "root_or_probe", 0.04)[0]
    split = one.model_copy(update={"evidence": [_p2p("n3"), _p2p("n3"), _p2p("n1")]})
    ok, why = policy.corroborated(split, trouble, 1.0, 900.0, "root_or_probe", 0.04)
    assert not ok and "another link" in why and "n1" in why
    # An earlier probe (taken before the fault, say) that named another node is outvoted
    # by the latest two in a row.
    outvoted = one.model_copy(update={"evidence": [_p2p("n1"), _p2p("n3"), _p2p("n3")]})
    assert policy.corroborated(outvoted, None, None, 900.0, "root_or_probe", 0.04)[0]
    # A link incident that carries only its link acts on the node whose link it is.
    only_link = two.model_copy(update={"node": None})
    assert policy.corroborated(only_link, None, None, 900.0, "root_or_probe", 0.04)[0]
    ok, why = policy.corroborated(incident(Cause.INPUT_LOADER), {"gpus": []}, 1.0, 900.0, "root", 0.04)
    assert not ok and "not a hardware fault" in why
