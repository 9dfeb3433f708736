"""What the node-side programs share: config, gathering, and sending node events.

The Prolog, Epilog and node check run as root under slurmd with the node's own
Python, so this module uses the standard library only (plus the probe's
stdlib-only ``torch_hook.telemetry`` and ``torch_hook.munge``, when importable).

Configuration — ``/etc/artemis/node.conf`` (``$ARTEMIS_NODE_CONF`` overrides the
path), slurm.conf syntax, keys case-insensitive::

    Endpoint=http://artemisd.example:7600   # required; unset = do nothing; a,b,… = several daemons
    MungeSocket=/run/munge/munge.socket.2   # default: libmunge's default
    AuthType=munge                          # or none (loopback daemons only)
    TimeoutSeconds=10                       # hard limit for one program run
    Telemetry=auto                          # auto|nvml|amdsmi|emulated|none
    EmulatedGpuDir=/var/lib/artemis/gpus    # for Telemetry=emulated
    StateDir=/var/lib/artemis               # node check memory (fingerprint)
    NodeProbe=yes                           # node check runs the node probe after a change

Each key can be overridden by the environment variable the probe uses for the
same thing (``ARTEMIS_ENDPOINT``, ``ARTEMIS_MUNGE_SOCKET``, ``ARTEMIS_TELEMETRY``,
``ARTEMIS_EMULATED_GPU_DIR``) — handy in tests, rarely needed at a site.
"""

from __future__ import annotations

import glob
import hashlib
import importlib
import importlib.util
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import syslog
import time
import types
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_CONF = "/etc/artemis/node.conf"
MAX_TIMEOUT_S = 55.0  # slurmd kills a HealthCheckProgram after 60 s


class NodeConfError(ValueError):
    """A bad node.conf line; the message names the file, line and key."""


@dataclass(frozen=True)
class NodeConfig:
    endpoint: str | None = None
    munge_socket: str | None = None
    auth: str = "munge"
    timeout_s: float = 10.0
    telemetry: str = "auto"
    emulated_gpu_dir: str | None = None
    state_dir: str = "/var/lib/artemis"
    node_probe: bool = True
    source: str = DEFAULT_CONF

    @property
    def http_bases(self) -> list[str]:
        """Every daemon of ``Endpoint`` (a comma-separated list where several share one database)."""
        if self.endpoint and self.endpoint.startswith(("http://", "https://")):
            return [u.strip().rstrip("/") for u in self.endpoint.split(",") if u.strip()]
        return []

    @property
    def http_base(self) -> str | None:
        return self.http_bases[0] if self.http_bases else None


_KEYS = {
    "endpoint": "endpoint", "mungesocket": "munge_socket", "authtype": "auth",
    "timeoutseconds": "timeout_s", "telemetry": "telemetry",
    "emulatedgpudir": "emulated_gpu_dir", "statedir": "state_dir", "nodeprobe": "node_probe",
}
_ENV = {
    "endpoint": "ARTEMIS_ENDPOINT", "munge_socket": "ARTEMIS_MUNGE_SOCKET",
    "telemetry": "ARTEMIS_TELEMETRY", "emulated_gpu_dir": "ARTEMIS_EMULATED_GPU_DIR",
}


def _value(attr: str, raw: str, where: str) -> Any:
    if attr == "timeout_s":
        try:
            seconds = float(raw)
        except ValueError:
            raise NodeConfError(f"{where}: expected seconds, got {raw!r}") from None
        if not 0 < seconds <= MAX_TIMEOUT_S:
            raise NodeConfError(f"{where}: expected 0 < seconds <= {MAX_TIMEOUT_S:g}, got {raw}")
        return seconds
    if attr == "auth":
        if raw.lower() not in ("munge", "none"):
            raise NodeConfError(f"{where}: expected munge or none, got {raw!r}")
        return raw.lower()
    if attr == "telemetry":
        if raw.lower() not in ("auto", "nvml", "amdsmi", "emulated", "none"):
            raise NodeConfError(f"{where}: expected auto, nvml, amdsmi, emulated or none, got {raw!r}")
        return raw.lower()
    if attr == "node_probe":
        if raw.lower() in ("yes", "true", "on", "1"):
            return True
        if raw.lower() in ("no", "false", "off", "0"):
            return False
        raise NodeConfError(f"{where}: expected yes or no, got {raw!r}")
    if attr == "endpoint" and not raw.startswith("file:") and not all(
            u.strip().startswith(("http://", "https://")) for u in raw.split(",")):
        raise NodeConfError(f"{where}: expected http://HOST:PORT (or a comma-separated list of them) "
                            f"or file:/PATH, got {raw!r}")
    return raw


