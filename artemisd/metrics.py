"""Prometheus metrics of one daemon (``GET /metrics``).

A registry per daemon instance rather than the process-global default, so
tests can run several daemons in one process and a reload keeps the counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["Metrics", "CONTENT_TYPE_LATEST"]


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.reports = Counter("artemis_reports_total", "Records received, by outcome", ["outcome"], registry=r)
        # Every request counts both: the children once, not looked up per request.
        self.accepted = self.reports.labels("accepted")
        self.rejected = self.reports.labels("rejected")
        self.ingest_seconds = Histogram("artemis_ingest_seconds", "Time to ingest one POST /v1/reports",
                                        registry=r, buckets=(.001, .005, .01, .05, .1, .5, 1, 5))
        self.ingest_group = Histogram("artemis_ingest_group_requests",
                                      "POST /v1/reports requests stored together in one transaction",
                                      registry=r, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.incidents = Gauge("artemis_incidents", "Incidents by state", ["state"], registry=r)
        self.leader = Gauge("artemis_leader", "1 while this instance holds the leader lease (decides and acts), "
                            "0 while it is a standby", registry=r)
        self.actions = Counter("artemis_actions_total", "Action attempts, by kind and result",
                               ["kind", "result"], registry=r)
        self.probes = Counter("artemis_probes_total", "Probe directives issued or refused", ["outcome"], registry=r)
        self.probe_cost_ms = Counter("artemis_probe_cost_ms_total",
                                     "Training time spent in matched probes (sum over ranks), ms", registry=r)
        self.auth_failures = Counter("artemis_auth_failures_total", "Rejected credentials", registry=r)
        self.legacy_credentials = Counter(
            "artemis_legacy_credentials_total",
            "POST /v1/reports requests accepted with a legacy credential (body sha256 only, from a probe "
            "started before the upgrade); once it stays at 0 the allowance can go (auth.py)", registry=r)
        self.quarantined = Counter("artemis_quarantined_records_total",
                                   "Records moved out of the replayed history (failed analysis or restore)",
                                   registry=r)
        self.item_failures = Counter("artemis_item_failures_total",
                                     "Items refused by the last-resort guard (an unforeseen error), by stage",
                                     ["stage"], registry=r)
        self.probe_dropped = Counter("artemis_probe_reports_dropped_total",
                                     "Window reports probes dropped while they could not reach the daemon "
                                     "(counted when they reach it again)", registry=r)
        self.connections = Gauge("artemis_connections", "Open client connections (MaxConnections caps them)",
                                 registry=r)
        self.connections_refused = Counter("artemis_connections_refused_total",
                                           "Connections closed at the cap: evicted (idle longest), "
                                           "evicted_share (reading a body for the user over its fair share of "
                                           "connections: 503) or shed (the newcomer: 503)",
                                           ["outcome"], registry=r)
        self.requests_refused = Counter("artemis_requests_refused_total",
                                        "Requests refused before processing, by HTTP status and reason "
                                        "(credential, forbidden, too_large, read_timeout, slow_body, body_memory, "
                                        "user_body_memory, connection_share, unavailable)",
                                        ["status", "reason"], registry=r)
        self.backend_errors = Counter("artemis_backend_errors_total", "Slurm/SMTP failures (retried)",
                                      ["backend"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
