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
   the node is drained (``sinfo -R``), the job requeued without it, and the
   requeued run's throughput on the healthy nodes verified;
5. then stalls one rank's data loader in a job that did not opt in to
   rebalancing: the incident is escalated (the email as the SMTP sink got it,
   and the AdminComment that ``sacct`` shows once the job has ended);
6. ends the job: its incidents still open end with it (the escalated loader
   incident ends unresolved, and the person paged is mailed); prints each
   incident (cause, evidence, action, measured result), what changed in each
   since it was shown, every incident of the job (the dismissed suspects
   too), writes the incident plots (``artemis show INC --plot``), and tears
   everything down.

The analysis, probing, verification and escalation run at the shipped
defaults; the demo prints the few policy settings it sets beside the defaults
they replace, and why (tests/cluster/scenario.py).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from artemisd import loss

from . import faults
from .artemis import ArtemisDaemon, Mailbox
from .healthy import still_open
from .scenario import DAEMON_CONF, TrainingJob, settings_beside_defaults, wait_for
from .procs import own_tmpdir
from .slurm import SlurmCluster

BASELINE_STEPS = 200
FAULTY_RANK = 1


def say(text: str, started: float) -> None:
    print(f"[{time.monotonic() - started:6.1f}s] {text}", flush=True)


def show_incident(incident: dict[str, Any]) -> str:
    where = (f"rank {incident['rank']} on node {incident['node']} (island {incident['island']})"
             if incident.get("rank") is not None else
             f"{incident['kind']} {incident.get('node') or incident.get('link') or 'job ' + incident['job']}")
    lines = [f"  {incident['id']}  {incident['kind']} incident, state {incident['state']}",
             f"    where:    {where}",
             f"    cause:    {incident['cause']} (confidence {incident['confidence']})",
             f"    impact:   {loss.loss_summary(incident.get('measured_loss_pct'), incident.get('loss_pct'))}"
             f" ({incident['ratio']}x its peers' busy time)"]
    for evidence in incident["evidence"]:
        note = f" — {evidence['note']}" if evidence.get("note") else ""
        lines.append(f"    evidence: {evidence['signal']} = {evidence['value']}"
                     f" (peers {evidence['peers']}){note}")
    action = incident.get("action") or {}
    lines.append(f"    action:   {action.get('kind')} {action.get('target')} -> {action.get('status')}")
    result = incident.get("result")
    if result:
        lines.append("    result:   " + format_result(result))
    return "\n".join(lines)


def format_result(result: dict[str, Any]) -> str:
    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    return (f"samples/s healthy {num(result.get('throughput_healthy'))}, slowed {num(result.get('throughput_before'))}, "
            f"after {num(result.get('throughput_after'))}; recovered: {result.get('recovered')}")


def changes_since_shown(shown: list[dict[str, Any]], final: list[dict[str, Any]]) -> list[str]:
    """Each shown incident whose final record differs from what was shown: its state, its loss and
    its result as they are now, so what the demo printed (and a page said) is never silently stale."""
    by_id = {i["id"]: i for i in final}
    lines = []
    for before in shown:
        after = by_id.get(before["id"])
        if after is None:
            continue
        what = []
        if after["state"] != before["state"]:
            ended = after.get("ended_with_job")
            why = (f" (its job ended {ended['job_state']}; the person paged was mailed)"
                   if ended and ended.get("person_told") else
                   f" (its job ended {ended['job_state']})" if ended else "")
            what.append(f"state {before['state']} -> {after['state']}{why}")
        if after.get("measured_loss_pct") != before.get("measured_loss_pct"):
            what.append(loss.loss_summary(after.get("measured_loss_pct"), after.get("loss_pct")) or "")
        if after.get("result") != before.get("result") and after.get("result"):
            what.append("result: " + format_result(after["result"]))
        if what:
            lines.append(f"  {after['id']}: " + "; ".join(w for w in what if w))
    return lines


