"""Change regressions: a known workload running slower under new software.

A job's healthy runs are remembered as *workload references* (``baseline.
WorkloadReference``), keyed by the workload — the job's shape (world, island
make-up), its samples per rank per step and its topology — and carrying the
software fingerprint it ran under (driver, comm lib, config hash, torch,
kernel, firmware).  A later job of the same workload under another
fingerprint that runs slower than the reference, by more than its stragglers
explain, is a *change* subject; ``localize.diagnose_change`` names what
changed.  A job whose fingerprint matches a reference is never a change
incident: the same software ran this workload before.

Pure functions of plain data.  The references are the caller's (they outlive
jobs): ``remember`` updates the dict it is given, nothing else is kept here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping

import numpy as np

from artemisd.baseline import JobHistory, JobSummary, WorkloadReference
from artemisd.detect import MIN_BASELINE_WINDOWS
from artemisd.frame import WindowFrame
from artemisd.localize import diagnose_change

References = dict[Hashable, list[WorkloadReference]]
# Workloads whose reference is kept, the least recently remembered going first: one reference per
# workload and software fingerprint (the newest job's), so a workload that thousands of jobs run
# holds a handful, and months of distinct workloads hold at most this many.
MAX_WORKLOADS = 4096
MAX_FINGERPRINTS_PER_WORKLOAD = 16
NODE_FINGERPRINT_KEYS = ("driver", "comm_lib", "kernel", "firmware")


def fingerprint(env: Mapping[str, str | None],
                node_fingerprints: Iterable[Mapping[str, str | None]]) -> dict[str, str | None]:
    """The job's software fingerprint: its reports' ``env``, with what the ranks
    did not say taken from its nodes' prolog events (the most common value)."""
    merged: dict[str, str | None] = dict(env)
    per_node = list(node_fingerprints)
    for key in NODE_FINGERPRINT_KEYS:
        values = [fp.get(key) for fp in per_node if fp.get(key)]
        if values and not merged.get(key):
            merged[key] = Counter(values).most_common(1)[0][0]
    return merged


def topology(frame: WindowFrame) -> int:
    """The nodes a job runs on, as one number."""
    return hash(tuple(sorted(str(n) for n in frame.node_names)))


def workload(frame: WindowFrame, conditions: Hashable, topology: int) -> Hashable:
    """Workload signature: the job's shape, its samples per rank per step, and its
    topology (the nodes it runs on) — a change is only judged under matched
    conditions: same workload, same hardware, same topology."""
    per_step = frame.samples / np.maximum(frame.steps, 1)
    finite = per_step[np.isfinite(per_step)]
    samples = round(float(np.median(finite)), 1) if finite.size else None
    return (conditions, samples, topology)


def worth_remembering(fingerprint: Mapping[str, str | None], history: JobHistory) -> bool:
    """A reference needs a fingerprint to compare with and a baseline to stand for."""
    return any(fingerprint.values()) and len(history.healthy) >= MIN_BASELINE_WINDOWS


def remember(references: References, job: str, previous_key: Hashable | None, key: Hashable,
             fingerprint: dict[str, str | None], history: JobHistory) -> None:
    """Keep what the job's healthy windows ran like as its workload's reference (replacing its own)."""
    if previous_key is not None and previous_key != key:
        # One reference per job step: a sender that varies its workload from
        # window to window (samples, world) must not leave one behind each time.
        old = [r for r in references.get(previous_key, []) if r.job != job]
        if old:
            references[previous_key] = old
        else:
            references.pop(previous_key, None)
    # An older job's reference of the same fingerprint goes: ``check`` asks only whether this software
    # ran the workload before and compares with the newest reference, which this one now is.
    refs = [r for r in references.pop(key, []) if r.job != job and r.fingerprint != fingerprint]
    h = history
    refs.append(WorkloadReference(fingerprint, h.median("step"), h.median("step_p50"), h.median("busy"),
                                  h.median("comm_wait"), job, len(h.healthy)))
    references[key] = refs[-MAX_FINGERPRINTS_PER_WORKLOAD:]  # (re)inserted last: the most recent
    while len(references) > MAX_WORKLOADS:
        del references[next(iter(references))]


def check(references: References, job: str, key: Hashable, fingerprint_of: Callable[[], dict[str, str | None]],
          summary: JobSummary, straggler_ms: float, job_slowdown: float) -> tuple[WorkloadReference, float] | None:
    """The reference this window's job is a change regression against, and its step ratio; None if it is not one.

    ``fingerprint_of`` is called only when the workload has a reference: the
    check runs every window, and the fingerprint walks every node's prolog event."""
    refs = [r for r in references.get(key, []) if r.job != job]
    if not refs:
        return None
    fingerprint = fingerprint_of()
    same = [r for r in refs if r.fingerprint == fingerprint]
    if same:
        return None  # the same software ran this workload before: not a change
    reference = refs[-1]
    ratio = summary.step / max(reference.step, 1e-9)
    if ratio < 1.0 + job_slowdown or summary.step - reference.step <= straggler_ms:
        return None
    if np.isfinite(summary.step_p50) and np.isfinite(reference.step_p50) and \
            summary.step_p50 < reference.step_p50 * (1.0 + job_slowdown / 2):
        return None  # a bursty window (checkpoint, congestion): the median step did not move
    if diagnose_change(reference, fingerprint, summary) is None:
        return None
    return reference, ratio
