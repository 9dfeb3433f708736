"""AMD telemetry through AMD SMI (the ``amdsmi`` Python package), mapped onto
the same wire ``gpu`` block and throttle vocabulary as NVML.

As in ``nvml.py``, ``read_raw`` gathers AMD SMI's values as returned and
``gpu_block`` maps them; the mapping is tested with recorded values.

Throttle reasons come from the SMU's independent throttler bitmask
(``indep_throttle_status`` in the GPU metrics table, Linux
``drivers/gpu/drm/amd/pm/inc/amdgpu_smu.h`` ``SMU_THROTTLER_*_BIT``), which is
the same on every ASIC; AMD has no idle, sync-boost or application-clock
reasons, so those names never appear for AMD.
"""

from __future__ import annotations

import threading
from typing import Any

from torch_hook.telemetry import TelemetryUnavailable, attempt

# SMU_THROTTLER_* bit ranges -> contract vocabulary.
#   0-7   PPT0..3, SPL, FPPT, SPPT, SPPT_APU: firmware power limits -> sw_power_cap
#   16-23 TDC_GFX/SOC/MEM/VDD/CVIP, EDC_CPU/GFX, APCC: current/electrical limits -> hw_slowdown
#   32-43 TEMP_GPU/CORE/MEM/EDGE/HOTSPOT/SOC/VR_*/LIQUID*: firmware thermal -> sw_thermal
#   44-45 VRHOT0/1: voltage-regulator hot signal (hardware) -> hw_thermal
#   56-57 PROCHOT_CPU/GFX: external hardware slowdown line -> hw_slowdown
#   58    PPM (platform power management) -> hw_power_brake
#   59    FIT (reliability) -> not a reason the contract knows; ignored
_AMD_BITS: tuple[tuple[range, str], ...] = (
    (range(0, 8), "sw_power_cap"),
    (range(16, 24), "hw_slowdown"),
    (range(32, 44), "sw_thermal"),
    (range(44, 46), "hw_thermal"),
    (range(56, 58), "hw_slowdown"),
    (range(58, 59), "hw_power_brake"),
)
# Unsupported fields in the GPU metrics table read as all-ones.
_NA_SENTINELS = {0xFFFF, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF}


def throttle_reasons(mask: int) -> list[str]:
    """Contract names for an SMU independent-throttler bitmask, in vocabulary order."""
    found = {name for bits, name in _AMD_BITS if any(mask >> b & 1 for b in bits)}
    order = ("sw_power_cap", "hw_slowdown", "hw_thermal", "sw_thermal", "hw_power_brake")
    return [name for name in order if name in found]


