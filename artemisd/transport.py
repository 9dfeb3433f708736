"""artemisd's front door: a connection cap, idle and body deadlines, bounded request bodies.

What a client can hold, with or without a credential (docs/architecture.md,
"Transport"; TRUST in artemis.conf(5)):

* **connections** — at most ``MaxConnections`` open at once (``ConnectionGate``).
  A new connection beyond the cap first closes the connection that has been
  idle longest (no request being handled: a kept-alive connection, or one
  still sending its request head), the way a web server recycles keep-alive
  slots.  With none idle, it takes the place of a connection still *reading
  a body* of the user who holds the most connections, if that user holds
  more than its fair share (``fair_share``: MaxConnections // (users with a
  request in progress + 1)); that connection is answered ``503`` with
  ``Retry-After`` and closed.  Only when no user is over its share is the
  newcomer answered ``503`` and closed.  So neither idle connections nor one
  user's slow uploads can lock everyone else out, and overload is answered
  rather than hung.
* **time** — a connection must deliver a complete request head within
  ``IdleTimeout`` of opening or of its previous response, else it is closed
  (aiohttp's keep-alive timer, armed at accept).  The body must keep
  arriving: it has ``BodyGrace`` after the head, one second more for every
  ``MinBodyRate`` bytes received, and never more than ``ReadTimeout`` in all
  (``body_deadline``, the rule of Apache's mod_reqtimeout), else ``408``.
* **memory** — the body is read only after the credential in the header is
  judged, streamed in chunks against ``MaxBodySize`` (``413``); all bodies
  buffered at once share ``MaxBodyMemory`` and one user's bodies
  ``MaxBodyMemoryPerUser`` (``BodyBudget``; ``503`` + ``Retry-After`` beyond).

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


# The ``reason`` label of artemis_requests_refused_total where a refusal names none.
_REASON_OF_STATUS = {401: "credential", 403: "forbidden", 408: "read_timeout", 413: "too_large",
                     503: "unavailable"}


class Refused(Exception):
    """A request turned away before it was processed: nothing of it was stored.

    ``retry_after`` (seconds) marks a refusal a client should retry later
    (503/429); ``close`` ends the connection after the answer, for refusals
    that leave an unread body behind.  ``reason`` tells refusals of one status
    apart in the metrics (a 503 for memory, for a user's share, for a
    connection given to another user).
    """

    def __init__(self, status: int, message: str, retry_after: int | None = None, close: bool = False,
                 reason: str | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        self.close = close
        self.reason = reason or _REASON_OF_STATUS.get(status, "other")

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
    """One accepted connection: admitted (events go to aiohttp's handler) or shed.

    While a request whose credential has been judged is handled, ``owner`` is
    its sender (``tagged``); while that request's body is read, ``timer`` is
    the body's deadline, which the gate moves to now to take the connection
    back (``evicted``).
    """

    __slots__ = ("gate", "inner", "transport", "admitted", "busy", "_linger", "owner", "tagged", "timer",
                 "evicted")

    def __init__(self, gate: ConnectionGate):
        self.gate = gate
        self.inner: Any = None
        self.transport: asyncio.Transport | None = None
        self.admitted = False
        self.busy = 0
        self._linger: asyncio.TimerHandle | None = None
        self.owner: Any = None
        self.tagged = False
        self.timer: asyncio.Timeout | None = None
        self.evicted = False

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


def fair_share(max_connections: int, users: int) -> int:
    """Connections one user may keep busy once the cap is reached, with ``users`` holding busy ones.

    The newcomer at the door counts as one more user: who it is is not known
    until its head is read, and assuming it is someone else is what keeps
    a heavy user from locking everyone else out.  At least one: a user is
    never left without a connection.
    """
    return max(1, max_connections // (users + 1))


class ConnectionGate:
    """Protocol factory for ``loop.create_server`` that caps open connections.

    ``make_handler`` is aiohttp's per-connection protocol factory
    (``AppRunner.server``), set once the runner is up.  ``gate_middleware``
    marks a connection busy while a request handler runs; between requests it
    is idle and, at the cap, may be closed to admit a newcomer (oldest idle
    first).  ``read_body`` names the connection's user once the credential is
    judged and marks it while the body is read: with none idle, a newcomer
    takes the place of the user over its ``fair_share`` that holds the most
    (max-min fairness), by the connection that has been reading longest.
    Everything runs on the event loop: no locks.
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
        self.evicted_share = 0
        self.owners: dict[Any, int] = {}  # user -> its busy connections (credential judged)
        # user -> its connections reading a body, longest reading first; a user is here only while it has one
        self.readers: dict[Any, dict[_Door, None]] = {}

    def __call__(self) -> asyncio.Protocol:
        return _Door(self)

    def _admit(self, door: _Door) -> bool:
        if self.count >= self.max_connections:
            if self.idle:
                victim = next(iter(self.idle))
                self._drop(victim)
                self.evicted += 1
                self._count("evicted")
                if victim.inner is not None:
                    victim.inner.force_close()
                elif victim.transport is not None:
                    victim.transport.close()
            else:
                reader = self.victim()
                if reader is None:
                    return False
                self._evict_reader(reader)
        door.admitted = True
        self.count += 1
        self.idle[door] = None
        self._gauge()
        return True

    def victim(self) -> _Door | None:
        """The connection a newcomer may take at the cap with none idle: None, or one reading a body
        for the user over its ``fair_share`` that holds the most busy connections."""
        if not self.readers:  # the usual case: honest bodies are read in a millisecond
            return None
        heaviest, most = None, fair_share(self.max_connections, len(self.owners))
        for owner in self.readers:
            held = self.owners.get(owner, 0)
            if held > most:
                heaviest, most = owner, held
        return None if heaviest is None else next(iter(self.readers[heaviest]))

    def _evict_reader(self, door: _Door) -> None:
        timer = door.timer
        self._drop(door)
        door.evicted = True
        self.evicted_share += 1
        self._count("evicted_share")
        if timer is not None:
            # Its read_body wakes at once and answers 503 + Retry-After (nothing of it was processed).
            timer.reschedule(asyncio.get_running_loop().time())
        if door.inner is None:
            return
        # No longer counted against the cap; kept open a moment for that answer,
        # a bounded number at once, as shed connections are.
        if self.lingering >= SHED_LINGER_MAX:
            door.inner.force_close()
            return
        self.lingering += 1
        door._linger = asyncio.get_running_loop().call_later(SHED_LINGER_S, door.inner.force_close)

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
        self._untag(door)
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
        if door.busy == 0:
            self._untag(door)
            if door.admitted:
                self.idle[door] = None  # at the end: most recently active

    def reading(self, door: _Door, owner: Any, timer: asyncio.Timeout) -> None:
        """``door``'s request, sent by ``owner``, starts reading its body under the deadline ``timer``."""
        if not door.admitted:
            return
        self._untag(door)
        door.owner, door.tagged = owner, True
        self.owners[owner] = self.owners.get(owner, 0) + 1
        door.timer = timer
        readers = self.readers.get(owner)
        if readers is None:
            self.readers[owner] = {door: None}
        else:
            readers[door] = None

    def read(self, door: _Door) -> None:
        """``door``'s body is in (or refused): no longer a connection a newcomer may take.  Its user
        keeps it counted until the request is answered."""
        if door.timer is None:
            return
        door.timer = None
        readers = self.readers.get(door.owner)
        if readers is not None:
            readers.pop(door, None)
            if not readers:
                del self.readers[door.owner]

    def _untag(self, door: _Door) -> None:
        self.read(door)
        if door.tagged:
            door.tagged = False
            left = self.owners[door.owner] - 1
            if left:
                self.owners[door.owner] = left
            else:
                del self.owners[door.owner]


def _not_started() -> asyncio.Protocol:
    raise RuntimeError("ConnectionGate.make_handler is set when the aiohttp runner is up")


class BodyBudget:
    """Bytes of request bodies held at once: all requests together (``MaxBodyMemory``), and the
    requests of one owner — a uid, or None for every anonymous caller — together (``per_owner``,
    ``MaxBodyMemoryPerUser``), so one user cannot take the memory every other user's bodies need."""

    def __init__(self, limit: int, per_owner: int | None = None):
        self.limit = limit
        self.per_owner = limit if per_owner is None else min(per_owner, limit)
        self.used = 0
        self.owners: dict[Any, int] = {}  # owner -> bytes held; an owner holding none is not kept

    def take(self, n: int, owner: Any = None) -> bool:
        held = self.owners.get(owner, 0)
        if held + n > self.per_owner or self.used + n > self.limit:
            return False
        self.used += n
        self.owners[owner] = held + n
        return True

    def give(self, n: int, owner: Any = None) -> None:
        if not n:
            return
        self.used -= n
        left = self.owners[owner] - n
        if left:
            self.owners[owner] = left
        else:
            del self.owners[owner]

    def held(self, owner: Any) -> int:
        return self.owners.get(owner, 0)


def body_deadline(start: float, received: int, *, timeout_s: float, grace_s: float, min_rate: int) -> float:
    """When a body whose reading began at ``start`` must be complete, ``received`` bytes in.

    mod_reqtimeout's rule: ``grace_s``, and one second more for every
    ``min_rate`` bytes received, never past ``timeout_s`` (ReadTimeout) in
    all; ``min_rate`` 0 leaves ReadTimeout alone.  A stalled or trickling
    client is cut off within seconds instead of holding memory and a
    connection for all of ReadTimeout; an honest sender, orders of magnitude
    faster than ``min_rate``, only ever meets the grace.
    """
    cap = start + timeout_s
    if min_rate <= 0:
        return cap
    return min(cap, start + grace_s + received / min_rate)


@contextlib.asynccontextmanager
async def read_body(request: web.Request, *, limit: int, timeout_s: float, budget: BodyBudget,
                    digest: bool = True, owner: Any = None, min_rate: int = 0,
                    grace_s: float | None = None) -> AsyncIterator[tuple[bytes, str | None]]:
    """The body and its sha256 hex (None without ``digest``), streamed against ``limit`` bytes in time.

    ``owner`` is who sent it (the credential's uid, judged from the header):
    its bytes count in ``budget`` against that owner's share, and its
    connection is marked for the ``ConnectionGate``, which may take it back
    for a newcomer while the body is read.  The body must arrive by
    ``body_deadline`` (``min_rate`` bytes/s after ``grace_s``, at most
    ``timeout_s``).  The bytes stay counted in ``budget`` until the ``async
    with`` ends (the request is processed); reading never holds more than
    ``limit`` bytes of one request, whatever its Content-Length claimed.
    Raises ``Refused``: 413 too large, 408 too slow, 503 (+ Retry-After) when
    the budget or the owner's share of it is spent, or the connection was
    given to another user.
    """
    declared = request.content_length
    if declared is not None and declared > limit:
        raise Refused(413, f"request body of {declared} bytes exceeds MaxBodySize ({limit} bytes)", close=True)
    grace = timeout_s if grace_s is None else min(grace_s, timeout_s)
    gate = request.app.get(GATE)
    door = gate.open.get(request.protocol) if gate is not None else None
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = body_deadline(start, 0, timeout_s=timeout_s, grace_s=grace, min_rate=min_rate)
    held = 0
    chunks: list[bytes] = []
    sha = hashlib.sha256() if digest else None
    try:
        try:
            async with asyncio.timeout_at(deadline) as timer:
                if door is not None:
                    gate.reading(door, owner, timer)  # type: ignore[union-attr]
                while True:
                    chunk = await request.content.read(_CHUNK)
                    if door is not None and door.evicted:
                        break
                    if not chunk:
                        break
                    if held + len(chunk) > limit:
                        raise Refused(413, f"request body exceeds MaxBodySize ({limit} bytes)", close=True)
                    if not budget.take(len(chunk), owner):
                        raise _spent(budget, owner, len(chunk))
                    held += len(chunk)
                    if sha is not None:
                        sha.update(chunk)
                    chunks.append(chunk)
                    if min_rate:
                        later = body_deadline(start, held, timeout_s=timeout_s, grace_s=grace, min_rate=min_rate)
                        if later > deadline:
                            deadline = later
                            timer.reschedule(later)
        except TimeoutError:
            if door is None or not door.evicted:
                raise _too_slow(held, loop.time() - start, timeout_s, grace, min_rate,
                                deadline >= start + timeout_s) from None
        finally:
            if door is not None:
                gate.read(door)  # type: ignore[union-attr]
        if door is not None and door.evicted:
            raise Refused(503, "artemisd is at its connection limit and your user holds more than its share of "
                          f"connections; retry after {RETRY_AFTER_S} s", retry_after=RETRY_AFTER_S, close=True,
                          reason="connection_share")
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        yield body, sha.hexdigest() if sha is not None else None
    finally:
        budget.give(held, owner)


def _spent(budget: BodyBudget, owner: Any, n: int) -> Refused:
    if budget.held(owner) + n > budget.per_owner:
        who = "anonymous callers" if owner is None else f"uid {owner}"
        return Refused(503, f"{who} already hold their share of request-body memory (MaxBodyMemoryPerUser, "
                       f"{budget.per_owner} bytes); retry after {RETRY_AFTER_S} s", retry_after=RETRY_AFTER_S,
                       close=True, reason="user_body_memory")
    return Refused(503, "artemisd holds too many request bodies (MaxBodyMemory); "
                   f"retry after {RETRY_AFTER_S} s", retry_after=RETRY_AFTER_S, close=True, reason="body_memory")


def _too_slow(held: int, waited: float, timeout_s: float, grace: float, min_rate: int, capped: bool) -> Refused:
    if capped:
        return Refused(408, f"request body not received within ReadTimeout ({timeout_s:g} s)", close=True,
                       reason="read_timeout")
    return Refused(408, f"request body arriving too slowly: {held} bytes in {waited:.1f} s, below MinBodyRate "
                   f"({min_rate} bytes/s after a BodyGrace of {grace:g} s)", close=True, reason="slow_body")


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
            gate.metrics.requests_refused.labels(str(refused.status), refused.reason).inc()
        return refused.response()
    finally:
        if door is not None:
            gate.done(door)
