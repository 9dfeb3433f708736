"""The read API's work, off the event loop: paged, bounded, and private where the site says so.

A read of a big job's windows decodes tens of thousands of stored reports: on
the event loop that held every other request, ``/v1/health`` and report intake
included, for seconds (issue 27, item 5).  So every read that touches more than
one row runs here instead (incidents, an incident, its windows, the status counts):

* in ``ReadPool``'s few worker threads, each with a connection to the state
  database of its own (a second reader of SQLite's WAL, or of PostgreSQL), so a
  read never interleaves with the loop's transactions;
* paged: a page holds at most ``WINDOWS_PAGE_MAX`` window reports or
  ``INCIDENTS_PAGE_MAX`` incidents, and says where the next one starts;
* bounded in number: at most ``READS_WAITING`` wait for a worker; beyond, 503
  with Retry-After, so readers queue behind each other, never in front of the
  loop;
* private with ``ReadAuth=required``: a reader is authenticated like a writer,
  and one who is not root, SlurmUser or in AdminUids reads only the incidents
  of jobs Slurm said they own (as ``squeue`` shows with ``PrivateData=jobs``);
  another's incident is "not found", not "forbidden", so its id tells nothing.

Each view function takes a store and plain values and returns what the handler
sends, JSON-encoded in the worker where the whole answer comes from the store;
``incident_detail`` and ``status_counts`` return plain data, to which the
handler adds, on the loop, what only the daemon holds in memory.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from artemisd.auth import Principal
from artemisd.incident import IncidentState
from artemisd.runs import split_run
from artemisd.store import StateStore, StoredIncident

READ_WORKERS = 2
READS_WAITING = 64
WINDOWS_PAGE = 5_000  # window reports a page holds unless ?limit= says fewer or more
WINDOWS_PAGE_MAX = 20_000
INCIDENTS_PAGE = 1_000
INCIDENTS_PAGE_MAX = 10_000

# What ``GET /v1/incidents`` lists without ?all=1: suspects and dismissed ones are the analysis' own.
LISTED = tuple(s.value for s in IncidentState if s not in (IncidentState.SUSPECT, IncidentState.DISMISSED))

T = TypeVar("T")


class ReadsBusy(Exception):
    """Every worker is busy and the queue is full: the reader retries later (503)."""


class NotFound(Exception):
    """No such incident, or not one this reader may see (404)."""


class BadQuery(ValueError):
    """A query parameter out of its range (400), named."""


@dataclass(frozen=True)
class Reader:
    """Who reads: ``private`` (ReadAuth=required and not an admin) reads only ``uid``'s jobs."""

    principal: Principal | None
    private: bool

    @property
    def owner(self) -> int | None:
        """The uid whose jobs' incidents are shown; None: all of them."""
        if not self.private or self.principal is None:
            return None
        return -1 if self.principal.uid is None else self.principal.uid


OPEN = Reader(None, False)


class ReadPool:
    """Reads in a few threads of their own, each on a store connection it opened itself."""

    def __init__(self, open_store: Callable[[], StateStore], workers: int = READ_WORKERS,
                 waiting: int = READS_WAITING):
        self.open_store = open_store
        self.waiting = waiting
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="read")
        self._local = threading.local()
        self._stores: list[StateStore] = []
        self._lock = threading.Lock()
        self.queued = 0
        self.refused = 0

    async def run(self, view: Callable[[StateStore], T]) -> T:
        if self.queued >= self.waiting:
            self.refused += 1
            raise ReadsBusy(f"{self.queued} reads wait already")
        self.queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._call, view)
        finally:
            self.queued -= 1

    def _call(self, view: Callable[[StateStore], T]) -> T:
        store = getattr(self._local, "store", None)
        if store is None:
            store = self._local.store = self.open_store()
            with self._lock:
                self._stores.append(store)
        return view(store)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for store in self._stores:
                store.close()
            self._stores.clear()


