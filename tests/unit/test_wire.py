"""Wire contract v1: what is accepted, what is rejected, and how errors read."""

import json

import pytest

from artemisd.wire import NodeEvent, ReportError, TraceReader, WindowReport, dump_record, parse_line, parse_record

DESIGN_EXAMPLE = {
    "type": "window", "v": 1, "job": "4242", "step": "0", "rank": 2, "world": 8, "node": "n2",
    "device": {"vendor": "nvidia", "model": "NVIDIA H100 80GB HBM3", "index": 0, "uuid": "GPU-1"},
    "island": "nvidia",
    "window": {"seq": 37, "first_step": 1850, "steps": 50, "t0": 1764683000.12, "t1": 1764683005.45},
    "ms": {"step": 106.6, "busy": 50.3, "compute": 49.1, "data": 1.2, "comm_wait": 56.3},
    "ms_p50": {"step": 106.1, "busy": 50.0},
    "samples": 1600,
    "collectives": [{"op": "all_reduce", "group": "world", "calls": 50, "bytes": 2.1e9, "ms": 2815.0}],
    "gpu": {"sm_clock_mhz": 1410, "max_sm_clock_mhz": 1980, "power_w": 512, "power_limit_w": 700,
            "default_power_limit_w": 700, "temp_c": 71, "util_pct": 97, "throttle": ["sw_thermal"],
            "ecc_uncorrected": 0, "pcie_replay": 0},
    "host": {"cpu_pct": 96.0, "steal_pct": 0.0, "iowait_pct": 0.3, "ctx_invol_per_s": 12.0,
             "net_retransmits_per_s": 0.0},
    "env": {"driver": "550.54.15", "comm_lib": "nccl 2.21.5", "torch": "2.5.1", "config": "sha256:ab"},
}
NODE_EXAMPLE = {
    "type": "node", "v": 1, "event": "job_start", "job": "4242", "node": "n2", "time": 1764682990.0,
    "fingerprint": {"driver": "550.54.15", "comm_lib": "nccl 2.21.5", "kernel": "6.1.0", "firmware": "96.00"},
    "gpus": [{"index": 0, "vendor": "nvidia", "model": "H100", "uuid": "GPU-1", "sm_clock_mhz": 1980,
              "max_sm_clock_mhz": 1980, "power_limit_w": 700, "default_power_limit_w": 700, "temp_c": 35}],
    "probe": {"gemm_tflops": [700.0], "membw_gbs": [3000.0]},
}


def with_(base, **changes):
    out = json.loads(json.dumps(base))
    for dotted, value in changes.items():
        target = out
        *path, last = dotted.split("__")
        for part in path:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if value is KeyError:
            del target[last]
        else:
            target[last] = value
    return out


def test_design_examples_parse():
    report = parse_record(DESIGN_EXAMPLE)
    assert isinstance(report, WindowReport)
    assert report.island_key == "nvidia"
    assert report.gpu.throttle == ("sw_thermal",)
    event = parse_record(NODE_EXAMPLE)
    assert isinstance(event, NodeEvent) and event.fingerprint.driver == "550.54.15"


def test_unknown_fields_are_ignored_and_missing_means_not_measured():
    report = parse_record(with_(DESIGN_EXAMPLE, future_field={"x": 1}, gpu=KeyError, host=KeyError))
    assert report.gpu is None and report.host is None
    assert "future_field" not in dump_record(report)


def test_busy_is_derived_from_step_and_comm_wait():
    report = parse_record(with_(DESIGN_EXAMPLE, ms__busy=KeyError))
    assert report.ms.busy == pytest.approx(106.6 - 56.3)


def test_island_defaults_to_vendor_and_model():
    report = parse_record(with_(DESIGN_EXAMPLE, island=KeyError))
    assert report.island_key == "nvidia:NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(
    ("changes", "field", "reason"),
    [
        ({"ms__busy": KeyError, "ms__comm_wait": KeyError}, "ms", "needs busy or comm_wait"),
        ({"ms__busy": 80.0}, "ms", "must equal step - comm_wait"),
        ({"rank": 8}, "<record>", "not below world"),
        ({"gpu__throttle": ["too_hot"]}, "gpu.throttle.0", "Input should be"),
        ({"window__t1": 1.0}, "window", "before t0"),
        ({"ms__step": -1}, "ms.step", "greater than or equal"),
        ({"v": 2}, "v", "unsupported wire version"),
        ({"job": ""}, "job", "at least 1"),
    ],
)
def test_bad_reports_name_field_and_reason(changes, field, reason):
    with pytest.raises(ReportError) as err:
        parse_record(with_(DESIGN_EXAMPLE, **changes), where="t.jsonl:7")
    text = str(err.value)
    assert text.startswith("t.jsonl:7: ")
    assert any(path == ("" if field == "<record>" else field) and reason in why
               for path, why in err.value.problems), err.value.problems


def test_non_object_and_non_json_lines():
    with pytest.raises(ReportError, match="expected a JSON object"):
        parse_record([1, 2])
    with pytest.raises(ReportError, match="not JSON"):
        parse_line("{nope")


def test_trace_reader_reports_file_line_and_keeps_the_rest(tmp_path):
    trace = tmp_path / "trace.jsonl"
    good = json.dumps(DESIGN_EXAMPLE)
    trace.write_text("\n".join([good, "{broken", json.dumps(with_(DESIGN_EXAMPLE, rank=-1)), "",
                                json.dumps(NODE_EXAMPLE), good]) + "\n")
    reader = TraceReader(trace)
    records = list(reader)
    assert [type(r).__name__ for r in records] == ["WindowReport", "NodeEvent", "WindowReport"]
    assert reader.rejected == 2
    assert [e.where for e in reader.errors] == [f"{trace}:2", f"{trace}:3"]
    assert "rank" in str(reader.errors[1])


