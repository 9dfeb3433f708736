"""Hostile and slow HTTP clients against a real artemisd on 127.0.0.1, and its memory.

Used by tests/cluster/test_daemon_transport.py and benchmarks/transport.py.
Everything talks to loopback only; every loop is bounded in count and time;
sockets are closed by their ``with`` blocks and the daemon is stopped by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import socket
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .procs import Daemon, spawn, wait_until
from .slurm import free_port


def vm_kib(pid: int, field: str = "VmHWM") -> int:
    """A /proc/PID/status memory field in KiB: VmHWM is the resident high-water mark."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class StandaloneDaemon:
    """The real ``artemisd`` on 127.0.0.1 with AuthType=munge and ``conf`` appended; no Slurm.

    ``SLURM_CONF`` points nowhere: the transport never needs Slurm, and root's
    reports need no ownership check.
    """

    def __init__(self, workdir: Path, munge_socket: str | Path, conf: str = "", python: str = sys.executable,
                 pythonpath: str | None = None, nofile: int | None = None):
        self.dir = Path(workdir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.munge_socket = str(munge_socket)
        self.conf = conf
        self.python = python
        self.pythonpath = pythonpath
        self.nofile = nofile  # RLIMIT_NOFILE (soft and hard), as systemd's LimitNOFILE= sets it
        self.daemon: Daemon | None = None

    @property
    def pid(self) -> int:
        assert self.daemon is not None
        return self.daemon.pid

    def __enter__(self) -> StandaloneDaemon:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "state").mkdir(exist_ok=True)
        conf = self.dir / "artemis.conf"
        conf.write_text(textwrap.dedent(f"""\
            Listen=127.0.0.1:{self.port}
            StateDir={self.dir}/state
            AuthType=munge
            MungeSocket={self.munge_socket}
            SlurmUser=root
            SlurmTimeout=2
            """) + self.conf)
        env = dict(os.environ, SLURM_CONF="/nonexistent")
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath
        nofile = self.nofile

        def limit_files() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.daemon = spawn("artemisd", [self.python, "-P", "-m", "artemisd.server", "-c", str(conf)],
                            self.dir / "artemisd.log", env=env, preexec=limit_files)
        try:
            wait_until(self.healthy, "artemisd to answer /v1/health", timeout_s=60, daemon=self.daemon)
        except BaseException:
            self.stop()
            raise
        return self

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/health", timeout=timeout_s) as reply:
                return reply.status == 200
        except OSError:
            return False

    def metric(self, name: str) -> float:
        """Sum of one Prometheus metric's samples (all labels)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def munge_credential(munge_socket: str | Path, body: bytes, method: str = "POST", path: str = "/v1/reports") -> str:
    """A root credential for ``method`` on ``path`` with ``body`` (through libmunge: fast enough for thousands)."""
    from torch_hook.munge import MungeSigner

    signer = MungeSigner(str(munge_socket))
    try:
        cred = signer.credential(method, path, body)
    finally:
        signer.close()
    assert cred, signer.last_error
    return cred


def post(url: str, path: str, body: bytes, cred: str | None, timeout_s: float = 30.0) -> tuple[int, dict, Any]:
    """(status, JSON reply, headers) of one POST by a well-behaved client (urllib)."""
    req = urllib.request.Request(f"{url}{path}", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    if cred is not None:
        req.add_header("Authorization", f"Munge {cred}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read()), resp.headers
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}"), err.headers


def head_bytes(port: int, path: str = "/v1/reports", *, length: int | None = None, chunked: bool = False,
               cred: str | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Content-Type: application/json"]
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    elif length is not None:
        lines.append(f"Content-Length: {length}")
    if cred is not None:
        lines.append(f"Authorization: Munge {cred}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_answer(sock: socket.socket, timeout_s: float) -> tuple[int | None, dict[str, str], bytes]:
    """(status, headers, body) of the response on ``sock``; status None if it closed without one."""
    sock.settimeout(timeout_s)
    data = b""
    deadline = time.monotonic() + timeout_s
    try:
        while b"\r\n\r\n" not in data and time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1."):
        return None, {}, b""
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    want = int(headers.get("content-length", "0"))
    try:
        while len(body) < want and time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    return int(lines[0].split()[1]), headers, body


def upload(port: int, size: int, *, chunked: bool, cred: str | None, timeout_s: float = 20.0
           ) -> tuple[int | None, int]:
    """Push a body of ``size`` bytes as fast as the daemon takes it.

    Returns (status of the answer, bytes the client managed to send).  The
    answer is looked for after every 1 MiB, so a daemon that refuses early is
    seen refusing early.
    """
    sent = 0
    block = b"x" * (1 << 20)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head_bytes(port, length=None if chunked else size, chunked=chunked, cred=cred))
        deadline = time.monotonic() + timeout_s
        while sent < size and time.monotonic() < deadline:
            readable, writable, _ = select.select([sock], [sock], [], 1.0)
            if readable:
                break  # the answer (or a close) came: the daemon is not waiting for the rest
            if not writable:
                continue
            piece = block[: min(len(block), size - sent)]
            payload = (b"%x\r\n" % len(piece)) + piece + b"\r\n" if chunked else piece
            try:
                sock.sendall(payload)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(piece)
        if chunked and sent == size:
            with contextlib.suppress(OSError):
                sock.sendall(b"0\r\n\r\n")
        status, _, _ = read_answer(sock, max(1.0, deadline - time.monotonic()))
    return status, sent


def concurrently(n: int, fn: Any, *args: Any, **kw: Any) -> list[Any]:
    """Run ``fn(*args, **kw)`` in ``n`` threads at once; their results in order."""
    results: list[Any] = [None] * n

    def one(i: int) -> None:
        try:
            results[i] = fn(*args, **kw)
        except Exception as err:  # noqa: BLE001 - reported as the result
            results[i] = err

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


@contextlib.contextmanager
def idle_connections(port: int, n: int, timeout_s: float = 60.0) -> Iterator[list[socket.socket]]:
    """``n`` connections that never send a byte, all closed on exit."""
    socks: list[socket.socket] = []
    deadline = time.monotonic() + timeout_s
    try:
        for _ in range(n):
            if time.monotonic() > deadline:
                raise TimeoutError(f"opened only {len(socks)} of {n} connections in {timeout_s:g} s")
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        yield socks
    finally:
        for sock in socks:
            sock.close()


def closed_by_peer(sock: socket.socket, timeout_s: float) -> float | None:
    """Seconds until the daemon closes ``sock`` (EOF or reset), None if it is still open after ``timeout_s``."""
    start = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - start < timeout_s:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - start
        except socket.timeout:
            continue
        except OSError:
            return time.monotonic() - start
    return None


def credential_as(munge_socket: str | Path, user: str, body: bytes, method: str = "POST",
                  path: str = "/v1/reports") -> str:
    """A credential made by ``user`` (a name in /etc/passwd; root runs this) for ``method`` on ``path``
    with ``body``: a sender that is not root, or several different ones."""
    import pwd
    import subprocess

    from torch_hook.munge import request_payload

    entry = pwd.getpwnam(user)
    done = subprocess.run(["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups",
                           "munge", "-S", str(munge_socket), "-s", request_payload(method, path, body)],
                          capture_output=True, text=True, timeout=10, check=True)
    return done.stdout.strip()
