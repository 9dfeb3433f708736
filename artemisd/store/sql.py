"""The SQL both backends run, written once: ``SqlStore``, the ``StateStore`` methods whose statements are
the same in SQLite and PostgreSQL, and the statements the backends' own methods share.

``SqlStore`` holds the records, jobs and incidents; its base ``LoopSql``
(store/sql_loop.py) the live loop's tables; how each backend runs them is
``SqlDialect`` (store/sql_dialect.py).  What the backends do differently
is theirs (store/sqlite.py, store/postgres.py).

Every public method is one transaction (``_tx``), as ``StateStore`` says.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Iterable
from typing import Any

from artemisd.store.base import (
    _QUARANTINE_COLS,
    QUARANTINE_KEPT,
    StoredIncident,
    WindowPage,
    by_row,
    item_quarantine,
    quarantine_row,
    window_bodies,
)
from artemisd.store.sql_loop import LoopSql

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
# A job's stored window rows (body, items, skipped), in stored order: ``window_bodies`` decodes them.
JOB_WINDOW_ROWS = 'SELECT body, items, skipped FROM records WHERE job = ? AND "window" IS NOT NULL ORDER BY seq'

# How a stored row moves its job's last_seen and newest window, in both backends' insert of records.
JOB_SEEN = ("ON CONFLICT(job) DO UPDATE SET last_seen = excluded.last_seen, "
            "last_window = COALESCE(excluded.last_window, jobs.last_window)")
_INCIDENT_COLS = ("id, job, step, state, subject, analyzer_id, plan_step, action_window, baseline, decide, "
                  "body, created, updated")
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


# A record row's columns as the quarantine copies them (store/postgres.py inserts them too).
RECORD_COLS = 'seq, job, "window", node, received, uid, root, body'
# What quarantine_items reads of a batch row, and writes per item (the quarantine's columns, in order).
QUARANTINE_ITEM_SOURCE = 'job, "window", node, received, uid, root, body, items, skipped'
QUARANTINE_ITEM_COLS = 'seq, item, job, "window", node, received, uid, root, body, reason, quarantined'
# A row quarantined again replaces the one kept (SQLite's INSERT OR REPLACE, said so both understand it).
QUARANTINE_UPSERT = ("ON CONFLICT(seq, item) DO UPDATE SET job = excluded.job, \"window\" = excluded.\"window\", "
                     "node = excluded.node, received = excluded.received, uid = excluded.uid, root = excluded.root, "
                     "body = excluded.body, reason = excluded.reason, quarantined = excluded.quarantined")
_JOB_COLS = ("job", "user_id", "partition", "first_seen", "last_seen", "last_window")


class SqlStore(LoopSql):
    """The ``StateStore`` methods both backends run as the same SQL; a subclass connects (``db``) and
    says how its dialect differs (``SqlDialect``)."""

    # --- records ----------------------------------------------------------

    def quarantine(self, seqs: Iterable[tuple[int, str]], now: float | None = None) -> int:
        """Move records ``(seq, reason)`` out of the replayed history; returns how many moved."""
        now = time.time() if now is None else now
        moved = 0
        with self._tx():
            for seq, reason in seqs:
                (count,) = self._one(f"SELECT {self._RECORD_COUNT} FROM records WHERE seq = ?", (seq,))
                self._run(f"INSERT INTO quarantine(item, {RECORD_COLS}, reason, quarantined) "
                          f"SELECT -1, {RECORD_COLS}, ?, ? FROM records WHERE seq = ? " + QUARANTINE_UPSERT,
                          (reason[:2000], now, seq))
                self._run("DELETE FROM records WHERE seq = ?", (seq,))
                moved += count
            self._quarantined(moved)
        return moved

    def quarantine_items(self, items: Iterable[tuple[int, int, str]], now: float | None = None) -> int:
        """Take items ``(seq, item, reason)`` of batch rows out of the replayed history (copied to the
        quarantine, marked skipped in their row); returns how many were taken.  Idempotent: an item
        already skipped, or a row already gone, is left alone."""
        now = time.time() if now is None else now
        moved = 0
        with self._tx():
            for seq, wanted in by_row(items).items():
                row = self._one(f"SELECT {QUARANTINE_ITEM_SOURCE} FROM records WHERE seq = ?{self._UPDATE_LOCK}",
                                (seq,))
                plan = item_quarantine(seq, row, wanted, now)
                if plan is None:
                    continue
                rows, skipped = plan
                self._many(f"INSERT INTO quarantine({QUARANTINE_ITEM_COLS}) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) " + QUARANTINE_UPSERT, rows)
                self._run("UPDATE records SET skipped = ? WHERE seq = ?", (skipped, seq))
                moved += len(rows)
            self._quarantined(moved)
        return moved

    def _quarantined(self, moved: int) -> None:
        self._run("DELETE FROM quarantine WHERE (seq, item) <= (SELECT seq, item FROM quarantine "
                  "ORDER BY seq DESC, item DESC LIMIT 1 OFFSET ?)", (QUARANTINE_KEPT,))
        self._run("INSERT INTO counters(name, value) VALUES ('quarantined', ?) "
                  "ON CONFLICT(name) DO UPDATE SET value = counters.value + excluded.value", (moved,))

    def quarantined(self) -> int:
        """Records ever quarantined (the table keeps the last ``QUARANTINE_KEPT``)."""
        row = self._one("SELECT value FROM counters WHERE name = 'quarantined'")
        return row[0] if row else 0

    def quarantine_rows(self, limit: int = 100) -> list[dict[str, Any]]:
        return [quarantine_row(row) for row in self._all(
            f"SELECT {', '.join(_QUARANTINE_COLS)} FROM quarantine ORDER BY seq DESC, item DESC LIMIT ?", (limit,))]

    def prune_records(self, job: str, keep_windows: int) -> int:
        """Keep the last ``keep_windows`` windows of ``job`` (its node events with them)."""
        with self._tx():
            row = self._one('SELECT MAX("window") FROM records WHERE job = ?', (job,))
            if row is None or row[0] is None:
                return 0
            return self._run('DELETE FROM records WHERE job = ? AND "window" IS NOT NULL AND "window" <= ?',
                             (job, row[0] - keep_windows)).rowcount

    def forget_job(self, job: str) -> None:
        with self._tx():
            self._run("DELETE FROM records WHERE job = ?", (job,))
            self._run("DELETE FROM throughput WHERE job = ?", (job,))

    def analysed_through(self) -> int:
        """Every record up to this seq has been analysed by a leader (its incidents published)."""
        row = self._one("SELECT value FROM counters WHERE name = 'analysed'")
        return row[0] if row else 0

    def set_analysed_through(self, seq: int, fence: int) -> None:
        """The leader (``fence``: its lease token) has analysed every record up to ``seq``; never lowered."""
        with self._tx():
            # Written after every batch the leader stores and analyses: a crash that loses it leaves
            # the mark lower, and the next leader analyses those rows once more (what it did before the mark).
            self._commit_unflushed()
            self._check_fence(fence)
            self._run("INSERT INTO counters(name, value) VALUES ('analysed', ?) ON CONFLICT(name) "
                      f"DO UPDATE SET value = {self._GREATEST}(counters.value, excluded.value)", (seq,))

    def record_count(self, after: int = 0) -> int:
        """Records kept in rows above seq ``after`` (a batch row counts its items not skipped)."""
        return self._one(f"SELECT {self._RECORD_COUNT} FROM records WHERE seq > ?", (after,))[0]

    def jobs_with_records(self, jobs: Collection[str]) -> set[str]:
        """Those of ``jobs`` that have records stored (``forget_job`` leaves none)."""
        among, arg = self._in(sorted(jobs))
        return {job for (job,) in self._all(f"SELECT DISTINCT job FROM records WHERE job {among}", (arg,))}

    # --- jobs and throughput ------------------------------------------------

    def set_job_owner(self, job: str, user_id: int, partition: str) -> None:
        with self._tx():
            self._run("INSERT INTO jobs(job, user_id, partition) VALUES (?, ?, ?) ON CONFLICT(job) "
                      "DO UPDATE SET user_id = excluded.user_id, partition = excluded.partition",
                      (job, user_id, partition))

    def job_last_seen(self, job: str) -> float | None:
        row = self._one("SELECT last_seen FROM jobs WHERE job = ?", (job,))
        return row[0] if row else None

    def job_partition(self, job: str) -> str | None:
        row = self._one("SELECT partition FROM jobs WHERE job = ?", (job,))
        return row[0] if row else None

    def job_owner(self, job: str) -> int | None:
        """The uid Slurm said owns ``job``; None where no user's report made the daemon ask."""
        row = self._one("SELECT user_id FROM jobs WHERE job = ?", (job,))
        return row[0] if row else None

    def jobs(self) -> list[dict[str, Any]]:
        return [dict(zip(_JOB_COLS, row)) for row in self._all(
            f"SELECT {', '.join(_JOB_COLS)} FROM jobs ORDER BY {self._JOBS_ORDER}")]

    def add_throughput(self, job: str, step: str, window: int, samples_per_s: float, ranks: int) -> None:
        with self._tx():
            self._run('INSERT INTO throughput VALUES (?, ?, ?, ?, ?) ON CONFLICT(job, step, "window") '
                      "DO UPDATE SET samples_per_s = excluded.samples_per_s, ranks = excluded.ranks",
                      (job, step, window, samples_per_s, ranks))

    def throughput(self, job: str, step: str | None = None) -> list[tuple[str, int, float]]:
        """(step, window, samples/s) of a job, oldest first."""
        if step is None:
            return self._all('SELECT step, "window", samples_per_s FROM throughput WHERE job = ? '
                             'ORDER BY "window"', (job,))
        return self._all('SELECT step, "window", samples_per_s FROM throughput WHERE job = ? AND step = ? '
                         'ORDER BY "window"', (job, step))

    def window_records(self, job: str) -> list[dict[str, Any]]:
        return window_bodies(self._all(JOB_WINDOW_ROWS, (job,)))

    def recent_window_records(self, job: str, at_most: int, before: int | None = None) -> WindowPage:
        """``job``'s newest stored window reports below row ``before``, whole rows up to ``at_most``
        reports (the newest row whatever its size: at most ``MaxWorld``), in stored order."""
        below = NEWEST if before is None else before
        (oldest,) = self._one(RECENT_WINDOWS_FROM, (job, below, at_most))
        if oldest is None:
            return WindowPage([], 0, None)
        rows = window_bodies(self._all('SELECT body, items, skipped FROM records WHERE job = ? '
                                       'AND "window" IS NOT NULL AND seq >= ? AND seq < ? ORDER BY seq',
                                       (job, oldest, below)))
        (left_out,) = self._one(f'SELECT {self._RECORD_COUNT} FROM records WHERE job = ? AND "window" IS NOT NULL '
                                'AND seq < ?', (job, oldest))
        return WindowPage(rows, left_out, oldest)

    # --- incidents --------------------------------------------------------

    def save_incident(self, inc: StoredIncident) -> None:
        inc.updated = time.time()
        with self._tx():
            self._run(UPSERT_INCIDENT, incident_row(inc))

    def incidents(self, states: Iterable[str] | None = None, job: str | None = None,
                  decide: bool | None = None, owner: int | None = None, limit: int | None = None,
                  offset: int = 0) -> list[StoredIncident]:
        sql = f"SELECT {_INCIDENT_COLS} FROM incidents WHERE TRUE"
        args: tuple[Any, ...] = ()
        if states is not None:
            among, arg = self._in(states)
            sql += f" AND state {among}"
            args += (arg,)
        if job is not None:
            sql += " AND job = ?"
            args += (job,)
        if decide is not None:
            sql += " AND decide = ?"
            args += (int(decide),)
        if owner is not None:
            sql += f" AND {OWNED_JOBS}"
            args += (owner,)
        sql += f" {self._INCIDENT_ORDER}"
        if limit is not None or offset:
            sql += " LIMIT ? OFFSET ?"
            args += (self._NO_LIMIT if limit is None else limit, offset)
        return [_incident(row) for row in self._all(sql, args)]

    def incident(self, incident_id: str) -> StoredIncident | None:
        row = self._one(f"SELECT {_INCIDENT_COLS} FROM incidents WHERE id = ?", (incident_id,))
        return _incident(row) if row else None

    def incident_counts(self) -> dict[str, int]:
        """Incidents per state (the gauges), only states that have any."""
        return dict(self._all("SELECT state, COUNT(*) FROM incidents GROUP BY state"))
