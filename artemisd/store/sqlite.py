"""The daemon's state in one SQLite file in WAL mode: ``Store``, the default backend.

What differs from PostgreSQL is here: the schema's DDL and migrations, the
connection and its transactions (``BEGIN IMMEDIATE``: one writer at a time,
by the file's lock), storing and replaying records, and the clock (this
host's).  The rest of ``StateStore`` is ``SqlStore``'s (store/sql.py).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import Any

from artemisd.store.base import SCHEMA_VERSION, SEQ_MAX, StoredRecord, newer_schema, skipped_items, with_items
from artemisd.store.sql import JOB_SEEN, SqlStore

SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job TEXT, window INTEGER, node TEXT, received REAL NOT NULL,
    uid INTEGER, root INTEGER NOT NULL DEFAULT 0, body TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS records_job ON records(job, window);
CREATE TABLE IF NOT EXISTS jobs (
    job TEXT PRIMARY KEY, user_id INTEGER, partition TEXT,
    first_seen REAL, last_seen REAL, last_window INTEGER);
CREATE TABLE IF NOT EXISTS throughput (
    job TEXT, step TEXT, window INTEGER, samples_per_s REAL, ranks INTEGER,
    PRIMARY KEY (job, step, window));
CREATE TABLE IF NOT EXISTS incidents (
    id TEXT PRIMARY KEY, job TEXT NOT NULL, step TEXT, state TEXT NOT NULL,
    subject TEXT NOT NULL, analyzer_id TEXT, plan_step INTEGER NOT NULL DEFAULT 0,
    action_window INTEGER, baseline REAL, decide INTEGER NOT NULL DEFAULT 0, body TEXT NOT NULL,
    created REAL NOT NULL, updated REAL NOT NULL);
CREATE INDEX IF NOT EXISTS incidents_subject ON incidents(subject);
CREATE TABLE IF NOT EXISTS actions (
    id INTEGER PRIMARY KEY AUTOINCREMENT, incident TEXT NOT NULL, kind TEXT NOT NULL,
    target TEXT, params TEXT NOT NULL DEFAULT '{}', status TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0, next_try REAL NOT NULL DEFAULT 0,
    created REAL NOT NULL, updated REAL NOT NULL, detail TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS actions_status ON actions(status, next_try);
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, incident TEXT,
    action INTEGER, who TEXT NOT NULL, what TEXT NOT NULL, why TEXT NOT NULL DEFAULT '',
    result TEXT NOT NULL DEFAULT '');
CREATE TRIGGER IF NOT EXISTS audit_no_update BEFORE UPDATE ON audit
    BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
CREATE TRIGGER IF NOT EXISTS audit_no_delete BEFORE DELETE ON audit
    BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
CREATE TABLE IF NOT EXISTS directives (
    id TEXT PRIMARY KEY, type TEXT NOT NULL, job TEXT NOT NULL, step TEXT NOT NULL,
    incident TEXT, body TEXT NOT NULL, issued REAL NOT NULL, expires REAL,
    ranks_reported INTEGER NOT NULL DEFAULT 0, cost_ms REAL NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS directives_job ON directives(job, step);
CREATE TABLE IF NOT EXISTS corrections (
    id TEXT PRIMARY KEY, incident TEXT NOT NULL, node TEXT NOT NULL, kind TEXT NOT NULL,
    gpu INTEGER, status TEXT NOT NULL, detail TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL, updated REAL NOT NULL);
CREATE INDEX IF NOT EXISTS corrections_node ON corrections(node, status);
CREATE TABLE IF NOT EXISTS node_evidence (
    node TEXT PRIMARY KEY, received REAL NOT NULL, uid INTEGER, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS quarantine (
    seq INTEGER PRIMARY KEY, job TEXT, window INTEGER, node TEXT, received REAL,
    uid INTEGER, root INTEGER, body TEXT NOT NULL, reason TEXT NOT NULL, quarantined REAL NOT NULL);
"""

