"""The node check's fabric evidence (prolog_epilog/fabric.py): sysfs read as NHC reads it, counters per
second between two passes, and a block the wire contract takes (issue 31)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from artemisd.wire import MAX_FABRIC_ITEMS, MAX_ID, NodeEvent, parse_record

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "prolog_epilog"))

import artemis_node  # noqa: E402
import fabric  # noqa: E402
import nodecheck  # noqa: E402

IB_ZERO = dict.fromkeys(fabric.IB_COUNTERS, 0)
ETH_ZERO = dict.fromkeys(fabric.ETH_COUNTERS[1:], 0)


def write(folder: Path, **files: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (folder / name).write_text(f"{value}\n")
    return folder


def ib_port(root: Path, device: str, port: str = "1", *, state: str = "4: ACTIVE", phys: str = "5: LinkUp",
            rate: str = "200 Gb/sec (4X HDR)", **counters: int) -> None:
    folder = write(root / "sys/class/infiniband" / device / "ports" / port,
                   state=state, phys_state=phys, rate=rate)
    write(folder / "counters", **{**IB_ZERO, **counters})


def eth(root: Path, name: str, *, speed: object = 100000, operstate: str = "up", kind: int = 1,
        carrier_changes: int = 1, **stats: int) -> None:
    files = {"operstate": operstate, "type": kind, "carrier_changes": carrier_changes}
    if speed is not None:
        files["speed"] = speed
    write(write(root / "sys/class/net" / name, **files) / "statistics", **{**ETH_ZERO, **stats})


def pci(root: Path, bdf: str, klass: str, **link: object) -> None:
    write(root / "sys/bus/pci/devices" / bdf, **{"class": klass}, **link)


def node_tree(root: Path, *, symbol_errors: int = 0, link_downed: int = 0, rx_crc: int = 0) -> Path:
    """A node with a healthy HDR port, one degraded to 100 Gb/s, one down, an IPoIB interface,
    a NIC, a veth, a GPU trained at x8 of x16, a NIC whose speed reads Unknown, a USB controller."""
    ib_port(root, "mlx5_0")
    ib_port(root, "mlx5_1", rate="100 Gb/sec (4X HDR)", symbol_error=symbol_errors, port_rcv_errors=symbol_errors // 2)
    ib_port(root, "mlx5_2", state="1: DOWN", phys="3: Disabled", rate="10 Gb/sec (4X SDR)", link_downed=link_downed)
    eth(root, "ib0", kind=32)  # IPoIB: already counted as mlx5_0/1
    write(root / "sys/class/net/lo", operstate="unknown", type=772)
    (root / "sys/class/net/bonding_masters").write_text("\n")  # a file, not an interface
    eth(root, "eth0", rx_crc_errors=rx_crc)
    eth(root, "veth3", speed=-1, operstate="down")
    eth(root, "veth4", speed=None)  # unreadable: EINVAL on a real down link
    pci(root, "0000:3b:00.0", "0x030200", current_link_width=8, max_link_width=16,
        current_link_speed="16.0 GT/s PCIe", max_link_speed="16.0 GT/s PCIe")
    pci(root, "0000:5e:00.0", "0x020700", current_link_width=16, max_link_width=16,
        current_link_speed="Unknown", max_link_speed="32.0 GT/s PCIe")
    pci(root, "0000:00:14.0", "0x0c0330", current_link_width=1, max_link_width=1)  # USB: not fabric
    pci(root, "0000:3c:00.0", "0x030000")  # integrated: no link files
    return root


def test_a_snapshot_reads_ports_interfaces_and_pcie_links(tmp_path: Path) -> None:
    taken = fabric.snapshot(node_tree(tmp_path, symbol_errors=40))
    assert set(taken["ib"]) == {"mlx5_0/1", "mlx5_1/1", "mlx5_2/1"}
    assert taken["ib"]["mlx5_0/1"] == {"state": "ACTIVE", "phys_state": "LinkUp", "rate_gbps": 200.0,
                                       "counters": IB_ZERO}
    assert taken["ib"]["mlx5_1/1"]["rate_gbps"] == 100.0
    assert taken["ib"]["mlx5_1/1"]["counters"]["symbol_error"] == 40
    assert taken["ib"]["mlx5_2/1"]["state"] == "DOWN" and taken["ib"]["mlx5_2/1"]["phys_state"] == "Disabled"
    assert list(taken["eth"]) == ["eth0", "veth3", "veth4"]  # no lo, no IPoIB, no bonding_masters
    assert taken["eth"]["eth0"] == {"state": "up", "speed_mbps": 100000,
                                    "counters": {"carrier_changes": 1, **ETH_ZERO}}
    assert "speed_mbps" not in taken["eth"]["veth3"] and "speed_mbps" not in taken["eth"]["veth4"]
    assert taken["pcie"] == {
        "0000:3b:00.0": {"role": "gpu", "width": 8, "max_width": 16, "speed_gts": 16.0, "max_speed_gts": 16.0},
        "0000:5e:00.0": {"role": "nic", "width": 16, "max_width": 16, "max_speed_gts": 32.0},
    }
    json.dumps(taken)  # plain data: it is kept between passes


def test_block_rates_counters_per_second_between_two_passes(tmp_path: Path) -> None:
    before = fabric.snapshot(node_tree(tmp_path / "a", symbol_errors=40))
    after = fabric.snapshot(node_tree(tmp_path / "b", symbol_errors=790, link_downed=1))
    out = fabric.block(before, after, 60.0)
    assert out is not None and out["interval_s"] == 60.0
    ports = {p["name"]: p for p in out["ports"]}
    assert ports["mlx5_0/1"] == {"name": "mlx5_0/1", "kind": "ib", "state": "ACTIVE", "phys_state": "LinkUp",
                                 "rate_gbps": 200.0, "per_s": {k: 0.0 for k in fabric.IB_COUNTERS}}
    degraded = ports["mlx5_1/1"]
    assert degraded["rate_gbps"] == 100.0
    assert degraded["per_s"]["symbol_error"] == 12.5 and degraded["per_s"]["port_rcv_errors"] == 6.25
    assert ports["mlx5_2/1"]["state"] == "DOWN" and ports["mlx5_2/1"]["per_s"]["link_downed"] == 0.016667
    assert ports["eth0"] == {"name": "eth0", "kind": "eth", "state": "up", "rate_gbps": 100.0,
                             "per_s": {k: 0.0 for k in fabric.ETH_COUNTERS}}
    assert "rate_gbps" not in ports["veth3"] and ports["veth3"]["state"] == "down"
    assert out["pcie"][0] == {"device": "0000:3b:00.0", "role": "gpu", "width": 8, "max_width": 16,
                              "speed_gts": 16.0, "max_speed_gts": 16.0}
    assert out["pcie"][1] == {"device": "0000:5e:00.0", "role": "nic", "width": 16, "max_width": 16,
                              "max_speed_gts": 32.0}
    event = parse_record({"type": "node", "v": 1, "event": "health", "node": "n1", "time": 1.0, "fabric": out})
    assert event.fabric is not None and event.fabric.ports[1].per_s.symbol_error == 12.5


def test_one_count_over_the_longest_interval_is_not_rounded_away(tmp_path: Path) -> None:
    before = fabric.snapshot(node_tree(tmp_path / "a"))
    after = fabric.snapshot(node_tree(tmp_path / "b", link_downed=1))
    out = fabric.block(before, after, fabric.MAX_INTERVAL_S)
    assert {p["name"]: p for p in out["ports"]}["mlx5_2/1"]["per_s"]["link_downed"] > 0


def test_no_rates_without_a_usable_previous_pass(tmp_path: Path) -> None:
    now = fabric.snapshot(node_tree(tmp_path / "b", symbol_errors=90))
    earlier = fabric.snapshot(node_tree(tmp_path / "a"))
    for previous, seconds in ((None, None), (earlier, None), (earlier, 0.0), (earlier, -5.0),
                              (earlier, fabric.MAX_INTERVAL_S + 1), ({**earlier, "boot_id": "other boot"}, 60.0)):
        out = fabric.block(previous, now, seconds)
        assert out is not None and "interval_s" not in out
        assert all("per_s" not in p for p in out["ports"]), (previous is None, seconds)
        assert {p["name"]: p for p in out["ports"]}["mlx5_1/1"]["rate_gbps"] == 100.0


def test_a_counter_that_went_backwards_or_a_new_port_has_no_rate(tmp_path: Path) -> None:
    before = fabric.snapshot(node_tree(tmp_path / "a", symbol_errors=500, rx_crc=7))
    after = fabric.snapshot(node_tree(tmp_path / "b", symbol_errors=20, rx_crc=9))  # mlx5_1 was reset
    del before["ib"]["mlx5_0/1"]  # a port that came up since the last pass
    ports = {p["name"]: p for p in fabric.block(before, after, 2.0)["ports"]}
    assert "symbol_error" not in ports["mlx5_1/1"]["per_s"] and "port_rcv_errors" not in ports["mlx5_1/1"]["per_s"]
    assert ports["mlx5_1/1"]["per_s"]["link_downed"] == 0.0
    assert "per_s" not in ports["mlx5_0/1"]
    assert ports["eth0"]["per_s"]["rx_crc_errors"] == 1.0


def test_odd_files_are_skipped_never_raised(tmp_path: Path) -> None:
    ib_port(tmp_path, "mlx5_0", state="", symbol_error=3)
    counters = tmp_path / "sys/class/infiniband/mlx5_0/ports/1/counters"
    (counters / "port_rcv_errors").write_text("lots\n")
    (counters / "link_downed").unlink()
    (counters / "port_xmit_wait").write_bytes(b"\xff\xfe\n")
    (counters / "port_xmit_discards").write_text(f"{2**64}\n")  # no 64-bit counter reads that
    (tmp_path / "sys/class/infiniband/mlx5_0/ports/1/rate").write_text("9" * 400 + " Gb/sec\n")
    eth(tmp_path, "eth0", speed=4294967295)  # some drivers' unsigned -1
    pci(tmp_path, "0000:3b:00.0", "0x030200", current_link_width="x16", max_link_width=99,
        current_link_speed="8 GT/s", max_link_speed="garbage")
    pci(tmp_path, "0000:3b:00.1", "nonsense", current_link_width=16)
    # Names no kernel gives, that the wire would refuse (and the whole health event with them).
    ib_port(tmp_path, "m" * 254)  # "m…m/1": 256 characters
    eth(tmp_path, "tab\tbed")
    eth(tmp_path, os.fsdecode(b"eth\xff"))
    taken = fabric.snapshot(tmp_path)
    assert list(taken["ib"]) == ["mlx5_0/1"] and list(taken["eth"]) == ["eth0"]
    assert taken["ib"]["mlx5_0/1"] == {"phys_state": "LinkUp", "counters": {
        "symbol_error": 3, "link_error_recovery": 0}}
    assert "speed_mbps" not in taken["eth"]["eth0"]
    assert taken["pcie"] == {"0000:3b:00.0": {"role": "gpu", "speed_gts": 8.0}}
    assert fabric.snapshot(tmp_path / "nothing here") == {}
    assert fabric.block(None, {}, None) is None


def test_everything_is_bounded_to_what_the_wire_takes(tmp_path: Path) -> None:
    assert fabric.MAX_ITEMS == MAX_FABRIC_ITEMS and fabric.MAX_NAME == MAX_ID
    for i in range(70):
        ib_port(tmp_path, f"mlx5_{i:02d}")
        eth(tmp_path, f"veth{i:02d}")
        pci(tmp_path, f"0000:{i:02x}:00.0", "0x020000", current_link_width=16, max_link_width=16)
    for i in range(3):
        pci(tmp_path, f"0000:f{i}:00.0", "0x030200", current_link_width=16, max_link_width=16)
    eth(tmp_path, "enp1s0")
    (tmp_path / "sys/class/net/enp1s0/device").mkdir()  # a physical NIC is kept before the veths
    taken = fabric.snapshot(tmp_path)
    assert len(taken["ib"]) == len(taken["eth"]) == len(taken["pcie"]) == 64
    assert "enp1s0" in taken["eth"]
    assert sum(1 for link in taken["pcie"].values() if link["role"] == "gpu") == 3
    out = fabric.block(taken, taken, 60.0)
    assert [p["kind"] for p in out["ports"]] == ["ib"] * 64  # one list of both kinds, InfiniBand first
    del taken["ib"]["mlx5_00/1"]
    out = fabric.block(taken, taken, 60.0)
    assert [p["name"] for p in out["ports"] if p["kind"] == "eth"] == ["enp1s0"]  # then physical NICs
    event = {"type": "node", "v": 1, "event": "health", "node": "n1", "time": 1.0, "fabric": out}
    assert len(parse_record(event).fabric.ports) == len(parse_record(event).fabric.pcie) == MAX_FABRIC_ITEMS


def test_remember_and_previous_keep_one_pass(tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert fabric.previous(state, "n1") is None
    fabric.remember(state, "n1", {"ib": {"mlx5_0/1": {"counters": {"symbol_error": 4}}}}, 1000.0)
    assert fabric.previous(state, "n1") == (1000.0, {"ib": {"mlx5_0/1": {"counters": {"symbol_error": 4}}}})
    assert [p.name for p in state.iterdir()] == ["fabric.n1.json"]  # no temporary file left behind
    for corrupt in ("{not json", "[1, 2]", '{"time": "yesterday", "snapshot": {}}', '{"time": 5}', ""):
        (state / "fabric.n1.json").write_text(corrupt)
        assert fabric.previous(state, "n1") is None, corrupt
    (state / "fabric.n1.json").write_bytes(b"\xff\xfe")
    assert fabric.previous(state, "n1") is None


def test_this_machine_reads_without_raising_into_a_block_the_wire_takes() -> None:
    taken = fabric.snapshot()
    assert json.loads(json.dumps(taken)) == taken
    out = fabric.block(taken, fabric.snapshot(), 1.0)
    event = {"type": "node", "v": 1, "event": "health", "node": "n1", "time": 1.0}
    if out is not None:
        event["fabric"] = json.loads(json.dumps(out))
    assert isinstance(parse_record(event), NodeEvent)


def test_two_node_check_passes_send_fabric_with_rates(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(artemis_node, "host_snapshot", lambda interval_s=0.2: None)
    cfg = artemis_node.NodeConfig(state_dir=str(tmp_path / "state"), telemetry="none", node_probe=False)
    node_tree(tmp_path / "root", symbol_errors=10)
    [first] = nodecheck.check(cfg, "n3", sysfs_root=tmp_path / "root")
    assert "interval_s" not in first["fabric"] and {p["name"] for p in first["fabric"]["ports"]} >= {"mlx5_1/1"}
    node_tree(tmp_path / "root", symbol_errors=1000)
    [second] = nodecheck.check(cfg, "n3", sysfs_root=tmp_path / "root")
    event = parse_record(second)
    assert event.event == "health" and event.fabric is not None and event.fabric.interval_s > 0
    degraded = {p.name: p for p in event.fabric.ports}["mlx5_1/1"]
    assert degraded.rate_gbps == 100.0 and degraded.per_s.symbol_error > 0
    assert [link.width for link in event.fabric.pcie] == [8, 16]


def test_a_failing_fabric_read_never_fails_the_node_check(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(artemis_node, "host_snapshot", lambda interval_s=0.2: None)

    def broken(root: Path) -> dict:
        raise RuntimeError("sysfs on fire")

    monkeypatch.setattr(fabric, "snapshot", broken)
    cfg = artemis_node.NodeConfig(state_dir=str(tmp_path / "state"), telemetry="none", node_probe=False)
    [health] = nodecheck.check(cfg, "n3", sysfs_root=tmp_path)
    assert health["event"] == "health" and "fabric" not in health
    assert "fabric evidence skipped: RuntimeError: sysfs on fire" in capsys.readouterr().err


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_dry_run_reads_the_last_pass_and_keeps_nothing(tmp_path: Path, monkeypatch, dry_run: bool) -> None:
    monkeypatch.setattr(artemis_node, "host_snapshot", lambda interval_s=0.2: None)
    cfg = artemis_node.NodeConfig(state_dir=str(tmp_path / "state"), telemetry="none", node_probe=False)
    node_tree(tmp_path / "root")
    nodecheck.check(cfg, "n3", dry_run=dry_run, sysfs_root=tmp_path / "root")
    assert (tmp_path / "state" / "fabric.n3.json").exists() is not dry_run