def test_dump_round_trips():
    report = parse_record(DESIGN_EXAMPLE)
    assert parse_line(dump_record(report)) == report


FABRIC_EXAMPLE = {
    "interval_s": 60.0,
    "ports": [{"name": "mlx5_0/1", "kind": "ib", "state": "ACTIVE", "phys_state": "LinkUp", "rate_gbps": 100.0,
               "per_s": {"symbol_error": 12.5, "link_error_recovery": 0.0, "link_downed": 0.0,
                         "port_rcv_errors": 6.25, "port_xmit_discards": 0.0, "port_xmit_wait": 310.0}},
              {"name": "eth0", "kind": "eth", "state": "up", "rate_gbps": 100.0,
               "per_s": {"carrier_changes": 0.0, "rx_crc_errors": 0.0, "rx_errors": 0.0, "tx_errors": 0.0,
                         "rx_dropped": 0.0}},
              {"name": "veth3", "kind": "eth", "state": "down"}],
    "pcie": [{"device": "0000:3b:00.0", "role": "gpu", "width": 8, "max_width": 16, "speed_gts": 16.0,
              "max_speed_gts": 16.0},
             {"device": "0000:5e:00.0", "role": "nic", "width": 16, "max_width": 16, "max_speed_gts": 32.0}],
}
HEALTH_EXAMPLE = {**{k: v for k, v in NODE_EXAMPLE.items() if k not in ("job", "probe")},
                  "event": "health", "fabric": FABRIC_EXAMPLE}


def test_a_fabric_block_round_trips_with_the_rest_of_the_health_event():
    event = parse_record(HEALTH_EXAMPLE)
    assert event.fabric.interval_s == 60.0 and event.fabric.ports[0].per_s.symbol_error == 12.5
    assert event.fabric.ports[2].per_s is None and event.fabric.pcie[1].speed_gts is None
    assert event.gpus[0].max_sm_clock_mhz == 1980 and event.fingerprint.kernel == "6.1.0"
    assert parse_line(dump_record(event)) == event
    assert json.loads(dump_record(event))["fabric"] == FABRIC_EXAMPLE
    assert parse_record(with_(HEALTH_EXAMPLE, fabric=KeyError)).fabric is None  # not measured


@pytest.mark.parametrize(
    ("changes", "field", "reason"),
    [
        ({"fabric__ports__0__rate_gbps": -100.0}, "fabric.ports.0.rate_gbps", "greater than or equal"),
        ({"fabric__ports__1__kind": "fc"}, "fabric.ports.1.kind", "Input should be 'ib' or 'eth'"),
        ({"fabric__ports": [FABRIC_EXAMPLE["ports"][1]] * 65}, "fabric.ports", "at most 64"),
        ({"fabric__pcie": [FABRIC_EXAMPLE["pcie"][0]] * 65}, "fabric.pcie", "at most 64"),
        ({"fabric__ports__0__per_s__port_rcv_errors": float("nan")}, "fabric.ports.0.per_s.port_rcv_errors",
         "finite"),
        ({"fabric__ports__0__name": ""}, "fabric.ports.0.name", "at least 1"),
        ({"fabric__ports__0__state": "x" * 33}, "fabric.ports.0.state", "at most 32"),
        ({"fabric__pcie__0__role": "disk"}, "fabric.pcie.0.role", "Input should be 'gpu' or 'nic'"),
        ({"fabric__pcie__0__width": 65}, "fabric.pcie.0.width", "less than or equal to 64"),
        ({"fabric__pcie__1__max_speed_gts": -1}, "fabric.pcie.1.max_speed_gts", "greater than or equal"),
        ({"fabric__interval_s": -60.0}, "fabric.interval_s", "greater than or equal"),
    ],
)
def test_a_bad_fabric_block_is_refused_naming_the_field(changes, field, reason):
    with pytest.raises(ReportError) as err:
        parse_record(with_(HEALTH_EXAMPLE, **changes), where="t.jsonl:3")
    assert any(path == field and reason in why for path, why in err.value.problems), err.value.problems


def test_a_counter_the_daemon_does_not_know_is_ignored_like_any_unknown_field():
    # A node check newer than the daemon keeps its health event, GPU evidence and all.
    event = parse_record(with_(HEALTH_EXAMPLE, fabric__ports__0__per_s__lane_errors=3.0))
    assert event.fabric.ports[0].per_s.symbol_error == 12.5 and event.gpus is not None


def test_a_bad_fabric_block_costs_its_own_line_only(tmp_path):
    trace = tmp_path / "trace.jsonl"
    bad = with_(HEALTH_EXAMPLE, fabric__ports__0__kind="fc")
    trace.write_text("\n".join(json.dumps(r) for r in (HEALTH_EXAMPLE, bad, NODE_EXAMPLE, DESIGN_EXAMPLE)) + "\n")
    reader = TraceReader(trace)
    records = list(reader)
    assert [type(r).__name__ for r in records] == ["NodeEvent", "NodeEvent", "WindowReport"]
    assert records[0].fabric is not None and records[1].fabric is None
    assert [e.where for e in reader.errors] == [f"{trace}:2"] and "fabric.ports.0.kind" in str(reader.errors[0])
