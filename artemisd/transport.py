"""artemisd's front door: a connection cap, idle and read timeouts, bounded request bodies.

What a client can hold, with or without a credential (docs/architecture.md,
"Transport"; TRUST in artemis.conf(5)):

* **connections** — at most ``MaxConnections`` open at once (``ConnectionGate``).
  A new connection beyond the cap first closes the connection that has been
  idle longest (no request being handled: a kept-alive connection, or one
  still sending its request head), the way a web server recycles keep-alive
  slots; only when every connection is busy with a request is the newcomer
  answered ``503`` with ``Retry-After`` and closed.  So a crowd of idle or
  slow-header connections cannot lock real clients out, and overload is
  answered rather than hung.
* **time** — a connection must deliver a complete request head within
  ``IdleTimeout`` of opening or of its previous response, else it is closed
  (aiohttp's keep-alive timer, armed at accept); the body must arrive within
  ``ReadTimeout`` of the head (``read_body``), else ``408``.
* **memory** — the body is read only after the credential in the header is
  judged, streamed in chunks against ``MaxBodySize`` (``413``), and all bodies
  buffered at once share ``MaxBodyMemory`` (``503`` + ``Retry-After`` beyond).

The gate wraps aiohttp's per-connection protocol instead of patching it: every
transport event is passed through, so aiohttp keeps parsing HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import resource
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

# A client told to come back waits this long (plus its own jitter).
RETRY_AFTER_S = 2
# File descriptors the daemon needs besides client connections: SQLite (db,
# WAL, shm), a munge socket per decoding thread (<= 32), pipes of running Slurm
# commands, SMTP, the listening sockets, and shed connections lingering below.
FD_RESERVE = 256
# A shed connection is kept half-open this long so the client reads its 503
# before the close (closing with its request unread would reset the
# connection, and the client could lose the answer); at most this many at once.
SHED_LINGER_S = 1.0
SHED_LINGER_MAX = 128
# Chunk size of a streamed body read (aiohttp's own read buffer is 64 KiB).
_CHUNK = 1 << 16
# Every closed connection leaves a reference cycle in asyncio's transport
# (~1 KiB: the transport, its socket and a bound method of its own), which
# only the cyclic collector frees.  With the high thresholds server.tune_gc
# sets for ingest, ~14,000 of them piled up before a collection: resident
# memory grew with every request or refused connection.  The young
# generations are collected every this many closed connections instead —
# ~1 ms of work per thousand connections.
COLLECT_EVERY = 1000


class Refused(Exception):
    """A request turned away before it was processed: nothing of it was stored.

    ``retry_after`` (seconds) marks a refusal a client should retry later
    (503/429); ``close`` ends the connection after the answer, for refusals
    that leave an unread body behind.
    """

    def __init__(self, status: int, message: str, retry_after: int | None = None, close: bool = False):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        self.close = close

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        resp = web.Response(text=json.dumps({"error": str(self)}), status=self.status,
                            content_type="application/json", headers=headers)
        if self.close:
            resp.force_close()
        return resp


def shed_response(retry_after: int = RETRY_AFTER_S) -> bytes:
    body = json.dumps({"error": f"artemisd is at its connection limit; retry after {retry_after} s"}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Retry-After: %d\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
            % (retry_after, len(body), body))


def fit_connections_to_fd_limit(wanted: int) -> tuple[int, int]:
    """(connection cap, RLIMIT_NOFILE soft limit) that fit together.

    Raises the soft limit towards the hard one when ``wanted`` + FD_RESERVE
    does not fit; if even the hard limit is too low, the cap shrinks so the
    daemon sheds with 503 before accept() starts failing with EMFILE (which
    makes it unreachable for everyone).  systemd's ``LimitNOFILE`` in the unit
    is sized for the default cap.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError):
                pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return wanted, soft
    return max(1, soft - FD_RESERVE), soft


class _Door(asyncio.Protocol):
    """One accepted connection: admitted (events go to aiohttp's handler) or shed."""

    __slots__ = ("gate", "inner", "transport", "admitted", "busy", "_linger")

    def __init__(self, gate: ConnectionGate):
        self.gate = gate
        self.inner: Any = None
        self.transport: asyncio.Transport | None = None
        self.admitted = False
        self.busy = 0
        self._linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.gate._admit(self):
            self.inner = self.gate.make_handler()
            self.gate.open[self.inner] = self
            self.inner.connection_made(transport)
        else:
            self.gate._shed(self)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
            self.gate.lingering -= 1
        self.gate._drop(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)
        self.gate._closed()

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()


