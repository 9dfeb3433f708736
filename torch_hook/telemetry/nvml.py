"""NVIDIA telemetry through NVML (the ``pynvml`` module of nvidia-ml-py).

Gathering is split from mapping: ``NvmlBackend`` reads raw NVML values into a
plain dict (``read_raw``), and ``gpu_block`` turns such a dict into the wire
``gpu`` block.  Tests feed ``gpu_block`` values recorded on real GPUs, because
NVML cannot run on a machine without an NVIDIA driver.
"""

from __future__ import annotations

import threading
from typing import Any

from torch_hook.telemetry import TelemetryUnavailable, attempt

# NVML clock-event ("throttle") reason bits, nvml.h nvmlClocksEventReason*.
# The contract's vocabulary was taken from these names.
CLOCK_EVENT_BITS: tuple[tuple[int, str], ...] = (
    (0x0000000000000001, "idle"),  # GpuIdle
    (0x0000000000000002, "applications_clocks"),  # ApplicationsClocksSetting
    (0x0000000000000004, "sw_power_cap"),  # SwPowerCap
    (0x0000000000000008, "hw_slowdown"),  # HwSlowdown
    (0x0000000000000010, "sync_boost"),  # SyncBoost
    (0x0000000000000020, "sw_thermal"),  # SwThermalSlowdown
    (0x0000000000000040, "hw_thermal"),  # HwThermalSlowdown
    (0x0000000000000080, "hw_power_brake"),  # HwPowerBrakeSlowdown
    # 0x100 DisplayClockSetting: not a slowdown of compute; not reported.
)


def throttle_reasons(mask: int) -> list[str]:
    """Contract names of the reasons set in an NVML clock-event bitmask."""
    return [name for bit, name in CLOCK_EVENT_BITS if mask & bit]


def gpu_block(raw: dict[str, Any]) -> dict[str, Any]:
    """Map raw NVML readings (NVML's own units) to the wire ``gpu`` block.

    ``raw`` keys, each optional: ``sm_clock`` / ``max_sm_clock`` (MHz),
    ``power_mw``, ``enforced_limit_mw``, ``default_limit_mw`` (milliwatts, as
    NVML returns them), ``temp_c``, ``util_gpu`` (%), ``clock_event_mask``,
    ``ecc_uncorrected_volatile``, ``pcie_replay``.
    """
    out: dict[str, Any] = {}
    if raw.get("sm_clock") is not None:
        out["sm_clock_mhz"] = float(raw["sm_clock"])
    if raw.get("max_sm_clock") is not None:
        out["max_sm_clock_mhz"] = float(raw["max_sm_clock"])
    for src, dst in (("power_mw", "power_w"), ("enforced_limit_mw", "power_limit_w"),
                     ("default_limit_mw", "default_power_limit_w")):
        if raw.get(src) is not None:
            out[dst] = round(float(raw[src]) / 1000.0, 3)
    if raw.get("temp_c") is not None:
        out["temp_c"] = float(raw["temp_c"])
    if raw.get("util_gpu") is not None:
        out["util_pct"] = float(min(100, max(0, raw["util_gpu"])))
    if raw.get("clock_event_mask") is not None:
        out["throttle"] = throttle_reasons(int(raw["clock_event_mask"]))
    if raw.get("ecc_uncorrected_volatile") is not None:
        out["ecc_uncorrected"] = int(raw["ecc_uncorrected_volatile"])
    if raw.get("pcie_replay") is not None:
        out["pcie_replay"] = int(raw["pcie_replay"])
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlBackend:
    """NVML, initialised once per process; every query is guarded on its own.

    A query the GPU does not support (ECC on consumer boards, PCIe replay on
    some SXM parts) raises NVMLError; that field is then simply not measured.
    """

    name = "nvml"
    _lock = threading.Lock()

    def __init__(self, nvml: Any):
        self._nvml = nvml
        self._handles: dict[int, Any] = {}

    @classmethod
    def open(cls) -> NvmlBackend:
        try:
            import pynvml  # nvidia-ml-py
        except ImportError as err:
            raise TelemetryUnavailable(f"pynvml not importable: {err}") from None
        try:
            with cls._lock:
                pynvml.nvmlInit()
        except Exception as err:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            raise TelemetryUnavailable(f"nvmlInit failed: {err}") from None
        return cls(pynvml)

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = self._nvml.nvmlDeviceGetHandleByIndex(index)
        return self._handles[index]

    def count(self) -> int:
        return int(attempt(self._nvml.nvmlDeviceGetCount) or 0)

    def driver(self) -> str | None:
        value = attempt(self._nvml.nvmlSystemGetDriverVersion)
        return _text(value) if value is not None else None

    def device(self, index: int) -> dict[str, Any] | None:
        handle = attempt(lambda: self._handle(index))
        if handle is None:
            return None
        name = attempt(lambda: self._nvml.nvmlDeviceGetName(handle))
        uuid = attempt(lambda: self._nvml.nvmlDeviceGetUUID(handle))
        out: dict[str, Any] = {"vendor": "nvidia", "model": _text(name) if name else "NVIDIA GPU", "index": index}
        if uuid:
            out["uuid"] = _text(uuid)
        return out

    def read_raw(self, index: int) -> dict[str, Any]:
        n = self._nvml
        handle = attempt(lambda: self._handle(index))
        if handle is None:
            return {}

        def clock_events() -> int:
            # Renamed in R535 ("throttle" -> "clocks event"); same bits.
            getter = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                n.nvmlDeviceGetCurrentClocksThrottleReasons
            return getter(handle)

        return {
            "sm_clock": attempt(lambda: n.nvmlDeviceGetClockInfo(handle, n.NVML_CLOCK_SM)),
            "max_sm_clock": attempt(lambda: n.nvmlDeviceGetMaxClockInfo(handle, n.NVML_CLOCK_SM)),
            "power_mw": attempt(lambda: n.nvmlDeviceGetPowerUsage(handle)),
            "enforced_limit_mw": attempt(lambda: n.nvmlDeviceGetEnforcedPowerLimit(handle)),
            "default_limit_mw": attempt(lambda: n.nvmlDeviceGetPowerManagementDefaultLimit(handle)),
            "temp_c": attempt(lambda: n.nvmlDeviceGetTemperature(handle, n.NVML_TEMPERATURE_GPU)),
            "util_gpu": attempt(lambda: n.nvmlDeviceGetUtilizationRates(handle).gpu),
            "clock_event_mask": attempt(clock_events),
            "ecc_uncorrected_volatile": attempt(lambda: n.nvmlDeviceGetTotalEccErrors(
                handle, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC)),
            "pcie_replay": attempt(lambda: n.nvmlDeviceGetPcieReplayCounter(handle)),
        }

    def sample(self, index: int) -> dict[str, Any]:
        return gpu_block(self.read_raw(index))

    def close(self) -> None:
        self._handles.clear()
        try:
            with self._lock:
                self._nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 -- shutdown of an already-closed NVML
            pass
