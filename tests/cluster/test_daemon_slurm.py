"""The daemon's Slurm side against the real slurmctld/slurmd/slurmdbd.

Part 1 drives the CLI backend and the actuator directly (drain visible in
``sinfo -R``, a person's drain untouched, requeue with ExcNodeList, AdminComment
in sacct).  Part 2 runs the whole daemon in-process on synthetic window
reports for a real running job: root-side evidence → drain + requeue through
Slurm, and the storm budget holding on the real partition.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from artemisd.act import Actuator
from artemisd.auth import TRUSTED_LOCAL
from artemisd.config import parse_config_text
from artemisd.service import Daemon
from artemisd.slurm.api import SlurmError
from artemisd.slurm.cli import CliSlurm
from artemisd.wire import parse_record
from tests.unit.windows import lockstep

from .procs import wait_until
from .slurm import SlurmCluster

pytestmark = pytest.mark.cluster

SLEEPER = "#!/bin/sh\nsleep 600\n"


def backend(cluster: SlurmCluster) -> CliSlurm:
    return CliSlurm(timeout=30, env=cluster.env)


def submit(cluster: SlurmCluster, *args: str) -> str:
    out = cluster.dir / "jobs" / "sleep-%j.out"
    job = cluster.sbatch(SLEEPER, "-o", str(out), *args)
    cluster.wait_job(job, ("RUNNING",), timeout_s=120)
    return job


def job_nodes(cluster: SlurmCluster, job: str) -> list[str]:
    return CliSlurm(env=cluster.env).job(job).nodes


def test_backend_reads_nodes_jobs_and_partitions(clean_cluster: SlurmCluster):
    slurm = backend(clean_cluster)
    assert [n.name for n in slurm.partition_nodes("main")] == clean_cluster.node_names
    node = slurm.node("n1")
    assert not node.drained and node.partitions == ("main",)
    job = submit(clean_cluster, "-N", "1", "--requeue")
    info = slurm.job(job)
    assert info.user_id == 0 and info.running and info.batch and info.requeue and info.partition == "main"
    assert info.tasks == 1 and info.cpus == 1 and info.max_world == 1
    assert slurm.job("999999") is None
    # A job without a time limit (MaxTime=INFINITE here) is no limit, not the year Slurm gives it as its end.
    assert info.unlimited and info.time_left(time.time()) is None
    timed = slurm.job(submit(clean_cluster, "-N", "1", "--time=30"))
    assert not timed.unlimited and 0 < timed.time_left(time.time()) <= 1800


def test_drain_shows_in_sinfo_and_a_person_s_drain_is_untouched(clean_cluster: SlurmCluster):
    act = Actuator(backend(clean_cluster))
    reason = "artemis: INC-17 gpu.clocks rank 2 1.19x"
    assert act.drain("n2", reason).status == "done"
    assert clean_cluster.drain_reasons()["n2"] == reason
    assert act.drain("n2", reason).status == "done"  # idempotent
    clean_cluster.scontrol("update", "NodeName=n3", "State=DRAIN", "Reason=PSU swap (ops ticket 88)")
    out = act.drain("n3", "artemis: INC-18 gpu.thermal")
    assert out.status == "skipped"
    assert act.undrain("n3", "INC-18").status == "skipped"
    assert clean_cluster.drain_reasons()["n3"] == "PSU swap (ops ticket 88)"
    assert act.undrain("n2", "INC-99").status == "skipped"  # not the incident that drained it
    assert act.undrain("n2", "INC-17").status == "done"
    assert "n2" not in clean_cluster.drain_reasons()


def test_requeue_excluding_the_node(clean_cluster: SlurmCluster):
    slurm = backend(clean_cluster)
    job = submit(clean_cluster, "-N", "1", "--requeue", "--exclude=n4")
    [node] = job_nodes(clean_cluster, job)
    out = requeue_retrying(Actuator(slurm), job, node)
    assert out.status == "done", out.detail
    info = slurm.job(job)
    assert set(info.excluded_nodes) == {"n4", node}  # merged, not replaced
    assert not info.held
    assert clean_cluster.job(job)["Restarts"] == "1"
    # Released and started again at once (no ~20 min BeginTime), somewhere else.
    clean_cluster.wait_job(job, ("RUNNING",), timeout_s=120)
    assert node not in job_nodes(clean_cluster, job)
    assert Actuator(slurm).requeue_excluding(job, node).status in ("done",)  # no second requeue
    assert clean_cluster.job(job)["Restarts"] in ("1", "2")


def requeue_retrying(act: Actuator, job: str, node: str, attempts: int = 6):
    """As the daemon does: a job still COMPLETING after requeuehold is a transient error, retried."""
    for attempt in range(attempts):
        try:
            return act.requeue_excluding(job, node)
        except SlurmError as err:
            if not err.transient or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def test_not_requeueable_job_is_refused(clean_cluster: SlurmCluster):
    job = submit(clean_cluster, "-N", "1", "--no-requeue")
    [node] = job_nodes(clean_cluster, job)
    out = Actuator(backend(clean_cluster)).requeue_excluding(job, node)
    assert out.status == "failed" and "requeueable" in out.detail
    assert clean_cluster.job_state(job) == "RUNNING"


def test_admin_comment_reaches_sacct_for_running_and_finished_jobs(clean_cluster: SlurmCluster):
    act = Actuator(backend(clean_cluster))
    running = submit(clean_cluster, "-N", "1")
    assert act.comment(running, "INC-21", "artemis: INC-21 gpu.power rank 0: needs a person").status == "done"
    clean_cluster.cmd("scancel", running)
    clean_cluster.wait_job(running, timeout_s=60)

    finished = clean_cluster.sbatch("#!/bin/sh\ntrue\n", "-o", "/dev/null")
    clean_cluster.wait_job(finished, timeout_s=60)

    def sacct_comment(job: str) -> str:
        return clean_cluster.cmd("sacct", "-n", "-X", "-P", "-j", job, "-o", "AdminComment").stdout.strip()

    wait_until(lambda: "INC-21" in sacct_comment(running), "AdminComment of the running job in sacct",
               timeout_s=30, interval_s=0.5)
    wait_until(lambda: backend(clean_cluster).job(finished) is not None and
               backend(clean_cluster).job(finished).finished, "finished job visible", timeout_s=30)
    assert act.comment(finished, "INC-22", "artemis: INC-22 comm.link node n2: needs a person").status == "done"
    # sacctmgr 22.05 stores it lowercased.
    wait_until(lambda: "inc-22" in sacct_comment(finished).lower(), "AdminComment of the finished job in sacct",
               timeout_s=30, interval_s=0.5)


def _windows(job: str, nodes: list[str], seqs: range, slow: bool) -> list:
    busy = [62.0 if (slow and r == 2) else 50.0 for r in range(len(nodes))]
    gpu = {2: {"temp_c": 93, "throttle": ["hw_thermal"]}} if slow else None
    return [r for seq in seqs for r in lockstep(seq, busy, job=job, nodes=nodes, gpu=gpu)]


def _feed(daemon: Daemon, records: list, per_window: int) -> None:
    for i in range(0, len(records), per_window):
        chunk = records[i:i + per_window]
        daemon.accept(list(enumerate(chunk)), TRUSTED_LOCAL, {})
        daemon.clock_offset += 10
        asyncio.run(daemon.run_once())


class _Clock:
    def __init__(self, daemon_ref: list):
        self.ref = daemon_ref

    def __call__(self) -> float:
        import time
        return time.time() + (self.ref[0].clock_offset if self.ref else 0.0)


def make_daemon(cluster: SlurmCluster, tmp: Path, conf: str) -> Daemon:
    ref: list = []
    config = parse_config_text(f"StateDir={tmp}\nAuthType=none\nVerifyWindows=2\n{conf}")
    daemon = Daemon(config, backend(cluster), clock=_Clock(ref))
    daemon.clock_offset = 0.0
    ref.append(daemon)
    return daemon


def test_daemon_drains_and_requeues_a_real_job_on_root_evidence(clean_cluster: SlurmCluster, tmp_path):
    job = submit(clean_cluster, "-N", "2", "--requeue")
    nodes = job_nodes(clean_cluster, job)
    ranks = [nodes[r // 2] for r in range(4)]  # rank 2 on the second node
    daemon = make_daemon(clean_cluster, tmp_path,
                         "PartitionPolicy=main Auto=drain,requeue,escalate MaxDrainFraction=0.5\n")
    try:
        _feed(daemon, _windows(job, ranks, range(0, 8), slow=False), 4)
        event = {"type": "node", "v": 1, "event": "health", "node": nodes[1], "time": 0.0,
                 "gpus": [{"index": 0, "util_pct": 97, "temp_c": 93, "throttle": ["hw_thermal"]}]}
        daemon.accept([(0, parse_record(event))], TRUSTED_LOCAL, {})
        _feed(daemon, _windows(job, ranks, range(8, 12), slow=True), 4)
        [inc] = [i.body for i in daemon.store.incidents()]
        assert inc["cause"] == "gpu.thermal" and inc["action"]["kind"] == "drain", inc
        reason = clean_cluster.drain_reasons()[nodes[1]]
        assert reason.startswith(f"artemis: {inc['id']} gpu.thermal rank 2")
        info = backend(clean_cluster).job(job)
        assert nodes[1] in info.excluded_nodes
        audit = [a["what"] for a in daemon.store.audit_log(inc["id"])]
        assert any(w.startswith("requeue") for w in audit), audit
    finally:
        daemon.store.close()


def test_storm_budget_holds_on_the_real_partition(clean_cluster: SlurmCluster, tmp_path):
    """Every node reports a hot GPU at once; MaxDrainFraction=0.25 of 4 nodes allows one drain."""
    jobs = [submit(clean_cluster, "-N", "1", "-w", name, "--requeue") for name in clean_cluster.node_names]
    daemon = make_daemon(clean_cluster, tmp_path,
                         "PartitionPolicy=main Auto=drain,escalate MaxDrainFraction=0.25 MaxDrainsPerHour=10\n")
    try:
        for name in clean_cluster.node_names:
            event = {"type": "node", "v": 1, "event": "health", "node": name, "time": 0.0,
                     "gpus": [{"index": 0, "util_pct": 97, "throttle": ["hw_thermal"]}]}
            daemon.accept([(0, parse_record(event))], TRUSTED_LOCAL, {})
        records = []
        for seq in range(12):
            for job, name in zip(jobs, clean_cluster.node_names):
                busy = [50.0, 50.0, 64.0, 50.0] if seq >= 8 else [50.0] * 4
                gpu = {2: {"throttle": ["hw_thermal"], "temp_c": 95}} if seq >= 8 else None
                records += lockstep(seq, busy, job=job, nodes=[name] * 4, gpu=gpu)
        _feed(daemon, records, 16)
        asyncio.run(daemon.run_once())
        drained = [n for n, r in clean_cluster.drain_reasons().items() if r.startswith("artemis:")]
        assert len(drained) == 1
        kinds = sorted(i.body["action"]["kind"] for i in daemon.store.incidents())
        assert kinds == ["drain", "escalate", "escalate", "escalate"]
        notes = [a["why"] for a in daemon.store.audit_log() if "budget" in a["why"]]
        assert len(notes) == 3 and all("MaxDrainFraction=0.25" in n for n in notes)
        assert json.dumps(notes)
    finally:
        daemon.store.close()
