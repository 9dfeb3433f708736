"""Two artemisd on one real PostgreSQL beside the real Slurm test cluster (issue 12): what the
failover tests share — the pair, its roles as /v1/health says them, its log and its actions."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.unit.pg import PASSWORD, PgServer

from .artemis import ArtemisDaemon
from .procs import wait_until
from .slurm import SlurmCluster, free_port
from .test_daemon_restart import POLICY

LEASE_TIME_S = 10  # long enough for a turn's Slurm reads before a held drain
TAKEOVER_BOUND_S = 30  # the requirement


def health(daemon: ArtemisDaemon, timeout_s: float = 15) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"{daemon.url}/v1/health", timeout=timeout_s) as reply:
            return json.loads(reply.read())
    except OSError:
        return None


def wait_role(daemon: ArtemisDaemon, role: str, since: float, timeout_s: float = TAKEOVER_BOUND_S) -> float:
    """Seconds from ``since`` (monotonic) until ``daemon`` says it is ``role``."""
    wait_until(lambda: (health(daemon) or {}).get("role") == role, f"{daemon.name} to be {role}",
               timeout_s=timeout_s, interval_s=0.1, daemon=daemon.daemon)
    return time.monotonic() - since


def logged_at(daemon: ArtemisDaemon, event: str) -> list[float]:
    """When ``daemon`` logged ``event`` (its JSON lines' UTC timestamps, as epoch seconds)."""
    times = []
    for line in (daemon.dir / "artemisd.log").read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == event:
            times.append(datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp())
    return times


def actions_of(db: Any, incident: str) -> list[tuple[str, str, int | None]]:
    return [tuple(r) for r in db.db.execute(
        "SELECT kind, status, token FROM actions WHERE incident = %s ORDER BY id", (incident,)).fetchall()]


class Pair:
    """Two artemisd on one database: ``a`` where the nodes report (it starts first and leads), ``b`` stands by."""

    def __init__(self, cluster: SlurmCluster, pg: PgServer, tmp: Path, name: str,
                 a_url: str | None = None, a_env: dict[str, str] | None = None, policy: str = POLICY):
        self.cluster, self.pg, self.dbname = cluster, pg, name
        self.url = pg.create_database(name)
        secret = tmp / "state-password"
        secret.write_text(PASSWORD + "\n")
        secret.chmod(0o600)  # readable by the daemons' user (root here) only
        conf = f"StatePasswordFile={secret}\nLeaseTime={LEASE_TIME_S}\n{policy}"
        self.a = ArtemisDaemon(cluster, f"StateURL={a_url or self.url}\n{conf}", name=f"{name}-a", env=a_env)
        self.b = ArtemisDaemon(cluster, f"StateURL={self.url}\n{conf}", name=f"{name}-b", port=free_port())
        self.db: Any = None

    @contextmanager
    def running(self) -> Iterator[Pair]:
        from artemisd.store.postgres import PostgresStore

        with ExitStack() as stack:
            stack.callback(self.pg.drop_database, self.dbname)
            stack.enter_context(self.a)
            wait_role(self.a, "leader", time.monotonic(), timeout_s=60)
            stack.enter_context(self.b)
            wait_role(self.b, "standby", time.monotonic(), timeout_s=60)
            self.db = PostgresStore(self.url, password=PASSWORD)  # the test's own look at the state
            stack.callback(self.db.close)
            yield self

    def kill_a(self) -> float:
        """SIGKILL the leader (no lease given up); monotonic time of death."""
        return kill(self.a)

    def leader(self) -> ArtemisDaemon | None:
        """The instance that says it leads now (None: neither)."""
        for daemon in (self.a, self.b):
            if daemon.daemon is not None and (health(daemon) or {}).get("role") == "leader":
                return daemon
        return None

    def wait_evidence(self, node: str) -> None:
        """Until the node check's own report of the hot GPU on ``node`` is in the shared database."""
        def hot() -> bool:
            seen = self.db.node_evidence(node)
            gpus = (seen[1].get("gpus") or []) if seen else []
            return bool(gpus) and all(g.get("uuid") for g in gpus) and any(
                "hw_thermal" in (g.get("throttle") or []) for g in gpus)
        wait_until(hot, f"the node check on {node} to report the hot GPU", timeout_s=30, interval_s=0.25)


def kill(daemon: ArtemisDaemon) -> float:
    """SIGKILL ``daemon`` (no lease given up); monotonic time of death."""
    assert daemon.daemon is not None
    daemon.daemon.proc.send_signal(signal.SIGKILL)
    daemon.daemon.proc.wait(timeout=10)
    died = time.monotonic()
    daemon.daemon = None
    return died
