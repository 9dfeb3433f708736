"""What a daemon instance holds in memory of the jobs it hears from, beside the analyzer.

Each rank's latest step, node and GPU; each job step's runs (a requeued job numbers its windows from 0
again: ``runs.JobRun``); the job's rank count; whether its ranks read their work shares; each rank's
count of reports it could not deliver; how many windows were stored since the last prune.  No I/O:
written by intake and restore, read by the decisions' gather, dropped with the job.
"""

from __future__ import annotations

import structlog

from artemisd.metrics import Metrics
from artemisd.pipeline import MAX_STEPS_PER_JOB
from artemisd.runs import JobRun, run_key, split_run
from artemisd.wire import NodeEvent, WindowReport

log = structlog.get_logger("artemisd")


class JobMemory:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.last_report: dict[str, dict[int, tuple[str, str, int | None]]] = {}  # job -> rank -> step, node, gpu
        self.steps: dict[str, str] = {}  # job -> the step its latest window came from
        self.world: dict[str, int] = {}  # job -> its ranks (GPUs): what a requeue restarts
        self.window_count: dict[str, int] = {}  # job -> rank 0's windows stored (the prune's cadence)
        self.runs: dict[tuple[str, str], JobRun] = {}  # (job, step) -> its latest run
        self.rebalance_opt_in: set[str] = set()  # jobs whose ranks read their work shares
        self.dropped: dict[str, dict[int, tuple[int, int]]] = {}  # job -> rank -> dropped_reports, relay_dropped

    def remember(self, rec: WindowReport | NodeEvent, quiet: bool = False) -> None:
        """A record stored (or restored, ``quiet``: nothing is said of it again)."""
        if rec.type != "window":
            return
        gpu = rec.device.index if rec.device is not None else None
        self.last_report.setdefault(rec.job, {})[rec.rank] = (rec.step, rec.node, gpu)
        self.steps[rec.job] = rec.step
        self.world[rec.job] = rec.world
        if rec.rebalance_opt_in:
            self.rebalance_opt_in.add(rec.job)
        self._reconnected(rec, quiet)

    def _reconnected(self, rec: WindowReport, quiet: bool) -> None:
        """A rank whose cumulative ``dropped_reports`` (or, a node's relay, ``relay_dropped``: its
        siblings' reports) grew could not reach us for a while: say so."""
        if rec.dropped_reports is None and rec.relay_dropped is None:
            return
        ranks = self.dropped.setdefault(rec.job, {})
        before, relay_before = ranks.get(rec.rank, (0, 0))
        dropped = before if rec.dropped_reports is None else rec.dropped_reports
        relay_dropped = relay_before if rec.relay_dropped is None else rec.relay_dropped
        ranks[rec.rank] = (dropped, relay_dropped)
        grew = max(0, dropped - before) + max(0, relay_dropped - relay_before)
        if grew and not quiet:
            self.metrics.probe_dropped.inc(grew)
            log.warning("probe reached the daemon again", job=rec.job, rank=rec.rank, node=rec.node,
                        dropped=dropped - before, dropped_total=dropped,
                        relay_dropped=relay_dropped - relay_before, relay_dropped_total=relay_dropped)

    def gpu_of(self, job: str, rank: int | None) -> int | None:
        """The device index ``rank`` of ``job`` last reported (None: not known)."""
        return self.last_report.get(job, {}).get(rank, (None, None, None))[2] if rank is not None else None

    def counted_window(self, rec: WindowReport | NodeEvent) -> int | None:
        """Rank 0's windows of the job stored so far, counting this one (None: not such a window)."""
        if rec.type != "window" or rec.rank != 0:
            return None
        count = self.window_count[rec.job] = self.window_count.get(rec.job, 0) + 1
        return count

    # --- runs -------------------------------------------------------------------------------------

    def run_for(self, job: str, step: str) -> tuple[str, JobRun]:
        """The base step name of ``step`` and its job step's latest run (a first run if none is known)."""
        base = split_run(step)[0]
        return base, self.runs.get((job, base)) or self.set_run(job, base, JobRun())

    def set_run(self, job: str, base: str, run: JobRun) -> JobRun:
        if (job, base) not in self.runs:
            # Step names are the sender's: as many as the analyzer keeps per job, the oldest goes.
            steps = [key for key in self.runs if key[0] == job]
            if len(steps) >= MAX_STEPS_PER_JOB:
                del self.runs[steps[0]]
        self.runs[(job, base)] = run
        return run

    def run_key(self, job: str, step: str) -> str:
        """The key of the job step's latest run (``step`` itself unless it was restarted since)."""
        base = split_run(step)[0]
        run = self.runs.get((job, base))
        return run_key(base, 0 if run is None else run.number)

    def seed_run(self, rec: WindowReport) -> None:
        """A stored report (its step key names its run) brings the job step's run up to date."""
        base, number = split_run(rec.step)
        known = self.runs.get((rec.job, base))
        if known is None:
            known = self.set_run(rec.job, base, JobRun(number))
        elif number > known.number:
            known.number, known.newest = number, {}  # as a restart does: the runs' starts stay
        if number == known.number:
            known.newest[rec.rank] = max(known.newest.get(rec.rank, rec.window.seq), rec.window.seq)
        known.saw_window(number, rec.window.seq, rec.window.t0, rec.window.t1)

    def forget(self, job: str) -> None:
        for key in [key for key in self.runs if key[0] == job]:
            del self.runs[key]
        for per_job in (self.last_report, self.dropped, self.steps, self.world, self.window_count):
            per_job.pop(job, None)
        self.rebalance_opt_in.discard(job)