class ConnectionGate:
    """Protocol factory for ``loop.create_server`` that caps open connections.

    ``make_handler`` is aiohttp's per-connection protocol factory
    (``AppRunner.server``), set once the runner is up.  ``gate_middleware``
    marks a connection busy while a request handler runs; between requests it
    is idle and, at the cap, may be closed to admit a newcomer (oldest idle
    first).  Everything runs on the event loop: no locks.
    """

    def __init__(self, max_connections: int, metrics: Any = None):
        self.max_connections = max_connections
        self.metrics = metrics
        self.make_handler: Callable[[], Any] = _not_started
        self.open: dict[Any, _Door] = {}  # aiohttp handler -> its door
        self.idle: OrderedDict[_Door, None] = OrderedDict()  # longest idle first
        self.count = 0  # admitted and not yet closed
        self.closed = 0
        self.lingering = 0
        self.shed = 0
        self.evicted = 0

    def __call__(self) -> asyncio.Protocol:
        return _Door(self)

    def _admit(self, door: _Door) -> bool:
        if self.count >= self.max_connections:
            if not self.idle:
                return False
            victim = next(iter(self.idle))
            self._drop(victim)
            self.evicted += 1
            self._count("evicted")
            if victim.inner is not None:
                victim.inner.force_close()
            elif victim.transport is not None:
                victim.transport.close()
        door.admitted = True
        self.count += 1
        self.idle[door] = None
        self._gauge()
        return True

    def _shed(self, door: _Door) -> None:
        self.shed += 1
        self._count("shed")
        transport = door.transport
        assert transport is not None
        transport.write(shed_response())
        if self.lingering >= SHED_LINGER_MAX or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self.lingering += 1
        door._linger = asyncio.get_running_loop().call_later(SHED_LINGER_S, transport.close)

    def _drop(self, door: _Door) -> None:
        """Stop counting ``door`` (closed, or chosen to be closed); idempotent."""
        if not door.admitted:
            return
        door.admitted = False
        self.open.pop(door.inner, None)
        self.idle.pop(door, None)
        self.count -= 1
        self._gauge()

    def _closed(self) -> None:
        self.closed += 1
        if self.closed % COLLECT_EVERY == 0:
            gc.collect(1)

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.connections_refused.labels(outcome).inc()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.connections.set(self.count)

    def busy(self, handler: Any) -> _Door | None:
        """A request handler starts on ``handler``'s connection: not evictable until ``done``."""
        door = self.open.get(handler)
        if door is not None:
            door.busy += 1
            self.idle.pop(door, None)
        return door

    def done(self, door: _Door) -> None:
        door.busy -= 1
        if door.busy == 0 and door.admitted:
            self.idle[door] = None  # at the end: most recently active


def _not_started() -> asyncio.Protocol:
    raise RuntimeError("ConnectionGate.make_handler is set when the aiohttp runner is up")


class BodyBudget:
    """Bytes of request bodies held at once, all requests together (``MaxBodyMemory``)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


@contextlib.asynccontextmanager
async def read_body(request: web.Request, *, limit: int, timeout_s: float, budget: BodyBudget,
                    digest: bool = True) -> AsyncIterator[tuple[bytes, str | None]]:
    """The body and its sha256 hex (None without ``digest``), streamed against ``limit`` bytes within ``timeout_s``.

    The bytes stay counted in ``budget`` until the ``async with`` ends (the
    request is processed); reading never holds more than ``limit`` bytes of one
    request, whatever its Content-Length claimed.  Raises ``Refused``: 413 too
    large, 408 too slow, 503 (+ Retry-After) when the budget is spent.
    """
    declared = request.content_length
    if declared is not None and declared > limit:
        raise Refused(413, f"request body of {declared} bytes exceeds MaxBodySize ({limit} bytes)", close=True)
    held = 0
    chunks: list[bytes] = []
    sha = hashlib.sha256() if digest else None
    try:
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    chunk = await request.content.read(_CHUNK)
                    if not chunk:
                        break
                    if held + len(chunk) > limit:
                        raise Refused(413, f"request body exceeds MaxBodySize ({limit} bytes)", close=True)
                    if not budget.take(len(chunk)):
                        raise Refused(503, "artemisd holds too many request bodies (MaxBodyMemory); "
                                      f"retry after {RETRY_AFTER_S} s", retry_after=RETRY_AFTER_S, close=True)
                    held += len(chunk)
                    if sha is not None:
                        sha.update(chunk)
                    chunks.append(chunk)
        except TimeoutError:
            raise Refused(408, f"request body not received within ReadTimeout ({timeout_s:g} s)",
                          close=True) from None
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        yield body, sha.hexdigest() if sha is not None else None
    finally:
        budget.give(held)


GATE: web.AppKey[ConnectionGate] = web.AppKey("gate", ConnectionGate)


@web.middleware
async def gate_middleware(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    """Marks the connection busy while ``handler`` runs; answers a ``Refused`` with its response."""
    gate = request.app.get(GATE)
    door = gate.busy(request.protocol) if gate is not None else None
    try:
        return await handler(request)
    except Refused as refused:
        if gate is not None and gate.metrics is not None:
            gate.metrics.requests_refused.labels(str(refused.status)).inc()
        return refused.response()
    finally:
        if door is not None:
            gate.done(door)