def plot(daemon: ArtemisDaemon, incident: str, out: Path) -> Path:
    target = out / f"{incident}.png"
    subprocess.run([sys.executable, "-m", "artemisd.cli", "show", incident, "--server", daemon.url,
                    "--plot", str(target)], check=True, capture_output=True, text=True, timeout=60,
                   env=daemon.cluster.env)
    return target


@dataclass
class DemoRun:
    """What the demo saw, for tests/cluster/test_demo.py to judge."""

    incidents: list[dict[str, Any]] = field(default_factory=list)      # one per fault, as last read
    every_incident: list[dict[str, Any]] = field(default_factory=list)  # the job's, dismissed ones too
    nodes: list[str] = field(default_factory=list)
    hot_node: str = ""
    drain_reasons: dict[str, str] = field(default_factory=dict)
    admin_comment: str = ""                                             # sacct, after the job ended
    mails: list[tuple[str, str]] = field(default_factory=list)          # (subject, body)


VERDICTS = ("resolved", "unresolved")


def run(out: Path, keep: bool) -> DemoRun:
    started = time.monotonic()
    seen = DemoRun()
    out.mkdir(parents=True, exist_ok=True)
    say("bringing up the emulated cluster (munged, MariaDB, slurmdbd, slurmctld, 4 x slurmd)", started)
    # The job's ranks bind their node relay's socket under TMPDIR; the one the cluster gets here
    # goes at teardown with the sockets of the ranks the requeue killed.
    with own_tmpdir("artemis-demo-"), \
            SlurmCluster(nodes=4, health_interval_s=5, keep_workdir=keep) as cluster, \
            Mailbox() as mailbox, ArtemisDaemon(cluster, DAEMON_CONF, mailbox) as daemon:
        say(f"cluster {cluster.name} up in {cluster.bring_up_s:.1f}s ({cluster.network} layout: "
            + ", ".join(f"{n.name}={n.address}" for n in cluster.nodes.values())
            + f"); artemisd at {daemon.url}", started)
        say("artemis.conf: the analysis, probing and verification at the shipped defaults; the policy "
            "of a small partition that lets every rung act:\n"
            + "\n".join(f"  {line}" for line in settings_beside_defaults(cluster.window_steps)), started)
        faults.write_healthy_gpus(cluster)
        seen.nodes = list(cluster.nodes)

        job = TrainingJob.submit(cluster, daemon, seconds=900)
        say(f"sbatch --artemis=on train_ddp.py -> job {job.job_id} (3 ranks, gloo, no Artemis code)",
            started)
        job.wait_running()
        job.wait_steps(BASELINE_STEPS, timeout_s=240)
        slow = job.rank_node(FAULTY_RANK)
        say(f"healthy baseline measured on {', '.join(job.nodes())}", started)

        say(f"fault 1: the GPU of {slow} stops boosting (clocks pinned low)", started)
        with faults.EmulatedGpuFault(cluster, slow, "clocks"):
            first = job.wait_incident(
                lambda i: i["cause"] == "gpu.clocks" and i["state"] in VERDICTS,
                "the clock incident to be corrected and verified", timeout_s=300)
        seen.incidents.append(first)
        say("incident:\n" + show_incident(first), started)

        hot = seen.hot_node = job.rank_node(2)
        say(f"fault 2: the GPU of {hot} overheats (a reset cannot fix heat)", started)
        with faults.EmulatedGpuFault(cluster, hot, "thermal"):
            second = job.wait_incident(lambda i: i["cause"] == "gpu.thermal" and i["state"] not in (
                "suspect", "dismissed", "confirmed"), "the thermal incident to be acted on", timeout_s=300)
            try:
                wait_for(lambda: cluster.drain_reasons().get(hot), f"{hot} drained", timeout_s=120)
            except Exception:
                detail = daemon.get(f"/v1/incidents/{second['id']}")
                say(f"{hot} was not drained; {second['id']} as the daemon has it:\n{json.dumps(detail)[:3000]}"
                    f"\n{daemon.log_tail(30)}", started)
                raise
            wait_for(lambda: hot in job.info().get("ExcNodeList", ""), "the requeue", timeout_s=120)
            say(f"{hot} drained, job {job.job_id} requeued excluding it; verifying on the healthy nodes",
                started)
            job.wait_running(timeout_s=120)
            # The node stays hot: verification judges the requeued run on the
            # other nodes once it is back in steady state.
            # Verified, or escalated because verification could not judge.
            second = job.wait_incident(lambda i: i["id"] == second["id"] and (i["state"] in VERDICTS or (
                i["state"] == "escalated" and (i.get("result") or {}).get("throughput_before") is not None)),
                "the requeued job's recovery to be verified", timeout_s=420)
        seen.incidents.append(second)
        say("incident:\n" + show_incident(second), started)
        seen.drain_reasons = cluster.drain_reasons()
        say("sinfo -R:\n" + cluster.cmd("sinfo", "-R", "-o", "%60E %9u %19H %N").stdout.rstrip(),
            started)
        info = job.info()
        say(f"job {job.job_id}: {info.get('JobState')}, requeued {info.get('Restarts')} time(s), "
            f"ExcNodeList={info.get('ExcNodeList')}", started)

        stalled = job.rank_node(FAULTY_RANK)
        say(f"fault 3: rank {FAULTY_RANK}'s data loader on {stalled} stalls; the job did not opt in to "
            f"rebalancing, so a person is told", started)
        mails_before = len(mailbox.subjects())
        # The loader stays stalled until the job ends: nobody fixed it, so its incident ends with the job.
        with faults.LoaderStall(job.stall_dir, stalled, seconds_per_batch=0.25):
            third = job.wait_incident(lambda i: i["cause"] == "input.loader" and i["state"] == "escalated",
                                      "the loader incident to be escalated", timeout_s=300)
            wait_for(lambda: len(mailbox.subjects()) > mails_before, "the escalation email", timeout_s=60)
            seen.incidents.append(third)
            say("incident:\n" + show_incident(third), started)
            seen.mails = list(zip(mailbox.subjects(), mailbox.bodies()))
            subject, body = next((s, b) for s, b in seen.mails[mails_before:] if third["id"] in s)
            say(f"escalation email as received by the SMTP sink:\n  Subject: {subject}\n"
                + "\n".join("  " + line for line in body.strip().splitlines()[:14]), started)

            for incident in seen.incidents:
                say(f"plot: {plot(daemon, incident['id'], out)}", started)
            job.cancel()
            cluster.wait_job(job.job_id, timeout_s=60)
        seen.admin_comment = wait_for(lambda: cluster.cmd("sacct", "-n", "-X", "-P", "-j", job.job_id,
                                                          "-o", "AdminComment").stdout.strip(),
                                      "AdminComment in sacct", timeout_s=60)
        say(f"sacct -j {job.job_id} -o AdminComment (the job has ended):\n  {seen.admin_comment}", started)
        # Slurm says the job ended: its incidents still open end with it (the loader's, escalated,
        # ends unresolved, and the person paged about it is mailed).
        wait_for(lambda: not still_open(daemon.incidents(job.job_id, everything=True)),
                 "the job's open incidents to end with it", timeout_s=90)
        seen.every_incident = daemon.incidents(job.job_id, everything=True)
        seen.mails = list(zip(mailbox.subjects(), mailbox.bodies()))
        say("every incident of the job, with the suspects that were never confirmed:\n" + "\n".join(
            f"  {i['id']:<7} {i['state']:<10} {i['kind']:<5} {i['cause']:<13} "
            f"{'rank ' + str(i['rank']) if i.get('rank') is not None else i.get('node') or i.get('link') or ''}"
            for i in seen.every_incident), started)
        changed = changes_since_shown(seen.incidents, seen.every_incident)
        if changed:
            say("what changed since each incident was shown above (the final records):\n" + "\n".join(changed),
                started)
        (out / "incidents.jsonl").write_text("".join(json.dumps(i) + "\n" for i in seen.every_incident))
        say("tearing down (daemons by PID, namespaces, bridge, cgroups, route)", started)
    say(f"done; incidents and plots in {out}", started)
    return seen


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
    run(args.out.resolve(), args.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
