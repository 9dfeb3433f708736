"""Real 4-rank gloo DDP jobs with the probe installed; no fakes of torch.

Each job plays several scenarios in a row (switched by step index) so the
suite pays the cost of starting ranks only a few times.  Assertions are on
ratios with generous margins: the 2 cores are shared with other work.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from artemisd.replay import replay_records
from artemisd.wire import WindowReport, parse_record
from tests.probe.launch import ROOT, run_job

pytestmark = [pytest.mark.probe, pytest.mark.timeout(240)]

W = 10
# windows 0-4 healthy (a baseline for replay), 5-11 rank 2 slow, 12-13 rank 1's
# loader stalls, 14 explicit collectives
PHASES = {"steps": 151, "slow_rank": 2, "slow": [50, 120], "slow_n": 320, "slow_reps": 24,
          "stall_rank": 1, "stall": [120, 140], "stall_s": 0.002, "collectives": [140, 150]}


def _reports(path: Path) -> list[WindowReport]:
    return [parse_record(json.loads(line), f"{path}:{i}") for i, line in enumerate(path.read_text().splitlines(), 1)]


def _by_seq(reports: list[WindowReport]) -> dict[int, dict[int, WindowReport]]:
    table: dict[int, dict[int, WindowReport]] = defaultdict(dict)
    for r in reports:
        table[r.window.seq][r.rank] = r
    return table


def _median(values: list[float]) -> float:
    return statistics.median(values)


@pytest.fixture(scope="module")
def phases(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[WindowReport]]:
    out = tmp_path_factory.mktemp("phases")
    trace = out / "trace.jsonl"
    results = run_job({**PHASES, "out": str(out)},
                      env={"ARTEMIS_ENDPOINT": f"file:{trace}", "ARTEMIS_WINDOW_STEPS": str(W)})
    return results, _reports(trace)


def test_reports_are_contract_valid_and_aligned(phases):
    results, reports = phases
    table = _by_seq(reports)
    assert len(table) == (PHASES["steps"] - 1) // W  # iteration 0 only starts the clock
    for seq, ranks in table.items():
        assert sorted(ranks) == [0, 1, 2, 3], f"window {seq} is missing ranks"
        spans = {(r.window.first_step, r.window.steps) for r in ranks.values()}
        assert spans == {(seq * W, W)}, f"window {seq} is not aligned across ranks: {spans}"
        for r in ranks.values():
            assert r.job == "4242" and r.world == 4 and r.dropped_reports == 0
            assert r.samples == 16 * W
            assert r.ms.busy + r.ms.comm_wait == pytest.approx(r.ms.step, abs=0.01)
            assert r.island and r.env and r.env.comm_lib == "gloo" and r.env.config.startswith("sha256:")
            assert r.host is not None and r.host.cpu_pct is not None
    assert all(res["stats"]["errors"] == 0 and res["stats"]["hook_errors"] == 0 for res in results)
    # DDP's gradient all-reduce is timed through the comm hook wrapper.
    ddp = [c for c in table[1][0].collectives if c.op == "all_reduce"]
    assert ddp and ddp[0].calls >= W and ddp[0].bytes > 0


def test_slow_rank_raises_its_busy_and_the_others_wait(phases):
    _, reports = phases
    table = _by_seq(reports)
    healthy, slow = [2, 3, 4], [6, 7, 8, 9, 10, 11]
    ratio = _median([table[s][2].ms.busy / _median([table[s][r].ms.busy for r in (0, 1, 3)]) for s in slow])
    assert ratio >= 1.3, f"rank 2 busy ratio {ratio:.2f} in the slow phase"
    for r in (0, 1, 3):
        before = _median([table[s][r].ms.comm_wait for s in healthy])
        during = _median([table[s][r].ms.comm_wait for s in slow])
        assert during > before, f"rank {r} comm_wait did not rise: {before:.2f} -> {during:.2f}"
        busy = _median([table[s][r].ms.busy for s in slow])
        assert busy * 1.3 <= _median([table[s][2].ms.busy for s in slow])
    # The slow rank waits least: the others wait for it.
    assert _median([table[s][2].ms.comm_wait for s in slow]) < _median(
        [table[s][r].ms.comm_wait for s in slow for r in (0, 1, 3)])


def test_data_loader_stall_shows_in_data(phases):
    _, reports = phases
    table = _by_seq(reports)
    for s in (12, 13):
        stalled = table[s][1].ms.data
        others = max(table[s][r].ms.data for r in (0, 2, 3))
        # 16 samples x 2 ms of sleep per batch on rank 1
        assert stalled >= 20.0 and stalled >= 4 * others, (s, stalled, others)
        assert table[s][1].ms.compute < stalled


def test_plain_collectives_are_timed(phases):
    _, reports = phases
    ops = {(c.op, c.group): c for c in _by_seq(reports)[14][0].collectives}
    for op in ("all_gather_into_tensor", "broadcast", "barrier"):
        assert ops[(op, "world")].calls == W, op
        assert ops[(op, "world")].ms > 0
    assert ops[("all_gather_into_tensor", "world")].bytes == W * 4 * (1 << 14) * 4
    # DDP buckets + one blocking and one async all_reduce per step
    assert ops[("all_reduce", "world")].calls == 3 * W


def test_replay_finds_the_slow_rank(phases):
    _, reports = phases
    incidents = replay_records(reports)
    summary = [(i.kind, i.rank, i.node, i.cause) for i in incidents]
    assert any(i.rank == 2 or i.node == "n2" for i in incidents), summary
    assert not any(i.rank in (0, 3) or i.node in ("n0", "n3") for i in incidents), summary


class _Daemon(BaseHTTPRequestHandler):
    """A stand-in artemisd on 127.0.0.1; ``mode`` decides how it answers."""

    mode = "directives"
    bodies: list[list[dict]] = []
    headers_seen: list[str | None] = []
    lock = threading.Lock()

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.lock:
            n = len(self.bodies)
            self.bodies.append(json.loads(body))
            self.headers_seen.append(self.headers.get("Authorization"))
        if self.mode == "hostile":
            kind = n % 3
            if kind == 0:
                time.sleep(3.0)  # slower than ARTEMIS_HTTP_TIMEOUT
            if kind in (0, 1):
                payload = b"\x00garbage{{"
            else:
                self.send_response(500)
                self.end_headers()
                return
        else:
            payload = json.dumps({"accepted": 1, "rejected": [], "directives": [
                {"type": "probe", "id": "PRB-7", "job": "4242", "step": "0"},
                {"type": "rebalance", "id": "RBL-3", "job": "4242", "step": "0", "shares": {"2": 0.5}},
                {"type": "probe", "id": "PRB-other-job", "job": "9999", "step": "0"},
            ]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def daemon():
    _Daemon.bodies, _Daemon.headers_seen = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Daemon)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def _directives_job(tmp_path: Path, port: int, env: dict[str, str]) -> list[dict]:
    """The autoloaded probe in a 4-rank job with a sampler, fed the stand-in's directives: each rank
    ran the probe directive once and applied the rebalance.  Returns the ranks' results."""
    env = {"ARTEMIS_ENABLED": "1", "ARTEMIS_ENDPOINT": f"http://127.0.0.1:{port}", "ARTEMIS_WINDOW_STEPS": "8",
           "PYTHONPATH": f"{ROOT / 'torch_hook' / 'autoload'}:{ROOT}", **env}
    results = run_job({"out": str(tmp_path), "steps": 64, "install": False, "sampler": True, "samples": 512,
                       "batch": 8}, env=env)
    for res in results:
        stats = res["stats"]
        assert res["installed"] and stats["errors"] == 0, stats
        assert [p["id"] for p in stats["probes"]] == ["PRB-7"], "every rank runs the probe exactly once"
        assert stats["shares"] == {"2": 0.5}
    return results


