"""The fleet simulator: lockstep invariants, fault signatures, determinism, fast path."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from pydantic import ValidationError

from artemisd.cli import main as cli_main
from artemisd.frame import THROTTLE_BIT, WindowFrame
from artemisd.sim import AMD_MI300X, NVIDIA_H100, FaultSpec, Fleet, FleetSpec, JobSpec, NoiseSpec, truth_path
from artemisd.sim.scenarios import change_pair
from artemisd.wire import NodeEvent, WindowReport, parse_record


def _job(world: int = 32, windows: int = 16, faults=(), **kw) -> JobSpec:
    islands = kw.pop("islands", (NVIDIA_H100.model_copy(update={"ranks": world}),))
    return JobSpec(job=kw.pop("job", "7"), islands=islands, windows=windows, faults=tuple(faults), **kw)


def _windows(spec: FleetSpec) -> tuple[dict[tuple[str, int], list[WindowReport]], list, dict]:
    """Parse every record through the wire contract; group window reports by (job, seq)."""
    fleet = Fleet(spec)
    parsed = [parse_record(r, f"record {i}") for i, r in enumerate(fleet.records())]
    by_window: dict[tuple[str, int], list[WindowReport]] = {}
    for r in parsed:
        if isinstance(r, WindowReport):
            by_window.setdefault((r.job, r.window.seq), []).append(r)
    for reports in by_window.values():
        reports.sort(key=lambda r: r.rank)
    return by_window, parsed, fleet.truth()


def _busy_ratio(reports: list[WindowReport], rank: int) -> float:
    busy = np.array([r.ms.busy for r in reports])
    return float(busy[rank] / np.median(busy))


def _step(windows, seqs, job: str = "7") -> float:
    """Median step time over some windows (one window can hold a GC pause or a spike)."""
    return float(np.median([windows[(job, w)][0].ms.step for w in seqs]))


QUIET = NoiseSpec(gc_rate=0, spike_rate=0, comm_spike_rate=0)  # no transients: signatures only


def _one(cause: str, seed: int = 3, **fault) -> tuple[dict, list, dict]:
    fault.setdefault("onset", 6)
    fault.setdefault("magnitude", 0.2)
    return _windows(FleetSpec(seed=seed, jobs=(_job(faults=[FaultSpec(cause=cause, **fault)], noise=QUIET),)))


def test_records_follow_the_wire_contract_and_lockstep():
    windows, parsed, _ = _windows(FleetSpec(seed=1, jobs=(_job(world=24, ranks_per_node=4),)))
    assert len(windows) == 16 and all(len(w) == 24 for w in windows.values())
    events = [r for r in parsed if isinstance(r, NodeEvent)]
    assert [e.event for e in events].count("job_start") == 6 and [e.event for e in events].count("job_end") == 6
    assert isinstance(parsed[0], NodeEvent) and parsed[0].event == "job_start"
    for reports in windows.values():
        step = {r.ms.step for r in reports}
        assert len(step) == 1, "lockstep: every rank sees the same step time"
        for r in reports:
            assert r.ms.busy + r.ms.comm_wait == pytest.approx(r.ms.step, abs=2e-3)
            assert r.ms.compute + r.ms.data == pytest.approx(r.ms.busy, abs=2e-3)
        # The slowest rank waits least; nobody waits a negative time.
        slowest = max(reports, key=lambda r: r.ms.busy)
        assert slowest.ms.comm_wait == min(r.ms.comm_wait for r in reports) and slowest.ms.comm_wait >= 0
    arrival = [r.window.t1 for r in parsed if isinstance(r, WindowReport)]
    assert arrival == sorted(arrival), "reports arrive window by window"


def test_same_seed_same_trace_other_seed_other_trace(tmp_path):
    spec = FleetSpec(seed=9, jobs=(_job(windows=6, faults=[FaultSpec(cause="gpu.thermal", onset=2)]),))
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    Fleet(spec).write(a)
    Fleet(spec).write(b)
    Fleet(spec.model_copy(update={"seed": 10})).write(c)
    assert a.read_bytes() == b.read_bytes()
    assert truth_path(a).read_text() == truth_path(b).read_text()
    assert a.read_bytes() != c.read_bytes()


@pytest.mark.parametrize("cause", ["gpu.thermal", "gpu.power", "gpu.clocks"])
def test_gpu_faults_slow_one_rank_with_matching_telemetry(cause):
    windows, _, truth = _one(cause, rank=5)
    (fault,) = truth["faults"]
    assert (fault["kind"], fault["rank"], fault["cause"]) == ("rank", 5, cause)
    before, during = windows[("7", 5)], windows[("7", 10)]
    assert _busy_ratio(before, 5) == pytest.approx(1.0, abs=0.02)
    assert _busy_ratio(during, 5) == pytest.approx(1.2, abs=0.03)
    gpu, peer = during[5].gpu, during[6].gpu
    assert gpu.sm_clock_mhz < 0.9 * peer.sm_clock_mhz
    if cause == "gpu.thermal":
        assert set(gpu.throttle) & {"sw_thermal", "hw_thermal"} and gpu.temp_c > 85
    elif cause == "gpu.power":
        assert "sw_power_cap" in gpu.throttle and gpu.power_limit_w < gpu.default_power_limit_w
        assert gpu.power_w <= gpu.power_limit_w
    else:
        assert gpu.throttle == () and gpu.power_limit_w == gpu.default_power_limit_w
    assert before[5].gpu.sm_clock_mhz > 0.9 * gpu.max_sm_clock_mhz


def test_host_cpu_slows_the_ranks_of_one_node_and_shows_on_its_host():
    windows, _, truth = _one("host.cpu", node=2, variant="contention")
    (fault,) = truth["faults"]
    assert fault["kind"] == "node" and fault["ranks"] == list(range(16, 24)) and fault["node"] == "n00002"
    during, before = windows[("7", 10)], windows[("7", 0)]
    for r in range(16, 24):
        assert _busy_ratio(during, r) == pytest.approx(1.2, abs=0.03)
        # Contended: runnable, and getting a smaller CPU share than before.
        assert during[r].host.cpu_pct < 0.8 * before[r].host.cpu_pct
        assert during[r].host.ctx_invol_per_s > 5 * during[0].host.ctx_invol_per_s


def test_input_faults_show_as_data_time():
    windows, _, _ = _one("input.loader", rank=3)
    during = windows[("7", 10)]
    assert during[3].ms.data > 50 * during[4].ms.data / 4  # ~ +0.2 x 424 ms on ~4 ms
    assert during[3].ms.compute == pytest.approx(during[4].ms.compute, rel=0.03)
    windows, _, truth = _one("input.storage", node=1, node_ranks=3)
    (fault,) = truth["faults"]
    assert len(fault["ranks"]) == 3 and all(8 <= r < 16 for r in fault["ranks"])
    during = windows[("7", 10)]
    assert during[fault["ranks"][0]].host.iowait_pct > 5 and during[0].host.iowait_pct < 2


def test_link_fault_slows_everyone_without_a_straggler():
    windows, _, truth = _one("comm.link", node=3)
    (fault,) = truth["faults"]
    assert fault["kind"] == "link" and fault["link"] == "n00003:uplink"
    during = windows[("7", 10)]
    assert _step(windows, range(8, 16)) / _step(windows, range(6)) == pytest.approx(1.2, abs=0.03)
    busy = np.array([r.ms.busy for r in during])
    assert busy.max() / np.median(busy) < 1.02, "no rank's own work slowed"
    retrans = {r.node: r.host.net_retransmits_per_s for r in during}
    assert retrans["n00003"] > 100 and max(v for n, v in retrans.items() if n != "n00003") < 5


def test_link_fault_probe_block_points_at_the_node():
    spec = FleetSpec(seed=2, jobs=(_job(faults=[FaultSpec(cause="comm.link", node=1, onset=5)], probe_after=2),))
    windows, _, _ = _windows(spec)
    assert all(r.probe is None for r in windows[("7", 6)])
    probed = windows[("7", 7)]
    slow = [r for r in probed if r.probe.p2p[0].ms > 2 * 3.0]
    assert slow and all(r.node == "n00001" or r.probe.p2p[0].node == "n00001" for r in slow)
    assert max(r.probe.gemm_ms for r in probed) < 1.08 * min(r.probe.gemm_ms for r in probed)


def test_island_fault_slows_that_islands_collectives():
    nv, amd = NVIDIA_H100.model_copy(update={"ranks": 16}), AMD_MI300X.model_copy(update={"ranks": 16})
    job = _job(islands=(nv, amd), faults=[FaultSpec(cause="comm.island", island="nvidia", onset=6)])
    windows, _, _ = _windows(FleetSpec(seed=4, jobs=(job,)))
    before, during = windows[("7", 4)], windows[("7", 10)]
    assert {r.island for r in before} == {"nvidia", "amd"}
    amd_busy = np.median([r.ms.busy for r in before if r.island == "amd"])
    nv_busy = np.median([r.ms.busy for r in before if r.island == "nvidia"])
    assert amd_busy > 1.04 * nv_busy, "islands run at different speeds"

    def group_ms(reports, group):
        return np.median([c.ms / c.calls for r in reports for c in r.collectives if c.group == group])

    assert group_ms(during, "nvidia") > 2 * group_ms(before, "nvidia")
    assert group_ms(during, "amd") == pytest.approx(group_ms(before, "amd"), rel=0.2)
    assert _step(windows, range(8, 16)) / _step(windows, range(6)) == pytest.approx(1.2, abs=0.03)


def test_change_pair_runs_slower_under_a_new_fingerprint():
    ref = _job(job="1", windows=8, first_node=0)
    new = change_pair(ref, "change.driver", 0.15, "2")
    windows, parsed, truth = _windows(FleetSpec(seed=5, jobs=(ref, new)))
    (fault,) = truth["faults"]
    assert (fault["job"], fault["kind"], fault["onset_window"]) == ("2", "change", 0)
    old, slow = windows[("1", 4)], windows[("2", 4)]
    assert {r.node for r in old} == {r.node for r in slow}, "same machines, upgraded"
    assert old[0].env.driver != slow[0].env.driver and old[0].env.config == slow[0].env.config
    assert _step(windows, range(8), "2") / _step(windows, range(8), "1") == pytest.approx(1.15, abs=0.03)
    starts = {e.job: e.fingerprint.driver for e in parsed if isinstance(e, NodeEvent) and e.event == "job_start"}
    assert starts == {"1": old[0].env.driver, "2": slow[0].env.driver}
    ends = [e.time for e in parsed if isinstance(e, NodeEvent) and e.job == "1" and e.event == "job_end"]
    assert max(ends) < min(r.window.t0 for r in slow), "the new job starts after the old one ended"


def test_healthy_slow_gpus_are_slow_for_good_and_in_the_truth():
    spec = FleetSpec(seed=6, jobs=(_job(windows=10, noise=NoiseSpec(healthy_slow=2)),))
    windows, _, truth = _windows(spec)
    slow = truth["healthy_slow"]
    assert len(slow) == 2 and truth["faults"] == []
    for entry in slow:
        assert 1.02 <= entry["ratio"] <= 1.03
        ratios = [_busy_ratio(windows[("7", w)], entry["rank"]) for w in range(10)]
        assert np.median(ratios) == pytest.approx(entry["ratio"], abs=0.006)


def test_variable_length_noise_spreads_busy_more_than_dense():
    def spread(step_noise: float) -> float:
        spec = FleetSpec(seed=8, jobs=(_job(world=64, windows=4, noise=NoiseSpec(step=step_noise, gc_rate=0,
                                                                                   spike_rate=0, gpu_spread=0)),))
        windows, _, _ = _windows(spec)
        busy = np.array([r.ms.busy for r in windows[("7", 2)]])
        p50 = np.array([r.ms_p50["busy"] for r in windows[("7", 2)]])
        return float(np.std(busy / np.median(busy))), float(np.median(busy - p50))

    (dense, _), (varlen, _) = spread(0.015), spread(0.07)
    # Window means over 50 steps: sd ~ noise / sqrt(50).
    assert dense == pytest.approx(0.015 / 50**0.5, rel=0.5)
    assert varlen == pytest.approx(0.07 / 50**0.5, rel=0.5)


def test_patterns_intermittent_and_ramp():
    windows, _, truth = _one("gpu.thermal", rank=1, pattern="ramp", ramp_windows=6, onset=4)
    ratios = [_busy_ratio(windows[("7", w)], 1) for w in range(4, 12)]
    assert all(b >= a - 0.01 for a, b in zip(ratios, ratios[1:])), ratios
    assert ratios[0] < 1.05 and ratios[-1] == pytest.approx(1.2, abs=0.03)
    assert truth["faults"][0]["visible_window"] > 4
    windows, _, truth = _one("gpu.thermal", rank=1, pattern="intermittent", duty=0.5, burst_steps=20, onset=2)
    ratios = np.array([_busy_ratio(windows[("7", w)], 1) for w in range(2, 16)])
    assert truth["faults"][0]["effective_magnitude"] == pytest.approx(0.1)
    assert ratios.min() < 1.08 < ratios.max(), "bursts come and go"
    assert np.mean(ratios) == pytest.approx(1.1, abs=0.05)


def test_transients_are_recorded_but_are_not_faults():
    noise = NoiseSpec(gc_rate=1 / 500, spike_rate=0.05, comm_spike_rate=0.5, checkpoint_every=4)
    windows, _, truth = _windows(FleetSpec(seed=12, jobs=(_job(windows=9, noise=noise),)))
    kinds = {t["kind"] for t in truth["transients"]}
    assert kinds == {"gc", "spike", "comm_spike", "checkpoint"} and truth["faults"] == []
    checkpoint = [t["window"] for t in truth["transients"] if t["kind"] == "checkpoint"]
    assert checkpoint == [4, 8]
    assert _step(windows, [4]) > 1.05 * _step(windows, [1, 2, 3, 5, 6, 7])
    spike = next(t for t in truth["transients"] if t["kind"] == "spike" and t["rise"] > 0.05)
    assert _busy_ratio(windows[("7", spike["window"])], spike["rank"]) > 1.03


def test_duration_ends_the_fault():
    windows, _, truth = _one("input.loader", rank=2, onset=4, duration=5)
    assert truth["faults"][0]["end_window"] == 8
    assert _busy_ratio(windows[("7", 8)], 2) > 1.15 and _busy_ratio(windows[("7", 9)], 2) < 1.03


def test_fast_path_frames_equal_frames_built_from_reports():
    nv, amd = NVIDIA_H100.model_copy(update={"ranks": 16}), AMD_MI300X.model_copy(update={"ranks": 8})
    job = _job(islands=(nv, amd), windows=4, faults=[FaultSpec(cause="gpu.power", rank=3, onset=1)])
    spec = FleetSpec(seed=11, jobs=(job,))
    windows, _, _ = _windows(spec)
    for fast in Fleet(spec).frames("7"):
        slow = WindowFrame.from_reports(windows[("7", fast.seq)])
        for f in dataclasses.fields(WindowFrame):
            a, b = getattr(fast, f.name), getattr(slow, f.name)
            if isinstance(a, np.ndarray):
                np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3, err_msg=f.name)
            elif f.name == "telemetry":
                assert a.keys() == b.keys()
                for k in a:
                    np.testing.assert_allclose(a[k], b[k], rtol=2e-3, atol=0.06, err_msg=k)
            elif f.name == "collectives":
                assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], abs=2e-3) for k in a)
            elif f.name == "env":
                assert {k: (list(v[0]), v[1]) for k, v in a.items()} == {k: (list(v[0]), v[1]) for k, v in b.items()}
            else:
                assert a == b, f.name
    assert fast.throttle[3] & THROTTLE_BIT["sw_power_cap"]


def test_fast_path_reaches_100k_ranks_shape():
    # Only the shape: the cost benchmark times it.  Two windows keep this quick.
    job = _job(world=100_000, windows=2)
    frames = list(Fleet(FleetSpec(seed=0, jobs=(job,))).frames("7"))
    assert [f.size for f in frames] == [100_000, 100_000]
    assert len(frames[0].node_names) == 12_500 and np.isfinite(frames[1].busy).all()


def test_spec_errors_name_the_field():
    with pytest.raises(ValidationError, match=r"faults.0.rank: 40 is not below world 32"):
        _job(faults=[FaultSpec(cause="gpu.thermal", rank=40)])
    with pytest.raises(ValidationError, match="comm.island needs a job with two or more islands"):
        _job(faults=[FaultSpec(cause="comm.island")])
    with pytest.raises(ValidationError, match="onset"):
        FaultSpec(cause="change.driver", onset=3)
    with pytest.raises(ValidationError, match="job-wide"):
        FaultSpec(cause="comm.link", rank=1)


def test_cli_writes_trace_and_truth(tmp_path, capsys):
    trace = tmp_path / "run.jsonl"
    argv = ["sim", str(trace), "--world", "16", "--windows", "6", "--seed", "4", "--healthy-slow", "1",
            "--fault", "gpu.clocks:rank=3,onset=2,magnitude=0.3,pattern=ramp"]
    assert cli_main(argv) == 0
    assert "1 fault(s)" in capsys.readouterr().out
    lines = trace.read_text().splitlines()
    assert all(parse_record(json.loads(line)) for line in lines)
    truth = json.loads((tmp_path / "run.truth.json").read_text())
    assert truth["faults"][0]["rank"] == 3 and truth["faults"][0]["pattern"] == "ramp"
    assert len(truth["healthy_slow"]) == 1 and truth["spec"]["seed"] == 4
    first = trace.read_bytes()
    assert cli_main(argv) == 0 and trace.read_bytes() == first

    assert cli_main(["sim", str(trace), "--fault", "change.comm_lib:magnitude=0.1", "--windows", "5"]) == 0
    assert json.loads((tmp_path / "run.truth.json").read_text())["faults"][0]["job"] == "1001"

    assert cli_main(["sim", str(trace), "--world", "16", "--fault", "gpu.thermal:rank=99"]) == 2
    assert "faults.0.rank: 99 is not below world 16" in capsys.readouterr().err
    assert cli_main(["sim", str(trace), "--fault", "gpu.thermal:bogus=1"]) == 2
    assert "bogus" in capsys.readouterr().err
    spec = tmp_path / "fleet.json"
    spec.write_text('{"jobs": [{"job": "1", "islands": [{"ranks": 4}], "windows": 2, "ranks_per_node": 4}]}')
    assert cli_main(["sim", str(trace), "--spec", str(spec)]) == 0
    spec.write_text('{"jobs": [{"job": "1", "windows": 0}]}')
    assert cli_main(["sim", str(trace), "--spec", str(spec)]) == 2
    assert "jobs.0.windows" in capsys.readouterr().err
