"""Issue 9, findings 2 and 3, against the real slurmctld and munged.

One real ``artemisd`` (AuthType=munge, CLI Slurm backend) for the module.
A job owner (``nobody``) cannot get a node outside their job acted on: the
report naming it is refused on its own, and the outside node's idle node check
corroborates nothing.  Budgets come from Slurm: drains waiting for approval
count, ``approve`` re-checks and names the budget, and a person's
``scontrol update State=RESUME`` frees the budget at once.
"""

from __future__ import annotations

import json
import signal
import time
from contextlib import ExitStack, closing

import pytest

from artemisd.server import TICK_S
from tests.unit.windows import lockstep

from . import faults
from .artemis import ArtemisDaemon
from .procs import wait_until
from .slurm import SlurmCluster
from .test_daemon_auth import NOBODY, credential, post

pytestmark = pytest.mark.cluster

POLICY = ("PartitionPolicy=main Auto=escalate Approve=drain,requeue MaxDrainFraction=0.25 "
          "MaxDrainsPerHour=3 Cooldown=0\nJobCacheSeconds=30\n")
IDLE_GPU = {"index": 0, "util_pct": 0, "sm_clock_mhz": 345, "max_sm_clock_mhz": 1980, "throttle": ["idle"]}


@pytest.fixture(scope="module")
def artemisd(slurm_cluster: SlurmCluster):
    ArtemisDaemon(slurm_cluster, POLICY).wipe_state()  # other modules' daemons share the directory
    # The cluster's own node check (every few s) reads these files and reports as root.
    faults.write_healthy_gpus(slurm_cluster)
    with ArtemisDaemon(slurm_cluster, POLICY) as daemon:
        yield daemon


def send(cluster: SlurmCluster, daemon: ArtemisDaemon, items: list[dict], user=None) -> dict:
    body = json.dumps(items).encode()
    status, reply = post(daemon.url, "/v1/reports", body, credential(cluster, body, user))
    assert status == 200, reply
    return reply


def dumped(reports: list) -> list[dict]:
    return [r.model_dump(mode="json", exclude_none=True) for r in reports]


def hostnames(cluster: SlurmCluster, job: str) -> list[str]:
    return cluster.cmd("scontrol", "show", "hostnames", cluster.job(job)["NodeList"]).stdout.split()


def test_a_user_cannot_get_a_node_outside_their_job_acted_on(clean_cluster: SlurmCluster, artemisd):
    job = clean_cluster.sbatch("#!/bin/sh\nsleep 300\n", "-o", "/dev/null", "--chdir=/tmp",
                               f"--uid={NOBODY.pw_uid}", f"--gid={NOBODY.pw_gid}", "-N", "2", "-n", "4")
    try:
        clean_cluster.wait_job(job, ("RUNNING",), timeout_s=60)
        mine = hostnames(clean_cluster, job)
        [outside, *_] = [n for n in clean_cluster.node_names if n not in mine]
        ranks = [mine[0], mine[0], mine[1], outside]
        allocation = clean_cluster.job(job)["NodeList"]
        # The outside node's own root-side node check: healthy, idle (what every idle GPU says).
        event = {"type": "node", "v": 1, "event": "health", "node": outside, "time": 0.0, "gpus": [IDLE_GPU]}
        assert send(clean_cluster, artemisd, [event])["accepted"] == 1
        for seq in range(12):
            busy = [50.0, 50.0, 50.0, 62.0 if seq >= 8 else 50.0]
            gpu = {3: {"sm_clock_mhz": 1300, "throttle": []}} if seq >= 8 else None
            reply = send(clean_cluster, artemisd, dumped(lockstep(seq, busy, job=job, nodes=ranks, gpu=gpu)),
                         NOBODY)
            assert reply["accepted"] == 3, reply
            assert reply["rejected"] == [{"index": 3, "error": f"node: {outside} is not in job {job}'s "
                                                                f"allocation {allocation}"}]
        big = dumped(lockstep(12, [50.0] * 4, job=job, nodes=ranks[:3] + [mine[1]]))
        big[0]["world"] = 1000  # within MaxWorld: beyond it is refused before Slurm is asked
        reply = send(clean_cluster, artemisd, big, NOBODY)
        assert reply["accepted"] == 3 and reply["rejected"] == [
            {"index": 0, "error": f"world: 1000 is more ranks than job {job} can run (4 tasks, 4 CPUs in Slurm)"}]
        time.sleep(3 * TICK_S)  # a few loop turns: nothing about the outside node, in Artemis or in Slurm
        assert not [i for i in artemisd.incidents(everything=True) if i.get("node") == outside]
        assert state(artemisd, "SELECT COUNT(*) FROM corrections WHERE node = ?", outside) == 0
        assert state(artemisd, USER_REPORTS_NAMING_NODE, outside) == 0
        assert outside not in clean_cluster.drain_reasons()
    finally:
        clean_cluster.cmd("scancel", job, check=False)
        clean_cluster.wait_job(job, timeout_s=60)


