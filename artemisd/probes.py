"""The matched probes the analysis asked for and the rate limit has not let out yet.

A probe request is the analysis waiting for a measurement: the incident stays
marked as waiting for it (``Analyzer.probe_outstanding``) until its results
are judged.  A request the rate limit refused (``ProbeMinInterval``,
``ProbeMaxPerHour``) used to be dropped, and the incident then waited for a
probe nobody would ever send: a degraded link whose request came minutes after
a start-up suspect's was never named (issue 28).  So a refused request waits
here and is asked again each turn until the limit lets one out, the incident
stops waiting for it (answered, recovered, closed), or a newer request of the
same incident replaces it.  When the limit lets one probe of a job out, it
goes to the waiting request most worth it — the largest loss — not to the one
that came first.

Plain data in, plain data out: the daemon says what may be sent (its rate
limit and policy) and what each request is worth; this keeps the queue.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from artemisd.pipeline import ProbeRequest

MAX_WAITING = 4096  # requests held at once (one per open incident that waits for a probe); oldest out first


@dataclass
class Waiting:
    request: ProbeRequest
    since: float
    refusal: str | None = None  # the last reason it was not sent, audited once per reason


class ProbeQueue:
    def __init__(self) -> None:
        self._waiting: dict[str, Waiting] = {}  # analyzer incident id -> its newest request

    def add(self, requests: Iterable[ProbeRequest], now: float) -> None:
        for req in requests:
            self._waiting.pop(req.incident, None)  # a newer question about the incident replaces the older
            self._waiting[req.incident] = Waiting(req, now)
        while len(self._waiting) > MAX_WAITING:
            del self._waiting[next(iter(self._waiting))]

    def by_job(self, still_waiting: Callable[[str], bool], worth: Callable[[ProbeRequest], float]
               ) -> dict[str, list[Waiting]]:
        """Each job's waiting requests, most worth first (ties: oldest first); a request whose
        incident no longer waits for it leaves the queue."""
        out: dict[str, list[Waiting]] = {}
        for incident, waiting in list(self._waiting.items()):
            if not still_waiting(incident):
                del self._waiting[incident]
                continue
            out.setdefault(waiting.request.job, []).append(waiting)
        for waiting in out.values():
            waiting.sort(key=lambda w: (-worth(w.request), w.since))
        return out

    def sent(self, request: ProbeRequest) -> None:
        current = self._waiting.get(request.incident)
        if current is not None and current.request is request:
            del self._waiting[request.incident]

    def forget_job(self, job: str) -> None:
        for incident in [i for i, w in self._waiting.items() if w.request.job == job]:
            del self._waiting[incident]

    def __len__(self) -> int:
        return len(self._waiting)
