"""The daemon's state: one SQLite file in WAL mode, or a PostgreSQL database (``StateURL``).

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

``StateStore`` is what the daemon may ask of a store; ``Store``
(store/sqlite.py, SQLite, the default) and ``PostgresStore``
(store/postgres.py, ``StateURL``) both implement it over the same schema, and
one contract test suite (tests/unit/test_store_contract.py) runs over both.
The schema is versioned: ``schema_version`` holds the migrations applied, and
a database written by a newer artemisd is refused rather than half understood.

The package: store/base.py, the records, errors, ``StateStore`` and the
helpers on rows; store/sql.py (with store/sql_loop.py and
store/sql_dialect.py), ``SqlStore``, the SQL both backends run, written once;
store/sqlite.py and store/postgres.py, each backend's own.  This module is
the interface callers import, and ``open_store``.  The backends import the
shared modules, never the other way; PostgreSQL's is imported only when
``StateURL`` asks for it (psycopg is an optional dependency).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from artemisd.store.base import (
    MERGED_ROW_BYTES,
    QUARANTINE_KEPT,
    SCHEMA_VERSION,
    SEQ_MAX,
    ActionRow,
    SchemaError,
    StateStore,
    StoredIncident,
    StoredRecord,
    StoreUnavailable,
    WindowPage,
    batch_items,
    merge_batch_rows,
    window_bodies,
)
from artemisd.store.sql import JOB_WINDOW_ROWS
from artemisd.store.sqlite import RECORD_COUNT, SCHEMA, Store

if TYPE_CHECKING:
    from artemisd.config import DaemonSettings

__all__ = [
    "JOB_WINDOW_ROWS", "MERGED_ROW_BYTES", "QUARANTINE_KEPT", "RECORD_COUNT", "SCHEMA", "SCHEMA_VERSION", "SEQ_MAX",
    "ActionRow", "SchemaError", "StateStore", "Store", "StoredIncident", "StoredRecord", "StoreUnavailable",
    "WindowPage", "batch_items", "merge_batch_rows", "open_store", "read_password", "window_bodies",
]


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
        from artemisd.store.postgres import PostgresStore  # psycopg is an optional dependency (the postgres extra)

        password = read_password(settings.state_password_file) if settings.state_password_file else None
        return PostgresStore(settings.state_url, password=password, lease_time=settings.lease_time)
    return Store(Path(settings.state_dir) / "artemis.db")

