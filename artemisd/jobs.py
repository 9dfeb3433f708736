"""What Slurm says of the jobs that reports name: read on a request's behalf, within bounds.

A user's report is stored only when Slurm says the sender owns its job, so
every report of a job not cached yet costs ``squeue`` (and ``sacct`` where
squeue no longer knows it).  Those reads are work any user can make artemisd
do, so each is bounded (docs/admin-guide.md, "Security"):

* **syntax** — a job id is held to Slurm's own syntax before any command
  (``slurm.api.job_id_problem``): "--iterate=1" is refused as a value, never
  read by squeue as an option;
* **per request** — at most ``NEW_JOBS_PER_REQUEST`` jobs not cached yet are
  looked up for one request; the reports of the others are refused one by one,
  to be sent again (a probe's or relay's request names one job, or a node's few);
* **per user** — at most ``USER_READS_AT_ONCE`` of a uid's reads run at once
  (its other requests wait their turn, not everyone's), and a uid that named
  ``UNKNOWN_PER_USER`` jobs Slurm did not know within ``UNKNOWN_WINDOW_S`` gets
  no more lookups of new jobs until that window has passed;
* **in time** — the reads run in a pool of their own (``SlurmReadWorkers``), so
  they can never hold the workers that actions, mail and munge use; requests
  asking for one job at once share one read, and a read whose requests have all
  gone away is cancelled: its command is killed (``slurm.scope.CancelScope``);
* **in memory** — jobs Slurm did not know are cached apart from the others, at
  most ``UNKNOWN_CACHED`` of them and for ``JobCacheSeconds`` each; known jobs at
  most ``KNOWN_CACHED`` (least recently used out first), and forgotten with
  their job.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from artemisd import ingest
from artemisd.auth import Principal
from artemisd.slurm.api import JobInfo, SlurmError, job_id_problem
from artemisd.slurm.scope import CURRENT_SCOPE, CancelScope
from artemisd.store import StoreUnavailable
from artemisd.wire import NodeEvent, WindowReport

log = structlog.get_logger("artemisd")

NEW_JOBS_PER_REQUEST = 8
USER_READS_AT_ONCE = 2
UNKNOWN_PER_USER = 32
UNKNOWN_WINDOW_S = 60.0
UNKNOWN_CACHED = 4096
KNOWN_CACHED = 65_536
USERS_TRACKED = 65_536  # uids with a recent unknown job; beyond, the oldest are forgotten


class JobCache:
    """Slurm's last answer for each job, with when it was read: known jobs and unknown ones apart,
    so a flood of made-up ids can neither grow memory without bound nor push real jobs out."""

    def __init__(self, known_max: int = KNOWN_CACHED, unknown_max: int = UNKNOWN_CACHED):
        self.known: collections.OrderedDict[str, tuple[float, JobInfo]] = collections.OrderedDict()
        self.unknown: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.known_max = known_max
        self.unknown_max = unknown_max

    def get(self, job: str) -> tuple[float, JobInfo | None] | None:
        """(read at, answer) or None when nothing is cached."""
        hit = self.known.get(job)
        if hit is not None:
            self.known.move_to_end(job)
            return hit
        read_at = self.unknown.get(job)
        return None if read_at is None else (read_at, None)

    def put(self, job: str, read_at: float, info: JobInfo | None) -> None:
        if info is None:
            self.known.pop(job, None)
            self.unknown[job] = read_at
            self.unknown.move_to_end(job)
            while len(self.unknown) > self.unknown_max:
                self.unknown.popitem(last=False)
        else:
            self.unknown.pop(job, None)
            self.known[job] = (read_at, info)
            self.known.move_to_end(job)
            while len(self.known) > self.known_max:
                self.known.popitem(last=False)

    def expire(self, now: float, ttl: float) -> None:
        """Unknown jobs read ``ttl`` ago or earlier leave (they are in read order, oldest first)."""
        while self.unknown:
            job, read_at = next(iter(self.unknown.items()))
            if now - read_at < ttl:
                break
            del self.unknown[job]

    def forget(self, job: str) -> None:
        self.known.pop(job, None)
        self.unknown.pop(job, None)

    def __contains__(self, job: str) -> bool:
        return job in self.known or job in self.unknown


class _Flight:
    __slots__ = ("future", "scope", "waiters")

    def __init__(self, future: asyncio.Future, scope: CancelScope):
        self.future = future
        self.scope = scope
        self.waiters = 0


class SlurmReads:
    """Blocking Slurm reads in a small pool of their own; one read per key at a time, shared by
    whoever asks meanwhile, and cancelled (its command killed) when nobody waits for it any more."""

    def __init__(self, workers: int):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="slurm-read")
        self._flights: dict[Any, _Flight] = {}
        self.cancelled = 0

    async def read(self, key: Any, fn: Callable[[Any], Any]) -> Any:
        flight = self._flights.get(key)
        if flight is None:
            scope = CancelScope()
            future = asyncio.get_running_loop().run_in_executor(self._pool, _in_scope, scope, fn, key)
            flight = self._flights[key] = _Flight(future, scope)
            future.add_done_callback(lambda done, key=key, flight=flight: self._landed(key, flight, done))
        flight.waiters += 1
        try:
            return await asyncio.shield(flight.future)
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.future.done():
                # Everyone who asked went away: nobody will read the answer.
                self.cancelled += 1
                flight.scope.cancel()
                if self._flights.get(key) is flight:
                    del self._flights[key]  # a later request starts a read of its own

    def _landed(self, key: Any, flight: _Flight, done: asyncio.Future) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
        if not done.cancelled():
            done.exception()  # retrieved: a cancelled read's error is nobody's to report

    def in_flight(self) -> int:
        return len(self._flights)

    def close(self) -> None:
        for flight in self._flights.values():
            flight.scope.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _in_scope(scope: CancelScope, fn: Callable[[Any], Any], key: Any) -> Any:
    token = CURRENT_SCOPE.set(scope)
    try:
        return fn(key)
    finally:
        CURRENT_SCOPE.reset(token)


class UserShares:
    """Per-uid bounds on the lookups a user's requests cause: reads at once, and unknown jobs."""

    def __init__(self, at_once: int = USER_READS_AT_ONCE, unknown_max: int = UNKNOWN_PER_USER,
                 window_s: float = UNKNOWN_WINDOW_S):
        self.at_once = at_once
        self.unknown_max = unknown_max
        self.window_s = window_s
        self._slots: dict[int | None, asyncio.Semaphore] = {}
        self._holders: collections.Counter[int | None] = collections.Counter()
        self._unknown: collections.OrderedDict[int | None, collections.deque[float]] = collections.OrderedDict()

    def unknown_refusal(self, uid: int | None, now: float) -> str | None:
        """Why ``uid`` may look up no new job now, or None."""
        seen = self._unknown.get(uid)
        if seen is None:
            return None
        while seen and now - seen[0] >= self.window_s:
            seen.popleft()
        if not seen:
            del self._unknown[uid]
            return None
        if len(seen) < self.unknown_max:
            return None
        wait = math.ceil(self.window_s - (now - seen[0]))
        return (f"not looked up: uid {uid} named {len(seen)} jobs Slurm does not know in the last "
                f"{self.window_s:g} s; send it again in {wait} s")

    def saw_unknown(self, uid: int | None, now: float) -> None:
        seen = self._unknown.setdefault(uid, collections.deque(maxlen=self.unknown_max))
        self._unknown.move_to_end(uid)
        seen.append(now)
        while len(self._unknown) > USERS_TRACKED:
            self._unknown.popitem(last=False)

    async def __call__(self, uid: int | None, read: Callable[[], Any]) -> Any:
        """``await read()`` within ``uid``'s share of reads at once."""
        slots = self._slots.get(uid)
        if slots is None:
            slots = self._slots[uid] = asyncio.Semaphore(self.at_once)
        self._holders[uid] += 1
        try:
            async with slots:
                return await read()
        finally:
            self._holders[uid] -= 1
            if not self._holders[uid]:
                del self._holders[uid]
                self._slots.pop(uid, None)  # nobody of this uid waits: no state is kept for it


