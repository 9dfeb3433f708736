"""``artemisd``: the HTTP service around ``Daemon`` (aiohttp).

Endpoints (JSON unless noted; docs/architecture.md "Daemon"):

    POST /v1/reports                      window reports / node events (array or JSON Lines)
    GET  /v1/incidents[?all=1]            incidents (suspects and dismissed only with all=1), paged:
                                          ?limit= (1000) and ?offset=, ``next`` while more are left
    GET  /v1/incidents/{id}               one incident, its actions and audit trail
    GET  /v1/incidents/{id}/windows       the job's newest stored per-rank windows (for plots), paged:
                                          ?limit= (5000 reports) and ?before= the ``before`` of the last page
    POST /v1/incidents/{id}/approve|deny  admin only
    GET  /v1/nodes/{node}/corrections     root/SlurmUser only: corrections the node check applies
    POST /v1/nodes/{node}/corrections/{id}  root/SlurmUser only: {"status": "done"|"failed", "detail"}
    GET  /v1/status                       daemon summary
    GET  /v1/health                       liveness, role (leader|standby), the lease holder and its age
    GET  /metrics                         Prometheus text format

Every request that changes something carries ``Authorization: Munge <cred>``
whose payload binds method, path and body (auth.py).  The credential is judged
from the header before any of the body is read; the body is then streamed
against ``MaxBodySize`` (``signed_body``).  Connections, idle time and body
memory are capped at the door (transport.py).  Reads of incidents and status
are open, like ``squeue``, or with ``ReadAuth=required`` signed like writes and
private to the job's owner (``reader``); either way they run off the event
loop, paged (reads.py).  Health and metrics are always open.  SIGHUP re-reads the config; a
bad file keeps the running config and logs the error with file:line.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import structlog
from aiohttp import web

from artemisd import __version__
from artemisd.auth import AuthError, MungeAuth, NoAuth, Principal
from artemisd.config import Config, ConfigError, load_config
from artemisd.metrics import CONTENT_TYPE_LATEST
from artemisd.ingest import MAX_ITEMS_PER_REQUEST, IngestError, IngestResult, Submission, decode_body, fast_records
from artemisd import reads
from artemisd.reads import OPEN, ReadPool, Reader
from artemisd.service import Daemon
from artemisd.store import StateStore, StoreUnavailable, open_store
from artemisd.slurm import make_backend
from artemisd.transport import (GATE, RETRY_AFTER_S, BodyBudget, ConnectionGate, Refused,
                                fit_connections_to_fd_limit, gate_middleware, read_body)

TICK_S = 1.0
STORE_RETRY_S = 5  # Retry-After while the state database is unreachable
GROUP_BYTES = 64 << 20  # the request bodies stored in one statement together (GroupCommit), at most
# After answering a request whose body it did not read (401, 413), aiohttp
# reads and discards the rest this long before closing, so the client gets
# the answer instead of a connection reset; discarded bytes cost no memory.
LINGER_S = 2.0
LISTEN_BACKLOG = 1024
DAEMON: web.AppKey[Daemon] = web.AppKey("daemon", Daemon)
AUTH: web.AppKey[Any] = web.AppKey("auth", object)
BODIES: web.AppKey[BodyBudget] = web.AppKey("bodies", BodyBudget)

log = structlog.get_logger("artemisd")


def configure_logging(level: int = logging.INFO) -> None:
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def tune_gc() -> None:
    """Fewer cyclic-GC passes while ingesting.

    Ingest allocates many short-lived containers (decoded JSON, pydantic models)
    that reference counting frees; with the default generation-0 threshold (700)
    the cyclic collector runs every few reports and re-walks the long-lived
    analyzer state each time, which costs about a third of the ingest CPU.
    Objects alive after start-up (config, restored analyzer) are frozen out of
    collection; the thresholds make full passes rare.  Ingest makes no
    reference cycles per report; the one cycle every connection leaves behind
    (in asyncio's transport) is collected by the ConnectionGate
    (transport.COLLECT_EVERY), not by lowering these thresholds, which cost
    10-20 % of ingest.
    """
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)


def make_auth(config: Config) -> MungeAuth | NoAuth:
    d = config.daemon
    if d.auth_type == "none":
        return NoAuth()
    from artemisd.slurm.cli import CliSlurm  # uid lookup only: no Slurm call

    slurm_uid = CliSlurm().uid_of(d.slurm_user)
    return MungeAuth(d.munge_socket, {slurm_uid} if slurm_uid is not None else set(), set(d.admin_uids))


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


def _refused(daemon: Daemon, err: AuthError) -> Refused:
    daemon.metrics.auth_failures.inc()
    # 503: munged unreachable — the client's credential may be fine, so it retries.
    return Refused(err.status, str(err), retry_after=RETRY_AFTER_S if err.status == 503 else None)


@contextlib.asynccontextmanager
async def signed_body(request: web.Request) -> AsyncIterator[tuple[Principal, bytes]]:
    """Who sent the request, and its body — in the order that keeps memory safe.

    The declared size and the credential (``Authorization`` header) are judged
    before a byte of the body is read, so a client without a valid credential
    costs a munge decode and nothing else; so does one whose credential was
    made for another method or path (``Credential.bind``: the request-target
    exactly as sent, ``raw_path``).  The body is then streamed against
    ``MaxBodySize`` within ``ReadTimeout`` and checked against the digest the
    credential vouches for.  Raises ``Refused`` (answered by the middleware).
    """
    daemon = request.app[DAEMON]
    settings = daemon.config.daemon
    declared = request.content_length
    if declared is not None and declared > settings.max_body_size:
        raise Refused(413, f"request body of {declared} bytes exceeds MaxBodySize "
                      f"({settings.max_body_size} bytes)", close=True)
    method, path = request.method, request.raw_path
    try:
        credential = await request.app[AUTH].check(request.headers.get("Authorization"))
        credential.bind(method, path)
    except AuthError as err:
        raise _refused(daemon, err) from None
    async with read_body(request, limit=settings.max_body_size, timeout_s=settings.read_timeout,
                         budget=request.app[BODIES], digest=credential.signed is not None,
                         owner=credential.principal.uid, min_rate=settings.min_body_rate,
                         grace_s=settings.body_grace) as (body, digest):
        try:
            principal = credential.verify(method, path, digest)
        except AuthError as err:
            raise _refused(daemon, err) from None
        if credential.legacy:  # a probe of a job started before the upgrade (auth.py, LEGACY_ROUTES)
            daemon.metrics.legacy_credentials.inc()
        yield principal, body


class GroupCommit:
    """The requests whose records are ready in one turn of the event loop, stored in one transaction.

    Each request's records wait here (``accept``) until the loop has run every
    other handler that was ready with it, then go to ``Daemon.accept_many``
    together: one database statement for all of them instead of one each (the
    request, not the report, is what costs at scale: docs/benchmarks.md
    "Scale").  A request alone waits one turn of the loop, nothing more: the
    groups grow only where requests arrive together, i.e. under load.  A group
    holds at most ``max_records`` records and ``max_bytes`` of bodies (the rest
    are the next group's; a request larger than that is a group of its own),
    so one flush stays as bounded as one request, and one statement's arrays
    far below PostgreSQL's 1 GB a value.  A request whose handler was
    cancelled before its group ran (the client went away) is not stored: it
    got no answer, and its sender sends it again.
    """

    def __init__(self, daemon: Daemon, max_records: int = MAX_ITEMS_PER_REQUEST, max_bytes: int = GROUP_BYTES):
        self.daemon = daemon
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._waiting: collections.deque[tuple[Submission, asyncio.Future[IngestResult]]] = collections.deque()
        self._scheduled = False

    async def accept(self, submission: Submission) -> IngestResult:
        """``submission``'s result once its group is stored; raises ``StoreUnavailable`` for a retry."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[IngestResult] = loop.create_future()
        self._waiting.append((submission, done))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return await done

    def _flush(self) -> None:
        self._scheduled = False
        group: list[tuple[Submission, asyncio.Future[IngestResult]]] = []
        records = size = 0
        while self._waiting:
            submission, done = self._waiting[0]
            if group and (records + len(submission.records) > self.max_records
                          or size + submission.size > self.max_bytes):
                break
            self._waiting.popleft()
            if not done.done():  # cancelled: never stored, never answered
                group.append((submission, done))
                records += len(submission.records)
                size += submission.size
        if self._waiting:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)
        if not group:
            return
        try:
            outcomes = self.daemon.accept_many([submission for submission, _ in group])
        except Exception as err:  # noqa: BLE001 - each request answers it as it would have alone (500)
            outcomes = [err for _ in group]
        self.daemon.metrics.ingest_group.observe(len(group))
        # No await since the group was taken: nothing could cancel its futures meanwhile.
        for (_, done), outcome in zip(group, outcomes):
            if isinstance(outcome, BaseException):
                done.set_exception(outcome)
            else:
                done.set_result(outcome)


GROUPS: web.AppKey[GroupCommit] = web.AppKey("groups", GroupCommit)
READS: web.AppKey[ReadPool] = web.AppKey("reads", ReadPool)


async def post_reports(request: web.Request) -> web.Response:
    daemon = request.app[DAEMON]
    started = time.perf_counter()
    async with signed_body(request) as (principal, body):
        # The common body (a clean array of window reports) in one fast pass; any
        # other body item by item, naming each bad item's field and reason.
        records, rejected = fast_records(body, daemon.config.daemon.max_world), []
        fast_body = body if records is not None else None
        if records is None:
            try:
                items = decode_body(body)
            except IngestError as err:
                return _error(400, str(err))
            records, rejected = daemon.validate(items)
        try:
            jobs = await daemon.check_jobs(principal, records)
            result = await request.app[GROUPS].accept(Submission(records, principal, jobs, rejected, fast_body,
                                                                   len(body)))
        except StoreUnavailable as err:
            log.warning("reports refused for a retry", error=str(err))
            return web.json_response({"error": str(err)}, status=503, headers={"Retry-After": str(STORE_RETRY_S)})
    result.rejected.sort(key=lambda r: r["index"])
    daemon.metrics.ingest_seconds.observe(time.perf_counter() - started)
    return _json(result.as_json())



async def reader(request: web.Request) -> Reader:
    """Who reads: anyone with ``ReadAuth=open``; with ``required``, the signer of the request, who
    reads only their own jobs' incidents unless root, SlurmUser or in AdminUids (``reads.Reader``)."""
    if request.app[DAEMON].config.daemon.read_auth == "open":
        return OPEN
    async with signed_body(request) as (principal, _):
        return Reader(principal, private=not principal.admin)


async def _read(request: web.Request, view: Callable[[StateStore], Any]) -> Any:
    """``view(store)`` in the read pool, its refusals answered as HTTP errors (``Refused``)."""
    try:
        return await request.app[READS].run(view)
    except reads.ReadsBusy as err:
        raise Refused(503, f"artemisd is busy with reads ({err}); retry after {RETRY_AFTER_S} s",
                      retry_after=RETRY_AFTER_S) from None
    except reads.NotFound as err:
        raise Refused(404, str(err)) from None


def _query_int(request: web.Request, name: str, default: int | None, low: int, high: int) -> int | None:
    try:
        return reads.bounded_int(request.query, name, default, low, high)
    except reads.BadQuery as err:
        raise Refused(400, str(err)) from None


def _json_bytes(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/json")


async def get_incidents(request: web.Request) -> web.Response:
    who = await reader(request)
    everything = request.query.get("all") in ("1", "yes", "true")
    limit = _query_int(request, "limit", reads.INCIDENTS_PAGE, 1, reads.INCIDENTS_PAGE_MAX)
    offset = _query_int(request, "offset", 0, 0, 1 << 40)
    return _json_bytes(await _read(request, lambda store: reads.incidents_page(store, who, everything, limit, offset)))


async def get_incident(request: web.Request) -> web.Response:
    who = await reader(request)
    daemon = request.app[DAEMON]
    stored, out = await _read(request, lambda store: reads.incident_detail(store, who, request.match_info["id"]))
    # A window some ranks' reports missed measures no throughput (NaN): null, as JSON has no NaN
    # and a strict reader (jq, a browser) refuses the whole body.  The analyzer's, read on the loop.
    out["throughput"] = [(seq, value if math.isfinite(value) else None)
                         for seq, value in daemon.analyzer.throughput(stored.job, stored.step or "0")]
    return _json(out)


async def get_incident_windows(request: web.Request) -> web.Response:
    """A page of the job's newest stored per-rank windows (``reads.windows_page``); a job of 100k
    ranks keeps millions of reports, so a plot follows ``before`` for older pages."""
    who = await reader(request)
    limit = _query_int(request, "limit", reads.WINDOWS_PAGE, 1, reads.WINDOWS_PAGE_MAX)
    before = _query_int(request, "before", None, 0, 1 << 62)
    return _json_bytes(await _read(request, lambda store: reads.windows_page(store, who, request.match_info["id"],
                                                                              limit, before)))


async def post_decision(request: web.Request) -> web.Response:
    daemon = request.app[DAEMON]
    async with signed_body(request) as (principal, _):
        pass
    if not principal.admin:
        return _error(403, f"{principal.who} may not approve or deny: needs root, SlurmUser or AdminUids")
    try:
        inc = await asyncio.shield(daemon.approve(request.match_info["id"], principal,
                                                  request.match_info["decision"] == "approve"))
    except KeyError:
        return _error(404, f"no incident {request.match_info['id']}")
    except ValueError as err:
        return _error(409, str(err))
    return _json({"incident": inc})


def _root_side(principal: Principal) -> None:
    if not principal.root_side:
        raise Refused(403, "corrections are for the node check (root or SlurmUser) only")


async def get_corrections(request: web.Request) -> web.Response:
    async with signed_body(request) as (principal, _):
        _root_side(principal)
    daemon = request.app[DAEMON]
    pending = daemon.store.corrections(request.match_info["node"])
    return _json({"corrections": [{"id": c["id"], "incident": c["incident"], "kind": c["kind"], "gpu": c["gpu"]}
                                  for c in pending]})


async def post_correction(request: web.Request) -> web.Response:
    async with signed_body(request) as (principal, body):
        _root_side(principal)
        try:
            data = json.loads(body or b"{}")
            status, detail = data["status"], str(data.get("detail", ""))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError):
            return _error(400, 'body must be {"status": "done"|"failed", "detail": "..."}')
    daemon = request.app[DAEMON]
    if status not in ("done", "failed"):
        return _error(400, f"status: expected done or failed, got {status!r}")
    cor = daemon.store.correction(request.match_info["id"])
    if cor is None or cor["node"] != request.match_info["node"]:
        return _error(404, f"no correction {request.match_info['id']} for {request.match_info['node']}")
    await asyncio.shield(daemon.correction_result(cor["id"], status, detail, principal.who))
    return _json({"id": cor["id"], "status": status})


async def get_status(request: web.Request) -> web.Response:
    who = await reader(request)
    daemon = request.app[DAEMON]
    d = daemon.config.daemon
    lease = daemon.lease
    stored = await _read(request, lambda store: reads.status_counts(store, who))
    return _json({"version": __version__, "listen": d.listen, "dry_run": d.dry_run, "enabled": d.enabled,
                  "instance": daemon.instance, "role": daemon.role, "leader": lease.holder if lease else None,
                  "auth": d.auth_type, **stored, "restore_skipped": daemon.restore_skipped})


async def get_health(request: web.Request) -> web.Response:
    """Liveness, and this instance's role: ``leader`` decides and acts, a ``standby`` waits for the lease."""
    daemon = request.app[DAEMON]
    lease = daemon.lease
    body: dict[str, Any] = {"ok": True, "version": __version__, "instance": daemon.instance, "role": daemon.role,
                            "leader": None}
    if lease is not None:
        # Ages by the clock the lease was judged with (the database server's, with PostgreSQL).
        with contextlib.suppress(Exception):
            now = daemon.store.clock()
            body["leader"] = {"instance": lease.holder, "token": lease.token,
                              "held_s": round(max(0.0, now - lease.acquired), 1),
                              "renewed_s_ago": round(lease.age(now), 1),
                              "expired": now >= lease.expires}
    return _json(body)


async def get_metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[DAEMON].metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _close_reads(app: web.Application) -> None:
    await asyncio.to_thread(app[READS].close)


def make_app(daemon: Daemon, auth: MungeAuth | NoAuth) -> web.Application:
    """The API; ``app[GATE]`` is the connection-capping protocol factory ``serve`` listens with."""
    settings = daemon.config.daemon
    # client_max_size guards request.read()/post(), which no handler uses: bodies go through signed_body.
    app = web.Application(client_max_size=settings.max_body_size, middlewares=[gate_middleware])
    app[DAEMON] = daemon
    app[AUTH] = auth
    app[BODIES] = BodyBudget(settings.max_body_memory, settings.body_memory_per_user)
    app[GROUPS] = GroupCommit(daemon)
    app[READS] = ReadPool(lambda: open_store(daemon.config.daemon))
    app.on_cleanup.append(_close_reads)
    app[GATE] = ConnectionGate(settings.max_connections, daemon.metrics)
    app.router.add_post("/v1/reports", post_reports)
    app.router.add_get("/v1/incidents", get_incidents)
    app.router.add_get("/v1/incidents/{id}", get_incident)
    app.router.add_get("/v1/incidents/{id}/windows", get_incident_windows)
    app.router.add_post("/v1/incidents/{id}/{decision:approve|deny}", post_decision)
    app.router.add_get("/v1/nodes/{node}/corrections", get_corrections)
    app.router.add_post("/v1/nodes/{node}/corrections/{id}", post_correction)
    app.router.add_get("/v1/status", get_status)
    app.router.add_get("/v1/health", get_health)
    app.router.add_get("/metrics", get_metrics)
    return app


async def run_loop(daemon: Daemon, stop: asyncio.Event, tick: float = TICK_S) -> None:
    """``while not stop: run_once()`` — an error in one turn is logged, never fatal."""
    while not stop.is_set():
        try:
            await daemon.run_once()
        except Exception:  # noqa: BLE001 - the loop must survive a bad turn; the error is logged
            log.exception("loop turn failed")
        try:
            await asyncio.wait_for(stop.wait(), tick)
        except asyncio.TimeoutError:
            pass


def reload_config(daemon: Daemon, path: str | None, auth: MungeAuth | NoAuth | None = None,
                  overrides: Sequence[tuple[str, str]] = ()) -> bool:
    try:
        config = load_config(path, overrides, secure=True)
    except ConfigError as err:
        log.error("config reload failed; keeping the running config", error=str(err), file=err.file,
                  line=err.line, key=err.key)
        return False
    daemon.reload(config)
    if isinstance(auth, MungeAuth):
        # Who is admin or root-side may change at reload; the auth mode and socket need a restart.
        fresh = make_auth(config)
        if isinstance(fresh, MungeAuth):
            auth.root_uids, auth.admin_uids = fresh.root_uids, fresh.admin_uids
    return True


def notify_ready(environ: dict[str, str] | None = None) -> bool:
    """Tell systemd (Type=notify) that the daemon serves and handles SIGHUP: True if told.

    With Type=simple systemd calls the unit active at exec, and a ``systemctl
    reload`` before the SIGHUP handler exists kills the daemon (a clean exit to
    systemd: not restarted).  The protocol is one datagram on $NOTIFY_SOCKET
    (sd_notify(3)); an abstract socket is written with a leading "@".
    """
    path = (environ if environ is not None else os.environ).get("NOTIFY_SOCKET")
    if not path:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(b"READY=1", address)
    except OSError as err:
        log.warning("could not tell systemd the daemon is ready", notify_socket=path, error=str(err))
        return False
    return True


async def serve(config_path: str | None, overrides: Sequence[tuple[str, str]] = ()) -> int:
    """Run the daemon until SIGTERM/SIGINT.  ``overrides``: settings given as options (``--listen``),
    over the file's at start and at every reload."""
    config = load_config(config_path, overrides, secure=True)
    daemon = Daemon(config, make_backend(config.daemon.slurm_backend, config.daemon.slurm_timeout))
    tune_gc()
    auth = make_auth(config)
    app = make_app(daemon, auth)
    gate = app[GATE]
    gate.max_connections, nofile = fit_connections_to_fd_limit(config.daemon.max_connections)
    if gate.max_connections < config.daemon.max_connections:
        log.warning("MaxConnections lowered to fit the open-file limit (raise LimitNOFILE)",
                    max_connections=gate.max_connections, configured=config.daemon.max_connections,
                    nofile=nofile)
    host, _, port = config.daemon.listen.rpartition(":")
    # keepalive_timeout is armed at accept: a connection that sends no complete
    # request head within IdleTimeout (new, or kept alive after a response) is closed.
    # handler_cancellation: a client that hangs up takes its request's work with it (the Slurm
    # reads it waits on are killed: jobs.SlurmReads), instead of holding workers for SlurmTimeout.
    # Handlers that change state shield that part (approve/deny, a correction's result).
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=config.daemon.idle_timeout,
                           lingering_time=LINGER_S, auto_decompress=False, handler_cancellation=True)
    await runner.setup()
    gate.make_handler = runner.server
    # Our own listener instead of TCPSite: connections go through the gate first.
    listener = await asyncio.get_running_loop().create_server(
        gate, host.strip("[]"), int(port), reuse_address=True, backlog=LISTEN_BACKLOG)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, reload_config, daemon, config_path, auth, overrides)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("artemisd listening", listen=config.daemon.listen, state_dir=config.daemon.state_dir,
             auth=config.daemon.auth_type, dry_run=config.daemon.dry_run, enabled=config.daemon.enabled)
    notify_ready()
    keeper = asyncio.create_task(daemon.keep_lease(stop))
    try:
        await run_loop(daemon, stop)
    finally:
        keeper.cancel()
        listener.close()
        await runner.cleanup()
        daemon.step_down()
        daemon.jobs.close()
        daemon.store.close()
    log.info("artemisd stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="artemisd",
        description="Artemis per-cluster daemon: ingests the probes' window reports, finds and confirms "
        "stragglers, acts through Slurm within the policy of artemis.conf, and verifies the result.",
        epilog="Signals: SIGHUP re-reads the config (a bad file keeps the running one; the error is logged "
        "with file:line); SIGTERM/SIGINT stop cleanly (a leader gives its lease up).  High availability: "
        "several artemisd with one StateURL (PostgreSQL) database, each with its own Listen; each takes "
        "reports (the probes list every endpoint) and stores them; one leads (analyses every instance's "
        "reports, decides, acts), the others stand by, following its records, and one takes over within "
        "LeaseTime; GET /v1/health and `artemis status` say which.  Logs: JSON lines on stderr.  "
        "Reference: artemis.conf(5) (docs/artemis.conf.5.md, admin guide: High availability); the "
        "`artemis` command reads the daemon's state.",
    )
    parser.add_argument("--config", "-c", default="/etc/artemis/artemis.conf", help="artemis.conf path")
    parser.add_argument("--listen", metavar="HOST:PORT",
                        help="listen here instead of artemis.conf's Listen: one of several instances on one "
                        "host, each its own (artemisd@HOST:PORT.service)")
    parser.add_argument("--version", action="version", version=f"artemisd {__version__}")
    args = parser.parse_args(argv)
    configure_logging()
    overrides = [("Listen", args.listen)] if args.listen is not None else []
    try:
        return asyncio.run(serve(args.config, overrides))
    except ConfigError as err:
        print(f"artemisd: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
