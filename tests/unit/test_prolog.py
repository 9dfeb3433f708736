"""Prolog/Epilog: the programs slurmd runs, exercised with slurmd's environment and a loopback daemon."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from artemisd.wire import NodeEvent, parse_record
from tests.cluster.recorder import RecordingDaemon

REPO = Path(__file__).resolve().parents[2]
PROLOG = REPO / "prolog_epilog" / "artemis-prolog"
EPILOG = REPO / "prolog_epilog" / "artemis-epilog"

GPU_FILE = {"vendor": "nvidia", "model": "Emulated GPU", "driver": "550.54.15",
            "gpus": {"0": {"sm_clock_mhz": 1410, "max_sm_clock_mhz": 1980, "power_w": 300,
                           "power_limit_w": 500, "default_power_limit_w": 700, "temp_c": 83,
                           "util_pct": 95, "throttle": ["sw_thermal", "sw_power_cap"]},
                     "1": {"sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980, "temp_c": 40,
                           "throttle": []}}}


def write_conf(tmp_path: Path, endpoint: str, extra: str = "AuthType=none\n") -> Path:
    conf = tmp_path / "node.conf"
    conf.write_text(f"Endpoint={endpoint}\nTimeoutSeconds=3\nStateDir={tmp_path}/state\n{extra}")
    return conf


def slurmd_env(tmp_path: Path, conf: Path, opted: str | None = "on", **more: str) -> dict[str, str]:
    """The environment slurmd 22.05 gives a Prolog (design.md §5), plus our config path."""
    gpus = tmp_path / "gpus"
    gpus.mkdir(exist_ok=True)
    (gpus / "n2.json").write_text(json.dumps(GPU_FILE))
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "4242", "SLURM_JOB_UID": "0",
           "SLURM_NODELIST": "n[1-4]", "SLURMD_NODENAME": "n2",
           "ARTEMIS_NODE_CONF": str(conf), "PYTHONPATH": str(REPO),
           "ARTEMIS_TELEMETRY": "emulated", "ARTEMIS_EMULATED_GPU_DIR": str(gpus)}
    if opted is not None:
        env["SPANK_ARTEMIS"] = opted
    env.update(more)
    return env


def run_hook(program: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(program)], env=env, capture_output=True,
                          text=True, timeout=60)


def test_prolog_reports_job_start_with_fingerprint_and_gpus(tmp_path: Path) -> None:
    with RecordingDaemon() as daemon:
        done = run_hook(PROLOG, slurmd_env(tmp_path, write_conf(tmp_path, daemon.endpoint)))
    assert done.returncode == 0, done.stderr
    (record,) = daemon.recorder.reports()
    event = parse_record(record)
    assert isinstance(event, NodeEvent)
    assert (event.event, event.job, event.node) == ("job_start", "4242", "n2")
    assert event.fingerprint is not None
    assert event.fingerprint.kernel == os.uname().release
    assert event.fingerprint.driver == "550.54.15"
    assert event.gpus is not None and [g.index for g in event.gpus] == [0, 1]
    assert event.gpus[0].sm_clock_mhz == 1410 and event.gpus[0].power_limit_w == 500
    assert set(event.gpus[0].throttle or ()) == {"sw_thermal", "sw_power_cap"}


def test_epilog_reports_job_end(tmp_path: Path) -> None:
    with RecordingDaemon() as daemon:
        done = run_hook(EPILOG, slurmd_env(tmp_path, write_conf(tmp_path, daemon.endpoint)))
    assert done.returncode == 0, done.stderr
    assert [r["event"] for r in daemon.recorder.reports()] == ["job_end"]


@pytest.mark.parametrize("opted", [None, "off"])
def test_jobs_without_artemis_on_send_nothing(tmp_path: Path, opted: str | None) -> None:
    with RecordingDaemon() as daemon:
        done = run_hook(PROLOG, slurmd_env(tmp_path, write_conf(tmp_path, daemon.endpoint), opted))
    assert done.returncode == 0
    assert daemon.recorder.requests == []


def test_daemon_down_still_exits_zero(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))  # bound, not listening: connection refused
        port = holder.getsockname()[1]
        done = run_hook(PROLOG, slurmd_env(tmp_path, write_conf(tmp_path, f"http://127.0.0.1:{port}")))
    assert done.returncode == 0
    assert "refused" in done.stderr.lower()


def test_hung_daemon_hits_the_hard_timeout_and_exits_zero(tmp_path: Path) -> None:
    with RecordingDaemon() as daemon:
        daemon.recorder.stalled = True
        done = run_hook(PROLOG, slurmd_env(tmp_path, write_conf(tmp_path, daemon.endpoint)))
    assert done.returncode == 0
    assert "timed out" in done.stderr or "hard timeout" in done.stderr


def test_busy_daemon_is_retried_after_its_retry_after(tmp_path: Path) -> None:
    with RecordingDaemon() as daemon:
        daemon.recorder.busy, daemon.recorder.retry_after = 2, "1"
        conf = write_conf(tmp_path, daemon.endpoint, "AuthType=none\nTimeoutSeconds=10\n")
        done = run_hook(PROLOG, slurmd_env(tmp_path, conf))
    assert done.returncode == 0, done.stderr
    posts = [r for r in daemon.recorder.requests if r.path == "/v1/reports"]
    assert len(posts) == 3 and [r["event"] for r in daemon.recorder.reports()] == ["job_start"] * 3
    assert len({r.body for r in posts}) == 1  # the same event, resent
    gaps = [b.at - a.at for a, b in zip(posts, posts[1:])]
    assert all(gap >= 1.0 for gap in gaps), gaps  # Retry-After honoured, never hammered


def test_daemon_busy_past_the_timeout_gives_up_cleanly_before_it(tmp_path: Path) -> None:
    with RecordingDaemon() as daemon:
        daemon.recorder.busy, daemon.recorder.retry_after = 1000, "1"
        done = run_hook(PROLOG, slurmd_env(tmp_path, write_conf(tmp_path, daemon.endpoint)))  # TimeoutSeconds=3
    assert done.returncode == 0
    assert "HTTP 503" in done.stderr and "hard timeout" not in done.stderr
    assert 2 <= len(daemon.recorder.requests) <= 3


def test_an_endpoint_list_goes_past_a_dead_daemon_and_a_standby(tmp_path: Path) -> None:
    with socket.socket() as holder, RecordingDaemon() as standby, RecordingDaemon() as leader:
        holder.bind(("127.0.0.1", 0))  # bound, not listening: connection refused
        standby.recorder.busy, standby.recorder.retry_after = 1000, "5"  # a standby answers every POST 503
        endpoints = f"http://127.0.0.1:{holder.getsockname()[1]},{standby.endpoint},{leader.endpoint}"
        done = run_hook(PROLOG, slurmd_env(tmp_path, write_conf(tmp_path, endpoints)))
    assert done.returncode == 0, done.stderr
    assert [r["event"] for r in leader.recorder.reports()] == ["job_start"]
    assert len(standby.recorder.requests) == 1  # asked once and passed on at once, no Retry-After waited


def test_bad_node_conf_is_named_and_harmless(tmp_path: Path) -> None:
    conf = tmp_path / "node.conf"
    conf.write_text("Endpoint=http://127.0.0.1:9\nTimeoutSecnds=3\n")
    done = run_hook(PROLOG, slurmd_env(tmp_path, conf))
    assert done.returncode == 0
    assert f"{conf}:2: TimeoutSecnds: unknown key" in done.stderr


def test_file_endpoint_appends_a_trace(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    done = run_hook(PROLOG, slurmd_env(tmp_path, write_conf(tmp_path, f"file:{trace}")))
    assert done.returncode == 0, done.stderr
    (line,) = trace.read_text().splitlines()
    assert parse_record(json.loads(line)).event == "job_start"


def test_munge_credential_binds_method_path_and_body(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("runs a private munged")
    from tests.cluster.munge import Munged

    with Munged() as munged, RecordingDaemon() as daemon:
        conf = write_conf(tmp_path, daemon.endpoint, f"AuthType=munge\nMungeSocket={munged.socket}\n")
        done = run_hook(PROLOG, slurmd_env(tmp_path, conf))
        assert done.returncode == 0, done.stderr
        (req,) = daemon.recorder.requests
        scheme, credential = req.headers["Authorization"].split(" ", 1)
        decoded = munged.decode(credential)
    assert scheme == "Munge" and decoded.returncode == 0
    # Bound to this one request: method, path as sent and body (artemisd/auth.py).
    payload = decoded.stdout.split("\n\n", 1)[1]
    assert (req.method, req.path) == ("POST", "/v1/reports")
    assert payload == f"artemis-request-v2 POST /v1/reports {hashlib.sha256(req.body).hexdigest()}"


def test_hard_timeout_is_disarmed_once_the_work_is_done():
    # Python gives SIGALRM back its default action while it shuts down: an
    # alarm still armed then kills the Prolog with signal 14 and slurmd drains
    # the node.  After guarded() returns, no alarm may be pending.
    script = (f"import sys, time; sys.path.insert(0, {str(REPO / 'prolog_epilog')!r})\n"
              "from artemis_node import arm_hard_timeout, guarded\n"
              "guarded('t', lambda: arm_hard_timeout('t', 0.3))\n"
              "time.sleep(0.6); print('alive'); sys.exit(3)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout.strip()) == (3, "alive"), done.stderr
