"""artemisd's memory and reachability under hostile clients (issue 9, finding 4).

    .venv/bin/python benchmarks/transport.py                       # this tree
    .venv/bin/python benchmarks/transport.py --pythonpath OLD_TREE  # another checkout, same client

Runs the real ``artemisd`` (AuthType=munge, a private munged, 127.0.0.1 only,
needs root for munged) and measures its resident high-water mark (VmHWM,
/proc/PID/status) around two attacks by a client with no credential:

* **uploads**: ``--uploads`` concurrent POSTs of ``--upload-mib`` MiB each,
  with a Content-Length, then the same chunked (no length); the status each got;
* **idle**: ``--idle`` connections that never send a byte; then whether a real
  client still gets ``/v1/health`` and how long it takes;
* **errors**: ``--errors`` refused (401) requests after as many / 2 of
  warm-up, one connection each; the growth of the resident set (VmRSS).

``--nofile`` sets the daemon's open-file limit (soft and hard) the way
systemd's ``LimitNOFILE=`` does: 1024 is what the unit had before (systemd's
default), 8192 what packaging/systemd/artemisd.service sets now.

``--ingest-vs REV`` instead measures what the front door costs real ingest:
this tree's artemisd and the one of git revision REV run side by side (both
AuthType=munge, pinned to the same CPU, the client on another), and every
window of the benchmarks/ingest.py trace (256 ranks x 40 windows) is posted
to both, alternating which goes first, each with a fresh root credential.
The figure is reports per CPU-second of each daemon process over the whole
run (its background loop included, the same wall time for both), median of
``--rounds`` fresh pairs; interleaving request by request keeps the load of
a shared machine from favouring either.  Every load loop is bounded in
count and time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.ingest import artemisd_of, cpu_seconds, trace  # noqa: E402
from tests.cluster.hostile import (StandaloneDaemon, concurrently, idle_connections, post, upload,  # noqa: E402
                                   vm_kib)
from tests.cluster.munge import Munged  # noqa: E402
from torch_hook.munge import MungeSigner  # noqa: E402

MIB = 1 << 20


def measure(args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, object] = {}
    with Munged() as munged, tempfile.TemporaryDirectory(prefix="artemis-transport-") as tmp, \
            StandaloneDaemon(Path(tmp) / "d", munged.socket, pythonpath=args.pythonpath,
                             nofile=args.nofile) as daemon:
        time.sleep(1.0)
        out["start_hwm_mib"] = vm_kib(daemon.pid) / 1024
        size = args.upload_mib * MIB
        for label, chunked in (("length", False), ("chunked", True)):
            start = time.monotonic()
            results = concurrently(args.uploads, upload, daemon.port, size, chunked=chunked, cred=None,
                                   timeout_s=120)
            out[f"uploads_{label}_status"] = [r[0] if isinstance(r, tuple) else repr(r) for r in results]
            out[f"uploads_{label}_client_sent_mib"] = [round(r[1] / MIB) if isinstance(r, tuple) else None
                                                       for r in results]
            out[f"uploads_{label}_seconds"] = round(time.monotonic() - start, 2)
            out[f"uploads_{label}_hwm_mib"] = vm_kib(daemon.pid) / 1024
        before = vm_kib(daemon.pid)
        with idle_connections(daemon.port, args.idle, timeout_s=60):
            time.sleep(1.0)
            start = time.monotonic()
            out["idle_health_ok"] = daemon.healthy(timeout_s=10)
            out["idle_health_seconds"] = round(time.monotonic() - start, 3)
            out["idle_hwm_growth_mib"] = (vm_kib(daemon.pid) - before) / 1024
        out["idle_after_close_health_ok"] = daemon.healthy(timeout_s=10)
        body = b'[{"type":"node","v":1,"event":"health","node":"n1","time":1.0}]'
        deadline = time.monotonic() + 300
        for _ in range(args.errors // 2):  # warm-up: past the first collections of per-connection garbage
            post(daemon.url, "/v1/reports", body, None)
        before, n = vm_kib(daemon.pid, "VmRSS"), 0
        while n < args.errors and time.monotonic() < deadline:
            assert post(daemon.url, "/v1/reports", body, None)[0] == 401
            n += 1
        out["errors_401_counted"] = n
        out["errors_rss_growth_kib"] = vm_kib(daemon.pid, "VmRSS") - before
    return out


def ingest_vs(rev: str, rounds: int, cpu: int, client_cpu: int) -> dict[str, object]:
    windows = [json.dumps(w).encode() for w in trace(256, 40)]
    reports = sum(len(json.loads(b)) for b in windows)
    rates: dict[str, list[float]] = {"this": [], rev: []}
    with Munged() as munged, tempfile.TemporaryDirectory(prefix="artemis-ingest-vs-") as tmp:
        old = artemisd_of(rev, Path(tmp) / "baseline")
        # A revision from before credentials were bound to their request (auth.py) takes the
        # legacy payload, the body's sha256 alone, which this tree accepts on /v1/reports too.
        legacy = {rev: "artemis-request-v2" not in (old / "artemisd" / "auth.py").read_text()}
        signer = MungeSigner(str(munged.socket))
        assert signer.credential("POST", "/v1/reports", b"warm-up"), signer.last_error

        def credential(name: str, body: bytes) -> str | None:
            if legacy.get(name):
                return signer.sign(hashlib.sha256(body).hexdigest())
            return signer.credential("POST", "/v1/reports", body)

        os.sched_setaffinity(0, {client_cpu})
        for r in range(rounds):
            with StandaloneDaemon(Path(tmp) / f"this{r}", munged.socket) as this, \
                    StandaloneDaemon(Path(tmp) / f"old{r}", munged.socket, pythonpath=str(old)) as base:
                daemons = {"this": this, rev: base}
                for d in daemons.values():
                    os.sched_setaffinity(d.pid, {cpu})
                cpu0 = {name: cpu_seconds(d.pid) for name, d in daemons.items()}
                for i, body in enumerate(windows):
                    for name in (list(daemons) if (i + r) % 2 == 0 else list(daemons)[::-1]):
                        status, reply, _ = post(daemons[name].url, "/v1/reports", body,
                                                credential(name, body), timeout_s=60)
                        assert status == 200 and reply["accepted"] == len(json.loads(body)), (name, status, reply)
                for name, d in daemons.items():
                    rates[name].append(reports / (cpu_seconds(d.pid) - cpu0[name]))
        signer.close()
    out: dict[str, object] = {f"{name}_reports_per_cpu_s": [round(x) for x in runs] for name, runs in rates.items()}
    out["median_this_over_" + rev[:12]] = statistics.median(rates["this"]) / statistics.median(rates[rev])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pythonpath", help="run artemisd from this source tree instead")
    parser.add_argument("--nofile", type=int, default=8192, help="the daemon's open-file limit")
    parser.add_argument("--uploads", type=int, default=3)
    parser.add_argument("--upload-mib", type=int, default=200)
    parser.add_argument("--idle", type=int, default=1100)
    parser.add_argument("--errors", type=int, default=3000)
    parser.add_argument("--ingest-vs", metavar="REV", help="ingest throughput of this tree vs git revision REV")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu", type=int, default=0, help="CPU the daemons are pinned to (--ingest-vs)")
    args = parser.parse_args()
    if args.ingest_vs:
        client = next((c for c in sorted(os.sched_getaffinity(0)) if c != args.cpu), args.cpu)
        result = ingest_vs(args.ingest_vs, args.rounds, args.cpu, client)
    else:
        result = measure(args)
    for key, value in result.items():
        print(f"{key:32} {value:.2f}" if isinstance(value, float) else f"{key:32} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
