"""The daemon's state: one SQLite file in WAL mode.

What is kept, and why it is enough to survive ``kill -9``:

* ``records``: every accepted window report and node event, in arrival order,
  bounded to the last ``HistoryWindowsKept`` windows per job.  A row holds
  one record (``items`` 0), or a *batch* (``items`` n): a JSON array of the n
  window reports of one job and window that one request brought, stored as
  the sender wrote them in one row (a 100k-rank window is one insert, not
  100k); ``skipped`` lists the items quarantined since.  On restart the
  analyzer is rebuilt by feeding these through a fresh ``Analyzer`` (the same
  path as replay), so its baselines and suspects come back without a second
  serialisation format for its internals.
* ``incidents``: the incident as last published (contract JSON) plus the
  daemon's own bookkeeping (analyzer id, plan step, action window).  These are
  authoritative: a re-fed analyzer's incidents are matched to them by subject,
  never duplicated, and a confirmed incident is never lost.
* ``actions``: one row per action, written as *intent* (``queued`` /
  ``running``) before Slurm is touched and updated with the result after.  A
  row found ``running`` after a crash is re-run through the idempotent path
  (the actuator reads Slurm first), so a completed action is never repeated.
* ``audit``: append-only (triggers forbid UPDATE and DELETE): who, what, why,
  result, for every decision and every action attempt.
* ``quarantine``: records that once failed analysis (or could not be read
  back), moved out of ``records`` with the reason (a batch's item: copied
  here and marked skipped in its row, ``item`` its index; -1 a whole row), so a restart never
  replays them; the last ``QUARANTINE_KEPT`` are kept for inspection and the
  ``quarantined`` counter counts them all.
* ``directives``, ``corrections``, ``node_evidence``, ``jobs``, ``throughput``,
  ``counters``: the live loop's small tables.

Each public method is one transaction.  The store is used from the event-loop
thread only; Slurm calls run in worker threads and report back through it.

``StateStore`` is what the daemon may ask of a store; ``Store`` (this file,
SQLite, the default) and ``artemisd.store_pg.PostgresStore`` (``StateURL``)
both implement it over the same schema, and one contract test suite
(tests/unit/test_store_contract.py) runs over both.  The schema is versioned:
``schema_version`` holds the migrations applied, and a database written by a
newer artemisd is refused rather than half understood.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import time
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import msgspec

from artemisd.control import actions
from artemisd.lease import LEADER, Fenced, Lease, next_lease, released

if TYPE_CHECKING:
    from artemisd.config import DaemonSettings

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
QUARANTINE_KEPT = 10_000
SEQ_MAX = (1 << 63) - 1  # above every record seq (both backends' seq is a signed 64-bit integer)

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
SCHEMA_VERSION = MIGRATIONS[-1][0]


class StoreUnavailable(RuntimeError):
    """The state database cannot be reached now; nothing of the request was kept, retry it later."""


class SchemaError(RuntimeError):
    """The state database was written by a newer artemisd (its schema version is unknown here)."""


RECORD_COUNT = ("COALESCE(SUM(CASE WHEN items > 0 THEN items - COALESCE(json_array_length(skipped), 0) "
                "ELSE 1 END), 0)")
_QUARANTINE_COLS = ("seq", "item", "job", "node", "uid", "reason", "quarantined", "body")


def with_items(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """An ``add_records`` row with its ``items`` (0, one record, where the caller gave none)."""
    return row if len(row) == 8 else (*row, 0)


def by_row(items: Iterable[tuple[int, int, str]]) -> dict[int, dict[int, str]]:
    """``quarantine_items``' argument -> {seq: {item: reason}} (an item named twice keeps its first reason)."""
    out: dict[int, dict[int, str]] = {}
    for seq, item, reason in items:
        out.setdefault(seq, {}).setdefault(item, reason)
    return out


# What quarantine_items reads of a batch row, and writes per item (the quarantine's columns, in order);
# "window" quoted, as PostgreSQL needs it (a reserved word there, an identifier in SQLite either way).
QUARANTINE_ITEM_SOURCE = 'job, "window", node, received, uid, root, body, items, skipped'
QUARANTINE_ITEM_COLS = 'seq, item, job, "window", node, received, uid, root, body, reason, quarantined'


def item_quarantine(seq: int, row: tuple[Any, ...] | None, wanted: dict[int, str], now: float
                    ) -> tuple[list[tuple[Any, ...]], str] | None:
    """For batch row ``seq`` (``row``: its ``QUARANTINE_ITEM_SOURCE``), the quarantine rows
    (``QUARANTINE_ITEM_COLS``) of the items ``wanted`` and not skipped yet, and the row's new ``skipped``;
    None where there is nothing to do (no such batch row, or every item already skipped).

    The body is split once per row, however many of its items go: a restore
    under a lower MaxWorld may quarantine every report of a 100k-rank window.
    An item the body cannot be split at keeps the whole body as its text.
    """
    if row is None or not row[7]:
        return None
    body, skipped = row[6], skipped_items(row[8])
    new = sorted((item, reason) for item, reason in wanted.items() if item not in skipped)
    if not new:
        return None
    try:
        texts = batch_items(body)
    except ValueError:
        texts = []
    rows = [(seq, item, *row[:6], texts[item] if 0 <= item < len(texts) else body, reason[:2000], now)
            for item, reason in new]
    return rows, json.dumps(sorted(skipped | {item for item, _ in new}))


