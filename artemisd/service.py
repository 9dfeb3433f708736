"""The daemon's loop: ingest → analyze → decide → act → verify, every step recorded.

``Daemon`` owns the analyzer, the store, the Slurm actuator and the policy.
The HTTP layer (server.py) only authenticates and hands records in; a timer
calls ``run_once``, which is also what tests drive step by step.

Incident life in the daemon (states from ``IncidentState``)::

    analyzer: suspect -> confirmed | dismissed
    daemon:   confirmed --decide--> acting (auto rung) | escalated (approval / escalate rung)
              acting    --action done--> verifying --verify--> resolved | unresolved
              unresolved --roll back reversible, next rung--> acting | escalated
              escalated --approve--> acting;  --deny--> next rung
              confirmed / escalated / unresolved --subject healthy again--> resolved
              any open --Slurm says the job ended--> unresolved (dismissed: a suspect), closed: ``_ended``

Restart (``restore``): stored incidents are authoritative.  The bounded window
history is fed through a fresh ``Analyzer`` (the replay path) to rebuild its
baselines and watched subjects; each incident it re-creates is bound to the
stored incident of the same subject instead of being published again.
Actions are recorded as intent before Slurm is touched; open ones are re-run
through the idempotent actuator.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from itertools import groupby
from typing import Any

import structlog

from artemisd import ingest
from artemisd.acting import Acting
from artemisd.auth import Principal
from artemisd.config import Config
from artemisd.ingest import IngestResult
from artemisd.incident import Incident, IncidentState
from artemisd.job_ends import JobEnds
from artemisd.job_memory import JobMemory
from artemisd.jobs import OWN, JobLookups
from artemisd.leadership import Leadership
from artemisd.lease import Fenced, Lease
from artemisd.ledger import Ledger, subject_of
from artemisd.metrics import Metrics
from artemisd.pipeline import Analyzer, ProbeRequest
from artemisd.probes import ProbeQueue
from artemisd.runs import run_key, split_run
from artemisd.slurm.api import JobInfo, SlurmBackend, SlurmError
from artemisd.store import (StateStore, StoredIncident, StoredRecord, StoreUnavailable, batch_items, merge_batch_rows,
                            open_store)
from artemisd.wire import NodeEvent, ReportError, WindowReport, dump_record, parse_record, with_step

S = IncidentState
FINAL = (S.RESOLVED.value, S.DISMISSED.value)
MAX_LOGGED_FAILURES = 64  # kinds of unforeseen per-item failure logged with a traceback (once each)
# A claim outside the cached allocation re-reads the job at most this often:
# a requeued job has new nodes, but a wrong claim must not cost a Slurm call each.
ALLOCATION_RECHECK_S = 5.0
# Between turns, the leader writes analysed_through at most this often: a
# write per request was a second transaction on every one-report POST (~100 us
# of its ~290), and a crash loses at most this long of the mark (those rows are
# analysed again, publishing nothing new).  Turns and a clean stop always write it.
MARK_EVERY_S = 1.0
# How long an instance answers a job step's reports with the directives it last read for that step:
# one read a second per step instead of one per request (a database round trip on every report's
# reply).  Its own new directives are seen at once; another instance's within this time.
DIRECTIVES_FRESH_S = 1.0
DIRECTIVES_HELD = 4096  # job steps whose last read is held; beyond, all are read again
REPLAY_PAGE = 1024  # stored records decoded per fast-path call when restoring or following
REPLAY_PIECE = 32  # a page the fast path refused is tried again in pieces this small

log = structlog.get_logger("artemisd")


class Daemon:
    def __init__(self, config: Config, slurm: SlurmBackend, clock: Callable[[], float] = time.time):
        self.config = config
        self.slurm = slurm
        self.clock = clock
        self.metrics = Metrics()
        self.store: StateStore = open_store(config.daemon)
        self.ledger = Ledger(self.store)
        self.leadership = Leadership(self.store, self.ledger, self.metrics,
                                     f"{socket.gethostname()}:{config.daemon.listen}",
                                     lambda: self.config.daemon.lease_time)
        self.instance = self.leadership.instance
        self.started = self.leadership.started
        self.analyzer = Analyzer(config.analysis, id_prefix="A-", active_probe=True)
        self._bound: dict[str, str] = {}  # analyzer incident id -> daemon incident id
        self.jobs = JobLookups(slurm.job, config.daemon.slurm_read_workers,
                               lambda: self.config.daemon.job_cache_seconds, self.clock, self._job_read,
                               self.metrics.backend_errors.labels("slurm").inc, ALLOCATION_RECHECK_S)
        self.memory = JobMemory(self.metrics)
        self._probe_due: dict[str, float] = {}  # analyzer incident id -> when its matched probe expires
        self._probes = ProbeQueue()  # requests the rate limit has not let out yet
        self._restoring = False
        # Every stored record up to _fed_seq is in this instance's analyzer; so
        # are those above it in _fed_own (the ones it analysed as it stored them, leading).
        self._fed_seq = 0
        self._fed_own: set[int] = set()
        self._marked = 0  # the analysed_through this instance last read or wrote
        self._marked_at = -math.inf  # time.monotonic() of this instance's last write of it
        # (job, step) -> (time.monotonic(), self.clock() of the read, its directives): ``_directives``.
        self._directives_read: dict[tuple[str, str], tuple[float, float, list[dict[str, Any]]]] = {}
        self._logged_failures: set[tuple[str, str]] = set()
        self.restore_skipped = 0
        self.acting = Acting(config, self.store, self.ledger, self.analyzer, slurm, self.metrics, self.memory,
                             self.clock, self.job_info, self._add_directive, self._bound, self._probe_due)
        self.ends = JobEnds(self.store, self.clock, self.job_info, self.acting.end_incidents, self._forget_in_memory,
                            self.analyzer.jobs, lambda: self.config.daemon.ended_job_history)
        self.restore()
        if self._lead():  # a lone instance leads from its first request, not from its first turn
            # ... with what it stored and had not marked analysed before it stopped
            # (its last second, after a crash), as the first turn would.
            try:
                self.follow()
            except Exception as err:  # noqa: BLE001 - the first turn follows them
                log.warning("records above the analysed mark left to the first turn", error=str(err))

    # --- configuration ---------------------------------------------------

    def reload(self, config: Config) -> None:
        """SIGHUP: new policy, mail, limits.  Listen/StateDir/analysis need a restart."""
        self.config = config
        self.acting.config = config
        log.info("config reloaded", policies=len(config.policies), dry_run=config.daemon.dry_run,
                 enabled=config.daemon.enabled)

    # --- restart ------------------------------------------------------------

    def restore(self) -> None:
        """Rebuild the analyzer from the stored history; stored data can never stop this.

        A record that does not decode, is out of today's bounds, or fails
        analysis is quarantined (never replayed again) and counted in
        ``restore_skipped`` (``artemis status``).
        """
        self._marked = self.store.analysed_through()
        fed, skipped, bound = self._follow_through(self._marked, publish=False)
        self.restore_skipped = skipped
        if fed or bound:
            log.info("state restored", records=fed, skipped=skipped, bound=bound)
        self._update_gauges()

    def follow(self) -> int:
        """Feed the analyzer the records stored since the last turn; returns how many were fed.

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
        marked = self._marked
        self._marked = max(self._marked, self.store.analysed_through())
        fed, skipped, _ = self._follow_through(self._marked, publish=False)
        if self._fence is not None:
            more, more_skipped, _ = self._follow_through(None, publish=True)
            fed, skipped = fed + more, skipped + more_skipped
            self._mark_analysed()
        elif self._marked > marked:
            self._forget_what_the_leader_forgot()
        self.restore_skipped += skipped
        return fed

    def _follow_through(self, upto: int | None, publish: bool) -> tuple[int, int, int]:
        """The records after ``_fed_seq`` up to ``upto`` (None: all stored) that this instance's analyzer
        has not seen, into it; then every record up to where it read is in it."""
        if upto is not None and upto <= self._fed_seq:
            return 0, 0, 0
        fed = self._replay(self.store.records(after=self._fed_seq, upto=upto, skip=self._fed_own), publish)
        # Every row up to ``upto`` (or up to the last one stored) was committed
        # before the read: the ones read and the own ones skipped are all of them.
        own = {seq for seq in self._fed_own if upto is None or seq <= upto}
        self._fed_seq = max(self._fed_seq, *own) if own else self._fed_seq
        self._fed_own -= own
        return fed

    def _fed_own_rows(self) -> bool:
        """Move ``_fed_seq`` over the own rows just above it; False where a row this instance did
        not store lies below one it did (it must be read before the analysis goes on)."""
        seq = self._fed_seq
        while seq + 1 in self._fed_own:
            seq += 1
            self._fed_own.discard(seq)
        self._fed_seq = seq
        return not self._fed_own

    def _mark_analysed(self, every_s: float = 0.0) -> None:
        """The leader moves ``analysed_through`` up to what its analyzer holds: after each turn, on a
        clean stop, and between turns after the batches it stored and analysed itself, at most once
        per ``every_s`` (``MARK_EVERY_S``), so a restart (or a takeover) takes those rows as analysed
        instead of analysing them once more.  Never lowered; under the lease's token.  Its callers
        have moved ``_fed_seq`` already (``_follow_through`` over every row, ``accept`` over its own
        contiguous rows)."""
        if self._fed_seq > self._marked and time.monotonic() - self._marked_at >= every_s:
            self.store.set_analysed_through(self._fed_seq, self._fence)  # type: ignore[arg-type]
            self._marked = self._fed_seq
            self._marked_at = time.monotonic()

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
        self._restoring = not publish
        now = self.clock()
        fed = 0
        ended: list[WindowReport | NodeEvent] = []
        bad: list[tuple[int, str]] = []
        bad_items: list[tuple[int, int, str]] = []
        context = self._context()
        try:
            for rec, item, text, record in self._decoded(records, context):
                self._fed_seq = max(self._fed_seq, rec.seq)
                try:
                    if record is None:
                        record = parse_record(json.loads(text), context=context)
                    if record.type == "window":
                        self.memory.seed_run(record)
                    self.memory.remember(record, quiet=not publish)
                    for update in self.analyzer.ingest(record):
                        if publish:
                            self.acting.publish(update, now)
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
            self._restoring = False
        if publish and fed:
            self._bookkeeping(now, pruned=[], ended=ended)
        if bad or bad_items:
            moved = self.store.quarantine(bad, self.clock()) + self.store.quarantine_items(bad_items, self.clock())
            self.metrics.quarantined.inc(moved)
            log.warning("stored records skipped and quarantined", count=len(bad) + len(bad_items),
                        first=(bad or bad_items)[0][-1][:300])
        return fed, len(bad) + len(bad_items), len(self._bound) - bound_before

    def _decoded(self, records: Iterable[StoredRecord], context: dict[str, Any]
                 ) -> Iterator[tuple[StoredRecord, int | None, str, WindowReport | None]]:
        """Stored rows -> (row, item or None for a one-record row, the record's text, the record or None).

        One-record rows are decoded in pages through the ingest fast path; a
        batch row in one call (it is the body the fast path once took).  A page
        or batch the fast path does not take whole (a node event, a record out of
        today's bounds) is tried again in smaller pieces; what is left comes
        with None and goes the careful way, one record at a time, so a bad
        record is still named and quarantined alone.
        """
        max_world = context["max_world"]
        page: list[StoredRecord] = []
        for rec in records:
            if rec.items:
                yield from self._decode_page(page, max_world)
                page = []
                yield from self._decode_batch(rec, max_world)
                continue
            page.append(rec)
            if len(page) == REPLAY_PAGE:
                yield from self._decode_page(page, max_world)
                page = []
        yield from self._decode_page(page, max_world)

    @staticmethod
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
        for (item, _), (_, _, text, record) in zip(kept, Daemon._decode_page(pieces, max_world, REPLAY_PIECE)):
            yield rec, item, text, record

    @staticmethod
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
                yield from Daemon._decode_page(part, max_world, REPLAY_PIECE)
            else:
                yield from ((rec, None, rec.body, None) for rec in part)

    def _context(self) -> dict[str, Any]:
        return {"max_world": self.config.daemon.max_world}

    def _unforeseen(self, stage: str, err: BaseException) -> str:
        """The last-resort guard's reason for one item; each kind of failure is logged once, with its traceback."""
        what = f"{type(err).__name__}: {err}"[:300]
        kind = (stage, type(err).__name__)
        if kind not in self._logged_failures and len(self._logged_failures) < MAX_LOGGED_FAILURES:
            self._logged_failures.add(kind)
            log.error("unforeseen failure on one item; it is refused, the others are kept", stage=stage,
                      error=what, exc_info=err)
        self.metrics.item_failures.labels(stage).inc()
        return f"internal error while {stage} this item ({what})"

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

    # --- ingest -------------------------------------------------------------

    def validate(self, items: list[tuple[int, Any, str | None]]) -> tuple[list[tuple[int, WindowReport | NodeEvent]], list[dict[str, Any]]]:
        """Items -> ([(index, record)], [{"index", "error"}]) (``ingest.validate``, under today's bounds)."""
        return ingest.validate(items, self._context(), lambda err: self._unforeseen("validating", err))

    async def check_jobs(self, principal: Principal, records: list[tuple[int, WindowReport | NodeEvent]]
                         ) -> dict[str, JobInfo | None | SlurmError | ingest.LookupRefused]:
        """What Slurm says of each job a user's records name, for ``accept`` (``JobLookups.for_request``,
        within its bounds per request and per user).  Root-side senders are not checked."""
        if principal.root_side:
            return {}
        return await self.jobs.for_request(principal, records, self._unforeseen)

    async def job_info(self, job: str, fresh: bool = False, strict: bool = False,
                       answered_now: bool = False) -> JobInfo | None:
        """The daemon's own read of a job (decisions, the sweep, actions), through the job cache."""
        return await self.jobs.info(job, fresh=fresh, strict=strict, uid=OWN, answered_now=answered_now)

    def _job_read(self, job: str, info: JobInfo) -> None:
        """A job just read from Slurm: its owner and partition are stored for the CLI and restarts."""
        try:
            self.store.set_job_owner(job, info.user_id, info.partition)
        except Exception as err:
            if self.store.is_unavailable(err):
                # Not Slurm's answer that failed: the request is refused for a
                # retry, and the owner is written when the job is read again.
                raise StoreUnavailable(f"state database unavailable: {err}") from err
            raise

    def accept(self, records: list[tuple[int, WindowReport | NodeEvent]], principal: Principal,
               jobs: dict[str, JobInfo | None | SlurmError] | None = None,
               rejected: list[dict[str, Any]] | None = None, body: bytes | None = None) -> IngestResult:
        """Store validated records, and analyse them if this instance leads: one request's
        ``accept_many``.  Raises ``StoreUnavailable`` where nothing could be stored (a retry)."""
        (out,) = self.accept_many([ingest.Submission(records, principal, jobs or {}, list(rejected or []), body)])
        if isinstance(out, StoreUnavailable):
            raise out
        return out

    def accept_many(self, submissions: list[ingest.Submission]) -> list[IngestResult | StoreUnavailable]:
        """Several requests' validated records stored in one transaction (group commit), then analysed
        if this instance leads: each request's result, or ``StoreUnavailable`` for all of them where the
        database could not be reached (nothing of any was stored; their senders retry).

        A standby stores them only: the leader analyses them on its next turn
        (``follow``), so a job's incidents are opened by one analysis.

        A submission's ``body``, where ``ingest.fast_records`` took it whole (so
        it is a JSON array of exactly these records, each item the record and
        nothing else): its window reports are stored as *batch rows*, the
        reports of one job and window as the sender wrote them, one row for all
        of them (the body itself where it is one such batch, no encoding or
        splitting pass); a record re-keyed to a new run is encoded again.  The
        requests' batch rows of one job, window and sender are then merged
        into one (``store.merge_batch_rows``).

        Each record is stored, then analysed, under a last-resort guard: an
        unforeseen failure refuses that record alone (its reason in its
        request's reply, logged once per kind), and one that fails analysis is
        quarantined so a restart never replays it.  A row the transaction
        cannot take is stored alone, so only its own records are refused.

        A user's record is rejected on its own unless Slurm (``jobs``, from
        ``check_jobs``) says the sender owns its job, its node is in the job's
        allocation and its world fits the job's size.
        """
        now = self.clock()
        results = [IngestResult(rejected=list(sub.rejected)) for sub in submissions]
        rows: list[tuple] = []
        places: list[list[tuple[int, WindowReport | NodeEvent, int]]] = []  # + the submission it came in
        for n, (sub, result) in enumerate(zip(submissions, results)):
            try:
                kept, one_batch = self._kept(sub, result)
                sub_rows, sub_places = self._rows(kept, len(sub.records), sub.body, now, sub.principal, result,
                                                  one_batch)
            except Exception as err:  # noqa: BLE001 - one request's failure never fails the others of its group
                reason = self._unforeseen("storing", err)
                refused = {r["index"] for r in result.rejected}
                result.rejected += [{"index": index, "error": reason} for index, _ in sub.records
                                    if index not in refused]
                continue
            rows += sub_rows
            places += [[(index, rec, n) for index, rec in members] for members in sub_places]
        rows, places = merge_batch_rows(rows, places)
        try:
            seqs = self._store_rows(rows, places, results)
        except StoreUnavailable as err:
            return [err for _ in submissions]
        leading = self._fence is not None
        if leading:
            self._fed_own.update(seq for seq in seqs if seq is not None)
            if not self._fed_own_rows():
                # Another instance stored rows since this one last read: they go
                # into the analysis first, so a job's windows are analysed in the
                # order they were stored whichever instance its ranks reached.
                try:
                    self.follow()
                except Exception as err:  # noqa: BLE001 - the next turn reads them; this batch goes on
                    self._unforeseen("reading other instances' records before", err)
        steps: list[set[tuple[str, str]]] = [set() for _ in submissions]
        taken: list[list[WindowReport | NodeEvent]] = [[] for _ in submissions]
        failed: list[tuple[int, str]] = []
        failed_items: list[tuple[int, int, str]] = []
        for row, seq, members in zip(rows, seqs, places):
            if seq is None:
                continue
            if not leading and row[7] and self._received_together(row[0], members, steps, taken):
                continue
            for item, (index, rec, n) in enumerate(members):
                try:
                    self._received(rec, submissions[n].principal, now, row[6], steps[n])
                    if leading:
                        self._analyse(rec, now)
                except Exception as err:  # noqa: BLE001 - quarantined and refused alone; the others go on
                    reason = self._unforeseen("analysing", err)
                    if row[7]:
                        failed_items.append((seq, item, reason))
                    else:
                        failed.append((seq, reason))
                    results[n].rejected.append({"index": index, "error": f"{reason}; the record is quarantined"})
                    continue
                taken[n].append(rec)
        if failed or failed_items:
            moved = self.store.quarantine(failed, now) + self.store.quarantine_items(failed_items, now)
            self.metrics.quarantined.inc(moved)
        for result, own in zip(results, taken):
            result.accepted = len(own)
        self.metrics.accepted.inc(sum(map(len, taken)))
        self.metrics.rejected.inc(sum(len(result.rejected) for result in results))
        # Forgetting an ended job reads its incidents' states: the leader's, after it analysed the job_end.
        self._bookkeeping(now, pruned=[rec for own in taken for rec in own],
                          ended=[rec for sub, own in zip(submissions, taken) if sub.principal.root_side
                                 for rec in own] if leading else [],
                          probes=leading)
        if leading:
            try:
                self._mark_analysed(MARK_EVERY_S)
            except Exception as err:  # noqa: BLE001 - the next turn writes it; the reply stands
                self._unforeseen("marking analysed", err)
        for result, wanted in zip(results, steps):
            for job, step in sorted(wanted):
                try:
                    result.directives.extend(self._directives(job, step, now))
                except Exception as err:  # noqa: BLE001 - no directives for that step this time
                    self._unforeseen("reading the directives of", err)
        return results

    def _kept(self, sub: ingest.Submission, result: IngestResult
              ) -> tuple[list[tuple[int, WindowReport | NodeEvent, bool]], tuple[str, int] | None]:
        """A request's records that its sender may send, each under its run, and whether it is as sent
        (so its text is the body's); the others refused in ``result``.  With them, the (job, window) of
        all of them where they are known to be one window's reports, every one as sent."""
        principal = sub.principal
        owned: list[tuple[int, WindowReport | NodeEvent]] = []
        for index, rec in sub.records:
            problem = None if principal.root_side else ingest.ownership_problem(rec, principal, sub.jobs)
            if problem:
                result.rejected.append({"index": index, "error": problem})
            else:
                owned.append((index, rec))
        as_sent = sub.body is not None
        together = self._runs_together(owned)
        if together is not None:
            kept = [(index, rec, as_sent and rec is sent) for (index, sent), rec in zip(owned, together)]
            one = (together[0].job, together[0].window.seq) if as_sent and together[0] is owned[0][1] else None
            return kept, one
        kept = []
        for index, rec in owned:
            try:
                sent = rec
                if rec.type == "window":
                    rec = self._run_of(rec)
            except Exception as err:  # noqa: BLE001 - one item's failure never drops the others
                result.rejected.append({"index": index, "error": self._unforeseen("storing", err)})
                continue
            kept.append((index, rec, as_sent and rec is sent))
        return kept, None

    def _runs_together(self, records: list[tuple[int, WindowReport | NodeEvent]]) -> list[WindowReport] | None:
        """A request's window reports of one job step and window, each under its run, as ``_run_of``
        one by one would give them, taken in one pass (``JobRun.take_together``): a sender's batch is
        one window of its ranks.  None where they go one by one (anything else, or a report that
        needs the run rule of its own), nothing taken."""
        if not records or records[0][1].type != "window":
            return None
        first = records[0][1]
        job, step, seq = first.job, first.step, first.window.seq
        if any(rec.type != "window" or rec.window.seq != seq or rec.step != step or rec.job != job
               for _, rec in records):
            return None
        try:
            base, run = self.memory.run_for(job, step)
            spans = [rec.window for _, rec in records]
            number = run.take_together([rec.rank for _, rec in records], seq,
                                       [span.t0 for span in spans], [span.t1 for span in spans])
        except Exception as err:  # noqa: BLE001 - one by one instead, each under its own guard
            self._unforeseen("storing", err)
            return None
        if number is None:
            return None
        if number == 0:
            return [rec for _, rec in records]
        key = run_key(base, number)
        return [with_step(rec, key) for _, rec in records]

    def _directives(self, job: str, step: str, now: float) -> list[dict[str, Any]]:
        """The live directives of a job step, read at most once per ``DIRECTIVES_FRESH_S``: a node's
        ranks post within moments of each other, and each reply carries its step's directives.  Fresh
        by both clocks, so a test's clock that jumps past a probe's expiry reads again."""
        key = (job, step)
        held = self._directives_read.get(key)
        ticks = time.monotonic()
        if held is not None and ticks - held[0] < DIRECTIVES_FRESH_S and 0.0 <= now - held[1] < DIRECTIVES_FRESH_S:
            return held[2]
        out = self.store.directives_for(job, step, now)
        if len(self._directives_read) >= DIRECTIVES_HELD:
            self._directives_read.clear()
        self._directives_read[key] = (ticks, now, out)
        return out

    def _add_directive(self, directive_id: str, kind: str, job: str, step: str, incident: str | None,
                       body: dict[str, Any], now: float, expires: float | None) -> None:
        self.store.add_directive(directive_id, kind, job, step, incident, body, now, expires)
        self._directives_read.pop((job, step), None)  # this instance's next reply carries it

    def _received(self, rec: WindowReport | NodeEvent, principal: Principal, now: float, text: str,
                  steps: set[tuple[str, str]]) -> None:
        """What the instance a stored record came to keeps of it, leading or not: a root-side node
        event (``text``) as the node's evidence, a matched probe's cost, the step to send directives to."""
        if type(rec) is NodeEvent and principal.root_side:
            self.store.set_node_evidence(rec.node, now, principal.uid, text)
        if rec.type == "window":
            steps.add((rec.job, split_run(rec.step)[0]))
            if rec.probe is not None:
                self.store.probe_result(rec.probe.id, rec.probe.cost_ms)
                if rec.probe.cost_ms:
                    self.metrics.probe_cost_ms.inc(rec.probe.cost_ms)

    def _received_together(self, job: str, members: list[tuple[int, WindowReport, int]],
                           steps: list[set[tuple[str, str]]], taken: list[list[WindowReport | NodeEvent]]) -> bool:
        """A stored batch row's window reports (all of ``job``; ``(index, record, submission)``) on an
        instance that does not analyse them: what ``_received`` keeps of each, the steps to send
        directives to, for the row at once.  False, nothing kept, where one of them holds a matched
        probe's result: those go one by one."""
        if [rec.probe for _, rec, _ in members].count(None) != len(members):
            return False
        for n, step in {(n, rec.step) for _, rec, n in members}:
            steps[n].add((job, split_run(step)[0]))
        for _, rec, n in members:
            taken[n].append(rec)
        return True

    def _analyse(self, rec: WindowReport | NodeEvent, now: float) -> None:
        """One stored record to the leader's analyzer, its incidents published."""
        self.memory.remember(rec)
        for update in self.analyzer.ingest(rec):
            self.acting.publish(update, now)

    def _bookkeeping(self, now: float, pruned: list[WindowReport | NodeEvent], ended: list[WindowReport | NodeEvent],
                     probes: bool = True) -> None:
        """After records are stored (and analysed): the matched probes the analysis asked for, the
        history pruned, ended jobs forgotten.  Their failure never turns the records' acceptance into
        an error: each kind is logged once."""
        for stage, step_fn in (("issuing probes for", lambda: probes and self._issue_probes(now)),
                               ("pruning the history of", lambda: self._prune(pruned)),
                               ("forgetting the ended jobs of",
                                lambda: self.ends.heard_from_epilogs(ended, pruned if probes else [], now))):
            try:
                step_fn()
            except Exception as err:  # noqa: BLE001 - logged once per kind; the reply stands
                self._unforeseen(stage, err)

    def _rows(self, kept: list[tuple[int, WindowReport | NodeEvent, bool]], sent: int, body: bytes | None,
              now: float, principal: Principal, result: IngestResult, one_batch: tuple[str, int] | None = None
              ) -> tuple[list[tuple], list[list[tuple[int, WindowReport | NodeEvent]]]]:
        """The rows that store ``kept``, and each row's records in order.

        A run of window reports kept as sent, of one job and window, is one
        batch row (``items`` n): the body itself where it is all of them, else
        their own texts joined.  Any other record is a row of its own.
        ``one_batch``: the (job, window) of every record of ``kept`` where the
        caller knows they are one such run.
        """
        rows: list[tuple] = []
        places: list[list[tuple[int, WindowReport | NodeEvent]]] = []
        texts: list[str] | None = None
        groups = ([(one_batch, kept)] if one_batch is not None and kept else
                  groupby(kept, key=lambda k: (k[1].job, k[1].window.seq) if k[2] else None))
        for batch, group in groups:
            if batch is not None:
                members = [(index, rec) for index, rec, _ in group]
                nodes = {rec.node for _, rec in members}
                if len(members) == sent:
                    text = body.decode()  # type: ignore[union-attr]
                else:
                    texts = texts if texts is not None else batch_items(body)  # type: ignore[arg-type]
                    text = "[" + ",".join(texts[index] for index, _ in members) + "]"
                rows.append((*batch, nodes.pop() if len(nodes) == 1 else None, now, principal.uid,
                             principal.root_side, text, len(members)))
                places.append(members)
                continue
            for index, rec, _ in group:
                try:
                    text = dump_record(rec)
                except Exception as err:  # noqa: BLE001 - one item's failure never drops the others
                    result.rejected.append({"index": index, "error": self._unforeseen("storing", err)})
                    continue
                window = rec.window.seq if rec.type == "window" else None
                rows.append((rec.job, window, rec.node, now, principal.uid, principal.root_side, text, 0))
                places.append([(index, rec)])
        return rows, places

    def _store_rows(self, rows: list[tuple], places: list[list[tuple[int, WindowReport | NodeEvent, int]]],
                    results: list[IngestResult]) -> list[int | None]:
        """One transaction for the batch; if it fails, row by row, refusing only the rows that fail (each
        record in its own request's result: ``results[n]``)."""
        if not rows:
            return []
        try:
            return list(self.store.add_records(rows))
        except Exception as err:  # noqa: BLE001 - find the row that fails; keep the others
            if self.store.is_unavailable(err):
                # The database, not a row: nothing is stored or analysed yet, so
                # the whole batch is refused for a retry (the probe keeps it).
                raise StoreUnavailable(f"state database unavailable: {err}") from err
            self._unforeseen("storing", err)
        seqs: list[int | None] = []
        for row, members in zip(rows, places):
            try:
                seqs.extend(self.store.add_records([row]))
            except Exception as err:  # noqa: BLE001 - that row alone is refused
                reason = self._unforeseen("storing", err)
                for index, _, n in members:
                    results[n].rejected.append({"index": index, "error": reason})
                seqs.append(None)
        return seqs

    def _run_of(self, rec: WindowReport) -> WindowReport:
        """Tell a restarted job (requeued: windows numbered from 0 again) from late reports.

        The analyzer keys a job step's windows by number, so a second run would
        look like reports of long-closed windows and be dropped.  A rank's window
        more than ``RESTART_GAP`` below that rank's own newest starts a new *run*
        (``JobRun``), analysed under the step key ``STEP~RUN`` (and stored so, so
        a restart of the daemon replays it the same way).  Incidents verifying on
        the old run continue on the new one: its windows all come after the action.
        """
        base, run = self.memory.run_for(rec.job, rec.step)
        span = rec.window
        number, started = run.take(rec.rank, span.seq, span.t0, span.t1)
        if started:
            self._restarted(rec.job, run_key(base, number - 1), run_key(base, number))
        return rec if number == 0 else with_step(rec, run_key(base, number))

    def _restarted(self, job: str, old_key: str, new_key: str) -> None:
        """A job under an action started again (requeued): its incidents keep the run they were
        seen in (healthy and slowed throughput come from it); verification follows the new run."""
        if self._restoring:
            return
        for stored in self.store.incidents(states=[S.VERIFYING, S.ACTING]):
            if stored.job == job and split_run(stored.step or "0")[0] == split_run(new_key)[0]:
                self._audit(stored.id, "daemon", "job restarted",
                            f"windows of {job} now counted as {new_key}; verified once back in steady state")

    def _forget_what_the_leader_forgot(self) -> None:
        """A standby: the jobs the leader forgot (``JobEnds.heard_from_epilogs``) leave its memory too.  It cannot
        read their ends for itself: the leader's ``forget_job`` takes the job's end with its records,
        often before the standby reads that far.  A job it holds has records stored until then."""
        held = self.analyzer.jobs()
        if held:
            for job in held - self.store.jobs_with_records(held):
                self._forget_in_memory(job)

    def _forget_in_memory(self, job: str) -> None:
        """What this instance holds of an ended job whose incidents are closed, in the analyzer and
        beside it: without this a daemon's memory grows with every job it has seen."""
        for analyzer_id in self.analyzer.forget_job(job):
            self._bound.pop(analyzer_id, None)
            self._probe_due.pop(analyzer_id, None)
        self.memory.forget(job)
        self.jobs.forget(job)
        self._probes.forget_job(job)
        self.ends.drop(job)
        for key in [key for key in self._directives_read if key[0] == job]:
            del self._directives_read[key]

    def _prune(self, kept: list[WindowReport | NodeEvent]) -> None:
        keep = self.config.daemon.history_windows_kept
        for rec in kept:
            count = self.memory.counted_window(rec)
            if count is not None and count % max(1, keep // 4) == 0:
                self.store.prune_records(rec.job, keep)

    # --- incidents from the analyzer ------------------------------------------

    def _audit(self, incident: str | None, who: str, what: str, why: str = "", result: str = "",
               action: int | None = None, now: float | None = None) -> None:
        self.ledger.audit(incident, who, what, why, result, action, now)

    # --- active confirmation ----------------------------------------------------

    def _issue_probes(self, now: float, retry: bool = False) -> None:
        """The matched probes the analysis asked for, within the policy and the rate limit.

        A request the rate limit refuses waits (``probes.ProbeQueue``) and is asked
        again at every leader turn (``retry``: about once a second, not on every
        request, which would cost every report the limit's reads) and with every
        new request, until the limit lets it out or its incident stops waiting for
        it; when one probe of a job may go, the request most worth it (the largest
        loss) goes first.  A request the policy refuses (``Probe=no``,
        ``Enabled=no``, ``DryRun=yes``) is dropped.  Each refusal is audited once
        per reason, not every turn.
        """
        # A restart's replay raises the requests of before again: those already sent are not resent.
        fresh = [r for r in self.analyzer.pending_probes() if not self.store.has_directive(r.id)]
        if not fresh and not retry:
            return
        self._probes.add(fresh, now)
        for job, waiting in self._probes.by_job(self.analyzer.probe_outstanding, self._probe_worth).items():
            pol = self.config.policy_for(self.store.job_partition(job))
            for entry in waiting:
                req = entry.request
                daemon_incident = self._bound.get(req.incident)
                refusal = self._probe_refusal(job, now, pol.probe, req.corroborates)
                if refusal is not None:
                    kind, why = refusal
                    if kind == "policy":
                        self._probes.sent(req)  # not asked again: only a new request is
                    if entry.refusal != kind:
                        entry.refusal = kind
                        self.metrics.probes.labels("refused").inc()
                        waits = "" if kind == "policy" else "; it waits and is asked again when the limit allows"
                        self._audit(daemon_incident, "policy", f"probe {req.id} not sent", why + waits, now=now)
                    continue
                step = split_run(req.step)[0]
                body = {"type": "probe", "id": req.id, "job": req.job, "step": step}
                self._add_directive(req.id, "probe", req.job, step, daemon_incident, body, now,
                                    now + self.config.daemon.probe_timeout)
                self._probes.sent(req)
                self._probe_due[req.incident] = now + self.config.daemon.probe_timeout
                self.metrics.probes.labels("issued").inc()
                waited = f" (waited {now - entry.since:.0f} s for the rate limit)" if entry.refusal else ""
                self._audit(daemon_incident, "daemon", f"probe {req.id} requested", req.reason + waited, now=now)

    def _probe_worth(self, req: ProbeRequest) -> float:
        """What a waiting probe request is worth: the loss its incident shows (0 where none is known)."""
        bound = self._bound.get(req.incident)
        stored = self.store.incident(bound) if bound else None
        loss = stored.body.get("loss_pct") if stored else None
        return float(loss) if isinstance(loss, (int, float)) else 0.0

    def _probe_refusal(self, job: str, now: float, allowed: bool, corroborates: bool = False
                       ) -> tuple[str, str] | None:
        """(kind, why) a probe of ``job`` may not go now, or None: kind ``policy`` (it may not go at
        all), ``interval`` or ``hourly`` (the rate limit: later it may)."""
        d = self.config.daemon
        if not allowed:
            return "policy", "Probe=no in the partition policy"
        if not d.enabled or d.dry_run:
            return "policy", "Enabled=no" if not d.enabled else "DryRun=yes"
        times = self.store.probe_times(job)
        # The second probe that confirms a link verdict is one measurement of the
        # same question: ProbeMaxPerHour bounds it, ProbeMinInterval does not.
        if times and now - times[-1] < d.probe_min_interval and not corroborates:
            return "interval", (f"rate limit: last probe {now - times[-1]:.0f} s ago "
                                f"(ProbeMinInterval={d.probe_min_interval:.0f})")
        if sum(1 for t in times if now - t < 3600) >= d.probe_max_per_hour:
            return "hourly", f"rate limit: {d.probe_max_per_hour} probes in the last hour (ProbeMaxPerHour)"
        return None

    # --- the loop -------------------------------------------------------------------

    @property
    def _fence(self) -> int | None:
        """The lease token while this instance leads (None: a standby): every ledger write carries it."""
        return self.ledger.fence

    @property
    def role(self) -> str:
        return self.leadership.role

    @property
    def lease(self) -> Lease | None:
        return self.leadership.lease

    def _lead(self) -> bool:
        return self.leadership.lead()

    def step_down(self) -> None:
        """A clean stop: the analysed mark written, the lease given up so a standby need not wait it out."""
        if self._fence is not None:
            try:
                self._mark_analysed()  # the next leader need not analyse this one's last batches again
            except Exception as err:  # noqa: BLE001 - it analyses them again, publishing nothing new
                log.warning("analysed mark not written", error=str(err))
        self.leadership.give_up()

    async def keep_lease(self, stop: asyncio.Event) -> None:
        """While leading, renew the lease between turns too (``Leadership.keep``)."""
        await self.leadership.keep(stop)

    async def run_once(self) -> None:
        """One turn: as the leader, decide what confirmed incidents get, run due actions,
        verify, close recovered ones; as a standby, follow the records the leader analysed (``follow``)."""
        if not self._lead():
            if not self.leadership.store_down:  # an unreachable database was logged once by _lead
                self.follow()
                self._update_gauges()
            return
        try:
            # What other instances stored since the last turn (all of it after a
            # takeover) goes into the analysis before anything is decided.
            self.follow()
            await self._lead_once()
        except Fenced as err:
            # Deposed between renewing and writing: another instance leads now
            # and resumes from the intents; this one writes nothing more.
            log.warning("deposed: standing by", instance=self.instance, error=str(err))
            self.leadership.stand_by()

    async def _lead_once(self) -> None:
        now = self.clock()
        if len(self._probes):
            self._issue_probes(now, retry=True)  # requests the rate limit held back: it may let one out by now
        await self.ends.ask_heard(now)  # before deciding: nothing is decided for a job that ended
        await self.acting.turn(now)
        await self.ends.sweep_quiet(now)
        self._update_gauges()

    def _update_gauges(self) -> None:
        counts: dict[str, int] = {s.value: 0 for s in S}
        counts.update(self.store.incident_counts())
        for state, n in counts.items():
            self.metrics.incidents.labels(state).set(n)

    # --- decide ------------------------------------------------------------------------

    # --- actions ------------------------------------------------------------------------------

    # --- verify ---------------------------------------------------------------------------------

    # --- people ------------------------------------------------------------------------------------

    # --- people and node checks (the HTTP layer's) -----------------------------------------------------

    async def approve(self, incident_id: str, principal: Principal, approve: bool) -> dict[str, Any]:
        """A person's decision on the action waiting for approval (``Acting.approve``)."""
        return await self.acting.approve(incident_id, principal, approve)

    async def correction_result(self, correction_id: str, status: str, detail: str, who: str) -> bool:
        """The node check applied (or failed to apply) a correction (``Acting.correction_result``)."""
        return await self.acting.correction_result(correction_id, status, detail, who)

