"""The closed loop (artemisd/sim/loop.py): the daemon's decisions and actuator over a SimSlurm, with numbers.

Incidents are written by hand (what the analysis would confirm), the
throughput windows verification judges are built from numbers, and the
cluster is a ``SimSlurm``: every assertion about a node or a job reads the
simulated controller, not the loop's own bookkeeping.
"""

from __future__ import annotations

import pytest

from artemisd.act import Outcome
from artemisd.config import parse_config_text
from artemisd.incident import Incident, IncidentState, Recurrence
from artemisd.sim.cluster import SimSlurm
from artemisd.sim.loop import Loop
from artemisd.verify import Evidence, WindowShape

S = IncidentState
T0 = 10_000.0
HEALTHY = 100.0


def conf(policy: str, daemon: str = "") -> object:
    return parse_config_text(f"{daemon}\nPartitionPolicy=gpu {policy}\n")


def cluster(nodes: int = 10) -> SimSlurm:
    slurm = SimSlurm(start=T0)
    for i in range(nodes):
        slurm.add_node(f"n{i}", "gpu", gpus=8)
    return slurm


def incident(n: int, job: str, node: str, cause: str = "gpu.thermal", rank: int = 5) -> Incident:
    return Incident(id=f"INC-{n}", job=job, kind="rank", state="confirmed", rank=rank, node=node, ratio=1.25,
                    excess_ms=100.0, loss_pct=17.0, cause=cause, confidence=0.9, onset_window=10,
                    flagged_window=10, confirmed_window=11)


def root_event(node: str, when: float, throttle: tuple[str, ...] = ("sw_thermal",), clock: int = 1500,
               util: float = 97.0) -> tuple[float, dict]:
    """The node check's reading of GPU 1 on ``node`` (root-side evidence)."""
    return when, {"type": "node", "v": 1, "event": "health", "node": node, "time": when,
                  "gpus": [{"index": 1, "sm_clock_mhz": clock, "max_sm_clock_mhz": 1980, "util_pct": util,
                            "throttle": list(throttle), "power_limit_w": 700, "default_power_limit_w": 700}]}


def windows(*throughputs: float, start: int = 0) -> list[WindowShape]:
    return [WindowShape(start + i, t, 16, 128.0, 50.0) for i, t in enumerate(throughputs)]


def evidence(after: float, action_window: int = 12) -> Evidence:
    """10 healthy windows, the slowdown from window 10, then 5 windows at ``after`` past the action."""
    shapes = windows(*([HEALTHY] * 10 + [83.0] * 3 + [after] * 5))
    return Evidence(HEALTHY, shapes, shapes, False, 10, action_window, T0 + 500)


def observe(loop: Loop, inc: Incident, now: float = T0, **kw) -> None:
    kw = {"gpus": 16, "gpu": 1, **kw}
    loop.observe(inc, now, **kw)


def kinds(loop: Loop, incident_id: str) -> list[tuple[str, str | None, str]]:
    return [(r.kind, r.target, r.status) for r in loop.actions(incident_id)]


def whats(loop: Loop, incident_id: str) -> list[str]:
    return [n.what for n in loop.notes(incident_id)]


# --- the ladder ---------------------------------------------------------------------------------


