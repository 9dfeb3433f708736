"""The stack matrix on the test cluster, at the shipped defaults, under a busy neighbour.

    .venv/bin/python benchmarks/held_out_stacks.py                   # as root; every stack, ~20 min here
    .venv/bin/python benchmarks/held_out_stacks.py --stacks ddp tp --json out.json

Issue 28's "held-out matrix of stacks where every slowed rank is named and no
control produces an incident", as a command.  tests/probe/test_stacks.py runs
the same stacks (tests/probe/stacks.py: DDP, torch.compile, a hand-written
all_reduce loop, FSDP1, FSDP2, tensor parallel, HF Trainer, Lightning) as
local gloo ranks and replays their traces; here each is a real job: 3 ranks
under ``sbatch --artemis=on`` (4 for tensor parallel, whose layers must split
evenly), one per node in its own network namespace, the
probe loaded by the SPANK plugin, artemisd as the demo and the end-to-end
tests run it (tests/cluster/scenario.py: every analysis, probing,
verification and escalation setting at its default; every rung automatic),
and the ``NoisyNeighbour`` of tests/cluster/healthy.py switching up to two
busy processes on and off every 10-30 s for the whole job.  Per stack:

* *control*: ``--healthy-s`` seconds of training (default 90) after the first
  report, nothing slowed.  Reported: every incident the job had by then, and
  those confirmed (an incident confirmed on a healthy job is a false one,
  whatever it names).
* *slowed*: then rank 1 sleeps before each iteration (a sleep, not a burn: on
  2 shared cores a burn slows its peers too), ``--slow`` (default 0.5) times
  the job's median step over its last 30 windows: the same relative slowdown
  whether the stack's step takes 5 ms or 300 ms here.  Reported: the
  first confirmed incident that names a cause for a rank or node, whether it
  names rank 1 (or its node), and the seconds from the slowdown to it, within
  ``--name-within-s``; and every incident naming another rank or node.

A stack that cannot train (say, a missing package) is a row with its error,
not the end of the run.  One JSON object on stdout (and in ``--json FILE``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.held_out import brief, end_trial, report  # noqa: E402
from tests.cluster import faults  # noqa: E402
from tests.cluster.artemis import ArtemisDaemon, Mailbox  # noqa: E402
from tests.cluster.healthy import NoisyNeighbour  # noqa: E402
from tests.cluster.procs import ClusterError, own_tmpdir, tail, wait_until  # noqa: E402
from tests.cluster.scenario import DAEMON_CONF, TrainingJob  # noqa: E402
from tests.cluster.slurm import SlurmCluster  # noqa: E402
from tests.probe.stacks import STACKS  # noqa: E402

STACK_SCRIPT = ROOT / "tests" / "probe" / "stacks.py"
SLOW_RANK = 1
NODES = {"tp": 4}  # tensor parallel shards the stacks' 1024-wide layer: a world that divides it; else 3
STEPS = 10_000_000  # trains until cancelled


def _named(incident: dict[str, Any]) -> bool:
    """A confirmed incident about a rank, node or link, whatever its cause: a rank that sleeps shows
    no deviating GPU or host signal, and ``unknown`` is then the honest cause (tests/probe/test_stacks.py
    asks the same of ``artemis replay``)."""
    return (incident.get("confirmed_window") is not None and incident["state"] != "dismissed"
            and any(incident.get(k) is not None for k in ("rank", "node", "link")))


def _on_slowed(incident: dict[str, Any], node: str) -> bool:
    return incident.get("rank") == SLOW_RANK or incident.get("node") == node


def trial(cluster: SlurmCluster, daemon: ArtemisDaemon, mailbox: Mailbox, stack: str, args: argparse.Namespace,
          seed: int) -> dict[str, Any]:
    work = cluster.dir / "jobs" / f"stack-{stack}-{time.time_ns()}"
    work.mkdir(parents=True)
    slow_file = work / "slow-now"
    spec = {"stack": stack, "out": str(work), "steps": STEPS, "slow_rank": SLOW_RANK,
            "slow_ms": 1, "slow_file": str(slow_file)}
    job = TrainingJob.submit(cluster, daemon, nodes=NODES.get(stack, 3),
                             program=(STACK_SCRIPT, shlex.quote(json.dumps(spec))),
                             env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(work / "hf-home"),
                                  "TOKENIZERS_PARALLELISM": "false"})
    out: dict[str, Any] = {"stack": stack, "job": job.job_id}
    mails_before = len(mailbox.subjects())

    def incidents() -> list[dict[str, Any]]:
        return [i for i in daemon.incidents(everything=True) if i.get("job") == job.job_id]

    def training() -> bool:
        state = cluster.job_state(job.job_id)
        if state not in ("RUNNING", "PENDING", "CONFIGURING"):
            raise ClusterError(f"job {job.job_id} is {state}:\n{tail(job.out)}")
        return daemon.records_of(job.job_id) > 0

    try:
        job.wait_running()
        with NoisyNeighbour(seed=seed, phase_s=(10.0, 30.0)) as load:
            wait_until(training, f"{stack}'s first reports", timeout_s=180)
            began = time.monotonic()
            wait_until(lambda: not training() or time.monotonic() - began >= args.healthy_s,
                       f"{args.healthy_s:g} s of healthy training", timeout_s=args.healthy_s + 30, interval_s=2.0)
            control = incidents()
            out["control"] = {"incidents": len(control),
                              "by_kind": {kind: sum(i["kind"] == kind for i in control)
                                          for kind in sorted({i["kind"] for i in control})},
                              "confirmed": [brief(i) for i in control if i.get("confirmed_window") is not None]}
            node = job.rank_node(SLOW_RANK)
            healthy_step = statistics.median(r["ms"]["step"] for r in daemon.window_records(job.job_id)[-30:])
            out["healthy_step_ms"] = round(healthy_step, 1)
            out["slow_ms"] = round(args.slow * healthy_step, 1)
            ready = slow_file.with_suffix(".new")
            ready.write_text(f"{out['slow_ms']}")
            ready.rename(slow_file)  # whole: the rank reads the file once it exists
            slowed = time.monotonic()
            out["slowed_at"] = time.time()  # against the windows' t0/t1 in a trace
            try:
                first = job.wait_incident(_named, "an incident naming a rank, node or link",
                                          timeout_s=args.name_within_s)
                out["named"] = brief(first) | {"after_s": round(time.monotonic() - slowed, 1),
                                                "right": _on_slowed(first, node)}
            except ClusterError:
                out["named"] = None
            wall = time.time() - time.monotonic()
            out["neighbour"] = [[round(at + wall, 2), hogs] for at, hogs in load.phases]  # [wall time, busy loops]
            if args.traces is not None:  # before the job ends: its records go with it
                args.traces.mkdir(parents=True, exist_ok=True)
                trace = args.traces / f"{stack}-job{job.job_id}.jsonl"
                trace.write_text("".join(json.dumps(r) + "\n" for r in daemon.window_records(job.job_id)))
                out["trace"] = str(trace)
        after = incidents()
        out["named_elsewhere"] = [brief(i) for i in after if _named(i) and not _on_slowed(i, node)]
        out["incidents"] = len(after)
        out["drained"] = cluster.drain_reasons()
        out["mails"] = mailbox.subjects()[mails_before:]
    finally:
        end_trial(cluster, job)
    return out


def summary(trials: list[dict[str, Any]]) -> dict[str, Any]:
    done = [t for t in trials if "error" not in t]
    return {"stacks": len(trials), "errors": [t["stack"] for t in trials if "error" in t],
            "named_right": [t["stack"] for t in done if (t.get("named") or {}).get("right")],
            "named_wrong": [t["stack"] for t in done if t.get("named") and not t["named"]["right"]],
            "unnamed": [t["stack"] for t in done if t.get("named") is None],
            "after_s": {t["stack"]: t["named"]["after_s"] for t in done if t.get("named")},
            "control_confirmed": {t["stack"]: len(t["control"]["confirmed"]) for t in done
                                  if t["control"]["confirmed"]},
            "named_elsewhere": sum(len(t["named_elsewhere"]) for t in done),
            "mails": sum(len(t["mails"]) for t in done)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stacks", nargs="+", choices=sorted(STACKS), default=sorted(STACKS))
    parser.add_argument("--healthy-s", type=float, default=90.0, help="the control's seconds (default 90)")
    parser.add_argument("--slow", type=float, default=0.5,
                        help="rank 1's sleep before each iteration once slowed, as a share of the job's median "
                             "step over its last 30 windows before (default 0.5)")
    parser.add_argument("--name-within-s", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=28, help="the neighbour's first seed")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--traces", type=Path, help="write each job's window reports here (artemis replay)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("held_out_stacks runs the Slurm test cluster: run it as root", file=sys.stderr)
        return 2
    began = time.monotonic()
    trials: list[dict[str, Any]] = []
    # --traces keeps every window of a trial's job (HistoryWindowsKept, a storage setting: the analysis
    # holds its own history either way), so its replay starts where the job did.
    conf = ("HistoryWindowsKept=100000\n" if args.traces is not None else "") + DAEMON_CONF
    with own_tmpdir("artemis-held-out-stacks-"), SlurmCluster(nodes=4, health_interval_s=5) as cluster, \
            Mailbox() as mailbox, ArtemisDaemon(cluster, conf, mailbox) as daemon:
        faults.write_healthy_gpus(cluster)
        for stack in args.stacks:
            try:
                trials.append(trial(cluster, daemon, mailbox, stack, args, seed=args.seed + len(trials)))
            except ClusterError as err:  # the stack could not train here: a row lost, not the run
                trials.append({"stack": stack, "error": str(err)[-2000:]})
            print(json.dumps(trials[-1]), file=sys.stderr, flush=True)
    report({"wall_s": round(time.monotonic() - began, 1), "slow": args.slow, "healthy_s": args.healthy_s,
            "summary": summary(trials), "trials": trials}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