def test_directives_run_matched_probe_and_rebalance_through_autoload(tmp_path, daemon):
    """Autoload (ARTEMIS_ENABLED + PYTHONPATH), HTTP reports, probe and rebalance directives."""
    _Daemon.mode = "directives"
    port = daemon.server_address[1]
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    for rank in range(4):  # the test cluster's emulated GPUs: n2's is thermally throttled
        clock, throttle = (1410, ["hw_thermal"]) if rank == 2 else (1980, [])
        (gpus / f"n{rank}.json").write_text(json.dumps({
            "vendor": "nvidia", "model": "Emulated GPU", "driver": "550.54.15",
            "gpus": {"0": {"sm_clock_mhz": clock, "max_sm_clock_mhz": 1980, "temp_c": 40, "throttle": throttle}}}))
    results = _directives_job(tmp_path, port, {"ARTEMIS_TELEMETRY": "emulated", "ARTEMIS_EMULATED_GPU_DIR": str(gpus)})
    reports = [parse_record(r) for body in _Daemon.bodies for r in body]
    probes = {r.rank: r.probe for r in reports if r.probe is not None}
    assert sorted(probes) == [0, 1, 2, 3]
    for rank, probe in probes.items():
        assert probe.id == "PRB-7" and probe.gemm_ms > 0 and probe.gemm_tflops > 0 and probe.allreduce_ms > 0
        assert [p.peer for p in probe.p2p] == [(rank + 1) % 4] and probe.cost_ms > 0
        # Each end's run-queue wait, which tells a preempted rank from a slow link (confirm.judge_probe).
        assert probe.p2p[0].wait_ms is not None and probe.served_wait_ms is not None
    # Shares are applied at an epoch start: rank 2 ends with a smaller batch,
    # and the four ranks still split the 32-sample global batch between them.
    last = [res["local_batches"][-1] for res in results]
    assert sum(last) == 32 and last[2] < last[0], last
    assert results[2]["share"] == 0.5 and results[0]["share"] == 1.0
    late = [r for r in reports if r.window.seq == max(x.window.seq for x in reports)]
    assert min(late, key=lambda r: r.samples).rank == 2
    # Emulated telemetry reaches the reports: device, island, GPU block, driver.
    for r in reports:
        assert r.island == "nvidia:Emulated GPU" and r.env.driver == "550.54.15"
        assert r.gpu.throttle == (("hw_thermal",) if r.rank == 2 else ())
        assert r.gpu.sm_clock_mhz == (1410 if r.rank == 2 else 1980)


