"""kill -9 of the real artemisd mid-incident, on the real cluster.

The daemon drains a node and requeues the job (root-side evidence from a
root-signed node event), is killed with SIGKILL, and restarts on the same
SQLite file.  The incident comes back as it was, the completed drain is not
repeated (one drain action, Slurm's reason unchanged), and reports that keep
arriving for the same subject do not open a second incident.
"""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.request

import pytest

from artemisd.auth import request_payload
from tests.unit.windows import lockstep

from . import faults
from .artemis import ArtemisDaemon
from .procs import wait_until
from .slurm import SlurmCluster

pytestmark = pytest.mark.cluster

POLICY = "PartitionPolicy=main Auto=drain,requeue,escalate MaxDrainFraction=0.5 Cooldown=0\n"


def send(cluster: SlurmCluster, url: str, items: list[dict]) -> dict:
    body = json.dumps(items).encode()
    cred = subprocess.run(["munge", "-S", str(cluster.munge_socket), "-s",
                           request_payload("POST", "/v1/reports", body)],
                          capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    req = urllib.request.Request(f"{url}/v1/reports", data=body, method="POST",
                                 headers={"Authorization": f"Munge {cred}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def windows(job: str, nodes: list[str], seqs: range, slow: bool) -> list[list[dict]]:
    busy = [62.0 if (slow and r == 2) else 50.0 for r in range(4)]
    gpu = {2: {"temp_c": 94, "throttle": ["hw_thermal"]}} if slow else None
    return [[r.model_dump(mode="json", exclude_none=True) for r in lockstep(seq, busy, job=job, nodes=nodes, gpu=gpu)]
            for seq in seqs]


def test_kill_9_mid_incident_resumes_without_repeating(clean_cluster: SlurmCluster):
    job = clean_cluster.sbatch("#!/bin/sh\nsleep 600\n", "-o", "/dev/null", "-N", "2", "--requeue")
    clean_cluster.wait_job(job, ("RUNNING",), timeout_s=60)
    nodes = clean_cluster.cmd("scontrol", "show", "hostnames", clean_cluster.job(job)["NodeList"]).stdout.split()
    ranks = [nodes[r // 2] for r in range(4)]
    # The cluster's node check reports every few seconds as root: the evidence is its own
    # report of the hot GPU (one sent by hand would be replaced by its next healthy one).
    faults.write_healthy_gpus(clean_cluster)
    with faults.EmulatedGpuFault(clean_cluster, nodes[1], "thermal", cpu_fraction=1.0):
        ArtemisDaemon(clean_cluster, POLICY).wipe_state()  # other tests' daemons share the directory
        with ArtemisDaemon(clean_cluster, POLICY) as daemon:
            for window in windows(job, ranks, range(0, 8), slow=False):
                send(clean_cluster, daemon.url, window)
            if clean_cluster.health_interval_s > 0:  # the node check's own report is the evidence
                daemon.wait_node_check(nodes[1], lambda e: any("hw_thermal" in (g.get("throttle") or [])
                                                               for g in e.get("gpus") or []))
            else:
                send(clean_cluster, daemon.url, [{"type": "node", "v": 1, "event": "health", "node": nodes[1],
                                                  "time": 0.0,
                                                  "gpus": [{"index": 0, "util_pct": 97, "throttle": ["hw_thermal"]}]}])
            for window in windows(job, ranks, range(8, 11), slow=True):
                send(clean_cluster, daemon.url, window)
            wait_until(lambda: nodes[1] in clean_cluster.drain_reasons(), "artemisd to drain the node",
                       timeout_s=60, daemon=daemon.daemon)
            wait_until(lambda: nodes[1] in clean_cluster.job(job).get("ExcNodeList", ""),
                       "the job requeued excluding the node", timeout_s=60, daemon=daemon.daemon)
            [before] = daemon.incidents(job=job)
            reason = clean_cluster.drain_reasons()[nodes[1]]
            daemon.daemon.proc.send_signal(signal.SIGKILL)
            daemon.daemon.proc.wait(timeout=10)
            daemon.daemon = None
        with ArtemisDaemon(clean_cluster, POLICY) as daemon:
            [after] = daemon.incidents(job=job)
            assert after["id"] == before["id"] and after["cause"] == before["cause"]
            assert after["state"] in ("verifying", "escalated", "unresolved", "resolved")
            # The old run's last reports trickle in after the restart: the same subject, no new incident.
            for window in windows(job, ranks, range(11, 13), slow=True):
                send(clean_cluster, daemon.url, window)
            shown = daemon.get(f"/v1/incidents/{after['id']}")
            drains = [a for a in shown["actions"] if a["kind"] == "drain"]
            assert len(drains) == 1 and drains[0]["status"] in ("done", "rolled_back")
            assert [i["id"] for i in daemon.incidents(job=job, everything=True)] == [before["id"]]
            assert clean_cluster.drain_reasons().get(nodes[1], reason) == reason
