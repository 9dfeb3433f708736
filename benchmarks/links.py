"""How often the matched probe names the right node's link, and the node check's counters: measured.

Issue 31's one number: when one node's link is degraded, how often do two matched probes agree
on the *right* node, how often on a wrong one, and how often do they name none — and what the
fabric counters say beside them.  Run as root (network namespaces, ``tc``):

    .venv/bin/python benchmarks/links.py --quick              # 3 trials per case, ~70 s
    .venv/bin/python benchmarks/links.py --trials 10 --json links.json

What runs, and what is real:

* ``NODES`` network namespaces on a bridge attached to nothing (``tests.cluster.netlab``: the
  test range 10.77.0.0/24, no default route), one gloo rank in each;
* every trial, the ranks run the probe's own matched micro-benchmark (``torch_hook.bench.run``,
  the code a ``probe`` directive runs in a training job) as often as the daemon asks for it about
  a job-wide slowdown (``trial``: one to ``MAX_LINK_PROBES``), and the daemon's own judgement
  (``confirm.judge_probe`` per probe, ``confirm.agree_on_link`` over them, at the shipped
  ``MinSlowdown``) names a node's link or none;
* around the probes each namespace's sysfs is read by the node check's own reader
  (``prolog_epilog.fabric``) and judged by the daemon's (``artemisd.fabric.findings``, each node
  against the others): "counters" names a node when exactly one shows a finding;
* "both" is what ``HardActionEvidence=root`` acts on: the probes' node, corroborated by that
  node's counters.

Every node's link is capped at ``LINK_RATE_BPS`` (``tc tbf`` on both ends of its veth), so the
probe's transfers are bound by their links, as on a real fabric, and not by what this machine's two
cores copy (a veth has no rate of its own).  A degradation of X % runs one node's link at
(100 - X) % of that rate, like a port trained at a lower rate: its transfers take 1 / (1 - X) as
long.  The fleet's link faults slow a *job's step* by their magnitude, which needs the transfers
slowed by at least as much, so this table is the hard end for the fleet's.
"Busy neighbour" pins the ring neighbour's rank to one core with two CPU hogs during the
trial: a loaded host that slows the transfers it takes part in, as a link would.  Controls degrade
nothing (with and without the busy neighbour) and must name nothing.

What it does not measure: detection and the probe's scheduling in front of the judgement (the
cluster test ``test_e2e.py::test_degraded_link_is_localised_to_the_node`` runs the whole loop; at
the shipped ``ProbeMinInterval`` the second probe waits up to that long).  ``median_s`` is the
time the probes took, the least a live naming can take.  A veth counts no symbol, CRC or
receive error under ``tbf``, so on this testbed the counters can only say nothing: that column
measures that they stay silent, and a real fabric's errors are tested on recorded sysfs trees
(tests/unit/test_fabric_sysfs.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NODES = 5
MAGNITUDES = (5, 10, 20, 40)
ROUND_TIMEOUT_S = 120.0
CALIBRATION_ROUNDS = 3
# Every node's link runs at this rate (``tc tbf`` on both ends of its veth): a fabric whose transfers
# are bound by their links, as a real one's are, not by what this machine's two cores copy.
LINK_RATE_BPS = 1e9


# --- the ranks ------------------------------------------------------------------------------------

def rank_main(rank: int, world: int, master: str, port: int, control: Path, nodes: list[str]) -> None:
    """One rank: wait for the driver's round number, run the matched probe, hand the results in."""
    import torch
    import torch.distributed as dist

    from torch_hook import bench

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=ROUND_TIMEOUT_S))
    round_no = torch.zeros(1, dtype=torch.int64)
    expected = 0
    while True:
        if rank == 0:
            go = control / f"go-{expected}"
            deadline = time.monotonic() + 3600.0
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            round_no[0] = int(go.read_text()) if go.exists() else -1
        dist.broadcast(round_no, 0)
        if int(round_no[0]) < 0:
            break
        errors: list[str] = []
        block = bench.run(f"links-{expected}", rank=rank, world=world, device=torch.device("cpu"),
                          island_group=None, nodes=nodes, errors=errors)
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object({"rank": rank, "probe": block, "errors": errors}, gathered if rank == 0 else None, dst=0)
        if rank == 0:
            tmp = control / f"result-{expected}.tmp"
            tmp.write_text(json.dumps(gathered))
            tmp.rename(control / f"result-{expected}.json")
        expected += 1
    dist.destroy_process_group()


