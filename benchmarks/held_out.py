"""Faults under a busy neighbour, at the shipped defaults: named on the right node? drained and verified?

    .venv/bin/python benchmarks/held_out.py                        # as root; 2 trials of each, ~6 min here
    .venv/bin/python benchmarks/held_out.py --faults link --trials 3 --json out.json

Issue 28's judgement as a command.  On the test cluster (real Slurm, munge,
MariaDB; 3 ranks of plain DDP under ``sbatch --artemis=on``, one per node in
its own network namespace), artemisd runs exactly as the demo and the
end-to-end tests run it (tests/cluster/scenario.py: every analysis, probing,
verification and escalation setting at its default; every rung automatic),
while the ``NoisyNeighbour`` of tests/cluster/healthy.py switches up to two
busy processes on and off every 10-30 s for the whole job, outside it.  After
a healthy baseline (10 windows), one fault on the job's second node:

* ``link``: ``tc tbf`` on both ends of the node's veth (the e2e test's
  ``DegradedLink``, 40 mbit).  Reported: the first incident that names a
  cause for a rank, node or link — which, where and how many seconds after
  the fault — within ``ProbeMinInterval`` + 150 s (the link's first matched
  probe may wait that long), and every incident naming another node.
* ``thermal``: the emulated GPU thermal fault (``EmulatedGpuFault``: the
  node's GPU file says hot and throttled, its CPU is capped).  Reported: the
  same, then whether the node was drained and the job requeued without it,
  and the verification — verdict and the samples/s it rests on (healthy,
  slowed, after, expected), with whether they add up: slowed below healthy,
  and a recovery at least ``RecoveryFraction`` of expected (of healthy where
  no expectation was made).

Every mail subject and drain of the trial is listed, so a page about an
innocent node shows.  One JSON object on stdout (and in ``--json FILE``).
Trials are the benchmark's to repeat; the tests assert one of each without a
neighbour (tests/cluster/test_e2e.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from artemisd.config import DaemonSettings  # noqa: E402
from tests.cluster import faults  # noqa: E402
from tests.cluster.artemis import ArtemisDaemon, Mailbox  # noqa: E402
from tests.cluster.healthy import NoisyNeighbour  # noqa: E402
from tests.cluster.procs import ClusterError, own_tmpdir, wait_until  # noqa: E402
from tests.cluster.scenario import DAEMON_CONF, TrainingJob  # noqa: E402
from tests.cluster.slurm import SlurmCluster  # noqa: E402

BASELINE_STEPS = 200  # ten 20-step windows, as in the e2e tests
FAULTY_RANK = 1
VERIFY_TIMEOUT_S = 300.0
SUBJECT_FIELDS = ("id", "kind", "state", "cause", "rank", "node", "link", "loss_pct", "measured_loss_pct")


def brief(incident: dict[str, Any]) -> dict[str, Any]:
    """What a trial reports of an incident: its subject, cause and loss."""
    return {k: incident.get(k) for k in SUBJECT_FIELDS}


def _named(incident: dict[str, Any]) -> bool:
    """A confirmed incident that names a cause for a rank, node or link."""
    return (incident.get("confirmed_window") is not None and incident["state"] != "dismissed"
            and incident.get("cause") != "unknown"
            and any(incident.get(k) is not None for k in ("rank", "node", "link")))


def _on(incident: dict[str, Any], node: str) -> bool:
    return incident.get("node") == node or node in str(incident.get("link") or "")


def _verdict(done: dict[str, Any]) -> dict[str, Any]:
    result = done.get("result") or {}
    healthy, before, after = (result.get(k) for k in ("throughput_healthy", "throughput_before",
                                                      "throughput_after"))
    expected = result.get("throughput_expected")
    bar = DaemonSettings().recovery_fraction * (expected or healthy or 0.0)
    recovered = result.get("recovered")
    adds_up = None
    if healthy and before and after:
        adds_up = before < healthy and (recovered is not True or after >= bar) and (
            recovered is not False or after < bar)
    return {"state": done["state"], "recovered": recovered,
            "recovered_after_load_correction": result.get("recovered_after_load_correction"),
            "recovered_within_noise": result.get("recovered_within_noise"),
            "samples_per_s": {"healthy": healthy, "slowed": before, "after": after, "expected": expected},
            "adds_up": adds_up}


def trial(cluster: SlurmCluster, daemon: ArtemisDaemon, mailbox: Mailbox, kind: str, seed: int) -> dict[str, Any]:
    name_within = DaemonSettings().probe_min_interval + 150.0 if kind == "link" else 240.0
    job = TrainingJob.submit(cluster, daemon, seconds=name_within + VERIFY_TIMEOUT_S + 120.0)
    mails_before = len(mailbox.subjects())
    out: dict[str, Any] = {"fault": kind, "job": job.job_id}
    try:
        job.wait_running()
        with NoisyNeighbour(seed=seed, phase_s=(10.0, 30.0)) as load:
            job.wait_steps(BASELINE_STEPS, timeout_s=300)
            node = job.rank_node(FAULTY_RANK)
            fault = (faults.DegradedLink(cluster, node) if kind == "link"
                     else faults.EmulatedGpuFault(cluster, node, "thermal"))
            out["node"] = node
            began = time.monotonic()
            with fault:
                try:
                    first = job.wait_incident(_named, "an incident naming a cause", timeout_s=name_within)
                    out["named"] = brief(first) | {
                        "after_s": round(time.monotonic() - began, 1), "right_node": _on(first, node)}
                except ClusterError:
                    out["named"] = None
                if kind == "thermal" and out["named"] and out["named"]["right_node"]:
                    ident = out["named"]["id"]
                    try:
                        done = job.wait_incident(
                            lambda i: i["id"] == ident and i["state"] in ("resolved", "unresolved", "escalated")
                            and (i.get("result") or {}).get("recovered") is not None,
                            "the action verified", timeout_s=VERIFY_TIMEOUT_S)
                        out["verified"] = _verdict(done)
                    except ClusterError:
                        out["verified"] = None
                    out["requeued_without_node"] = node in job.info().get("ExcNodeList", "")
            out["neighbour_phases"] = len(load.phases)
        incidents = [i for i in daemon.incidents(everything=True) if i.get("job") == job.job_id]
        out["named_elsewhere"] = [brief(i) for i in incidents
                                  if _named(i) and not _on(i, node) and i.get("rank") != FAULTY_RANK]
        out["incidents"] = len(incidents)
        out["drained"] = cluster.drain_reasons()
        out["mails"] = mailbox.subjects()[mails_before:]
    finally:
        end_trial(cluster, job)
    return out


def end_trial(cluster: SlurmCluster, job: TrainingJob) -> None:
    """The trial's job cancelled and gone, every node back in service, every GPU healthy: the next
    trial starts as the first did."""
    job.cancel()
    try:
        wait_until(lambda: cluster.job_state(job.job_id) not in ("RUNNING", "COMPLETING", "PENDING"),
                   "the trial's job to end", timeout_s=120)
    except ClusterError:
        pass
    cluster.reset()
    faults.write_healthy_gpus(cluster)


def summary(trials: list[dict[str, Any]]) -> dict[str, Any]:
    by_kind: dict[str, dict[str, Any]] = {}
    for t in trials:
        row = by_kind.setdefault(t["fault"], {"trials": 0, "right": 0, "wrong": 0, "unnamed": 0, "errors": 0,
                                              "named_elsewhere": 0, "after_s": [], "verified_adds_up": 0})
        row["trials"] += 1
        if "error" in t:
            row["errors"] += 1
            continue
        named = t.get("named")
        if named is None:
            row["unnamed"] += 1
        elif named["right_node"]:
            row["right"] += 1
            row["after_s"].append(named["after_s"])
        else:
            row["wrong"] += 1
        row["named_elsewhere"] += len(t.get("named_elsewhere", []))
        row["verified_adds_up"] += bool((t.get("verified") or {}).get("adds_up"))
    return by_kind


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--faults", nargs="+", choices=("link", "thermal"), default=["link", "thermal"])
    parser.add_argument("--trials", type=int, default=2, help="trials of each fault (default 2)")
    parser.add_argument("--seed", type=int, default=28, help="the neighbour's first seed")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("held_out runs the Slurm test cluster: run it as root", file=sys.stderr)
        return 2
    began = time.monotonic()
    trials = []
    with own_tmpdir("artemis-held-out-"), SlurmCluster(nodes=4, health_interval_s=5) as cluster, \
            Mailbox() as mailbox, ArtemisDaemon(cluster, DAEMON_CONF, mailbox) as daemon:
        faults.write_healthy_gpus(cluster)
        if cluster.network != "netns" and "link" in args.faults:
            print("a per-node link needs the netns layout", file=sys.stderr)
            return 2
        for _ in range(args.trials):
            for kind in args.faults:
                try:
                    trials.append(trial(cluster, daemon, mailbox, kind, seed=args.seed + len(trials)))
                except ClusterError as err:  # the job could not train (say): a trial lost, not the run
                    trials.append({"fault": kind, "error": str(err)[-2000:]})
                print(json.dumps(trials[-1]), file=sys.stderr, flush=True)
    report({"wall_s": round(time.monotonic() - began, 1), "summary": summary(trials), "trials": trials}, args.json)
    return 0


def report(result: dict[str, Any], path: Path | None) -> None:
    """The run's one JSON object on stdout, and in ``path`` where given."""
    text = json.dumps(result, indent=1)
    print(text)
    if path is not None:
        path.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