def load_config(env: dict[str, str] | None = None) -> NodeConfig:
    """node.conf, then environment overrides.  A missing file is an empty config."""
    env = dict(os.environ) if env is None else env
    path = env.get("ARTEMIS_NODE_CONF") or DEFAULT_CONF
    values: dict[str, Any] = {"source": path}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        text = ""
    except OSError as err:
        raise NodeConfError(f"{path}: cannot read: {err.strerror}") from None
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError as err:
            raise NodeConfError(f"{path}:{number}: cannot parse: {err}") from None
        for token in tokens:
            key, sep, raw = token.partition("=")
            where = f"{path}:{number}: {key}"
            if not sep:
                raise NodeConfError(f"{path}:{number}: {token}: expected Key=Value")
            attr = _KEYS.get(key.lower())
            if attr is None:
                raise NodeConfError(f"{where}: unknown key (known: {', '.join(sorted(_KEYS))})")
            values[attr] = _value(attr, raw, where)
    for attr, name in _ENV.items():
        if env.get(name):
            values[attr] = _value(attr, env[name], f"${name}")
    return NodeConfig(**values)


# --- running safely under slurmd ---------------------------------------------


def log(program: str, message: str) -> None:
    """To syslog (slurmd discards a Prolog's output) and to stderr (for tests)."""
    print(f"{program}: {message}", file=sys.stderr, flush=True)
    try:
        syslog.openlog(program, syslog.LOG_PID, syslog.LOG_DAEMON)
        syslog.syslog(syslog.LOG_WARNING, message)
    except OSError:
        pass


# When the hard timeout fires (time.monotonic()); retries after a 503 stop short of it.
_deadline: float | None = None


def arm_hard_timeout(program: str, seconds: float) -> None:
    """Exit 0 after ``seconds`` whatever we are blocked in.

    A Prolog that hangs holds the job; one that fails drains the node.  Exiting
    0 from the alarm handler (``os._exit``, no cleanup that could block) is the
    one outcome that can do neither.
    """
    global _deadline
    _deadline = time.monotonic() + seconds

    def expire(signum: int, frame: Any) -> None:
        log(program, f"gave up after the hard timeout of {seconds:g} s")
        os._exit(0)

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def guarded(program: str, body: Any) -> int:
    """Run ``body()``; whatever happens, report it and return 0."""
    try:
        body()
    except Exception as err:  # noqa: BLE001 -- never fail slurmd's hook
        log(program, f"{type(err).__name__}: {err}")
    finally:
        # Disarm: Python restores SIGALRM's default action while it shuts down,
        # so a hard timeout that fires during a slow exit (a loaded node) kills
        # the program with signal 14 — and slurmd drains the node for a Prolog
        # that did its work.
        signal.setitimer(signal.ITIMER_REAL, 0)
    return 0


# --- gathering ------------------------------------------------------------------


def import_probe_module(name: str) -> types.ModuleType | None:
    """``torch_hook.<name>`` without running ``torch_hook/__init__``.

    The probe package's ``__init__`` imports torch (seconds of start-up, and
    absent from a node's system Python); its telemetry, munge and retry
    modules are stdlib only.  So the package is registered bare — a module
    object whose only content is its path — and the module is imported from
    it.  This runs in a short-lived process of our own, never inside a
    training rank.
    """
    if "torch_hook" not in sys.modules:
        spec = importlib.util.find_spec("torch_hook")
        if spec is None or not spec.submodule_search_locations:
            return None
        bare = types.ModuleType("torch_hook")
        bare.__path__ = list(spec.submodule_search_locations)
        sys.modules["torch_hook"] = bare
    try:
        return importlib.import_module(f"torch_hook.{name}")
    except ImportError:
        return None


def import_telemetry() -> types.ModuleType | None:
    return import_probe_module("telemetry")


def open_gpus(cfg: NodeConfig, node: str) -> Any:
    """The configured GPU backend, or None (no GPUs, or no library to read them)."""
    telemetry = import_telemetry()
    if telemetry is None:
        return None
    if cfg.emulated_gpu_dir:
        os.environ["ARTEMIS_EMULATED_GPU_DIR"] = cfg.emulated_gpu_dir
    return telemetry.open_backend(cfg.telemetry, node=node)


# util_pct: root-side evidence counts only for a GPU under load (an idle GPU's
# low clocks are no fault).
_NODE_GPU_KEYS = ("sm_clock_mhz", "max_sm_clock_mhz", "power_limit_w",
                  "default_power_limit_w", "temp_c", "util_pct", "throttle")


