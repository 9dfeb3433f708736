"""The ingest fast path (``ingest.fast_records``) against the careful path it stands in for.

``fast_records`` may only ever say what ``validate(decode_body(body))`` says
with nothing rejected: the same records, field for field (name, value and
type of every value), and an encoding that parses back to the careful path's
record.
Every body it does not take (None) goes through the careful path, which names
each bad item's field and reason.  So the properties checked here are:

* on clean simulator windows (every block, probe results, absent optional
  fields), the fast path takes the body and its records equal the careful
  path's;
* on thousands of hostile items (the generator of test_ingest_fuzz: values at
  and past every bound, NaN/Infinity, lone surrogates, invalid UTF-8, deep
  nesting, wrong types, unknown fields), whenever the fast path takes a body
  the careful path accepts every item of it, with equal records;
* the bounds the fast path checks in Python (busy vs step and comm_wait, t1
  after t0, rank below world, MaxWorld) and the string bounds at their edge.

And ``WindowFrame.from_reports``, rewritten as one pass, equals a
column-by-column reading of the reports.
"""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
from pydantic import BaseModel

from artemisd.frame import TELEMETRY_COLUMNS, THROTTLE_BIT, THROTTLE_UNMEASURED, WindowFrame
from artemisd.ingest import FastReport, IngestError, decode_body, fast_records, validate
from artemisd.sim.fleet import simulate_records, single_job
from artemisd.store import batch_items
from artemisd.sim.spec import FaultSpec, IslandSpec, JobSpec
from artemisd.wire import DEFAULT_MAX_WORLD, MAX_ID, WindowReport, dump_record, parse_record, with_step
from tests.unit.test_ingest_fuzz import KINDS, TEMPLATE, hostile


def careful(body: bytes, max_world: int = DEFAULT_MAX_WORLD):
    """(records, rejected) of the careful path, or None where it refuses the body as a whole."""
    try:
        items = decode_body(body)
    except IngestError:
        return None
    return validate(items, {"max_world": max_world}, lambda err: f"unforeseen {err!r}")


def assert_same(fast, slow) -> None:
    records, rejected = slow
    assert rejected == []
    assert [i for i, _ in fast] == [i for i, _ in records]
    for (_, a), (_, b) in zip(fast, records):
        assert type(a) is FastReport and type(b) is WindowReport
        assert_same_record(a, b)


def assert_same_record(fast, model, path: str = "") -> None:
    """Every field of the wire model ``model`` reads the same on ``fast`` (value and type, block by
    block), and ``fast`` encoded parses back to ``model``: what the daemon reads by attribute and what
    it stores are the careful path's."""
    for name in type(model).model_fields:
        a, b = getattr(fast, name), getattr(model, name)
        where = f"{path}{name}"
        if isinstance(b, BaseModel):
            assert a is not None, where
            assert_same_record(a, b, f"{where}.")
        elif isinstance(b, tuple) and b and isinstance(b[0], BaseModel):
            assert type(a) is tuple and len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b)):
                assert_same_record(x, y, f"{where}.{i}.")
        else:
            assert a == b and type(a) is type(b), (where, a, b)
    if not path:
        assert parse_record(json.loads(dump_record(fast)), context={"max_world": model.world}) == model


