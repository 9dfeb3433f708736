"""When a job ends: its open incidents end with it, and what the daemon holds of it goes.

Slurm is the truth for whether a job ended.  A job's epilog says ``job_end`` (a requeued job's does
too), a job that went quiet may have ended without its epilog reaching us, and a rank's last windows
may arrive after its job was forgotten: in each case Slurm is asked, and only when it says the job
ended (or no longer knows it) do its incidents end (``Acting.end_incidents``) and its history go.  A
job one of whose incidents waits for a person keeps its window history ``EndedJobHistory`` longer,
for that person's ``artemis show --plot``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable

import structlog

from artemisd.acting import closed
from artemisd.slurm.api import JobInfo, SlurmError
from artemisd.store import StateStore, StoredIncident
from artemisd.wire import NodeEvent, WindowReport

log = structlog.get_logger("artemisd")

# A job whose end never reached the daemon (no epilog installed, or its job_end lost with its node):
# once it has sent nothing this long, the leader asks Slurm, every QUIET_SWEEP_S and at most
# QUIET_ASKED_PER_SWEEP jobs each time, and forgets it as a job_end would if Slurm says it ended.
QUIET_S = 600.0
QUIET_SWEEP_S = 300.0
QUIET_ASKED_PER_SWEEP = 64
# ... and stops asking once a sweep has taken this long: it runs in the leader's turn, and a slow
# slurmctld must not hold decisions, actions and verification back (the next sweep goes on from there).
QUIET_SWEEP_BUDGET_S = 2.0
# A job's epilog says job_end while Slurm still has it COMPLETING (the epilogs of its nodes are
# running): Slurm is asked again this often, for at most END_COMPLETING_S (a node stuck completing
# is left to the quiet sweep), so its incidents end once it has ended, not ten minutes later.
END_RECHECK_S = 2.0
END_COMPLETING_S = 600.0
# A job forgotten as ended whose windows still arrive within this long (a rank's last reports
# delivered after its epilog's job_end): Slurm is asked about it again, so an incident those
# windows opened ends with it and the job is forgotten again, rather than at the quiet sweep.
LATE_AFTER_END_S = 120.0


def told_at_job_end(stored: StoredIncident) -> bool:
    return bool((stored.body.get("ended_with_job") or {}).get("person_told"))


class JobEnds:
    """The jobs heard to have ended, asked about, and forgotten (see the module doc).

    ``end_incidents(job, info, now)``: the acting half ends a job's open incidents; ``forget_in_memory``:
    the daemon drops what it holds of a job (analyzer, memory, caches: it calls ``drop`` here too);
    ``held_jobs``: the jobs the analyzer holds (what the quiet sweep walks)."""

    def __init__(self, store: StateStore, clock: Callable[[], float], job_info: Callable[..., Awaitable[JobInfo | None]],
                 end_incidents: Callable[[str, JobInfo | None, float], None],
                 forget_in_memory: Callable[[str], None], held_jobs: Callable[[], set[str]],
                 ended_job_history: Callable[[], float]):
        self.store = store
        self.clock = clock
        self._job_info = job_info
        self._end_incidents = end_incidents
        self._forget_in_memory = forget_in_memory
        self._held_jobs = held_jobs
        self._ended_job_history = ended_job_history
        self._swept = -math.inf  # clock() of the last quiet sweep
        self._last_asked = ""  # the job that sweep asked Slurm about last: the next starts after it
        # Jobs Slurm said had ended while one of their incidents was open: job -> (its last-seen time
        # then, when its EndedJobHistory runs from).  Not asked again while their last-seen holds.
        self.ended_open: dict[str, tuple[float | None, float]] = {}
        # Jobs whose epilog said job_end while an incident of theirs was open: the leader's next turn
        # asks Slurm whether they ended (a requeued job's epilog says job_end too).  job -> (when it
        # was heard, when Slurm is to be asked next): a job still completing is asked again.
        self.heard: dict[str, tuple[float, float]] = {}
        # Jobs forgotten as ended: job -> when (``LATE_AFTER_END_S``).
        self.forgotten: dict[str, float] = {}

    def drop(self, job: str) -> None:
        """The job has left this instance's memory: nothing about its end is held either."""
        self.ended_open.pop(job, None)
        self.heard.pop(job, None)

    def heard_from_epilogs(self, ended: list[WindowReport | NodeEvent], analysed: list[WindowReport | NodeEvent],
                      now: float) -> None:
        """A job's epilog said it ended and none of its incidents is open: its window history goes.

        A requeued job's epilog also says job_end, so one with an incident open is
        only heard of here: the leader's turn asks Slurm (``ask_heard``),
        and its incidents end with it only if Slurm says it ended; a requeued
        job's stay open, with its history (and the analyzer's restart from it).
        """
        for job in {r.job for r in ended if type(r) is NodeEvent and r.event == "job_end" and r.job}:
            if not self._forget_if_closed(job):
                self._hear_end(job, now)
        self._late_after_end(analysed, now)

    def _hear_end(self, job: str, now: float) -> None:
        heard = self.heard.get(job)
        self.heard[job] = (heard[0] if heard else now, now)

    def _late_after_end(self, kept: list[WindowReport | NodeEvent], now: float) -> None:
        """Windows of a job forgotten as ended, arriving after its job_end (each node's epilog runs
        once its ranks exited, while their last reports may still be on their way): the analysis
        holds the job again, and may open a suspect on them; Slurm is asked about it again."""
        while self.forgotten:  # in the order they were forgotten
            job, at = next(iter(self.forgotten.items()))
            if now - at <= LATE_AFTER_END_S:
                break
            del self.forgotten[job]
        if not self.forgotten:  # the usual case: no pass over the request's records
            return
        for job in {r.job for r in kept if r.type == "window" and r.job in self.forgotten}:
            self._hear_end(job, now)

    async def ask_heard(self, now: float) -> None:
        """The jobs whose epilog said job_end while an incident of theirs was open, or whose windows
        came after they were forgotten as ended: Slurm says whether they ended.  A requeued job
        (pending or running again) keeps its incidents open; one Slurm still has COMPLETING (its
        epilogs run while it is) is asked again in ``END_RECHECK_S``; Slurm unreachable: asked again
        next turn, nothing closed on a guess.  Like the quiet sweep, this stops at
        ``QUIET_SWEEP_BUDGET_S`` and the next turn goes on."""
        began = time.monotonic()
        for job, (heard_at, ask_at) in sorted(self.heard.items()):
            if now < ask_at:
                continue
            if time.monotonic() - began >= QUIET_SWEEP_BUDGET_S:
                return
            try:
                info = await self._job_info(job, fresh=True, strict=True, answered_now=True)
            except SlurmError:
                return
            if info is not None and info.state == "COMPLETING" and now - heard_at < END_COMPLETING_S:
                self.heard[job] = (heard_at, now + END_RECHECK_S)  # ended or requeued: not yet known
                continue
            del self.heard[job]
            if info is not None and not info.finished:
                self.forgotten.pop(job, None)  # requeued, running again: its windows are its own
            elif self._ended(job, info, now):
                log.info("ended job forgotten", job=job, slurm_state=info.state if info else "not known to Slurm")

    async def sweep_quiet(self, now: float) -> None:
        """Jobs that ended without their end reaching us leave the store and memory, as a job_end
        would have them: a job held that has sent nothing for ``QUIET_S`` and that Slurm says has
        finished (or no longer knows) has its open incidents end with it (``_ended``), then goes.
        Slurm is the truth for a job's state; while it cannot be asked, nothing is closed or
        forgotten.  Without this, a site without the epilog would hold every job it has seen (~1 kB
        a rank) and its incidents open for ever."""
        if now - self._swept < QUIET_SWEEP_S:
            return
        self._swept = now
        held = sorted(self._held_jobs())
        # In turn from after the last one asked: a long list of quiet running jobs must not starve
        # the ones after it.
        start = next((i for i, job in enumerate(held) if job > self._last_asked), 0)
        asked = 0
        began = time.monotonic()
        for job in held[start:] + held[:start]:
            if asked >= QUIET_ASKED_PER_SWEEP or (asked and time.monotonic() - began >= QUIET_SWEEP_BUDGET_S):
                break
            seen = self.store.job_last_seen(job)
            if seen is not None and now - seen < QUIET_S:
                continue
            ended = self.ended_open.get(job)
            if ended is not None and ended[0] == seen:
                # Slurm said it ended, and an incident of it was open: not asked again.  Its history
                # stays for a person to look at, EndedJobHistory from its last word, then goes.
                if now - ended[1] >= self._ended_job_history():
                    self._release_history(job, now - ended[1])
                continue
            asked += 1
            self._last_asked = job
            try:
                info = await self._job_info(job, fresh=True, strict=True, answered_now=True)
            except SlurmError:
                return  # Slurm cannot say: the next sweep asks again
            if info is not None and not info.finished:  # pending, running, or being requeued
                continue
            if self._ended(job, info, now):
                log.info("ended job forgotten", job=job, quiet_s=round(now - seen) if seen is not None else None,
                         slurm_state=info.state if info is not None else "not known to Slurm")

    def _ended(self, job: str, info: JobInfo | None, now: float) -> bool:
        """Slurm says the job ended (``info``; None: it no longer knows it): its open incidents end
        with it, and it is forgotten (True), or its windows stay ``EndedJobHistory`` for a person
        paged about one of them."""
        self._end_incidents(job, info, now)
        if self._forget_if_closed(job):
            return True
        seen = self.store.job_last_seen(job)
        self.ended_open[job] = (seen, seen if seen is not None else now)
        return False

    def _forget_if_closed(self, job: str) -> bool:
        """An ended job whose incidents are all closed leaves the store and memory; False: one is open,
        or one ended with the job after a person was paged about it (its windows stay for that
        person's ``artemis show --plot``, ``EndedJobHistory``, as ``_release_history`` says)."""
        incidents = self.store.incidents(job=job)
        if not all(closed(i) for i in incidents) or any(told_at_job_end(i) for i in incidents):
            return False
        self.forget(job)
        return True

    def forget(self, job: str) -> None:
        """An ended job leaves the store and this instance's memory (a standby's, once the mark moves)."""
        self.store.forget_job(job)
        self._forget_in_memory(job)
        self.forgotten.pop(job, None)
        self.forgotten[job] = self.clock()

    def _release_history(self, job: str, quiet_s: float) -> None:
        """An ended job whose incidents stayed open (held, escalated, unresolved: waiting for a
        person) lets its window history go after ``EndedJobHistory``, as a closed one does at once:
        else every such job's history would stay in the store, in memory and in each restore for
        ever.  Its incidents stay, with their numbers and evidence; only the windows behind their
        plots go."""
        incidents = [i.id for i in self.store.incidents(job=job)]
        self.forget(job)
        log.info("ended job's window history released; its incidents stay", job=job,
                 quiet_s=round(quiet_s), incidents=incidents)
