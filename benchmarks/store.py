"""The state store's two backends side by side: SQLite (the default) and PostgreSQL (StateURL).

    .venv/bin/python benchmarks/store.py              # 10,000 window rows, 1,000 incident saves
    .venv/bin/python benchmarks/store.py --rows 100000 --incidents 5000 --repeats 5

Both run on this machine in the same process, one after the other, each on a
fresh database: SQLite a file in a temporary directory (WAL, synchronous=NORMAL,
as the daemon opens it), PostgreSQL a throwaway server (tests/unit/pg.py) on a
unix socket, with its defaults (``durable``: every commit flushed) and again
with ``synchronous_commit=off``, which, like SQLite's NORMAL in WAL mode, can
lose the last commits on a crash of the machine but never consistency.  Timed
(wall clock, median of ``--repeats``):

* ``add_records``: the window rows in one call (one transaction), and in calls
  of 100 rows (one POST of a window batch each);
* ``save_incident``: one transaction per save, as the ledger writes them;
* ``audit``: one append per transaction;
* ``records``: reading every row back in order, both sets (what a restart replays).

The ratio column is PostgreSQL's time over SQLite's, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from artemisd.store import Store, StoredIncident  # noqa: E402
from tests.unit.pg import PASSWORD, PgServer  # noqa: E402


def window_rows(n: int) -> list[tuple]:
    # A window report of a 256-rank job's rank, about the size the probe sends.
    body = json.dumps({"v": 1, "job": "4242", "step": "0", "rank": 0, "window": 0, "steps": 50,
                       "busy_ms": [12.5] * 24, "comm_wait_ms": [3.25] * 24, "host": "gpu-n001"})
    return [("4242", w // 256, f"gpu-n{w % 64:03d}", 1.7e9 + w / 100, 1000, False, body) for w in range(n)]


def measure(open_store: Callable[[], object], rows: int, incidents: int) -> dict[str, float]:
    data = window_rows(rows)
    out: dict[str, float] = {}
    store = open_store()
    t = time.perf_counter()
    store.add_records(data)
    out["add_records, one call"] = time.perf_counter() - t
    store.close()
    store = open_store()
    t = time.perf_counter()
    for i in range(0, rows, 100):
        store.add_records(data[i:i + 100])
    out["add_records, calls of 100"] = time.perf_counter() - t
    t = time.perf_counter()
    n = sum(1 for _ in store.records())
    out["records, read back (2 x rows)"] = time.perf_counter() - t
    assert n == 2 * rows, n
    body = {"id": "INC-0", "state": "confirmed", "evidence": [{"rank": r, "ratio": 1.25} for r in range(8)]}
    t = time.perf_counter()
    for i in range(incidents):
        store.save_incident(StoredIncident(f"INC-{i}", "4242", "0", "confirmed", f"4242|rank|{i}", None, 0, None,
                                           300.0, True, body, 1.7e9 + i, 1.7e9 + i))
    out["save_incident"] = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(incidents):
        store.audit("artemisd", "drain gpu-n001", "confirmed twice", "ok", incident=f"INC-{i}")
    out["audit"] = time.perf_counter() - t
    store.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000, help="window rows added (default 10,000)")
    ap.add_argument("--incidents", type=int, default=1_000, help="incident saves and audit appends (default 1,000)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the medians here")
    args = ap.parse_args()

    from artemisd.store.postgres import PostgresStore

    server = PgServer(durable=True).start()
    runs: dict[str, list[dict[str, float]]] = {"sqlite": [], "postgresql": [], "postgresql async": []}
    try:
        for repeat in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                runs["sqlite"].append(measure(lambda tmp=tmp: Store(Path(tmp) / "artemis.db"), args.rows,
                                              args.incidents))
            for label, sync in (("postgresql", "on"), ("postgresql async", "off")):
                name = f"bench{repeat}{sync}"
                url = server.create_database(name)

                def open_pg(url: str = url, sync: str = sync) -> PostgresStore:
                    store = PostgresStore(url, password=PASSWORD)
                    store.db.execute(f"SET synchronous_commit = {sync}")
                    return store

                try:
                    runs[label].append(measure(open_pg, args.rows, args.incidents))
                finally:
                    server.drop_database(name)
    finally:
        server.stop()

    medians = {label: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for label, rs in runs.items()}
    print(f"{args.rows:,} window rows, {args.incidents:,} incident saves and audit appends; "
          f"median of {args.repeats}, seconds (ratio: PostgreSQL / SQLite)")
    print(f"{'':30} {'SQLite':>8} {'PG':>8} {'ratio':>6} {'PG async':>9} {'ratio':>6}")
    for key, base in medians["sqlite"].items():
        pg, pga = medians["postgresql"][key], medians["postgresql async"][key]
        print(f"{key:30} {base:8.3f} {pg:8.3f} {pg / base:6.1f} {pga:9.3f} {pga / base:6.1f}")
    if args.json:
        args.json.write_text(json.dumps({"rows": args.rows, "incidents": args.incidents, "repeats": args.repeats,
                                         "seconds": medians}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
