"""The Artemis demo: the whole loop on an emulated Slurm cluster, in a few minutes.

    sudo .venv/bin/python -m tests.cluster.demo [--out DIR] [--keep]

1. brings up munged, MariaDB + slurmdbd, slurmctld and four slurmd, one per
   network namespace, with the SPANK plugin, Prolog/Epilog and node check;
   starts artemisd and an SMTP server on 127.0.0.1 (the admins' mailbox);
2. submits an unchanged DDP training script with ``sbatch --artemis=on``;
3. after a healthy baseline, makes one node's (emulated) GPU stop boosting:
   Artemis detects the slow rank, confirms it, names ``gpu.clocks`` from the
   node's telemetry, queues a clock reset that the node check applies as root,
   and measures the throughput before and after;
4. then makes another node's GPU overheat: a clock reset cannot fix that, so
   the node is drained (``sinfo -R``) and the job requeued without it;
5. prints each incident (cause, evidence, action, result), writes the
   incident plots (``artemis show INC --plot``), and tears everything down.

Needs root (daemons, namespaces, cgroups) and the packages of
scripts/apt-packages.txt.  Nothing leaves the machine: the nodes sit on a
bridge attached to nothing (design.md §6).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import faults
from .artemis import ArtemisDaemon, Mailbox
from .scenario import DAEMON_CONF, TrainingJob, wait_for
from .slurm import SlurmCluster

BASELINE_STEPS = 200
FAULTY_RANK = 1


def say(text: str, started: float) -> None:
    print(f"[{time.monotonic() - started:6.1f}s] {text}", flush=True)


def show_incident(incident: dict[str, Any]) -> str:
    lines = [f"  {incident['id']}  {incident['kind']} incident, state {incident['state']}",
             f"    where:    rank {incident['rank']} on node {incident['node']}"
             f" (island {incident['island']})",
             f"    cause:    {incident['cause']} (confidence {incident['confidence']})",
             f"    impact:   {incident['ratio']}x its peers' busy time, "
             f"{incident['loss_pct']} % of job throughput lost"]
    for evidence in incident["evidence"]:
        note = f" — {evidence['note']}" if evidence.get("note") else ""
        lines.append(f"    evidence: {evidence['signal']} = {evidence['value']}"
                     f" (peers {evidence['peers']}){note}")
    action = incident.get("action") or {}
    lines.append(f"    action:   {action.get('kind')} {action.get('target')} -> {action.get('status')}")
    result = incident.get("result")
    if result:
        lines.append(f"    result:   {result['throughput_before']:.0f} -> {result['throughput_after']:.0f}"
                     f" samples/s, recovered: {result['recovered']}")
    return "\n".join(lines)


def plot(daemon: ArtemisDaemon, incident: str, out: Path) -> Path:
    target = out / f"{incident}.png"
    subprocess.run([sys.executable, "-m", "artemisd.cli", "show", incident, "--server", daemon.url,
                    "--plot", str(target)], check=True, capture_output=True, text=True, timeout=60,
                   env=daemon.cluster.env)
    return target


def run(out: Path, keep: bool) -> int:
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    say("bringing up the emulated cluster (munged, MariaDB, slurmdbd, slurmctld, 4 x slurmd)", started)
    with SlurmCluster(nodes=4, health_interval_s=5, keep_workdir=keep) as cluster, \
            Mailbox() as mailbox, ArtemisDaemon(cluster, DAEMON_CONF, mailbox) as daemon:
        say(f"cluster {cluster.name} up in {cluster.bring_up_s:.1f}s ({cluster.network} layout: "
            + ", ".join(f"{n.name}={n.address}" for n in cluster.nodes.values())
            + f"); artemisd at {daemon.url}", started)
        faults.write_healthy_gpus(cluster)

        job = TrainingJob.submit(cluster, daemon, seconds=600)
        say(f"sbatch --artemis=on train_ddp.py -> job {job.job_id} (3 ranks, gloo, no Artemis code)",
            started)
        job.wait_running()
        job.wait_steps(BASELINE_STEPS, timeout_s=240)
        slow = job.rank_node(FAULTY_RANK)
        say(f"healthy baseline measured on {', '.join(job.nodes())}", started)

        say(f"fault 1: the GPU of {slow} stops boosting (clocks pinned low)", started)
        incidents = []
        with faults.EmulatedGpuFault(cluster, slow, "clocks"):
            first = job.wait_incident(
                lambda i: i["cause"] == "gpu.clocks" and i["state"] in ("resolved", "unresolved"),
                "the clock incident to be corrected and verified", timeout_s=300)
        incidents.append(first)
        say("incident:\n" + show_incident(first), started)

        hot = job.rank_node(2)
        say(f"fault 2: the GPU of {hot} overheats (a reset cannot fix heat)", started)
        with faults.EmulatedGpuFault(cluster, hot, "thermal"):
            second = job.wait_incident(lambda i: i["cause"] == "gpu.thermal" and i["state"] not in (
                "suspect", "dismissed", "confirmed"), "the thermal incident to be acted on", timeout_s=300)
            wait_for(lambda: cluster.drain_reasons().get(hot), f"{hot} drained", timeout_s=120)
            wait_for(lambda: hot in job.info().get("ExcNodeList", ""), "the requeue", timeout_s=120)
            # Re-read: the action has finished meanwhile (drain done, job requeued).
            second = job.wait_incident(lambda i: i["id"] == second["id"] and (i.get("action") or {}).get(
                "status") in ("done", "failed"), "the drain to be recorded", timeout_s=120)
        incidents.append(second)
        say("incident:\n" + show_incident(second), started)
        say("sinfo -R:\n" + cluster.cmd("sinfo", "-R", "-o", "%60E %9u %19H %N").stdout.rstrip(),
            started)
        info = job.info()
        say(f"job {job.job_id}: {info.get('JobState')}, requeued {info.get('Restarts')} time(s), "
            f"ExcNodeList={info.get('ExcNodeList')}", started)
        say(f"escalation emails received: {mailbox.subjects() or 'none'}", started)

        for incident in incidents:
            say(f"plot: {plot(daemon, incident['id'], out)}", started)
        (out / "incidents.jsonl").write_text("".join(json.dumps(i) + "\n" for i in incidents))
        job.cancel()
        say("tearing down (daemons by PID, namespaces, bridge, cgroups, route)", started)
    say(f"done; incidents and plots in {out}", started)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.demo",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/demo"),
                        help="where incident plots and incidents.jsonl go (default out/demo)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the cluster's work dir (configs, daemon logs) for a look afterwards")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("the demo runs Slurm's daemons and creates namespaces: run it as root", file=sys.stderr)
        return 2
    return run(args.out.resolve(), args.keep)


if __name__ == "__main__":
    sys.exit(main())