def test_correct_then_drain_with_requeue_then_a_person():
    slurm = cluster()
    slurm.add_job("7", ["n0", "n1"], "gpu")
    loop = Loop(conf("Auto=correct,drain,requeue,escalate MaxDrainFraction=0.2"), slurm)
    observe(loop, incident(1, "7", "n1", cause="gpu.clocks"),
            node_evidence=root_event("n1", T0, ("hw_slowdown",), clock=1200))
    loop.tick(T0 + 1)
    assert kinds(loop, "INC-1") == [("correct", "n1", "done")]
    assert loop.incident("INC-1").state is S.VERIFYING
    # The clocks did not come back: 83 of 100 samples/s.  A correction is not undone.
    verdict = loop.verify("INC-1", evidence(83.0), T0 + 300)
    assert verdict.state == "unresolved" and verdict.verification.recovered is False
    assert loop.incident("INC-1").state is S.UNRESOLVED
    # Next rung: drain, and its requeue, through the actuator; Slurm shows both.
    loop.tick(T0 + 301)
    assert kinds(loop, "INC-1")[1:] == [("drain", "n1", "done"), ("requeue", "7", "done")]
    node = slurm.node("n1")
    assert node.drained_by_artemis and node.reason == "artemis: INC-1 gpu.clocks rank 5 1.25x"
    job = slurm.job("7")
    assert job.pending and job.excluded_nodes == ("n1",)
    assert loop.incident("INC-1").state is S.VERIFYING
    # Still slow, and the node still shows the fault: the drain is kept, a person is told.
    loop.node_event("n1", T0 + 590, root_event("n1", T0 + 590, ("hw_slowdown",))[1])
    verdict = loop.verify("INC-1", evidence(82.0, action_window=13), T0 + 600)
    assert verdict.state == "unresolved" and not verdict.rollbacks[0].undo
    assert "drain of n1 kept" in whats(loop, "INC-1") and slurm.node("n1").drained
    loop.tick(T0 + 601)
    inc = loop.incident("INC-1")
    assert inc.state is S.ESCALATED and loop.escalations("INC-1") == ["needs a person"]
    assert inc.result.recovered is False and inc.result.throughput_healthy == HEALTHY


def test_a_drain_that_did_not_help_is_undone_when_the_node_no_longer_shows_the_fault():
    slurm = cluster()
    slurm.add_job("7", ["n0", "n1"], "gpu")
    loop = Loop(conf("Auto=drain,requeue,escalate MaxDrainFraction=0.2"), slurm)
    observe(loop, incident(1, "7", "n1"), node_evidence=root_event("n1", T0))
    loop.tick(T0 + 1)
    assert slurm.node("n1").drained_by_artemis
    # The node check, on the drained node, sees nothing wrong any more; throughput did not come back.
    loop.node_event("n1", T0 + 290, root_event("n1", T0 + 290, (), clock=1980)[1])
    verdict = loop.verify("INC-1", evidence(84.0), T0 + 300)
    assert verdict.state == "unresolved" and verdict.rollbacks[0].undo and verdict.rolled_back
    assert not slurm.node("n1").drained
    assert kinds(loop, "INC-1") == [("drain", "n1", "rolled_back"), ("requeue", "7", "done"),
                                    ("undrain", "n1", "done")]
    assert loop.incident("INC-1").action.status == "rolled_back"
    assert [(e.who, e.what, e.target) for e in slurm.events() if e.target == "n1"] == \
        [("artemis", "drain", "n1"), ("artemis", "resume", "n1")]


def test_a_drain_that_helped_is_resolved_and_stays():
    slurm = cluster()
    slurm.add_job("7", ["n0", "n1"], "gpu")
    loop = Loop(conf("Auto=drain,requeue MaxDrainFraction=0.2"), slurm)
    observe(loop, incident(1, "7", "n1"), node_evidence=root_event("n1", T0))
    loop.tick(T0 + 1)
    assert loop.verify("INC-1", evidence(99.0), T0 + 300).state == "resolved"
    inc = loop.incident("INC-1")
    assert inc.state is S.RESOLVED and inc.result.recovered is True and inc.result.throughput_after == 99.0
    assert slurm.node("n1").drained_by_artemis


