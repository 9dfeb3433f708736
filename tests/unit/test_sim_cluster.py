"""SimSlurm: the simulated Slurm the closed loop acts on behaves as design.md §5 says Slurm does.

The actuator here is the daemon's own (``act.Actuator``); what it may and may
not do to a node (NHC manners) is checked against the simulated controller's
state and its event log.
"""

from __future__ import annotations

import pytest

from artemisd.act import Actuator
from artemisd.slurm.api import SlurmBackend, SlurmError
from artemisd.sim.cluster import SimSlurm


def cluster(nodes: int = 4, **kw) -> SimSlurm:
    slurm = SimSlurm(start=1000.0, **kw)
    for i in range(nodes):
        slurm.add_node(f"n{i}", "gpu", gpus=4, features=("healthy",) if i != 1 else ())
    return slurm


def states(slurm: SimSlurm, node: str) -> set[str]:
    return set(slurm.node(node).states)


def test_it_is_a_slurm_backend():
    slurm: SlurmBackend = cluster()  # the protocol, checked by the type checker and here by use
    assert [n.name for n in slurm.partition_nodes("gpu")] == ["n0", "n1", "n2", "n3"]
    assert slurm.partition_nodes("other") == ()
    assert slurm.job("nope") is None
    with pytest.raises(SlurmError) as err:
        slurm.node("n9")
    assert not err.value.transient


def test_node_states_follow_the_gpus_running_jobs_hold():
    slurm = cluster()
    slurm.add_job("7", ["n0", "n1"], "gpu")
    slurm.add_job("8", ["n2"], "gpu", gpus_per_node=2)
    assert states(slurm, "n0") == {"ALLOCATED"} and states(slurm, "n2") == {"MIXED"}
    assert states(slurm, "n3") == {"IDLE"}
    slurm.end_job("7")
    assert states(slurm, "n0") == {"IDLE"}
    assert slurm.job("7").state == "COMPLETED" and slurm.job("7").finished


def test_a_drain_keeps_new_jobs_off_and_leaves_the_running_job_alone():
    slurm = cluster()
    slurm.add_job("7", ["n0", "n1"], "gpu")
    slurm.drain("n1", "artemis: INC-1 gpu.thermal rank 5 1.25x")
    info = slurm.node("n1")
    assert info.states == {"ALLOCATED", "DRAIN"} and info.drained_by_artemis and not info.drained_by_person
    assert slurm.job("7").running and slurm.job("7").nodes == ("n0", "n1")
    with pytest.raises(ValueError, match="drained"):
        slurm.add_job("8", ["n1"], "gpu")
    slurm.add_job("9", 1, "gpu")  # Slurm picks: not the drained node
    assert slurm.job("9").nodes == ("n2",)


def test_the_artemis_prefix_decides_whose_drain_it_is():
    slurm = cluster()
    slurm.person_drain("n2", "bad fan, ticket 4411")
    assert slurm.node("n2").drained_by_person and not slurm.node("n2").drained_by_artemis
    slurm.drain("n3", "artemis: INC-2 gpu.clocks")
    assert slurm.node("n3").drained_by_artemis


def test_the_actuator_never_touches_a_node_a_person_drained():
    slurm = cluster()
    act = Actuator(slurm)
    slurm.person_drain("n2", "bad fan, ticket 4411")
    assert act.drain("n2", "artemis: INC-1 gpu.thermal").status == "skipped"
    assert act.undrain("n2", "INC-1").status == "skipped"
    assert slurm.node("n2").reason == "bad fan, ticket 4411" and slurm.node("n2").drained
    assert [e for e in slurm.events() if e.who == "artemis" and e.target == "n2"] == []
    # Ours: undone only for the incident its reason names.
    act.drain("n3", "artemis: INC-7 gpu.clocks")
    assert act.undrain("n3", "INC-8").status == "skipped" and slurm.node("n3").drained
    assert act.undrain("n3", "INC-7").status == "done" and not slurm.node("n3").drained


def test_a_person_resume_frees_the_node_whoever_drained_it():
    slurm = cluster()
    slurm.drain("n1", "artemis: INC-1 gpu.thermal")
    slurm.person_resume("n1")
    assert not slurm.node("n1").drained and slurm.node("n1").reason == ""
    assert [(e.who, e.what) for e in slurm.events()] == [("artemis", "drain"), ("person", "resume")]


def test_requeue_excluding_holds_merges_the_exclusion_releases_and_the_scheduler_starts_it_elsewhere():
    slurm = cluster()
    slurm.add_job("7", ["n0", "n1"], "gpu")
    slurm.add_job("8", ["n3"], "gpu")
    # An exclusion set at submission stays (the actuator reads, merges, writes).
    slurm.requeue_hold("8")
    slurm.set_excluded_nodes("8", ("n9x",))
    slurm.release("8")
    slurm.advance_to(1001.0)
    assert slurm.job("8").running
    act = Actuator(slurm)
    assert act.drain("n1", "artemis: INC-1 gpu.thermal").status == "done"
    out = act.requeue_excluding("7", "n1")
    assert out.status == "done", out
    job = slurm.job("7")
    assert (job.state, job.held, job.nodes, job.excluded_nodes) == ("PENDING", False, (), ("n1",))
    assert states(slurm, "n0") == {"IDLE"} and states(slurm, "n1") == {"IDLE", "DRAIN"}
    # Released: started by the next scheduling pass, where it ran before less the excluded node.
    slurm.advance_to(1010.0)
    job = slurm.job("7")
    assert job.running and job.nodes == ("n0", "n2") and slurm.restarts("7") == 1
    assert act.requeue_excluding("7", "n1").status == "done"  # again: already excluded, requeued once more
    assert "n1" not in slurm.job("7").nodes
    whats = [e.what for e in slurm.events() if e.target == "7"]
    assert whats[:6] == ["start", "requeuehold", "exclude", "release", "restart 1", "requeuehold"]


