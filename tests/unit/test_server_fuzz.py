"""Fuzz the ingest API with thousands of malformed and hostile items.

Properties: the daemon never crashes (every reply is 200 or a clear 400),
each bad item gets its own error naming its index, and every valid item mixed
in among them is accepted and stored — none lost.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from artemisd.auth import NoAuth
from artemisd.config import parse_config_text
from artemisd.server import make_app
from artemisd.service import Daemon
from tests.unit.test_act import MemorySlurm
from tests.unit.windows import lockstep

VALID = [r.model_dump(mode="json", exclude_none=True) for r in lockstep(0, [50.0] * 4, nodes=["a", "a", "b", "b"])]

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                      st.floats(allow_nan=False), st.text(max_size=20))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)
FIELDS = ["type", "v", "job", "step", "rank", "world", "node", "window", "ms", "samples", "gpu", "host",
          "probe", "event", "time", "gpus", "device", "collectives"]


@st.composite
def hostile(draw):
    """A valid report with fields replaced, removed or poisoned, or arbitrary JSON."""
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(json_value)
    item = json.loads(json.dumps(draw(st.sampled_from(VALID))))
    for field in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=4)):
        if kind == 1:
            item.pop(field, None)
        else:
            item[field] = draw(json_value)
    if kind == 3:
        item["ms"] = {"step": draw(st.floats()), "busy": draw(st.floats()), "comm_wait": -1}
    return item


def is_valid(item) -> bool:
    from artemisd.wire import ReportError, parse_record
    try:
        parse_record(item)
        return True
    except ReportError:
        return False


# ~40 batches of 20-120 hostile items: a few thousand per run.  Big inputs are the point.
@settings(max_examples=40, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
@given(items=st.lists(hostile(), min_size=20, max_size=120), as_lines=st.booleans())
def test_hostile_batches_never_crash_and_lose_nothing_valid(tmp_path_factory, items, as_lines):
    state = tmp_path_factory.mktemp("fuzz")
    slurm = MemorySlurm({"a": "allocated", "b": "allocated"})

    async def scenario():
        daemon = Daemon(parse_config_text(f"StateDir={state}\nAuthType=none\n"), slurm)
        client = TestClient(TestServer(make_app(daemon, NoAuth())))
        await client.start_server()
        try:
            batch = list(items) + VALID  # the valid ones ride along at the end
            if as_lines:
                payload = "\n".join(json.dumps(x) for x in batch)
            else:
                payload = json.dumps(batch)
            resp = await client.post("/v1/reports", data=payload)
            assert resp.status == 200, await resp.text()
            reply = await resp.json()
            valid = sum(1 for x in batch if is_valid(x))
            assert reply["accepted"] == valid
            assert reply["accepted"] + len(reply["rejected"]) == len(batch)
            assert all(isinstance(r["index"], int) and r["error"] for r in reply["rejected"])
            assert daemon.store.record_count() == valid
            # The daemon still works afterwards.
            assert (await client.get("/v1/health")).status == 200
            await daemon.run_once()
        finally:
            await client.close()
            daemon.store.close()
    asyncio.run(scenario())


def test_garbage_bodies_get_a_clear_400(tmp_path):
    async def scenario():
        daemon = Daemon(parse_config_text(f"StateDir={tmp_path}\nAuthType=none\n"), MemorySlurm())
        client = TestClient(TestServer(make_app(daemon, NoAuth())))
        await client.start_server()
        try:
            for payload in (b"[", b'{"a": 1}]', b"[" + b"1," * 10 + b"]", b"\xff\xfe[1]"):
                resp = await client.post("/v1/reports", data=payload)
                assert resp.status in (200, 400)
                if resp.status == 400:
                    assert "JSON" in (await resp.json())["error"]
            resp = await client.post("/v1/reports", data=b"\x00\x01\x02")
            assert resp.status == 200 and (await resp.json())["rejected"][0]["error"].startswith("not JSON")
        finally:
            await client.close()
            daemon.store.close()
    asyncio.run(scenario())


def test_json_lines_whose_first_line_is_an_array(tmp_path):
    """Found by the fuzzer: '[]' as the first JSON line is one bad item, not a bad body."""
    async def scenario():
        daemon = Daemon(parse_config_text(f"StateDir={tmp_path}\nAuthType=none\n"), MemorySlurm())
        client = TestClient(TestServer(make_app(daemon, NoAuth())))
        await client.start_server()
        try:
            payload = "[]\n" + json.dumps(VALID[0])
            reply = await (await client.post("/v1/reports", data=payload)).json()
            assert reply["accepted"] == 1 and [r["index"] for r in reply["rejected"]] == [0]
        finally:
            await client.close()
            daemon.store.close()
    asyncio.run(scenario())
