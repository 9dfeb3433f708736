"""The real ``artemisd`` process and the ``artemis`` admin commands against it.

artemisd runs as a subprocess on a free loopback port (AuthType=none) with its
SQLite file in tmp; no Slurm is configured here, so its Slurm calls fail and
decisions wait — which is what these tests need: incidents stay put while we
kill -9 the daemon, restart it, reload its config and read it with the CLI.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from artemisd.cli import main as artemis
from tests.unit.windows import lockstep

NODES = [f"n{r // 2}" for r in range(8)]
HEALTHY = [50.0] * 8
SLOW = [62.0 if r == 2 else 50.0 for r in range(8)]
SLOW_GPU = {2: {"sm_clock_mhz": 1300, "throttle": ["applications_clocks"]}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Artemisd:
    def __init__(self, tmp: Path, extra: str = ""):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.conf = tmp / "artemis.conf"
        self.conf.write_text(f"Listen=127.0.0.1:{self.port}\nAuthType=none\nStateDir={tmp / 'state'}\n"
                             f"SlurmTimeout=5\n{extra}")
        self.log = tmp / "artemisd.log"
        self.proc: subprocess.Popen | None = None
        self.options: list[str] = []

    def start(self) -> Artemisd:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = "/nonexistent/slurm.conf"  # no cluster: Slurm calls fail fast
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "artemisd.server", "--config", str(self.conf),
                                          *self.options], stdout=log, stderr=log, env=env)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if self.get("/v1/health")["ok"]:
                    return self
            except OSError:
                time.sleep(0.1)
            assert self.proc.poll() is None, self.log.read_text()
        raise AssertionError(f"artemisd did not come up:\n{self.log.read_text()}")

    def get(self, path: str):
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as resp:
            return json.loads(resp.read())

    def post(self, items: list) -> dict:
        body = json.dumps([r.model_dump(mode="json", exclude_none=True) for r in items]).encode()
        req = urllib.request.Request(f"{self.url}/v1/reports", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


@pytest.fixture
def daemon(tmp_path):
    d = Artemisd(tmp_path)
    yield d.start()
    d.stop()


def feed(d: Artemisd, seqs: range, busy, **kw) -> None:
    for seq in seqs:
        d.post(lockstep(seq, busy, nodes=NODES, **kw))


def test_incident_survives_kill_9_without_duplicates(daemon, capsys):
    feed(daemon, range(0, 8), HEALTHY)
    feed(daemon, range(8, 11), SLOW, gpu=SLOW_GPU)
    [before] = daemon.get("/v1/incidents")["incidents"]
    assert before["state"] == "confirmed" and before["cause"] == "gpu.clocks"
    daemon.kill9()
    daemon.start()
    [after] = daemon.get("/v1/incidents")["incidents"]
    assert after == before
    feed(daemon, range(11, 14), SLOW, gpu=SLOW_GPU)  # the same straggler keeps going
    incidents = daemon.get("/v1/incidents?all=1")["incidents"]
    assert [i["id"] for i in incidents] == [before["id"]]
    assert artemis(["incidents", "--json", "--server", daemon.url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(x)["id"] for x in lines] == [before["id"]]


def test_admin_commands_and_plot(daemon, tmp_path, capsys):
    feed(daemon, range(0, 8), HEALTHY)
    feed(daemon, range(8, 11), SLOW, gpu=SLOW_GPU)
    [inc] = daemon.get("/v1/incidents")["incidents"]
    assert artemis(["status", "--server", daemon.url]) == 0
    out = capsys.readouterr().out
    assert "auth=none" in out and "1 confirmed" in out
    assert "role: leader\n" in out and " leader " in out.split("role: leader", 1)[1]  # its own instance row
    assert artemis(["incidents", "--server", daemon.url]) == 0
    out = capsys.readouterr().out
    assert inc["id"] in out and "gpu.clocks" in out
    png = tmp_path / "timeline.png"
    assert artemis(["show", inc["id"], "--server", daemon.url, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "audit:" in out and "confirmed" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # Nothing awaits approval: a clear error, exit status 1.
    assert artemis(["approve", inc["id"], "--config", str(daemon.conf)]) == 1
    assert "no action waiting for approval" in capsys.readouterr().err
    assert artemis(["show", "INC-999", "--server", daemon.url]) == 1
    assert "404" in capsys.readouterr().err


def test_sighup_reload_keeps_old_config_on_error(daemon):
    assert daemon.get("/v1/status")["dry_run"] is False
    good = daemon.conf.read_text()
    daemon.conf.write_text(good + "DryRun=yes\nPartitionPolicy=gpu Auto=reboot\n")
    daemon.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 15
    while "config reload failed" not in daemon.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    logged = [json.loads(x) for x in daemon.log.read_text().splitlines() if "config reload failed" in x]
    assert logged and logged[0]["line"] == len(good.splitlines()) + 2 and logged[0]["key"] == "Auto"
    assert daemon.get("/v1/status")["dry_run"] is False
    daemon.conf.write_text(good + "DryRun=yes\n")
    daemon.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 15
    while not daemon.get("/v1/status")["dry_run"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert daemon.get("/v1/status")["dry_run"] is True


def test_listen_given_as_an_option_wins_over_the_files_and_stays_through_a_reload(tmp_path):
    """Several instances on one host share one artemis.conf, each with its own ``--listen``
    (artemisd@HOST:PORT.service): the option's address is served, the file's is not, and a
    SIGHUP re-reads the file without moving the instance."""
    d = Artemisd(tmp_path)
    in_file = d.port
    d.port = free_port()
    d.url = f"http://127.0.0.1:{d.port}"
    d.options = ["--listen", f"127.0.0.1:{d.port}"]
    try:
        d.start()
        assert d.get("/v1/status")["instance"].endswith(f":127.0.0.1:{d.port}")
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{in_file}/v1/health", timeout=2)
        d.conf.write_text(d.conf.read_text() + "DryRun=yes\n")
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while not d.get("/v1/status")["dry_run"] and time.monotonic() < deadline:
            time.sleep(0.1)
        status = d.get("/v1/status")
        assert status["dry_run"] is True and status["instance"].endswith(f":127.0.0.1:{d.port}")
    finally:
        d.stop()
    bad = subprocess.run([sys.executable, "-m", "artemisd.server", "--config", str(d.conf), "--listen", "7600"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "command line: Listen: bad value '7600'" in bad.stderr


def test_config_check_command(tmp_path, capsys):
    conf = tmp_path / "a.conf"
    conf.write_text("DryRun=yes\n\nPartitionPolicy=gpu Auto=drain MaxDrainFraction=1.5\n")
    assert artemis(["config", "check", str(conf)]) == 1
    assert f"{conf}:3: MaxDrainFraction" in capsys.readouterr().err
    conf.write_text("DryRun=yes\nPartitionPolicy=gpu Auto=drain\n")
    assert artemis(["config", "check", str(conf)]) == 0
    assert "DRY RUN" in capsys.readouterr().out


def test_metrics_endpoint(daemon):
    feed(daemon, range(0, 2), HEALTHY)
    with urllib.request.urlopen(f"{daemon.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'artemis_reports_total{outcome="accepted"} 16.0' in text


# --- credentials bound to their request (issue 27, item 6) ----------------------------------------



def test_the_cli_signs_every_request_for_itself(munged):
    """Writes and reads alike (a read signs the empty body), each for its own method and path."""
    from artemisd.auth import request_payload
    from artemisd.cli.admin import Client, ClientError
    from tests.cluster.recorder import RecordingDaemon

    with RecordingDaemon() as recorder:
        client = Client(recorder.endpoint + "/", str(munged.socket), sign=True)
        client.request("POST", "/v1/incidents/INC-7/deny")
        with pytest.raises(ClientError, match="404"):  # the recorder serves no incidents; the request went out
            client.request("GET", "/v1/incidents?all=1")
        requests = list(recorder.recorder.requests)
    assert [(r.method, r.path, r.body) for r in requests] == [("POST", "/v1/incidents/INC-7/deny", b""),
                                                               ("GET", "/v1/incidents?all=1", b"")]
    for req in requests:
        scheme, credential = req.headers["Authorization"].split(" ", 1)
        decoded = munged.decode(credential)
        assert scheme == "Munge" and decoded.returncode == 0, decoded.stderr
        assert decoded.stdout.split("\n\n", 1)[1] == request_payload(req.method, req.path, b"")


def test_a_read_goes_unsigned_where_no_credential_can_be_made_and_a_write_fails(tmp_path):
    from artemisd.cli.admin import Client, ClientError
    from tests.cluster.recorder import RecordingDaemon

    with RecordingDaemon() as recorder:
        client = Client(recorder.endpoint, str(tmp_path / "no-munged.socket"), sign=True)
        with pytest.raises(ClientError, match="munge"):
            client.request("POST", "/v1/incidents/INC-7/approve")
        with pytest.raises(ClientError, match="404"):
            client.request("GET", "/v1/nodes/n1")
        requests = list(recorder.recorder.requests)
    assert [(r.method, r.path, "Authorization" in r.headers) for r in requests] == [("GET", "/v1/nodes/n1", False)]


def test_the_cli_against_a_daemon_that_checks_munge_credentials(tmp_path, munged, capsys):
    d = Artemisd(tmp_path)
    d.conf.write_text(d.conf.read_text().replace("AuthType=none\n", f"AuthType=munge\nMungeSocket={munged.socket}\n"))
    d.start()
    try:
        assert artemis(["status", "--config", str(d.conf)]) == 0
        assert "auth=munge" in capsys.readouterr().out
        # root is an admin: the credential passed, and the daemon looked the incident up.
        assert artemis(["deny", "INC-424242", "--config", str(d.conf)]) == 1
        err = capsys.readouterr().err
        assert "404" in err and "no incident INC-424242" in err
    finally:
        d.stop()