def quarantine_row(row: tuple[Any, ...]) -> dict[str, Any]:
    out = dict(zip(_QUARANTINE_COLS, row))
    out["item"] = None if out["item"] < 0 else out["item"]
    return out


def newer_schema(found: int, where: str) -> SchemaError:
    return SchemaError(f"{where}: the state database is at schema version {found}, newer than this "
                       f"artemisd knows ({SCHEMA_VERSION}); upgrade artemisd or point it at another database")

# Action rows move through the action table's life cycle (control/actions.py ``NEXT``); an update
# that does not follow it is not written.  ``running`` means "intent recorded, result not yet":
# after a crash it is re-run through the idempotent path.
ACTION_OPEN = tuple(sorted(actions.IN_FLIGHT))


@dataclass(frozen=True)
class StoredRecord:
    """A stored row as written: ``body`` is its JSON text, decoded by the reader (it may not decode).

    ``items`` 0: the body is one record; n: a JSON array of n window reports
    (one job, one window), of which the reader skips the indexes in ``skipped``.
    """

    seq: int
    received: float
    uid: int | None
    root: bool
    body: str
    items: int = 0
    skipped: frozenset[int] = frozenset()


_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])


def batch_items(body: str | bytes) -> list[str]:
    """A batch row's body -> each item's own JSON text, in order (ValueError: not a JSON array)."""
    try:
        return [bytes(item).decode() for item in _ITEMS.decode(body)]
    except (msgspec.DecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"a batch row is not a JSON array: {err}") from None


T = TypeVar("T")
MERGED_ROW_BYTES = 1 << 20  # batch rows of several requests are merged up to this size (merge_batch_rows)


def merge_batch_rows(rows: list[tuple[Any, ...]], members: list[list[T]], limit: int = MERGED_ROW_BYTES
                     ) -> tuple[list[tuple[Any, ...]], list[list[T]]]:
    """``add_records`` rows and each row's members -> the same with the batch rows of one job, window,
    time received and sender (uid, root side) merged into one, each at its first place.

    Requests stored together (one per rank, or one per node) each make a batch
    row of a few reports of the same job and window: merged, they are one row
    as a forwarder's body would be, so the database, a standby's follow and a
    restore take one row instead of many.  A merged row's items are its rows'
    items in order (a quarantined item is named by that place); its node is
    theirs where they share one.  Only rows whose texts fit ``limit`` together
    merge: a forwarder's large body stays as it came.
    """
    out_rows: list[list[Any]] = []
    texts: list[list[str]] = []
    out_members: list[list[T]] = []
    sizes: list[int] = []
    open_at: dict[tuple[Any, ...], int] = {}
    for row, own in zip(rows, members):
        job, window, node, received, uid, root, text, items = with_items(row)
        key = (job, window, received, uid, root)
        at = open_at.get(key) if items else None
        if at is not None and sizes[at] + len(text) <= limit:
            merged = out_rows[at]
            merged[2] = node if merged[2] == node else None
            merged[7] += items
            texts[at].append(text)
            sizes[at] += len(text)
            out_members[at].extend(own)
            continue
        if items:
            open_at[key] = len(out_rows)
        out_rows.append([job, window, node, received, uid, root, text, items])
        texts.append([text])
        sizes.append(len(text))
        out_members.append(list(own))
    for row, parts in zip(out_rows, texts):
        if len(parts) > 1:
            # Each part is a JSON array: its items between the first "[" and the last "]".
            row[6] = "[" + ",".join(part[part.index("[") + 1:part.rindex("]")] for part in parts) + "]"
    return [tuple(row) for row in out_rows], out_members


def skipped_items(text: str | None) -> frozenset[int]:
    return frozenset(json.loads(text)) if text else frozenset()


# The oldest seq of ``job``'s newest window rows that hold at most ``at_most``
# reports together (the newest row always, however many it holds): read from
# each row's ``items``, never its body.
RECENT_WINDOWS_FROM = (
    "SELECT MIN(seq) FROM (SELECT seq, SUM(CASE WHEN items > 0 THEN items ELSE 1 END) OVER (ORDER BY seq DESC) "
    "AS reports, ROW_NUMBER() OVER (ORDER BY seq DESC) AS newest FROM records "
    "WHERE job = ? AND \"window\" IS NOT NULL AND seq < ?) AS recent WHERE reports <= ? OR newest = 1")
# A page's upper bound when none is given: above every seq.
NEWEST = 1 << 62
# Incidents a user may read where reads are private (ReadAuth=required): those of the jobs Slurm
# said they own.
OWNED_JOBS = "job IN (SELECT job FROM jobs WHERE user_id = ?)"


