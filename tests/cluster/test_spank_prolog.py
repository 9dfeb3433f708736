"""The SPANK plugin, Prolog/Epilog and node check, loaded by the real Slurm daemons."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from artemisd.wire import parse_record

from .procs import wait_until
from .recorder import RecordingDaemon
from .slurm import REPO, SlurmCluster

pytestmark = pytest.mark.cluster

ENV_SCRIPT = """#!/bin/sh
echo "batch $(env | grep -E '^(ARTEMIS_|PYTHONPATH=)' | sort | tr '\\n' ' ')"
srun sh -c 'echo "step $SLURMD_NODENAME $(env | grep -E "^(ARTEMIS_|PYTHONPATH=)" | sort | tr "\\n" " ")"'
"""


def run_env_job(cluster: SlurmCluster, *args: str) -> tuple[str, list[str]]:
    out = cluster.dir / "jobs" / "env-%j.out"
    job = cluster.sbatch(ENV_SCRIPT, "-N", "2", "-o", str(out), *args,
                         env={"PYTHONPATH": "/opt/site/python"})
    assert cluster.wait_job(job, timeout_s=90) == "COMPLETED"
    return job, Path(str(out).replace("%j", job)).read_text().splitlines()


def test_artemis_on_instruments_batch_and_every_step_and_reports_job_start_end(
        slurm_cluster: SlurmCluster) -> None:
    with RecordingDaemon(slurm_cluster.artemis_listen) as daemon:
        job, lines = run_env_job(slurm_cluster, "--artemis=on")
        # The Epilog runs after the job is reported complete: wait for its event.
        wait_until(lambda: sum(1 for r in daemon.recorder.reports()
                               if r.get("job") == job and r["event"] == "job_end") == 2,
                   "job_end from both nodes", timeout_s=60, interval_s=0.2)
    autoload = str(REPO / "torch_hook" / "autoload")
    assert len(lines) == 3  # the batch script and one task on each of two nodes
    for line in lines:
        assert "ARTEMIS_ENABLED=1" in line
        assert f"ARTEMIS_ENDPOINT={slurm_cluster.artemis_endpoint} " in line
        assert f"ARTEMIS_JOB_ID={job} " in line
        assert f"ARTEMIS_WINDOW_STEPS={slurm_cluster.window_steps} " in line
        assert f"PYTHONPATH={autoload}:/opt/site/python " in line  # prepended once, site's kept
    events = [r for r in daemon.recorder.reports() if r.get("job") == job]
    starts = sorted(r["node"] for r in events if r["event"] == "job_start")
    ends = sorted(r["node"] for r in events if r["event"] == "job_end")
    step_nodes = sorted(line.split()[1] for line in lines if line.startswith("step"))
    assert starts == ends == step_nodes
    # Every node event carries a munge credential made by root for exactly its request:
    # this method, this path and this body (artemisd/auth.py, request_payload).
    for req in daemon.recorder.requests:
        if req.path != "/v1/reports" or not any(r.get("job") == job for r in req.json()):
            continue
        scheme, credential = req.headers["Authorization"].split(" ", 1)
        decoded = slurm_cluster.munge.decode(credential)
        assert scheme == "Munge" and decoded.returncode == 0
        assert re.search(r"^UID:\s+root \(0\)", decoded.stdout, re.M)
        assert decoded.stdout.split("\n\n", 1)[1] == \
            f"artemis-request-v2 POST /v1/reports {hashlib.sha256(req.body).hexdigest()}"


@pytest.mark.parametrize("flag", [None, "--artemis=off"])
def test_jobs_without_artemis_on_are_untouched(slurm_cluster: SlurmCluster, flag: str | None) -> None:
    with RecordingDaemon(slurm_cluster.artemis_listen) as daemon:
        job, lines = run_env_job(slurm_cluster, *([flag] if flag else []))
        # The node check may report node health meanwhile; nothing names this job.
        assert not [r for r in daemon.recorder.reports() if r.get("job") == job]
    assert len(lines) == 3
    for line in lines:
        assert "ARTEMIS_" not in line
        assert "PYTHONPATH=/opt/site/python " in line


def test_srun_allocation_is_instrumented_too(slurm_cluster: SlurmCluster) -> None:
    done = slurm_cluster.cmd("srun", "--artemis=on", "-N", "2", "sh", "-c",
                             'echo "$ARTEMIS_ENABLED $ARTEMIS_JOB_ID"', timeout_s=90)
    values = {line for line in done.stdout.splitlines()}
    assert len(values) == 1 and values.pop().startswith("1 ")


def test_a_bad_value_is_refused_at_submission(slurm_cluster: SlurmCluster) -> None:
    done = slurm_cluster.cmd("sbatch", "--artemis=maybe", "--wrap", "true", check=False)
    assert done.returncode != 0
    assert "--artemis=maybe: expected on or off" in done.stderr


def test_the_plugin_records_the_slurm_release_it_was_built_for(slurm_cluster: SlurmCluster) -> None:
    built_for = (REPO / "spank" / "artemis.so.slurm-version").read_text().strip()
    running = slurm_cluster.cmd("sinfo", "-V").stdout.split()[-1]
    assert built_for == running
    help_text = slurm_cluster.cmd("sbatch", "--help").stdout
    assert "--artemis=on|off" in help_text


def test_node_check_reports_health_from_every_node(slurm_cluster: SlurmCluster) -> None:
    if slurm_cluster.health_interval_s <= 0:
        pytest.skip("this cluster runs no HealthCheckProgram")
    with RecordingDaemon(slurm_cluster.artemis_listen) as daemon:
        wait_until(lambda: {r["node"] for r in daemon.recorder.reports() if r["event"] == "health"}
                   == set(slurm_cluster.node_names),
                   "a health event from every node", timeout_s=8 * slurm_cluster.health_interval_s + 30)
        # From its second pass on, a node's check reports its interfaces' counters per second since the
        # previous pass (the test cluster's veths or loopback-only namespaces: whatever it has), and the
        # daemon's wire contract takes the whole event.
        wait_until(lambda: any((r.get("fabric") or {}).get("interval_s") for r in daemon.recorder.reports()
                               if r["event"] == "health"),
                   "a health event with fabric rates", timeout_s=8 * slurm_cluster.health_interval_s + 30)
        for record in daemon.recorder.reports():
            if record["event"] == "health":
                parse_record(record)
