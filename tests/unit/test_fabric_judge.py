"""What a node's fabric block convicts: receive-side counters, port state and rate, PCIe training,
each read against the job's other nodes (artemisd/fabric.py)."""

from artemisd import fabric


def ib(name="mlx5_0/1", state="ACTIVE", rate=200.0, **per_s):
    port = {"name": name, "kind": "ib", "state": state, "phys_state": "LinkUp", "rate_gbps": rate}
    if per_s:
        port["per_s"] = per_s
    return port


def event(*ports, pcie=()):
    return {"fabric": {"interval_s": 60.0, "ports": list(ports), "pcie": list(pcie)}}


def healthy_peers(n=4, **per_s):
    return [event(ib(symbol_error=0.0, port_rcv_errors=0.0, **per_s)) for _ in range(n)]


def signals(found):
    return [(f.signal, f.where) for f in found]


def test_a_clean_node_and_one_without_a_block_show_nothing():
    assert fabric.findings(event(ib(symbol_error=0.0, port_xmit_wait=0.0)), healthy_peers()) == []
    assert fabric.findings({"host": {"net_retransmits_per_s": 90.0}}) == []
    assert fabric.findings(None) == [] and fabric.shown(None) is None


def test_receive_side_errors_convict_with_the_peers_value_beside():
    [found] = fabric.findings(event(ib(symbol_error=12.5, port_rcv_errors=0.0)), healthy_peers())
    assert (found.signal, found.where, found.value, found.peers) == ("fabric.symbol_error", "mlx5_0/1", 12.5, 0.0)
    assert fabric.shown(event(ib(symbol_error=12.5)), healthy_peers()) == "mlx5_0/1 symbol_error 12.5/s (peers 0.0)"


def test_transmit_side_counters_are_never_a_finding():
    # A sender to a slow link waits and discards: that says the *other* end is slow.
    busy_sender = event(ib(port_xmit_wait=5000.0, port_xmit_discards=40.0),
                        {"name": "eth0", "kind": "eth", "state": "up", "per_s": {"tx_errors": 9.0, "rx_dropped": 50.0}})
    assert fabric.findings(busy_sender, healthy_peers()) == []


def test_a_rate_below_the_floor_or_a_fabric_wide_storm_is_not_a_finding():
    assert fabric.findings(event(ib(symbol_error=0.2)), healthy_peers()) == []
    storm = [event(ib(symbol_error=10.0)) for _ in range(4)]
    assert fabric.findings(event(ib(symbol_error=12.0)), storm) == []
    # Without peers the absolute floor alone decides.
    assert signals(fabric.findings(event(ib(symbol_error=12.0)))) == [("fabric.symbol_error", "mlx5_0/1")]


def test_a_link_that_went_down_in_the_interval_counts_at_any_rate_unless_every_peer_flapped_too():
    assert signals(fabric.findings(event(ib(link_downed=1 / 60)), healthy_peers(link_downed=0.0))) == \
        [("fabric.link_downed", "mlx5_0/1")]
    flapping = [event(ib(link_downed=1 / 60)) for _ in range(3)]
    assert fabric.findings(event(ib(link_downed=1 / 60)), flapping) == []


def test_a_port_down_where_its_peers_is_up_and_one_trained_slow():
    assert signals(fabric.findings(event(ib(state="DOWN")), healthy_peers())) == [("fabric.state", "mlx5_0/1")]
    # A port that is down on every node is one no job uses; without peers a spare port and a failed one
    # look alike (the test cluster's nodes each have a down ifb0).
    unused = [event(ib(state="DOWN")) for _ in range(4)]
    assert fabric.findings(event(ib(state="DOWN")), unused) == []
    assert fabric.findings(event(ib(state="DOWN"))) == []
    spare = {"name": "ifb0", "kind": "eth", "state": "down", "per_s": {"rx_errors": 0.0}}
    assert fabric.findings(event(ib(), spare), [event(ib(), spare)] * 3) == []
    [slow] = fabric.findings(event(ib(rate=100.0)), healthy_peers())
    assert (slow.signal, slow.value, slow.peers) == ("fabric.rate_gbps", 100.0, 200.0)
    # A rate alone says nothing without peers to compare with.
    assert fabric.findings(event(ib(rate=100.0))) == []


def test_pcie_downtrained_width_counts_a_gpus_idle_speed_does_not():
    nic_x8 = {"device": "0000:3b:00.0", "role": "nic", "width": 8, "max_width": 16, "speed_gts": 16.0,
              "max_speed_gts": 16.0}
    [found] = fabric.findings(event(pcie=[nic_x8]))
    assert (found.signal, found.value, found.peers) == ("fabric.pcie_width", 8, 16)
    idle_gpu = {"device": "0000:1b:00.0", "role": "gpu", "width": 16, "max_width": 16, "speed_gts": 2.5,
                "max_speed_gts": 16.0}
    assert fabric.findings(event(pcie=[idle_gpu])) == []
    busy = {**idle_gpu, "speed_gts": 16.0}
    assert signals(fabric.findings(event(pcie=[idle_gpu]), [event(pcie=[busy])] * 3)) == \
        [("fabric.pcie_speed", "gpu 0000:1b:00.0")]
    slow_nic = {**nic_x8, "width": 16, "speed_gts": 8.0}
    assert signals(fabric.findings(event(pcie=[slow_nic]))) == [("fabric.pcie_speed", "nic 0000:3b:00.0")]