def _number(value: Any) -> float | None:
    """AMD SMI reports unsupported values as "N/A" strings or all-ones sentinels."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, dict) and "value" in value:  # newer releases: {"value": v, "unit": u}
        value = value["value"]
    if isinstance(value, int | float):
        return None if value in _NA_SENTINELS else float(value)
    try:
        return float(str(value).split()[0])
    except (ValueError, IndexError):
        return None


def gpu_block(raw: dict[str, Any]) -> dict[str, Any]:
    """Map raw AMD SMI readings to the wire ``gpu`` block.

    ``raw`` keys, each optional: ``clock`` (``amdsmi_get_clock_info(GFX)`` dict),
    ``power`` (``amdsmi_get_power_info`` dict, watts), ``power_cap``
    (``amdsmi_get_power_cap_info`` dict, microwatts), ``temp_c``, ``activity``
    (``amdsmi_get_gpu_activity`` dict), ``metrics``
    (``amdsmi_get_gpu_metrics_info`` dict), ``ecc`` (``amdsmi_get_gpu_total_ecc_count``
    dict), ``pcie_replay``.
    """
    out: dict[str, Any] = {}
    clock = raw.get("clock") or {}
    cur = _number(clock.get("clk", clock.get("cur_clk")))
    if cur is not None:
        out["sm_clock_mhz"] = cur
    top = _number(clock.get("max_clk"))
    if top is not None:
        out["max_sm_clock_mhz"] = top
    power = raw.get("power") or {}
    watts = _number(power.get("current_socket_power"))
    if watts is None:
        watts = _number(power.get("average_socket_power"))
    if watts is not None:
        out["power_w"] = watts
    cap = raw.get("power_cap") or {}
    for src, dst in (("power_cap", "power_limit_w"), ("default_power_cap", "default_power_limit_w")):
        micro = _number(cap.get(src))
        if micro is not None:
            out[dst] = round(micro / 1e6, 3)
    temp = _number(raw.get("temp_c"))
    if temp is not None:
        out["temp_c"] = temp
    util = _number((raw.get("activity") or {}).get("gfx_activity"))
    if util is not None:
        out["util_pct"] = min(100.0, max(0.0, util))
    metrics = raw.get("metrics") or {}
    mask = metrics.get("indep_throttle_status")
    if isinstance(mask, int) and mask not in _NA_SENTINELS:
        out["throttle"] = throttle_reasons(mask)
    ecc = _number((raw.get("ecc") or {}).get("uncorrectable_count"))
    if ecc is not None:
        out["ecc_uncorrected"] = int(ecc)
    replay = _number(raw.get("pcie_replay"))
    if replay is not None:
        out["pcie_replay"] = int(replay)
    return out


class AmdSmiBackend:
    """AMD SMI, initialised once per process; each query guarded on its own."""

    name = "amdsmi"
    _lock = threading.Lock()

    def __init__(self, smi: Any):
        self._smi = smi
        self._handles: list[Any] | None = None

    @classmethod
    def open(cls) -> AmdSmiBackend:
        try:
            import amdsmi
        except ImportError as err:
            raise TelemetryUnavailable(f"amdsmi not importable: {err}") from None
        try:
            with cls._lock:
                flags = getattr(getattr(amdsmi, "AmdSmiInitFlags", None), "INIT_AMD_GPUS", None)
                amdsmi.amdsmi_init(flags) if flags is not None else amdsmi.amdsmi_init()
        except Exception as err:  # AmdSmiLibraryException: no driver, no device
            raise TelemetryUnavailable(f"amdsmi_init failed: {err}") from None
        backend = cls(amdsmi)
        if backend.count() == 0:
            backend.close()
            raise TelemetryUnavailable("amdsmi sees no AMD GPU")
        return backend

    def _all(self) -> list[Any]:
        if self._handles is None:
            self._handles = list(attempt(self._smi.amdsmi_get_processor_handles) or [])
        return self._handles

    def _handle(self, index: int) -> Any:
        handles = self._all()
        return handles[index] if 0 <= index < len(handles) else None

    def count(self) -> int:
        return len(self._all())

    def driver(self) -> str | None:
        handle = self._handle(0)
        info = attempt(lambda: self._smi.amdsmi_get_gpu_driver_info(handle)) if handle is not None else None
        version = (info or {}).get("driver_version")
        return str(version) if version else None

    def device(self, index: int) -> dict[str, Any] | None:
        handle = self._handle(index)
        if handle is None:
            return None
        asic = attempt(lambda: self._smi.amdsmi_get_gpu_asic_info(handle)) or {}
        uuid = attempt(lambda: self._smi.amdsmi_get_gpu_device_uuid(handle))
        out: dict[str, Any] = {"vendor": "amd", "model": str(asic.get("market_name") or "AMD GPU"), "index": index}
        if uuid:
            out["uuid"] = str(uuid)
        return out

    def read_raw(self, index: int) -> dict[str, Any]:
        s = self._smi
        handle = self._handle(index)
        if handle is None:
            return {}

        def temperature() -> Any:
            # MI200/MI300 have no edge sensor; hotspot (junction) is what
            # NVML's "GPU temperature" corresponds to on those parts.
            for sensor in ("EDGE", "HOTSPOT"):
                value = attempt(lambda: s.amdsmi_get_temp_metric(
                    handle, getattr(s.AmdSmiTemperatureType, sensor), s.AmdSmiTemperatureMetric.CURRENT))
                if _number(value) is not None:
                    return value
            return None

        return {
            "clock": attempt(lambda: s.amdsmi_get_clock_info(handle, s.AmdSmiClkType.GFX)),
            "power": attempt(lambda: s.amdsmi_get_power_info(handle)),
            "power_cap": attempt(lambda: s.amdsmi_get_power_cap_info(handle)),
            "temp_c": temperature(),
            "activity": attempt(lambda: s.amdsmi_get_gpu_activity(handle)),
            "metrics": attempt(lambda: s.amdsmi_get_gpu_metrics_info(handle)),
            "ecc": attempt(lambda: s.amdsmi_get_gpu_total_ecc_count(handle)),
            "pcie_replay": attempt(lambda: s.amdsmi_get_gpu_pci_replay_counter(handle)),
        }

    def sample(self, index: int) -> dict[str, Any]:
        return gpu_block(self.read_raw(index))

    def close(self) -> None:
        self._handles = None
        try:
            with self._lock:
                self._smi.amdsmi_shut_down()
        except Exception:  # noqa: BLE001
            pass