def test_too_few_windows_decide_nothing_yet():
    slurm = cluster()
    slurm.add_job("7", ["n0", "n1"], "gpu")
    loop = Loop(conf("Auto=drain,requeue MaxDrainFraction=0.2"), slurm)
    observe(loop, incident(1, "7", "n1"), node_evidence=root_event("n1", T0))
    loop.tick(T0 + 1)
    shapes = windows(*([HEALTHY] * 10 + [83.0] * 3 + [99.0] * 2))
    verdict = loop.verify("INC-1", Evidence(HEALTHY, shapes, shapes, False, 10, 12, T0 + 100), T0 + 101)
    assert verdict.state is None and loop.incident("INC-1").state is S.VERIFYING


def test_without_root_side_corroboration_the_drain_is_only_recommended():
    slurm = cluster()
    slurm.add_job("7", ["n0", "n1"], "gpu")
    loop = Loop(conf("Auto=drain,requeue MaxDrainFraction=0.2"), slurm)
    observe(loop, incident(1, "7", "n1"), node_evidence=root_event("n1", T0, util=3.0))
    loop.tick(T0 + 1)
    assert kinds(loop, "INC-1") == [("escalate", "7", "done")]
    assert not slurm.node("n1").drained and loop.budget_refusals == 0
    [note] = [n for n in loop.notes("INC-1") if n.what == "drain n1: recommend"]
    assert "root-side corroboration" in note.why and "utilization 3 %" in note.why


# --- budgets --------------------------------------------------------------------------------------


def two_jobs(slurm: SimSlurm) -> None:
    slurm.add_job("7", ["n0", "n1"], "gpu")
    slurm.add_job("8", ["n2", "n3"], "gpu")


def test_the_drain_fraction_refuses_the_second_drain_and_names_the_budget():
    slurm = cluster(10)
    two_jobs(slurm)
    loop = Loop(conf("Auto=drain,requeue,escalate MaxDrainFraction=0.1 MaxDrainsPerHour=5"), slurm)
    observe(loop, incident(1, "7", "n1"), node_evidence=root_event("n1", T0))
    observe(loop, incident(2, "8", "n3"), node_evidence=root_event("n3", T0))
    loop.tick(T0 + 1)
    assert slurm.node("n1").drained_by_artemis and not slurm.node("n3").drained
    [refusal] = loop.refusals()
    assert (refusal.incident, refusal.kind, refusal.target, refusal.at) == ("INC-2", "drain", "n3", "decide")
    assert refusal.why == ("drain budget: MaxDrainFraction=0.1 reached: 1 of 10 nodes drained or being drained "
                           "by Artemis (allows 1)")
    assert loop.budget_refusals == 1
    assert loop.incident("INC-2").state is S.ESCALATED
    [escalation] = [r for r in loop.actions("INC-2") if r.kind == "escalate"]
    assert "drain budget" in escalation.params["recommended"][0]
    # A person resumes n1: Slurm is the truth, the share is free at once.
    slurm.person_resume("n1")
    observe(loop, incident(3, "8", "n2"), node_evidence=root_event("n2", T0 + 10), now=T0 + 10)
    loop.tick(T0 + 11)
    assert slurm.node("n2").drained_by_artemis and loop.budget_refusals == 1


def test_drains_per_hour_count_every_drain_of_the_last_hour_even_undone():
    slurm = cluster(10)
    two_jobs(slurm)
    slurm.add_job("9", ["n4", "n5"], "gpu")
    loop = Loop(conf("Auto=drain,requeue,escalate MaxDrainFraction=1 MaxDrainsPerHour=1"), slurm)
    observe(loop, incident(1, "7", "n1"), node_evidence=root_event("n1", T0))
    loop.tick(T0 + 1)
    loop.node_event("n1", T0 + 100, root_event("n1", T0 + 100, (), clock=1980)[1])
    loop.verify("INC-1", evidence(84.0), T0 + 120)  # not recovered: n1 is resumed
    assert not slurm.node("n1").drained
    observe(loop, incident(2, "8", "n3"), now=T0 + 200, node_evidence=root_event("n3", T0 + 200))
    loop.tick(T0 + 201)
    assert loop.refusals()[-1].why == "drain budget: MaxDrainsPerHour=1 reached: 1 drain in the last hour"
    # An hour after the first drain the budget has room again.
    observe(loop, incident(3, "9", "n5"), now=T0 + 3602, node_evidence=root_event("n5", T0 + 3602))
    loop.tick(T0 + 3602)
    assert slurm.node("n5").drained_by_artemis


