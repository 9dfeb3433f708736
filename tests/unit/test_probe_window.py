"""Step accounting and window aggregation of the probe (no ranks needed)."""

from __future__ import annotations

import time

import pytest

from artemisd.wire import parse_record
from torch_hook.config import ConfigError, ProbeConfig
from torch_hook.probe import config_fingerprint, directive_hash, parse_shares
from torch_hook.window import StepRecorder


def _report(fields: dict) -> dict:
    return {"type": "window", "v": 1, "job": "1", "rank": 0, "world": 1, "node": "n1", **fields}


def test_windows_align_on_step_index_and_satisfy_the_contract():
    rec = StepRecorder(window_steps=3)
    assert rec.end_step() is None  # the first boundary only starts the clock
    closed = []
    for i in range(7):
        rec.comm("all_reduce", "world", 1024, 1, wait_ms=1.0, coll_ms=2.0)
        rec.data(0.5, samples=8)
        time.sleep(0.004)
        window = rec.end_step()
        if window:
            closed.append(window)
    assert [(w.seq, w.first_step, len(w.step_ms)) for w in closed] == [(0, 0, 3), (1, 3, 3)]
    fields = closed[1].report_fields()
    report = parse_record(_report(fields))
    assert report.ms.comm_wait == pytest.approx(1.0) and report.ms.data == pytest.approx(0.5)
    assert report.ms.busy == pytest.approx(report.ms.step - 1.0, abs=1e-3)
    assert report.ms.compute == pytest.approx(report.ms.busy - 0.5, abs=1e-3)
    assert report.samples == 24
    assert fields["collectives"] == [{"op": "all_reduce", "group": "world", "calls": 3, "bytes": 3072.0, "ms": 6.0}]


def test_explicit_samples_take_precedence_over_loader_batches():
    rec = StepRecorder(window_steps=2)
    rec.end_step()
    rec.data(0.1, samples=32)
    rec.add_samples(5)
    rec.data(0.1, samples=32)  # ignored from now on
    rec.end_step()
    rec.add_samples(7)
    window = rec.end_step()
    assert window.report_fields()["samples"] == 12.0


def test_unmeasured_samples_are_absent_not_zero():
    rec = StepRecorder(window_steps=1)
    rec.end_step()
    assert "samples" not in rec.end_step().report_fields()


def test_comm_never_exceeds_step():
    rec = StepRecorder(window_steps=1)
    rec.end_step()
    rec.comm("barrier", "world", 0, 1, wait_ms=10_000.0, coll_ms=10_000.0)
    fields = rec.end_step().report_fields()
    assert fields["ms"]["busy"] == 0.0 and fields["ms"]["comm_wait"] == fields["ms"]["step"]
    parse_record(_report(fields))


def test_device_spans_park_the_window_until_resolved():
    rec = StepRecorder(window_steps=1)
    rec.end_step()
    ready = {"done": False}
    rec.comm_pending("all_reduce", "world", 64, 1, lambda: (3.0, 4.0) if ready["done"] else None)
    time.sleep(0.005)  # the step outlasts the 3 ms span
    assert rec.finished(rec.end_step()) == []  # still pending: parked, not reported
    second = rec.end_step()
    assert rec.finished(second) == []  # order is kept behind the parked one
    ready["done"] = True
    out = rec.finished(None)
    assert [w.seq for w in out] == [0, 1]
    fields = out[0].report_fields()
    assert fields["ms"]["comm_wait"] == pytest.approx(3.0)
    assert fields["collectives"][0]["ms"] == 4.0


def test_agreed_shorter_windows():
    rec = StepRecorder(window_steps=4)
    rec.end_step()
    rec.next_window_steps(2)
    sizes = []
    for _ in range(8):
        w = rec.end_step()
        if w:
            sizes.append((w.first_step, len(w.step_ms)))
    assert sizes == [(0, 4), (4, 2), (6, 2)]


def test_config_from_env_and_errors():
    cfg = ProbeConfig.from_env({"SLURM_JOB_ID": "77", "SLURMD_NODENAME": "n3", "ARTEMIS_WINDOW_STEPS": "20",
                                "ARTEMIS_ENDPOINT": "file:/tmp/x.jsonl"})
    assert (cfg.job, cfg.node, cfg.window_steps, cfg.job_step) == ("77", "n3", 20, "0")
    assert ProbeConfig.from_env({"ARTEMIS_JOB_ID": "a", "SLURM_JOB_ID": "b"}).job == "a"
    with pytest.raises(ConfigError, match="ARTEMIS_WINDOW_STEPS='0'"):
        ProbeConfig.from_env({"ARTEMIS_WINDOW_STEPS": "0"})
    with pytest.raises(ConfigError, match="ARTEMIS_ENDPOINT"):
        ProbeConfig.from_env({"ARTEMIS_ENDPOINT": "tcp://x"})
    with pytest.raises(ConfigError, match="ARTEMIS_WINDOW_SECONDS"):
        ProbeConfig.from_env({"ARTEMIS_WINDOW_SECONDS": "soon"})


def test_directive_helpers():
    assert directive_hash("PRB-1") == directive_hash("PRB-1") > 0
    assert directive_hash("PRB-1") != directive_hash("PRB-2")
    assert parse_shares({"2": 0.8, "0": "1.5"}) == {2: 0.8, 0: 1.5}
    assert parse_shares({}) == {}
    for bad in ({"x": 1}, {"1": 0}, {"1": "nan"}, {"-1": 1}, [1]):
        assert parse_shares(bad) is None
    a = config_fingerprint({"NCCL_IB_HCA": "mlx5", "HOME": "/root"})
    assert a == config_fingerprint({"NCCL_IB_HCA": "mlx5"}) != config_fingerprint({"NCCL_IB_HCA": "mlx4"})