def gpu_snapshot(backend: Any) -> list[dict[str, Any]] | None:
    """One entry per GPU: identity plus the health fields of a node event."""
    if backend is None:
        return None
    gpus = []
    for index in range(backend.count()):
        entry: dict[str, Any] = {"index": index}
        entry.update({k: v for k, v in (backend.device(index) or {}).items()
                      if k in ("vendor", "model", "uuid")})
        sample = backend.sample(index)
        entry.update({k: sample[k] for k in _NODE_GPU_KEYS if k in sample})
        gpus.append(entry)
    return gpus


def host_snapshot(interval_s: float = 0.2) -> dict[str, Any] | None:
    """Node-wide steal/iowait and TCP retransmit rates over a short interval."""
    try:
        host = importlib.import_module("torch_hook.telemetry.host") if import_telemetry() else None
    except ImportError:
        host = None
    if host is None:
        return None
    before = host.read_counters()
    time.sleep(interval_s)
    block = host.host_block(before, host.read_counters())
    # cpu_pct and ctx_invol_per_s describe the calling process: ours, not the node's.
    return {k: v for k, v in block.items() if k not in ("cpu_pct", "ctx_invol_per_s")} or None


_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib",
             "/usr/local/cuda/lib64", "/opt/rocm/lib")
_SONAME = re.compile(r"lib(nccl|rccl)\.so\.(\d+(?:\.\d+)*)$")


def comm_lib_version(dirs: list[str] | None = None) -> str | None:
    """``nccl 2.21.5`` / ``rccl 2.18.3`` from the newest fully versioned soname found.

    Searched: ``dirs``, default $LD_LIBRARY_PATH then the usual library folders.
    """
    if dirs is None:
        dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d] + list(_LIB_DIRS)
    found: list[tuple[tuple[int, ...], str]] = []
    for directory in dirs:
        for path in glob.glob(os.path.join(directory, "lib[nr]ccl.so.*")):
            match = _SONAME.search(os.path.basename(path))
            if match and match.group(2).count(".") >= 2:
                version = tuple(int(p) for p in match.group(2).split("."))
                found.append((version, f"{match.group(1)} {match.group(2)}"))
    return max(found)[1] if found else None


def _read_first(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="ascii", errors="replace").strip() or None
    except OSError:
        return None


def firmware_version() -> str | None:
    bios = _read_first("/sys/class/dmi/id/bios_version")
    return f"bios {bios}" if bios else None


def fingerprint(backend: Any) -> dict[str, str]:
    """What a change regression is attributed to: driver, comm lib, kernel, firmware."""
    values = {
        "driver": backend.driver() if backend is not None else None,
        "comm_lib": comm_lib_version(),
        "kernel": os.uname().release,
        "firmware": firmware_version(),
    }
    return {k: v for k, v in values.items() if v}


def node_event(event: str, node: str, job: str | None, backend: Any,
               with_host: bool = True) -> dict[str, Any]:
    record: dict[str, Any] = {"type": "node", "v": 1, "event": event, "node": node,
                              "time": time.time(), "fingerprint": fingerprint(backend)}
    if job:
        record["job"] = job
    gpus = gpu_snapshot(backend)
    if gpus is not None:
        record["gpus"] = gpus
    host = host_snapshot() if with_host else None
    if host:
        record["host"] = host
    return record


# --- talking to artemisd --------------------------------------------------------


class DaemonError(RuntimeError):
    pass


REQUEST_PAYLOAD_VERSION = "artemis-request-v2"
_METHOD = re.compile(r"[A-Z]{1,16}")
_PATH = re.compile(r"/[\x21-\x7e]{0,8191}")  # printable ASCII, no space: one field of the payload


def request_payload(method: str, path: str, body: bytes) -> str:
    """``artemis-request-v2 METHOD PATH SHA256``: the munge payload that binds a credential to one request.

    ``path`` is the request-target as sent (path and ``?query``), ``body`` the
    bytes sent (``b""`` for a GET).  A copy of ``artemisd.auth.request_payload``
    (this runs under the node's own Python, without artemisd): same checks,
    same output, held equal by tests/unit/test_auth.py.
    """
    if not _METHOD.fullmatch(method):
        raise ValueError(f"HTTP method must be upper-case letters, got {method!r}")
    if not _PATH.fullmatch(path):
        raise ValueError(f"request path must start with / and be printable ASCII without spaces, got {path!r}")
    return f"{REQUEST_PAYLOAD_VERSION} {method} {path} {hashlib.sha256(body).hexdigest()}"


