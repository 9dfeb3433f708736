"""Issue 27, defects 3 and 4: one user's slow bodies must not take what every other user needs.

3. four stalled 64 KiB bodies of one uid filled ``MaxBodyMemory``: every other
   user got 503 for the whole ReadTimeout, renewable at will;
4. a connection reading a body was never evicted: eight slow bodies at
   ``MaxConnections=8`` locked every other user out.

The pure parts first (the per-owner body budget, the body deadline, the fair
share and the gate's choice of a victim), then the real app on a loopback
port behind the real ``ConnectionGate``, wired as ``server.serve`` wires it,
with a stand-in auth that names the uid from the header (the real munge path
is tests/cluster/test_daemon_transport.py).  Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from artemisd.auth import AuthError, Credential, Principal
from artemisd.config import parse_config_text
from artemisd.metrics import Metrics
from artemisd.server import LINGER_S, make_app
from artemisd.service import Daemon
from artemisd.transport import (GATE, RETRY_AFTER_S, BodyBudget, ConnectionGate, _Door, body_deadline,
                                fair_share)
from tests.unit.test_act import MemorySlurm

KIB = 1 << 10
EVENT = b'[{"type":"node","v":1,"event":"health","node":"n1","time":1.0}]'
ATTACKER, OTHER = 1000, 0  # an ordinary user; root, whose node event needs no Slurm to be accepted


# --- the per-owner body budget ------------------------------------------------------------


def test_one_owner_cannot_take_the_memory_every_other_owner_needs():
    budget = BodyBudget(256 * KIB, per_owner=128 * KIB)
    assert budget.take(64 * KIB, ATTACKER) and budget.take(64 * KIB, ATTACKER)
    assert not budget.take(1, ATTACKER)  # its share is spent...
    assert budget.take(64 * KIB, OTHER) and budget.take(64 * KIB, None)  # ...the others' is not
    assert not budget.take(1, OTHER)  # and all of it together is still capped
    assert (budget.used, budget.held(ATTACKER), budget.held(OTHER)) == (256 * KIB, 128 * KIB, 64 * KIB)
    budget.give(128 * KIB, ATTACKER)
    assert budget.take(1, OTHER) and ATTACKER not in budget.owners  # nothing kept for an owner holding none
    budget.give(64 * KIB + 1, OTHER)
    budget.give(64 * KIB, None)
    assert budget.used == 0 and budget.owners == {}


def test_without_a_share_one_owner_may_use_it_all_and_a_share_above_the_total_is_the_total():
    assert BodyBudget(100).per_owner == 100 and BodyBudget(100, per_owner=1000).per_owner == 100
    budget = BodyBudget(100)
    assert budget.take(100, ATTACKER) and not budget.take(1, OTHER)


def test_default_share_is_a_quarter_of_the_memory_and_never_below_one_largest_body():
    assert parse_config_text("").daemon.body_memory_per_user == 16 << 20  # 64M / 4
    assert parse_config_text("MaxBodyMemory=1G\n").daemon.body_memory_per_user == 256 << 20
    assert parse_config_text("MaxBodySize=128K MaxBodyMemory=256K\n").daemon.body_memory_per_user == 128 * KIB
    assert parse_config_text("MaxBodyMemoryPerUser=20M\n").daemon.body_memory_per_user == 20 << 20


@pytest.mark.parametrize("text, complaint", [
    ("MaxBodyMemoryPerUser=1M\n", "at least MaxBodySize"),
    ("MaxBodyMemoryPerUser=65M\n", "at most MaxBodyMemory"),
    ("MinBodyRate=500\n", "at least 1K"),
    ("BodyGrace=31\n", "must not exceed ReadTimeout"),
    ("BodyGrace=0\n", "greater than 0"),
    ("MinBodyRate=2G\n", "less than or equal"),
])
def test_body_limits_are_validated(text, complaint):
    with pytest.raises(ValueError, match=complaint):
        parse_config_text(text)


def test_body_rate_keys_and_their_defaults():
    d = parse_config_text("").daemon
    assert (d.min_body_rate, d.body_grace) == (64 * KIB, 5.0)
    d = parse_config_text("MinBodyRate=1M BodyGrace=2s ReadTimeout=10\n").daemon
    assert (d.min_body_rate, d.body_grace, d.read_timeout) == (1 << 20, 2.0, 10.0)
    assert parse_config_text("MinBodyRate=0\n").daemon.min_body_rate == 0
    assert parse_config_text("ReadTimeout=3\n").daemon.body_grace == 5.0  # the default grace is capped, not refused


# --- the body deadline ----------------------------------------------------------------------


def test_body_deadline_starts_at_the_grace_and_grows_a_second_per_min_rate_bytes():
    at = {"timeout_s": 30.0, "grace_s": 5.0, "min_rate": 64 * KIB}
    assert body_deadline(100.0, 0, **at) == 105.0
    assert body_deadline(100.0, 64 * KIB, **at) == 106.0
    assert body_deadline(100.0, 10 * 64 * KIB, **at) == 115.0
    assert body_deadline(100.0, 1 << 30, **at) == 130.0  # never past ReadTimeout
    assert body_deadline(100.0, 0, timeout_s=3.0, grace_s=5.0, min_rate=64 * KIB) == 103.0
    assert body_deadline(100.0, 0, timeout_s=30.0, grace_s=5.0, min_rate=0) == 130.0  # off: ReadTimeout alone


def test_a_stalled_64k_body_is_cut_in_seconds_and_a_trickle_too():
    at = {"timeout_s": 30.0, "grace_s": 5.0, "min_rate": 64 * KIB}
    assert body_deadline(0.0, 64 * KIB, **at) == 6.0  # what defect 3's bodies held for 30 s
    # 1 KiB a second: by second t it has t KiB, worth t/64 s of credit; cut once t > 5 + t/64.
    cut = next(t for t in range(1, 31) if t > body_deadline(0.0, t * KIB, **at))
    assert cut == 6


# --- the fair share and the gate's victim -------------------------------------------------------


def test_fair_share_counts_the_newcomer_as_one_more_user():
    assert fair_share(8, 1) == 4
    assert fair_share(8, 2) == 2
    assert fair_share(8, 7) == 1 and fair_share(8, 100) == 1  # never below one
    assert fair_share(4096, 1) == 2048


class _Handler:
    """What the gate needs of aiohttp's per-connection protocol."""

    def __init__(self) -> None:
        self.closed = False

    def force_close(self) -> None:
        self.closed = True


