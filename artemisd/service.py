"""The daemon's loop: ingest → analyze → decide → act → verify, every step recorded.

``Daemon`` owns the analyzer, the store and the ledger, and wires the parts:
intake (``accept_many``: store, analyse, quarantine, directives) and restore /
a standby's follow are here; the acting half is ``acting.Acting`` (gather,
``control/reconcile.py``, apply), a job's end ``job_ends.JobEnds``, the lease
``leadership.Leadership``, what it holds of each job ``job_memory.JobMemory``.
The HTTP layer (server.py) only authenticates and hands records in; a timer
calls ``run_once``, which is also what tests drive step by step.

Incident life in the daemon (states from ``IncidentState``)::

    analyzer: suspect -> confirmed | dismissed
    daemon:   confirmed --decide--> acting (auto rung) | escalated (approval / escalate rung)
              acting    --action done--> verifying --verify--> resolved | unresolved
              unresolved --roll back reversible, next rung--> acting | escalated
              escalated --approve--> acting;  --deny--> next rung
              confirmed / escalated / unresolved --subject healthy again--> resolved
              any open --Slurm says the job ended--> unresolved (dismissed: a suspect): ``JobEnds``

Restart (``restore``): stored incidents are authoritative.  The bounded window
history is fed through a fresh ``Analyzer`` (the replay path) to rebuild its
baselines and watched subjects; each incident it re-creates is bound to the
stored incident of the same subject instead of being published again.
Actions are recorded as intent before Slurm is touched; open ones are re-run
through the idempotent actuator.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

import structlog

from artemisd import ingest
from artemisd.acting import Acting
from artemisd.auth import Principal
from artemisd.config import Config
from artemisd.follow import Follower
from artemisd.intake import Intake
from artemisd.incident import IncidentState
from artemisd.ingest import IngestResult
from artemisd.job_ends import JobEnds
from artemisd.job_memory import JobMemory
from artemisd.jobs import OWN, JobLookups
from artemisd.leadership import Leadership
from artemisd.lease import Fenced, Lease
from artemisd.ledger import Ledger
from artemisd.metrics import Metrics
from artemisd.pipeline import Analyzer
from artemisd.probing import Probing
from artemisd.slurm.api import JobInfo, SlurmBackend, SlurmError
from artemisd.store import StateStore, StoreUnavailable, open_store
from artemisd.wire import NodeEvent, WindowReport

MAX_LOGGED_FAILURES = 64  # kinds of unforeseen per-item failure logged with a traceback (once each)
# A claim outside the cached allocation re-reads the job at most this often:
# a requeued job has new nodes, but a wrong claim must not cost a Slurm call each.
ALLOCATION_RECHECK_S = 5.0
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
        self._logged_failures: set[tuple[str, str]] = set()
        self.restore_skipped = 0
        # The parts; ``intake`` is made last, and the three made before it reach it through these.
        add_directive = lambda *a: self.intake.add_directive(*a)  # noqa: E731
        bookkeeping = lambda *a, **k: self.intake.bookkeeping(*a, **k)  # noqa: E731
        self.acting = Acting(config, self.store, self.ledger, self.analyzer, slurm, self.metrics, self.memory,
                             self.clock, self.job_info, add_directive, self._bound, self._probe_due)
        self.probing = Probing(lambda: self.config, self.store, self.ledger, self.analyzer, self.metrics,
                               add_directive, self._bound, self._probe_due)
        self.follower = Follower(self.store, self.ledger, self.analyzer, self.memory, self.metrics, self.clock,
                                 self._bound, lambda: self.config.daemon.max_world, self.acting.publish,
                                 bookkeeping, self._unforeseen, self._forget_in_memory)
        self.ends = JobEnds(self.store, self.clock, self.job_info, self.acting.end_incidents, self._forget_in_memory,
                            self.analyzer.jobs, lambda: self.config.daemon.ended_job_history)
        self.intake = Intake(lambda: self.config, self.store, self.ledger, self.analyzer, self.memory, self.metrics,
                             self.clock, self.jobs, self.follower, self._unforeseen, self.acting.publish, self.follow,
                             self.probing.issue, self.ends.heard_from_epilogs)
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
        fed, skipped, bound = self.follower.restore()
        self.restore_skipped = skipped
        if fed or bound:
            log.info("state restored", records=fed, skipped=skipped, bound=bound)
        self._update_gauges()

    def follow(self) -> int:
        """Feed the analyzer the records stored since the last turn (``Follower.follow``: every instance
        takes what the leader analysed; the leader analyses the rest); returns how many were fed."""
        fed, skipped = self.follower.follow()
        self.restore_skipped += skipped
        return fed

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

    # --- jobs -------------------------------------------------------------

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

    def _forget_in_memory(self, job: str) -> None:
        """What this instance holds of an ended job whose incidents are closed, in the analyzer and
        beside it: without this a daemon's memory grows with every job it has seen."""
        for analyzer_id in self.analyzer.forget_job(job):
            self._bound.pop(analyzer_id, None)
            self._probe_due.pop(analyzer_id, None)
        self.memory.forget(job)
        self.jobs.forget(job)
        self.probing.forget_job(job)
        self.ends.drop(job)
        self.intake.forget_job(job)

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
                self.follower.mark()  # the next leader need not analyse this one's last batches again
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
        if len(self.probing.queue):
            self.probing.issue(now, retry=True)  # requests the rate limit held back: it may let one out by now
        await self.ends.ask_heard(now)  # before deciding: nothing is decided for a job that ended
        await self.acting.turn(now)
        await self.ends.sweep_quiet(now)
        self._update_gauges()

    def _update_gauges(self) -> None:
        counts: dict[str, int] = {s.value: 0 for s in IncidentState}
        counts.update(self.store.incident_counts())
        for state, n in counts.items():
            self.metrics.incidents.labels(state).set(n)

    # --- people and node checks (the HTTP layer's) -----------------------------------------------------

    async def approve(self, incident_id: str, principal: Principal, approve: bool) -> dict[str, Any]:
        """A person's decision on the action waiting for approval (``Acting.approve``)."""
        return await self.acting.approve(incident_id, principal, approve)

    async def correction_result(self, correction_id: str, status: str, detail: str, who: str) -> bool:
        """The node check applied (or failed to apply) a correction (``Performer.correction_result``)."""
        return await self.acting.performer.correction_result(correction_id, status, detail, who)

    # --- intake (the HTTP layer's) ------------------------------------------------------------------

    def validate(self, items: list[tuple[int, Any, str | None]]
                 ) -> tuple[list[tuple[int, WindowReport | NodeEvent]], list[dict[str, Any]]]:
        """Items -> ([(index, record)], [{"index", "error"}]) under today's bounds (``Intake.validate``)."""
        return self.intake.validate(items)

    async def check_jobs(self, principal: Principal, records: list[tuple[int, WindowReport | NodeEvent]]
                         ) -> dict[str, JobInfo | None | SlurmError | ingest.LookupRefused]:
        """What Slurm says of each job a user's records name (``Intake.check_jobs``)."""
        return await self.intake.check_jobs(principal, records)

    def accept(self, records: list[tuple[int, WindowReport | NodeEvent]], principal: Principal,
               jobs: dict[str, JobInfo | None | SlurmError] | None = None,
               rejected: list[dict[str, Any]] | None = None, body: bytes | None = None) -> IngestResult:
        """One request's records stored, and analysed if this instance leads (``Intake.accept``)."""
        return self.intake.accept(records, principal, jobs, rejected, body)

    def accept_many(self, submissions: list[ingest.Submission]) -> list[IngestResult | StoreUnavailable]:
        """Several requests' records in one transaction (``Intake.accept_many``)."""
        return self.intake.accept_many(submissions)

