"""Intake: what a request's records become — checked, stored (group commit), analysed, answered.

Any instance takes reports.  A request's records are checked against Slurm's word on their jobs
(``ingest.ownership_problem``), keyed to their job step's run (a requeued job numbers its windows
from 0 again), stored in one transaction with the other requests ready together, and — on the
leader — analysed, their incidents going to the acting half.  Each record is stored and analysed
under a last-resort guard: an unforeseen failure refuses that record alone, and one that fails
analysis is quarantined so a restart never replays it.  The reply carries the job step's directives.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import groupby
from typing import Any

import structlog

from artemisd import ingest
from artemisd.auth import Principal
from artemisd.config import Config
from artemisd.follow import Follower
from artemisd.incident import Incident, IncidentState
from artemisd.ingest import IngestResult
from artemisd.job_memory import JobMemory
from artemisd.jobs import JobLookups
from artemisd.ledger import Ledger
from artemisd.metrics import Metrics
from artemisd.pipeline import Analyzer
from artemisd.runs import run_key, split_run
from artemisd.slurm.api import JobInfo, SlurmError
from artemisd.store import StateStore, StoreUnavailable, batch_items, merge_batch_rows
from artemisd.wire import NodeEvent, WindowReport, dump_record, with_step

S = IncidentState
log = structlog.get_logger("artemisd")

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


class Intake:
    """See the module doc.  The daemon's other parts come in as callables: ``publish`` (the acting
    half takes an incident the analysis opened or updated), ``follow`` (read other instances' rows
    first), ``issue_probes`` and ``heard_from_epilogs`` (the bookkeeping after a batch), and
    ``unforeseen`` (the last-resort guard, which logs each kind of failure once)."""

    def __init__(self, config: Callable[[], Config], store: StateStore, ledger: Ledger, analyzer: Analyzer,
                 memory: JobMemory, metrics: Metrics, clock: Callable[[], float], jobs: JobLookups,
                 follower: Follower, unforeseen: Callable[[str, BaseException], str],
                 publish: Callable[[Incident, float], None], follow: Callable[[], int],
                 issue_probes: Callable[[float], None],
                 heard_from_epilogs: Callable[[list[WindowReport | NodeEvent], list[WindowReport | NodeEvent], float],
                                              None]):
        self._config = config
        self.store = store
        self.ledger = ledger
        self.analyzer = analyzer
        self.memory = memory
        self.metrics = metrics
        self.clock = clock
        self.jobs = jobs
        self.follower = follower
        self._unforeseen = unforeseen
        self._publish = publish
        self._follow = follow
        self._issue_probes = issue_probes
        self._heard_from_epilogs = heard_from_epilogs
        # (job, step) -> (time.monotonic(), clock() of the read, its directives): ``directives``.
        self._directives_read: dict[tuple[str, str], tuple[float, float, list[dict[str, Any]]]] = {}

    def forget_job(self, job: str) -> None:
        for key in [key for key in self._directives_read if key[0] == job]:
            del self._directives_read[key]

    def validate(self, items: list[tuple[int, Any, str | None]]) -> tuple[list[tuple[int, WindowReport | NodeEvent]], list[dict[str, Any]]]:
        """Items -> ([(index, record)], [{"index", "error"}]) (``ingest.validate``, under today's bounds)."""
        return ingest.validate(items, {"max_world": self._config().daemon.max_world}, lambda err: self._unforeseen("validating", err))

    async def check_jobs(self, principal: Principal, records: list[tuple[int, WindowReport | NodeEvent]]
                         ) -> dict[str, JobInfo | None | SlurmError | ingest.LookupRefused]:
        """What Slurm says of each job a user's records name, for ``accept`` (``JobLookups.for_request``,
        within its bounds per request and per user).  Root-side senders are not checked."""
        if principal.root_side:
            return {}
        return await self.jobs.for_request(principal, records, self._unforeseen)

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
        leading = self.ledger.fence is not None
        if leading:
            self.follower.fed_own.update(seq for seq in seqs if seq is not None)
            if not self.follower.own_rows():
                # Another instance stored rows since this one last read: they go
                # into the analysis first, so a job's windows are analysed in the
                # order they were stored whichever instance its ranks reached.
                try:
                    self._follow()
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
        self.bookkeeping(now, pruned=[rec for own in taken for rec in own],
                          ended=[rec for sub, own in zip(submissions, taken) if sub.principal.root_side
                                 for rec in own] if leading else [],
                          probes=leading)
        if leading:
            try:
                self.follower.mark(MARK_EVERY_S)
            except Exception as err:  # noqa: BLE001 - the next turn writes it; the reply stands
                self._unforeseen("marking analysed", err)
        for result, wanted in zip(results, steps):
            for job, step in sorted(wanted):
                try:
                    result.directives.extend(self.directives(job, step, now))
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

    def directives(self, job: str, step: str, now: float) -> list[dict[str, Any]]:
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

    def add_directive(self, directive_id: str, kind: str, job: str, step: str, incident: str | None,
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
            self._publish(update, now)

    def bookkeeping(self, now: float, pruned: list[WindowReport | NodeEvent], ended: list[WindowReport | NodeEvent],
                     probes: bool = True) -> None:
        """After records are stored (and analysed): the matched probes the analysis asked for, the
        history pruned, ended jobs forgotten.  Their failure never turns the records' acceptance into
        an error: each kind is logged once."""
        for stage, step_fn in (("issuing probes for", lambda: probes and self._issue_probes(now)),
                               ("pruning the history of", lambda: self._prune(pruned)),
                               ("forgetting the ended jobs of",
                                lambda: self._heard_from_epilogs(ended, pruned if probes else [], now))):
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
        if self.follower.restoring:
            return
        for stored in self.store.incidents(states=[S.VERIFYING, S.ACTING]):
            if stored.job == job and split_run(stored.step or "0")[0] == split_run(new_key)[0]:
                self.ledger.audit(stored.id, "daemon", "job restarted",
                                  f"windows of {job} now counted as {new_key}; verified once back in steady state")

    def _prune(self, kept: list[WindowReport | NodeEvent]) -> None:
        keep = self._config().daemon.history_windows_kept
        for rec in kept:
            count = self.memory.counted_window(rec)
            if count is not None and count % max(1, keep // 4) == 0:
                self.store.prune_records(rec.job, keep)
