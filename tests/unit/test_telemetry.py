"""Telemetry mapping with values recorded from real devices (no vendor library needed)."""

from __future__ import annotations

import json

import pytest

from artemisd.wire import GpuTelemetry, HostTelemetry
from torch_hook.telemetry import TelemetryUnavailable, open_backend
from torch_hook.telemetry import amdsmi as amd
from torch_hook.telemetry import emulated, host, nvml

# nvidia-smi -q on an H100 SXM held at its power cap, and one in HW thermal slowdown.
NVML_H100_POWER_CAPPED = {"sm_clock": 1410, "max_sm_clock": 1980, "power_mw": 699_412,
                          "enforced_limit_mw": 700_000, "default_limit_mw": 700_000, "temp_c": 71,
                          "util_gpu": 100, "clock_event_mask": 0x4, "ecc_uncorrected_volatile": 0,
                          "pcie_replay": 0}
NVML_A100_THERMAL = {"sm_clock": 1095, "max_sm_clock": 1410, "power_mw": 251_000, "enforced_limit_mw": 250_000,
                     "default_limit_mw": 400_000, "temp_c": 89, "util_gpu": 97,
                     "clock_event_mask": 0x40 | 0x20 | 0x8, "ecc_uncorrected_volatile": None,
                     "pcie_replay": 3}
# amd-smi metric --json on an MI300X under a PPT (power) limit: indep_throttle_status bit 0.
AMD_MI300X_PPT = {
    "clock": {"clk": 1420, "min_clk": 500, "max_clk": 2100, "clk_locked": 0, "clk_deep_sleep": 0},
    "power": {"current_socket_power": 748, "average_socket_power": "N/A", "gfx_voltage": "N/A"},
    "power_cap": {"power_cap": 750_000_000, "default_power_cap": 750_000_000, "dpm_cap": 2100,
                  "min_power_cap": 0, "max_power_cap": 750_000_000},
    "temp_c": 78, "activity": {"gfx_activity": 100, "umc_activity": 41, "mm_activity": "N/A"},
    "metrics": {"throttle_status": "N/A", "indep_throttle_status": 1 << 0},
    "ecc": {"correctable_count": 2, "uncorrectable_count": 0}, "pcie_replay": 0,
}


def test_nvml_power_capped_block_is_contract_valid():
    block = nvml.gpu_block(NVML_H100_POWER_CAPPED)
    assert block == {"sm_clock_mhz": 1410.0, "max_sm_clock_mhz": 1980.0, "power_w": 699.412,
                     "power_limit_w": 700.0, "default_power_limit_w": 700.0, "temp_c": 71.0,
                     "util_pct": 100.0, "throttle": ["sw_power_cap"], "ecc_uncorrected": 0, "pcie_replay": 0}
    GpuTelemetry(**block)


def test_nvml_thermal_and_lowered_limit():
    block = nvml.gpu_block(NVML_A100_THERMAL)
    assert block["throttle"] == ["hw_slowdown", "sw_thermal", "hw_thermal"]
    assert block["power_limit_w"] < block["default_power_limit_w"]
    assert "ecc_uncorrected" not in block  # not supported = not measured, never 0
    GpuTelemetry(**block)


@pytest.mark.parametrize(("mask", "names"), [
    (0x0, []), (0x1, ["idle"]), (0x2, ["applications_clocks"]), (0x10, ["sync_boost"]),
    (0x80, ["hw_power_brake"]), (0x100, []), (0x1FF, ["idle", "applications_clocks", "sw_power_cap",
     "hw_slowdown", "sync_boost", "sw_thermal", "hw_thermal", "hw_power_brake"]),
])
def test_nvml_clock_event_bits(mask, names):
    assert nvml.throttle_reasons(mask) == names


def test_amd_block_maps_onto_the_same_vocabulary():
    block = amd.gpu_block(AMD_MI300X_PPT)
    assert block == {"sm_clock_mhz": 1420.0, "max_sm_clock_mhz": 2100.0, "power_w": 748.0,
                     "power_limit_w": 750.0, "default_power_limit_w": 750.0, "temp_c": 78.0,
                     "util_pct": 100.0, "throttle": ["sw_power_cap"], "ecc_uncorrected": 0, "pcie_replay": 0}
    GpuTelemetry(**block)


@pytest.mark.parametrize(("bits", "names"), [
    ([], []), ([4], ["sw_power_cap"]), ([16, 22], ["hw_slowdown"]), ([36], ["sw_thermal"]),
    ([44], ["hw_thermal"]), ([57], ["hw_slowdown"]), ([58], ["hw_power_brake"]), ([59], []),
    ([0, 35, 45], ["sw_power_cap", "hw_thermal", "sw_thermal"]),
])
def test_amd_throttler_bits(bits, names):
    assert amd.throttle_reasons(sum(1 << b for b in bits)) == names


