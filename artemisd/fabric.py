"""What a node's fabric counters show of a degraded link, judged against the job's other nodes.  Pure.

The node check reads them from sysfs (``prolog_epilog/fabric.py``) and sends them as a health event's
``fabric`` block: each port's state, trained rate and error counters per second since its previous
pass, and each GPU's and NIC's PCIe link width and speed against its maximum.  Only what the node
*receives* or its own link's training can say that its link is at fault: symbol and CRC errors,
link recoveries and downs, received packets in error, lost carrier, a port down or trained below its
peers, a PCIe link trained below its maximum.  What a node *sends* into trouble (transmit discards
and waits, TCP retransmits) rises on every sender to a slow link, so it is shown, never a finding.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from artemisd.thresholds import FABRIC_ERROR_FACTOR, FABRIC_ERRORS_PER_S, RATE_DROP

# Counted where the bits arrive, or in the link's own training: they name this node's link.
RECEIVE_SIDE = ("symbol_error", "link_error_recovery", "port_rcv_errors", "rx_crc_errors", "rx_errors")
# A link that went down or lost its carrier in the interval: any count is a finding.
LINK_LOST = ("link_downed", "carrier_changes")
UP_STATES = frozenset({"ACTIVE", "up", "unknown"})  # a veth reads "up"; some drivers "unknown"


@dataclass(frozen=True)
class Finding:
    """One reading that convicts the node's link, with its peers' for comparison."""

    signal: str  # e.g. "fabric.symbol_error"
    where: str  # the port or PCIe device
    value: float | str
    peers: float | str | None
    note: str

    def line(self) -> str:
        peers = f" (peers {self.peers})" if self.peers is not None else ""
        return f"{self.where} {self.note}{peers}"


def _ports(event: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    fabric = (event or {}).get("fabric") or {}
    return {p["name"]: p for p in fabric.get("ports") or () if isinstance(p, dict) and p.get("name")}


def _pcie(event: dict[str, Any] | None) -> list[dict[str, Any]]:
    fabric = (event or {}).get("fabric") or {}
    return [d for d in fabric.get("pcie") or () if isinstance(d, dict)]


def _median(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def findings(event: dict[str, Any] | None, peers: Sequence[dict[str, Any]] = ()) -> list[Finding]:
    """What ``event``'s fabric block shows against its link, each reading beside the median of the same
    port's reading on ``peers`` (the job's other nodes' latest events); none without a block."""
    out: list[Finding] = []
    peer_ports = [_ports(p) for p in peers]
    for name, port in sorted(_ports(event).items()):
        same = [pp[name] for pp in peer_ports if name in pp]
        state = port.get("state")
        if state is not None and state not in UP_STATES:
            up = sum(1 for p in same if p.get("state") in UP_STATES)
            # A port nobody uses (a spare NIC port, an ifb device) is down on every node alike: only one
            # down where most of the peers' same port is up counts, and without peers nothing tells them apart.
            if same and up * 2 > len(same):
                out.append(Finding("fabric.state", name, state, f"{up} of {len(same)} up", f"port {state}"))
            continue
        rate = _number(port.get("rate_gbps"))
        peer_rates = [r for p in same if (r := _number(p.get("rate_gbps"))) is not None and r > 0]
        usual = _median(peer_rates)
        if rate is not None and usual is not None and rate < RATE_DROP * usual:
            out.append(Finding("fabric.rate_gbps", name, rate, usual,
                               f"trained at {rate:g} Gb/s, below its peers' {usual:g} Gb/s"))
        per_s = port.get("per_s") or {}
        for counter in RECEIVE_SIDE + LINK_LOST:
            value = _number(per_s.get(counter))
            if value is None or value <= 0:
                continue
            theirs = [v for p in same if (v := _number((p.get("per_s") or {}).get(counter))) is not None]
            usual = _median(theirs)
            if counter in LINK_LOST:
                hit = usual is None or usual == 0
            else:
                hit = value >= FABRIC_ERRORS_PER_S and (usual is None or value >= FABRIC_ERROR_FACTOR * usual)
            if hit:
                out.append(Finding(f"fabric.{counter}", name, round(value, 3),
                                   round(usual, 3) if usual is not None else None, f"{counter} {value:.3g}/s"))
    out.extend(_downtrained(event, peers))
    return out


def _downtrained(event: dict[str, Any] | None, peers: Sequence[dict[str, Any]]) -> list[Finding]:
    """PCIe links of the node's NICs and GPUs trained below their maximum width, or a NIC's below its
    maximum speed.  A GPU's PCIe *speed* drops when it idles (power saving), so a GPU counts on speed
    only where most of the peers' same device runs at its maximum."""
    out = []
    peer_links = [{d.get("device"): d for d in _pcie(p)} for p in peers]
    for link in _pcie(event):
        device, role = link.get("device"), link.get("role")
        width, top = _number(link.get("width")), _number(link.get("max_width"))
        if width is not None and top and width < top:
            out.append(Finding("fabric.pcie_width", f"{role} {device}", int(width), int(top),
                               f"PCIe x{width:g} of x{top:g}"))
            continue
        speed, fastest = _number(link.get("speed_gts")), _number(link.get("max_speed_gts"))
        if speed is None or not fastest or speed >= RATE_DROP * fastest:
            continue
        if role == "gpu":
            same = [pl[device] for pl in peer_links if device in pl]
            at_max = sum(1 for d in same if _number(d.get("speed_gts")) == _number(d.get("max_speed_gts")))
            if not same or at_max * 2 <= len(same):
                continue
        out.append(Finding("fabric.pcie_speed", f"{role} {device}", speed, fastest,
                           f"PCIe {speed:g} GT/s of {fastest:g} GT/s"))
    return out


def shown(event: dict[str, Any] | None, peers: Sequence[dict[str, Any]] = ()) -> str | None:
    """The findings in one line (None: the fabric shows nothing against this node's link)."""
    found = findings(event, peers)
    return "; ".join(f.line() for f in found) if found else None