def _credential(cfg: NodeConfig, method: str, path: str, body: bytes) -> str | None:
    """A credential for this one request (``request_payload``); None with ``AuthType=none``."""
    if cfg.auth == "none":
        return None
    payload = request_payload(method, path, body)
    munge = import_probe_module("munge")
    if munge is not None:  # torch_hook is importable: reuse its signer
        signer = munge.MungeSigner(cfg.munge_socket)
        try:
            credential = signer.sign(payload)
        finally:
            signer.close()
        if credential:
            return credential
        raise DaemonError(f"cannot make a munge credential: {signer.last_error}")
    cmd = ["munge", "--string", payload]
    if cfg.munge_socket:
        cmd += ["--socket", cfg.munge_socket]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=5, check=False)
    if done.returncode != 0:
        raise DaemonError(f"munge: {done.stderr.strip()}")
    return done.stdout.strip()


# Retries after 503/429 stop this long before the hard timeout, leaving time to log.
_RETRY_MARGIN_S = 1.0
_MAX_ATTEMPTS = 8


def request(cfg: NodeConfig, method: str, path: str, payload: Any = None,
            timeout_s: float | None = None) -> Any:
    """One authenticated JSON request to artemisd; returns the decoded reply.

    A ``503``/``429`` answer (the daemon stored nothing and is busy) is retried
    after its ``Retry-After`` with growing, jittered waits, each time with a
    fresh credential (munge refuses a replayed one), for as long as the
    program's hard timeout leaves room; then it fails like any other error.
    """
    bases = cfg.http_bases
    if not bases:
        raise DaemonError(f"no http endpoint configured in {cfg.source}")
    body = json.dumps(payload, separators=(",", ":")).encode() if payload is not None else b""
    retry = import_probe_module("retry")
    backoff = retry.Backoff(random.Random()) if retry is not None else None
    deadline = _deadline if _deadline is not None else time.monotonic() + cfg.timeout_s
    attempt = 0
    while True:
        attempt += 1
        # Each daemon of the list once per round: one that is down, or
        # answers 503 (its database unreachable), passes the request on at once.
        deferred_s: float | None = None
        failures = []
        for base in bases:
            req = urllib.request.Request(f"{base}{path}", data=body if payload is not None else None,
                                         method=method, headers={"Content-Type": "application/json"})
            # Bound to this method, this daemon's request-target (the base's path, if
            # any, included: what urllib puts on the request line) and this body.
            credential = _credential(cfg, method, req.selector or "/", body)
            if credential:
                req.add_header("Authorization", f"Munge {credential}")
            try:
                with urllib.request.urlopen(req, timeout=timeout_s or cfg.timeout_s) as reply:
                    text = reply.read()
                return json.loads(text) if text else None
            except urllib.error.HTTPError as err:
                detail = err.read().decode(errors="replace")[:300]
                failures.append(f"{base}: HTTP {err.code}: {detail}")
                if retry is None or err.code not in retry.RETRY_STATUSES:
                    raise DaemonError(f"{method} {path}: {failures[-1]}") from None
                deferred_s = max(deferred_s or 0.0, retry.retry_after_s(err.headers.get("Retry-After")) or 0.0)
            except (urllib.error.URLError, OSError) as err:
                failures.append(f"{base}: {getattr(err, 'reason', err)}")
        if deferred_s is not None and backoff is not None and attempt < _MAX_ATTEMPTS:
            wait = backoff.next(deferred_s or None)
            if time.monotonic() + wait + _RETRY_MARGIN_S < deadline:
                time.sleep(wait)
                continue
        raise DaemonError(f"{method} {path}: {'; '.join(failures)}")


def send_records(cfg: NodeConfig, records: list[dict[str, Any]]) -> dict[str, Any]:
    """POST node events (or append them to a ``file:`` endpoint)."""
    if cfg.endpoint and cfg.endpoint.startswith("file:"):
        with open(cfg.endpoint[len("file:"):], "a", encoding="utf-8") as trace:
            for record in records:
                trace.write(json.dumps(record, separators=(",", ":")) + "\n")
        return {"accepted": len(records), "rejected": []}
    reply = request(cfg, "POST", "/v1/reports", records)
    if reply and reply.get("rejected"):
        raise DaemonError(f"daemon rejected node events: {reply['rejected']}")
    return reply or {}


@dataclass
class SlurmJobEnv:
    """What slurmd puts in a Prolog/Epilog environment (22.05; design.md §5)."""

    job: str | None = None
    node: str | None = None
    opted_in: bool = False

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> SlurmJobEnv:
        env = dict(os.environ) if env is None else env
        return cls(
            job=env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"),
            node=env.get("SLURMD_NODENAME") or os.uname().nodename,
            opted_in=env.get("SPANK_ARTEMIS", "").lower() == "on",
        )