def _busy_gate(owners: list[Any], reading: list[bool] | None = None, cap: int = 8) -> tuple[ConnectionGate, list]:
    """A gate at ``cap`` whose connections are all handling a request: of ``owners[i]`` (None: credential not
    judged yet), reading its body where ``reading[i]``."""
    gate = ConnectionGate(cap, Metrics())
    doors = []
    for i, owner in enumerate(owners):
        door = _Door(gate)
        door.inner = _Handler()
        assert gate._admit(door)
        gate.open[door.inner] = door
        gate.busy(door.inner)
        if owner is not None:
            gate.reading(door, owner, timer=object())  # type: ignore[arg-type]
            if reading is not None and not reading[i]:
                gate.read(door)
        doors.append(door)
    return gate, doors


def test_the_victim_is_the_longest_reading_connection_of_the_heaviest_user_over_its_share():
    gate, doors = _busy_gate([ATTACKER] * 8)
    assert gate.victim() is doors[0]  # one user holds 8 > 8 // 2
    gate, doors = _busy_gate([ATTACKER, 7, ATTACKER, 7, ATTACKER, ATTACKER, ATTACKER, 7])
    assert gate.victim() is doors[0]  # 5 against 3, both over 8 // 3: the heavier
    gate, doors = _busy_gate([7, ATTACKER, ATTACKER, ATTACKER, ATTACKER, ATTACKER, 7, 7],
                             reading=[True, False, True, True, True, True, True, True])
    assert gate.victim() is doors[2]  # a connection whose body is in is being processed: not taken


def test_no_victim_while_no_user_is_over_its_share_or_over_it_only_with_processed_requests():
    gate, _ = _busy_gate(list(range(8)))  # eight users, one connection each: real overload
    assert gate.victim() is None
    gate, _ = _busy_gate([ATTACKER] * 6 + [7, 7], reading=[False] * 6 + [True, True])
    assert gate.victim() is None  # the heavy user's requests are all being processed; 7 holds 2 of 8 // 3
    gate, _ = _busy_gate([None] * 8)  # credentials still being decoded: nobody is named yet
    assert gate.victim() is None


def test_done_and_close_give_the_users_connections_back():
    gate, doors = _busy_gate([ATTACKER, ATTACKER, 7])
    assert gate.owners == {ATTACKER: 2, 7: 1} and set(gate.readers) == {ATTACKER, 7}
    gate.read(doors[0])
    assert list(gate.readers[ATTACKER]) == [doors[1]] and gate.owners[ATTACKER] == 2
    gate.done(doors[0])
    assert gate.owners[ATTACKER] == 1 and doors[0] in gate.idle
    gate._drop(doors[1])  # closed while reading
    assert ATTACKER not in gate.owners and ATTACKER not in gate.readers
    gate.done(doors[1])  # the handler ends after the close: nothing counted twice
    assert gate.owners == {7: 1} and gate.count == 2


