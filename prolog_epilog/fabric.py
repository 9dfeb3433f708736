"""Fabric evidence for the node check: link state, rate, error counters and PCIe training, from sysfs.

Read as NHC reads them, with no daemon of our own and no tool to run:

* InfiniBand and RoCE ports, ``/sys/class/infiniband/<dev>/ports/<port>/``: ``state``,
  ``phys_state``, ``rate`` and the error counters of ``counters/``;
* Ethernet interfaces, ``/sys/class/net/<iface>/`` (not ``lo``, not IPoIB: those are the
  InfiniBand ports above): ``operstate``, ``speed``, ``carrier_changes`` and ``statistics/``;
* the PCIe link of each GPU (class 0x03) and network controller (class 0x02),
  ``/sys/bus/pci/devices/<bdf>/``: trained width and speed against the maximum.

``snapshot`` takes the raw readings of one pass; ``block`` turns two passes into the health
event's ``fabric`` block (counters per second between them).  ``remember`` / ``previous`` keep
the last pass's snapshot in the node check's state folder.

Only what a node *receives*, or its own link's training, can say that its link is at fault
(symbol and CRC errors, link recoveries and downs, received errors, lost carrier, a port down or
trained slow, a PCIe link trained below its maximum); transmit-side counters rise on every sender
to a slow link, so they are sent to be shown, never to convict.  Traffic shaping in a qdisc
(netem, tbf) drops or delays packets before any of these counters sees them.

Standard library only; nothing here raises on a missing or odd file: that value is left out.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

# Bounds of the wire contract (artemisd.wire: MAX_FABRIC_ITEMS, MAX_ID, FabricState, PcieLink):
# a block beyond them would have the whole health event refused.
MAX_ITEMS = 64
MAX_NAME = 255
MAX_STATE = 32
MAX_WIDTH = 64
_COUNTER_END = 2**64  # sysfs counters are 64-bit at most; a bigger number is no reading
# Counters older than this say nothing about now: no rates (the node check runs every few minutes).
MAX_INTERVAL_S = 3600.0

IB_COUNTERS = ("symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors",
               "port_xmit_discards", "port_xmit_wait")
ETH_COUNTERS = ("carrier_changes", "rx_crc_errors", "rx_errors", "tx_errors", "rx_dropped")
_ARPHRD_INFINIBAND = "32"  # /sys/class/net/<iface>/type of an IPoIB interface
_ROLES = {"03": "gpu", "02": "nic"}  # PCI base class: display controller, network controller
_NUMBER = re.compile(r"\s*(\d+(?:\.\d+)?)")


def _text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace").strip() or None
    except (OSError, ValueError):
        return None


def _int(path: Path) -> int | None:
    text = _text(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _leading_number(text: str | None) -> float | None:
    """200.0 from ``200 Gb/sec (4X HDR)``, 16.0 from ``16.0 GT/s PCIe``; None from ``Unknown``."""
    match = _NUMBER.match(text or "")
    value = float(match.group(1)) if match else None
    return value if value is not None and math.isfinite(value) else None


def _name(text: str) -> str | None:
    """``text`` if the wire contract takes it as a name (printable Unicode, 1..MAX_NAME
    characters), else None: no kernel gives such a name, and a cut one could name another."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes in a file name (surrogate escapes)
        return None
    return text if 0 < len(text) <= MAX_NAME and text.isprintable() else None


def _state(text: str | None) -> str | None:
    """``ACTIVE`` from ``4: ACTIVE``, ``up`` from ``up``: the words after the number."""
    if text is None:
        return None
    word = text.split(":", 1)[-1].strip()
    return _name(word[:MAX_STATE]) if word else None


def _entries(folder: Path) -> list[Path]:
    try:
        return sorted((p for p in folder.iterdir() if _name(p.name)), key=lambda p: p.name)
    except OSError:
        return []


def _counters(folder: Path, names: tuple[str, ...]) -> dict[str, int]:
    values = {name: _int(folder / name) for name in names}
    return {name: value for name, value in values.items() if value is not None and 0 <= value < _COUNTER_END}


def _ib_ports(root: Path) -> dict[str, dict[str, Any]]:
    ports: dict[str, dict[str, Any]] = {}
    for device in _entries(root / "sys/class/infiniband"):
        for port in _entries(device / "ports"):
            name = _name(f"{device.name}/{port.name}")
            if name is None or len(ports) >= MAX_ITEMS:
                continue
            reading = {"state": _state(_text(port / "state")),
                       "phys_state": _state(_text(port / "phys_state")),
                       "rate_gbps": _leading_number(_text(port / "rate")),
                       "counters": _counters(port / "counters", IB_COUNTERS)}
            ports[name] = {k: v for k, v in reading.items() if v not in (None, {})}
    return ports


def _eth_ifaces(root: Path) -> dict[str, dict[str, Any]]:
    candidates = [p for p in _entries(root / "sys/class/net")
                  if p.name != "lo" and os.path.isdir(p) and _text(p / "type") != _ARPHRD_INFINIBAND]
    # Physical NICs (a ``device`` link) before virtual ones when there are more than the bound.
    candidates.sort(key=lambda p: not os.path.exists(p / "device"))
    ifaces: dict[str, dict[str, Any]] = {}
    for iface in candidates[:MAX_ITEMS]:
        speed = _int(iface / "speed")  # Mb/s; unreadable or -1 while down, 2**32-1 on some drivers
        counters = _counters(iface / "statistics", ETH_COUNTERS[1:])
        changes = _int(iface / "carrier_changes")
        if changes is not None and changes >= 0:
            counters = {"carrier_changes": changes, **counters}
        reading = {"state": _state(_text(iface / "operstate")),
                   "speed_mbps": speed if speed is not None and 0 < speed < 10_000_000 else None,
                   "counters": counters}
        ifaces[iface.name] = {k: v for k, v in reading.items() if v not in (None, {})}
    return ifaces


