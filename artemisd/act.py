"""Act: perform one action through Slurm, idempotently and with NHC manners.

Each method reads Slurm first and writes only what is missing, so re-running
an action whose result was never recorded (the daemon died mid-way) finishes
it instead of repeating it.  ``SlurmError`` propagates: the caller records
the attempt and retries with backoff.  Methods return an ``Outcome``:

* ``done``     the action took effect (or already had);
* ``skipped``  deliberately not done, with the reason (a person's drain);
* ``failed``   cannot be done (a job that is not requeueable): escalate;
* ``waiting``  handed to someone else who reports back (a correction the
  node check applies as root).

NHC manners: every reason and comment Artemis writes starts with
``artemis:``; a node drained with any other reason was drained by a person
and is never re-drained, overwritten or resumed; Artemis resumes only a node
whose drain reason names the very incident that drained it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from artemisd.slurm.api import JobInfo, SlurmBackend, SlurmError

# Slurm keeps reasons and comments short in its tables; stay well inside.
PENDING_POLLS = 40
PENDING_POLL_S = 0.25


@dataclass(frozen=True)
class Outcome:
    status: Literal["done", "skipped", "failed", "waiting"]
    detail: str


def _merge_features(current: str, extra: str) -> str:
    current = current.strip()
    if not current or current == "(null)":
        return extra
    if extra in current.split("&"):
        return current
    return f"({current})&{extra}" if "|" in current else f"{current}&{extra}"


class Actuator:
    def __init__(self, slurm: SlurmBackend):
        self.slurm = slurm

    def perform(self, kind: str, params: dict[str, Any], incident_id: str) -> Outcome | None:
        """Carry out one of the rungs Slurm carries out, from its action row's kind and params;
        None for a kind that is not Slurm's to do (a rebalance, a correction, telling people).
        The daemon and the simulated loop both act through here, on real or simulated Slurm."""
        if kind == "drain":
            return self.drain(params["node"], params["reason"])
        if kind == "requeue":
            return self.requeue_excluding(params["job"], params["node"])
        if kind == "constrain":
            return self.constrain(params["job"], params["feature"])
        if kind == "undrain":
            return self.undrain(params["node"], incident_id)
        return None

    def drain(self, node: str, reason: str) -> Outcome:
        info = self.slurm.node(node)
        if info.drained_by_person:
            return Outcome("skipped", f"{node} was drained by a person ({info.reason!r}); left alone")
        if info.drained_by_artemis:
            return Outcome("done", f"{node} already drained: {info.reason}")
        self.slurm.drain(node, reason)
        after = self.slurm.node(node)
        if not after.drained:
            raise SlurmError(f"{node} not drained after scontrol update (state {sorted(after.states)})")
        return Outcome("done", f"{node} drained: {reason}")

    def undrain(self, node: str, incident_id: str) -> Outcome:
        info = self.slurm.node(node)
        if not info.drained:
            return Outcome("done", f"{node} is not drained")
        if not info.drained_by_artemis or incident_id not in info.reason.split():
            return Outcome("skipped", f"{node} drain reason {info.reason!r} is not ours for {incident_id}; left alone")
        self.slurm.resume(node)
        return Outcome("done", f"{node} resumed")

    def requeue_excluding(self, job_id: str, node: str) -> Outcome:
        """requeuehold -> merge ExcNodeList -> release (ExcNodeList changes only while pending)."""
        job = self.slurm.job(job_id)
        if job is None:
            return Outcome("failed", f"job {job_id} unknown to Slurm")
        if not job.batch or not job.requeue:
            return Outcome("failed", f"job {job_id} is not a requeueable batch job (batch={job.batch}, "
                                     f"requeue={job.requeue}): it needs a restart by a person")
        if job.pending and not job.held and node in job.excluded_nodes:
            return Outcome("done", f"job {job_id} already requeued excluding {node}")
        if job.finished:
            return Outcome("failed", f"job {job_id} already ended ({job.state})")
        if job.state in ("RUNNING", "SUSPENDED", "CONFIGURING"):
            self.slurm.requeue_hold(job_id)
            job = self._wait_pending(job_id)
        elif not job.pending:
            # COMPLETING / REQUEUED: the old run is still being torn down; ExcNodeList
            # only changes once it is pending again.
            job = self._wait_pending(job_id)
        if node not in job.excluded_nodes:
            self.slurm.set_excluded_nodes(job_id, tuple(job.excluded_nodes) + (node,))
        self.slurm.release(job_id)
        return Outcome("done", f"job {job_id} requeued excluding {node}")

    def _wait_pending(self, job_id: str) -> JobInfo:
        """A requeued job passes through COMPLETING before it is pending again (bounded wait)."""
        seen = ""
        for _ in range(PENDING_POLLS):
            job = self.slurm.job(job_id)
            if job is not None and job.pending:
                return job
            seen = job.state if job else "gone"
            time.sleep(PENDING_POLL_S)
        raise SlurmError(f"job {job_id} not pending after requeuehold (state {seen}); retried later")

    def constrain(self, job_id: str, feature: str) -> Outcome:
        job = self.slurm.job(job_id)
        if job is None or not job.pending:
            return Outcome("failed", f"job {job_id} is not pending: Features can only change on a pending job")
        merged = _merge_features(job.features, feature)
        if merged != job.features:
            self.slurm.set_features(job_id, merged)
        return Outcome("done", f"job {job_id} Features={merged}")

    def comment(self, job_id: str, incident_id: str, text: str) -> Outcome:
        """Append ``text`` to the job's AdminComment unless it is already there."""
        job = self.slurm.job(job_id)
        if job is None:
            return Outcome("failed", f"job {job_id} unknown to Slurm")
        # casefold: sacctmgr (22.05) lowercases an AdminComment set on a finished job.
        if text.casefold() in job.admin_comment.casefold():
            return Outcome("done", f"job {job_id} AdminComment already has this {incident_id} note")
        comment = f"{job.admin_comment}; {text}" if job.admin_comment else text
        self.slurm.set_admin_comment(job_id, comment[:1000], finished=job.finished)
        return Outcome("done", f"job {job_id} AdminComment set")