def sim_windows(seed: int, ranks: int = 24) -> list[list[dict]]:
    job = JobSpec(job=f"j{seed}", islands=(IslandSpec(ranks=ranks),), windows=6,
                  faults=(FaultSpec(cause="gpu.clocks", rank=ranks // 3, onset=3, magnitude=0.3),))
    records, _ = simulate_records(single_job(job, seed=seed))
    by_window: dict[int, list[dict]] = {}
    for rec in records:
        if rec.get("type") == "window":
            by_window.setdefault(rec["window"]["seq"], []).append(rec)
    return [by_window[s] for s in sorted(by_window)]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_clean_simulator_windows_take_the_fast_path_with_the_careful_paths_records(seed):
    rng = random.Random(seed)
    for window in sim_windows(seed):
        for rec in window:  # absent optional fields and blocks, as older or leaner probes send them
            for key in ("gpu", "host", "env", "ms_p50", "samples", "collectives", "device", "island", "step"):
                if rng.random() < 0.2:
                    rec.pop(key, None)
            if rng.random() < 0.3:
                rec["ms"].pop("busy")  # derived from step - comm_wait
            if rng.random() < 0.2:
                rec["probe"] = {"id": "p1", "gemm_ms": 3.5, "served_wait_ms": 0.4,
                                "p2p": [{"peer": 1, "ms": 2.0, "node": "n1", "wait_ms": 0.3}]}
            if "gpu" in rec and rng.random() < 0.3:
                rec["gpu"]["throttle"] = ["sw_thermal", "idle"]
            if rng.random() < 0.2:
                rec["rebalance_opt_in"] = True
                rec["dropped_reports"] = 3
        body = json.dumps(window).encode()
        fast = fast_records(body)
        assert fast is not None
        assert_same(fast, careful(body))


def test_hostile_items_the_fast_path_takes_are_exactly_what_the_careful_path_accepts():
    """6,000 hostile items (test_ingest_fuzz's generator), each alone and beside a good report."""
    good = json.dumps(TEMPLATE).encode()
    taken = refused = 0
    for seed in range(6_000):
        kind = KINDS[seed % len(KINDS)]
        item = hostile(kind, seed, [None, 0, -1, 2**63, 1.5, "x", "\ud800"][seed % 7])
        for body in (b"[" + item + b"]", b"[" + good + b", " + item + b"]"):
            fast = fast_records(body)
            slow = careful(body)
            if fast is None:
                refused += 1
                continue
            taken += 1
            assert slow is not None, body
            assert_same(fast, slow)
    # Both sides exercised: some hostile values sit inside the bounds, most do not.
    assert taken > 100 and refused > 5_000, (taken, refused)


def report(**changes) -> dict:
    rec = copy.deepcopy(TEMPLATE)
    for path, value in changes.items():
        *parents, last = path.split("__")
        holder = rec
        for key in parents:
            holder = holder[key]
        if value is _DROP:
            holder.pop(last, None)
        else:
            holder[last] = value
    return rec


_DROP = object()


@pytest.mark.parametrize("changes, why", [
    ({"ms__busy": _DROP, "ms__comm_wait": _DROP}, "needs busy or comm_wait"),
    ({"ms__busy": 80.0, "ms__step": 70.0, "ms__comm_wait": _DROP}, "busy (80.0) exceeds step"),
    ({"ms__busy": 10.0}, "must equal step - comm_wait"),
    ({"window__t1": 1.0, "window__t0": 2.0}, "is before t0"),
    ({"rank": 4, "world": 4}, "is not below world"),
    ({"world": DEFAULT_MAX_WORLD + 1, "rank": 0}, "is above MaxWorld"),
    ({"job": 4242}, None),  # valid (a number coerced to its text): the careful path's business
    ({"extension": {"x": 1}}, None),  # unknown field: ignored, by the careful path
    ({"samples": 3}, "OK"),  # an int where a float goes: the fast path takes it as pydantic does
    ({"job": "é" * MAX_ID}, "OK"),  # MAX_ID characters, not bytes
    ({"job": "😀" * MAX_ID}, "OK"),
    ({"job": "é" * (MAX_ID + 1)}, "at most 255 characters"),
    ({"env__driver": "x" * 1024}, "OK"),
    ({"env__driver": "x" * 1025}, "at most 1024 characters"),
    ({"ms_p50__" + "k" * 33: 1.0}, "at most 32 characters"),
    ({"gpu": {"throttle": ["idle"] * 9}}, "at most 8 items"),
    ({"gpu": {"temp_c": -5.0, "util_pct": 100}}, "OK"),
    ({"gpu": {"util_pct": 100.5}}, "less than or equal to 100"),
])
def test_each_cross_field_and_edge_bound_either_passes_both_paths_or_goes_the_careful_way(changes, why):
    body = json.dumps([report(**changes)]).encode()
    fast, slow = fast_records(body), careful(body)
    records, rejected = slow
    if why == "OK":
        assert fast is not None
        assert_same(fast, slow)
        return
    assert fast is None
    if why is None:
        assert rejected == [] and len(records) == 1
    else:
        assert records == [] and why in rejected[0]["error"]


def test_max_world_is_the_daemons():
    body = json.dumps([report(world=100_000, rank=99_999)]).encode()
    assert fast_records(body) is None
    fast = fast_records(body, max_world=100_000)
    assert_same(fast, careful(body, max_world=100_000))


@pytest.mark.parametrize("body", [
    b"",
    json.dumps(TEMPLATE).encode(),  # one object, not an array
    (json.dumps(TEMPLATE) + "\n" + json.dumps(TEMPLATE)).encode(),  # JSON Lines
    json.dumps([TEMPLATE, {"type": "node", "v": 1, "event": "health", "node": "a", "time": 1.0}]).encode(),
    json.dumps([{k: v for k, v in TEMPLATE.items() if k != "type"}]).encode(),
    b"[" + json.dumps(TEMPLATE).encode() + b", NaN]",
])
def test_anything_but_a_clean_array_of_window_reports_goes_the_careful_way(body):
    assert fast_records(body) is None


def test_an_empty_array_is_nothing_on_both_paths():
    assert fast_records(b" [ ]\n") == [] and careful(b" [ ]\n") == ([], [])


# --- WindowFrame.from_reports ------------------------------------------------

def nan(value) -> float:
    return np.nan if value is None else float(value)


def test_frame_gathered_in_one_pass_equals_each_column_read_from_the_reports():
    rng = random.Random(5)
    window = sim_windows(4, ranks=64)[-1]
    for rec in window:
        for key in ("gpu", "host", "env", "ms_p50", "samples", "collectives", "device", "island"):
            if rng.random() < 0.3:
                rec.pop(key, None)
        if "gpu" in rec and rng.random() < 0.5:
            rec["gpu"]["throttle"] = rng.sample(["sw_thermal", "idle", "hw_slowdown"], 2)
        if "host" in rec and rng.random() < 0.5:
            rec["host"].pop("cpu_pct")
        if "ms_p50" in rec and rng.random() < 0.5:
            rec["ms_p50"].pop("busy")
        if rng.random() < 0.5:
            rec["ms"].pop("compute")
    reports = sorted((parse_record(r) for r in window), key=lambda r: r.rank)
    frame = WindowFrame.from_reports(reports)

    def column(values, dtype=np.float64):
        return np.array(values, dtype=dtype)

    expected = {
        "rank": column([r.rank for r in reports], np.int64),
        "busy": column([r.ms.busy for r in reports]),
        "step": column([r.ms.step for r in reports]),
        "comm_wait": column([nan(r.ms.comm_wait) for r in reports]),
        "compute": column([nan(r.ms.compute) for r in reports]),
        "data": column([nan(r.ms.data) for r in reports]),
        "samples": column([nan(r.samples) for r in reports]),
        "busy_p50": column([nan((r.ms_p50 or {}).get("busy")) for r in reports]),
        "step_p50": column([nan((r.ms_p50 or {}).get("step")) for r in reports]),
        "seconds": column([r.window.seconds for r in reports]),
        "steps": column([r.window.steps for r in reports], np.int64),
        "first_step": column([r.window.first_step for r in reports], np.int64),
        "throttle": column([THROTTLE_UNMEASURED if r.gpu is None or r.gpu.throttle is None
                            else sum(THROTTLE_BIT[t] for t in set(r.gpu.throttle)) for r in reports], np.int64),
    }
    for name, values in expected.items():
        got = getattr(frame, name)
        assert got.dtype == values.dtype and got.flags.c_contiguous, name
        np.testing.assert_array_equal(got, values, err_msg=name)
    assert list(frame.telemetry) == list(TELEMETRY_COLUMNS)
    for name, (block, attr) in TELEMETRY_COLUMNS.items():
        np.testing.assert_array_equal(frame.telemetry[name], column(
            [nan(getattr(getattr(r, block), attr)) if getattr(r, block) is not None else None for r in reports]),
            err_msg=name)
    assert [frame.island_names[c] for c in frame.island] == [r.island_key for r in reports]
    assert [frame.node_names[c] for c in frame.node] == [r.node for r in reports]
    for attr, (codes, names) in frame.env.items():
        assert [names[c] for c in codes] == [getattr(r.env, attr) if r.env else None for r in reports]
    groups: dict[str, list[float]] = {}
    for r in reports:
        for c in r.collectives or ():
            groups.setdefault(c.group, []).append(c.ms / r.window.steps)
    assert frame.collectives == {g: float(np.median(v)) for g, v in groups.items()}
    assert (frame.job, frame.job_step, frame.seq, frame.world) == (
        reports[0].job, reports[0].step, reports[0].window.seq, reports[0].world)


def test_the_items_own_text_parses_back_to_the_record_the_fast_path_made():
    window = sim_windows(7)[-1]
    window[0]["ms"].pop("busy")  # derived again when the text is read back
    window[1]["env"]["driver"] = "caf\u00e9 \U0001f600"
    body = json.dumps(window, indent=1).encode()  # the sender's spacing is kept, and harmless
    texts = batch_items(body)
    records = fast_records(body)
    assert len(texts) == len(records) == len(window)
    for text, (_, rec) in zip(texts, records):
        assert_same_record(rec, parse_record(json.loads(text)))


def test_a_fast_record_under_another_step_is_the_careful_ones_under_it():
    body = json.dumps(sim_windows(3)[-1]).encode()
    fast, (records, _) = fast_records(body), careful(body)
    for (_, a), (_, b) in zip(fast, records):
        moved = with_step(a, "0~1")
        assert type(moved) is FastReport and a.step == "0"
        assert_same_record(moved, with_step(b, "0~1"))


def test_the_fast_schema_names_exactly_the_wire_models_fields():
    """A field added to the wire contract but not to the fast Structs would send every body that
    carries it the slow way (and one only in the Structs would be stored unvalidated by the models)."""
    import msgspec

    from artemisd import ingest, wire

    pairs = {"FastReport": wire.WindowReport, "_Device": wire.Device, "_WindowSpan": wire.WindowSpan,
             "_StepTimes": wire.StepTimes, "_Collective": wire.Collective, "_Gpu": wire.GpuTelemetry,
             "_Host": wire.HostTelemetry, "_Env": wire.EnvFingerprint, "_P2P": wire.P2PTiming,
             "_Probe": wire.ProbeResult}
    fast = {name for name, value in vars(ingest).items()
            if isinstance(value, type) and issubclass(value, msgspec.Struct) and name != "_Fast"}
    assert fast == set(pairs)
    for name, model in pairs.items():
        assert set(getattr(ingest, name).__struct_fields__) == set(model.model_fields), name