def test_an_idle_connection_still_goes_first():
    gate, doors = _busy_gate([ATTACKER] * 7)
    spare = _Door(gate)
    spare.inner = _Handler()
    assert gate._admit(spare)  # the eighth: kept alive, idle
    newcomer = _Door(gate)
    assert gate._admit(newcomer) and spare.inner.closed and not any(d.evicted for d in doors)
    assert gate.evicted == 1 and gate.evicted_share == 0


def test_a_newcomer_takes_the_place_of_the_reader_and_its_body_read_is_answered():
    async def scenario() -> None:
        gate, doors = _busy_gate([None] * 8)
        forever = asyncio.get_running_loop().create_future()

        async def reading(door: _Door) -> str:
            try:
                async with asyncio.timeout(60) as timer:
                    gate.reading(door, ATTACKER, timer)
                    await forever
            except TimeoutError:
                return "evicted" if door.evicted else "timed out"
            finally:
                gate.read(door)
            return "read"

        tasks = [asyncio.create_task(reading(d)) for d in doors]
        await asyncio.sleep(0)
        newcomer = _Door(gate)
        newcomer.inner = _Handler()
        assert gate._admit(newcomer)
        assert await asyncio.wait_for(tasks[0], 5) == "evicted"  # at once, not after 60 s
        assert gate.count == 8 and gate.owners == {ATTACKER: 7} and not doors[0].admitted
        assert gate.evicted_share == 1 and gate.lingering == 1  # kept open a moment for its 503
        metric = gate.metrics.connections_refused.labels("evicted_share")._value.get()
        assert metric == 1
        for t in tasks[1:]:
            t.cancel()
        await asyncio.gather(*tasks[1:], return_exceptions=True)
        doors[0]._linger.cancel()

    asyncio.run(scenario())


# --- the app behind the gate, on a loopback port ------------------------------------------------


class UidAuth:
    """Stands in for munge: ``Authorization: Munge uid=N`` is uid N; 0 is root-side."""

    async def check(self, header: str | None) -> Credential:
        if not header or not header.startswith("Munge uid="):
            raise AuthError("missing Authorization: Munge <credential>")
        uid = int(header.removeprefix("Munge uid="))
        return Credential(Principal(uid, uid, uid == 0, uid == 0), None)


@contextlib.asynccontextmanager
async def gated(tmp: Path, conf: str) -> AsyncIterator[tuple[int, ConnectionGate]]:
    """The app as ``server.serve`` runs it: aiohttp's handlers behind the ConnectionGate."""
    daemon = Daemon(parse_config_text(f"StateDir={tmp}\nAuthType=none\n{conf}"), MemorySlurm())
    app = make_app(daemon, UidAuth())  # type: ignore[arg-type]
    gate = app[GATE]
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=daemon.config.daemon.idle_timeout,
                           lingering_time=LINGER_S, auto_decompress=False)
    await runner.setup()
    gate.make_handler = runner.server
    listener = await asyncio.get_running_loop().create_server(gate, "127.0.0.1", 0)
    try:
        yield listener.sockets[0].getsockname()[1], gate
    finally:
        listener.close()
        await runner.cleanup()
        with contextlib.suppress(Exception):
            daemon.jobs.close()  # type: ignore[attr-defined]
        daemon.store.close()


def head(port: int, uid: int, length: int) -> bytes:
    return (f"POST /v1/reports HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Authorization: Munge uid={uid}\r\nContent-Length: {length}\r\n\r\n").encode()


async def answer(reader: asyncio.StreamReader, timeout_s: float) -> tuple[int | None, dict[str, str], dict]:
    """(status, headers, JSON body) of the response, status None if none came within ``timeout_s``."""
    try:
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        return None, {}, {}
    lines = raw.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), timeout_s)
    return int(lines[0].split()[1]), headers, json.loads(body or b"{}")


async def post(port: int, uid: int, body: bytes, timeout_s: float = 5.0) -> tuple[int | None, dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head(port, uid, len(body)) + body)
        status, _, reply = await answer(reader, timeout_s)
        return status, reply
    finally:
        writer.close()


async def stall(port: int, uid: int, declared: int, sent: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head(port, uid, declared) + b"x" * sent)
    await writer.drain()
    return reader, writer


