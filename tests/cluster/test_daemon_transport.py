"""The daemon's front door under hostile and broken clients (issue 9, finding 4; issue 27, defects 3 and 4).

The real ``artemisd`` process on 127.0.0.1 with AuthType=munge on a private
munged; memory is the process's own resident high-water mark (VmHWM).  Every
load loop is bounded in count and time and talks to loopback only.  The
numbers behind the bounds are in docs/benchmarks.md ("Transport").
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from pathlib import Path

import pytest

from torch_hook.munge import MungeSigner
from torch_hook.transport import Sender

from .hostile import (StandaloneDaemon, closed_by_peer, concurrently, credential_as, head_bytes, idle_connections,
                      post, read_answer, upload, vm_kib)
from .munge import Munged

pytestmark = pytest.mark.cluster

MIB = 1 << 20
# A root-side node event: needs no Slurm to be accepted.
EVENT = b'[{"type":"node","v":1,"event":"health","node":"n1","time":1.0}]'
SMALL = "MaxBodySize=4M\nMaxBodyMemory=16M\nReadTimeout=3\nIdleTimeout=3\n"


@pytest.fixture(scope="module")
def signer(munged: Munged):
    signer = MungeSigner(str(munged.socket))
    # munged's first credential is slow
    assert signer.credential("POST", "/v1/reports", b"warm-up"), signer.last_error
    yield signer
    signer.close()


def cred(signer: MungeSigner, body: bytes, path: str = "/v1/reports", method: str = "POST") -> str:
    made = signer.credential(method, path, body)
    assert made, signer.last_error
    return made


# An ordinary cluster account (munge names it, as for any job owner), and as many of them as a test needs.
ATTACKER = "nobody"
USERS = ("daemon", "bin", "sys", "sync", "games", "man", "lp", "mail")


@pytest.fixture
def small(munged: Munged, tmp_path: Path):
    with StandaloneDaemon(tmp_path / "artemisd", munged.socket, SMALL) as daemon:
        yield daemon


def warm_up(daemon: StandaloneDaemon, signer: MungeSigner) -> int:
    """Exercise every refusal path once, so start-up allocations are not counted; returns VmHWM (KiB)."""
    assert post(daemon.url, "/v1/reports", EVENT, cred(signer, EVENT))[0] == 200
    for _ in range(20):
        assert post(daemon.url, "/v1/reports", EVENT, None)[0] == 401
    assert upload(daemon.port, 20 * MIB, chunked=True, cred=None)[0] == 401
    assert upload(daemon.port, 20 * MIB, chunked=True, cred=cred(signer, b"x"))[0] == 413  # > MaxBodySize
    return vm_kib(daemon.pid)


def test_unauthenticated_uploads_are_refused_before_their_body_is_read(small, signer):
    before = warm_up(small, signer)
    size = 200 * MIB
    forged = "MUNGE:AwQFAAB0aGlzIGlzIG5vdCBhIGNyZWRlbnRpYWw=:"
    # The answer comes while the client is still sending: the daemon never waited for the body.
    for chunked, credential, status in ((True, None, 401), (True, forged, 401), (False, None, 413)):
        got, sent = upload(small.port, size, chunked=chunked, cred=credential)
        assert got == status and sent < size, (chunked, credential, got, sent)
    # What the issue measured: three at once took the daemon from 68 MB to 716 MB.
    for _ in range(2):
        assert [r[0] for r in concurrently(3, upload, small.port, size, chunked=True, cred=None)] == [401] * 3
    grown = vm_kib(small.pid) - before
    assert grown < 16 * 1024, f"resident high-water mark grew {grown} KiB"
    assert small.metric('artemis_requests_refused_total{reason="credential",status="401"}') >= 8
    assert small.healthy()


def test_authenticated_body_is_streamed_against_the_limit(small, signer):
    before = warm_up(small, signer)
    got, sent = upload(small.port, 200 * MIB, chunked=True, cred=cred(signer, b"anything"))
    assert got == 413 and sent < 200 * MIB
    grown = vm_kib(small.pid) - before
    assert grown < 16 * 1024, f"resident high-water mark grew {grown} KiB for a 4 MiB limit"
    status, reply, _ = post(small.url, "/v1/reports", EVENT, cred(signer, EVENT))
    assert status == 200 and reply["accepted"] == 1


def test_bodies_held_at_once_are_bounded_by_max_body_memory(munged, signer, tmp_path):
    conf = "MaxBodySize=4M\nMaxBodyMemory=4M\nReadTimeout=5\n"
    with StandaloneDaemon(tmp_path / "artemisd", munged.socket, conf) as daemon:
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as holder, \
                socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as second:
            holder.sendall(head_bytes(daemon.port, length=4 * MIB, cred=cred(signer, b"a")) + b"x" * (3 * MIB))
            time.sleep(1.0)  # the daemon holds 3 MiB of the 4 it may
            # Another user, within its own share: refused by the total alone.
            second.sendall(head_bytes(daemon.port, length=2 * MIB, cred=credential_as(munged.socket, ATTACKER, b"b"))
                           + b"y" * (2 * MIB))
            status, headers, body = read_answer(second, 10)
            assert status == 503 and headers.get("retry-after") == "2", (status, headers, body)
            assert "(MaxBodyMemory)" in json.loads(body)["error"]
            assert read_answer(holder, 15)[0] == 408  # the stalled one times out and frees its share
        status, reply, _ = post(daemon.url, "/v1/reports", EVENT, cred(signer, EVENT))
        assert status == 200 and reply["accepted"] == 1


def test_slow_upload_slow_head_and_idle_connection_are_timed_out(small, signer):
    with socket.create_connection(("127.0.0.1", small.port), timeout=10) as slow_body:
        slow_body.sendall(head_bytes(small.port, length=1000, cred=cred(signer, b"x")) + b"[")
        start = time.monotonic()
        status, headers, body = read_answer(slow_body, 15)
        waited = time.monotonic() - start
        assert status == 408 and "ReadTimeout" in json.loads(body)["error"], (status, body)
        assert 2.5 <= waited <= 10 and headers.get("connection") == "close"
        assert closed_by_peer(slow_body, 5) is not None

    with socket.create_connection(("127.0.0.1", small.port), timeout=10) as slow_head:
        slow_head.sendall(b"POST /v1/reports HTTP/1.1\r\n")
        start, cut = time.monotonic(), None
        for i in range(40):  # one header line every 0.25 s: never a complete head
            try:
                slow_head.sendall(b"X-Slow-%d: 1\r\n" % i)
            except OSError:
                cut = time.monotonic() - start
                break
            time.sleep(0.25)
        assert cut is not None and cut <= 8, cut

    with socket.create_connection(("127.0.0.1", small.port), timeout=10) as idle:
        closed = closed_by_peer(idle, 10)
        assert closed is not None and 2.5 <= closed <= 8, closed


def test_many_idle_connections_leave_the_daemon_reachable(munged, signer, tmp_path):
    """1,100 idle connections made the daemon unreachable; now the longest idle make room."""
    with StandaloneDaemon(tmp_path / "artemisd", munged.socket, "MaxConnections=1000\nIdleTimeout=60\n") as daemon:
        before = warm_up(daemon, signer)
        with idle_connections(daemon.port, 1100):
            start = time.monotonic()
            assert daemon.healthy(timeout_s=10)
            status, reply, _ = post(daemon.url, "/v1/reports", EVENT, cred(signer, EVENT), timeout_s=10)
            assert status == 200 and reply["accepted"] == 1
            assert time.monotonic() - start < 10
            assert daemon.metric('artemis_connections_refused_total{outcome="evicted"}') >= 100
            assert daemon.metric("artemis_connections ") <= 1000
            grown = vm_kib(daemon.pid) - before
        assert grown < 32 * 1024, f"resident high-water mark grew {grown} KiB for 1,100 connections"


def test_at_the_cap_with_every_connection_busy_it_sheds_with_503_and_the_probe_waits(munged, signer, tmp_path):
    conf = "MaxConnections=8\nReadTimeout=4\nIdleTimeout=10\n"
    with StandaloneDaemon(tmp_path / "artemisd", munged.socket, conf) as daemon:
        busy = []
        try:
            # Authenticated uploads that stall, one each of eight users: no user holds more than its
            # fair share (8 // 9: one), so none of them yields to a newcomer — real overload.
            for user in USERS:
                sock = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
                busy.append(sock)
                sock.sendall(head_bytes(daemon.port, length=1000,
                                        cred=credential_as(munged.socket, user, user.encode())) + b"[")
            time.sleep(0.5)
            stalled_at = time.monotonic()
            status, reply, headers = post(daemon.url, "/v1/reports", EVENT, cred(signer, EVENT))
            assert status == 503 and "connection limit" in reply["error"]
            assert headers["Retry-After"] == "2"

            # The probe's sender, with a real credential: it waits out the 503s off the
            # training thread, then delivers once the stalled uploads are timed out.
            sender = Sender(daemon.url, munge_socket=str(munged.socket), queue_size=4)
            try:
                report = {"type": "node", "v": 1, "event": "health", "node": "n2", "time": 2.0}
                assert sender.submit(report)
                assert sender.flush(30.0), sender.last_error
            finally:
                sender.close()
            assert sender.deferred >= 1 and sender.sent == 1 and sender.dropped == 0
            assert time.monotonic() - stalled_at >= 3  # not before the busy connections freed up
            assert [read_answer(sock, 10)[0] for sock in busy] == [408] * 8
        finally:
            for sock in busy:
                sock.close()
        assert daemon.metric('artemis_connections_refused_total{outcome="shed"}') >= 2
        status, reply, _ = post(daemon.url, "/v1/reports", EVENT, cred(signer, EVENT))
        assert status == 200 and reply["accepted"] == 1


def test_repeated_errors_keep_memory_flat(small, signer):
    """Refusals of every kind, thousands of times: the resident set does not creep."""
    garbage = b"[{not json"

    def errors(n: int) -> None:
        for i in range(n):
            kind = i % 4
            if kind == 0:
                assert post(small.url, "/v1/reports", EVENT, None)[0] == 401
            elif kind == 1:
                assert post(small.url, "/v1/reports", EVENT, cred(signer, b"other body"))[0] == 401
            elif kind == 2:  # refused as a whole (400) or item by item (200): never taken, never a 5xx
                status, reply, _ = post(small.url, "/v1/reports", garbage, cred(signer, garbage))
                assert status == 400 or (status == 200 and not reply["accepted"] and reply["rejected"])
            else:
                approve = "/v1/incidents/INC-0/approve"
                assert post(small.url, approve, b"", cred(signer, b"", approve))[0] == 404

    errors(2000)  # past the first collections of the cycles closed connections leave (transport.COLLECT_EVERY)
    before = vm_kib(small.pid, "VmRSS")
    deadline = time.monotonic() + 120
    rounds = 0
    while rounds < 6 and time.monotonic() < deadline:
        errors(400)
        rounds += 1
    grown = vm_kib(small.pid, "VmRSS") - before
    # ~1 KiB per request (what the issue saw) would be 2.4 MiB over these 2,400.
    assert rounds == 6 and grown < 1024, f"{rounds} rounds; resident set grew {grown} KiB"


# --- issue 27: one user must not take what every other user needs ------------------------------


def stalled(port: int, cred_: str, declared: int, sent: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(head_bytes(port, length=declared, cred=cred_) + sent)
    return sock


def test_one_users_stalled_bodies_leave_the_body_memory_to_everyone_else(munged, signer, tmp_path):
    """Defect 3: four stalled 64 KiB bodies of one uid gave every other user 503 for all of ReadTimeout."""
    conf = "MaxBodySize=128K\nMaxBodyMemory=256K\nReadTimeout=30\n"
    with StandaloneDaemon(tmp_path / "artemisd", munged.socket, conf) as daemon:
        creds = [credential_as(munged.socket, ATTACKER, b"%d" % i) for i in range(4)]
        held = []
        try:
            for c in creds:
                held.append(stalled(daemon.port, c, 128 << 10, b"x" * (64 << 10)))
            time.sleep(0.5)  # the daemon has read what they sent
            status, reply, _ = post(daemon.url, "/v1/reports", EVENT, cred(signer, EVENT), timeout_s=10)
            assert status == 200 and reply["accepted"] == 1, (status, reply)
            # The attacker is refused on its own requests: at most its share (128K) is held.
            answers = [read_answer(sock, 1) for sock in held]
            own = [(s, h.get("retry-after"), json.loads(b).get("error", "")) for s, h, b in answers if s is not None]
            assert len(own) >= 2 and all(s == 503 and ra == "2" and "MaxBodyMemoryPerUser" in e
                                         for s, ra, e in own), answers
        finally:
            for sock in held:
                sock.close()
        assert daemon.metric('artemis_requests_refused_total{reason="user_body_memory",status="503"}') >= 2


def test_one_users_slow_bodies_at_the_connection_cap_give_way_to_another_user(munged, signer, tmp_path):
    """Defect 4: eight slow bodies of one uid at MaxConnections=8 locked every other user out."""
    conf = "MaxConnections=8\nReadTimeout=30\nIdleTimeout=10\n"
    with StandaloneDaemon(tmp_path / "artemisd", munged.socket, conf) as daemon:
        creds = [credential_as(munged.socket, ATTACKER, b"%d" % i) for i in range(8)]
        slow = []
        try:
            for c in creds:
                slow.append(stalled(daemon.port, c, 1000, b"["))
            time.sleep(0.5)
            status, reply, _ = post(daemon.url, "/v1/reports", EVENT, cred(signer, EVENT), timeout_s=10)
            assert status == 200 and reply["accepted"] == 1, (status, reply)
            # The one that made room (its user's longest reading) was told to come back, and closed.
            answered, _, _ = select.select(slow, [], [], 3)
            assert len(answered) == 1, answered
            status, headers, body = read_answer(answered[0], 3)
            assert status == 503 and headers.get("retry-after") == "2", (status, headers, body)
            assert "share of connections" in json.loads(body)["error"]
            assert closed_by_peer(answered[0], 5) is not None
        finally:
            for sock in slow:
                sock.close()
        assert daemon.metric('artemis_connections_refused_total{outcome="evicted_share"}') >= 1
        assert daemon.metric('artemis_connections_refused_total{outcome="shed"}') == 0


def test_a_stalled_or_trickling_body_is_cut_by_the_rate_deadline_not_read_timeout(munged, tmp_path):
    """A body must keep arriving: BodyGrace (5 s), then MinBodyRate (64 KiB/s); ReadTimeout (30 s) only caps."""
    with StandaloneDaemon(tmp_path / "artemisd", munged.socket, "ReadTimeout=30\n") as daemon:
        stall_sock = stalled(daemon.port, credential_as(munged.socket, ATTACKER, b"s"), 100 << 10, b"[")
        trickle_sock = stalled(daemon.port, credential_as(munged.socket, ATTACKER, b"t"), 100 << 10, b"[")
        start = time.monotonic()
        stop = threading.Event()

        def trickle() -> None:  # 100 bytes every 0.25 s: 400 B/s, bounded to 15 s
            for _ in range(60):
                if stop.wait(0.25):
                    return
                try:
                    trickle_sock.sendall(b" " * 100)
                except OSError:
                    return

        feeder = threading.Thread(target=trickle, daemon=True)
        feeder.start()
        try:
            for sock in (stall_sock, trickle_sock):
                status, headers, body = read_answer(sock, 12)
                waited = time.monotonic() - start
                assert status == 408 and "MinBodyRate" in json.loads(body)["error"], (status, body)
                # after the grace, far before ReadTimeout (30 s); read_answer waits 12 s at most
                assert waited >= 4 and headers.get("connection") == "close", waited
            stop.set()
            assert closed_by_peer(stall_sock, 5) is not None
        finally:
            stop.set()
            feeder.join(timeout=5)
            stall_sock.close()
            trickle_sock.close()
        assert daemon.metric('artemis_requests_refused_total{reason="slow_body",status="408"}') == 2