class WindowPage(NamedTuple):
    """A page of a job's stored window reports, newest first by row: the reports (in stored order),
    how many older ones are left, and the seq of the page's oldest row (the next page is ``before`` it)."""

    records: list[dict[str, Any]]
    left_out: int
    oldest: int | None


# A job's stored window rows (body, items, skipped), in stored order: ``window_bodies`` decodes them.
JOB_WINDOW_ROWS = "SELECT body, items, skipped FROM records WHERE job = ? AND window IS NOT NULL ORDER BY seq"


def window_bodies(rows: Iterable[tuple[str, int, str | None]]) -> list[dict[str, Any]]:
    """Rows (body, items, skipped) -> every record they hold, decoded, skipped items left out."""
    out: list[dict[str, Any]] = []
    for body, items, skipped in rows:
        if not items:
            out.append(json.loads(body))
            continue
        gone = skipped_items(skipped)
        out.extend(rec for i, rec in enumerate(json.loads(body)) if i not in gone)
    return out


@dataclass
class StoredIncident:
    id: str
    job: str
    step: str | None
    state: str
    subject: str
    analyzer_id: str | None
    plan_step: int
    action_window: int | None
    baseline: float | None
    decide: bool  # the policy must (re)consider it: confirmed, unresolved, or denied
    body: dict[str, Any]
    created: float
    updated: float


# How a stored row moves its job's last_seen and newest window, in both backends' insert of records.
JOB_SEEN = ("ON CONFLICT(job) DO UPDATE SET last_seen = excluded.last_seen, "
            "last_window = COALESCE(excluded.last_window, jobs.last_window)")
_INCIDENT_COLS = ("id, job, step, state, subject, analyzer_id, plan_step, action_window, baseline, decide, "
                  "body, created, updated")
# One upsert for both backends (SQLite's and PostgreSQL's ON CONFLICT agree); "?" is SQLite's
# placeholder, PostgresStore writes it as "%s".
UPSERT_INCIDENT = (
    f"INSERT INTO incidents({_INCIDENT_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT(id) DO UPDATE SET step = excluded.step, state = excluded.state, subject = excluded.subject, "
    "analyzer_id = excluded.analyzer_id, plan_step = excluded.plan_step, "
    "action_window = excluded.action_window, baseline = excluded.baseline, "
    "decide = excluded.decide, body = excluded.body, updated = excluded.updated")


def incident_row(inc: StoredIncident) -> tuple[Any, ...]:
    """The values of ``UPSERT_INCIDENT``, in ``_INCIDENT_COLS`` order."""
    return (inc.id, inc.job, inc.step, inc.state, inc.subject, inc.analyzer_id, inc.plan_step,
            inc.action_window, inc.baseline, int(inc.decide), json.dumps(inc.body), inc.created, inc.updated)


def _incident(row: tuple[Any, ...]) -> StoredIncident:
    return StoredIncident(*row[:9], bool(row[9]), json.loads(row[10]), row[11], row[12])


@dataclass(frozen=True)
class ActionRow:
    id: int
    incident: str
    kind: str
    target: str | None
    params: dict[str, Any]
    status: str
    attempts: int
    next_try: float
    detail: str


