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
from typing import Any, Protocol

# The contract's throttle vocabulary; AMD reasons are mapped onto it.
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
    if choice in ("nvml", "auto"):
        from torch_hook.telemetry.nvml import NvmlBackend

        try:
            return NvmlBackend.open()
        except TelemetryUnavailable:
            if choice == "nvml":
                raise
    if choice in ("amdsmi", "auto"):
        from torch_hook.telemetry.amdsmi import AmdSmiBackend

        try:
            return AmdSmiBackend.open()
        except TelemetryUnavailable:
            if choice == "amdsmi":
                raise
    return None