def test_a_person_drained_node_is_left_alone_and_uses_no_budget():
    slurm = cluster(10)
    two_jobs(slurm)
    slurm.person_drain("n1", "bad fan, ticket 4411")
    loop = Loop(conf("Auto=drain,requeue,escalate MaxDrainFraction=0.1"), slurm)
    observe(loop, incident(1, "7", "n1"), node_evidence=root_event("n1", T0))
    loop.tick(T0 + 1)
    # The actuator skips it: the rung did not happen, the next one (a person) is taken.
    assert kinds(loop, "INC-1")[0] == ("drain", "n1", "skipped")
    assert slurm.node("n1").reason == "bad fan, ticket 4411"
    loop.tick(T0 + 2)
    assert loop.incident("INC-1").state is S.ESCALATED
    observe(loop, incident(2, "8", "n3"), node_evidence=root_event("n3", T0 + 3), now=T0 + 3)
    loop.tick(T0 + 3)
    assert slurm.node("n3").drained_by_artemis  # the person's drain took no share of the budget


# --- cooldown ---------------------------------------------------------------------------------------


def test_a_target_another_incident_acted_on_is_in_its_cooldown():
    slurm = cluster()
    slurm.add_job("7", ["n1"], "gpu", gpus_per_node=4)
    slurm.add_job("8", ["n1"], "gpu", gpus_per_node=4)
    loop = Loop(conf("Auto=correct,escalate Approve= Cooldown=15m"), slurm)
    observe(loop, incident(1, "7", "n1", cause="gpu.clocks"))
    loop.tick(T0 + 1)
    observe(loop, incident(2, "8", "n1", cause="gpu.clocks", rank=0), now=T0 + 60)
    loop.tick(T0 + 61)
    assert kinds(loop, "INC-1") == [("correct", "n1", "done")]
    assert kinds(loop, "INC-2") == [("escalate", "8", "done")]
    [note] = [n for n in loop.notes("INC-2") if n.what == "correct n1: recommend"]
    assert note.why == "n1 is in its cooldown for 840 s more"
    # After the cooldown another incident on n1 is corrected.
    slurm.add_job("9", ["n2"], "gpu")
    observe(loop, incident(3, "7", "n1", cause="gpu.clocks", rank=1), now=T0 + 902)
    loop.tick(T0 + 902)
    assert kinds(loop, "INC-3") == [("correct", "n1", "done")]


# --- approvals ------------------------------------------------------------------------------------


def test_an_approval_only_drain_waits_then_runs_with_its_requeue():
    slurm = cluster()
    slurm.add_job("7", ["n0", "n1"], "gpu")
    loop = Loop(conf("Auto=escalate Approve=drain,requeue MaxDrainFraction=0.2"), slurm)
    observe(loop, incident(1, "7", "n1"), node_evidence=root_event("n1", T0))
    loop.tick(T0 + 1)
    inc = loop.incident("INC-1")
    assert inc.state is S.ESCALATED and inc.action.status == "pending_approval"
    assert [(r.kind, r.target) for r in loop.pending_approvals()] == [("drain", "n1")]
    assert loop.escalations("INC-1") == ["drain n1 awaits approval (artemis approve INC-1)"]
    assert not slurm.node("n1").drained
    loop.approve("INC-1", "alice", now=T0 + 120)
    # Approving the rung approves its requeue too.
    assert kinds(loop, "INC-1") == [("drain", "n1", "done"), ("escalate", "7", "done"), ("requeue", "7", "done")]
    assert loop.actions("INC-1")[0].approved_by == "alice" and loop.pending_approvals() == []
    assert slurm.node("n1").drained_by_artemis and slurm.job("7").excluded_nodes == ("n1",)
    assert loop.incident("INC-1").state is S.VERIFYING
    with pytest.raises(ValueError, match="no action waiting"):
        loop.approve("INC-1", "alice", now=T0 + 121)


