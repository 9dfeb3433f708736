"""Sends window reports from a background thread; never blocks a step.

``submit`` puts a report on a bounded queue without waiting; a full queue
drops its oldest report (the newest says more about the job now) and counts
it.  The sender thread completes reports (the ``enrich`` callback adds
telemetry, off the training thread), batches them and either POSTs them to
``<endpoint>/v1/reports`` with ``Authorization: Munge <credential>`` or, for
``file:/path``, appends JSON lines (a trace for ``artemis replay``).

``endpoint`` may list several daemons (``http://a:7600,http://b:7600``: one
leads, the others stand by; any of them takes reports).  Each rank has a home
daemon (its rank plus a hash of its node, modulo their number), so a job's
ranks, and a cluster's node relays, spread their requests
over all of them: a request costs a daemon more than the report in it (about
1 ms of CPU against 0.05, docs/benchmarks.md), and a standby's share of that
is work the leader does not do.  One that cannot be reached, or answers
503/429, passes the batch on to the next at once, each tried once per round,
so a failover costs no wait; later batches go to the daemon that took the
last one, and home again after ``RETURN_HOME_S``.  Only when every one of them
deferred does the sender wait.

Each daemon's connection is kept alive from one batch to the next: a new
connection per request cost the daemon ~0.5 ms of CPU besides the request's
~1 ms (docs/benchmarks.md, "Scale").  The daemon closes a connection idle for
its ``IdleTimeout`` (15 s), or sooner when it needs the slot; the sender sees
that before it reuses one (it has something to read: the close) and opens a
new one, and a request that meets the close in flight on a kept connection
(the daemon read none of it) is sent once more on a new one, never more.

A daemon that answers ``503``/``429`` (at its connection or memory limit) has
stored nothing of the batch and asks to be retried: the sender waits its
``Retry-After`` (at least the current backoff, which doubles from 1 s up to
60 s, with jitter so a job's ranks do not return together) and resends the
same batch with a fresh credential, for up to ``hold_s`` in all.  Only the
sender thread waits; training keeps submitting into the bounded queue.  A
daemon that is down, slow or answers garbage costs the batch (dropped,
counted) and nothing else.  ``dropped`` is cumulative and goes into every later
report as ``dropped_reports``.

With a ``relay`` (``relay.py``), a node's ranks send in one request: the
sender of local rank 0 also posts the batches its siblings hand it, waiting
up to ``LINGER_S`` after the first of a window for the others, and hands them
the daemon's reply; a sibling's sender hands its batches over and reads the
replies it is handed, posting a batch itself whenever the relay cannot take
it.  A relayed report that the relay cannot deliver is counted in the relay's
``relay_dropped``, not in its sender's ``dropped_reports``; the relay's own
reports carry both.
"""

from __future__ import annotations

import functools
import hashlib
import http.client
import json
import os
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from torch_hook.munge import MungeSigner
from torch_hook.notice import Reachability
from torch_hook.relay import NodeRelay, readable
from torch_hook.retry import RETRY_STATUSES, Backoff, retry_after_s

_BATCH_MAX = 64
# After a failover, batches stay with the daemon that took them this long
# before the home daemon is tried again: a home that stays down costs one
# refused (or timed out) connection per this long, not one per batch.
RETURN_HOME_S = 60.0
# The relay waits this long after the first batch of a window for its
# siblings' (they close the same window within milliseconds of each other).
LINGER_S = 0.2
REPLY_POLL_S = 1.0  # a sibling reads the replies it was handed at least this often
_HOLD_S = 300.0  # a batch the daemon keeps refusing is dropped after this long
_REPLY_MAX = 1 << 20  # a longer reply is read this far (its directives lost) and its connection closed
_STOP = object()
# A kept-alive connection that fails in these ways before any reply was closed by the daemon while
# idle (its IdleTimeout, or a newcomer took its slot at MaxConnections): the daemon read nothing of
# the request, which is sent once more on a new connection.
_CLOSED_WHILE_IDLE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


