"""``artemisd``: the HTTP service around ``Daemon`` (aiohttp).

Endpoints (JSON unless noted; docs/architecture.md "Daemon"):

    POST /v1/reports                      window reports / node events (array or JSON Lines)
    GET  /v1/incidents[?all=1]            incidents (suspects and dismissed only with all=1)
    GET  /v1/incidents/{id}               one incident, its actions and audit trail
    GET  /v1/incidents/{id}/windows       the job's stored per-rank windows (for plots)
    POST /v1/incidents/{id}/approve|deny  admin only
    GET  /v1/nodes/{node}/corrections     root/SlurmUser only: corrections the node check applies
    POST /v1/nodes/{node}/corrections/{id}  root/SlurmUser only: {"status": "done"|"failed", "detail"}
    GET  /v1/status                       daemon summary
    GET  /v1/health                       liveness
    GET  /metrics                         Prometheus text format

Every request that changes something carries ``Authorization: Munge <cred>``
whose payload is the sha256 of the body (auth.py).  Reads of incidents,
status and metrics are open, like ``squeue``.  SIGHUP re-reads the config; a
bad file keeps the running config and logs the error with file:line.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import signal
import sys
import time
from typing import Any

import structlog
from aiohttp import web

from artemisd import __version__
from artemisd.auth import AuthError, MungeAuth, NoAuth, Principal
from artemisd.config import Config, ConfigError, load_config
from artemisd.metrics import CONTENT_TYPE_LATEST
from artemisd.service import Daemon, IngestError, decode_body
from artemisd.slurm import make_backend

TICK_S = 1.0
MAX_BODY = 256 * 1024 * 1024
DAEMON: web.AppKey[Daemon] = web.AppKey("daemon", Daemon)
AUTH: web.AppKey[Any] = web.AppKey("auth", object)

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
    collection; the thresholds make full passes rare.  Memory stays bounded:
    no reference cycles are made per report.
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


async def _principal(request: web.Request, body: bytes) -> Principal:
    try:
        return await request.app[AUTH].authenticate(request.headers.get("Authorization"), body)
    except AuthError:
        request.app[DAEMON].metrics.auth_failures.inc()
        raise


async def post_reports(request: web.Request) -> web.Response:
    daemon = request.app[DAEMON]
    started = time.perf_counter()
    body = await request.read()
    try:
        principal = await _principal(request, body)
        items = decode_body(body)
    except AuthError as err:
        return _error(err.status, str(err))
    except IngestError as err:
        return _error(400, str(err))
    records, rejected = daemon.validate(items)
    owners = await daemon.owners(daemon.jobs_needing_owner_check(principal, records))
    result = daemon.accept(records, principal, owners, rejected)
    result.rejected.sort(key=lambda r: r["index"])
    daemon.metrics.ingest_seconds.observe(time.perf_counter() - started)
    return _json(result.as_json())



async def get_incidents(request: web.Request) -> web.Response:
    daemon = request.app[DAEMON]
    everything = request.query.get("all") in ("1", "yes", "true")
    rows = daemon.store.incidents()
    out = [r.body for r in rows if everything or r.state not in ("suspect", "dismissed")]
    return _json({"incidents": out})


async def get_incident(request: web.Request) -> web.Response:
    daemon = request.app[DAEMON]
    stored = daemon.store.incident(request.match_info["id"])
    if stored is None:
        return _error(404, f"no incident {request.match_info['id']}")
    actions = [{"id": a.id, "kind": a.kind, "target": a.target, "status": a.status, "attempts": a.attempts,
                "detail": a.detail} for a in daemon.store.actions_of(stored.id)]
    return _json({"incident": stored.body, "step": stored.step, "baseline": stored.baseline,
                  "actions": actions, "audit": daemon.store.audit_log(stored.id),
                  "throughput": daemon.analyzer.throughput(stored.job, stored.step or "0")})


async def get_incident_windows(request: web.Request) -> web.Response:
    daemon = request.app[DAEMON]
    stored = daemon.store.incident(request.match_info["id"])
    if stored is None:
        return _error(404, f"no incident {request.match_info['id']}")
    windows = []
    for rec in daemon.store.window_records(stored.job):
        ms = rec.get("ms") or {}
        busy = ms.get("busy")
        if busy is None and ms.get("step") is not None and ms.get("comm_wait") is not None:
            busy = ms["step"] - ms["comm_wait"]
        window = rec.get("window") or {}
        windows.append({"rank": rec.get("rank"), "seq": window.get("seq"),
                        "node": rec.get("node"), "step": ms.get("step"), "busy": busy,
                        "comm_wait": ms.get("comm_wait"), "samples": rec.get("samples"),
                        "t0": window.get("t0"), "t1": window.get("t1")})
    return _json({"incident": stored.body, "windows": windows})


async def post_decision(request: web.Request) -> web.Response:
    daemon = request.app[DAEMON]
    body = await request.read()
    try:
        principal = await _principal(request, body)
    except AuthError as err:
        return _error(err.status, str(err))
    if not principal.admin:
        return _error(403, f"{principal.who} may not approve or deny: needs root, SlurmUser or AdminUids")
    try:
        inc = daemon.approve(request.match_info["id"], principal, request.match_info["decision"] == "approve")
    except KeyError:
        return _error(404, f"no incident {request.match_info['id']}")
    except ValueError as err:
        return _error(409, str(err))
    return _json({"incident": inc})


async def _root(request: web.Request, body: bytes) -> Principal | web.Response:
    try:
        principal = await _principal(request, body)
    except AuthError as err:
        return _error(err.status, str(err))
    if not principal.root_side:
        return _error(403, "corrections are for the node check (root or SlurmUser) only")
    return principal


async def get_corrections(request: web.Request) -> web.Response:
    principal = await _root(request, await request.read())
    if isinstance(principal, web.Response):
        return principal
    daemon = request.app[DAEMON]
    pending = daemon.store.corrections(request.match_info["node"])
    return _json({"corrections": [{"id": c["id"], "incident": c["incident"], "kind": c["kind"], "gpu": c["gpu"]}
                                  for c in pending]})


async def post_correction(request: web.Request) -> web.Response:
    body = await request.read()
    principal = await _root(request, body)
    if isinstance(principal, web.Response):
        return principal
    daemon = request.app[DAEMON]
    try:
        data = json.loads(body or b"{}")
        status, detail = data["status"], str(data.get("detail", ""))
    except (json.JSONDecodeError, KeyError, TypeError):
        return _error(400, 'body must be {"status": "done"|"failed", "detail": "..."}')
    if status not in ("done", "failed"):
        return _error(400, f"status: expected done or failed, got {status!r}")
    cor = daemon.store.correction(request.match_info["id"])
    if cor is None or cor["node"] != request.match_info["node"]:
        return _error(404, f"no correction {request.match_info['id']} for {request.match_info['node']}")
    await daemon.correction_result(cor["id"], status, detail, principal.who)
    return _json({"id": cor["id"], "status": status})


async def get_status(request: web.Request) -> web.Response:
    daemon = request.app[DAEMON]
    counts: dict[str, int] = {}
    for inc in daemon.store.incidents():
        counts[inc.state] = counts.get(inc.state, 0) + 1
    d = daemon.config.daemon
    return _json({"version": __version__, "listen": d.listen, "dry_run": d.dry_run, "enabled": d.enabled,
                  "auth": d.auth_type, "incidents": counts, "jobs": daemon.store.jobs()[:50],
                  "records": daemon.store.record_count(), "quarantined": daemon.store.quarantined(),
                  "restore_skipped": daemon.restore_skipped,
                  "open_actions": len(daemon.store.due_actions(float("inf")))})


async def get_health(request: web.Request) -> web.Response:
    return _json({"ok": True, "version": __version__})


async def get_metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[DAEMON].metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_app(daemon: Daemon, auth: MungeAuth | NoAuth) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)
    app[DAEMON] = daemon
    app[AUTH] = auth
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


def reload_config(daemon: Daemon, path: str | None, auth: MungeAuth | NoAuth | None = None) -> bool:
    try:
        config = load_config(path)
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


async def serve(config_path: str | None) -> int:
    config = load_config(config_path)
    daemon = Daemon(config, make_backend(config.daemon.slurm_backend, config.daemon.slurm_timeout))
    tune_gc()
    auth = make_auth(config)
    app = make_app(daemon, auth)
    host, _, port = config.daemon.listen.rpartition(":")
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host.strip("[]"), int(port))
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, reload_config, daemon, config_path, auth)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("artemisd listening", listen=config.daemon.listen, state_dir=config.daemon.state_dir,
             auth=config.daemon.auth_type, dry_run=config.daemon.dry_run, enabled=config.daemon.enabled)
    try:
        await run_loop(daemon, stop)
    finally:
        await runner.cleanup()
        daemon.store.close()
    log.info("artemisd stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="artemisd",
        description="Artemis per-cluster daemon: ingests the probes' window reports, finds and confirms "
        "stragglers, acts through Slurm within the policy of artemis.conf, and verifies the result.",
        epilog="Signals: SIGHUP re-reads the config (a bad file keeps the running one; the error is logged "
        "with file:line); SIGTERM/SIGINT stop cleanly.  Logs: JSON lines on stderr.  Reference: "
        "artemis.conf(5) (docs/artemis.conf.5.md); the `artemis` command reads the daemon's state.",
    )
    parser.add_argument("--config", "-c", default="/etc/artemis/artemis.conf", help="artemis.conf path")
    parser.add_argument("--version", action="version", version=f"artemisd {__version__}")
    args = parser.parse_args(argv)
    configure_logging()
    try:
        return asyncio.run(serve(args.config))
    except ConfigError as err:
        print(f"artemisd: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
