"""The probe's sender: file traces, HTTP with a munge credential, and daemons that misbehave."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.unit.http_stub import serving
from torch_hook.munge import MungeSigner, request_payload
from torch_hook.retry import Backoff, retry_after_s
from torch_hook.transport import Sender


def _tried_in_turn(*urls: str) -> str:
    """An endpoint list whose daemons ``_report``'s rank tries in the order given: the list rotated
    so that the first given is its home."""
    from torch_hook.transport import node_hash

    home = (0 + node_hash("n1")) % len(urls)
    return ",".join(urls[(i - home) % len(urls)] for i in range(len(urls)))


def _report(seq: int) -> dict:
    return {"type": "window", "v": 1, "job": "1", "rank": 0, "world": 1, "node": "n1",
            "window": {"seq": seq, "first_step": seq, "steps": 1, "t0": 1.0, "t1": 2.0},
            "ms": {"step": 1.0, "comm_wait": 0.5}}


class _Handler(BaseHTTPRequestHandler):
    reply: bytes = b"{}"
    gate = threading.Event()  # cleared: the daemon hangs until the test opens it
    seen: list[tuple[bytes, str | None]] = []
    at: list[float] = []  # time.monotonic() of each POST
    busy = 0  # answer this many next POSTs 503 + Retry-After (a daemon at its limit)
    retry_after = "1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append((body, self.headers.get("Authorization")))
        self.at.append(time.monotonic())
        self.gate.wait(30)
        try:
            if _Handler.busy > 0:
                _Handler.busy -= 1
                self.send_response(503)
                self.send_header("Retry-After", self.retry_after)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.reply)))
            self.end_headers()
            self.wfile.write(self.reply)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the probe gave up waiting, as it should


@pytest.fixture
def server():
    _Handler.seen, _Handler.at, _Handler.reply, _Handler.busy, _Handler.retry_after = [], [], b"{}", 0, "1"
    _Handler.gate.set()
    with serving(_Handler) as url:
        try:
            yield url
        finally:
            _Handler.gate.set()  # a handler the test held must not keep the shutdown waiting


def test_file_endpoint_appends_json_lines(tmp_path):
    path = tmp_path / "trace.jsonl"
    sender = Sender(f"file:{path}")
    for i in range(5):
        assert sender.submit(_report(i))
    sender.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["window"]["seq"] for r in lines] == list(range(5))
    assert all(r["dropped_reports"] == 0 for r in lines) and sender.sent == 5


def test_http_reply_directives_reach_the_handler(server):
    _Handler.reply = json.dumps({"accepted": 1, "rejected": [], "directives": [{"type": "probe", "id": "P"}]}).encode()
    replies = []
    sender = Sender(server, on_reply=replies.append)
    sender.submit(_report(0))
    assert sender.flush(5.0)
    sender.close()
    assert replies and replies[0]["directives"][0]["id"] == "P"
    body, auth = _Handler.seen[0]
    assert json.loads(body)[0]["window"]["seq"] == 0
    assert auth is not None or sender.unauthenticated == 1  # no munged: sent, and counted


def test_hanging_daemon_never_blocks_submit_and_drops_are_counted(server):
    _Handler.gate.clear()  # every POST hangs until the submits are done
    sender = Sender(server, queue_size=2, timeout_s=0.2)
    # If submit waited on the daemon, this would hang until pytest's timeout.
    accepted = [sender.submit(_report(i)) for i in range(50)]
    assert accepted.count(False) >= 40
    _Handler.gate.set()
    sender.flush(5.0)
    sender.close(timeout_s=3.0)
    assert sender.dropped == 50 - sender.sent and sender.dropped >= 47


def test_busy_daemon_is_retried_after_retry_after_while_training_never_waits(server):
    _Handler.busy, _Handler.retry_after = 2, "1"
    sender = Sender(server, queue_size=4)
    sender.submit(_report(0))
    deadline = time.monotonic() + 10
    while not _Handler.at and time.monotonic() < deadline:
        time.sleep(0.01)
    # The sender now waits out Retry-After; the training thread keeps submitting.
    slowest, kept = 0.0, []
    for seq in range(1, 21):
        start = time.perf_counter()
        kept.append(sender.submit(_report(seq)))
        slowest = max(slowest, time.perf_counter() - start)
    # Far below the 1 s the sender waits: submit never waits for it (generous for a loaded box).
    assert slowest < 0.5, f"submit blocked {slowest:.3f} s while the sender backed off"
    assert sender._queue.qsize() <= 4 and kept.count(False) == 16  # bounded: the oldest 16 dropped
    assert sender.flush(30.0)
    sender.close()
    gaps = [b - a for a, b in zip(_Handler.at, _Handler.at[1:3])]
    assert len(gaps) == 2 and all(g >= 1.0 for g in gaps), gaps  # Retry-After honoured, then doubled
    first = [r["window"]["seq"] for r in json.loads(_Handler.seen[2][0])]
    assert first == [0] and _Handler.seen[0][0] == _Handler.seen[2][0]  # the refused batch, resent as is
    delivered = [r["window"]["seq"] for body, _ in _Handler.seen[3:] for r in json.loads(body)]
    assert delivered == [17, 18, 19, 20]  # the newest survive the full queue
    assert sender.deferred == 2 and sender.dropped == 16 and sender.sent == 5


def test_daemon_that_stays_busy_costs_the_batch_not_the_close(server):
    _Handler.busy, _Handler.retry_after = 1000, "30"
    sender = Sender(server, hold_s=60)
    sender.submit(_report(0))
    deadline = time.monotonic() + 10
    while not _Handler.at and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    sender.close(timeout_s=0.5)  # the sender is waiting out Retry-After: 30; close must not
    assert time.monotonic() - start < 3
    assert sender.dropped == 1 and sender.sent == 0 and "503" in (sender.last_error or "")


def test_retry_after_and_backoff():
    import random

    assert retry_after_s("7") == 7.0 and retry_after_s(None) is None and retry_after_s("soon") is None
    assert retry_after_s("Thu, 03 Dec 2026 10:00:30 GMT", now=1796292000.0) == 30.0
    backoff = Backoff(random.Random(1), first_s=1.0, max_s=8.0)
    waits = [backoff.next(None) for _ in range(6)]
    assert all(base <= w <= 1.5 * base for w, base in zip(waits, [1, 2, 4, 8, 8, 8])), waits
    backoff.reset()
    assert 5.0 <= backoff.next(5.0) <= 7.5  # what the server asked, when more than the backoff
    assert backoff.next(1000.0) <= 8.0 * 1.5  # never more than the cap


def test_garbage_reply_and_no_daemon(server):
    _Handler.reply = b"\x00not json"
    sender = Sender(server)
    sender.submit(_report(0))
    sender.flush(5.0)
    sender.close()
    assert sender.bad_replies == 1 and sender.sent == 1
    dead = Sender("http://127.0.0.1:9", timeout_s=0.5)  # discard port: nothing listens
    dead.submit(_report(0))
    dead.flush(5.0)
    dead.submit(_report(1))
    dead.flush(5.0)
    dead.close()
    assert dead.dropped == 2 and dead.last_error


def test_enrich_failure_still_sends(tmp_path):
    path = tmp_path / "t.jsonl"

    def broken(report):
        raise RuntimeError("telemetry exploded")

    sender = Sender(f"file:{path}", enrich=broken)
    sender.submit(_report(0))
    sender.close()
    assert len(path.read_text().splitlines()) == 1 and sender.errors == 1


@pytest.fixture
def munged(tmp_path):
    if not (shutil.which("munged") or shutil.which("/usr/sbin/munged")) or not shutil.which("mungekey"):
        pytest.skip("munge is not installed (scripts/apt-packages.txt lists it)")
    key, sock = tmp_path / "munge.key", tmp_path / "munge.sock"
    subprocess.run(["mungekey", "--create", f"--keyfile={key}", "--bits=256"], check=True, timeout=10)
    proc = subprocess.Popen([shutil.which("munged") or "/usr/sbin/munged", "--foreground", "--force",
                             f"--socket={sock}", f"--key-file={key}", f"--pid-file={tmp_path}/pid",
                             f"--log-file={tmp_path}/log", f"--seed-file={tmp_path}/seed"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        if sock.exists():
            break
        time.sleep(0.05)
    yield str(sock)
    proc.terminate()
    proc.wait(timeout=10)


def test_munge_credential_binds_method_path_and_body(munged, server):
    body = b'[{"type":"window"}]'
    signer = MungeSigner(munged)
    cred = signer.credential("POST", "/v1/reports", body)
    assert cred and cred.startswith("MUNGE:")
    decoded = subprocess.run(["unmunge", f"--socket={munged}", "--metadata=/dev/null"], input=cred.encode(),
                             capture_output=True, timeout=10, check=True).stdout.decode()
    assert decoded == f"artemis-request-v2 POST /v1/reports {hashlib.sha256(body).hexdigest()}"
    # The endpoint's own path (a daemon behind a prefix) is part of the request-target signed.
    sender = Sender(server + "/artemis/", munge_socket=munged)
    sender.submit(_report(0))
    sender.flush(5.0)
    sender.close()
    sent, auth = _Handler.seen[0]
    assert auth and auth.startswith("Munge MUNGE:") and sender.unauthenticated == 0
    payload = subprocess.run(["unmunge", f"--socket={munged}", "--metadata=/dev/null"],
                             input=auth.split(" ", 1)[1].encode(), capture_output=True, timeout=10,
                             check=True).stdout.decode()
    assert payload == request_payload("POST", "/artemis/v1/reports", sent) == \
        f"artemis-request-v2 POST /artemis/v1/reports {hashlib.sha256(sent).hexdigest()}"


class _Unmunging(BaseHTTPRequestHandler):
    """A daemon that decodes each credential with the real unmunge, as artemisd does: a credential
    decoded once already is a replay (401).  ``status`` is what it answers a good one."""

    munged = ""
    status = 200
    answers: list[int] = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        cred = (self.headers.get("Authorization") or " ").split(" ", 1)[1]
        decoded = subprocess.run(["unmunge", f"--socket={self.munged}", "--metadata=/dev/null"], input=cred.encode(),
                                 capture_output=True, timeout=10)
        # Made for this very request (method, path as sent, body), as artemisd requires.
        bound = decoded.stdout.decode() == request_payload("POST", self.path, body)
        code = self.status if decoded.returncode == 0 and bound else 401
        type(self).answers.append(code)
        reply = b"{}" if code == 200 else b'{"error": "x"}'
        self.send_response(code)
        if code == 503:
            self.send_header("Retry-After", "5")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


def test_each_daemon_of_a_list_gets_a_credential_of_its_own(munged):
    """The first daemon decodes the batch's credential and defers (its database is down); the
    second must not be handed the same one, which munge would refuse as a replay."""
    class Deferring(_Unmunging):
        status, answers = 503, []

    class Taking(_Unmunging):
        status, answers = 200, []

    servers = []
    for handler in (Deferring, Taking):
        handler.munged = munged
        srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(srv)
    try:
        sender = Sender(_tried_in_turn(*(f"http://127.0.0.1:{srv.server_address[1]}" for srv in servers)),
                        munge_socket=munged)
        sender.submit(_report(0))
        assert sender.flush(10)
        sender.close()
        assert (Deferring.answers, Taking.answers) == ([503], [200])
        assert sender.dropped == 0 and sender.sent == 1 and sender.unauthenticated == 0
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()


def test_munge_without_daemon_returns_none(tmp_path):
    signer = MungeSigner(str(tmp_path / "no.sock"))
    assert signer.credential("POST", "/v1/reports", b"x") is None and signer.last_error


class _Deferring(BaseHTTPRequestHandler):
    """An artemisd that cannot take reports now (its state database unreachable): every batch
    answered 503 with Retry-After, nothing stored."""

    posts = 0

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        _Deferring.posts += 1
        reply = b'{"error": "state database unavailable: connection refused"}'
        self.send_response(503)
        self.send_header("Retry-After", "1")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


@pytest.fixture
def deferring():
    _Deferring.posts = 0
    with serving(_Deferring) as url:
        yield url


def _closed_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed


def _delivered() -> list[int]:
    return [r["window"]["seq"] for body, _ in _Handler.seen for r in json.loads(body)]


def test_a_list_of_daemons_goes_past_a_dead_one_and_a_deferring_one_without_waiting(server, deferring):
    sender = Sender(_tried_in_turn(_closed_port(), deferring, server))
    for seq in range(3):
        sender.submit(_report(seq))
        assert sender.flush(10)
    sender.close()
    assert _delivered() == [0, 1, 2] and sender.dropped == 0
    assert sender.deferred == 0  # the 503 cost no wait: the next daemon took the batch
    assert sender.failovers == 1 and _Deferring.posts == 1  # later batches went straight to the one that took it


def test_when_every_daemon_defers_the_batch_waits_and_is_not_lost(server, deferring):
    _Handler.busy = 1  # the other daemon is at its connection cap once
    sender = Sender(_tried_in_turn(deferring, server))
    sender.submit(_report(7))
    assert sender.flush(15)
    sender.close()
    # It saw it twice: refused at its cap in the first round, taken in the second.
    assert _delivered() == [7, 7] and _Deferring.posts == 2 and sender.dropped == 0 and sender.deferred == 1


def test_endpoint_lists_are_checked():
    from torch_hook.config import ConfigError, ProbeConfig

    cfg = ProbeConfig.from_env({"ARTEMIS_ENDPOINT": "http://a:7600, http://b:7600"})
    assert cfg.endpoint == "http://a:7600,http://b:7600"
    with pytest.raises(ConfigError, match="comma-separated list"):
        ProbeConfig.from_env({"ARTEMIS_ENDPOINT": "http://a:7600,b:7600"})


class _Recording(BaseHTTPRequestHandler):
    """A daemon that records the ranks of each batch it takes; ``refuse`` > 0: answers that many
    next batches 503 (its database unreachable)."""

    ranks: list[int]
    refuse = 0

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        if cls.refuse > 0:
            cls.refuse -= 1
            self.send_response(503)
            self.send_header("Retry-After", "1")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        cls.ranks.extend(r["rank"] for r in body)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")


def test_ranks_spread_over_the_daemons_of_a_list_and_return_home_after_a_failover(monkeypatch):
    """A request costs a daemon far more than the report in it: each rank posts to its home
    daemon (rank plus its node's hash, modulo the list), so a standby takes its share; a rank whose
    home refused a batch sends to the one that took it, and home again after RETURN_HOME_S."""
    import torch_hook.transport as transport

    def home(rank: int, node: str = "n1") -> int:
        return (rank + transport.node_hash(node)) % 2

    monkeypatch.setattr(transport, "RETURN_HOME_S", 0.5)
    daemons = [type(f"Daemon{i}", (_Recording,), {"ranks": [], "refuse": 0}) for i in range(2)]
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), handler) for handler in daemons]
    for srv in servers:
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    endpoint = ",".join(f"http://127.0.0.1:{srv.server_address[1]}" for srv in servers)
    try:
        senders = [Sender(endpoint) for _ in range(4)]
        for rank, sender in enumerate(senders):
            sender.submit(_report(0) | {"rank": rank, "world": 4})
            assert sender.flush(10)
        # A node's ranks alternate over the daemons.
        assert daemons[home(0)].ranks == [0, 2] and daemons[home(1)].ranks == [1, 3] and home(0) != home(1)
        assert all(s.failovers == 0 for s in senders)

        rank1, away = senders[1], 1 - home(1)
        daemons[home(1)].refuse = 1  # rank 1's home cannot take this one
        rank1.submit(_report(1) | {"rank": 1, "world": 4})
        assert rank1.flush(10)
        rank1.submit(_report(2) | {"rank": 1, "world": 4})  # straight to the daemon that took the last
        assert rank1.flush(10)
        assert daemons[away].ranks[-2:] == [1, 1] and rank1.failovers == 1 and rank1.deferred == 0
        time.sleep(0.6)
        rank1.submit(_report(3) | {"rank": 1, "world": 4})  # home again
        assert rank1.flush(10)
        assert daemons[home(1)].ranks[-1] == 1 and daemons[away].ranks.count(1) == 2

        # Nodes' relays (local rank 0: ranks 0, 8, 16, 24 of 8-GPU nodes) spread too: the rank
        # alone would send them all to the same daemon.
        for daemon in daemons:
            daemon.ranks.clear()
        relays = [Sender(endpoint) for _ in range(4)]
        for i, relay in enumerate(relays):
            relay.submit(_report(0) | {"rank": 8 * i, "world": 32, "node": f"n{i}"})
            assert relay.flush(10)
            relay.close()
        assert all(8 * i in daemons[home(8 * i, f"n{i}")].ranks for i in range(4))
        assert daemons[0].ranks and daemons[1].ranks, "n0-n3's relays all went to one daemon"
        for sender in senders:
            sender.close()
        assert sum(s.dropped for s in senders + relays) == 0
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()


class _KeptAlive(BaseHTTPRequestHandler):
    """A daemon that keeps connections alive (HTTP/1.1, as artemisd's aiohttp does), or closes them
    the ways artemisd may: after a reply without saying so (``IdleTimeout``, a newcomer taking the
    slot at ``MaxConnections``), or as a request comes in on a kept connection (the same, at that
    instant): such a request is read and never answered nor taken."""
    protocol_version = "HTTP/1.1"
    taken: list[int] = []  # window seqs answered 200
    connections: list[int] = []  # client ports, one per connection
    close_after_reply = False
    drop_second_request = False

    def log_message(self, *args):
        pass

    def setup(self):
        super().setup()
        _KeptAlive.connections.append(self.client_address[1])
        self.requests_here = 0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests_here += 1
        if _KeptAlive.drop_second_request and self.requests_here == 2:
            _KeptAlive.drop_second_request = False  # once
            self.close_connection = True
            return
        _KeptAlive.taken.extend(r["window"]["seq"] for r in body)
        reply = json.dumps({"accepted": len(body)}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)
        self.close_connection = _KeptAlive.close_after_reply


@pytest.mark.parametrize("closing", ["kept", "closed_after_reply", "closed_as_a_request_comes"])
def test_batches_share_one_connection_and_none_is_lost_or_doubled_when_the_daemon_closes_it(closing):
    _KeptAlive.taken, _KeptAlive.connections = [], []
    _KeptAlive.close_after_reply = closing == "closed_after_reply"
    _KeptAlive.drop_second_request = closing == "closed_as_a_request_comes"
    with serving(_KeptAlive) as url:
        sender = Sender(url)
        try:
            for seq in range(4):
                sender.submit(_report(seq))
                assert sender.flush(5)
                time.sleep(0.05)  # the daemon's close reaches the sender before its next batch
        finally:
            sender.close()
    assert _KeptAlive.taken == [0, 1, 2, 3] and sender.sent == 4 and sender.dropped == 0, sender.last_error
    # The request met by the close went once more, on a new connection, which the rest then kept.
    expected = {"kept": 1, "closed_after_reply": 4, "closed_as_a_request_comes": 2}[closing]
    assert sender.connections_opened == len(_KeptAlive.connections) == expected