def test_amd_unsupported_values_are_not_measured():
    block = amd.gpu_block({"clock": {"clk": 0xFFFFFFFF, "max_clk": "N/A"}, "power": {"current_socket_power": "N/A"},
                           "metrics": {"indep_throttle_status": 0xFFFFFFFFFFFFFFFF}, "temp_c": {"value": 55, "unit": "C"}})
    assert block == {"temp_c": 55.0}


def test_emulated_backend_reads_the_file_each_time(tmp_path, monkeypatch):
    monkeypatch.setenv("ARTEMIS_EMULATED_GPU_DIR", str(tmp_path))
    monkeypatch.delenv("ARTEMIS_TELEMETRY", raising=False)
    path = tmp_path / "n2.json"
    doc = {"vendor": "nvidia", "model": "Emulated GPU", "driver": "550.54.15",
           "gpus": {"0": {"sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980, "power_w": 300, "power_limit_w": 700,
                          "default_power_limit_w": 700, "temp_c": 40, "util_pct": 95, "throttle": []},
                    "1": {"sm_clock_mhz": 1980}}}
    path.write_text(json.dumps(doc))
    backend = open_backend(node="n2")
    assert isinstance(backend, emulated.EmulatedBackend)
    assert backend.device(2) == {"vendor": "nvidia", "model": "Emulated GPU", "index": 0}  # 2 % 2 gpus
    assert backend.driver() == "550.54.15"
    GpuTelemetry(**backend.sample(0))
    assert backend.sample(3) == {"sm_clock_mhz": 1980}  # missing fields = not measured
    doc["gpus"]["0"].update(sm_clock_mhz=1410, throttle=["hw_thermal", "bogus"])
    path.write_text(json.dumps(doc))
    assert backend.sample(0)["sm_clock_mhz"] == 1410
    assert backend.sample(0)["throttle"] == ["hw_thermal"]
    path.unlink()
    assert backend.sample(0) == {} and backend.device(0) is None


def test_backend_choice(monkeypatch):
    monkeypatch.delenv("ARTEMIS_EMULATED_GPU_DIR", raising=False)
    assert open_backend("none") is None
    with pytest.raises(ValueError, match="ARTEMIS_TELEMETRY"):
        open_backend("cuda")
    with pytest.raises(TelemetryUnavailable):
        open_backend("emulated")
    with pytest.raises(TelemetryUnavailable):
        open_backend("nvml")  # no NVIDIA driver on this machine


SNMP = """Ip: Forwarding DefaultTTL InReceives
Ip: 1 64 1000
Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors
Tcp: 1 200 120000 -1 500 20 3 7 12 90000 85000 1234 0 44 0
Udp: InDatagrams NoPorts
Udp: 5 6
"""


def test_host_parsers_and_rates():
    assert host.parse_snmp_retrans(SNMP) == 1234
    assert host.parse_snmp_retrans("Ip: a\nIp: 1\n") is None
    total, steal, iowait = host.parse_proc_stat_cpu("cpu  100 0 50 800 30 0 0 20 5 0\ncpu0 1 2 3\n")
    tick = host._CLK_TCK
    assert (total, steal, iowait) == (1000 / tick, 20 / tick, 30 / tick)
    cpu, invol = host.parse_proc_self("42 (python3 x) S 1 " + " ".join(["0"] * 9) + " 300 100 0",
                                      "Name:\tpython3\nnonvoluntary_ctxt_switches:\t17\n")
    assert (cpu, invol) == (400 / tick, 17)
    a = host.HostCounters(10.0, 1.0, 100, 1000.0, 10.0, 5.0, 50)
    b = host.HostCounters(12.0, 2.5, 140, 1100.0, 12.0, 6.0, 70)
    block = host.host_block(a, b)
    assert block == {"cpu_pct": 75.0, "ctx_invol_per_s": 20.0, "steal_pct": 2.0, "iowait_pct": 1.0,
                     "net_retransmits_per_s": 10.0}
    HostTelemetry(**block)
    assert host.host_block(b, b) == {}


def test_run_queue_wait_is_a_rate_per_second_of_the_window():
    a = host.HostCounters(10.0, run_wait_ms=500.0)
    b = host.HostCounters(12.0, run_wait_ms=1300.0)
    assert host.host_block(a, b) == {"run_wait_ms_per_s": 400.0}
    # A thread that ended took its share with it: the window reads no wait, never a negative one.
    assert host.host_block(b, host.HostCounters(13.0, run_wait_ms=900.0)) == {"run_wait_ms_per_s": 0.0}
    assert host.host_block(a, host.HostCounters(12.0)) == {}


def test_host_sampler_reads_this_machine():
    sampler = host.HostSampler()
    sum(i * i for i in range(200_000))
    block = sampler.sample()
    HostTelemetry(**block)
    assert block["run_wait_ms_per_s"] >= 0.0  # /proc/<tid>/schedstat: every Linux with sched_info


def test_vocabulary_matches_the_wire_contract():
    from artemisd.wire import THROTTLE_REASONS
    from torch_hook.telemetry import THROTTLE_VOCABULARY

    assert THROTTLE_VOCABULARY == THROTTLE_REASONS
