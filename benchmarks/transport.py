"""artemisd's memory and reachability under hostile clients (issue 9, finding 4).

    .venv/bin/python benchmarks/transport.py                       # this tree
    .venv/bin/python benchmarks/transport.py --pythonpath OLD_TREE  # another checkout, same client

Runs the real ``artemisd`` (AuthType=munge, a private munged, 127.0.0.1 only,
needs root for munged) and measures its resident high-water mark (VmHWM,
/proc/PID/status) around two attacks by a client with no credential:

* **uploads**: ``--uploads`` concurrent POSTs of ``--upload-mib`` MiB each,
  with a Content-Length, then the same chunked (no length); the status each got;
* **idle**: ``--idle`` connections that never send a byte; then whether a real
  client still gets ``/v1/health`` and how long it takes.

``--nofile`` sets the daemon's open-file limit (soft and hard) the way
systemd's ``LimitNOFILE=`` does: 1024 is what the unit had before (systemd's
default), 8192 what packaging/systemd/artemisd.service sets now.  Every load
loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.cluster.hostile import StandaloneDaemon, concurrently, idle_connections, upload, vm_kib  # noqa: E402
from tests.cluster.munge import Munged  # noqa: E402

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
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pythonpath", help="run artemisd from this source tree instead")
    parser.add_argument("--nofile", type=int, default=8192, help="the daemon's open-file limit")
    parser.add_argument("--uploads", type=int, default=3)
    parser.add_argument("--upload-mib", type=int, default=200)
    parser.add_argument("--idle", type=int, default=1100)
    args = parser.parse_args()
    for key, value in measure(args).items():
        print(f"{key:32} {value:.2f}" if isinstance(value, float) else f"{key:32} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