# --- the driver -----------------------------------------------------------------------------------

class Ranks:
    """The gloo ranks, one per namespace, fed rounds through files in ``control``."""

    def __init__(self, lab: Any, control: Path, port: int):
        self.lab, self.control, self.round = lab, control, 0
        names = list(lab.nodes)
        master = lab.nodes[names[0]].address
        # gloo would bind the address the hostname resolves to (loopback): the node's own link instead.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
               "GLOO_SOCKET_IFNAME": next(iter(lab.nodes.values())).iface}
        self.procs = [subprocess.Popen(
            ["ip", "netns", "exec", lab.nodes[name].netns, sys.executable, str(Path(__file__).resolve()),
             "--rank", str(i), "--world", str(len(names)), "--master", master, "--port", str(port),
             "--control", str(control), "--nodes", ",".join(names)],
            env=env, stdout=subprocess.DEVNULL, stderr=open(control / f"rank{i}.log", "w"))
            for i, name in enumerate(names)]

    def _go(self, value: int) -> None:
        """Round ``self.round``'s go file, whole when rank 0 sees it (written aside, then renamed)."""
        aside = self.control / f"go-{self.round}.tmp"
        aside.write_text(str(value))
        aside.rename(self.control / f"go-{self.round}")

    def probe(self) -> dict[int, dict[str, Any]]:
        """One matched probe on every rank: rank -> its wire ``probe`` block."""
        n = self.round
        self._go(n)
        result = self.control / f"result-{n}.json"
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        while not result.exists():
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                logs = "\n".join((self.control / f"rank{i}.log").read_text()[-800:] for i in range(len(self.procs)))
                raise RuntimeError(f"round {n} did not come back:\n{logs}")
            time.sleep(0.02)
        self.round += 1
        return {item["rank"]: item["probe"] for item in json.loads(result.read_text())}

    def close(self) -> None:
        self._go(-1)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def fabric_event(netns: str, previous: dict[str, Any] | None, seconds: float | None) -> tuple[dict, dict]:
    """The node check's fabric reading inside ``netns`` (its own sysfs): (raw snapshot, event)."""
    code = ("import json, sys; sys.path.insert(0, %r); from prolog_epilog import fabric; "
            "print(json.dumps(fabric.snapshot()))" % str(ROOT))
    out = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    from prolog_epilog import fabric as node_fabric

    taken = json.loads(out)
    return taken, {"fabric": node_fabric.block(previous, taken, seconds)}


def judge(probes: list[dict[int, dict[str, Any]]], node_of: dict[int, str], min_slowdown: float
          ) -> tuple[str | None, list[str | None]]:
    """The daemon's verdict over the trial's probes: (the node two probes agree on, each probe's)."""
    from artemisd.confirm import ProbeVerdict, agree_on_link, judge_probe
    from artemisd.wire import ProbeResult

    judgements = []
    for blocks in probes:
        results = {rank: ProbeResult.model_validate(block) for rank, block in blocks.items()}
        judgements.append(judge_probe(results, set(), node_of, min_slowdown))
    combined = agree_on_link(judgements)
    named = [j.node if j.verdict is ProbeVerdict.LINK else None for j in judgements]
    return (combined.node if combined.verdict is ProbeVerdict.LINK else None), named


def counters_name(events: dict[str, dict[str, Any]]) -> str | None:
    """The node whose counters alone convict its link: exactly one node with a finding."""
    from artemisd import fabric

    shown = [node for node, event in events.items()
             if fabric.findings(event, [e for other, e in events.items() if other != node])]
    return shown[0] if len(shown) == 1 else None


def pair_ms(blocks: dict[int, dict[str, Any]]) -> list[float]:
    return [hop["ms"] for block in blocks.values() for hop in block.get("p2p") or ()]


def pairs(blocks: dict[int, dict[str, Any]], node_of: dict[int, str]) -> list[dict[str, Any]]:
    """Each ring pair's round trip and its two ends' run-queue waits, for the JSON's reader."""
    return [{"pair": f"{node_of[rank]}-{hop.get('node') or node_of[hop['peer']]}", "ms": hop["ms"],
             "wait_ms": hop.get("wait_ms"), "served_wait_ms": blocks.get(hop["peer"], {}).get("served_wait_ms")}
            for rank, block in sorted(blocks.items()) for hop in block.get("p2p") or ()]


