"""A matched probe's evidence reads for or against the cause named, never as support it is not."""

from __future__ import annotations

import numpy as np

from artemisd.confirm import ProbeJudgement, ProbeVerdict
from artemisd.frame import WindowFrame
from artemisd.incident import Evidence
from artemisd.localize import diagnose_straggler
from tests.unit.windows import lockstep

BUSY = [50.0, 50.0, 80.0, 50.0]
HOT = {2: {"sm_clock_mhz": 1230, "temp_c": 93, "throttle": ["hw_thermal", "sw_thermal"]}}
AT_PEER_SPEED = Evidence(signal="probe.gemm_ms", value=10.1, peers=10.0, note="identical GEMM runs at peer speed")


def diagnose(probe: ProbeJudgement | None):
    frame = WindowFrame.from_reports(lockstep(0, BUSY, gpu=HOT))
    return diagnose_straggler(frame, np.array([2]), np.array([0, 1, 3]), 0.5, probe=probe)


def test_a_probe_at_peer_speed_is_shown_against_a_gpu_cause_the_telemetry_keeps():
    diagnosis = diagnose(ProbeJudgement(ProbeVerdict.NORMAL, (AT_PEER_SPEED,)))
    assert diagnosis.cause.value == "gpu.thermal"
    [line] = [e for e in diagnosis.evidence if e.signal == "probe.gemm_ms"]
    assert line.note.startswith("identical GEMM runs at peer speed: speaks against gpu.thermal")


def test_a_slow_probe_gemm_stays_support_for_the_device():
    slow = Evidence(signal="probe.gemm_ms", value=14.0, peers=10.0,
                    note="identical GEMM is slower on the suspect: the device")
    diagnosis = diagnose(ProbeJudgement(ProbeVerdict.DEVICE, (slow,)))
    assert diagnosis.cause.value == "gpu.thermal"
    [line] = [e for e in diagnosis.evidence if e.signal == "probe.gemm_ms"]
    assert line.note == slow.note
