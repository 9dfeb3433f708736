"""The matched probes the analysis asks for, sent as directives within the policy and the rate limit.

A probe request goes out as a ``probe`` directive in the replies to the job step's ranks
(``ProbeMinInterval``, ``ProbeMaxPerHour``); one the rate limit holds back waits in the
``ProbeQueue`` and is asked again each turn; one the policy refuses (``Probe=no``, ``Enabled=no``,
``DryRun=yes``) is dropped.  Each refusal is audited once per reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from artemisd.config import Config
from artemisd.ledger import Ledger
from artemisd.metrics import Metrics
from artemisd.pipeline import Analyzer, ProbeRequest
from artemisd.probes import ProbeQueue
from artemisd.runs import split_run
from artemisd.store import StateStore

AddDirective = Callable[[str, str, str, str, str | None, dict[str, Any], float, float | None], None]


class Probing:
    """``bound``: analyzer incident id -> the daemon's; ``due``: analyzer incident id -> when its
    matched probe expires (the acting half waits for it before deciding a job-wide incident)."""

    def __init__(self, config: Callable[[], Config], store: StateStore, ledger: Ledger, analyzer: Analyzer,
                 metrics: Metrics, add_directive: AddDirective, bound: dict[str, str], due: dict[str, float]):
        self._config = config
        self.store = store
        self.ledger = ledger
        self.analyzer = analyzer
        self.metrics = metrics
        self._add_directive = add_directive
        self._bound = bound
        self.due = due
        self.queue = ProbeQueue()  # requests the rate limit has not let out yet

    def forget_job(self, job: str) -> None:
        self.queue.forget_job(job)

    def _audit(self, incident: str | None, who: str, what: str, why: str = "", now: float | None = None) -> None:
        self.ledger.audit(incident, who, what, why, now=now)

    def issue(self, now: float, retry: bool = False) -> None:
        """The matched probes the analysis asked for, within the policy and the rate limit.

        A request the rate limit refuses waits (``probes.ProbeQueue``) and is asked
        again at every leader turn (``retry``: about once a second, not on every
        request, which would cost every report the limit's reads) and with every
        new request, until the limit lets it out or its incident stops waiting for
        it; when one probe of a job may go, the request most worth it (the largest
        loss) goes first.  A request the policy refuses (``Probe=no``,
        ``Enabled=no``, ``DryRun=yes``) is dropped.  Each refusal is audited once
        per reason, not every turn.
        """
        # A restart's replay raises the requests of before again: those already sent are not resent.
        fresh = [r for r in self.analyzer.pending_probes() if not self.store.has_directive(r.id)]
        if not fresh and not retry:
            return
        self.queue.add(fresh, now)
        for job, waiting in self.queue.by_job(self.analyzer.probe_outstanding, self._worth).items():
            pol = self._config().policy_for(self.store.job_partition(job))
            for entry in waiting:
                req = entry.request
                daemon_incident = self._bound.get(req.incident)
                refusal = self._refusal(job, now, pol.probe, req.corroborates)
                if refusal is not None:
                    kind, why = refusal
                    if kind == "policy":
                        self.queue.sent(req)  # not asked again: only a new request is
                    if entry.refusal != kind:
                        entry.refusal = kind
                        self.metrics.probes.labels("refused").inc()
                        waits = "" if kind == "policy" else "; it waits and is asked again when the limit allows"
                        self._audit(daemon_incident, "policy", f"probe {req.id} not sent", why + waits, now=now)
                    continue
                step = split_run(req.step)[0]
                body = {"type": "probe", "id": req.id, "job": req.job, "step": step}
                self._add_directive(req.id, "probe", req.job, step, daemon_incident, body, now,
                                    now + self._config().daemon.probe_timeout)
                self.queue.sent(req)
                self.due[req.incident] = now + self._config().daemon.probe_timeout
                self.metrics.probes.labels("issued").inc()
                waited = f" (waited {now - entry.since:.0f} s for the rate limit)" if entry.refusal else ""
                self._audit(daemon_incident, "daemon", f"probe {req.id} requested", req.reason + waited, now=now)

    def _worth(self, req: ProbeRequest) -> float:
        """What a waiting probe request is worth: the loss its incident shows (0 where none is known)."""
        bound = self._bound.get(req.incident)
        stored = self.store.incident(bound) if bound else None
        loss = stored.body.get("loss_pct") if stored else None
        return float(loss) if isinstance(loss, (int, float)) else 0.0

    def _refusal(self, job: str, now: float, allowed: bool, corroborates: bool = False
                       ) -> tuple[str, str] | None:
        """(kind, why) a probe of ``job`` may not go now, or None: kind ``policy`` (it may not go at
        all), ``interval`` or ``hourly`` (the rate limit: later it may)."""
        d = self._config().daemon
        if not allowed:
            return "policy", "Probe=no in the partition policy"
        if not d.enabled or d.dry_run:
            return "policy", "Enabled=no" if not d.enabled else "DryRun=yes"
        times = self.store.probe_times(job)
        # The second probe that confirms a link verdict is one measurement of the
        # same question: ProbeMaxPerHour bounds it, ProbeMinInterval does not.
        if times and now - times[-1] < d.probe_min_interval and not corroborates:
            return "interval", (f"rate limit: last probe {now - times[-1]:.0f} s ago "
                                f"(ProbeMinInterval={d.probe_min_interval:.0f})")
        if sum(1 for t in times if now - t < 3600) >= d.probe_max_per_hour:
            return "hourly", f"rate limit: {d.probe_max_per_hour} probes in the last hour (ProbeMaxPerHour)"
        return None