def set_rate(node: Any, rate_bps: float) -> None:
    """Cap both ends of ``node``'s veth at ``rate_bps`` (``tc tbf``): what it sends and what it receives."""
    burst = max(16 << 10, int(rate_bps / 8 / 1000))  # a millisecond's worth: the rate holds within a trip
    for tc, dev in ((["tc"], node.host_veth), (["tc", "-n", node.netns], node.iface)):
        subprocess.run([*tc, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(rate_bps)}bit",
                        "burst", str(burst), "latency", "100ms"], check=True, capture_output=True, timeout=10)


class Degraded:
    """One node's link at (100 - X) % of the fabric's rate for the trial, then back."""

    def __init__(self, node: Any, magnitude: int):
        self.node, self.magnitude = node, magnitude

    def __enter__(self) -> Degraded:
        if self.magnitude:
            set_rate(self.node, LINK_RATE_BPS * (1 - self.magnitude / 100))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.magnitude:
            set_rate(self.node, LINK_RATE_BPS)


class Busy:
    """A loaded host: the node's rank and two CPU hogs share one core for the trial (the hogs are
    ours, stopped by PID; the rank floats over every core again afterwards)."""

    def __init__(self, node: Any | None, rank_pid: int | None, hogs: int = 2):
        self.node, self.rank_pid, self.hogs, self.procs = node, rank_pid, hogs, []

    def __enter__(self) -> Busy:
        if self.node is not None and self.rank_pid is not None:
            subprocess.run(["taskset", "-apc", "0", str(self.rank_pid)], check=True, capture_output=True,
                           timeout=10)
            self.procs = [subprocess.Popen(["ip", "netns", "exec", self.node.netns, "taskset", "-c", "0",
                                            sys.executable, "-c", "import time\nend = time.monotonic() + 600\n"
                                            "while time.monotonic() < end: pass"])
                          for _ in range(self.hogs)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(timeout=10)
        if self.procs:
            subprocess.run(["taskset", "-apc", f"0-{os.cpu_count() - 1}", str(self.rank_pid)],
                           capture_output=True, timeout=10)


def trial(ranks: Ranks, lab: Any, node_of: dict[int, str], min_slowdown: float) -> dict[str, Any]:
    """The matched probes the daemon asks about one job-wide slowdown's link, and the counters around
    them, judged as the daemon judges them: a probe, then another while the latest named a link
    and the last two do not agree yet, up to ``confirm.MAX_LINK_PROBES``."""
    from artemisd import fabric
    from artemisd.confirm import MAX_LINK_PROBES

    before = {name: fabric_event(node.netns, None, None)[0] for name, node in lab.nodes.items()}
    t0 = time.monotonic()
    probes = [ranks.probe()]
    named, each = judge(probes, node_of, min_slowdown)
    while named is None and each[-1] is not None and len(probes) < MAX_LINK_PROBES:
        probes.append(ranks.probe())
        named, each = judge(probes, node_of, min_slowdown)
    seconds = time.monotonic() - t0
    events = {name: fabric_event(node.netns, before[name], seconds)[1] for name, node in lab.nodes.items()}

    counted = counters_name(events)
    corroborated = named if named is not None and fabric.findings(
        events[named], [e for other, e in events.items() if other != named]) else None
    return {"probes": named, "each_probe": each, "counters": counted, "both": corroborated,
            "seconds": round(seconds, 3), "pairs": [pairs(p, node_of) for p in probes]}


def tally(rows: list[dict[str, Any]], evidence: str) -> dict[str, Any]:
    right = sum(1 for r in rows if r[evidence] is not None and r[evidence] == r["target"])
    wrong = sum(1 for r in rows if r[evidence] is not None and r[evidence] != r["target"])
    times = [r["seconds"] for r in rows if r[evidence] is not None and r[evidence] == r["target"]]
    return {"right": right, "wrong": wrong, "unnamed": len(rows) - right - wrong, "trials": len(rows),
            "median_s": round(statistics.median(times), 3) if times else None}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"by_magnitude": {}, "by_evidence": {}, "controls": {}}
    degraded = [r for r in rows if r["magnitude"]]
    controls = [r for r in rows if not r["magnitude"]]
    for evidence in ("probes", "counters", "both"):
        per = out["by_evidence"][evidence] = {}
        for magnitude in sorted({r["magnitude"] for r in degraded}):
            for busy in (False, True):
                case = [r for r in degraded if r["magnitude"] == magnitude and r["busy"] == busy]
                if case:
                    per[f"{magnitude}{'+busy' if busy else ''}"] = tally(case, evidence)
        out["controls"][evidence] = {"named": sum(1 for r in controls if r[evidence] is not None),
                                     "trials": len(controls)}
    for magnitude in sorted({r["magnitude"] for r in degraded}):
        out["by_magnitude"][str(magnitude)] = tally([r for r in degraded if r["magnitude"] == magnitude], "probes")
    out["controls"].update(out["controls"]["probes"])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10, help="trials per magnitude and neighbour (default 10)")
    parser.add_argument("--quick", action="store_true", help="3 trials per case")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the numbers as JSON here")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--control", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--nodes", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.world, args.master, args.port, args.control, args.nodes.split(","))
        return 0
    if os.geteuid() != 0:
        print("benchmarks/links.py: must run as root (network namespaces and tc)", file=sys.stderr)
        return 2

    import signal
    import tempfile

    from torch_hook import bench

    # Stopped from outside (SIGTERM), the namespaces, qdiscs and ranks still go (the with blocks).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from artemisd.config import AnalysisSettings
    from tests.cluster.netlab import NetLab, namespaces_available

    why = namespaces_available()
    if why:
        print(f"benchmarks/links.py: {why}", file=sys.stderr)
        return 2
    trials = 3 if args.quick else args.trials
    min_slowdown = AnalysisSettings().min_slowdown
    rng = random.Random(args.seed)
    names = [f"n{i + 1}" for i in range(NODES)]
    node_of = dict(enumerate(names))
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="artemis-links-") as tmp, NetLab(names) as lab:
        for node in lab.nodes.values():
            set_rate(node, LINK_RATE_BPS)
        ranks = Ranks(lab, Path(tmp), port=29500 + rng.randrange(1000))
        try:
            calibration = [ranks.probe() for _ in range(CALIBRATION_ROUNDS)]
            healthy_ms = statistics.median(ms for blocks in calibration for ms in pair_ms(blocks))
            print(f"calibration: on {LINK_RATE_BPS / 1e9:g} Gbit/s links a healthy ring pair's round trip of "
                  f"{bench.CPU_SIZES[2] >> 20} MiB each way takes {healthy_ms:.2f} ms (median over {NODES} "
                  f"namespaces, {CALIBRATION_ROUNDS} probes); MinSlowdown {min_slowdown}", flush=True)
            cases = [(m, busy) for m in (0, *MAGNITUDES) for busy in (False, True)]
            plan = [case for case in cases for _ in range(trials)]
            rng.shuffle(plan)
            for i, (magnitude, busy) in enumerate(plan):
                target = rng.choice(names)
                neighbour = names[(names.index(target) + 1) % NODES]
                with Busy(lab.nodes[neighbour] if busy else None, ranks.procs[names.index(neighbour)].pid), \
                        Degraded(lab.nodes[target], magnitude):
                    row = trial(ranks, lab, node_of, min_slowdown)
                row.update(magnitude=magnitude, busy=busy, target=target if magnitude else None,
                           neighbour=neighbour if busy else None)
                rows.append(row)
                print(f"[{i + 1}/{len(plan)}] {magnitude:>2} %{' +busy' if busy else '      '} on "
                      f"{target if magnitude else '-':<3} probes named {row['probes'] or '-':<3} "
                      f"(each {row['each_probe']}), counters {row['counters'] or '-'}; {row['seconds']:.1f} s",
                      flush=True)
        finally:
            ranks.close()
            lab.kill_all()
    result = summarize(rows)
    result.update(nodes=NODES, trials_per_case=trials, min_slowdown=min_slowdown, seed=args.seed,
                  healthy_round_trip_ms=round(healthy_ms, 3), seconds=round(time.monotonic() - started, 1))
    print(f"\n{'case':<10} {'right':>5} {'wrong':>5} {'unnamed':>7}  median_s   (probes / counters / both)")
    for case, row in result["by_evidence"]["probes"].items():
        cols = [result["by_evidence"][e][case] for e in ("probes", "counters", "both")]
        print(f"{case + ' %':<10} " + " / ".join(f"{c['right']}/{c['wrong']}/{c['unnamed']}" for c in cols)
              + f"   {row['median_s']}")
    print("controls named: " + ", ".join(f"{e} {result['controls'][e]['named']}/{result['controls'][e]['trials']}"
                                         for e in ("probes", "counters", "both")))
    print(f"{result['seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({**result, "trials": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