def test_exclusions_and_features_change_only_while_pending():
    slurm = cluster()
    slurm.add_job("7", ["n0"], "gpu")
    for write in (lambda: slurm.set_excluded_nodes("7", ("n1",)), lambda: slurm.set_features("7", "healthy")):
        with pytest.raises(SlurmError, match="no longer pending") as err:
            write()
        assert not err.value.transient
    assert Actuator(slurm).constrain("7", "healthy").status == "failed"


def test_a_constraint_written_after_the_release_narrows_where_the_job_starts():
    slurm = cluster()
    slurm.add_job("7", ["n0", "n1"], "gpu")
    act = Actuator(slurm)
    act.drain("n0", "artemis: INC-1 gpu.thermal")
    assert act.requeue_excluding("7", "n0").status == "done"
    assert act.constrain("7", "healthy").status == "done"
    slurm.advance_to(1001.0)
    # n1 (where it ran) lacks the feature; n2 and n3 have it.
    assert slurm.job("7").nodes == ("n2", "n3") and slurm.job("7").features == "healthy"


def test_a_requeued_job_waits_while_too_few_nodes_are_usable():
    slurm = cluster(nodes=3)
    slurm.add_job("7", ["n0", "n1"], "gpu")
    slurm.person_drain("n2", "maintenance")
    act = Actuator(slurm)
    act.drain("n1", "artemis: INC-1 gpu.thermal")
    act.requeue_excluding("7", "n1")
    slurm.advance_to(1100.0)
    assert slurm.job("7").pending
    slurm.person_resume("n2")
    assert slurm.job("7").running and slurm.job("7").nodes == ("n0", "n2")


def test_a_job_that_is_not_requeueable_is_refused_and_the_actuator_says_so():
    slurm = cluster()
    slurm.add_job("7", ["n0"], "gpu", requeue=False)
    with pytest.raises(SlurmError) as err:
        slurm.requeue_hold("7")
    assert not err.value.transient
    out = Actuator(slurm).requeue_excluding("7", "n0")
    assert out.status == "failed" and "not a requeueable batch job" in out.detail
    slurm.end_job("7")
    with pytest.raises(SlurmError, match="completed"):
        slurm.requeue_hold("7")


def test_time_limits_end_jobs_and_say_how_long_is_left():
    slurm = cluster()
    slurm.add_job("7", ["n0"], "gpu", time_limit_s=3600.0)
    slurm.advance_to(1000.0 + 600.0)
    assert slurm.time_left_s("7") == 3000.0 and slurm.job("7").time_left(slurm.clock()) == 3000.0
    slurm.advance_to(1000.0 + 3600.0)
    assert slurm.job("7").state == "TIMEOUT" and slurm.time_left_s("7") is None
    assert states(slurm, "n0") == {"IDLE"}


def test_the_clock_only_moves_forward_and_the_event_log_is_bounded():
    slurm = cluster(log_size=3)
    slurm.advance_to(2000.0)
    slurm.advance_to(1500.0)
    assert slurm.clock() == 2000.0
    for node in ("n0", "n1", "n2", "n3"):
        slurm.person_drain(node, "x")
    assert [e.target for e in slurm.events()] == ["n1", "n2", "n3"] and slurm.logged == 4
    assert str(slurm.events()[0]) == "2000.0 person: drain n1 (x)"


def test_a_finished_jobs_admin_comment_is_stored_lower_case_as_sacctmgr_does():
    slurm = cluster()
    slurm.add_job("7", ["n0"], "gpu")
    slurm.set_admin_comment("7", "artemis: INC-1 Needs A Person", finished=False)
    assert slurm.job("7").admin_comment == "artemis: INC-1 Needs A Person"
    slurm.end_job("7")
    slurm.set_admin_comment("7", "artemis: INC-1 Needs A Person", finished=True)
    assert slurm.job("7").admin_comment == "artemis: inc-1 needs a person"


def test_feature_expressions():
    slurm = cluster()
    slurm.add_job("7", 1, "gpu", features="(healthy|fast)&healthy")
    assert slurm.job("7").nodes == ("n0",)
    slurm.add_job("8", 1, "gpu", features="fast")
    assert slurm.job("8").pending  # no node has it
    slurm.end_job("8")
    slurm.add_job("9", ["n2"], "gpu")
    slurm.requeue_hold("9")
    with pytest.raises(SlurmError, match="Invalid feature"):
        slurm.set_features("9", "healthy&")


def test_it_is_deterministic():
    def run() -> list[str]:
        slurm = cluster()
        act = Actuator(slurm)
        slurm.add_job("7", 2, "gpu")
        slurm.add_job("8", 2, "gpu")
        act.drain("n1", "artemis: INC-1 gpu.thermal")
        act.requeue_excluding("7", "n1")
        slurm.end_job("8")
        slurm.advance_to(1100.0)
        return [str(e) for e in slurm.events()] + [repr(slurm.jobs()), repr(slurm.nodes())]

    assert run() == run()
