"""Restore and follow: the stored records into this instance's analyzer.

At start the bounded window history is fed through a fresh ``Analyzer`` (the replay path), and each
incident it re-creates is bound to the stored incident of the same subject instead of being published
again (``restore``).  Every turn, each instance takes the records a leader analysed already (up to
``analysed_through``) without publishing anything; the leader then analyses and publishes what it did
not store itself and moves the mark (``follow``).  Stored data never stops either: a record that does
not decode, is out of today's bounds, or fails analysis is quarantined, counted, and never replayed.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Iterator

import structlog

from artemisd import ingest
from artemisd.incident import Incident
from artemisd.job_memory import JobMemory
from artemisd.ledger import Ledger, subject_of
from artemisd.metrics import Metrics
from artemisd.pipeline import Analyzer
from artemisd.store import StateStore, StoredIncident, StoredRecord, batch_items
from artemisd.wire import NodeEvent, ReportError, WindowReport, parse_record

log = structlog.get_logger("artemisd")

REPLAY_PAGE = 1024  # stored records decoded per fast-path call when restoring or following
REPLAY_PIECE = 32  # a page the fast path refused is tried again in pieces this small


class Follower:
    """The records this instance's analyzer holds, and the leader's ``analysed_through`` mark.

    Every stored record up to ``fed_seq`` is in the analyzer; so are those above it in ``fed_own``
    (the ones this instance analysed as it stored them, leading).  ``publish``: the acting half takes
    an incident the analysis opened or updated; ``bookkeeping``: intake's after-storing steps (probes,
    pruning, ended jobs); ``unforeseen``: the daemon's last-resort guard (logs each kind once);
    ``forget_in_memory``: the daemon drops a job the leader forgot.
    """

    def __init__(self, store: StateStore, ledger: Ledger, analyzer: Analyzer, memory: JobMemory, metrics: Metrics,
                 clock: Callable[[], float], bound: dict[str, str], max_world: Callable[[], int],
                 publish: Callable[[Incident, float], None],
                 bookkeeping: Callable[..., None], unforeseen: Callable[[str, BaseException], str],
                 forget_in_memory: Callable[[str], None]):
        self.store = store
        self.ledger = ledger
        self.analyzer = analyzer
        self.memory = memory
        self.metrics = metrics
        self.clock = clock
        self._bound = bound
        self._max_world = max_world
        self._publish = publish
        self._bookkeeping = bookkeeping
        self._unforeseen = unforeseen
        self._forget_in_memory = forget_in_memory
        self.fed_seq = 0
        self.fed_own: set[int] = set()
        self.marked = 0  # the analysed_through this instance last read or wrote
        self.marked_at = -math.inf  # time.monotonic() of this instance's last write of it
        self.restoring = False

    def restore(self) -> tuple[int, int, int]:
        """Rebuild the analyzer from the stored history: (records fed, quarantined, incidents bound)."""
        self.marked = self.store.analysed_through()
        return self.through(self.marked, publish=False)

    def follow(self) -> tuple[int, int]:
        """Feed the analyzer the records stored since the last turn: (fed, quarantined).

        Any instance stores the reports it is sent; only the leader analyses
        them into incidents.  Every instance first takes, without publishing
        anything, the records a leader has analysed already (up to
        ``analysed_through``): a standby's analyzer then holds the same window
        history and incidents as the leader's, so a takeover resumes every
        incident at once (a verification included).  The leader then analyses
        and publishes every record above that which it did not store itself
        (other instances', or a dead leader's last ones), and moves the mark.
        Rows commit in ``seq`` order (``add_records``), so "above the highest
        seq fed" misses none.
        """
        marked = self.marked
        self.marked = max(self.marked, self.store.analysed_through())
        fed, skipped, _ = self.through(self.marked, publish=False)
        if self.ledger.fence is not None:
            more, more_skipped, _ = self.through(None, publish=True)
            fed, skipped = fed + more, skipped + more_skipped
            self.mark()
        elif self.marked > marked:
            self.forget_what_the_leader_forgot()
        return fed, skipped

    def through(self, upto: int | None, publish: bool) -> tuple[int, int, int]:
        """The records after ``_fed_seq`` up to ``upto`` (None: all stored) that this instance's analyzer
        has not seen, into it; then every record up to where it read is in it."""
        if upto is not None and upto <= self.fed_seq:
            return 0, 0, 0
        fed = self._replay(self.store.records(after=self.fed_seq, upto=upto, skip=self.fed_own), publish)
        # Every row up to ``upto`` (or up to the last one stored) was committed
        # before the read: the ones read and the own ones skipped are all of them.
        own = {seq for seq in self.fed_own if upto is None or seq <= upto}
        self.fed_seq = max(self.fed_seq, *own) if own else self.fed_seq
        self.fed_own -= own
        return fed

    def own_rows(self) -> bool:
        """Move ``_fed_seq`` over the own rows just above it; False where a row this instance did
        not store lies below one it did (it must be read before the analysis goes on)."""
        seq = self.fed_seq
        while seq + 1 in self.fed_own:
            seq += 1
            self.fed_own.discard(seq)
        self.fed_seq = seq
        return not self.fed_own

    def mark(self, every_s: float = 0.0) -> None:
        """The leader moves ``analysed_through`` up to what its analyzer holds: after each turn, on a
        clean stop, and between turns after the batches it stored and analysed itself, at most once
        per ``every_s`` (``MARK_EVERY_S``), so a restart (or a takeover) takes those rows as analysed
        instead of analysing them once more.  Never lowered; under the lease's token.  Its callers
        have moved ``_fed_seq`` already (``_follow_through`` over every row, ``accept`` over its own
        contiguous rows)."""
        if self.fed_seq > self.marked and time.monotonic() - self.marked_at >= every_s:
            self.store.set_analysed_through(self.fed_seq, self.ledger.fence)  # type: ignore[arg-type]
            self.marked = self.fed_seq
            self.marked_at = time.monotonic()

    def _replay(self, records: Iterable[StoredRecord], publish: bool = False) -> tuple[int, int, int]:
        """Stored records -> the analyzer: (fed, quarantined, incidents bound).

        ``publish``: the leader analysing records nobody analysed yet, as
        ``accept`` does; otherwise a restart or a standby following them, whose
        incidents are the stored ones (bound, nothing published).
        """
        by_subject: dict[str, list[StoredIncident]] | None = None

        def stored_incidents() -> dict[str, list[StoredIncident]]:
            nonlocal by_subject
            if by_subject is None:  # read once, and only when a replayed incident needs binding
                by_subject = {}
                for inc in self.store.incidents():
                    by_subject.setdefault(inc.subject, []).append(inc)
            return by_subject

        bound_before = len(self._bound)
        self.restoring = not publish
        now = self.clock()
        fed = 0
        ended: list[WindowReport | NodeEvent] = []
        bad: list[tuple[int, str]] = []
        bad_items: list[tuple[int, int, str]] = []
        context = {"max_world": self._max_world()}
        try:
            for rec, item, text, record in decoded(records, context["max_world"]):
                self.fed_seq = max(self.fed_seq, rec.seq)
                try:
                    if record is None:
                        record = parse_record(json.loads(text), context=context)
                    if record.type == "window":
                        self.memory.seed_run(record)
                    self.memory.remember(record, quiet=not publish)
                    for update in self.analyzer.ingest(record):
                        if publish:
                            self._publish(update, now)
                        elif update.id not in self._bound:
                            self._bind_restored(update, stored_incidents())
                    if rec.root:
                        ended.append(record)
                    fed += 1
                except Exception as err:  # noqa: BLE001 - stored data must never stop a start
                    reason = f"restore: {err}" if isinstance(err, ReportError) else \
                        f"restore: {self._unforeseen('restoring', err)}"
                    if item is None:
                        bad.append((rec.seq, reason))
                    else:
                        bad_items.append((rec.seq, item, reason))
            if not publish:
                self.analyzer.pending_probes()  # the leader issued (or refused) them already
        finally:
            self.restoring = False
        if publish and fed:
            self._bookkeeping(now, pruned=[], ended=ended)
        if bad or bad_items:
            moved = self.store.quarantine(bad, self.clock()) + self.store.quarantine_items(bad_items, self.clock())
            self.metrics.quarantined.inc(moved)
            log.warning("stored records skipped and quarantined", count=len(bad) + len(bad_items),
                        first=(bad or bad_items)[0][-1][:300])
        return fed, len(bad) + len(bad_items), len(self._bound) - bound_before

    def _bind_restored(self, update: Incident, by_subject: dict[str, list[StoredIncident]]) -> None:
        bound = set(self._bound.values())
        for inc in by_subject.get(subject_of(update), []):
            if inc.id not in bound:
                self._bound[update.id] = inc.id
                return
        # Re-created under a subject it had before a rank->node re-key: match by analyzer id.
        for incs in by_subject.values():
            for inc in incs:
                if inc.analyzer_id == update.id and inc.id not in bound:
                    self._bound[update.id] = inc.id
                    return

    def forget_what_the_leader_forgot(self) -> None:
        """A standby: the jobs the leader forgot (``JobEnds.heard_from_epilogs``) leave its memory too.  It cannot
        read their ends for itself: the leader's ``forget_job`` takes the job's end with its records,
        often before the standby reads that far.  A job it holds has records stored until then."""
        held = self.analyzer.jobs()
        if held:
            for job in held - self.store.jobs_with_records(held):
                self._forget_in_memory(job)


def decoded(records: Iterable[StoredRecord], max_world: int
            ) -> Iterator[tuple[StoredRecord, int | None, str, WindowReport | None]]:
    """Stored rows -> (row, item or None for a one-record row, the record's text, the record or None).

    One-record rows are decoded in pages through the ingest fast path; a
    batch row in one call (it is the body the fast path once took).  A page
    or batch the fast path does not take whole (a node event, a record out of
    today's bounds) is tried again in smaller pieces; what is left comes
    with None and goes the careful way, one record at a time, so a bad
    record is still named and quarantined alone.
    """
    page: list[StoredRecord] = []
    for rec in records:
        if rec.items:
            yield from _decode_page(page, max_world)
            page = []
            yield from _decode_batch(rec, max_world)
            continue
        page.append(rec)
        if len(page) == REPLAY_PAGE:
            yield from _decode_page(page, max_world)
            page = []
    yield from _decode_page(page, max_world)


def _decode_batch(rec: StoredRecord, max_world: int
                  ) -> Iterator[tuple[StoredRecord, int | None, str, WindowReport | None]]:
    try:
        fast = ingest.fast_records(rec.body.encode(), max_world)
    except Exception:  # noqa: BLE001 - e.g. a body that is not valid UTF-8: the careful way names it
        fast = None
    if fast is not None and len(fast) == rec.items:
        yield from ((rec, i, "", record) for i, record in fast if i not in rec.skipped)
        return
    try:
        texts = batch_items(rec.body)
    except ValueError:
        yield rec, None, rec.body, None  # not an array: the careful way refuses (and quarantines) the row
        return
    kept = [(i, text) for i, text in enumerate(texts) if i not in rec.skipped]
    pieces = [StoredRecord(rec.seq, rec.received, rec.uid, rec.root, text) for _, text in kept]
    for (item, _), (_, _, text, record) in zip(kept, _decode_page(pieces, max_world, REPLAY_PIECE)):
        yield rec, item, text, record


def _decode_page(page: list[StoredRecord], max_world: int, piece: int = REPLAY_PAGE
                 ) -> Iterator[tuple[StoredRecord, int | None, str, WindowReport | None]]:
    for start in range(0, len(page), piece):
        part = page[start:start + piece]
        try:
            fast = ingest.fast_records(("[" + ",".join(r.body for r in part) + "]").encode(), max_world)
        except Exception:  # noqa: BLE001 - e.g. a body that is not valid UTF-8: the careful way names it
            fast = None
        if fast is not None and len(fast) == len(part):
            yield from ((rec, None, rec.body, record) for rec, (_, record) in zip(part, fast))
        elif piece > REPLAY_PIECE:
            yield from _decode_page(part, max_world, REPLAY_PIECE)
        else:
            yield from ((rec, None, rec.body, None) for rec in part)