# A batch row (``items`` > 0) holds the reports of several ranks, of several nodes, under one row: the
# reports inside every row the job's owner sent are what must not name the node.
USER_REPORTS_NAMING_NODE = (
    "SELECT COUNT(*) FROM records AS s, json_each(CASE WHEN s.items > 0 THEN s.body ELSE json_array(json(s.body)) "
    "END) AS r WHERE s.root = 0 AND json_extract(r.value, '$.node') = ?")


def state(daemon: ArtemisDaemon, sql: str, *args: str) -> int:
    """One number from the daemon's SQLite state, read-only."""
    with closing(daemon.state_db()) as db:
        return int(db.execute(sql, args).fetchone()[0])


def runs_hot(event: dict) -> bool:
    return any("hw_thermal" in (g.get("throttle") or []) and (g.get("util_pct") or 0) >= 50
               for g in event.get("gpus") or [])


def hot_job(cluster: SlurmCluster, daemon: ArtemisDaemon, node: str, hot: ExitStack) -> str:
    """A root job on ``node`` whose rank 2 runs hot under load; its incident id.

    The node's emulated GPU runs hot (until ``hot`` closes): the root-side
    evidence is the cluster's own node check seeing it.
    """
    hot.enter_context(faults.EmulatedGpuFault(cluster, node, "thermal", cpu_fraction=1.0))
    job = cluster.sbatch("#!/bin/sh\nsleep 300\n", "-o", "/dev/null", "-N", "1", "-n", "1", "-w", node,
                         "--requeue")
    cluster.wait_job(job, ("RUNNING",), timeout_s=60)
    if cluster.health_interval_s > 0:
        daemon.wait_node_check(node, runs_hot)
    else:  # no node check in this cluster: what it would send
        send(cluster, daemon, [{"type": "node", "v": 1, "event": "health", "node": node, "time": 0.0,
                                "gpus": [{"index": 0, "util_pct": 98, "temp_c": 94, "throttle": ["hw_thermal"]}]}])
    for seq in range(12):
        busy = [50.0, 50.0, 63.0 if seq >= 8 else 50.0, 50.0]
        gpu = {2: {"temp_c": 94, "throttle": ["hw_thermal"]}} if seq >= 8 else None
        send(cluster, daemon, dumped(lockstep(seq, busy, job=job, nodes=[node] * 4, gpu=gpu)))

    def decided() -> dict | None:
        incs = [i for i in daemon.incidents(job=job) if i["state"] == "escalated"]
        return incs[0] if incs else None
    wait_until(lambda: decided() is not None, f"job {job}'s incident decided", timeout_s=60, daemon=daemon.daemon)
    return decided()["id"]


