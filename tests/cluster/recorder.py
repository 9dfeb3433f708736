"""A loopback HTTP server that records what the node-side programs send.

It stands in for artemisd in the prolog/epilog/node check unit tests, which
must run without the daemon: it answers ``POST /v1/reports`` like the daemon
(``{"accepted": N, "rejected": [], "directives": []}``), serves a corrections
queue the test fills, and records every request with its body and headers.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    at: float = 0.0  # time.monotonic() when it arrived

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


@dataclass
class Recorder:
    requests: list[Request] = field(default_factory=list)
    corrections: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    stalled: bool = False  # True: accept connections but never answer (a hung daemon)
    release: threading.Event = field(default_factory=threading.Event)
    busy: int = 0  # answer this many next requests 503 + Retry-After, as a daemon at its limit does
    retry_after: str = "1"

    def reports(self) -> list[dict[str, Any]]:
        return [rec for r in self.requests if r.path == "/v1/reports" for rec in r.json()]

    def acks(self) -> dict[str, dict[str, Any]]:
        prefix = "/corrections/"
        return {r.path.rsplit(prefix, 1)[1]: r.json() for r in self.requests
                if r.method == "POST" and prefix in r.path}


class RecordingDaemon:
    """``with RecordingDaemon() as d: d.endpoint`` — by default 127.0.0.1, a free port."""

    def __init__(self, address: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        self.recorder = Recorder()
        recorder = self.recorder

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, payload: Any, status: int = 200) -> None:
                if recorder.stalled:
                    recorder.release.wait(timeout=60)  # bounded; released at teardown
                    return
                if recorder.busy > 0:
                    recorder.busy -= 1
                    payload, status = {"error": "busy"}, 503
                data = json.dumps(payload).encode()
                self.send_response(status)
                if status == 503:
                    self.send_header("Retry-After", recorder.retry_after)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self) -> Request:
                length = int(self.headers.get("Content-Length") or 0)
                req = Request(self.command, self.path, dict(self.headers.items()),
                              self.rfile.read(length), time.monotonic())
                recorder.requests.append(req)
                return req

            def do_GET(self) -> None:
                self._record()
                parts = self.path.strip("/").split("/")
                if len(parts) == 4 and parts[:2] == ["v1", "nodes"] and parts[3] == "corrections":
                    self._answer({"corrections": recorder.corrections.pop(parts[2], [])})
                else:
                    self._answer({"error": "not found"}, 404)

            def do_POST(self) -> None:
                req = self._record()
                if self.path == "/v1/reports":
                    self._answer({"accepted": len(req.json()), "rejected": [], "directives": []})
                else:
                    self._answer({"ok": True})

        self.server = ThreadingHTTPServer(address, Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> RecordingDaemon:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.recorder.release.set()
        self.server.shutdown()
        self.server.server_close()