# (version, script): applied in order, each in its own transaction with its
# row in schema_version.  Migration 1 is the schema as it was before versions
# were recorded; its statements are all IF NOT EXISTS, so a file written then
# (no schema_version table) is brought to version 1 without a table changed.
# Migration 2 (issue 12): the leader lease, each action's fencing token (the
# lease token of the leader that wrote it; NULL before leases existed), and
# every instance's last turn (what `artemis status` lists).
LEASES = """
CREATE TABLE IF NOT EXISTS leases (
    name TEXT PRIMARY KEY, holder TEXT NOT NULL, token INTEGER NOT NULL,
    acquired REAL NOT NULL, renewed REAL NOT NULL, expires REAL NOT NULL);
ALTER TABLE actions ADD COLUMN token INTEGER;
CREATE TABLE IF NOT EXISTS instances (
    instance TEXT PRIMARY KEY, role TEXT NOT NULL, version TEXT NOT NULL,
    started REAL NOT NULL, seen REAL NOT NULL);
"""
# Migration 3 (issue 12, ingest at scale): batch rows (``items``, ``skipped``),
# and the quarantine keyed by row and item.
BATCHES = """
ALTER TABLE records ADD COLUMN items INTEGER NOT NULL DEFAULT 0;
ALTER TABLE records ADD COLUMN skipped TEXT;
CREATE TABLE quarantine_3 (
    seq INTEGER NOT NULL, item INTEGER NOT NULL DEFAULT -1, job TEXT, window INTEGER, node TEXT,
    received REAL, uid INTEGER, root INTEGER, body TEXT NOT NULL, reason TEXT NOT NULL,
    quarantined REAL NOT NULL, PRIMARY KEY (seq, item));
INSERT INTO quarantine_3 SELECT seq, -1, job, window, node, received, uid, root, body, reason, quarantined
    FROM quarantine;
DROP TABLE quarantine;
ALTER TABLE quarantine_3 RENAME TO quarantine;
"""
# Migration 4 (issue 12, any instance accepts reports): the highest record
# seq below which the leader has analysed every record (``analysed_through``).
# Before it, only the leader stored records and analysed each as it stored
# it, so every record already stored is analysed.
ANALYSED = """
INSERT OR IGNORE INTO counters(name, value) SELECT 'analysed', COALESCE(MAX(seq), 0) FROM records;
"""
MIGRATIONS: tuple[tuple[int, str], ...] = ((1, SCHEMA), (2, LEASES), (3, BATCHES), (4, ANALYSED))
assert MIGRATIONS[-1][0] == SCHEMA_VERSION, "a migration added to one backend must be added to the other"

# A batch row counts its items not skipped (``skipped``: a JSON array of their indexes).
RECORD_COUNT = ("COALESCE(SUM(CASE WHEN items > 0 THEN items - COALESCE(json_array_length(skipped), 0) "
                "ELSE 1 END), 0)")



