"""artemis-nodecheck: corrections applied as root (emulated GPUs), health and probe events."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from artemisd.wire import parse_record
from tests.cluster.recorder import RecordingDaemon

REPO = Path(__file__).resolve().parents[2]
NODECHECK = REPO / "prolog_epilog" / "artemis-nodecheck"
sys.path.insert(0, str(REPO / "prolog_epilog"))

import artemis_node  # noqa: E402
import corrections  # noqa: E402


def gpu_file(tmp_path: Path, **gpu0: object) -> Path:
    entry = {"sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980, "power_w": 300,
             "power_limit_w": 700, "default_power_limit_w": 700, "temp_c": 40,
             "util_pct": 95, "throttle": []}
    entry.update(gpu0)
    path = tmp_path / "gpus" / "n3.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"vendor": "nvidia", "model": "Emulated GPU", "driver": "550.54.15",
                                "gpus": {"0": entry, "1": dict(entry, sm_clock_mhz=1980,
                                                               power_limit_w=700, throttle=[])}}))
    return path


def run_check(tmp_path: Path, endpoint: str, *args: str, probe: bool = False,
              auth: str = "AuthType=none") -> subprocess.CompletedProcess[str]:
    conf = tmp_path / "node.conf"
    conf.write_text(f"Endpoint={endpoint}\n{auth}\nTimeoutSeconds=20\n"
                    f"StateDir={tmp_path}/state\nNodeProbe={'yes' if probe else 'no'}\n"
                    f"Telemetry=emulated\nEmulatedGpuDir={tmp_path}/gpus\n")
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "ARTEMIS_NODE_CONF": str(conf),
           "SLURMD_NODENAME": "n3"}
    return subprocess.run([sys.executable, str(NODECHECK), *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_queued_corrections_are_applied_acknowledged_and_seen_in_health(tmp_path: Path) -> None:
    path = gpu_file(tmp_path, sm_clock_mhz=1200, power_limit_w=350, throttle=["sw_power_cap"])
    with RecordingDaemon() as daemon:
        daemon.recorder.corrections["n3"] = [
            {"id": "COR-1", "incident": "INC-7", "kind": "restore_power_limit", "gpu": 0},
            {"id": "COR-2", "incident": "INC-7", "kind": "reflash_firmware", "gpu": None},
        ]
        done = run_check(tmp_path, daemon.endpoint)
    assert done.returncode == 0, done.stderr
    acks = daemon.recorder.acks()
    assert acks["COR-1"]["status"] == "done" and "700 W" in acks["COR-1"]["detail"]
    assert acks["COR-2"] == {"status": "failed", "detail": acks["COR-2"]["detail"]}
    assert "unsupported correction kind 'reflash_firmware'" in acks["COR-2"]["detail"]
    gpu0 = json.loads(path.read_text())["gpus"]["0"]
    assert (gpu0["power_limit_w"], gpu0["sm_clock_mhz"], gpu0["throttle"]) == (700, 1980, [])
    # The health event comes after the corrections and shows their effect.
    paths = [r.path for r in daemon.recorder.requests]
    assert paths.index("/v1/reports") > max(i for i, p in enumerate(paths) if "COR-" in p)
    (health,) = [parse_record(r) for r in daemon.recorder.reports()]
    assert health.event == "health" and health.node == "n3" and health.job is None
    assert health.gpus is not None and health.gpus[0].power_limit_w == 700


def test_a_clock_reset_cannot_beat_a_thermal_throttle(tmp_path: Path) -> None:
    path = gpu_file(tmp_path, sm_clock_mhz=1100, temp_c=92, throttle=["hw_thermal"])
    corrector = corrections.EmulatedCorrector(path)
    detail = corrections.apply(corrector, {"id": "COR-3", "kind": "reset_clocks", "gpu": None})
    assert "still held down by hw_thermal" in detail
    data = json.loads(path.read_text())["gpus"]
    assert data["0"]["sm_clock_mhz"] == 1100  # reset "done", but the GPU is still hot
    assert data["1"]["sm_clock_mhz"] == 1980


def test_clocks_pinned_low_come_back_after_a_reset(tmp_path: Path) -> None:
    path = gpu_file(tmp_path, sm_clock_mhz=900, throttle=["applications_clocks"])
    corrections.apply(corrections.EmulatedCorrector(path), {"kind": "reset_clocks", "gpu": 0})
    gpu0 = json.loads(path.read_text())["gpus"]["0"]
    assert (gpu0["sm_clock_mhz"], gpu0["throttle"]) == (1980, [])


@pytest.mark.parametrize("gpu", [-1, "0", True])
def test_bad_gpu_index_is_refused(tmp_path: Path, gpu: object) -> None:
    corrector = corrections.EmulatedCorrector(gpu_file(tmp_path))
    with pytest.raises(corrections.CorrectionError, match="gpu must be"):
        corrections.apply(corrector, {"kind": "reset_clocks", "gpu": gpu})


def test_probe_event_follows_a_fingerprint_change_only(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    gpu_file(tmp_path)
    with RecordingDaemon() as daemon:
        first = run_check(tmp_path, daemon.endpoint, probe=True)
        second = run_check(tmp_path, daemon.endpoint, probe=True)
        data = json.loads((tmp_path / "gpus" / "n3.json").read_text())
        data["driver"] = "555.42.02"  # a driver update between two passes
        (tmp_path / "gpus" / "n3.json").write_text(json.dumps(data))
        third = run_check(tmp_path, daemon.endpoint, probe=True)
    assert first.returncode == second.returncode == third.returncode == 0
    events = [parse_record(r) for r in daemon.recorder.reports()]
    assert [e.event for e in events] == ["health", "probe", "health", "health", "probe"]
    probe = events[-1]
    assert probe.fingerprint.driver == "555.42.02"
    assert probe.probe is not None and len(probe.probe.gemm_tflops) == 1
    assert probe.probe.gemm_tflops[0] > 0 and probe.probe.membw_gbs[0] > 0


def test_dry_run_prints_and_sends_nothing(tmp_path: Path) -> None:
    gpu_file(tmp_path)
    with RecordingDaemon() as daemon:
        daemon.recorder.corrections["n3"] = [{"id": "COR-9", "kind": "reset_clocks", "gpu": 0}]
        done = run_check(tmp_path, daemon.endpoint, "--dry-run")
    assert done.returncode == 0, done.stderr
    assert daemon.recorder.requests == []
    assert json.loads(done.stdout.splitlines()[0])["event"] == "health"
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("line, message", [
    ("TimeoutSeconds=0", "TimeoutSeconds: expected 0 < seconds"),
    ("Endpoint=artemisd:7600", "Endpoint: expected http://HOST:PORT"),
    ("AuthType=kerberos", "AuthType: expected munge or none"),
    ('Telemetry="nvml', "cannot parse"),
    ("Endpoint", "Endpoint: expected Key=Value"),
])
def test_node_conf_errors_name_file_line_and_key(tmp_path: Path, line: str, message: str) -> None:
    conf = tmp_path / "node.conf"
    conf.write_text(f"# Artemis node settings\n{line}\n")
    with pytest.raises(artemis_node.NodeConfError) as err:
        artemis_node.load_config({"ARTEMIS_NODE_CONF": str(conf)})
    assert str(err.value).startswith(f"{conf}:2")
    assert message in str(err.value)


def test_environment_overrides_node_conf(tmp_path: Path) -> None:
    conf = tmp_path / "node.conf"
    conf.write_text("endpoint=http://a:1 mungesocket=/x TimeoutSeconds=4\n")
    cfg = artemis_node.load_config({"ARTEMIS_NODE_CONF": str(conf), "ARTEMIS_ENDPOINT": "http://b:2"})
    assert (cfg.endpoint, cfg.munge_socket, cfg.timeout_s) == ("http://b:2", "/x", 4.0)


def test_comm_lib_version_reads_the_newest_soname(tmp_path: Path) -> None:
    for name in ("libnccl.so.2", "libnccl.so.2.18.1", "libnccl.so.2.21.5"):
        (tmp_path / name).write_bytes(b"")
    assert artemis_node.comm_lib_version([str(tmp_path)]) == "nccl 2.21.5"



def test_every_request_of_the_node_check_is_signed_for_itself(tmp_path: Path, munged) -> None:
    """GET corrections, each acknowledgement and the health event: each credential names its own
    method, path and body, so root's credential for one is refused on any other (issue 27, item 6)."""
    gpu_file(tmp_path, sm_clock_mhz=1200, power_limit_w=350, throttle=["sw_power_cap"])
    with RecordingDaemon() as daemon:
        daemon.recorder.corrections["n3"] = [{"id": "COR-1", "incident": "INC-7", "kind": "restore_power_limit",
                                              "gpu": 0}]
        # What is signed is the request-target as sent: Endpoint's trailing slash is not in it.
        done = run_check(tmp_path, f"{daemon.endpoint}/", auth=f"AuthType=munge\nMungeSocket={munged.socket}")
        assert done.returncode == 0, done.stderr
        requests = list(daemon.recorder.requests)
    seen = [(r.method, r.path) for r in requests]
    assert ("GET", "/v1/nodes/n3/corrections") in seen and ("POST", "/v1/nodes/n3/corrections/COR-1") in seen
    assert ("POST", "/v1/reports") in seen
    for req in requests:
        scheme, credential = req.headers["Authorization"].split(" ", 1)
        decoded = munged.decode(credential)
        assert scheme == "Munge" and decoded.returncode == 0, decoded.stderr
        assert decoded.stdout.split("\n\n", 1)[1] == artemis_node.request_payload(req.method, req.path, req.body)


def test_without_torch_hook_the_munge_command_signs_the_same_payload(munged, monkeypatch) -> None:
    cfg = artemis_node.NodeConfig(endpoint="http://127.0.0.1:1", munge_socket=str(munged.socket), auth="munge")
    for probe_module in (True, False):
        if not probe_module:
            monkeypatch.setattr(artemis_node, "import_probe_module", lambda name: None)
        credential = artemis_node._credential(cfg, "GET", "/v1/nodes/n3/corrections", b"")
        decoded = munged.decode(credential)
        assert decoded.returncode == 0 and decoded.stdout.split("\n\n", 1)[1] == \
            "artemis-request-v2 GET /v1/nodes/n3/corrections " + \
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