def _pcie_links(root: Path) -> dict[str, dict[str, Any]]:
    links: list[tuple[str, str, dict[str, Any]]] = []
    for device in _entries(root / "sys/bus/pci/devices"):
        klass = (_text(device / "class") or "").lower().removeprefix("0x")
        role = _ROLES.get(klass[:2]) if len(klass) == 6 else None
        if role is None or os.path.exists(device / "physfn"):  # an SR-IOV function mirrors its parent's link
            continue
        width, top = _int(device / "current_link_width"), _int(device / "max_link_width")
        reading = {"role": role,
                   "width": width if width is not None and 0 <= width <= MAX_WIDTH else None,
                   "max_width": top if top is not None and 0 <= top <= MAX_WIDTH else None,
                   "speed_gts": _leading_number(_text(device / "current_link_speed")),
                   "max_speed_gts": _leading_number(_text(device / "max_link_speed"))}
        reading = {k: v for k, v in reading.items() if v is not None}
        if len(reading) > 1:  # a device without link files has no link to show
            links.append((role, device.name, reading))
    links.sort(key=lambda item: (item[0], item[1]))  # GPUs first when there are more than the bound
    return {bdf: reading for _, bdf, reading in links[:MAX_ITEMS]}


def snapshot(root: Path = Path("/")) -> dict[str, Any]:
    """This pass's raw readings under ``root`` (plain JSON data; empty parts left out)."""
    root = Path(root)
    taken: dict[str, Any] = {"boot_id": _text(root / "proc/sys/kernel/random/boot_id"),
                             "ib": _ib_ports(root), "eth": _eth_ifaces(root), "pcie": _pcie_links(root)}
    return {k: v for k, v in taken.items() if v}


def _per_s(before: Any, after: dict[str, int], seconds: float) -> dict[str, float]:
    rates: dict[str, float] = {}
    if not isinstance(before, dict):
        return rates
    for name, value in after.items():
        old = before.get(name)
        # A counter that went backwards was reset or wrapped: its difference means nothing.
        if isinstance(old, int) and not isinstance(old, bool) and value >= old:
            # Six decimals: one count in MAX_INTERVAL_S (2.8e-4 /s) must not round to nothing.
            rates[name] = round((value - old) / seconds, 6)
    return rates


def block(previous: dict[str, Any] | None, current: dict[str, Any], seconds: float | None
          ) -> dict[str, Any] | None:
    """The health event's ``fabric`` block; counters per second only against an earlier pass of
    the same boot, ``0 < seconds <= MAX_INTERVAL_S`` ago.  None when there is nothing to show."""
    interval = 0.0
    earlier: dict[str, Any] = {}
    if (isinstance(previous, dict) and seconds is not None and 0 < seconds <= MAX_INTERVAL_S
            and previous.get("boot_id") == current.get("boot_id")):  # a reboot restarts every counter
        interval, earlier = float(seconds), previous
    ports = []
    for kind in ("ib", "eth"):
        before = earlier.get(kind) if isinstance(earlier.get(kind), dict) else {}
        for name, reading in current.get(kind, {}).items():
            port: dict[str, Any] = {"name": name, "kind": kind}
            port.update({k: reading[k] for k in ("state", "phys_state", "rate_gbps") if k in reading})
            if "speed_mbps" in reading:
                port["rate_gbps"] = round(reading["speed_mbps"] / 1000, 3)
            old = before.get(name)
            per_s = _per_s(old.get("counters") if isinstance(old, dict) else None,
                           reading.get("counters", {}), interval)
            if per_s:
                port["per_s"] = per_s
            ports.append(port)
    # The wire takes MAX_ITEMS ports of both kinds: InfiniBand first, then physical NICs, veths last.
    del ports[MAX_ITEMS:]
    pcie = [{"device": bdf, **reading} for bdf, reading in current.get("pcie", {}).items()]
    out: dict[str, Any] = {}
    if interval and ports:
        out["interval_s"] = round(interval, 3)
    if ports:
        out["ports"] = ports
    if pcie:
        out["pcie"] = pcie
    return out or None


def _state_file(state_dir: str | Path, node: str) -> Path:
    return Path(state_dir) / f"fabric.{node}.json"


def remember(state_dir: str | Path, node: str, taken: dict[str, Any], now: float) -> None:
    """Keep this pass's snapshot for the next one (written whole or not at all)."""
    path = _state_file(state_dir, node)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "w") as out:
            json.dump({"time": now, "snapshot": taken}, out, sort_keys=True)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def previous(state_dir: str | Path, node: str) -> tuple[float, dict[str, Any]] | None:
    """The last pass's ``(time, snapshot)``; None when there is none, or it cannot be read."""
    try:
        kept = json.loads(_state_file(state_dir, node).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict):
        return None
    when, taken = kept.get("time"), kept.get("snapshot")
    if not isinstance(when, (int, float)) or isinstance(when, bool) or not isinstance(taken, dict):
        return None
    return float(when), taken
