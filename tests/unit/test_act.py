"""Actuator: NHC manners and idempotence, over an in-memory Slurm model.

``MemorySlurm`` models the parts of Slurm semantics the actuator relies on
(drain reasons, requeuehold → pending+held, ExcNodeList only while pending,
AdminComment).  The same actuator runs against the real slurmctld in
tests/cluster/test_daemon_slurm.py; here the fast cases and the failure
paths (Slurm down) that are awkward to provoke on a real controller.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from artemisd.act import Actuator
from artemisd.decide import drain_reason
from artemisd.slurm.api import JobInfo, NodeInfo, SlurmError


class MemorySlurm:
    def __init__(self, nodes: dict[str, str] | None = None, partition: str = "gpu"):
        self.nodes = {n: NodeInfo(n, frozenset({s.upper()}), "", (partition,)) for n, s in (nodes or {}).items()}
        self.jobs: dict[str, JobInfo] = {}
        self.partition = partition
        self.down = False
        self.fail_writes = False  # slurmctld answers reads but times out on updates
        self.calls: list[tuple] = []

    def _check(self, *call) -> None:
        self.calls.append(call)
        if self.down:
            raise SlurmError("slurm_load_node error: Unable to contact slurm controller (connect failure)")
        if self.fail_writes and call[0] not in ("node", "job", "partition_nodes"):
            raise SlurmError("scontrol update: Socket timed out on send/recv operation")

    def add_job(self, job_id: str, uid: int, nodes: tuple[str, ...], **kw) -> None:
        self.jobs[job_id] = JobInfo(job_id, uid, kw.pop("state", "RUNNING"), self.partition, nodes,
                                    **{"requeue": True, **kw})

    def node(self, name):
        self._check("node", name)
        return self.nodes[name]

    def partition_nodes(self, partition):
        self._check("partition_nodes", partition)
        return tuple(i for i in self.nodes.values() if partition in i.partitions)

    def job(self, job_id):
        self._check("job", job_id)
        return self.jobs.get(job_id)

    def drain(self, node, reason):
        self._check("drain", node, reason)
        info = self.nodes[node]
        self.nodes[node] = replace(info, states=info.states | {"DRAIN"}, reason=reason)

    def resume(self, node):
        self._check("resume", node)
        info = self.nodes[node]
        self.nodes[node] = replace(info, states=info.states - {"DRAIN"}, reason="")

    def requeue_hold(self, job_id):
        self._check("requeue_hold", job_id)
        self.jobs[job_id] = replace(self.jobs[job_id], state="PENDING", held=True, nodes=())

    def release(self, job_id):
        self._check("release", job_id)
        self.jobs[job_id] = replace(self.jobs[job_id], held=False)

    def set_excluded_nodes(self, job_id, nodes):
        self._check("set_excluded_nodes", job_id, nodes)
        if not self.jobs[job_id].pending:
            raise SlurmError("Job is no longer pending execution", transient=False)
        self.jobs[job_id] = replace(self.jobs[job_id], excluded_nodes=tuple(nodes))

    def set_features(self, job_id, features):
        self._check("set_features", job_id, features)
        self.jobs[job_id] = replace(self.jobs[job_id], features=features)

    def set_admin_comment(self, job_id, comment, finished):
        self._check("set_admin_comment", job_id, comment, finished)
        self.jobs[job_id] = replace(self.jobs[job_id], admin_comment=comment)

    def uid_of(self, user):
        return 0 if user == "root" else None


def writes(slurm: MemorySlurm) -> list[str]:
    return [c[0] for c in slurm.calls if c[0] not in ("node", "job", "partition_nodes")]


def test_drain_reason_is_prefixed_and_names_the_incident():
    assert drain_reason("INC-17", "gpu.clocks", 2, 1.19) == "artemis: INC-17 gpu.clocks rank 2 1.19x"
    assert drain_reason("INC-3", "comm.link", None, None) == "artemis: INC-3 comm.link"


def test_drain_is_idempotent():
    slurm = MemorySlurm({"n1": "idle"})
    act = Actuator(slurm)
    assert act.drain("n1", "artemis: INC-1 gpu.thermal").status == "done"
    assert act.drain("n1", "artemis: INC-1 gpu.thermal").status == "done"
    assert writes(slurm) == ["drain"]


def test_a_person_s_drain_is_never_touched():
    slurm = MemorySlurm({"n1": "idle"})
    slurm.drain("n1", "bad fan, ticket 4711")
    slurm.calls.clear()
    act = Actuator(slurm)
    out = act.drain("n1", "artemis: INC-2 gpu.thermal")
    assert out.status == "skipped" and "person" in out.detail
    assert act.undrain("n1", "INC-2").status == "skipped"
    assert writes(slurm) == []
    assert slurm.nodes["n1"].reason == "bad fan, ticket 4711"


def test_undrain_only_our_own_incident():
    slurm = MemorySlurm({"n1": "idle"})
    act = Actuator(slurm)
    act.drain("n1", "artemis: INC-5 comm.link")
    assert act.undrain("n1", "INC-6").status == "skipped"
    assert act.undrain("n1", "INC-5").status == "done"
    assert not slurm.nodes["n1"].drained


def test_requeue_merges_excluded_nodes_and_is_idempotent():
    slurm = MemorySlurm({"n1": "allocated", "n2": "allocated"})
    slurm.add_job("42", 1000, ("n1", "n2"), excluded_nodes=("n9",))
    act = Actuator(slurm)
    assert act.requeue_excluding("42", "n2").status == "done"
    job = slurm.jobs["42"]
    assert job.excluded_nodes == ("n9", "n2") and job.pending and not job.held
    assert act.requeue_excluding("42", "n2").status == "done"
    assert writes(slurm) == ["requeue_hold", "set_excluded_nodes", "release"]


def test_requeue_resumes_after_a_crash_between_hold_and_release():
    slurm = MemorySlurm({"n1": "allocated"})
    slurm.add_job("42", 1000, ("n1",))
    slurm.requeue_hold("42")
    slurm.calls.clear()
    assert Actuator(slurm).requeue_excluding("42", "n1").status == "done"
    assert writes(slurm) == ["set_excluded_nodes", "release"]


@pytest.mark.parametrize("kw", [{"batch": False}, {"requeue": False}])
def test_only_requeueable_batch_jobs_are_requeued(kw):
    slurm = MemorySlurm({"n1": "allocated"})
    slurm.add_job("7", 1000, ("n1",), **kw)
    out = Actuator(slurm).requeue_excluding("7", "n1")
    assert out.status == "failed" and "requeueable" in out.detail
    assert writes(slurm) == []


def test_constrain_needs_a_pending_job_and_merges_features():
    slurm = MemorySlurm({"n1": "allocated"})
    slurm.add_job("7", 1000, ("n1",), features="h100")
    act = Actuator(slurm)
    assert act.constrain("7", "healthy").status == "failed"
    slurm.requeue_hold("7")
    assert act.constrain("7", "healthy").status == "done"
    assert slurm.jobs["7"].features == "h100&healthy"
    assert act.constrain("7", "healthy").status == "done"
    assert writes(slurm).count("set_features") == 1


def test_admin_comment_is_appended_once_per_text():
    slurm = MemorySlurm({"n1": "allocated"})
    slurm.add_job("7", 1000, ("n1",), admin_comment="site note")
    act = Actuator(slurm)
    act.comment("7", "INC-1", "artemis: INC-1 gpu.power rank 0: needs a person")
    act.comment("7", "INC-1", "artemis: INC-1 gpu.power rank 0: needs a person")
    assert slurm.jobs["7"].admin_comment == "site note; artemis: INC-1 gpu.power rank 0: needs a person"


def test_slurm_down_raises_for_the_caller_to_retry():
    slurm = MemorySlurm({"n1": "idle"})
    slurm.down = True
    with pytest.raises(SlurmError) as err:
        Actuator(slurm).drain("n1", "artemis: INC-1 gpu.thermal")
    assert err.value.transient
