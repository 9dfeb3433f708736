"""artemisd ingest rate and report→incident latency, on one core.

    .venv/bin/python benchmarks/ingest.py                  # in-process, 256 ranks, 40 windows
    .venv/bin/python benchmarks/ingest.py --http           # also through HTTP to a real artemisd
    .venv/bin/python benchmarks/ingest.py --ranks 1024 --windows 20
    .venv/bin/python benchmarks/ingest.py --baseline REV   # this tree vs git REV, side by side
    .venv/bin/python benchmarks/ingest.py --single-window 100000 --baseline REV --rounds 2

Records come from the simulator (``artemisd.sim``): one job, a healthy
lockstep phase, then one GPU with stuck clocks, so the last windows confirm an
incident.  What is timed:

* **parse**: body → records (``decode_body`` + ``Daemon.validate``), the cost
  of the wire contract alone;
* **ingest**: parse + SQLite (WAL) + ``Analyzer.ingest`` + directives — the
  whole ``POST /v1/reports`` minus HTTP and auth; one body per window of the
  whole job (what a proxy or a batching sender posts) and one body per rank
  (what each rank's own sender posts);
* **analyzer**: ``Analyzer.ingest`` alone, for the share of the total;
* **latency**: from the start of the request carrying the last report of the
  confirming window to the incident being readable as ``confirmed``.  The
  detection delay itself is ConfirmWindows windows of training time, by design;
* **--http**: a real ``artemisd`` (AuthType=none) pinned to one CPU, posted to
  by a client pinned to another, windows as JSON arrays; then a fresh one fed
  each report as its own request (``http_rank_posts``), as the probes send them.

Rates are reports per CPU-second of the process doing the work (process CPU
time, so other load on a shared machine slows the wall clock, not the
figure); ``http_window_batches_wall`` is the wall-clock rate for comparison.
Latencies are wall clock.  The process is pinned to one CPU (``--cpu``) and
BLAS pools to one thread; medians of ``--repeats``.

``--baseline REV`` compares this tree's artemisd with the one of git revision
REV in one run: the same trace (written once, by this tree) is ingested in
fresh worker processes, one per tree and round, alternating A B B A so that
the machine's load drifts over both alike; medians of ``--rounds`` rounds
and the ratio this/REV per measure.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import functools  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from artemisd.auth import TRUSTED_LOCAL  # noqa: E402
from artemisd.config import parse_config_text  # noqa: E402
from artemisd.pipeline import Analyzer  # noqa: E402
from artemisd.server import configure_logging, tune_gc  # noqa: E402
from artemisd import ingest  # noqa: E402
from artemisd.ingest import IngestResult, decode_body  # noqa: E402
from artemisd.service import Daemon  # noqa: E402
from artemisd.sim.fleet import simulate_records, single_job  # noqa: E402
from artemisd.sim.spec import FaultSpec, IslandSpec, JobSpec  # noqa: E402
from artemisd.slurm.cli import CliSlurm  # noqa: E402
from artemisd.wire import parse_record  # noqa: E402


def trace(ranks: int, windows: int) -> list[list[dict[str, Any]]]:
    """Window reports grouped by window, in order; a GPU's clocks stick at 3/4 of the run."""
    onset = max(1, (3 * windows) // 4)
    job = JobSpec(job="4242", islands=(IslandSpec(ranks=ranks),), windows=windows,
                  faults=(FaultSpec(cause="gpu.clocks", rank=ranks // 3, onset=onset, magnitude=0.25),))
    records, _ = simulate_records(single_job(job, seed=7))
    by_window: dict[int, list[dict[str, Any]]] = {}
    for rec in records:
        if rec.get("type") == "window":
            by_window.setdefault(rec["window"]["seq"], []).append(rec)
    return [by_window[s] for s in sorted(by_window)]


def new_daemon(state: Path, max_world: int = 65_536) -> Daemon:
    # No Slurm here: its calls fail fast and decisions wait, which is not what is timed.
    config = parse_config_text(f"StateDir={state}\nAuthType=none\nMaxWorld={max_world}\n")
    return Daemon(config, CliSlurm(timeout=2, env={"SLURM_CONF": "/nonexistent", "PATH": os.environ["PATH"]}))


@functools.cache
def _takes(function: Any, parameter: str) -> bool:
    # Asked once per tree: inspect.signature costs ~200 us, as much as a one-report request itself.
    return parameter in inspect.signature(function).parameters


def read(body: bytes, daemon: Daemon, texts: list[str] | None = None) -> tuple[list, list]:
    """Body -> (records, rejected) as ``POST /v1/reports`` reads it in the tree under test.

    A tree without the fast path (``--baseline`` of an older revision) reads
    every body item by item, as its server did.  ``texts``: where the tree's
    fast path hands the items' own JSON texts to ``accept`` (revisions before
    the daemon stored the body whole), they are put there, as its server did.
    """
    fast = getattr(ingest, "fast_records", None)
    if fast is None:
        records = None
    elif _takes(fast, "texts"):
        records = fast(body, daemon.config.daemon.max_world, texts)
    else:
        records = fast(body, daemon.config.daemon.max_world)
    if records is not None:
        return records, []
    return daemon.validate(decode_body(body))


def accept(daemon: Daemon, records: list, rejected: list, texts: list[str], body: bytes) -> Any:
    """``Daemon.accept`` as the tree's server calls it: with the body the fast path took (this tree:
    stored whole), with the items' texts (revisions that stored those), or with neither."""
    if _takes(Daemon.accept, "body") and records and not rejected:
        return daemon.accept(records, TRUSTED_LOCAL, {}, rejected, body)
    if texts and _takes(Daemon.accept, "texts"):
        return daemon.accept(records, TRUSTED_LOCAL, {}, rejected, texts)
    return daemon.accept(records, TRUSTED_LOCAL, {}, rejected)


def time_parse(bodies: list[bytes], daemon: Daemon) -> float:
    start = time.process_time()
    for body in bodies:
        read(body, daemon)
    return time.process_time() - start


def time_ingest(bodies: list[bytes], windows_of_body: list[int], confirm_at: int | None,
                daemon: Daemon) -> tuple[float, float | None]:
    """(CPU seconds for all bodies, wall latency of the confirming request or None)."""
    latency = None
    start = time.process_time()
    for body, window in zip(bodies, windows_of_body):
        t0 = time.perf_counter()
        texts: list[str] = []
        records, rejected = read(body, daemon, texts)
        accept(daemon, records, rejected, texts, body)
        if latency is None and confirm_at is not None and window >= confirm_at and daemon.store.db.execute(
                "SELECT 1 FROM incidents WHERE state = 'confirmed' LIMIT 1").fetchone():
            latency = time.perf_counter() - t0
    return time.process_time() - start, latency


def confirming_window(windows: list[list[dict[str, Any]]]) -> int | None:
    analyzer = Analyzer(parse_config_text("").analysis)
    for seq, window in enumerate(windows):
        for rec in window:
            for inc in analyzer.ingest(parse_record(rec)):
                if inc.state.value == "confirmed":
                    return seq
    return None


def in_process(windows: list[list[dict[str, Any]]], repeats: int) -> dict[str, Any]:
    reports = sum(len(w) for w in windows)
    per_window = [json.dumps(w).encode() for w in windows]
    per_rank = [json.dumps([r]).encode() for w in windows for r in w]
    rank_windows = [i for i, w in enumerate(windows) for _ in w]
    confirm_at = confirming_window(windows)
    parsed = [parse_record(r) for w in windows for r in w]
    out: dict[str, list[float]] = {"parse": [], "ingest_window_batches": [], "ingest_rank_posts": [],
                                   "analyzer": [], "latency_ms": []}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            daemon = new_daemon(Path(tmp) / "a")
            out["parse"].append(reports / time_parse(per_window, daemon))
            daemon.store.close()
            daemon = new_daemon(Path(tmp) / "b")
            seconds, latency = time_ingest(per_window, list(range(len(windows))), confirm_at, daemon)
            out["ingest_window_batches"].append(reports / seconds)
            if latency is not None:
                out["latency_ms"].append(1000 * latency)
            daemon.store.close()
            daemon = new_daemon(Path(tmp) / "c")
            seconds, _ = time_ingest(per_rank, rank_windows, None, daemon)
            out["ingest_rank_posts"].append(reports / seconds)
            daemon.store.close()
        analyzer = Analyzer(parse_config_text("").analysis)
        start = time.process_time()
        for rec in parsed:
            analyzer.ingest(rec)
        out["analyzer"].append(reports / (time.process_time() - start))
    return {k: statistics.median(v) if v else None for k, v in out.items()} | {"confirm_window": confirm_at}


def single_window(window: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    """CPU seconds for one whole window posted as one body (``--single-window N``).

    * **read**: body -> validated records (what ``POST /v1/reports`` does before Slurm's checks);
    * **read_store**: read + the rows ``Daemon.accept`` stores (one SQLite
      transaction), without the analysis: this tree's rows from ``Intake._rows``
      (one batch row, the body as it came); an older tree's one row per report
      (each item's own text where its fast path kept it, else the record
      encoded again);
    * **accept**: read + ``Daemon.accept`` (store, analyzer, directives);
    * **analyzer**: ``Analyzer.ingest`` alone over the window's records.
    """
    body = json.dumps(window).encode()
    ranks = len(window)
    out: dict[str, list[float]] = {"read": [], "read_store": [], "accept": [], "analyzer": []}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            daemon = new_daemon(Path(tmp) / "a", max_world=ranks)
            start = time.process_time()
            records, rejected = read(body, daemon)
            out["read"].append(time.process_time() - start)
            assert not rejected and len(records) == ranks, rejected[:3]
            start = time.process_time()
            texts: list[str] = []
            records, _ = read(body, daemon, texts)
            now = daemon.clock()
            intake = getattr(daemon, "intake", daemon)  # ``Daemon.intake`` since issue 29; the daemon before
            if hasattr(intake, "_rows"):
                rows, _ = intake._rows([(i, rec, True) for i, rec in records], len(records), body, now,
                                       TRUSTED_LOCAL, IngestResult())
            else:
                rows = [(rec.job, rec.window.seq, rec.node, now, 0, True,
                         texts[i] if texts else rec.model_dump_json(exclude_none=True)) for i, rec in records]
            daemon.store.add_records(rows)
            out["read_store"].append(time.process_time() - start)
            daemon.store.close()
            daemon = new_daemon(Path(tmp) / "b", max_world=ranks)
            start = time.process_time()
            texts = []
            records, rejected = read(body, daemon, texts)
            result = accept(daemon, records, rejected, texts, body)
            out["accept"].append(time.process_time() - start)
            assert result.accepted == ranks, result.rejected[:3]
            daemon.store.close()
            analyzer = Analyzer(parse_config_text(f"MaxWorld={ranks}\n").analysis)
            start = time.process_time()
            for _, rec in records:
                analyzer.ingest(rec)
            out["analyzer"].append(time.process_time() - start)
    return {k: statistics.median(v) for k, v in out.items()} | {"ranks": ranks}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def over_http(windows: list[list[dict[str, Any]]], server_cpu: int, client_cpu: int) -> dict[str, Any]:
    """A real artemisd, fed each window as one body, then (a fresh one) each report as its own
    request, as every rank's own sender posts it; its CPU per report in both."""
    reports = sum(len(w) for w in windows)
    result = _http_run([json.dumps(w).encode() for w in windows], reports, server_cpu, client_cpu, latency=True)
    out = {"http_window_batches_wall": result["wall"], "http_window_batches": result["cpu"],
           "http_latency_ms": result["latency_ms"]}
    rank_posts = _http_run([json.dumps([r]).encode() for w in windows for r in w], reports, server_cpu, client_cpu)
    return out | {"http_rank_posts": rank_posts["cpu"]}


def _http_run(bodies: list[bytes], reports: int, server_cpu: int, client_cpu: int, latency: bool = False
              ) -> dict[str, Any]:
    """Each body POSTed in turn to a fresh artemisd (AuthType=none) on ``server_cpu``: reports per
    server CPU-second and per wall second, and the latency of the request that confirmed an incident."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "artemis.conf"
        conf.write_text(f"Listen=127.0.0.1:{port}\nAuthType=none\nStateDir={tmp}/state\nSlurmTimeout=2\n")
        env = dict(os.environ, SLURM_CONF="/nonexistent")
        proc = subprocess.Popen([sys.executable, "-m", "artemisd.server", "-c", str(conf)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                preexec_fn=lambda: os.sched_setaffinity(0, {server_cpu}))
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    urllib.request.urlopen(f"{url}/v1/health", timeout=1).read()
                    break
                except OSError:
                    time.sleep(0.1)
            os.sched_setaffinity(0, {client_cpu})
            server_cpu0 = cpu_seconds(proc.pid)
            confirmed_after = None
            start = time.perf_counter()
            for body in bodies:
                t0 = time.perf_counter()
                req = urllib.request.Request(f"{url}/v1/reports", data=body, method="POST")
                urllib.request.urlopen(req, timeout=60).read()
                if latency and confirmed_after is None:
                    incidents = json.loads(urllib.request.urlopen(f"{url}/v1/incidents", timeout=10).read())
                    if any(i["state"] == "confirmed" for i in incidents["incidents"]):
                        confirmed_after = time.perf_counter() - t0
            seconds = time.perf_counter() - start
            server_cpu_s = cpu_seconds(proc.pid) - server_cpu0
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)
    return {"wall": reports / seconds, "cpu": reports / server_cpu_s,
            "latency_ms": 1000 * confirmed_after if confirmed_after else None}


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (/proc/PID/stat), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def artemisd_of(rev: str, dest: Path) -> Path:
    """``artemisd`` of git revision ``rev``, extracted into ``dest`` (created): a tree to put first
    on a process's path, for a side-by-side run against this one."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "archive", rev, "artemisd"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def compare(windows: list[list[dict[str, Any]]], baseline: str, rounds: int, cpu: int, single: bool = False) -> int:
    """This tree vs ``baseline`` (a git revision), alternating worker processes; prints both and the ratio."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        old = artemisd_of(baseline, Path(tmp) / "baseline")
        trace_file = Path(tmp) / "trace.json"
        trace_file.write_text(json.dumps(windows))
        trees = {"this": root, baseline: old}
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
        for r in range(rounds):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                env = dict(os.environ, PYTHONPATH=str(trees[name]))
                out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(trace_file),
                                      "--repeats", "1", "--cpu", str(cpu), *(["--single-window", "1"] if single else [])],
                                     env=env, cwd=tmp, check=True,
                                     capture_output=True, text=True).stdout
                runs[name].append(json.loads(out.splitlines()[-1]))
    if single:
        ranks = len(windows[0])
        print(f"{'one ' + str(ranks) + '-rank window':24} {baseline + ' CPU-s':>14} {'this CPU-s':>12} "
              f"{'speed-up':>9} {'this reports/CPU-s':>19}")
        for key in ("read", "read_store", "accept", "analyzer"):
            before = statistics.median(run[key] for run in runs[baseline])
            after = statistics.median(run[key] for run in runs["this"])
            print(f"{key:24} {before:14.3f} {after:12.3f} {before / after:9.2f} {ranks / after:19.0f}")
        return 0
    print(f"{'measure (reports/s)':24} {baseline:>12} {'this':>12} {'this/' + baseline[:8]:>14}")
    for key in ("parse", "ingest_window_batches", "ingest_rank_posts", "analyzer"):
        before = statistics.median(run[key] for run in runs[baseline])
        after = statistics.median(run[key] for run in runs["this"])
        print(f"{key:24} {before:12.1f} {after:12.1f} {after / before:14.3f}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu", type=int, default=0, help="CPU to pin the in-process run (and the server) to")
    parser.add_argument("--http", action="store_true", help="also measure through a real artemisd over HTTP")
    parser.add_argument("--baseline", metavar="REV", help="compare with the artemisd of git revision REV")
    parser.add_argument("--rounds", type=int, default=6, help="worker rounds per tree with --baseline")
    parser.add_argument("--single-window", type=int, metavar="N",
                        help="CPU seconds for one N-rank window in one body (read, store, accept, analyzer)")
    parser.add_argument("--worker", metavar="TRACE", help=argparse.SUPPRESS)  # one --baseline measurement
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    configure_logging(logging.WARNING)  # as the service logs: JSON, and only what matters here
    if args.worker:
        tune_gc()
        windows = json.loads(Path(args.worker).read_text())
        result = single_window(windows[0], args.repeats) if args.single_window else in_process(windows, args.repeats)
        print(json.dumps(result))
        return 0
    if args.single_window:
        # The first window of a two-window trace: healthy, every rank of the job in one body.
        windows = trace(args.single_window, 2)[:1]
        if args.baseline:
            return compare(windows, args.baseline, args.rounds, args.cpu, single=True)
        tune_gc()
        for key, value in single_window(windows[0], args.repeats).items():
            print(f"{key:24} {value:12.3f} CPU-s" if isinstance(value, float) else f"{key:24} {value!s:>12}")
        return 0
    windows = trace(args.ranks, args.windows)
    if args.baseline:
        return compare(windows, args.baseline, args.rounds, args.cpu)
    tune_gc()  # as artemisd does after start-up
    result: dict[str, Any] = {"ranks": args.ranks, "windows": len(windows),
                              "reports": sum(len(w) for w in windows)}
    result |= in_process(windows, args.repeats)
    if args.http:
        cpus = sorted(os.sched_getaffinity(0) | set(range(os.cpu_count() or 1)))
        client = next((c for c in cpus if c != args.cpu), args.cpu)
        result |= over_http(windows, args.cpu, client)
    for key, value in result.items():
        if isinstance(value, float):
            unit = "ms" if key.endswith("_ms") else "reports/s"
            print(f"{key:24} {value:12.1f} {unit}")
        else:
            print(f"{key:24} {value!s:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
