"""Emulated GPU telemetry read from a file, so the test cluster can play a
throttled GPU on machines without one.

``$ARTEMIS_EMULATED_GPU_DIR/<node>.json``::

    {"vendor": "nvidia", "model": "Emulated GPU", "driver": "550.54.15",
     "gpus": {"0": {"sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980, "power_w": 300,
                    "power_limit_w": 700, "default_power_limit_w": 700,
                    "temp_c": 40, "util_pct": 95, "throttle": []}}}

Values are already in wire units.  The file is re-read on every sample (it is
small), so a test can change it while a job runs.  A missing file or field
means "not measured".  A rank maps onto ``gpus[str(index % len(gpus))]``.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from torch_hook.telemetry import THROTTLE_VOCABULARY, TelemetryUnavailable

_GPU_FIELDS = (
    "sm_clock_mhz", "max_sm_clock_mhz", "power_w", "power_limit_w", "default_power_limit_w",
    "temp_c", "util_pct", "ecc_uncorrected", "pcie_replay",
)


class EmulatedBackend:
    name = "emulated"

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def from_env(cls, node: str | None = None) -> EmulatedBackend:
        folder = os.environ.get("ARTEMIS_EMULATED_GPU_DIR")
        if not folder:
            raise TelemetryUnavailable("ARTEMIS_TELEMETRY=emulated needs ARTEMIS_EMULATED_GPU_DIR")
        node = node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        return cls(Path(folder) / f"{node}.json")

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _gpu(self, data: dict[str, Any], index: int) -> tuple[str, dict[str, Any]] | None:
        gpus = data.get("gpus")
        if not isinstance(gpus, dict) or not gpus:
            return None
        key = str(index % len(gpus))
        entry = gpus.get(key)
        return (key, entry) if isinstance(entry, dict) else None

    def count(self) -> int:
        gpus = self._read().get("gpus")
        return len(gpus) if isinstance(gpus, dict) else 0

    def driver(self) -> str | None:
        value = self._read().get("driver")
        return str(value) if value else None

    def device(self, index: int) -> dict[str, Any] | None:
        data = self._read()
        found = self._gpu(data, index)
        if found is None:
            return None
        key, entry = found
        out: dict[str, Any] = {
            "vendor": str(entry.get("vendor") or data.get("vendor") or "nvidia"),
            "model": str(entry.get("model") or data.get("model") or "Emulated GPU"),
            "index": int(key),
        }
        if entry.get("uuid"):
            out["uuid"] = str(entry["uuid"])
        return out

    def sample(self, index: int) -> dict[str, Any]:
        found = self._gpu(self._read(), index)
        if found is None:
            return {}
        entry = found[1]
        out = {k: entry[k] for k in _GPU_FIELDS if isinstance(entry.get(k), int | float) and not isinstance(entry.get(k), bool)}
        throttle = entry.get("throttle")
        if isinstance(throttle, list):
            out["throttle"] = [r for r in throttle if r in THROTTLE_VOCABULARY]
        return out

    def close(self) -> None:
        pass