def test_one_users_stalled_bodies_leave_the_memory_for_everyone_else(tmp_path):
    async def scenario() -> None:
        async with gated(tmp_path, "MaxBodySize=128K MaxBodyMemory=256K ReadTimeout=30\n") as (port, _):
            held = [await stall(port, ATTACKER, 128 * KIB, 64 * KIB) for _ in range(4)]
            await asyncio.sleep(0.3)
            status, reply = await post(port, OTHER, EVENT)
            assert status == 200 and reply["accepted"] == 1, (status, reply)
            refused = [await answer(r, 0.5) for r, _ in held]
            own = [(s, h.get("retry-after"), "MaxBodyMemoryPerUser" in b.get("error", "")) for s, h, b in refused
                   if s is not None]
            assert len(own) >= 2 and all(x == (503, str(RETRY_AFTER_S), True) for x in own), refused
            for _, writer in held:
                writer.close()

    asyncio.run(scenario())


def test_a_stalled_or_trickling_body_is_cut_within_the_rate_deadline_not_read_timeout(tmp_path):
    async def scenario() -> None:
        conf = "ReadTimeout=30 BodyGrace=1 MinBodyRate=64K\n"
        async with gated(tmp_path, conf) as (port, gate):
            stalled_r, stalled_w = await stall(port, ATTACKER, 100 * KIB, 1)
            trickle_r, trickle_w = await stall(port, ATTACKER, 100 * KIB, 100)
            start = time.monotonic()

            async def trickle() -> None:
                for _ in range(100):  # 100 bytes every 0.1 s: 1 KB/s, far below 64K/s
                    await asyncio.sleep(0.1)
                    trickle_w.write(b"x" * 100)

            feeding = asyncio.create_task(trickle())
            try:
                for reader in (stalled_r, trickle_r):
                    status, headers, reply = await answer(reader, 5)
                    assert status == 408 and "MinBodyRate" in reply["error"], (status, reply)
                    assert headers.get("connection") == "close"
                assert time.monotonic() - start < 25  # cut by the rate deadline, far before ReadTimeout
            finally:
                feeding.cancel()
                stalled_w.close()
                trickle_w.close()
            assert gate.readers == {} and gate.owners == {}
            status, reply = await post(port, OTHER, EVENT)  # an honest body is untouched by it
            assert status == 200 and reply["accepted"] == 1

    asyncio.run(scenario())


def test_one_users_slow_bodies_at_the_connection_cap_give_way_to_another_user(tmp_path):
    async def scenario() -> None:
        async with gated(tmp_path, "MaxConnections=8 ReadTimeout=30\n") as (port, gate):
            slow = [await stall(port, ATTACKER, 1000, 1) for _ in range(8)]
            await asyncio.sleep(0.3)
            assert gate.count == 8 and gate.owners == {ATTACKER: 8}
            status, reply = await post(port, OTHER, EVENT)
            assert status == 200 and reply["accepted"] == 1, (status, reply)
            # The attacker's connection that has waited longest made room: told to come back, and closed.
            status, headers, reply = await answer(slow[0][0], 2)
            assert status == 503 and headers.get("retry-after") == str(RETRY_AFTER_S), (status, reply)
            assert "share of connections" in reply["error"]
            assert gate.evicted_share == 1 and gate.shed == 0
            for _, writer in slow:
                writer.close()

    asyncio.run(scenario())


def test_the_heavy_users_own_newcomer_takes_its_place(tmp_path):
    """A big job's ranks (one uid, here root's node programs) at the cap: a newcomer of that uid replaces
    its slowest connection, which is told to come back (the probe and node programs retry)."""
    async def scenario() -> None:
        async with gated(tmp_path, "MaxConnections=8 ReadTimeout=30\n") as (port, gate):
            slow = [await stall(port, OTHER, 1000, 1) for _ in range(8)]
            await asyncio.sleep(0.3)
            status, reply = await post(port, OTHER, EVENT)
            assert status == 200 and reply["accepted"] == 1, (status, reply)
            assert (await answer(slow[0][0], 2))[0] == 503
            for _, writer in slow:
                writer.close()

    asyncio.run(scenario())


def test_with_no_user_over_its_share_the_newcomer_is_shed_not_left_hanging(tmp_path):
    async def scenario() -> None:
        async with gated(tmp_path, "MaxConnections=8 ReadTimeout=30\n") as (port, gate):
            slow = [await stall(port, 100 + i, 1000, 1) for i in range(8)]  # eight users, one each
            await asyncio.sleep(0.3)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            status, headers, reply = await answer(reader, 2)
            writer.close()
            assert status == 503 and "connection limit" in reply["error"] and headers["retry-after"] == "2"
            assert gate.shed == 1 and gate.evicted_share == 0
            for _, w in slow:
                w.close()

    asyncio.run(scenario())
