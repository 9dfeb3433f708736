"""artemisd at scale on PostgreSQL: ingest, analysis, a standby's follow, a cold restore, and a sizing table.

    .venv/bin/python benchmarks/scale.py                          # 100,000 ranks, 3 windows
    .venv/bin/python benchmarks/scale.py --ranks 10000 --windows 4 --batch 8

One job of ``--ranks`` ranks (8 GPUs per node, one island) reporting
``--windows`` windows, records shaped like the probe's (step split, p50s, one
collective, GPU and host telemetry, environment fingerprint; ~900 bytes of
JSON).  A throwaway PostgreSQL server (tests/unit/pg.py, unix socket,
PostgreSQL's defaults: every commit flushed) holds the state.  Each window is
posted as bodies of ``--batch`` records (1,024: a forwarder's batch; 8: one
node's ranks) and goes through what ``POST /v1/reports`` does minus HTTP and
authentication: ``ingest.fast_records`` (every bound; the careful
``decode_body`` + ``Daemon.validate`` for any other body), and
``Daemon.accept`` (stored in one transaction per body, analysed).  Timed,
as CPU seconds per 100,000 reports:

* **validate**: decode + validate, on the leader;
* **accept**: store + analyse + directives, on the leader (of which
  **analyzer**: ``Analyzer.ingest`` of the same records in a fresh analyzer,
  window close and frame analysis included);
* **PostgreSQL**: the server's processes' CPU over the ingest (from /proc);
* **follow**: a standby on the same database catching up on those windows
  (``Daemon.follow``: read, decode, validate, analyse) — a standby's steady
  cost, and the work of a takeover, which follows the last turn's records;
* **restore**: a daemon started on that database (``Daemon.restore``, as after
  a restart of every instance);
* **standby read**, **standby accept**, **standby postgresql** and **leader
  analyses it**: the same windows posted to the standby of a second pair
  (any instance takes reports): its read, its ``accept`` (validated bodies
  checked, stored, nothing analysed) and the PostgreSQL server's CPU over
  that accept (their sum, printed last, is what a window costs before any
  analysis: issue 12's ingest target), then the leader's
  turn (``Daemon.follow``: read back, decode, analyse, publish).  Read
  against **accept**, it is the leader's CPU a standby takes off it;
* **front door** (``--door-ranks``, 4,096 by default; 0 skips it): a real
  ``artemisd`` process (AuthType=none) on a third database, fed over HTTP
  by a client on another CPU: two windows with each report its own request
  (what every rank's sender posts) and two in bodies of 8 (one node's
  ranks), each request on a new connection (``door_*_posts``), the same
  over one kept-alive connection (``door_*_kept``: the probe's sender keeps
  its connection), and over 64 kept-alive connections posting at once
  (``door_*_together``: a job's ranks end a window at the same step); the
  server's CPU, and PostgreSQL's, per 100,000 reports of each.  Everything
  else above is per report; this is what a request costs.

The sizing table extrapolates linearly from those costs (every one of them
is linear in the reports or the requests: per-record work plus one analysis
per window whose cost is ~25 ms at 100k ranks, docs/benchmarks.md "Analysis
cost").  The process is pinned to one CPU, BLAS pools to one thread.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import http.client  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from artemisd.auth import TRUSTED_LOCAL  # noqa: E402
from artemisd.config import parse_config_text  # noqa: E402
from artemisd.ingest import decode_body, fast_records  # noqa: E402
from artemisd.pipeline import Analyzer  # noqa: E402
from artemisd.server import configure_logging, tune_gc  # noqa: E402
from artemisd.service import Daemon  # noqa: E402
from artemisd.slurm.cli import CliSlurm  # noqa: E402
from artemisd.wire import DEFAULT_MAX_WORLD  # noqa: E402
from benchmarks.ingest import artemisd_of, cpu_seconds, free_port  # noqa: E402
from tests.unit.pg import PASSWORD, PgServer  # noqa: E402

GPUS_PER_NODE = 8
WINDOW_S = 10.0
# Connections posting at once in the ``_together`` shapes: a job's ranks finish a window at the same
# step and post within moments of each other (64 client threads here; a real burst is the job's ranks).
TOGETHER = 64


def window(seq: int, ranks: int, rng: random.Random) -> list[dict[str, Any]]:
    """One window of a healthy job, as its probes send it."""
    out = []
    t0 = 1.8e9 + seq * WINDOW_S
    for rank in range(ranks):
        busy = 180.0 * (1 + rng.gauss(0, 0.02))
        step = 250.0
        out.append({
            "type": "window", "v": 1, "job": "777001", "step": "0", "rank": rank, "world": ranks,
            "node": f"gpu{rank // GPUS_PER_NODE:05d}", "island": "nvidia:H100",
            "device": {"vendor": "nvidia", "model": "H100", "index": rank % GPUS_PER_NODE},
            "window": {"seq": seq, "first_step": seq * 40, "steps": 40, "t0": t0, "t1": t0 + WINDOW_S},
            "ms": {"step": step, "busy": round(busy, 3), "compute": round(busy - 5, 3), "data": 5.0,
                   "comm_wait": round(step - busy, 3)},
            "ms_p50": {"step": step, "busy": round(busy, 3)},
            "samples": 32.0,
            "collectives": [{"op": "all_reduce", "group": "world", "calls": 40, "bytes": 4.2e9, "ms": 2800.0}],
            "gpu": {"sm_clock_mhz": 1980.0, "max_sm_clock_mhz": 1980.0, "power_w": 650.0, "power_limit_w": 700.0,
                    "temp_c": 61.0, "util_pct": 97.0, "throttle": [], "ecc_uncorrected": 0, "pcie_replay": 0},
            "host": {"cpu_pct": 35.0, "steal_pct": 0.0, "iowait_pct": 0.1, "ctx_invol_per_s": 40.0,
                     "net_retransmits_per_s": 0.0},
            "env": {"driver": "550.54.15", "comm_lib": "nccl 2.21.5", "torch": "2.13.0",
                    "config": "sha256:24a571cf962c0cd0c0cd6edcadb1c69e5a9cfc597933f6ce5fcc9ba69591dac1"},
            "dropped_reports": 0,
        })
    return out


def server_cpu_s(pg: PgServer) -> float:
    """CPU seconds of every process of the PostgreSQL server (postmaster and its backends)."""
    tick = os.sysconf("SC_CLK_TCK")
    root = pg.proc.pid
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid = int(entry.name), int(fields[1])
        if pid == root or ppid == root:
            total += int(fields[11]) + int(fields[12])
    return total / tick


def read(leader: Daemon, body: bytes) -> tuple[list, list, bytes | None]:
    """What POST /v1/reports does with a body: the fast path (the body goes on to ``accept``, which stores
    it as it came), or the careful one for any other body."""
    records = fast_records(body, leader.config.daemon.max_world)
    if records is not None:
        return records, [], body
    return (*leader.validate(decode_body(body)), None)


def daemon(url: str, secret: Path, listen: str, ranks: int) -> Daemon:
    # MaxWorld (65,536 by default) raised as a site with a 100k-rank job would.
    config = parse_config_text(f"StateURL={url}\nStatePasswordFile={secret}\nAuthType=none\nListen={listen}\n"
                               f"MaxWorld={max(ranks, DEFAULT_MAX_WORLD)}\n")
    return Daemon(config, CliSlurm(timeout=2, env={"SLURM_CONF": "/nonexistent", "PATH": os.environ["PATH"]}))


def measure(ranks: int, windows: int, batch: int, door_ranks: int, cpu: int, door_baseline: str | None = None
            ) -> dict[str, float]:
    rng = random.Random(7)
    bodies = []
    for seq in range(windows):
        recs = window(seq, ranks, rng)
        bodies.append([json.dumps(recs[i:i + batch]).encode() for i in range(0, ranks, batch)])
    reports = ranks * windows
    out: dict[str, float] = {"reports": reports, "body_bytes_per_report": sum(map(len, bodies[0])) / ranks}
    pg = PgServer(durable=True).start()
    try:
        url = pg.create_database("scale")
        with tempfile.TemporaryDirectory() as tmp:
            secret = Path(tmp, "pw")
            secret.write_text(PASSWORD + "\n")
            secret.chmod(0o600)
            leader = daemon(url, secret, "127.0.0.1:7701", ranks)
            standby = daemon(url, secret, "127.0.0.1:7702", ranks)
            assert (leader.role, standby.role) == ("leader", "standby")

            # Window by window, each body read then accepted, as the server does: nothing is
            # held across windows that the daemon would not hold (a heap of every window's
            # records would make the cyclic GC, not ingest, the cost).
            out.update(validate=0.0, accept=0.0, postgresql=0.0, analyzer=0.0)
            analyzer = Analyzer(leader.config.analysis, id_prefix="A-", active_probe=True)
            for window_bodies in bodies:
                start = time.process_time()
                batches = [read(leader, body) for body in window_bodies]
                out["validate"] += time.process_time() - start
                pg_before = server_cpu_s(pg)
                start = time.process_time()
                for records, rejected, fast_body in batches:
                    result = leader.accept(records, TRUSTED_LOCAL, {}, rejected, fast_body)
                    assert not result.rejected, result.rejected[:3]
                out["accept"] += time.process_time() - start
                out["postgresql"] += server_cpu_s(pg) - pg_before
                start = time.process_time()
                for records, _, _ in batches:
                    for _, rec in records:
                        analyzer.ingest(rec)
                out["analyzer"] += time.process_time() - start
                del batches

            leader.follow()  # the leader's turn: between turns its mark moves at most once a second
            start = time.process_time()
            fed = standby.follow()
            out["follow"] = time.process_time() - start
            assert fed == reports, (fed, reports)

            start = time.process_time()
            restarted = daemon(url, secret, "127.0.0.1:7703", ranks)
            out["restore"] = time.process_time() - start
            for d in (leader, standby, restarted):
                d.store.close()
            out.update(split_analysis(pg, secret, bodies, ranks))
            if door_ranks:
                out.update(front_door(pg, secret, door_ranks, cpu))
                if door_baseline:
                    out.update(door_side_by_side(pg, secret, door_ranks, cpu, door_baseline, Path(tmp)))
    finally:
        pg.stop()
    return out


def split_analysis(pg: PgServer, secret: Path, bodies: list[list[bytes]], ranks: int) -> dict[str, float]:
    """A second pair on a fresh database: every window posted to the standby, which stores it; the
    leader's next turn analyses it.  CPU seconds of each side."""
    url = pg.create_database("scale_split")
    leader = daemon(url, secret, "127.0.0.1:7711", ranks)
    standby = daemon(url, secret, "127.0.0.1:7712", ranks)
    assert (leader.role, standby.role) == ("leader", "standby")
    out = {"standby_read": 0.0, "standby_accept": 0.0, "standby_postgresql": 0.0, "leader_analyses_it": 0.0}
    for window_bodies in bodies:
        start = time.process_time()
        batches = [read(standby, body) for body in window_bodies]
        out["standby_read"] += time.process_time() - start
        pg_before = server_cpu_s(pg)
        start = time.process_time()
        for records, rejected, fast_body in batches:
            result = standby.accept(records, TRUSTED_LOCAL, {}, rejected, fast_body)
            assert not result.rejected and result.accepted == len(records), result.rejected[:3]
        out["standby_accept"] += time.process_time() - start
        out["standby_postgresql"] += server_cpu_s(pg) - pg_before
        del batches
        start = time.process_time()
        fed = leader.follow()
        out["leader_analyses_it"] += time.process_time() - start
        assert fed == ranks, (fed, ranks)
    assert leader.store.analysed_through() > 0
    for d in (leader, standby):
        d.store.close()
    return out