def test_a_denied_drain_goes_to_the_next_rung():
    slurm = cluster()
    slurm.add_job("7", ["n0", "n1"], "gpu")
    loop = Loop(conf("Auto=escalate Approve=drain,requeue MaxDrainFraction=0.2"), slurm)
    observe(loop, incident(1, "7", "n1"), node_evidence=root_event("n1", T0))
    loop.tick(T0 + 1)
    loop.deny("INC-1", "bob", now=T0 + 50)
    assert loop.incident("INC-1").action.status == "denied"
    loop.tick(T0 + 51)
    assert kinds(loop, "INC-1") == [("drain", "n1", "denied"), ("escalate", "7", "done"), ("escalate", "7", "done")]
    assert loop.escalations("INC-1")[-1] == "needs a person"
    assert "denied drain n1" in whats(loop, "INC-1") and not slurm.node("n1").drained


def test_an_approval_beyond_the_budget_is_refused_and_keeps_waiting():
    slurm = cluster(10)
    two_jobs(slurm)
    loop = Loop(conf("Auto=escalate Approve=drain,requeue MaxDrainFraction=0.2"), slurm)
    observe(loop, incident(1, "7", "n1"), node_evidence=root_event("n1", T0))
    observe(loop, incident(2, "8", "n3"), node_evidence=root_event("n3", T0))
    loop.tick(T0 + 1)
    assert len(loop.pending_approvals()) == 2
    loop.approve("INC-1", "alice", now=T0 + 60)
    # The site lowers the budget (a reload) before the second approval.
    loop.config = conf("Auto=escalate Approve=drain,requeue MaxDrainFraction=0.1")
    with pytest.raises(ValueError, match="approval refused: drain budget: MaxDrainFraction=0.1 reached"):
        loop.approve("INC-2", "alice", now=T0 + 61)
    assert [(r.incident, r.at) for r in loop.refusals()] == [("INC-2", "approve")]
    assert [r.incident for r in loop.pending_approvals()] == ["INC-2"] and not slurm.node("n3").drained


def test_approve_all_gives_every_approval_and_says_so():
    slurm = cluster()
    slurm.add_job("7", ["n0", "n1"], "gpu")
    loop = Loop(conf("Auto=escalate Approve=drain,requeue MaxDrainFraction=0.2"), slurm, approve_all=True)
    observe(loop, incident(1, "7", "n1"), node_evidence=root_event("n1", T0))
    loop.tick(T0 + 1)
    assert kinds(loop, "INC-1") == [("drain", "n1", "done"), ("requeue", "7", "done")]
    assert loop.actions("INC-1")[0].approved_by == "approve-all"
    assert "drain n1: approved automatically" in whats(loop, "INC-1")
    assert loop.incident("INC-1").state is S.VERIFYING


# --- the simulation's side ---------------------------------------------------------------------------


def test_on_action_applies_a_correction_and_may_fail_it():
    slurm = cluster()
    slurm.add_job("7", ["n0", "n1"], "gpu")
    seen = []

    def on_action(kind, target, params, inc):
        seen.append((kind, target, params.get("kind"), inc.id))
        return Outcome("failed", "the clocks could not be reset") if kind == "correct" else None

    loop = Loop(conf("Auto=correct,escalate Approve="), slurm, on_action=on_action)
    observe(loop, incident(1, "7", "n1", cause="gpu.power"))
    loop.tick(T0 + 1)
    assert seen[0] == ("correct", "n1", "restore_power_limit", "INC-1")
    assert kinds(loop, "INC-1")[0] == ("correct", "n1", "failed")
    assert loop.incident("INC-1").state is S.UNRESOLVED
    loop.tick(T0 + 2)
    assert loop.incident("INC-1").state is S.ESCALATED and seen[-1][0] == "escalate"