class StateStore(Protocol):
    """What the daemon asks of its state, whichever database holds it.

    Each method is one transaction; bodies (JSON text) come back byte for
    byte as written; ``seq`` and action ids grow in the order rows were added.
    """

    def close(self) -> None: ...
    def schema_version(self) -> int: ...
    def next_id(self, name: str, prefix: str) -> str: ...
    def add_records(self, rows: list[tuple[Any, ...]]) -> list[int]: ...
    def quarantine(self, seqs: Iterable[tuple[int, str]], now: float | None = None) -> int: ...
    def quarantine_items(self, items: Iterable[tuple[int, int, str]], now: float | None = None) -> int: ...
    def quarantined(self) -> int: ...
    def quarantine_rows(self, limit: int = 100) -> list[dict[str, Any]]: ...
    def prune_records(self, job: str, keep_windows: int) -> int: ...
    def forget_job(self, job: str) -> None: ...
    def records(self, after: int = 0, upto: int | None = None, skip: Collection[int] = ()
                ) -> Iterator[StoredRecord]: ...
    def analysed_through(self) -> int: ...
    def set_analysed_through(self, seq: int, fence: int) -> None: ...
    def record_count(self, after: int = 0) -> int: ...
    def jobs_with_records(self, jobs: Collection[str]) -> set[str]: ...
    def set_job_owner(self, job: str, user_id: int, partition: str) -> None: ...
    def job_last_seen(self, job: str) -> float | None: ...
    def job_partition(self, job: str) -> str | None: ...
    def job_owner(self, job: str) -> int | None: ...
    def jobs(self) -> list[dict[str, Any]]: ...
    def add_throughput(self, job: str, step: str, window: int, samples_per_s: float, ranks: int) -> None: ...
    def throughput(self, job: str, step: str | None = None) -> list[tuple[str, int, float]]: ...
    def window_records(self, job: str) -> list[dict[str, Any]]: ...
    def recent_window_records(self, job: str, at_most: int, before: int | None = None) -> WindowPage: ...
    def save_incident(self, inc: StoredIncident) -> None: ...
    def incidents(self, states: Iterable[str] | None = None, job: str | None = None,
                  decide: bool | None = None, owner: int | None = None, limit: int | None = None,
                  offset: int = 0) -> list[StoredIncident]: ...
    def incident(self, incident_id: str) -> StoredIncident | None: ...
    def incident_counts(self) -> dict[str, int]: ...
    def add_action(self, incident: str, kind: str, target: str | None, params: dict[str, Any],
                   status: str, now: float, fence: int | None = None) -> int: ...
    def update_action(self, action_id: int, status: str, detail: str = "", next_try: float | None = None,
                      attempt: bool = False, fence: int | None = None) -> bool: ...
    def set_action_params(self, action_id: int, params: dict[str, Any]) -> None: ...
    def due_actions(self, now: float) -> list[ActionRow]: ...
    def clock(self) -> float: ...
    def is_unavailable(self, err: BaseException) -> bool: ...
    def take_lease(self, name: str, holder: str, ttl: float) -> Lease: ...
    def lease(self, name: str) -> Lease | None: ...
    def release_lease(self, name: str, holder: str) -> None: ...
    def heartbeat(self, instance: str, role: str, version: str, started: float) -> None: ...
    def instances(self) -> list[dict[str, Any]]: ...
    def actions_of(self, incident: str) -> list[ActionRow]: ...
    def action(self, action_id: int) -> ActionRow | None: ...
    def drain_actions(self) -> list[tuple[int, str, str, float]]: ...
    def last_action_on(self, target: str, other_than: str) -> float | None: ...
    def audit(self, who: str, what: str, why: str = "", result: str = "", incident: str | None = None,
              action: int | None = None, now: float | None = None) -> None: ...
    def audit_log(self, incident: str | None = None) -> list[dict[str, Any]]: ...
    def add_directive(self, directive_id: str, kind: str, job: str, step: str, incident: str | None,
                      body: dict[str, Any], now: float, expires: float | None) -> None: ...
    def directives_for(self, job: str, step: str, now: float) -> list[dict[str, Any]]: ...
    def probe_times(self, job: str) -> list[float]: ...
    def has_directive(self, directive_id: str) -> bool: ...
    def probe_result(self, directive_id: str, cost_ms: float | None) -> None: ...
    def probe_costs(self) -> list[dict[str, Any]]: ...
    def add_correction(self, correction_id: str, incident: str, node: str, kind: str, gpu: int | None,
                       now: float) -> None: ...
    def corrections(self, node: str, status: str | None = "pending") -> list[dict[str, Any]]: ...
    def correction(self, correction_id: str) -> dict[str, Any] | None: ...
    def set_correction(self, correction_id: str, status: str, detail: str) -> None: ...
    def set_node_evidence(self, node: str, received: float, uid: int | None, body: str) -> None: ...
    def node_evidence(self, node: str) -> tuple[float, dict[str, Any]] | None: ...


def read_password(path: str | Path) -> str:
    """The password in ``StatePasswordFile``: refused unless only its owner can read it.

    Checked on the open file (fstat), so the file read is the file checked.
    """
    from artemisd.config import ConfigError  # config imports nothing of the store; keep it that way

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as err:
        raise ConfigError(path, None, "StatePasswordFile", f"cannot read: {err.strerror}") from None
    with os.fdopen(fd, "r", encoding="utf-8") as f:
        mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
        if mode & 0o044:
            raise ConfigError(path, None, "StatePasswordFile",
                              f"mode {mode:04o} lets group or others read the password; "
                              f"chmod 600 it (owned by the daemon's user)")
        text = f.read()
    # One line; the newline an editor or `echo` leaves is not part of the password.
    return text.removesuffix("\n").removesuffix("\r")


def open_store(settings: DaemonSettings) -> StateStore:
    """The daemon's store: PostgreSQL when ``StateURL`` is set, else SQLite under ``StateDir``."""
    if settings.state_url:
        from artemisd.store_pg import PostgresStore  # psycopg is an optional dependency (the postgres extra)

        password = read_password(settings.state_password_file) if settings.state_password_file else None
        return PostgresStore(settings.state_url, password=password, lease_time=settings.lease_time)
    return Store(Path(settings.state_dir) / "artemis.db")


