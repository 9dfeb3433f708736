"""Emulated hosts: one network namespace per node on a bridge attached to nothing.

Network safety (design.md §6) is enforced here, in this order:

1. ``ip route replace unreachable 10.77.0.0/24 metric 4000`` in the root
   namespace, so a packet for the test range can never follow the default route
   out of the machine — not before the bridge exists, not after it is gone;
2. the bridge with its address, and a check that ``ip route get`` for every node
   address says ``dev <bridge>`` before anything may dial it;
3. namespaces get only a veth into the bridge and no default route.

Several clusters (several pytest sessions of different developers) may run on
one machine at once, so the /24 is cut into sixteen /28 *slots*; a slot is held
with an flock for the lifetime of the lab.  The safety route is shared: it is
added by every lab and removed by the last one, under a second lock.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from .procs import ClusterError, kill_pids, run

TEST_RANGE = ipaddress.ip_network("10.77.0.0/24")
SLOT_PREFIX = 28
LOCK_DIR = Path("/run/artemis-testcluster")
SAFETY_ROUTE = ["unreachable", str(TEST_RANGE), "metric", "4000"]
MAX_NODES = 2 ** (32 - SLOT_PREFIX) - 3  # minus network, broadcast and the bridge


def namespaces_available() -> str | None:
    """None when this machine can run one namespace per node, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"{tool} is not installed"
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    return None


@dataclass(frozen=True)
class NetNode:
    name: str          # Slurm node name, e.g. "n2"
    netns: str         # namespace name under /run/netns
    address: str       # the node's address inside its namespace
    host_veth: str     # root-namespace end of the node's link (on the bridge)
    iface: str = "eth0"  # the namespace end, the same name on every node

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"

    def pids(self) -> list[int]:
        out = run(["ip", "netns", "pids", self.netns], check=False).stdout
        return [int(p) for p in out.split()]


class NetLab:
    """``with NetLab(["n1", "n2"]) as lab: lab.nodes["n1"].address``."""

    def __init__(self, node_names: list[str]):
        if len(node_names) > MAX_NODES:
            raise ValueError(f"at most {MAX_NODES} nodes per lab, asked for {len(node_names)}")
        self.node_names = list(node_names)
        self.slot: int | None = None
        self._slot_fd: int | None = None
        self.nodes: dict[str, NetNode] = {}

    # -- slots and the shared safety route ---------------------------------

    def _acquire_slot(self) -> None:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        for slot in range(2 ** (SLOT_PREFIX - 24)):
            fd = os.open(LOCK_DIR / f"slot-{slot}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue
                raise
            self.slot, self._slot_fd = slot, fd
            return
        raise ClusterError("all 16 test-network slots of 10.77.0.0/24 are in use")

    def _route_lock(self) -> int:
        fd = os.open(LOCK_DIR / "route.lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def _other_slots_held(self) -> bool:
        for path in LOCK_DIR.glob("slot-*.lock"):
            if path.name == f"slot-{self.slot}.lock":
                continue
            fd = os.open(path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return True
            finally:
                os.close(fd)
        return False

    # -- names -------------------------------------------------------------

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        assert self.slot is not None
        return list(TEST_RANGE.subnets(new_prefix=SLOT_PREFIX))[self.slot]

    @property
    def bridge(self) -> str:
        return f"artbr{self.slot}"

    @property
    def bridge_address(self) -> str:
        return str(self.subnet.network_address + 1)

    def _node(self, index: int, name: str) -> NetNode:
        return NetNode(
            name=name,
            netns=f"art{self.slot}-{name}",
            address=str(self.subnet.network_address + 2 + index),
            host_veth=f"art{self.slot}v{index}",
        )

    # -- life cycle --------------------------------------------------------

    def __enter__(self) -> NetLab:
        self._acquire_slot()
        try:
            route_fd = self._route_lock()
            try:
                run(["ip", "route", "replace", *SAFETY_ROUTE])
            finally:
                os.close(route_fd)
            self._remove_links()  # leftovers of a crashed run in this slot
            self._build()
            self._check_routes()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        prefix = self.subnet.prefixlen
        run(["ip", "link", "add", self.bridge, "type", "bridge"])
        run(["ip", "addr", "add", f"{self.bridge_address}/{prefix}", "dev", self.bridge])
        run(["ip", "link", "set", self.bridge, "up"])
        for index, name in enumerate(self.node_names):
            node = self._node(index, name)
            self.nodes[name] = node
            peer = f"{node.host_veth}p"
            run(["ip", "netns", "add", node.netns])
            run(["ip", "link", "add", node.host_veth, "type", "veth", "peer", "name", peer])
            run(["ip", "link", "set", peer, "netns", node.netns])
            run(["ip", "link", "set", node.host_veth, "master", self.bridge, "up"])
            inside = ["ip", "-n", node.netns]
            run([*inside, "link", "set", peer, "name", node.iface])
            run([*inside, "link", "set", "lo", "up"])
            run([*inside, "addr", "add", f"{node.address}/{prefix}", "dev", node.iface])
            run([*inside, "link", "set", node.iface, "up"])

    def _check_routes(self) -> None:
        for node in self.nodes.values():
            out = run(["ip", "route", "get", node.address]).stdout
            if f"dev {self.bridge}" not in out:
                raise ClusterError(
                    f"refusing to start: `ip route get {node.address}` says {out.strip()!r}, "
                    f"not dev {self.bridge}"
                )

    def _remove_links(self) -> None:
        assert self.slot is not None
        listed = run(["ip", "netns", "list"], check=False).stdout.split("\n")
        for line in listed:
            netns = line.split(" ", 1)[0]
            if netns.startswith(f"art{self.slot}-"):
                kill_pids([int(p) for p in run(["ip", "netns", "pids", netns],
                                               check=False).stdout.split()])
                run(["ip", "netns", "del", netns], check=False)
        for index in range(MAX_NODES):
            run(["ip", "link", "del", f"art{self.slot}v{index}"], check=False)
        run(["ip", "link", "del", f"artbr{self.slot}"], check=False)

    def kill_all(self) -> None:
        """Stop every process still inside one of our namespaces (they are all ours)."""
        for node in self.nodes.values():
            kill_pids(node.pids())

    def close(self) -> None:
        if self.slot is None:
            return
        self.kill_all()
        self._remove_links()  # deleting a namespace deletes its veth, qdiscs with it
        self.nodes.clear()
        route_fd = self._route_lock()
        try:
            if not self._other_slots_held():
                run(["ip", "route", "del", *SAFETY_ROUTE], check=False)
        finally:
            os.close(route_fd)
            if self._slot_fd is not None:
                os.close(self._slot_fd)
            self.slot, self._slot_fd = None, None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