def drain_status(daemon: ArtemisDaemon, incident: str) -> str | None:
    rows = [a for a in daemon.get(f"/v1/incidents/{incident}")["actions"] if a["kind"] == "drain"]
    return rows[-1]["status"] if rows else None


def decisions(daemon: ArtemisDaemon, incident: str) -> list[tuple[str, str]]:
    """The incident's policy audit, for assertion messages."""
    return [(a["what"], a["why"]) for a in daemon.get(f"/v1/incidents/{incident}")["audit"] if a["who"] == "policy"]


def approve(cluster: SlurmCluster, daemon: ArtemisDaemon, incident: str) -> tuple[int, dict]:
    path = f"/v1/incidents/{incident}/approve"
    return post(daemon.url, path, b"", credential(cluster, b"", path=path))


def reload(daemon: ArtemisDaemon, conf: str) -> None:
    log = daemon.dir / "artemisd.log"
    before = log.read_text(errors="replace").count("config reloaded")
    daemon.write_conf(conf)
    daemon.daemon.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: log.read_text(errors="replace").count("config reloaded") > before, "artemisd to reload",
               timeout_s=20)


def test_budgets_count_waiting_drains_and_a_person_s_resume_frees_them(clean_cluster: SlurmCluster, artemisd):
    """MaxDrainFraction=0.25 of 4 nodes allows one drained node at a time."""
    with ExitStack() as hot:
        budgets_from_slurm(clean_cluster, artemisd, hot)


def budgets_from_slurm(clean_cluster: SlurmCluster, artemisd: ArtemisDaemon, hot: ExitStack) -> None:
    first = hot_job(clean_cluster, artemisd, "n1", hot)
    assert drain_status(artemisd, first) == "pending_approval", decisions(artemisd, first)
    # The waiting drain holds the budget: the next decision is refused, naming it.
    second = hot_job(clean_cluster, artemisd, "n2", hot)
    assert drain_status(artemisd, second) is None, decisions(artemisd, second)
    why = [a["why"] for a in artemisd.get(f"/v1/incidents/{second}")["audit"] if a["what"].startswith("drain n2")]
    assert why and "MaxDrainFraction=0.25 reached: 1 of 4 nodes" in why[0], why
    status, reply = approve(clean_cluster, artemisd, first)
    assert status == 200, reply
    wait_until(lambda: clean_cluster.drain_reasons().get("n1", "").startswith("artemis:"), "n1 drained by Artemis",
               timeout_s=60, daemon=artemisd.daemon)
    # Done as Artemis sees it too (it reads the node back after draining): a person comes later.
    wait_until(lambda: drain_status(artemisd, first) == "done", "the drain recorded done", timeout_s=30,
               daemon=artemisd.daemon)
    # A person repairs n1 and resumes it: Slurm no longer shows it drained by Artemis, the budget is free again.
    clean_cluster.scontrol("update", "NodeName=n1", "State=RESUME")
    third = hot_job(clean_cluster, artemisd, "n3", hot)
    assert drain_status(artemisd, third) == "pending_approval", decisions(artemisd, third)
    # The site lowers MaxDrainsPerHour to 1 while it waits: n1's drain happened this hour, so approve refuses.
    reload(artemisd, POLICY.replace("MaxDrainsPerHour=3", "MaxDrainsPerHour=1"))
    try:
        status, reply = approve(clean_cluster, artemisd, third)
        assert status == 409 and "MaxDrainsPerHour=1 reached: 1 drain in the last hour" in reply["error"], reply
        assert drain_status(artemisd, third) == "pending_approval" and "n3" not in clean_cluster.drain_reasons()
    finally:
        reload(artemisd, POLICY)
    status, reply = approve(clean_cluster, artemisd, third)
    assert status == 200, reply
    wait_until(lambda: clean_cluster.drain_reasons().get("n3", "").startswith("artemis:"), "n3 drained by Artemis",
               timeout_s=60, daemon=artemisd.daemon)
    assert "n2" not in clean_cluster.drain_reasons()