def test_a_nodes_ranks_report_through_its_first_rank_and_all_get_the_directives(tmp_path, daemon):
    """Four ranks on one node: local rank 0's probe relays the others' reports (fewer requests,
    each of several ranks), and hands them the daemon's directives, which every rank runs once."""
    _Daemon.mode = "directives"
    results = _directives_job(tmp_path, daemon.server_address[1], {"ARTEMIS_NODE": "n0", "TMPDIR": str(tmp_path)})
    # (Each rank's stats are taken before its probe's last window is sent, at exit: counts, not totals.)
    relay, siblings = results[0]["stats"], [res["stats"] for res in results[1:]]
    assert relay["relayed"] > 0 and relay["relay_dropped"] == 0 and all(s["handed_over"] > 0 for s in siblings)
    reports = [parse_record(r) for body in _Daemon.bodies for r in body]
    assert sorted({r.rank for r in reports}) == [0, 1, 2, 3] and {r.node for r in reports} == {"n0"}
    windows = {r.window.seq for r in reports}
    assert len(reports) == 4 * len(windows), "no window of any rank lost or sent twice"
    assert len(_Daemon.bodies) < len(reports) / 2, f"{len(_Daemon.bodies)} requests for {len(reports)} reports"
    assert not list(tmp_path.glob("artemis-*/*")), "the ranks' sockets are gone once they exit"


def test_probe_survives_hostile_daemon_faults_and_reinstall(tmp_path, daemon):
    """A daemon that hangs, answers garbage or 500; exceptions inside the probe; uninstall/reinstall."""
    _Daemon.mode = "hostile"
    port = daemon.server_address[1]
    env = {"ARTEMIS_ENDPOINT": f"http://127.0.0.1:{port}", "ARTEMIS_WINDOW_STEPS": "5",
           "ARTEMIS_HTTP_TIMEOUT": "0.5", "ARTEMIS_QUEUE": "2"}
    results = run_job({"out": str(tmp_path), "steps": 60, "faults": [10, 30], "reinstall": 45}, env=env)
    digests = {round(r["digest"], 6) for r in results}
    assert len(digests) == 1, "training diverged across ranks"
    assert all(r["installed"] for r in results)
    assert sum(r["stats"]["dropped"] for r in results) > 0  # the hangs and 500s cost reports, nothing else
    # After the heal and the reinstall the probe still reports, numbering goes
    # on where it stopped, and the DDP model built under the first install is
    # timed by the second.
    assert all(r["stats"]["windows"] >= 2 for r in results)
    reports = [parse_record(r) for body in _Daemon.bodies for r in body]
    for rank in range(4):
        seqs = [r.window.seq for r in reports if r.rank == rank]
        assert len(seqs) == len(set(seqs)), f"rank {rank} sent a window seq twice: {seqs}"
    late = [r for r in reports if r.window.first_step >= 45]
    assert late and all(any(c.op == "all_reduce" and c.calls >= 5 for c in r.collectives) for r in late)


def test_probe_survives_no_daemon(tmp_path):
    # A port nothing listens on (bound, then closed).
    from tests.probe.launch import free_port

    env = {"ARTEMIS_ENDPOINT": f"http://127.0.0.1:{free_port()}", "ARTEMIS_WINDOW_STEPS": "5"}
    results = run_job({"out": str(tmp_path), "steps": 30}, world=2, env=env)
    for res in results:
        assert res["stats"]["dropped"] >= 1 and res["stats"]["sent"] == 0
        assert res["stats"]["errors"] == 0
    # Not silent: each rank's stderr says once that nobody watches it (not once per window).
    for rank in range(2):
        log = (tmp_path / f"rank{rank}.log").read_text()
        assert log.count("cannot reach the Artemis daemon") == 1, log