def front_door(pg: PgServer, secret: Path, ranks: int, cpu: int, tree: Path = ROOT, name: str = "scale_door"
               ) -> dict[str, float]:
    """A real artemisd (the one in ``tree``) on ``cpu``, fed over HTTP: two windows of one-report
    requests and two in bodies of 8, each request on a new connection (``_posts``), and the same
    over one kept-alive connection (``_kept``), as the probe posts since 2026-12-06 where its
    daemon's ``IdleTimeout`` outlasts a window; then both sizes from ``TOGETHER`` kept-alive
    connections at once (``_together``: a job's ranks post within moments of each other, and the
    daemon stores the requests that are ready together in one statement, ``GroupCommit``).  A
    window at a time, shapes alternating (A B B A), so neither has the warmer daemon or the smaller
    tables.  Its CPU and PostgreSQL's per shape."""
    url = pg.create_database(name)
    port = free_port()
    rng = random.Random(11)
    shapes = {"door_rank_posts": (1, False, 1), "door_rank_kept": (1, True, 1),
              "door_node_posts": (GPUS_PER_NODE, False, 1), "door_node_kept": (GPUS_PER_NODE, True, 1),
              "door_rank_together": (1, True, TOGETHER), "door_node_together": (GPUS_PER_NODE, True, TOGETHER)}
    names = list(shapes)
    order = [names[i] for i in (0, 1, 1, 0, 2, 3, 3, 2, 4, 5, 5, 4)]
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp, "artemis.conf")
        conf.write_text(f"Listen=127.0.0.1:{port}\nAuthType=none\nStateURL={url}\nStatePasswordFile={secret}\n"
                        f"MaxWorld={max(ranks, DEFAULT_MAX_WORLD)}\nSlurmTimeout=2\n")
        env = dict(os.environ, SLURM_CONF="/nonexistent", PYTHONPATH=str(tree))
        # cwd: ``-m`` puts the working directory first on sys.path, before PYTHONPATH.
        proc = subprocess.Popen([sys.executable, "-m", "artemisd.server", "-c", str(conf)], env=env, cwd=tree,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
        client_cpu = next((c for c in sorted(os.sched_getaffinity(0) | set(range(os.cpu_count() or 1)))
                           if c != cpu), cpu)
        mine = os.sched_getaffinity(0)
        out: dict[str, float] = {}
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(f"{base}/v1/health", timeout=1).read()
                    break
                except OSError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError("artemisd did not answer /v1/health") from None
                    time.sleep(0.1)
            os.sched_setaffinity(0, {client_cpu})
            seq = 0
            for name in order:
                size, kept, connections = shapes[name]
                recs = window(seq, ranks, rng)
                seq += 1
                bodies = [(json.dumps(recs[i:i + size]).encode(), len(recs[i:i + size]))
                          for i in range(0, ranks, size)]
                server_before, pg_before = cpu_seconds(proc.pid), server_cpu_s(pg)
                with ThreadPoolExecutor(connections) as pool:
                    list(pool.map(lambda part: post_all(port, part, kept), (bodies[i::connections]
                                                                           for i in range(connections))))
                # Scaled to the reports the main stages count, so per_100k reads alike.
                out[name] = out.get(name, 0.0) + cpu_seconds(proc.pid) - server_before
                pg_name = name.replace("door", "door_pg")
                out[pg_name] = out.get(pg_name, 0.0) + server_cpu_s(pg) - pg_before
                out[name + "_reports"] = out.get(name + "_reports", 0) + ranks
        finally:
            os.sched_setaffinity(0, mine)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    return out


def post_all(port: int, bodies: list[tuple[bytes, int]], kept: bool) -> None:
    """``bodies`` posted one after the other, each over a new connection or all over one kept alive."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for body, count in bodies:
        conn.request("POST", "/v1/reports", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        reply = json.loads(response.read())
        assert response.status == 200 and reply["accepted"] == count, reply
        if not kept:
            conn.close()  # the next request opens a new one
    conn.close()


def door_side_by_side(pg: PgServer, secret: Path, ranks: int, cpu: int, baseline: str, tmp: Path
                      ) -> dict[str, float]:
    """The front door of this tree and of git revision ``baseline``, alternating (B A A B), each on a
    fresh database: medians of two runs each, as ``<measure>@<rev>`` and ``<measure>@this``."""
    import statistics

    old = artemisd_of(baseline, tmp / "baseline")
    runs: dict[str, list[dict[str, float]]] = {baseline: [], "this": []}
    for n, label in enumerate((baseline, "this", "this", baseline)):
        runs[label].append(front_door(pg, secret, ranks, cpu, old if label == baseline else ROOT,
                                      f"scale_door_{n}"))
    return {f"{key}@{label}": statistics.median(run[key] for run in got)
            for label, got in runs.items() for key in got[0]}


def sizing(per_100k: dict[str, float], keep: int, idle_timeout_s: float) -> list[str]:
    """Cores of this machine per load.  With the front door measured, the instances' cores are its
    figures (HTTP, store and analysis of one-report and of 8-report requests): over kept-alive
    connections where the window is shorter than ``IdleTimeout`` (the probe's connection is still
    open at its next window), else a new connection per request, each request alone (the most a
    request costs); and one-report requests arriving together (a job's ranks end a window at the
    same step), stored together; without it, the in-process figures of bodies of ``--batch``."""
    door = "door_rank_posts" in per_100k
    heads = (["artemisd cores, each rank posting", "artemisd cores, a node's 8 per request",
              "PostgreSQL cores, each rank posting", "artemisd + PostgreSQL cores, ranks posting together"]
             if door else ["leader cores (validate + accept)", "PostgreSQL cores"])
    rows = ["| GPUs | window | reports/s | " + " | ".join(heads) + " | standby cores (follow) | stored reports "
            "| cold restore |", "|---:" * (len(heads) + 6) + "|"]
    for gpus in (1_000, 10_000, 100_000):
        for window_s in (10, 60):
            rate = gpus / window_s
            if door:
                shape = "kept" if "door_rank_kept" in per_100k and window_s < idle_timeout_s else "posts"
                cores = [per_100k[f"door_rank_{shape}"], per_100k[f"door_node_{shape}"],
                         per_100k[f"door_pg_rank_{shape}"],
                         per_100k["door_rank_together"] + per_100k["door_pg_rank_together"]]
            else:
                cores = [per_100k["validate"] + per_100k["accept"], per_100k["postgresql"]]
            follow = rate * per_100k["follow"] / 100_000
            restore = gpus * keep * per_100k["restore"] / 100_000
            rows.append(f"| {gpus:,} | {window_s} s | {rate:,.0f} | "
                        + " | ".join(f"{rate * c / 100_000:.2f}" for c in cores)
                        + f" | {follow:.2f} | {gpus * keep:,} | {restore / 60:,.1f} min |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=100_000)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1024, help="records per request body")
    parser.add_argument("--cpu", type=int, default=0, help="CPU to pin this process (and the front door's "
                        "artemisd) to")
    parser.add_argument("--door-ranks", type=int, default=4096,
                        help="ranks of the job fed to a real artemisd over HTTP (0: skip the front door)")
    parser.add_argument("--door-baseline", metavar="REV",
                        help="also measure the front door of git revision REV against this tree's, alternating")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    configure_logging()
    logging.getLogger().setLevel(logging.WARNING)
    tune_gc()
    got = measure(args.ranks, args.windows, args.batch, args.door_ranks, args.cpu, args.door_baseline)
    reports = got["reports"]
    def reports_of(key: str) -> float:
        bare = key.split("@")[0].replace("door_pg", "door")
        return got.get(bare + "_reports", reports)

    counted = {k: reports_of(k) for k in got
               if k not in ("reports", "body_bytes_per_report") and "_reports" not in k}
    per_100k = {k: got[k] * 100_000 / n for k, n in counted.items()}
    print(f"{args.ranks:,} ranks x {args.windows} windows = {reports:,.0f} reports, bodies of {args.batch}, "
          f"{got['body_bytes_per_report']:.0f} bytes/report; front door: {args.door_ranks:,} ranks x 2 windows "
          f"per request shape")
    print(f"{'':24}{'CPU s':>10}{'per 100k reports':>20}{'reports/CPU-s':>16}")
    for key, value in per_100k.items():
        print(f"{key:24}{got[key]:10.2f}{value:20.2f}{counted[key] / got[key] if got[key] else float('inf'):16,.0f}")
    stored = sum(per_100k[k] for k in ("standby_read", "standby_accept", "standby_postgresql"))
    print(f"\na {100_000:,}-rank window read, validated and stored, before any analysis (standby_read + "
          f"standby_accept + standby_postgresql): {stored:.2f} CPU-s")
    defaults = parse_config_text("").daemon
    keep, idle = defaults.history_windows_kept, defaults.idle_timeout
    print(f"\nsizing (linear in reports; HistoryWindowsKept={keep}; requests on kept-alive connections where "
          f"the window is shorter than IdleTimeout={idle:g} s):")
    print("\n".join(sizing(per_100k, keep, idle)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
