"""The real artemisd (and a loopback SMTP server) wired to a ``SlurmCluster``.

artemisd listens where every emulated node reaches it (the bridge address, or
127.0.0.1 in the loopback layout), authenticates with the cluster's munged,
acts on the cluster through its Slurm CLI backend (``SLURM_CONF``), and mails
escalations to ``Mailbox`` on 127.0.0.1.  ``incidents()`` reads them the way a
person would: ``artemis incidents --json``.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import threading
import urllib.request
from collections.abc import Callable
from contextlib import closing
from email import message_from_bytes
from email.message import Message
from pathlib import Path
from typing import Any

from artemisd.store import JOB_WINDOW_ROWS, RECORD_COUNT, window_bodies

from .procs import ClusterError, Daemon, spawn, tail, wait_until
from .slurm import SlurmCluster, free_port


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:.1f}"


class Mailbox:
    """aiosmtpd on 127.0.0.1 that keeps every message it receives."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self._lock = threading.Lock()
        self.port = free_port()
        self.controller: Any = None

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        with self._lock:
            self.messages.append(message_from_bytes(envelope.content))
        return "250 OK"

    def __enter__(self) -> Mailbox:
        from aiosmtpd.controller import Controller

        self.controller = Controller(self, hostname="127.0.0.1", port=self.port)
        self.controller.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.controller.stop()

    def subjects(self) -> list[str]:
        with self._lock:
            return [str(m["Subject"]) for m in self.messages]

    def bodies(self) -> list[str]:
        with self._lock:
            return [m.get_payload(decode=True).decode(errors="replace") if not m.is_multipart()
                    else m.get_payload(0).get_payload(decode=True).decode(errors="replace")
                    for m in self.messages]


class ArtemisDaemon:
    """``with ArtemisDaemon(cluster, policy=…) as d: d.incidents()``."""

    def __init__(self, cluster: SlurmCluster, conf: str = "", mailbox: Mailbox | None = None,
                 name: str = "artemisd", port: int | None = None, env: dict[str, str] | None = None):
        # name, port: a second instance (issue 12) beside the one the nodes report to;
        # env: what it runs with instead of the cluster's (e.g. another PATH).
        self.cluster = cluster
        self.name = name
        self.port = port if port is not None else cluster.artemis_port
        self.env = env if env is not None else cluster.env
        self.dir = cluster.dir / name
        self.conf_path = self.dir / "artemis.conf"
        self.extra_conf = conf
        self.mailbox = mailbox
        self.daemon: Daemon | None = None

    @property
    def url(self) -> str:
        return f"http://{self.cluster.artemis_listen[0]}:{self.port}"

    def write_conf(self, extra: str | None = None) -> None:
        host, port = self.cluster.artemis_listen[0], self.port
        mail = (f"MailRelay=127.0.0.1:{self.mailbox.port}\nMailTo=hpc-admins@example.org\n"
                if self.mailbox else "")
        self.conf_path.write_text(textwrap.dedent(f"""\
            # artemisd of the test cluster {self.cluster.name}
            Listen={host}:{port}
            StateDir={self.dir}/state
            AuthType=munge
            MungeSocket={self.cluster.munge_socket}
            SlurmUser=root
            """) + mail + (self.extra_conf if extra is None else extra))

    def __enter__(self) -> ArtemisDaemon:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "state").mkdir(exist_ok=True)
        self.write_conf()
        self.daemon = spawn(self.name, [sys.executable, "-m", "artemisd.server", "-c",
                                        str(self.conf_path)],
                            self.dir / "artemisd.log", env=self.env)
        try:
            wait_until(self._healthy, "artemisd to answer /v1/health", timeout_s=60,
                       daemon=self.daemon)
        except BaseException:
            self.stop()
            raise
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/health", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as reply:
            return json.loads(reply.read())

    def state_db(self) -> sqlite3.Connection:
        """The daemon's SQLite state, opened read-only (the caller closes it)."""
        return sqlite3.connect(f"file:{self.dir / 'state' / 'artemis.db'}?mode=ro", uri=True, timeout=10)

    def records_of(self, job: str) -> int:
        """How many reports of ``job`` the daemon stored (read from its SQLite state, read-only)."""
        with closing(self.state_db()) as db:
            return int(db.execute(f"SELECT {RECORD_COUNT} FROM records WHERE job = ?", (job,)).fetchone()[0])

    def window_records(self, job: str) -> list[dict[str, Any]]:
        """``job``'s stored window reports in stored order: a trace ``artemis replay`` reads."""
        with closing(self.state_db()) as db:
            return window_bodies(db.execute(JOB_WINDOW_ROWS, (job,)))

    def node_evidence(self, node: str) -> tuple[float, dict[str, Any]] | None:
        """(received, body) of the latest root-side node event the daemon keeps for ``node``."""
        with closing(self.state_db()) as db:
            row = db.execute("SELECT received, body FROM node_evidence WHERE node = ?", (node,)).fetchone()
        return (row[0], json.loads(row[1])) if row else None

    def wait_node_check(self, node: str, shows: Callable[[dict[str, Any]], bool], timeout_s: float = 30.0) -> None:
        """Until the cluster's own node check on ``node`` (its events carry GPU uuids) reports what ``shows``.

        The node check runs every few seconds as root; a run that read the GPU
        before a fault was injected can still arrive after it, replacing any
        evidence sent by hand.  Once a run that saw the fault is in, every later
        one sees it too.
        """
        def seen() -> bool:
            latest = self.node_evidence(node)
            gpus = (latest[1].get("gpus") or []) if latest else []
            return bool(gpus) and all(g.get("uuid") for g in gpus) and shows(latest[1])
        wait_until(seen, f"the node check on {node} to report the fault", timeout_s=timeout_s, interval_s=0.25,
                   daemon=self.daemon)

    def incidents(self, job: str | None = None, everything: bool = False) -> list[dict[str, Any]]:
        """``artemis incidents --json`` (the CLI), one incident per line."""
        argv = [sys.executable, "-m", "artemisd.cli", "incidents", "--json", "--server", self.url]
        if everything:
            argv.append("--all")
        if job:
            argv += ["--job", job]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=self.cluster.env)
        if done.returncode != 0:
            raise ClusterError(f"artemis incidents failed ({done.returncode}): {done.stderr.strip()}")
        return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]

    def explain(self, incident_id: str, limit: int = 20000, last_windows: int = 40) -> str:
        """One incident as the API gives it (numbers, actions, audit trail) and its job's last windows,
        one line each (ranks' busy / step ms): a failed assertion's message."""
        body = json.dumps(self.get(f"/v1/incidents/{incident_id}"), indent=1, default=str)[:limit]
        by_window: dict[tuple[Any, Any], list[str]] = {}
        for w in self.get(f"/v1/incidents/{incident_id}/windows")["windows"]:
            cell = f"r{w['rank']}@{w['node']} {_ms(w['busy'])}/{_ms(w['step'])}"
            by_window.setdefault((w["t0"] or 0.0, w["seq"]), []).append(cell)
        lines = [f"t0={t0:.2f} seq={seq}: " + "  ".join(cells)
                 for (t0, seq), cells in sorted(by_window.items(), key=lambda kv: kv[0][0])[-last_windows:]]
        return body + "\nwindows (busy/step ms per rank):\n" + "\n".join(lines)

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.dir / "artemisd.log", lines)

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def wipe_state(self) -> None:
        shutil.rmtree(self.dir / "state", ignore_errors=True)
