"""What the state store hands out and takes, whichever database holds it.

The records it returns (``StoredRecord``, ``StoredIncident``, ``ActionRow``,
``WindowPage``), its errors, ``StateStore`` (what the daemon may ask of a
store), and the helpers both backends use on rows in Python: batch rows split
and merged, items quarantined, bodies decoded.  No SQL here (store/sql.py)
and no database driver.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import msgspec

from artemisd.lease import Lease


QUARANTINE_KEPT = 10_000
SEQ_MAX = (1 << 63) - 1  # above every record seq (both backends' seq is a signed 64-bit integer)
# The last migration: both backends apply the same versions (store/sqlite.py, store/postgres.py
# ``MIGRATIONS``), migration N meaning the same schema on both.
SCHEMA_VERSION = 4


class StoreUnavailable(RuntimeError):
    """The state database cannot be reached now; nothing of the request was kept, retry it later."""


class SchemaError(RuntimeError):
    """The state database was written by a newer artemisd (its schema version is unknown here)."""


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


class WindowPage(NamedTuple):
    """A page of a job's stored window reports, newest first by row: the reports (in stored order),
    how many older ones are left, and the seq of the page's oldest row (the next page is ``before`` it)."""

    records: list[dict[str, Any]]
    left_out: int
    oldest: int | None


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
