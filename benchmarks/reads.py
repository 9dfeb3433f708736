"""What heavy reads cost everyone else: /v1/health and report intake while readers pull a big job's windows.

Issue 27, item 5: one anonymous read of an incident's windows (30-50k stored
reports) ran on the event loop for seconds, and 8 readers at once pushed
``/v1/health`` to 5-10 s, with every report behind it.  This starts a real
artemisd (AuthType=none, 127.0.0.1, no Slurm) for each tree, stores a job of
``--ranks`` x ``--windows`` reports whose GPU fault opens an incident, then
for ``--seconds`` runs ``--readers`` threads that each read the job's newest
50,000 window reports again and again (one request on a tree that answers
them at once, page after page on one that pages, as ``artemis show --plot``
does), while one thread asks ``/v1/health`` every 0.2 s and another posts a
small report every 0.5 s.  It prints the latency of both, idle and under the
readers, for this tree and, with ``--baseline REV``, the artemisd of that git
revision side by side in one run.

    .venv/bin/python benchmarks/reads.py --baseline f79087a

Loopback only; every loop is bounded by ``--seconds``; each daemon is stopped by its PID.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ingest import artemisd_of, free_port, trace  # noqa: E402

PLOT_REPORTS = 50_000
PAGE = 20_000


def _get(url: str, timeout: float = 120) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def newest_windows(url: str, incident: str) -> int:
    """Reports read: the newest PLOT_REPORTS, paged where the daemon pages (it says ``before``)."""
    page = _get(f"{url}/v1/incidents/{incident}/windows?limit={PAGE}")
    got = len(page["windows"])
    for _ in range(100):
        if "before" not in page or got >= PLOT_REPORTS:
            break
        page = _get(f"{url}/v1/incidents/{incident}/windows?limit={PAGE}&before={page['before']}")
        got += len(page["windows"])
    return got


def small_report(seq: int) -> bytes:
    t0 = time.time()
    return json.dumps([{"type": "window", "v": 1, "job": "5", "rank": r, "world": 2, "node": "n1",
                        "window": {"seq": seq, "first_step": seq * 10, "steps": 10, "t0": t0, "t1": t0 + 1},
                        "ms": {"step": 50.0, "busy": 30.0, "comm_wait": 20.0}, "samples": 10}
                       for r in range(2)]).encode()


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50_ms": None, "p95_ms": None, "max_ms": None}
    ordered = sorted(values)
    return {"n": len(values), "p50_ms": round(1000 * statistics.median(ordered), 1),
            "p95_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 1),
            "max_ms": round(1000 * ordered[-1], 1)}


def measure(url: str, seconds: float, readers: int, incident: str | None, seq0: int) -> dict[str, Any]:
    stop = threading.Event()
    health: list[float] = []
    intake: list[float] = []
    reads: list[float] = []
    errors: list[str] = []

    def ask_health() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                _get(f"{url}/v1/health", timeout=60)
                health.append(time.perf_counter() - t0)
            except (OSError, urllib.error.URLError) as err:
                errors.append(f"health: {err}")
            stop.wait(0.2)

    def post_reports() -> None:
        seq = seq0
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                req = urllib.request.Request(f"{url}/v1/reports", data=small_report(seq), method="POST")
                urllib.request.urlopen(req, timeout=60).read()
                intake.append(time.perf_counter() - t0)
            except (OSError, urllib.error.URLError) as err:
                errors.append(f"intake: {err}")
            seq += 1
            stop.wait(0.5)

    def read_windows() -> None:
        while not stop.is_set() and incident is not None:
            t0 = time.perf_counter()
            try:
                newest_windows(url, incident)
                reads.append(time.perf_counter() - t0)
            except (OSError, urllib.error.URLError) as err:
                errors.append(f"read: {err}")
                stop.wait(0.5)

    threads = [threading.Thread(target=ask_health), threading.Thread(target=post_reports)]
    threads += [threading.Thread(target=read_windows) for _ in range(readers)]
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=180)
    return {"health": percentiles(health), "intake": percentiles(intake), "read_50k": percentiles(reads),
            "errors": len(errors), "first_error": errors[0] if errors else None}


def run_tree(name: str, tree: Path, windows: list[list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "artemis.conf"
        conf.write_text(f"Listen=127.0.0.1:{port}\nAuthType=none\nStateDir={tmp}/state\nSlurmTimeout=2\n"
                        f"MaxWorld=65536\nHistoryWindowsKept={len(windows) + 10}\n")
        conf.chmod(0o644)
        env = dict(os.environ, SLURM_CONF="/nonexistent", PYTHONPATH=str(tree))
        proc = subprocess.Popen([sys.executable, "-m", "artemisd.server", "-c", str(conf)], env=env, cwd=tmp,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    _get(f"{url}/v1/health", timeout=1)
                    break
                except OSError:
                    time.sleep(0.1)
            for window in windows:
                req = urllib.request.Request(f"{url}/v1/reports", data=json.dumps(window).encode(), method="POST")
                urllib.request.urlopen(req, timeout=120).read()
            incidents = _get(f"{url}/v1/incidents?all=1")["incidents"]
            incident = incidents[0]["id"] if incidents else None
            idle = measure(url, min(5.0, args.seconds), 0, None, 0)
            loaded = measure(url, args.seconds, args.readers, incident, 10_000)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return {"tree": name, "incident": incident, "idle": idle, "under_readers": loaded}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--windows", type=int, default=80)
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--baseline", metavar="REV", help="also run the artemisd of this git revision, first")
    parser.add_argument("--json", metavar="FILE", help="write the results here too")
    args = parser.parse_args()
    windows = trace(args.ranks, args.windows)
    root = Path(__file__).resolve().parents[1]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        trees = [(args.baseline, artemisd_of(args.baseline, Path(tmp) / "baseline"))] if args.baseline else []
        trees.append(("this", root))
        for name, tree in trees:
            results.append(run_tree(name, tree, windows, args))
    print(f"{args.ranks} ranks x {args.windows} windows = {args.ranks * args.windows:,} stored reports; "
          f"{args.readers} readers of the newest {PLOT_REPORTS:,} for {args.seconds:g} s")
    print(f"{'tree':10} {'phase':14} {'health p50/p95/max ms':>26} {'intake p50/p95/max ms':>26} "
          f"{'50k read p50 ms':>16} {'reads':>6} {'errors':>7}")
    for r in results:
        for phase in ("idle", "under_readers"):
            m = r[phase]
            fmt = lambda p: f"{p['p50_ms']}/{p['p95_ms']}/{p['max_ms']}"  # noqa: E731
            print(f"{r['tree']:10} {phase:14} {fmt(m['health']):>26} {fmt(m['intake']):>26} "
                  f"{str(m['read_50k']['p50_ms']):>16} {m['read_50k']['n']:>6} {m['errors']:>7}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