class Store(SqlStore):
    """``StateStore`` over one SQLite file (used from the event-loop thread)."""

    _RECORD_COUNT = RECORD_COUNT
    _INCIDENT_ORDER = "ORDER BY created, CAST(SUBSTR(id, INSTR(id, '-') + 1) AS INTEGER)"
    _NO_LIMIT = -1
    _JOBS_ORDER = "last_seen DESC"  # NULLs sort first, so last in DESC
    _DIRECTIVE_ORDER = "rowid"
    _GREATEST = "max"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: transactions are explicit (``_tx``), so a
        # method is all-or-nothing and nothing is left half-written by a crash.
        self.db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode loses at most the last transactions on power loss,
        # never consistency; a process kill loses nothing that was committed.
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA busy_timeout=5000")
        self._migrate()

    def close(self) -> None:
        self.db.close()

    def _migrate(self) -> None:
        self.db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, applied REAL NOT NULL)")
        found = self.schema_version()
        if found > SCHEMA_VERSION:
            self.db.close()
            raise newer_schema(found, str(self.path))
        for version, script in MIGRATIONS:
            if version <= found:
                continue
            # executescript commits whatever is open first; the script carries
            # its own transaction so the migration and its version row land together.
            try:
                self.db.executescript(f"BEGIN IMMEDIATE;\n{script}\nINSERT INTO schema_version VALUES "
                                      f"({version}, {time.time()!r});\nCOMMIT;")
            except BaseException:
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                raise

    class _Tx:
        def __init__(self, db: sqlite3.Connection):
            self.db = db

        def __enter__(self) -> sqlite3.Connection:
            self.db.execute("BEGIN IMMEDIATE")
            return self.db

        def __exit__(self, exc_type, exc, tb) -> None:
            self.db.execute("ROLLBACK" if exc_type else "COMMIT")

    def _tx(self) -> Store._Tx:
        return Store._Tx(self.db)

    def _run(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        return self.db.execute(sql, args)

    def _many(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        self.db.executemany(sql, rows)

    def _in(self, values: Iterable[Any]) -> tuple[str, Any]:
        # One JSON array, however many: no limit on bound variables to meet.
        return "IN (SELECT value FROM json_each(?))", json.dumps(list(values))

    def _insert_id(self, sql: str, args: tuple[Any, ...]) -> int:
        return int(self.db.execute(sql, args).lastrowid)

    # --- counters and ids -------------------------------------------------

    def next_id(self, name: str, prefix: str) -> str:
        with self._tx() as db:
            db.execute("INSERT INTO counters(name, value) VALUES (?, 1) "
                       "ON CONFLICT(name) DO UPDATE SET value = value + 1", (name,))
            (value,) = db.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()
        return f"{prefix}{value}"

    # --- records ----------------------------------------------------------

    def add_records(self, rows: list[tuple[Any, ...]]) -> list[int]:
        """rows: (job, window seq, node, received, uid, root, body JSON[, items]); jobs' last_seen in the same
        transaction.  ``items`` n > 0: the body is a batch of n window reports of that job and window.

        Returns the rows' ``seq`` (what ``quarantine`` takes), in order.
        """
        seen: dict[str, tuple[float, int | None]] = {}
        for job, window, _, received, *_ in rows:
            if job is not None:
                top = seen.get(job, (received, None))[1]
                seen[job] = (received, window if top is None or (window is not None and window > top) else top)
        with self._tx() as db:
            db.executemany("INSERT INTO records(job, window, node, received, uid, root, body, items) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", map(with_items, rows))
            # One writer inside BEGIN IMMEDIATE: AUTOINCREMENT hands out consecutive numbers.
            last = db.execute("SELECT last_insert_rowid()").fetchone()[0]
            db.executemany("INSERT INTO jobs(job, first_seen, last_seen, last_window) VALUES (?, ?, ?, ?) " + JOB_SEEN,
                           [(job, t, t, w) for job, (t, w) in seen.items()])
        return list(range(last - len(rows) + 1, last + 1))

    def records(self, after: int = 0, upto: int | None = None, skip: Collection[int] = ()
                ) -> Iterator[StoredRecord]:
        """Stored rows with ``after`` < seq <= ``upto``, in seq order, less the seqs in ``skip``.

        Rows are committed in seq order (one writer at a time), so a reader
        that has seen every row up to some seq never meets a lower one later.
        """
        cur = self.db.execute("SELECT seq, received, uid, root, body, items, skipped FROM records "
                              "WHERE seq > ? AND seq <= ? AND seq NOT IN (SELECT value FROM json_each(?)) "
                              "ORDER BY seq", (after, SEQ_MAX if upto is None else upto, json.dumps(sorted(skip))))
        for seq, received, uid, root, body, items, skipped in cur:
            yield StoredRecord(seq, received, uid, bool(root), body, items, skipped_items(skipped))

    # --- the clock ----------------------------------------------------------

    def clock(self) -> float:
        # One host holds a SQLite file: its clock is the only one.
        return time.time()

    @staticmethod
    def is_unavailable(err: BaseException) -> bool:
        """Another process held the file past busy_timeout: worth retrying later."""
        return isinstance(err, sqlite3.OperationalError) and "locked" in str(err)
