"""What the Analyzer learns across jobs for the change check: workload references and the nodes' fingerprints.

``change.py`` holds the rules (what a workload is, when a reference is kept,
when a job is a change regression); this object holds the state they run on:
the workload references, which outlive the jobs that taught them, and the
software fingerprints the nodes' prolog events reported per job, which go with
their job (``forget_job``).  Pure: plain data in, plain data out.
"""

from __future__ import annotations

from collections.abc import Hashable

from artemisd import change
from artemisd.baseline import JobSummary, WorkloadReference
from artemisd.config import AnalysisSettings
from artemisd.frame import WindowFrame
from artemisd.pipeline_assembly import JobState
from artemisd.wire import NodeEvent


class ChangeMemory:
    """Workload references across jobs and the nodes' software fingerprints per job."""

    def __init__(self, settings: AnalysisSettings):
        self.settings = settings
        self.references: change.References = {}
        self.node_fingerprints: dict[tuple[str, str], dict[str, str | None]] = {}

    def note(self, event: NodeEvent) -> None:
        """Keep the fingerprint a node's event reports for its job."""
        if event.job is not None and event.fingerprint is not None:
            self.node_fingerprints[(event.job, event.node)] = event.fingerprint.model_dump()

    def forget_job(self, job: str) -> None:
        """Drop the job's nodes' fingerprints (its references stay: they are what is learnt across jobs)."""
        for key in [key for key in self.node_fingerprints if key[0] == job]:
            del self.node_fingerprints[key]

    def fingerprint(self, state: JobState) -> dict[str, str | None]:
        """The job's software fingerprint: its reports' env with its nodes' events'."""
        return change.fingerprint(state.env, (fp for (job, _), fp in self.node_fingerprints.items()
                                              if job == state.job))

    def remember(self, state: JobState, frame: WindowFrame, conditions: Hashable) -> None:
        """A healthy window of the job step: keep its workload's reference up to date."""
        fingerprint = self.fingerprint(state)
        if not change.worth_remembering(fingerprint, state.history):
            return
        key = self._workload(state, frame, conditions)
        change.remember(self.references, state.job, state.reference_key, key, fingerprint, state.history)
        state.reference_key = key

    def check(self, state: JobState, frame: WindowFrame, summary: JobSummary,
              conditions: Hashable, straggler_ms: float) -> tuple[WorkloadReference, float] | None:
        """The reference this window is a change regression against, and its step ratio; None if it is not one."""
        return change.check(self.references, state.job, self._workload(state, frame, conditions),
                            lambda: self.fingerprint(state), summary, straggler_ms, self.settings.job_slowdown)

    @staticmethod
    def _workload(state: JobState, frame: WindowFrame, conditions: Hashable) -> Hashable:
        if state.topology is None:  # the nodes the job was first judged on
            state.topology = change.topology(frame)
        return change.workload(frame, conditions, state.topology)
