"""Device and host telemetry for one rank (or one node), vendor independent.

Collectors *gather*; they never judge.  Each returns plain dicts whose keys are
the wire contract's field names (design.md §3, ``gpu`` / ``host`` / ``device``
blocks), and leaves a key out when the value was not measured -- never zero.

This package imports nothing beyond the standard library at import time: it
runs inside training ranks that may lack artemisd's dependencies.  The vendor
libraries (``pynvml`` from nvidia-ml-py, ``amdsmi``) and ``psutil`` are
imported only when a backend is chosen and only if importable.

Backend choice: ``ARTEMIS_TELEMETRY=auto|nvml|amdsmi|emulated|none`` (default
``auto``: emulated when ``ARTEMIS_EMULATED_GPU_DIR`` is set, else NVML, else
AMD SMI, else none).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

# The contract's throttle vocabulary (artemisd.wire.THROTTLE_REASONS, copied
# because this package must not import artemisd; a unit test keeps them equal).
THROTTLE_VOCABULARY = (
    "sw_power_cap",
    "hw_slowdown",
    "hw_thermal",
    "sw_thermal",
    "hw_power_brake",
    "sync_boost",
    "applications_clocks",
    "idle",
)

BACKENDS = ("auto", "nvml", "amdsmi", "emulated", "none")


def attempt(query: Callable[[], Any]) -> Any:
    """Run one vendor query; None when the device does not support it.

    NVML and AMD SMI raise for a query a board does not support (ECC on
    consumer parts, PCIe replay on some SXM boards); that field is then simply
    not measured, and the other queries still run.
    """
    try:
        return query()
    except Exception:  # noqa: BLE001 -- NVMLError_NotSupported, AmdSmiLibraryException, ...
        return None


class TelemetryUnavailable(RuntimeError):
    """The requested backend cannot run here (library or device missing)."""


class GpuBackend(Protocol):
    """One vendor's GPU telemetry.  Every method may omit what it cannot measure."""

    name: str

    def device(self, index: int) -> dict[str, Any] | None:
        """``{"vendor", "model", "index", "uuid"}`` of GPU ``index``, or None."""

    def sample(self, index: int) -> dict[str, Any]:
        """The wire ``gpu`` block for GPU ``index`` (missing keys = not measured)."""

    def driver(self) -> str | None:
        """Driver version string, for the ``env`` fingerprint."""

    def count(self) -> int:
        """Number of GPUs visible to this backend."""

    def close(self) -> None: ...


def open_backend(choice: str | None = None, node: str | None = None) -> GpuBackend | None:
    """Open the GPU backend named by ``choice`` (default ``$ARTEMIS_TELEMETRY``).

    ``auto`` returns None when no backend can run; an explicit name that cannot
    run raises TelemetryUnavailable, so a misconfigured site hears about it.
    """
    choice = (choice or os.environ.get("ARTEMIS_TELEMETRY") or "auto").strip().lower()
    if choice not in BACKENDS:
        raise ValueError(f"ARTEMIS_TELEMETRY={choice!r}: expected one of {', '.join(BACKENDS)}")
    if choice == "none":
        return None
    if choice == "emulated" or (choice == "auto" and os.environ.get("ARTEMIS_EMULATED_GPU_DIR")):
        from torch_hook.telemetry.emulated import EmulatedBackend

        return EmulatedBackend.from_env(node)
    for name in ("nvml", "amdsmi"):
        if choice not in (name, "auto"):
            continue
        try:
            return _vendor_backend(name)
        except TelemetryUnavailable:
            if choice == name:
                raise
    return None


def _vendor_backend(name: str) -> GpuBackend:
    if name == "nvml":
        from torch_hook.telemetry.nvml import NvmlBackend

        return NvmlBackend.open()
    from torch_hook.telemetry.amdsmi import AmdSmiBackend

    return AmdSmiBackend.open()