def test_dry_run_decides_and_changes_nothing():
    slurm = cluster()
    slurm.add_job("7", ["n0", "n1"], "gpu")
    loop = Loop(conf("Auto=drain,requeue MaxDrainFraction=0.2", "DryRun=yes"), slurm)
    observe(loop, incident(1, "7", "n1"), node_evidence=root_event("n1", T0))
    loop.tick(T0 + 1)
    assert loop.incident("INC-1").action.status == "proposed" and loop.actions() == []
    assert [e for e in slurm.events() if e.who == "artemis"] == []


def test_an_unknown_with_no_signal_waits_and_says_why_once():
    slurm = cluster()
    slurm.add_job("7", ["n0", "n1"], "gpu")
    loop = Loop(conf("Auto=escalate"), slurm)
    inc = incident(1, "7", "n1", cause="unknown").model_copy(update={"loss_pct": 5.0})
    observe(loop, inc)
    loop.tick(T0 + 1)
    loop.tick(T0 + 2)
    assert loop.actions() == [] and loop.incident("INC-1").state is S.CONFIRMED
    assert whats(loop, "INC-1").count("not escalated yet") == 1


def test_a_subject_healthy_again_resolves_only_when_throughput_agrees():
    from artemisd.verify import Verification

    slurm = cluster()
    slurm.add_job("7", ["n0", "n1"], "gpu")
    loop = Loop(conf("Auto=escalate"), slurm)
    observe(loop, incident(1, "7", "n1", cause="input.storage"))
    loop.tick(T0 + 1)
    assert not loop.subject_recovered("INC-1", T0 + 10, Verification(True, False, HEALTHY, 80.0, "not back"))
    assert loop.subject_recovered("INC-1", T0 + 20, Verification(True, True, HEALTHY, 99.0, "back"))
    assert loop.incident("INC-1").state is S.RESOLVED
    assert whats(loop, "INC-1")[-2:] == ["subject healthy, job throughput not back", "resolved"]


def test_a_fault_that_comes_back_reopens_its_incident_and_goes_to_a_person_once_it_keeps_coming_back():
    slurm = cluster()
    slurm.add_job("7", ["n0", "n1"], "gpu")
    loop = Loop(conf("Auto=correct,drain,requeue,escalate", "RecurEscalate=2"), slurm)
    first = incident(1, "7", "n1", cause="gpu.clocks")
    observe(loop, first)
    loop.tick(T0 + 1)
    assert loop.verify("INC-1", evidence(99.0), T0 + 300).state == "resolved"
    back = [Recurrence(onset_window=30, confirmed_window=31, ratio=1.3, loss_pct=18.0)]
    observe(loop, first.model_copy(update={"recurrences": back}), now=T0 + 900)
    inc = loop.incident("INC-1")
    assert inc.state is S.CONFIRMED and inc.action is None and inc.result is None
    loop.tick(T0 + 901)  # decided again from the ladder's start: corrected again
    assert [k for k, _, _ in kinds(loop, "INC-1")] == ["correct", "correct"]
    assert loop.verify("INC-1", evidence(99.0), T0 + 1200).state == "resolved"
    back = back + [Recurrence(onset_window=50, confirmed_window=51, ratio=1.3, loss_pct=18.0)]
    observe(loop, first.model_copy(update={"recurrences": back}), now=T0 + 1800)
    loop.tick(T0 + 1801)
    assert loop.incident("INC-1").state is S.ESCALATED
    assert [k for k, _, _ in kinds(loop, "INC-1")] == ["correct", "correct", "escalate"]
    assert whats(loop, "INC-1").count("recurred") == 2 and "escalated: keeps coming back" in whats(loop, "INC-1")
