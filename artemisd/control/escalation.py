"""What a person is told: the AdminComment and mail of an escalation, the all-clear, the job-end notice.

Pure: an incident and its action rows in, text out.  The daemon queues it as an
``escalate`` or ``notify`` action (the actuator sets the AdminComment, ``mail``
sends it); the simulated loop records the same text, so what a fleet run or
``artemis replay --policy`` says a person was told is what the daemon would
have sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from artemisd import loss
from artemisd.incident import Incident, IncidentState


class Row(Protocol):
    """An action row as this module reads it (the store's and the simulated loop's alike)."""

    id: int
    kind: str
    target: str | None
    status: str
    params: Mapping[str, Any]


@dataclass(frozen=True)
class Message:
    """One message for a person: the mail's subject and lines, and the AdminComment ("" for mail only)."""

    subject: str
    lines: tuple[str, ...]
    comment: str = ""
    marks: Mapping[str, Any] = field(default_factory=dict)  # extra params the row keeps (job_ended)

    def params(self, job: str) -> dict[str, Any]:
        """The ``escalate``/``notify`` action's params: what the actuator and mail carry out."""
        return {"job": job, "comment": self.comment, "subject": self.subject, "text": "\n".join(self.lines),
                "comment_done": not self.comment, "mail_done": False, **self.marks}


def where(inc: Incident) -> str:
    parts = []
    if inc.rank is not None:
        parts.append(f"rank {inc.rank}")
    if inc.node:
        parts.append(f"node {inc.node}")
    if inc.link:
        parts.append(f"link {inc.link}")
    return " ".join(parts) or f"job {inc.job}"


def by_hand(inc: Incident, kind: str, target: str | None) -> str | None:
    """The commands a person runs to do ``kind`` themselves (None where there is no such command)."""
    if kind == "drain" and target:
        return f"scontrol update NodeName={target} State=DRAIN Reason='{inc.id} {inc.cause.value}'"
    if kind == "requeue":
        node = inc.node or inc.link
        exclude = f"scontrol update JobId={inc.job} ExcNodeList={node}; " if node else ""
        return f"scontrol requeuehold {inc.job}; {exclude}scontrol release {inc.job}"
    if kind == "correct" and target:
        what = "restore the default power limit" if inc.cause.value == "gpu.power" else "reset application clocks"
        return f"{what} on {target} (nvidia-smi -rac / -pl, or amd-smi reset)"
    return None


def what_a_person_can_do(inc: Incident, recommended: Sequence[str], rows: Iterable[Row]) -> list[str]:
    """Only what exists for this incident: a pending approval, the recommended actions by hand."""
    out: list[str] = []
    for row in rows:
        if row.status == "pending_approval":
            out.append(f"{row.kind} {row.target or ''} awaits your decision: artemis approve {inc.id}  "
                       f"(or artemis deny {inc.id})")
    for item in recommended:
        kind, _, rest = item.partition(" ")
        target = rest.split(" (", 1)[0].strip() or None
        out.append(f"recommended, not done automatically: {item}")
        hand = by_hand(inc, kind, target)
        if hand:
            out.append(f"  by hand: {hand}")
    node = inc.node or inc.link
    if inc.cause.value.startswith(("gpu.", "comm.link")) and node and not recommended:
        out.append(f"inspect {node}: the evidence above says what it showed")
    out.append(f"the evidence and every decision: artemis show {inc.id}")
    return out


def escalation(inc: Incident, headline: str, recommended: Sequence[str], rows: Sequence[Row]) -> Message:
    """AdminComment and mail: what is known now, and what the person can do about it.

    A second escalation of the same incident (the diagnosis changed, or the
    next rung also needs a person) says that it updates the first.
    """
    earlier = [r for r in rows if r.kind == "escalate"]
    update = "update: " if earlier else ""
    subject = f"{update}{inc.id} {inc.cause.value} {where(inc)}: {headline}"
    comment = f"artemis: {update}{inc.id} {inc.cause.value} {where(inc)}"
    if inc.ratio:
        comment += f" {inc.ratio:.2f}x"
    comment += f": {headline}"
    lines = [f"Incident {inc.id} on job {inc.job}: {headline}."]
    if earlier:
        lines += [f"This updates the earlier message ({earlier[0].params.get('subject', '')}): "
                  f"what is known has changed."]
    lines += ["", f"cause: {inc.cause.value} (confidence {inc.confidence:.2f})",
              f"where: {where(inc)}",
              f"slowdown: ratio {inc.ratio}, {inc.excess_ms} ms/step excess"]
    summary = loss.loss_summary(inc.measured_loss_pct, inc.loss_pct)
    if summary is not None:
        lines.append(summary)
    if inc.result is not None:
        lines.append(inc.result.describe())
    lines += ["", "evidence:"]
    lines += [f"  {e.signal}: {e.value} (peers {e.peers}) {e.note}" for e in inc.evidence]
    lines += ["", "what you can do:"] + [f"  {line}" for line in what_a_person_can_do(inc, recommended, rows)]
    return Message(subject, tuple(lines), comment)


def all_clear(inc: Incident, why: str, rows: Iterable[Row]) -> Message | None:
    """A person was told about this incident and it resolved: tell them (mail only — AdminComment is
    for what a person must act on).  None where nobody was told."""
    if not any(r.kind == "escalate" and r.status == "done" for r in rows):
        return None
    lines = [f"Incident {inc.id} on job {inc.job} ({inc.cause.value} {where(inc)}) is resolved: {why}."]
    if inc.result is not None:
        lines.append(inc.result.describe())
    lines += ["", f"Nothing is needed from you for it. artemis show {inc.id}"]
    return Message(f"resolved: {inc.id} {inc.cause.value} {where(inc)}", tuple(lines))


def job_end_notice(inc: Incident, before: IncidentState, job_state: str | None, rows: Sequence[Row],
                   withdrawn: Iterable[Row]) -> Message | None:
    """A person was paged about this incident and its job ended before it was resolved: say so once, and
    what they may still want to do about it (mail only).  None where that was queued already (a
    restart cut the closing short): it is not sent twice."""
    if any(r.kind == "notify" and r.params.get("job_ended") for r in rows):
        return None
    slurm_said = f"Slurm: {job_state}" if job_state else "Slurm no longer knows it"
    lines = [f"Job {inc.job} ended ({slurm_said}) while incident {inc.id} ({inc.cause.value} "
             f"{where(inc)}) was {before.value}. It is closed as unresolved: nothing showed the "
             f"slowdown gone, and nothing more will be done about it automatically."]
    if inc.result is not None:
        lines.append(inc.result.describe())
    lines += ["", "what you may still want to do:"]
    for row in withdrawn:
        if row.status == "pending_approval":
            lines.append(f"  {row.kind} {row.target or ''} waited for your approval and was not done; "
                         f"there is nothing to approve any more")
    drained = {r.target for r in rows if r.kind == "drain" and r.status == "done" and r.target}
    for node in sorted(drained):
        lines.append(f"  {node} stays drained by Artemis: once it is checked, "
                     f"scontrol update NodeName={node} State=RESUME")
    node = inc.node or inc.link
    if node and node not in drained:
        lines.append(f"  {node} was not drained and may still be at fault: the next job on it may meet it")
        hand = by_hand(inc, "drain", node)
        if hand:
            lines.append(f"    by hand: {hand}")
    lines.append(f"  the evidence and every decision: artemis show {inc.id} (its plot, --plot, for "
                 f"EndedJobHistory after the job's last report)")
    return Message(f"ended with its job: {inc.id} {inc.cause.value} {where(inc)}", tuple(lines),
                   marks={"job_ended": True})
