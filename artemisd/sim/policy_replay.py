"""``artemis replay --policy``: a recorded trace through the analysis *and* the closed loop.

The analysis runs exactly as plain replay runs it (``pipeline.Analyzer`` over
the records in arrival order).  Each incident it confirms goes to a ``Loop``
as the trace advances (the records' own times are ``now``), over a
``SimSlurm`` built from the trace: one partition, ``replay``, holding every
node the trace names, and one running job per job id with the nodes and
world its reports name.  A trace names no partitions, so the first
``PartitionPolicy`` whose pattern matches ``replay`` (``*`` or ``DEFAULT``)
applies to every job.

Two things differ from the live daemon, and the output says both:

* node events in the trace are taken as root-side evidence (a recorded trace
  is the admin's: its node events came from the prolog and the node check);
* the trace was recorded without the actions, so verification judges the
  recorded windows: a fault that an action would have fixed is still in them.
  Jobs are taken as requeueable batch jobs with no time limit (a trace says
  neither).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from artemisd import loss, verify
from artemisd.config import AnalysisSettings, Config, PartitionPolicy
from artemisd.incident import Incident, IncidentState
from artemisd.pipeline import Analyzer
from artemisd.sim.cluster import SimSlurm
from artemisd.sim.loop import Loop
from artemisd.wire import NodeEvent, WindowReport

PARTITION = "replay"
S = IncidentState
NOT_INCIDENTS = (S.SUSPECT, S.DISMISSED)


@dataclass
class PolicyReplay:
    """What the loop would have done over a trace: the loop (actions, notes, refusals), its cluster,
    the policy that applied, and the incidents in the order the analysis opened them."""

    loop: Loop
    slurm: SimSlurm
    policy: PartitionPolicy
    policy_matched: bool
    started: float
    incidents: list[Incident] = field(default_factory=list)
    analyzer_incidents: list[Incident] = field(default_factory=list)


def _time_of(rec: WindowReport | NodeEvent) -> float:
    return rec.time if isinstance(rec, NodeEvent) else rec.window.t1


def build_cluster(records: list[WindowReport | NodeEvent], start: float) -> SimSlurm:
    """The trace's cluster: one partition with every node it names; every job running on its nodes.

    Every job is there from the start (the trace has no queue to replay), and
    a node carries a GPU per rank any job ran on it, so jobs that shared a
    node in the recording fit on it together.
    """
    slurm = SimSlurm(start=start)
    ranks: dict[str, dict[str, set[int]]] = {}  # job -> node -> ranks
    worlds: dict[str, int] = {}
    nodes: set[str] = set()
    for rec in records:
        nodes.add(rec.node)
        if isinstance(rec, WindowReport):
            ranks.setdefault(rec.job, {}).setdefault(rec.node, set()).add(rec.rank)
            worlds[rec.job] = max(worlds.get(rec.job, 0), rec.world)
    gpus = {n: max(1, sum(len(by_node.get(n, ())) for by_node in ranks.values())) for n in nodes}
    for name in sorted(nodes):
        slurm.add_node(name, (PARTITION,), gpus=gpus[name])
    for job in sorted(ranks):
        by_node = ranks[job]
        # Each node holds the ranks this job ran there; one count per job keeps the sim simple: the most.
        per_node = max(len(r) for r in by_node.values())
        slurm.add_job(job, tuple(sorted(by_node)), PARTITION, user_id=0, gpus_per_node=per_node,
                      tasks=worlds[job], start=start)
    return slurm


def replay_policy(records: Iterable[WindowReport | NodeEvent], config: Config, *, approve_all: bool = False,
                  analysis: AnalysisSettings | None = None) -> PolicyReplay:
    """Run the trace through the analysis and the loop (see the module doc)."""
    run = TraceLoop(list(records), config, approve_all=approve_all, analysis=analysis)
    for rec in run.records:
        run.record(rec)
    return run.finish()


class TraceLoop:
    """The replay, one record at a time: the analysis' updates go to the loop, the recorded
    windows to verification.  ``record`` each record in order, then ``finish``; between two
    records a caller (a test) may act on ``slurm`` as a person would."""

    def __init__(self, records: list[WindowReport | NodeEvent], config: Config, *, approve_all: bool = False,
                 analysis: AnalysisSettings | None = None):
        self.records = records
        self.started = min((_time_of(r) for r in records), default=0.0)
        self.now = self.started
        self.slurm = build_cluster(records, self.started)
        self.policy = config.policy_for(PARTITION)
        self.analyzer = Analyzer(analysis or config.analysis)
        self.loop = Loop(config, self.slurm, approve_all=approve_all)
        self.config = config
        self.steps: dict[str, str] = {}
        self.worlds: dict[str, int] = {}
        self.gpus: dict[tuple[str, int], int] = {}
        self.opt_in: set[str] = set()
        self.last_seen: dict[str, float] = {}
        self.closed: dict[str, int] = {}
        self.baselines: dict[str, float | None] = {}
        self.action_windows: dict[str, int | None] = {}

    def record(self, rec: WindowReport | NodeEvent) -> None:
        now = self.now = max(self.now, _time_of(rec))
        self.slurm.advance_to(now)
        changed = False
        if isinstance(rec, NodeEvent):
            # A recorded trace is the admin's: its node events count as root-side evidence.
            self.loop.node_event(rec.node, now, rec.model_dump(mode="json", exclude_none=True))
            changed = True
        else:
            self.steps[rec.job] = rec.step
            self.worlds[rec.job] = rec.world
            self.last_seen[rec.job] = now
            if rec.device is not None:
                self.gpus[(rec.job, rec.rank)] = rec.device.index
            if rec.rebalance_opt_in:
                self.opt_in.add(rec.job)
        updates = self.analyzer.ingest(rec)
        self._observe(updates, now)
        if isinstance(rec, NodeEvent) and rec.event == "job_end" and rec.job is not None:
            info = self.slurm.job(rec.job)
            if info is not None and info.running:
                self.slurm.end_job(rec.job)
        if isinstance(rec, WindowReport):
            # Decide and verify when one of the job's windows was analysed, not on every report.
            series = self.analyzer.throughput(rec.job, rec.step)
            newest = series[-1][0] if series else -1
            changed = changed or newest != self.closed.get(rec.job)
            self.closed[rec.job] = newest
        if changed or updates:
            self._turn(now)

    def finish(self) -> PolicyReplay:
        """End of the trace: the windows still waiting are analysed, decided and verified."""
        self._observe(self.analyzer.flush(), self.now)
        self._turn(self.now)
        loop = self.loop
        return PolicyReplay(loop, self.slurm, self.policy, any(p is self.policy for p in self.config.policies),
                            self.started, [i for i in loop.incidents() if i.state not in NOT_INCIDENTS],
                            [i for i in self.analyzer.incidents if i.state not in NOT_INCIDENTS])

    def _observe(self, updates: list[Incident], now: float) -> None:
        for update in updates:
            step = self.steps.get(update.job, "0")
            if update.state is S.CONFIRMED and update.id not in self.baselines:
                self.baselines[update.id] = loss.baseline(self.analyzer.throughput(update.job, step),
                                                            update.onset_window)
            baseline = self.baselines.get(update.id)
            series = self.analyzer.throughput(update.job, step)
            self.loop.observe(
                update, now, gpus=self.worlds.get(update.job), time_left_s=None, node_evidence=None,
                gpu=self.gpus.get((update.job, update.rank)) if update.rank is not None else None,
                rebalance_opt_in=update.job in self.opt_in,
                measured_loss_pct=loss.incident_loss(baseline, series, update.onset_window, bool(update.recurrences)),
                step=step)

    def _turn(self, now: float) -> None:
        self.loop.tick(now)
        for incident_id in self.loop.verifying():
            inc = self.loop.tracked(incident_id).inc
            if incident_id not in self.action_windows:
                self.action_windows[incident_id] = self._last_window(inc.job)
            self.loop.verify(incident_id, self._evidence(inc, self.action_windows[incident_id]), now)
        rules = verify.Rules.of(self.config.daemon)
        for incident_id in self.loop.incident_ids((S.CONFIRMED, S.ESCALATED, S.UNRESOLVED)):
            if self.analyzer.subject_active(incident_id):
                continue
            inc = self.loop.tracked(incident_id).inc
            ev = self._evidence(inc, None)
            verification = None
            if ev.baseline is not None:
                since = verify.latest_since(list(ev.current), rules)
                if since is None:
                    continue
                verification = verify.measure(inc.kind.value, inc.cause.value, ev, rules, since=since)
            self.loop.subject_recovered(inc.id, now, verification)

    def _evidence(self, inc: Incident, action_window: int | None) -> verify.Evidence:
        shapes = self.analyzer.window_shapes(inc.job, self.steps.get(inc.job, "0"))
        # Recorded without the actions: the run the fault was seen in is the run judged.
        return verify.Evidence(self.baselines.get(inc.id), shapes, shapes, False, inc.onset_window,
                               action_window, self.last_seen.get(inc.job))

    def _last_window(self, job: str) -> int | None:
        step = self.steps.get(job, "0")
        series = self.analyzer.throughput(job, step)
        analysed = series[-1][0] if series else None
        newest = self.analyzer.newest_window(job, step)
        return max((w for w in (analysed, newest) if w is not None), default=None)
