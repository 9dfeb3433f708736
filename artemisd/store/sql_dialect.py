"""How a backend runs the SQL that ``SqlStore`` (store/sql.py) writes once for both.

Statements are written with SQLite's ``?`` placeholder; a backend's ``_run``
writes them in its own (PostgreSQL's ``%s``).  Column ``window`` is always
quoted: a reserved word in PostgreSQL, an identifier in SQLite either way.
Where the two dialects differ in a word, the backend says it in a class
attribute (``_RECORD_COUNT``, ``_INCIDENT_ORDER``, the row locks ...) or a
small method (``_in``, ``_insert_id``, ``_clock_sql`` ...); where they differ
in more (connecting, migrating, inserting records, reading them back, the
clock), the method is the backend's own (store/sqlite.py, store/postgres.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any


class SqlDialect:
    """What the shared SQL asks of a backend: its connection (``db``), transactions, statements run, and the
    words its dialect says otherwise."""

    db: Any
    # A batch row counts its items not skipped; ``skipped`` is JSON text, read as JSON where the dialect needs it.
    _RECORD_COUNT: str
    # Incidents in the order they were created, ids of one second by their number.
    _INCIDENT_ORDER: str
    # What LIMIT takes for "no limit".
    _NO_LIMIT: int | None
    # Newest first, jobs never seen last.
    _JOBS_ORDER: str
    # The column that keeps directives in the order they were inserted.
    _DIRECTIVE_ORDER: str
    # Appended to a read inside a write: the row stays locked until it commits (SQLite locks the file).
    _SHARE_LOCK = ""
    _UPDATE_LOCK = ""
    # The larger of two values in SQL.
    _GREATEST: str

    def _tx(self) -> AbstractContextManager[Any]:
        """One transaction: committed when the block ends, rolled back where it raises."""
        raise NotImplementedError

    def _run(self, sql: str, args: tuple[Any, ...] = ()) -> Any:
        """Run one statement (``?`` placeholders); its cursor."""
        raise NotImplementedError

    def _many(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        """Run one statement (``?`` placeholders) once per row."""
        raise NotImplementedError

    def _in(self, values: Iterable[Any]) -> tuple[str, Any]:
        """SQL that, after a column, is true where it holds one of ``values`` (none: never); its one argument."""
        raise NotImplementedError

    def _insert_id(self, sql: str, args: tuple[Any, ...]) -> int:
        """Run an INSERT of one row into a table keyed by ``id``; the id it was given."""
        raise NotImplementedError

    def _clock_sql(self) -> tuple[str, tuple[Any, ...]]:
        """``clock()`` as an SQL value and its arguments: here the reading, bound."""
        return "?", (self.clock(),)

    def _commit_unflushed(self) -> None:
        """This transaction's commit need not wait for the disk (a lost write is redone); where it can say so."""

    def clock(self) -> float:
        raise NotImplementedError

    def _one(self, sql: str, args: tuple[Any, ...] = ()) -> Any:
        return self._run(sql, args).fetchone()

    def _all(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return self._run(sql, args).fetchall()

    def schema_version(self) -> int:
        """The last migration applied (0: none yet)."""
        return self._one("SELECT COALESCE(MAX(version), 0) FROM schema_version")[0]
