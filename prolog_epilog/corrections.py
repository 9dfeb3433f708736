"""Supported corrections, applied as root by the node check.

artemisd queues a correction (``GET /v1/nodes/{node}/corrections``) when its
policy allows one for a confirmed GPU incident; this module applies it with the
vendor's management library and says what it did:

* ``reset_clocks`` — NVML: ``nvmlDeviceResetGpuLockedClocks`` and
  ``nvmlDeviceResetApplicationsClocks`` (clocks pinned low by someone's
  ``nvidia-smi -lgc``/``-ac``); AMD SMI: ``amdsmi_set_gpu_perf_level(AUTO)``.
* ``restore_power_limit`` — NVML: ``nvmlDeviceSetPowerManagementLimit`` to
  ``nvmlDeviceGetPowerManagementDefaultLimit`` (milliwatts); AMD SMI:
  ``amdsmi_set_power_cap`` to ``amdsmi_get_power_cap_info()['default_power_cap']``
  (read and written in the library's own unit, so no conversion).
* the emulated backend (test cluster) edits ``$ARTEMIS_EMULATED_GPU_DIR/<node>.json``
  the way the hardware would respond: a clock reset brings clocks back only
  when nothing (thermal, power cap, HW slowdown) still holds them down.

``gpu`` null means every GPU of the node.  A failure raises CorrectionError
with a message fit for the incident's record.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Protocol

KINDS = ("reset_clocks", "restore_power_limit")

# Reasons that keep clocks low whatever the clock settings say.
_HOLDS_CLOCKS_DOWN = ("hw_thermal", "sw_thermal", "hw_slowdown", "hw_power_brake", "sw_power_cap")


class CorrectionError(RuntimeError):
    pass


class Corrector(Protocol):
    name: str

    def gpus(self) -> list[int]: ...

    def reset_clocks(self, gpu: int) -> str: ...

    def restore_power_limit(self, gpu: int) -> str: ...

    def close(self) -> None: ...


class NvmlCorrector:
    name = "nvml"

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError:
            raise CorrectionError("nvidia-ml-py (pynvml) is not installed") from None
        self.nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            raise CorrectionError(f"nvmlInit: {err}") from None

    def gpus(self) -> list[int]:
        return list(range(self.nvml.nvmlDeviceGetCount()))

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self.nvml.NVMLError as err:
            raise CorrectionError(f"{what}: {err}") from None

    def reset_clocks(self, gpu: int) -> str:
        handle = self._call("nvmlDeviceGetHandleByIndex", self.nvml.nvmlDeviceGetHandleByIndex, gpu)
        self._call("nvmlDeviceResetGpuLockedClocks", self.nvml.nvmlDeviceResetGpuLockedClocks, handle)
        try:
            self.nvml.nvmlDeviceResetApplicationsClocks(handle)
        except self.nvml.NVMLError_NotSupported:
            pass  # application clocks only exist on some products; locked clocks were reset
        except self.nvml.NVMLError as err:
            raise CorrectionError(f"nvmlDeviceResetApplicationsClocks: {err}") from None
        return f"gpu {gpu}: locked and application clocks reset"

    def restore_power_limit(self, gpu: int) -> str:
        handle = self._call("nvmlDeviceGetHandleByIndex", self.nvml.nvmlDeviceGetHandleByIndex, gpu)
        default_mw = self._call("nvmlDeviceGetPowerManagementDefaultLimit",
                                self.nvml.nvmlDeviceGetPowerManagementDefaultLimit, handle)
        self._call("nvmlDeviceSetPowerManagementLimit",
                   self.nvml.nvmlDeviceSetPowerManagementLimit, handle, default_mw)
        return f"gpu {gpu}: power limit restored to the default {default_mw / 1000:g} W"

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


class AmdSmiCorrector:
    name = "amdsmi"

    def __init__(self) -> None:
        try:
            import amdsmi
        except ImportError:
            raise CorrectionError("amdsmi (ROCm's Python package) is not installed") from None
        self.smi = amdsmi
        try:
            amdsmi.amdsmi_init()
            self.handles = amdsmi.amdsmi_get_processor_handles()
        except amdsmi.AmdSmiException as err:
            raise CorrectionError(f"amdsmi_init: {err}") from None

    def gpus(self) -> list[int]:
        return list(range(len(self.handles)))

    def _handle(self, gpu: int) -> Any:
        if not 0 <= gpu < len(self.handles):
            raise CorrectionError(f"gpu {gpu}: this node has {len(self.handles)} AMD GPUs")
        return self.handles[gpu]

    def reset_clocks(self, gpu: int) -> str:
        try:
            self.smi.amdsmi_set_gpu_perf_level(self._handle(gpu), self.smi.AmdSmiDevPerfLevel.AUTO)
        except self.smi.AmdSmiException as err:
            raise CorrectionError(f"amdsmi_set_gpu_perf_level(AUTO): {err}") from None
        return f"gpu {gpu}: performance level back to AUTO"

    def restore_power_limit(self, gpu: int) -> str:
        handle = self._handle(gpu)
        try:
            info = self.smi.amdsmi_get_power_cap_info(handle)
            default = int(info["default_power_cap"])
            self.smi.amdsmi_set_power_cap(handle, 0, default)
        except (self.smi.AmdSmiException, KeyError, TypeError, ValueError) as err:
            raise CorrectionError(f"amdsmi power cap: {err}") from None
        return f"gpu {gpu}: power cap restored to the default ({default})"

    def close(self) -> None:
        try:
            self.smi.amdsmi_shut_down()
        except self.smi.AmdSmiException:
            pass


class EmulatedCorrector:
    """Edits the emulated telemetry file as the hardware would react."""

    name = "emulated"

    def __init__(self, path: Path):
        self.path = path
        if not path.exists():
            raise CorrectionError(f"{path}: no emulated GPU file for this node")

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as err:
            raise CorrectionError(f"{self.path}: {err}") from None
        if not isinstance(data.get("gpus"), dict):
            raise CorrectionError(f"{self.path}: no 'gpus' object")
        return data

    def _store(self, data: dict[str, Any]) -> None:
        # Atomic: the probe re-reads this file every window, possibly right now.
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        with os.fdopen(fd, "w") as out:
            json.dump(data, out, indent=1)
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.path)

    def gpus(self) -> list[int]:
        return sorted(int(k) for k in self._load()["gpus"])

    def _edit(self, gpu: int, change: Any) -> str:
        data = self._load()
        entry = data["gpus"].get(str(gpu))
        if not isinstance(entry, dict):
            raise CorrectionError(f"{self.path}: no gpu {gpu}")
        detail = change(entry)
        throttle = entry.get("throttle") or []
        if not any(r in _HOLDS_CLOCKS_DOWN for r in throttle) and "max_sm_clock_mhz" in entry \
                and "applications_clocks" not in throttle:
            entry["sm_clock_mhz"] = entry["max_sm_clock_mhz"]
        self._store(data)
        return f"gpu {gpu}: {detail}"

    def reset_clocks(self, gpu: int) -> str:
        def change(entry: dict[str, Any]) -> str:
            entry["throttle"] = [r for r in entry.get("throttle") or [] if r != "applications_clocks"]
            held = [r for r in entry["throttle"] if r in _HOLDS_CLOCKS_DOWN]
            return "clocks reset" + (f" (still held down by {', '.join(held)})" if held else "")
        return self._edit(gpu, change)

    def restore_power_limit(self, gpu: int) -> str:
        def change(entry: dict[str, Any]) -> str:
            if "default_power_limit_w" not in entry:
                raise CorrectionError(f"{self.path}: gpu {gpu} has no default_power_limit_w")
            entry["power_limit_w"] = entry["default_power_limit_w"]
            entry["throttle"] = [r for r in entry.get("throttle") or [] if r != "sw_power_cap"]
            return f"power limit restored to the default {entry['power_limit_w']} W"
        return self._edit(gpu, change)

    def close(self) -> None:
        pass


def open_corrector(telemetry: str, emulated_dir: str | None, node: str) -> Corrector:
    """The corrector matching the node's telemetry backend choice."""
    if telemetry == "emulated" or (telemetry == "auto" and emulated_dir):
        if not emulated_dir:
            raise CorrectionError("Telemetry=emulated needs EmulatedGpuDir")
        return EmulatedCorrector(Path(emulated_dir) / f"{node}.json")
    if telemetry == "none":
        raise CorrectionError("Telemetry=none: this node has no GPU management configured")
    errors = []
    for name, factory in (("nvml", NvmlCorrector), ("amdsmi", AmdSmiCorrector)):
        if telemetry not in ("auto", name):
            continue
        try:
            return factory()
        except CorrectionError as err:
            errors.append(f"{name}: {err}")
    raise CorrectionError("no GPU management library usable: " + "; ".join(errors))


def apply(corrector: Corrector, correction: dict[str, Any]) -> str:
    """Apply one queued correction; returns the detail line for the daemon."""
    kind = correction.get("kind")
    if kind not in KINDS:
        raise CorrectionError(f"unsupported correction kind {kind!r} (supported: {', '.join(KINDS)})")
    gpu = correction.get("gpu")
    if gpu is not None and (not isinstance(gpu, int) or isinstance(gpu, bool) or gpu < 0):
        raise CorrectionError(f"gpu must be a GPU index or null, got {gpu!r}")
    targets = corrector.gpus() if gpu is None else [gpu]
    if not targets:
        raise CorrectionError("this node has no GPUs to correct")
    method = getattr(corrector, kind)
    return "; ".join(method(index) for index in targets)