class _Refused(Exception):
    """The daemon answered and refused the batch itself (an error status other than 503/429)."""


class _Deferred(Exception):
    """The daemon answered 503/429: nothing stored, retry after ``wait_s`` (None: not said)."""

    def __init__(self, status: int, wait_s: float | None):
        super().__init__(f"HTTP {status}, retry after {wait_s if wait_s is not None else '?'} s")
        self.wait_s = wait_s


class _Relayed:
    """A sibling's batch (``sibling``: its relay ident), handed to this rank's sender to post (the relay's)."""

    __slots__ = ("sibling", "reports")

    def __init__(self, sibling: str, reports: list[dict[str, Any]]):
        self.sibling, self.reports = sibling, reports


class Sender:
    def __init__(
        self,
        endpoint: str | None,
        *,
        queue_size: int = 64,
        timeout_s: float = 2.0,
        munge_socket: str | None = None,
        enrich: Callable[[dict[str, Any]], None] | None = None,
        on_reply: Callable[[dict[str, Any]], None] | None = None,
        hold_s: float = _HOLD_S,
        backoff: Backoff | None = None,
        relay: NodeRelay | None = None,
    ):
        self.endpoint = endpoint
        self._urls = [u for u in (endpoint or "").split(",") if u] if endpoint and endpoint.startswith("http") else []
        self._paths = [urlsplit(u).path.rstrip("/") + "/v1/reports" for u in self._urls]
        self._current: int | None = None  # index of the daemon that took the last batch
        # Sender thread: a kept-alive connection per daemon.  A new connection per request cost
        # the daemon ~0.5 ms of CPU more than the request itself (docs/benchmarks.md, "Scale").
        self._connections: dict[int, http.client.HTTPConnection] = {}
        self.connections_opened = 0  # sender thread
        self._away_since = 0.0  # time.monotonic() when batches left the home daemon
        self.failovers = 0  # sender thread: batches that the first daemon tried passed on to another
        self.timeout_s = timeout_s
        self.hold_s = hold_s
        self._backoff = backoff or Backoff(random.Random())
        self._closing = threading.Event()
        self._munge_socket = munge_socket
        self._enrich = enrich
        self._on_reply = on_reply
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._idle = threading.Event()
        self._idle.set()
        # Counters (read by tests and put in reports); each written by one thread
        # only, so no increment is ever lost.
        self._dropped_full = 0  # training thread: queue full, oldest dropped
        self._dropped_send = 0  # sender thread: daemon down, slow or refusing
        self.deferred = 0  # sender thread: 503/429 answers waited out
        self.sent = 0
        self.unauthenticated = 0
        self.bad_replies = 0
        self.errors = 0
        self.last_error: str | None = None
        self.reachability = Reachability(endpoint)  # one stderr line per outage (notice.py)
        self.relayed = 0  # sender thread: siblings' reports this relay posted
        self._relay_full = 0  # relay thread: siblings' reports dropped, the queue full
        self._relay_lost = 0  # sender thread: siblings' reports whose request failed
        self.handed_over = 0  # sender thread: this sibling's reports the relay took
        self._own: dict[str, Any] | None = None  # sender thread: a report of this sender's own (rank, node)
        self._relay = relay if relay is not None and self._urls and relay.open() else None
        self._relay_stop = threading.Event()
        self._siblings_seen = False  # relay thread: a sibling has handed a batch over
        self._relay_thread: threading.Thread | None = None
        if self._relay is not None and self._relay.is_relay:
            self._relay_thread = threading.Thread(target=self._take_handed, name="artemis-relay", daemon=True)
            self._relay_thread.start()
        self._thread = threading.Thread(target=self._run, name="artemis-sender", daemon=True)
        self._thread.start()

    @property
    def relay_dropped(self) -> int:
        """Siblings' reports this relay took and lost (its queue full, or their request failed)."""
        return self._relay_full + self._relay_lost

    @property
    def dropped(self) -> int:
        """Reports lost so far (cumulative): queue full plus failed sends."""
        return self._dropped_full + self._dropped_send

    # -- training thread -----------------------------------------------------
    def submit(self, report: dict[str, Any]) -> bool:
        """Queue ``report``; never waits.  False: the queue was full and its oldest report was dropped."""
        kept_all = True
        for _ in range(2):  # the sender may refill the slot we freed; then the newest is dropped
            try:
                self._queue.put_nowait(report)
                self._idle.clear()
                return kept_all
            except queue.Full:
                kept_all = False
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    continue
                self._dropped_full += 1
        self._dropped_full += 1
        return False

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until everything submitted was handled."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            # Always block in wait(): it releases the GIL the sender needs.
            if self._idle.wait(min(0.05, left)) and self._queue.empty():
                return True
        return False

    def close(self, timeout_s: float = 2.0) -> None:
        if self._relay_thread is not None:
            # Siblings post for themselves from now on; what they handed over already is read and sent.
            self._relay.stop_listening()  # type: ignore[union-attr]
            self._relay_stop.set()
            self._relay_thread.join(timeout=1.0)
        self.flush(timeout_s)
        self._closing.set()  # a batch waiting out a 503 is dropped now, not retried
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:
            pass
        self._thread.join(timeout=max(0.1, timeout_s))
        if self._relay is not None:
            self._relay.close()

    # -- relay thread (local rank 0) -------------------------------------------
    def _take_handed(self) -> None:
        try:
            self._relay_loop()
        except Exception as err:  # noqa: BLE001 - the rank trains on; its siblings post for themselves
            self.last_error = f"relay: {err!r}"
            # Its path goes at once: a sibling's next hand-over then fails and it posts the batch
            # itself, instead of filling a socket nobody reads (those batches would be lost unseen).
            self._relay.stop_listening()  # type: ignore[union-attr]

    def _relay_loop(self) -> None:
        relay = self._relay
        assert relay is not None
        while True:
            stopping = self._relay_stop.is_set()
            data = relay.receive(wait=not stopping)
            if data is None:
                if stopping:
                    return  # its path is gone and nothing is left to read
                continue
            handed = relay.handed(data)
            if handed is None:
                continue
            self._siblings_seen = True
            try:
                self._queue.put_nowait(_Relayed(*handed))
                self._idle.clear()
            except queue.Full:  # the rank's own reports keep their place; a sibling's batch is dropped
                self._relay_full += len(handed[1])

    # -- sender thread -------------------------------------------------------
    def _run(self) -> None:
        signer: MungeSigner | None = None
        if self.endpoint and self.endpoint.startswith("http"):
            signer = MungeSigner(self._munge_socket, self.timeout_s)
        sibling = self._relay is not None and not self._relay.is_relay
        while True:
            try:
                item = self._queue.get(timeout=REPLY_POLL_S if sibling else None)
            except queue.Empty:
                self._read_handed_replies()
                continue
            if item is _STOP:
                self._close_connections()
                return
            batch = [item]
            # Only once siblings have handed batches over: a rank alone on its node never waits.
            linger_until = time.monotonic() + LINGER_S if self._siblings_seen else 0.0
            while _reports_in(batch) < _BATCH_MAX:
                try:
                    left = linger_until - time.monotonic()
                    more = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    self._send(batch, signer)
                    self._close_connections()
                    return
                batch.append(more)
            self._send(batch, signer)
            if sibling:
                self._read_handed_replies()
            if self._queue.empty():
                self._idle.set()

    def _read_handed_replies(self) -> None:
        """A sibling: the daemon's replies the relay handed this rank, to the reply handler."""
        while (data := self._relay.receive(wait=False)) is not None:  # type: ignore[union-attr]
            try:
                reply = json.loads(data)
                if isinstance(reply, dict) and self._on_reply is not None:
                    self._on_reply(reply)
            except Exception as err:  # noqa: BLE001 - a bad reply costs its directives, nothing else
                self.errors += 1
                self.last_error = f"handed reply: {err!r}"

    def _send(self, batch: list[dict[str, Any] | _Relayed], signer: MungeSigner | None) -> None:
        give_up = time.monotonic() + self.hold_s
        self._backoff.reset()
        own = [item for item in batch if not isinstance(item, _Relayed)]
        handed = [item for item in batch if isinstance(item, _Relayed)]
        relayed = sum(len(item.reports) for item in handed)
        try:
            for report in own:
                if self._enrich is not None:
                    try:
                        self._enrich(report)
                    except Exception as err:  # noqa: BLE001 -- a report without telemetry beats none
                        self.errors += 1
                        self.last_error = f"enrich: {err!r}"
                report["dropped_reports"] = self.dropped
                if self._relay is not None and self._relay.is_relay:
                    report["relay_dropped"] = self.relay_dropped
            if own:
                self._own = own[0]
            if not self.endpoint:
                return
            if self._relay is not None and not self._relay.is_relay and self._relay.hand_over(own):
                self.handed_over += len(own)
                return
            reports = [r for item in batch for r in (item.reports if isinstance(item, _Relayed) else (item,))]
            while True:
                try:
                    if self.endpoint.startswith("file:"):
                        self._append(reports)
                    else:
                        reply = self._post(reports, signer)
                        if handed and reply is not None:
                            self._relay.answer({item.sibling for item in handed}, reply)  # type: ignore[union-attr]
                    break
                except _Deferred as deferred:
                    self.deferred += 1
                    self.last_error = f"deferred: {deferred}"
                    wait = self._backoff.next(deferred.wait_s)
                    if time.monotonic() + wait > give_up:
                        raise
                    if self._closing.wait(wait):
                        raise
            self.sent += len(own)
            self.relayed += relayed
            self.reachability.ok(self.dropped)
        except Exception as err:  # noqa: BLE001 -- daemon down, slow, disk full: drop and count
            self._dropped_send += len(own)
            self._relay_lost += relayed
            self.last_error = f"{type(err).__name__}: {err}"
            self.reachability.failed(self.last_error, self.dropped - len(own))

    def _append(self, batch: list[dict[str, Any]]) -> None:
        path = self.endpoint[len("file:"):]
        data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in batch).encode()
        # One write() on an O_APPEND descriptor: lines of concurrent ranks never interleave.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def _exchange(self, at: int, body: bytes, headers: dict[str, str]) -> tuple[int, str, str | None, bytes]:
        """POST ``body`` to daemon ``at`` over its kept-alive connection: (status, reason, Retry-After,
        reply).  A connection the daemon closed while it was idle is replaced, and the request sent
        once more on the new one, never more: the daemon read nothing of it on the old one."""
        for attempt in range(2):
            conn = self._connections.get(at)
            # An idle kept-alive connection with something to read has been closed by the daemon (or
            # is out of step with it): not to be used again.
            reused = conn is not None and conn.sock is not None and not readable(conn.sock, 0)
            if not reused:
                conn = self._connect(at)
            assert conn is not None
            try:
                conn.request("POST", self._paths[at], body=body, headers=headers)
                response = conn.getresponse()
                raw = response.read(_REPLY_MAX)
            except _CLOSED_WHILE_IDLE:
                self._disconnect(at)
                if reused and attempt == 0:
                    continue
                raise
            except BaseException:
                self._disconnect(at)
                raise
            if response.will_close or not response.isclosed():  # Connection: close, or a reply too long
                self._disconnect(at)
            return response.status, response.reason, response.getheader("Retry-After"), raw
        raise AssertionError("unreachable")

    def _connect(self, at: int) -> http.client.HTTPConnection:
        self._disconnect(at)
        url = urlsplit(self._urls[at])
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        conn = kind(url.hostname or "", url.port, timeout=self.timeout_s)
        conn.connect()  # http.client sets TCP_NODELAY: a request and its reply are one round trip
        self._connections[at] = conn
        self.connections_opened += 1
        return conn

    def _disconnect(self, at: int) -> None:
        conn = self._connections.pop(at, None)
        if conn is not None:
            conn.close()

    def _close_connections(self) -> None:
        for at in list(self._connections):
            self._disconnect(at)

    def _home_and_first(self, report: dict[str, Any]) -> tuple[int, int]:
        """This rank's home daemon, and the one a batch goes to first: the one that took the last
        batch, or home at the start and ``RETURN_HOME_S`` after a failover.

        Home is the rank plus a hash of its node, modulo the daemons: a node's ranks alternate over
        them, and so do the nodes' relays, whose ranks (local rank 0's) are all multiples of the
        node's size, which the rank alone would send to the same daemon."""
        rank, node = report.get("rank"), report.get("node")
        if type(rank) is not int or rank < 0 or not isinstance(node, str):
            home = 0
        else:
            home = (rank + node_hash(node)) % len(self._urls)
        if self._current is None or time.monotonic() - self._away_since >= RETURN_HOME_S:
            return home, home
        return home, self._current

    def _post(self, batch: list[dict[str, Any]], signer: MungeSigner | None) -> bytes | None:
        """POST the batch; the daemon's reply (None: it took the batch but its answer was unreadable)."""
        body = json.dumps(batch, separators=(",", ":")).encode()
        deferred: _Deferred | None = None
        failure: Exception | None = None
        unsigned = False
        # A relay's batch may begin with a sibling's report: its home stays its own rank's.
        home, first = self._home_and_first(self._own if self._own is not None else batch[0])
        for turn in range(len(self._urls)):
            at = (first + turn) % len(self._urls)
            # A credential per daemon: munge decodes each one once (a second
            # decode is a replay, 401), and the daemon that deferred the batch
            # has decoded this one already.  It is bound to this POST, to the
            # path _exchange sends, and to this body (munge.request_payload).
            headers = {"Content-Type": "application/json"}
            credential = signer.credential("POST", self._paths[at], body) if signer is not None else None
            if credential:
                headers["Authorization"] = f"Munge {credential}"
            elif not unsigned:
                unsigned = True
                self.unauthenticated += 1
            try:
                status, reason, retry_after, raw = self._exchange(at, body, headers)
            except (OSError, http.client.HTTPException) as err:  # unreachable, timed out, garbled: the next may lead
                failure = err
                continue
            if status in RETRY_STATUSES:
                wait = retry_after_s(retry_after)
                if deferred is None or (wait or 0) > (deferred.wait_s or 0):
                    deferred = _Deferred(status, wait)
                continue
            if not 200 <= status < 300:  # it answered, and refused the batch itself: another daemon would too
                raise _Refused(f"HTTP {status} {reason}: {raw[:200].decode('utf-8', 'replace')}")
            if at != first:
                self.failovers += 1
            if at != home and first == home:
                self._away_since = time.monotonic()  # home refused it (again): the next try is RETURN_HOME_S away
            self._current = at
            break
        else:
            if deferred is not None:
                raise deferred
            assert failure is not None
            raise failure
        try:
            reply = json.loads(raw)
            if not isinstance(reply, dict):
                raise ValueError(f"expected a JSON object, got {type(reply).__name__}")
        except ValueError as err:
            self.bad_replies += 1
            self.last_error = f"reply: {err}"
            return None  # the daemon took the batch; only its answer was unreadable
        if self._on_reply is not None:
            try:
                self._on_reply(reply)
            except Exception as err:  # noqa: BLE001
                self.errors += 1
                self.last_error = f"reply handler: {err!r}"
        return raw


def _reports_in(batch: list[Any]) -> int:
    return sum(len(item.reports) if isinstance(item, _Relayed) else 1 for item in batch)


@functools.lru_cache(maxsize=64)
def node_hash(node: str) -> int:
    """A node name's well-mixed hash (CRC32's low bits are alike for n0, n1, n2...: every node's
    relay would have the same home)."""
    return int.from_bytes(hashlib.blake2b(node.encode("utf-8", "replace"), digest_size=8).digest(), "big")