class _Own:
    """The daemon's own reads (decisions, the sweep, actions): not a user's, outside the read pool."""


OWN = _Own()


class JobLookups:
    """Slurm's word on jobs, through the cache: for the daemon's own decisions (``info``) and for
    the requests of users (``for_request``, within the bounds above).

    ``on_read(job, info)`` runs when a job was just read from Slurm (the daemon
    writes its owner to the store there); it may raise ``StoreUnavailable``,
    which forgets that answer so the next lookup reads it again.
    """

    def __init__(self, slurm_job: Callable[[str], JobInfo | None], workers: int, ttl: Callable[[], float],
                 clock: Callable[[], float], on_read: Callable[[str, JobInfo], None],
                 on_error: Callable[[], None], recheck_s: float):
        self.slurm_job = slurm_job
        self.cache = JobCache()
        self.reads = SlurmReads(workers)
        self.users = UserShares()
        self.ttl = ttl
        self.clock = clock
        self.on_read = on_read
        self.on_error = on_error
        self.recheck_s = recheck_s

    def is_fresh(self, job: str, now: float) -> bool:
        cached = self.cache.get(job)
        return cached is not None and now - cached[0] < self.ttl()

    async def info(self, job: str, fresh: bool = False, strict: bool = False,
                   uid: int | None | _Own = OWN, answered_now: bool = False) -> JobInfo | None:
        """The job as Slurm has it (None: Slurm never heard of it), read at most every JobCacheSeconds.

        Slurm down: the last answer, or None (``strict``: ``SlurmError`` when there
        is none, so the caller waits instead of guessing; ``answered_now``: even
        where there is one, for a caller that must not act on an older state of
        the job, e.g. close its incidents).  ``uid``: the user whose
        request needs it (within that user's share, in the read pool); the daemon's
        own reads (``OWN``) use the default workers, so users cannot hold them back.
        """
        now = self.clock()
        cached = self.cache.get(job)
        if cached and not (fresh or answered_now) and now - cached[0] < self.ttl():
            return cached[1]
        try:
            if isinstance(uid, _Own):
                value = await asyncio.to_thread(self.slurm_job, job)
            else:
                value = await self.users(uid, lambda: self.reads.read(job, self.slurm_job))
        except SlurmError as err:
            self.on_error()
            log.warning("slurm lookup failed", what="job", key=job, error=str(err))
            if (strict and not cached) or answered_now:
                raise
            return cached[1] if cached else None
        self.cache.expire(now, self.ttl())
        self.cache.put(job, now, value)
        if value is None:
            if not isinstance(uid, _Own):
                self.users.saw_unknown(uid, now)
        else:
            try:
                self.on_read(job, value)
            except StoreUnavailable:
                self.cache.forget(job)
                raise
        return value

    async def for_request(self, principal: Principal, records: list[tuple[int, WindowReport | NodeEvent]],
                          unforeseen: Callable[[str, BaseException], Any]
                          ) -> dict[str, JobInfo | None | SlurmError | ingest.LookupRefused]:
        """What Slurm says of each job a user's records name (owner, nodes, size), for ``accept``.

        Read through the cache.  When a record claims a node outside the cached
        allocation, or a world beyond the cached size, the job is read again (at
        most every ``recheck_s``): a requeued job runs on new nodes.  Slurm
        unreachable with nothing cached: the ``SlurmError``, and ``accept`` refuses
        those records.  A job that may not be looked up (its id, or the bounds of
        this module): ``LookupRefused``, and its records are refused with the reason.
        """
        claims: dict[str, list[WindowReport | NodeEvent]] = {}
        for _, rec in records:
            if rec.job is not None:
                claims.setdefault(rec.job, []).append(rec)
        out: dict[str, JobInfo | None | SlurmError | ingest.LookupRefused] = {}
        now = self.clock()
        new = 0
        for job, recs in claims.items():
            problem = job_id_problem(job)
            if problem:
                out[job] = ingest.LookupRefused(problem)
                continue
            if not self.is_fresh(job, now):
                new += 1
                if new > NEW_JOBS_PER_REQUEST:
                    out[job] = ingest.LookupRefused(
                        f"not looked up: one request may name at most {NEW_JOBS_PER_REQUEST} jobs artemisd "
                        "has not looked up yet; send it again")
                    continue
                if job not in self.cache:
                    refusal = self.users.unknown_refusal(principal.uid, now)
                    if refusal:
                        out[job] = ingest.LookupRefused(refusal)
                        continue
            try:
                info = await self.info(job, strict=True, uid=principal.uid)
                cached = self.cache.get(job)
                read_at = cached[0] if cached else self.clock()
                if info is not None and self.clock() - read_at >= self.recheck_s \
                        and any(ingest.claim_problem(rec, info) for rec in recs):
                    info = await self.info(job, fresh=True, strict=True, uid=principal.uid)
                out[job] = info
            except SlurmError as err:
                out[job] = err
            except StoreUnavailable:
                raise  # the whole request waits for the database, as storing it would
            except Exception as err:  # noqa: BLE001 - an unreadable answer about one job: that job is refused
                unforeseen("looking up", err)
                out[job] = None
        return out

    def forget(self, job: str) -> None:
        self.cache.forget(job)

    def close(self) -> None:
        self.reads.close()