def bounded_int(query: dict[str, str], name: str, default: int | None, low: int, high: int) -> int | None:
    """``?name=`` as an int in [low, high]; ``default`` when absent."""
    text = query.get(name)
    if text is None:
        return default
    if not text.isdigit() or not low <= int(text) <= high:
        raise BadQuery(f"{name}: expected a whole number from {low} to {high}, got {text[:20]!r}")
    return int(text)


def _visible(store: StateStore, incident_id: str, reader: Reader) -> StoredIncident:
    stored = store.incident(incident_id)
    if stored is None or (reader.owner is not None and store.job_owner(stored.job) != reader.owner):
        raise NotFound(f"no incident {incident_id}")
    return stored


def incidents_page(store: StateStore, reader: Reader, everything: bool, limit: int, offset: int) -> bytes:
    """``GET /v1/incidents``: a page of incidents in the order they were opened; ``next`` is the
    offset of the following page, absent on the last."""
    states = None if everything else LISTED
    rows = store.incidents(states=states, owner=reader.owner, limit=limit + 1, offset=offset)
    out: dict[str, Any] = {"incidents": [r.body for r in rows[:limit]]}
    if len(rows) > limit:
        out["next"] = offset + limit
    return json.dumps(out).encode()


def incident_detail(store: StateStore, reader: Reader, incident_id: str) -> tuple[StoredIncident, dict[str, Any]]:
    """``GET /v1/incidents/{id}`` less the throughput the analyzer holds (the caller adds it on the loop)."""
    stored = _visible(store, incident_id, reader)
    actions = [{"id": a.id, "kind": a.kind, "target": a.target, "status": a.status, "attempts": a.attempts,
                "detail": a.detail} for a in store.actions_of(stored.id)]
    return stored, {"incident": stored.body, "step": stored.step, "baseline": stored.baseline,
                    "actions": actions, "audit": store.audit_log(stored.id)}


def windows_page(store: StateStore, reader: Reader, incident_id: str, limit: int, before: int | None) -> bytes:
    """``GET /v1/incidents/{id}/windows``: the job's newest stored window reports below ``before``
    (whole rows: a window as a body posted it), ``limit`` at most; ``left_out`` counts the older
    ones, and ``before`` is where the next older page starts (absent when none is left)."""
    stored = _visible(store, incident_id, reader)
    page = store.recent_window_records(stored.job, limit, before)
    windows = []
    for rec in page.records:
        ms = rec.get("ms") or {}
        busy = ms.get("busy")
        if busy is None and ms.get("step") is not None and ms.get("comm_wait") is not None:
            busy = ms["step"] - ms["comm_wait"]
        window = rec.get("window") or {}
        # ``run``: the daemon's own run of the job step (``runs.split_run`` of the key it was
        # stored under), so a plot never re-derives a requeue; ``world``: how many ranks a
        # whole window has.
        windows.append({"rank": rec.get("rank"), "seq": window.get("seq"),
                        "run": split_run(str(rec.get("step") or "0"))[1], "world": rec.get("world"),
                        "node": rec.get("node"), "step": ms.get("step"), "busy": busy,
                        "comm_wait": ms.get("comm_wait"), "samples": rec.get("samples"),
                        "t0": window.get("t0"), "t1": window.get("t1")})
    out: dict[str, Any] = {"incident": stored.body, "windows": windows, "left_out": page.left_out}
    if page.left_out and page.oldest is not None:
        out["before"] = page.oldest
    return json.dumps(out).encode()


def status_counts(store: StateStore, reader: Reader) -> dict[str, Any]:
    """What ``GET /v1/status`` reads from the store (the caller adds what the daemon holds)."""
    return {"instances": store.instances(), "incidents": store.incident_counts(),
            # Job ids and owners are private where reads are (PrivateData=jobs).
            "jobs": [] if reader.private else store.jobs()[:50],
            "records": store.record_count(), "quarantined": store.quarantined(),
            # Stored by any instance, not yet analysed by the leader: stays near a second's
            # worth while the leader keeps up (it marks its progress about once a second).
            "not_analysed": store.record_count(after=store.analysed_through()),
            "open_actions": len(store.due_actions(float("inf")))}