class Store:
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

    def schema_version(self) -> int:
        """The last migration applied (0: none yet)."""
        return self.db.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()[0]

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

    def quarantine(self, seqs: Iterable[tuple[int, str]], now: float | None = None) -> int:
        """Move records ``(seq, reason)`` out of the replayed history; returns how many moved."""
        now = time.time() if now is None else now
        moved = 0
        with self._tx() as db:
            for seq, reason in seqs:
                (count,) = db.execute(f"SELECT {RECORD_COUNT} FROM records WHERE seq = ?", (seq,)).fetchone()
                db.execute("INSERT OR REPLACE INTO quarantine SELECT seq, -1, job, window, node, received, uid, "
                           "root, body, ?, ? FROM records WHERE seq = ?", (reason[:2000], now, seq))
                db.execute("DELETE FROM records WHERE seq = ?", (seq,))
                moved += count
            self._quarantined(db, moved)
        return moved

    def quarantine_items(self, items: Iterable[tuple[int, int, str]], now: float | None = None) -> int:
        """Take items ``(seq, item, reason)`` of batch rows out of the replayed history (copied to the
        quarantine, marked skipped in their row); returns how many were taken.  Idempotent: an item
        already skipped, or a row already gone, is left alone."""
        now = time.time() if now is None else now
        moved = 0
        with self._tx() as db:
            for seq, wanted in by_row(items).items():
                row = db.execute(f"SELECT {QUARANTINE_ITEM_SOURCE} FROM records WHERE seq = ?", (seq,)).fetchone()
                plan = item_quarantine(seq, row, wanted, now)
                if plan is None:
                    continue
                rows, skipped = plan
                db.executemany(f"INSERT OR REPLACE INTO quarantine({QUARANTINE_ITEM_COLS}) "
                               "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
                db.execute("UPDATE records SET skipped = ? WHERE seq = ?", (skipped, seq))
                moved += len(rows)
            self._quarantined(db, moved)
        return moved

    @staticmethod
    def _quarantined(db: sqlite3.Connection, moved: int) -> None:
        db.execute("DELETE FROM quarantine WHERE (seq, item) <= (SELECT seq, item FROM quarantine "
                   "ORDER BY seq DESC, item DESC LIMIT 1 OFFSET ?)", (QUARANTINE_KEPT,))
        db.execute("INSERT INTO counters(name, value) VALUES ('quarantined', ?) "
                   "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value", (moved,))

    def quarantined(self) -> int:
        """Records ever quarantined (the table keeps the last ``QUARANTINE_KEPT``)."""
        row = self.db.execute("SELECT value FROM counters WHERE name = 'quarantined'").fetchone()
        return row[0] if row else 0

    def quarantine_rows(self, limit: int = 100) -> list[dict[str, Any]]:
        cur = self.db.execute("SELECT seq, item, job, node, uid, reason, quarantined, body FROM quarantine "
                              "ORDER BY seq DESC, item DESC LIMIT ?", (limit,))
        return [quarantine_row(row) for row in cur]

    def prune_records(self, job: str, keep_windows: int) -> int:
        """Keep the last ``keep_windows`` windows of ``job`` (its node events with them)."""
        with self._tx() as db:
            row = db.execute("SELECT MAX(window) FROM records WHERE job = ?", (job,)).fetchone()
            if row is None or row[0] is None:
                return 0
            cur = db.execute("DELETE FROM records WHERE job = ? AND window IS NOT NULL AND window <= ?",
                             (job, row[0] - keep_windows))
            return cur.rowcount

    def forget_job(self, job: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM records WHERE job = ?", (job,))
            db.execute("DELETE FROM throughput WHERE job = ?", (job,))

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

    def analysed_through(self) -> int:
        """Every record up to this seq has been analysed by a leader (its incidents published)."""
        row = self.db.execute("SELECT value FROM counters WHERE name = 'analysed'").fetchone()
        return row[0] if row else 0

    def set_analysed_through(self, seq: int, fence: int) -> None:
        """The leader (``fence``: its lease token) has analysed every record up to ``seq``; never lowered."""
        with self._tx() as db:
            self._check_fence(db, fence)
            db.execute("INSERT INTO counters(name, value) VALUES ('analysed', ?) "
                       "ON CONFLICT(name) DO UPDATE SET value = max(value, excluded.value)", (seq,))

    def record_count(self, after: int = 0) -> int:
        """Records kept in rows above seq ``after`` (a batch row counts its items not skipped)."""
        return self.db.execute(f"SELECT {RECORD_COUNT} FROM records WHERE seq > ?", (after,)).fetchone()[0]

    def jobs_with_records(self, jobs: Collection[str]) -> set[str]:
        """Those of ``jobs`` that have records stored (``forget_job`` leaves none)."""
        cur = self.db.execute("SELECT DISTINCT job FROM records WHERE job IN (SELECT value FROM json_each(?))",
                              (json.dumps(sorted(jobs)),))
        return {job for (job,) in cur}

    # --- jobs and throughput ------------------------------------------------

    def set_job_owner(self, job: str, user_id: int, partition: str) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO jobs(job, user_id, partition) VALUES (?, ?, ?) "
                       "ON CONFLICT(job) DO UPDATE SET user_id = excluded.user_id, partition = excluded.partition",
                       (job, user_id, partition))

    def job_last_seen(self, job: str) -> float | None:
        row = self.db.execute("SELECT last_seen FROM jobs WHERE job = ?", (job,)).fetchone()
        return row[0] if row else None

    def job_partition(self, job: str) -> str | None:
        row = self.db.execute("SELECT partition FROM jobs WHERE job = ?", (job,)).fetchone()
        return row[0] if row else None

    def job_owner(self, job: str) -> int | None:
        """The uid Slurm said owns ``job``; None where no user's report made the daemon ask."""
        row = self.db.execute("SELECT user_id FROM jobs WHERE job = ?", (job,)).fetchone()
        return row[0] if row else None

    def jobs(self) -> list[dict[str, Any]]:
        cur = self.db.execute("SELECT job, user_id, partition, first_seen, last_seen, last_window FROM jobs "
                              "ORDER BY last_seen DESC")
        cols = ("job", "user_id", "partition", "first_seen", "last_seen", "last_window")
        return [dict(zip(cols, row)) for row in cur]

    def add_throughput(self, job: str, step: str, window: int, samples_per_s: float, ranks: int) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO throughput VALUES (?, ?, ?, ?, ?)",
                       (job, step, window, samples_per_s, ranks))

    def throughput(self, job: str, step: str | None = None) -> list[tuple[str, int, float]]:
        """(step, window, samples/s) of a job, oldest first."""
        if step is None:
            cur = self.db.execute("SELECT step, window, samples_per_s FROM throughput WHERE job = ? "
                                  "ORDER BY window", (job,))
        else:
            cur = self.db.execute("SELECT step, window, samples_per_s FROM throughput WHERE job = ? AND step = ? "
                                  "ORDER BY window", (job, step))
        return list(cur)

    def window_records(self, job: str) -> list[dict[str, Any]]:
        return window_bodies(self.db.execute(JOB_WINDOW_ROWS, (job,)))

    def recent_window_records(self, job: str, at_most: int, before: int | None = None) -> WindowPage:
        """``job``'s newest stored window reports below row ``before``, whole rows up to ``at_most``
        reports (the newest row whatever its size: at most ``MaxWorld``), in stored order."""
        below = NEWEST if before is None else before
        (oldest,) = self.db.execute(RECENT_WINDOWS_FROM, (job, below, at_most)).fetchone()
        if oldest is None:
            return WindowPage([], 0, None)
        rows = window_bodies(self.db.execute("SELECT body, items, skipped FROM records WHERE job = ? AND "
                                             "window IS NOT NULL AND seq >= ? AND seq < ? ORDER BY seq",
                                             (job, oldest, below)))
        (left_out,) = self.db.execute(f"SELECT {RECORD_COUNT} FROM records WHERE job = ? AND window IS NOT NULL "
                                      "AND seq < ?", (job, oldest)).fetchone()
        return WindowPage(rows, left_out, oldest)

    # --- incidents --------------------------------------------------------

    def save_incident(self, inc: StoredIncident) -> None:
        inc.updated = time.time()
        with self._tx() as db:
            db.execute(UPSERT_INCIDENT, incident_row(inc))

    def incidents(self, states: Iterable[str] | None = None, job: str | None = None,
                  decide: bool | None = None, owner: int | None = None, limit: int | None = None,
                  offset: int = 0) -> list[StoredIncident]:
        sql = f"SELECT {_INCIDENT_COLS} FROM incidents WHERE 1"
        args: tuple[Any, ...] = ()
        if states is not None:
            wanted = tuple(states)
            sql += f" AND state IN ({','.join('?' * len(wanted))})"
            args += wanted
        if job is not None:
            sql += " AND job = ?"
            args += (job,)
        if decide is not None:
            sql += " AND decide = ?"
            args += (int(decide),)
        if owner is not None:
            sql += f" AND {OWNED_JOBS}"
            args += (owner,)
        sql += " ORDER BY created, CAST(SUBSTR(id, INSTR(id, '-') + 1) AS INTEGER)"
        if limit is not None or offset:
            sql += " LIMIT ? OFFSET ?"
            args += (-1 if limit is None else limit, offset)
        return [_incident(row) for row in self.db.execute(sql, args)]

    def incident(self, incident_id: str) -> StoredIncident | None:
        row = self.db.execute(f"SELECT {_INCIDENT_COLS} FROM incidents WHERE id = ?", (incident_id,)).fetchone()
        return _incident(row) if row else None

    def incident_counts(self) -> dict[str, int]:
        """Incidents per state (the gauges), only states that have any."""
        return dict(self.db.execute("SELECT state, COUNT(*) FROM incidents GROUP BY state").fetchall())

    # --- actions ----------------------------------------------------------

    def add_action(self, incident: str, kind: str, target: str | None, params: dict[str, Any],
                   status: str, now: float, fence: int | None = None) -> int:
        """A new action intent; with ``fence``, only while that is still the leader lease's token."""
        with self._tx() as db:
            self._check_fence(db, fence)
            cur = db.execute("INSERT INTO actions(incident, kind, target, params, status, next_try, created, updated, "
                             "token) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                             (incident, kind, target, json.dumps(params), status, now, now, now, fence))
            return int(cur.lastrowid)

    def update_action(self, action_id: int, status: str, detail: str = "", next_try: float | None = None,
                      attempt: bool = False, fence: int | None = None) -> bool:
        """Move an action row to ``status``; False (nothing written) where its life cycle does not
        allow it from the status it is in (another writer got there first)."""
        with self._tx() as db:
            self._check_fence(db, fence)
            cur = db.execute("UPDATE actions SET status = ?, detail = ?, updated = ?, "
                             "next_try = COALESCE(?, next_try), attempts = attempts + ?, token = COALESCE(?, token) "
                             f"WHERE id = ? AND status IN {actions.sql_list(actions.came_from(status))}",
                             (status, detail, time.time(), next_try, 1 if attempt else 0, fence, action_id))
            return cur.rowcount > 0

    @staticmethod
    def _check_fence(db: sqlite3.Connection, fence: int | None) -> None:
        if fence is None:
            return
        row = db.execute("SELECT token, holder FROM leases WHERE name = ?", (LEADER,)).fetchone()
        if row is None or row[0] != fence:
            raise Fenced(fence, row[0] if row else None, row[1] if row else None)

    # --- the leader lease (artemisd/lease.py) ------------------------------

    def clock(self) -> float:
        # One host holds a SQLite file: its clock is the only one.
        return time.time()

    @staticmethod
    def is_unavailable(err: BaseException) -> bool:
        """Another process held the file past busy_timeout: worth retrying later."""
        return isinstance(err, sqlite3.OperationalError) and "locked" in str(err)

    def take_lease(self, name: str, holder: str, ttl: float) -> Lease:
        with self._tx() as db:
            now = self.clock()
            current = self._lease(db, name)
            after = next_lease(current, name, holder, ttl, now)
            if after != current:
                db.execute("INSERT OR REPLACE INTO leases(name, holder, token, acquired, renewed, expires) "
                           "VALUES (?, ?, ?, ?, ?, ?)",
                           (after.name, after.holder, after.token, after.acquired, after.renewed, after.expires))
        return after

    def lease(self, name: str) -> Lease | None:
        return self._lease(self.db, name)

    def release_lease(self, name: str, holder: str) -> None:
        with self._tx() as db:
            now = self.clock()
            current = self._lease(db, name)
            after = released(current, holder, now)
            if after is not None and after != current:
                db.execute("UPDATE leases SET expires = ? WHERE name = ?", (after.expires, name))

    def heartbeat(self, instance: str, role: str, version: str, started: float) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO instances(instance, role, version, started, seen) VALUES (?, ?, ?, ?, ?) "
                       "ON CONFLICT(instance) DO UPDATE SET role = excluded.role, version = excluded.version, "
                       "started = excluded.started, seen = excluded.seen",
                       (instance, role, version, started, self.clock()))

    def instances(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [{"instance": r[0], "role": r[1], "version": r[2], "started": r[3], "seen_s_ago": round(now - r[4], 1)}
                for r in self.db.execute("SELECT instance, role, version, started, seen FROM instances "
                                         "ORDER BY instance")]

    @staticmethod
    def _lease(db: sqlite3.Connection, name: str) -> Lease | None:
        row = db.execute("SELECT name, holder, token, acquired, renewed, expires FROM leases WHERE name = ?",
                         (name,)).fetchone()
        return Lease(*row) if row else None

    def _action_rows(self, sql: str, args: tuple[Any, ...]) -> list[ActionRow]:
        return [ActionRow(r[0], r[1], r[2], r[3], json.loads(r[4]), r[5], r[6], r[7], r[8])
                for r in self.db.execute(
                    "SELECT id, incident, kind, target, params, status, attempts, next_try, detail "
                    f"FROM actions {sql}", args)]

    def set_action_params(self, action_id: int, params: dict[str, Any]) -> None:
        with self._tx() as db:
            db.execute("UPDATE actions SET params = ?, updated = ? WHERE id = ?",
                       (json.dumps(params), time.time(), action_id))

    def due_actions(self, now: float) -> list[ActionRow]:
        return self._action_rows(f"WHERE status IN {actions.SQL_DUE} AND next_try <= ? ORDER BY id", (now,))

    def actions_of(self, incident: str) -> list[ActionRow]:
        return self._action_rows("WHERE incident = ? ORDER BY id", (incident,))

    def action(self, action_id: int) -> ActionRow | None:
        rows = self._action_rows("WHERE id = ?", (action_id,))
        return rows[0] if rows else None

    def drain_actions(self) -> list[tuple[int, str, str, float]]:
        """(id, node, status, when) of every drain that may count toward a budget.

        ``when`` is when it was approved, else when it was decided: an approval
        given hours after the decision drains the node at approval time.
        """
        rows = self.db.execute("SELECT id, target, status, created, params FROM actions WHERE kind = 'drain' AND "
                               f"status IN {actions.SQL_BUDGETED} ORDER BY id")
        return [(aid, target, status, float(json.loads(params).get("approved_at", created)))
                for aid, target, status, created, params in rows]

    def last_action_on(self, target: str, other_than: str) -> float | None:
        """When another incident last acted on ``target`` (cooldowns are between incidents; telling
        people acts on nothing)."""
        row = self.db.execute("SELECT MAX(created) FROM actions WHERE target = ? AND incident != ? AND "
                              f"kind NOT IN {actions.SQL_TELL} AND status NOT IN {actions.SQL_NEVER_ACTED}",
                              (target, other_than)).fetchone()
        return row[0] if row else None

    # --- audit ------------------------------------------------------------

    def audit(self, who: str, what: str, why: str = "", result: str = "", incident: str | None = None,
              action: int | None = None, now: float | None = None) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO audit(time, incident, action, who, what, why, result) VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (now if now is not None else time.time(), incident, action, who, what, why, result))

    def audit_log(self, incident: str | None = None) -> list[dict[str, Any]]:
        cols = ("id", "time", "incident", "action", "who", "what", "why", "result")
        if incident is None:
            cur = self.db.execute(f"SELECT {', '.join(cols)} FROM audit ORDER BY id")
        else:
            cur = self.db.execute(f"SELECT {', '.join(cols)} FROM audit WHERE incident = ? ORDER BY id", (incident,))
        return [dict(zip(cols, row)) for row in cur]

    # --- directives -------------------------------------------------------

    def add_directive(self, directive_id: str, kind: str, job: str, step: str, incident: str | None,
                      body: dict[str, Any], now: float, expires: float | None) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO directives(id, type, job, step, incident, body, issued, expires) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (directive_id, kind, job, step, incident, json.dumps(body), now, expires))

    def directives_for(self, job: str, step: str, now: float) -> list[dict[str, Any]]:
        """Live directives of a job step: unexpired probes, and the latest rebalance."""
        rows = self.db.execute("SELECT type, body, expires FROM directives WHERE job = ? AND step = ? "
                               "ORDER BY issued, rowid", (job, step)).fetchall()
        out = [json.loads(body) for kind, body, expires in rows
               if kind == "probe" and (expires is None or expires > now)]
        rebalances = [json.loads(body) for kind, body, _ in rows if kind == "rebalance"]
        if rebalances:
            out.append(rebalances[-1])
        return out

    def probe_times(self, job: str) -> list[float]:
        return [t for (t,) in self.db.execute(
            "SELECT issued FROM directives WHERE job = ? AND type = 'probe' ORDER BY issued", (job,))]

    def has_directive(self, directive_id: str) -> bool:
        return self.db.execute("SELECT 1 FROM directives WHERE id = ?", (directive_id,)).fetchone() is not None

    def probe_result(self, directive_id: str, cost_ms: float | None) -> None:
        with self._tx() as db:
            db.execute("UPDATE directives SET ranks_reported = ranks_reported + 1, cost_ms = cost_ms + ? "
                       "WHERE id = ?", (cost_ms or 0.0, directive_id))

    def probe_costs(self) -> list[dict[str, Any]]:
        cols = ("id", "job", "step", "incident", "issued", "ranks_reported", "cost_ms")
        return [dict(zip(cols, row)) for row in self.db.execute(
            f"SELECT {', '.join(cols)} FROM directives WHERE type = 'probe' ORDER BY issued")]

    # --- corrections --------------------------------------------------------

    def add_correction(self, correction_id: str, incident: str, node: str, kind: str, gpu: int | None,
                       now: float) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO corrections(id, incident, node, kind, gpu, status, created, updated) "
                       "VALUES (?, ?, ?, ?, ?, 'pending', ?, ?)", (correction_id, incident, node, kind, gpu, now, now))

    def corrections(self, node: str, status: str | None = "pending") -> list[dict[str, Any]]:
        cols = ("id", "incident", "node", "kind", "gpu", "status", "detail")
        sql = f"SELECT {', '.join(cols)} FROM corrections WHERE node = ?"
        args: tuple[Any, ...] = (node,)
        if status is not None:
            sql += " AND status = ?"
            args += (status,)
        return [dict(zip(cols, row)) for row in self.db.execute(sql + " ORDER BY created", args)]

    def correction(self, correction_id: str) -> dict[str, Any] | None:
        cols = ("id", "incident", "node", "kind", "gpu", "status", "detail")
        row = self.db.execute(f"SELECT {', '.join(cols)} FROM corrections WHERE id = ?", (correction_id,)).fetchone()
        return dict(zip(cols, row)) if row else None

    def set_correction(self, correction_id: str, status: str, detail: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE corrections SET status = ?, detail = ?, updated = ? WHERE id = ?",
                       (status, detail, time.time(), correction_id))

    # --- root-side node evidence --------------------------------------------

    def set_node_evidence(self, node: str, received: float, uid: int | None, body: str) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO node_evidence VALUES (?, ?, ?, ?)", (node, received, uid, body))

    def node_evidence(self, node: str) -> tuple[float, dict[str, Any]] | None:
        row = self.db.execute("SELECT received, body FROM node_evidence WHERE node = ?", (node,)).fetchone()
        return (row[0], json.loads(row[1])) if row else None
