"""A node's ranks send in one request: the first local rank's sender relays its siblings' batches."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from tests.unit.http_stub import serving
from torch_hook.relay import NodeRelay, private_directory
from torch_hook.transport import Sender

JOB, STEP, NODE = "77", "0", "n1"
DIRECTIVE = {"type": "probe", "id": "PRB-1", "job": JOB, "step": STEP}


def _report(rank: int, seq: int = 0, job: str = JOB) -> dict:
    return {"type": "window", "v": 1, "job": job, "rank": rank, "world": 4, "node": NODE,
            "window": {"seq": seq, "first_step": seq, "steps": 1, "t0": 1.0, "t1": 2.0},
            "ms": {"step": 1.0, "comm_wait": 0.5}}


class _Daemon(BaseHTTPRequestHandler):
    bodies: list[list[dict]] = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        _Daemon.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        reply = json.dumps({"accepted": len(_Daemon.bodies[-1]), "directives": [DIRECTIVE]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


@pytest.fixture
def daemon():
    _Daemon.bodies = []
    with serving(_Daemon) as url:
        yield url


def _node(tmp_path, endpoint: str, ranks: int, replies: dict[int, list]) -> list[Sender]:
    senders = []
    for local in range(ranks):
        relay = NodeRelay.for_rank(JOB, STEP, NODE, local, base=str(tmp_path))
        assert relay is not None
        replies[local] = []
        senders.append(Sender(endpoint, relay=relay, on_reply=replies[local].append))
    return senders


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_nodes_ranks_send_one_request_and_each_gets_the_directives(tmp_path, daemon):
    replies: dict[int, list] = {}
    relay, *siblings = _node(tmp_path, daemon, 4, replies)
    try:
        for seq in range(2):
            for sender in siblings:
                sender.submit(_report(siblings.index(sender) + 1, seq))
                assert sender.flush(5)
            if seq == 0:  # the relay has not seen a sibling yet: it posts at once, they are separate requests
                _wait_for(lambda: relay.relayed == 3)
            relay.submit(_report(0, seq))
            assert relay.flush(5)
        _wait_for(lambda: relay.relayed == 6)
        # The second window went as one request: the relay waited for its siblings' batches.
        assert sorted(r["rank"] for r in _Daemon.bodies[-1]) == [0, 1, 2, 3]
        assert sum(len(body) for body in _Daemon.bodies) == 8
        assert [s.handed_over for s in siblings] == [2, 2, 2] and all(s.sent == 0 for s in siblings)
        assert relay.sent == 2 and relay.relayed == 6 and relay.dropped == relay.relay_dropped == 0
        # Every sibling is handed the daemon's reply, whose directives the probe acts on.
        _wait_for(lambda: all(replies[local] for local in range(1, 4)))
        assert all(reply["directives"] == [DIRECTIVE] for local in range(4) for reply in replies[local])
    finally:
        for sender in (relay, *siblings):
            sender.close()
    assert not list(tmp_path.glob("artemis-*/*")), "every socket is removed when its sender closes"


def test_a_sibling_posts_itself_when_no_relay_listens(tmp_path, daemon):
    sibling = Sender(daemon, relay=NodeRelay.for_rank(JOB, STEP, NODE, 2, base=str(tmp_path)))
    try:
        sibling.submit(_report(2))
        assert sibling.flush(5)
        assert sibling.sent == 1 and sibling.handed_over == 0 and _Daemon.bodies == [[_report(2) | {
            "dropped_reports": 0}]]
    finally:
        sibling.close()


def test_after_the_relay_closes_its_siblings_post_for_themselves(tmp_path, daemon):
    replies: dict[int, list] = {}
    relay, sibling = _node(tmp_path, daemon, 2, replies)
    try:
        sibling.submit(_report(1, 0))
        assert sibling.flush(5)
        _wait_for(lambda: relay.relayed == 1)
        relay.close()
        sibling.submit(_report(1, 1))
        assert sibling.flush(5)
        assert sibling.handed_over == 1 and sibling.sent == 1
        assert [[r["window"]["seq"] for r in body] for body in _Daemon.bodies] == [[0], [1]]
    finally:
        sibling.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to send as another user")
def test_the_relay_takes_batches_of_its_own_user_and_job_step_only(tmp_path, daemon):
    """Another user's process that reaches the socket (the directory opened up here on purpose:
    Artemis makes it 0700) is not relayed; nor is a batch of another job, even from the same user."""
    # pytest's own directories are 0700: another user could not reach in.
    base = Path(tempfile.mkdtemp(prefix="artemis-relay-test-", dir="/tmp"))
    base.chmod(0o711)
    replies: dict[int, list] = {}
    (relay,) = _node(base, daemon, 1, replies)
    directory = base / "artemis-0"
    directory.chmod(0o711)
    path = relay._relay.relay_path  # type: ignore[union-attr]
    os.chmod(path, 0o666)
    message = json.dumps({"from": "1.1", "reports": [_report(1)]}).encode()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child only sends
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(message, path)
            os._exit(0)
        except BaseException:
            os._exit(1)
    assert os.waitpid(pid, 0)[1] == 0, "the other user's datagram was not even sent"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(json.dumps({"from": "1.1", "reports": [_report(1, job="78")]}).encode(), path)
        _wait_for(lambda: relay._relay.refused == 2)  # type: ignore[union-attr]
        relay.submit(_report(0))
        assert relay.flush(5)
        assert relay.relayed == 0 and [[r["rank"] for r in body] for body in _Daemon.bodies] == [[0]]
    finally:
        relay.close()
        shutil.rmtree(base)


def test_no_relay_in_a_directory_others_may_enter(tmp_path):
    directory = tmp_path / f"artemis-{os.getuid()}"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    assert private_directory(os.getuid(), str(tmp_path)) is None
    assert NodeRelay.for_rank(JOB, STEP, NODE, 0, base=str(tmp_path)) is None
    directory.chmod(0o700)
    assert private_directory(os.getuid(), str(tmp_path)) == directory
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    directory.rmdir()
    directory.symlink_to(tmp_path / "elsewhere")  # never followed
    assert private_directory(os.getuid(), str(tmp_path)) is None


def test_a_forked_child_that_exits_leaves_the_relay_in_place(tmp_path, daemon):
    """A process forked from a rank (a user's helper) runs the rank's exit handlers when it exits
    normally: closing its copy of the relay must not remove the rank's socket."""
    replies: dict[int, list] = {}
    relay, sibling = _node(tmp_path, daemon, 2, replies)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child closes its copies and exits
            relay._relay.close()  # type: ignore[union-attr]
            sibling._relay.close()  # type: ignore[union-attr]
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        sibling.submit(_report(1))
        assert sibling.flush(5)
        assert sibling.handed_over == 1
        _wait_for(lambda: relay.relayed == 1)
        _wait_for(lambda: bool(replies[1]))  # the sibling's own socket is still there too
    finally:
        relay.close(), sibling.close()


def test_a_relay_that_starts_removes_the_sockets_of_ranks_killed_earlier(tmp_path):
    """A rank killed by a signal leaves its socket behind; the next relay to start in the directory
    removes every socket no process listens on, and nothing else."""
    directory = private_directory(os.getuid(), str(tmp_path))
    assert directory is not None
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listening.bind(str(directory / "live.relay"))
    for name in ("killed.relay", "killed.123.1"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as gone:
            gone.bind(str(directory / name))  # closed without unlinking: what SIGKILL leaves
    (directory / "not-a-socket").write_text("")
    relay = NodeRelay.for_rank(JOB, STEP, NODE, 0, base=str(tmp_path))
    sibling = NodeRelay.for_rank(JOB, STEP, NODE, 1, base=str(tmp_path))
    try:
        assert relay is not None and relay.open() and sibling is not None and sibling.open()
        assert sorted(p.name for p in directory.iterdir()) == sorted(
            ["live.relay", "not-a-socket", Path(relay.own_path).name, Path(sibling.own_path).name])
    finally:
        listening.close()
        relay.close(), sibling.close()


def test_the_relays_own_reports_count_its_siblings_reports_it_could_not_deliver(tmp_path):
    """``relay_dropped`` in the relay's reports: the daemon logs and counts those losses, as it
    does a rank's own ``dropped_reports``."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        nobody_listens = f"http://127.0.0.1:{closed.getsockname()[1]}"
    replies: dict[int, list] = {}
    relay, sibling = _node(tmp_path, nobody_listens, 2, replies)
    try:
        theirs = _report(1, 0)
        sibling.submit(theirs)
        assert sibling.flush(5) and sibling.handed_over == 1
        _wait_for(lambda: relay.relay_dropped == 1)
        own = _report(0, 1)
        relay.submit(own)
        assert relay.flush(5)
        assert (own["dropped_reports"], own["relay_dropped"]) == (0, 1) and relay.dropped == 1
        assert theirs["dropped_reports"] == 0 and "relay_dropped" not in theirs  # a sibling's never carry it
    finally:
        relay.close(), sibling.close()


def test_the_relay_takes_batches_in_a_process_holding_over_a_thousand_descriptors(tmp_path, daemon):
    """A training process can hold more descriptors than select() handles (FD_SETSIZE, 1,024):
    the relay's socket then has a number above it, and the relay must still read it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard RLIMIT_NOFILE ({hard}) is too low")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        for _ in range(1100):  # the sockets opened next get numbers above 1,100
            held.append(os.open(os.devnull, os.O_RDONLY))
            if held[-1] >= 1100:
                break
        replies: dict[int, list] = {}
        relay, sibling = _node(tmp_path, daemon, 2, replies)
        try:
            assert relay._relay._sock.fileno() > 1024  # type: ignore[union-attr]
            sibling.submit(_report(1))
            assert sibling.flush(5) and sibling.handed_over == 1
            _wait_for(lambda: relay.relayed == 1)
        finally:
            relay.close(), sibling.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_relay_whose_thread_fails_lets_its_siblings_post_for_themselves_at_once(tmp_path, daemon, monkeypatch):
    replies: dict[int, list] = {}
    relay, sibling = _node(tmp_path, daemon, 2, replies)
    try:
        monkeypatch.setattr(relay._relay, "handed", lambda data: 1 / 0)  # a fault nobody foresaw
        sibling.submit(_report(1, 0))
        assert sibling.flush(5) and sibling.handed_over == 1
        _wait_for(lambda: relay.last_error is not None)
        sibling.submit(_report(1, 1))
        assert sibling.flush(5)
        assert (sibling.handed_over, sibling.sent) == (1, 1)  # not handed to a socket nobody reads
        assert [[r["window"]["seq"] for r in body] for body in _Daemon.bodies] == [[1]]
    finally:
        relay.close(), sibling.close()
