"""What a long-running artemisd keeps of the jobs it has seen end.

    .venv/bin/python benchmarks/held_memory.py                 # 50 jobs of 64 ranks x 8 windows
    .venv/bin/python benchmarks/held_memory.py --baseline REV  # also git REV's artemisd, side by side

A daemon (SQLite, AuthType=none, the shipped analysis defaults) is fed jobs
one after the other, each a few healthy windows of ``--ranks`` ranks and then
the Epilog's ``job_end``, through ``Daemon.accept`` as ``POST /v1/reports``
does.  After ``--warm`` jobs (caches, imports, first allocations), Python's
``tracemalloc`` measures what the next ``--jobs`` jobs leave allocated once a
collection has run: memory that grows with the number of jobs a daemon has
seen, which months of a busy cluster multiply.  ``--baseline`` runs the same
against ``artemisd`` of git revision REV (``git archive`` into a temporary
directory, in a child process).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def held_per_job(ranks: int, windows: int, jobs: int, warm: int, root: Path = ROOT) -> float:
    """kB still allocated per ended job, by the artemisd of ``root``."""
    sys.path.insert(0, str(root))
    from artemisd.auth import TRUSTED_LOCAL
    from artemisd.config import parse_config_text
    from artemisd.ingest import decode_body, fast_records
    from artemisd.server import configure_logging
    from artemisd.service import Daemon
    from artemisd.slurm.cli import CliSlurm
    from benchmarks.scale import window

    configure_logging()
    logging.getLogger().setLevel(logging.WARNING)
    rng = random.Random(7)
    shapes = [window(seq, ranks, rng) for seq in range(windows)]
    with tempfile.TemporaryDirectory() as tmp:
        daemon = Daemon(parse_config_text(f"StateDir={tmp}\nAuthType=none\n"),
                        CliSlurm(timeout=2, env={"SLURM_CONF": "/nonexistent", "PATH": os.environ["PATH"]}))

        def post(body: bytes) -> None:
            records = fast_records(body)
            if records is not None:
                daemon.accept(records, TRUSTED_LOCAL, {}, [], body)
            else:  # the job_end: the careful path, as the server takes it
                kept, rejected = daemon.validate(decode_body(body))
                daemon.accept(kept, TRUSTED_LOCAL, {}, rejected, None)

        def job(number: int) -> None:
            for reports in shapes:
                post(json.dumps([dict(r, job=str(number)) for r in reports]).encode())
            post(json.dumps([{"type": "node", "v": 1, "event": "job_end", "job": str(number), "node": "n0",
                              "time": 0.0}]).encode())

        for number in range(warm):
            job(number)
        gc.collect()
        tracemalloc.start()
        for number in range(warm, warm + jobs):
            job(number)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        daemon.store.close()
    return held / jobs / 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--warm", type=int, default=20)
    parser.add_argument("--baseline", metavar="REV")
    parser.add_argument("--root", help=argparse.SUPPRESS)  # a baseline's child: its tree
    args = parser.parse_args()
    if args.root:
        print(held_per_job(args.ranks, args.windows, args.jobs, args.warm, Path(args.root)))
        return 0
    print(f"{args.jobs} jobs of {args.ranks} ranks x {args.windows} windows, each ended by job_end "
          f"(after {args.warm} to warm up): kB still allocated per ended job")
    if args.baseline:
        sys.path.insert(0, str(ROOT))
        from benchmarks.ingest import artemisd_of

        with tempfile.TemporaryDirectory() as tmp:
            artemisd_of(args.baseline, Path(tmp))
            # The child puts the baseline's tree first on sys.path; the record shapes and the test
            # helpers they import come from this one.
            (Path(tmp) / "benchmarks").symlink_to(ROOT / "benchmarks")
            (Path(tmp) / "tests").symlink_to(ROOT / "tests")
            out = subprocess.run([sys.executable, __file__, f"--root={tmp}", f"--ranks={args.ranks}",
                                  f"--windows={args.windows}", f"--jobs={args.jobs}", f"--warm={args.warm}"],
                                 check=True, capture_output=True, text=True, cwd=tmp)
            print(f"  {args.baseline}: {float(out.stdout.split()[-1]):8.1f}")
    print(f"  this tree: {held_per_job(args.ranks, args.windows, args.jobs, args.warm):8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
