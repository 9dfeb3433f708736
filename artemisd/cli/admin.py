"""``artemis status | incidents | show | approve | deny``: talk to the running artemisd.

The daemon's address comes from ``--server URL``, else ``$ARTEMIS_SERVER``,
else ``Listen=`` in artemis.conf (``--config``, default /etc/artemis/artemis.conf).
With ``AuthType=munge`` (the default) every request is signed with a munge
credential of the caller, bound to that one request: its payload is
``artemis-request-v2 <METHOD> <PATH> <SHA256 of body>`` (``artemisd.auth.request_payload``),
so it is good for nothing else.  Approve and deny need it; reads are open today
and are signed all the same (a GET signs the empty body), so a daemon that
requires credentials for reads is answered too.  A read whose credential
cannot be made (no ``munge`` command here) goes unsigned and the daemon
decides; a write fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from datetime import datetime, timezone
from typing import Any

from artemisd.auth import request_payload
from artemisd.cli.replay import format_table
from artemisd.config import ConfigError, load_config
from artemisd.incident import Incident
from artemisd.loss import loss_summary, window_throughput

DEFAULT_CONFIG = "/etc/artemis/artemis.conf"
TIMEOUT_S = 30.0
PLOT_REPORTS = 50_000  # the newest window reports a plot reads (the daemon pages them)
WINDOWS_PAGE = 20_000  # reports a page asks for (the daemon's most)
MAX_PAGES = 1_000


class ClientError(RuntimeError):
    pass


class Client:
    def __init__(self, server: str, munge_socket: str | None, sign: bool):
        self.server = server.rstrip("/")
        self.munge_socket = munge_socket
        self.sign = sign

    def _credential(self, method: str, path: str, body: bytes) -> str:
        """A credential for ``method`` on ``path`` (the request-target as sent) with ``body``."""
        try:
            payload = request_payload(method, path, body)
        except ValueError as err:
            raise ClientError(f"cannot sign {method} {path!r}: {err}") from None
        argv = ["munge", "-s", payload]
        if self.munge_socket:
            argv += ["-S", self.munge_socket]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise ClientError(f"cannot get a munge credential: {err}") from None
        if proc.returncode != 0:
            raise ClientError(f"munge: {proc.stderr.strip()}")
        return proc.stdout.strip()

    def request(self, method: str, path: str, body: bytes = b"") -> Any:
        sent = body if method == "POST" else b""
        req = urllib.request.Request(f"{self.server}{path}", data=sent if method == "POST" else None, method=method)
        req.add_header("Content-Type", "application/json")
        if self.sign:
            # Signed for the request-target urllib sends (the server URL's own path included).
            try:
                credential = self._credential(method, req.selector or "/", sent)
            except ClientError:
                if method == "POST":
                    raise
                credential = None  # a read: open unless the daemon says otherwise (its 401 names why)
            if credential is not None:
                req.add_header("Authorization", f"Munge {credential}")
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:  # noqa: S310 - the site's own daemon
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            try:
                message = json.loads(err.read()).get("error", err.reason)
            except (json.JSONDecodeError, AttributeError):
                message = err.reason
            raise ClientError(f"{method} {path}: {err.code} {message}") from None
        except (urllib.error.URLError, OSError) as err:
            raise ClientError(f"cannot reach artemisd at {self.server}: {getattr(err, 'reason', err)}") from None


def client_from(args: argparse.Namespace) -> Client:
    server = args.server or os.environ.get("ARTEMIS_SERVER")
    munge_socket, sign = None, True
    config_path = args.config or (DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None)
    if config_path:
        # Not secure=True, unlike artemisd: here the file only says where the daemon is and
        # whether to sign; a credential is bound to its one request and the daemon judges it.
        # Refusing would lock users out of a read-only command and protect nothing.
        config = load_config(config_path)
        munge_socket = config.daemon.munge_socket
        sign = config.daemon.auth_type == "munge"
        server = server or f"http://{config.daemon.listen}"
    if not server:
        raise ClientError("no daemon address: give --server URL, set ARTEMIS_SERVER, or --config FILE")
    return Client(server, munge_socket, sign)


def _time(t: float | None) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def cmd_status(args: argparse.Namespace) -> int:
    status = client_from(args).request("GET", "/v1/status")
    if args.json:
        print(json.dumps(status))
        return 0
    mode = "DRY RUN" if status["dry_run"] else ("ACTIONS OFF (kill switch)" if not status["enabled"] else "acting")
    print(f"artemisd {status['version']} on {status['listen']}  auth={status['auth']}  mode={mode}")
    if "role" in status:  # older daemons do not say
        leader = "" if status["role"] == "leader" else f" (leader: {status.get('leader') or 'none yet'})"
        print(f"role: {status['role']}{leader}")
    for inst in status.get("instances", []):
        # Every artemisd sharing this database, by its last turn (a dead one stops being seen).
        print(f"  instance {inst['instance']:<32} {inst['role']:<8} {inst['version']:<10} "
              f"last turn {inst['seen_s_ago']:.0f} s ago")
    counts = ", ".join(f"{n} {s}" for s, n in sorted(status["incidents"].items())) or "none"
    print(f"incidents: {counts}")
    behind = f"   not analysed yet: {status['not_analysed']}" if "not_analysed" in status else ""
    print(f"open actions: {status['open_actions']}   stored records: {status['records']}{behind}")
    if status.get("quarantined") or status.get("restore_skipped"):
        # Records that failed analysis or could not be replayed at the last start: never replayed again.
        print(f"quarantined records: {status.get('quarantined', 0)} "
              f"(skipped at the last start: {status.get('restore_skipped', 0)})")
    for job in status["jobs"][:10]:
        print(f"  job {job['job']:<10} partition {job['partition'] or '-':<10} last window "
              f"{job['last_window'] if job['last_window'] is not None else '-':<6} seen {_time(job['last_seen'])}")
    return 0


def cmd_incidents(args: argparse.Namespace) -> int:
    client = client_from(args)
    incidents: list[dict[str, Any]] = []
    offset: int | None = 0
    for _ in range(MAX_PAGES):  # the daemon pages its answer; a bound in case it never says "last"
        data = client.request("GET", f"/v1/incidents?offset={offset}" + ("&all=1" if args.all else ""))
        incidents += [i for i in data["incidents"] if args.job is None or i["job"] == args.job]
        offset = data.get("next")
        if offset is None:
            break
    if args.json:
        for inc in incidents:
            print(json.dumps(inc))
        return 0
    if not incidents:
        print("no incidents")
        return 0
    print(format_table([Incident.model_validate(i) for i in incidents]))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    client = client_from(args)
    data = client.request("GET", f"/v1/incidents/{args.incident}")
    if args.json:
        print(json.dumps(data))
    else:
        inc = Incident.model_validate(data["incident"])
        print(format_table([inc]))
        loss = loss_summary(inc.measured_loss_pct, inc.loss_pct)
        if loss is not None:
            print(f"\n{loss}")
        result = inc.result
        if result is not None:
            print("\n" + result.describe())
        ended = inc.ended_with_job
        if ended is not None:
            print(f"\nended with its job at {_time(ended.at)} (Slurm: {ended.job_state or 'no longer known'}) "
                  f"while {ended.state_before.value}; "
                  + ("the person paged about it was mailed" if ended.person_told else "nobody had been paged"))
        if data["actions"]:
            print("\nactions:")
            for a in data["actions"]:
                print(f"  #{a['id']} {a['kind']} {a['target'] or ''} {a['status']} (attempts {a['attempts']}) "
                      f"{a['detail']}")
        print("\naudit:")
        for a in data["audit"]:
            tail = " — ".join(x for x in (a["why"], a["result"]) if x)
            print(f"  {_time(a['time'])}  {a['who']:<8} {a['what']}" + (f"  ({tail[:160]})" if tail else ""))
    if args.plot:
        windows = newest_windows(client, args.incident, PLOT_REPORTS)
        plot_timeline(windows, args.plot, audit=data["audit"])
        print(f"\nwrote {args.plot}", file=sys.stderr)
        if windows.get("left_out"):
            print(f"(the job's newest {len(windows['windows']):,} window reports; the daemon left out "
                  f"{windows['left_out']:,} older ones)", file=sys.stderr)
    return 0


def newest_windows(client: Client, incident: str, at_most: int) -> dict[str, Any]:
    """The job's newest stored window reports, ``at_most`` or a little more (whole windows), read
    page by page, older pages first in the list as the daemon stored them."""
    page = client.request("GET", f"/v1/incidents/{incident}/windows?limit={WINDOWS_PAGE}")
    windows = page["windows"]
    for _ in range(MAX_PAGES):
        if "before" not in page or len(windows) >= at_most:
            break
        page = client.request("GET", f"/v1/incidents/{incident}/windows?limit={WINDOWS_PAGE}"
                                     f"&before={page['before']}")
        windows = page["windows"] + windows
    return {"incident": page["incident"], "windows": windows, "left_out": page["left_out"]}


def job_windows(windows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The job's windows in time order, each with its ranks' rows and the job's samples/s.

    A requeued job numbers its windows from 0 again: a job window is (run, seq),
    the run being the daemon's own (each row's ``run``, from the step key the
    daemon analysed and stored it under: ``runs.JobRun``'s rule, not a second
    one here).  A rank's row stored twice counts once.  Throughput is
    ``loss.window_throughput``, the definition verification judges with, and
    like the analyzer's a window some rank's row is missing from measures none
    (its samples would be part of the job's): None.
    """
    grouped: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    for w in windows:
        if w.get("rank") is None or w.get("seq") is None or w.get("t1") is None:
            continue
        grouped.setdefault((int(w.get("run") or 0), int(w["seq"])), {}).setdefault(int(w["rank"]), w)
    out = []
    for (run, seq), by_rank in grouped.items():
        rows = sorted(by_rank.values(), key=lambda w: int(w["rank"]))
        world = max((int(w["world"]) for w in rows if w.get("world")), default=len(rows))
        spans = [w["t1"] - w["t0"] for w in rows if w.get("t0") is not None]
        throughput = window_throughput([w.get("samples") for w in rows], spans) if len(rows) >= world else None
        out.append({"run": run, "seq": seq, "t0": min(w.get("t0") or w["t1"] for w in rows),
                    "t1": float(sorted(w["t1"] for w in rows)[len(rows) // 2]), "rows": rows,
                    "throughput": throughput})
    out.sort(key=lambda j: j["t1"])
    return out


def loop_marks(incident: dict[str, Any], jobs: list[dict[str, Any]],
               audit: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """(label, time) of the loop's steps: onset, confirmation, action, verification.

    Onset and confirmation are windows of the run the fault was seen in (the
    last run that reached that window before the action); the action and the
    verdict are the audit log's times.
    """
    acted = next((a["time"] for a in audit if a["who"] == "daemon" and str(a["result"]).startswith("done")), None)
    verified = next((a for a in audit if a["who"] == "verify"), None)
    marks: list[tuple[str, float]] = []
    for label, key, edge in (("onset", "onset_window", "t0"), ("confirmed", "confirmed_window", "t1")):
        seq = incident.get(key)
        seen = [j for j in jobs if j["seq"] == seq and (acted is None or j["t1"] <= acted)]
        if seq is not None and seen:
            marks.append((label, seen[-1][edge]))
    if acted is not None:
        marks.append(("action", acted))
    if verified is not None:
        marks.append((verified["what"], verified["time"]))
    return marks


def plot_timeline(data: dict[str, Any], path: str, audit: list[dict[str, Any]] | None = None) -> None:
    """The job's throughput with the loop's steps marked, then per-rank busy and comm_wait.

    A person looks first at the top panel: did the job's samples/s fall at the
    onset and come back after the action?  The panels below show which rank
    took longer (busy) and which waited for it (comm_wait).  The x axis is
    wall time, so a requeued job's new run follows its first one.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inc = data["incident"]
    jobs = job_windows(data["windows"])
    if not jobs:
        raise ClientError(f"{inc['id']}: no timed windows stored for job {inc['job']} (an ended job's windows "
                          "go once its incidents are closed, or EndedJobHistory after it ended while one "
                          "was open)")
    origin = jobs[0]["t0"]
    subject = inc.get("rank")
    fig, (ax_tp, ax_busy, ax_wait) = plt.subplots(3, 1, sharex=True, figsize=(10, 8),
                                                  gridspec_kw={"height_ratios": [1.2, 1, 1]})
    for run in sorted({j["run"] for j in jobs}):
        points = [((j["t1"] - origin) / 60.0, j["throughput"]) for j in jobs
                  if j["run"] == run and j["throughput"] is not None]
        ax_tp.plot([p[0] for p in points], [p[1] for p in points], marker=".", color="tab:blue",
                   label="job samples/s" if run == 0 else None)
    result = inc.get("result") or {}
    if result.get("throughput_healthy"):
        ax_tp.axhline(result["throughput_healthy"], color="tab:green", linestyle="--", linewidth=0.8,
                      label=f"healthy {result['throughput_healthy']:.0f}")
    for label, when in loop_marks(inc, jobs, audit or []):
        for ax in (ax_tp, ax_busy, ax_wait):
            ax.axvline((when - origin) / 60.0, color="tab:red", linewidth=0.9, alpha=0.7)
        ax_tp.annotate(label, ((when - origin) / 60.0, 1.0), xycoords=("data", "axes fraction"),
                       rotation=90, va="top", ha="right", fontsize="small", color="tab:red")
    by_rank: dict[int, list[tuple[float, float | None, float | None]]] = {}
    for j in jobs:
        for w in j["rows"]:
            line = by_rank.setdefault(int(w["rank"]), [])
            if j["run"] > 0 and j["seq"] == 0:  # no line across the restart
                line.append((float("nan"), None, None))
            line.append(((j["t1"] - origin) / 60.0, w["busy"], w["comm_wait"]))
    for rank in sorted(by_rank):
        rows = by_rank[rank]
        highlight = rank == subject
        style = {"linewidth": 2.2 if highlight else 0.8, "alpha": 1.0 if highlight else 0.5,
                 "label": f"rank {rank}" if highlight or len(by_rank) <= 8 else None}
        ax_busy.plot([r[0] for r in rows], [r[1] for r in rows], **style)
        ax_wait.plot([r[0] for r in rows], [r[2] for r in rows], linestyle=":", **style)
    for ax in (ax_tp, ax_busy, ax_wait):
        ax.grid(alpha=0.3)
    ax_tp.set_ylabel("job samples/s")
    ax_busy.set_ylabel("busy ms/step")
    ax_wait.set_ylabel("comm_wait ms/step")
    ax_wait.set_xlabel("minutes since the job's first window")
    ax_tp.set_title(f"{inc['id']} job {inc['job']}: {inc['cause']} "
                    f"{'rank ' + str(subject) if subject is not None else inc.get('node') or inc.get('link') or ''} "
                    f"({inc['state']})")
    ax_tp.legend(loc="lower left", fontsize="small")
    ax_busy.legend(loc="upper left", fontsize="small", ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_decide(args: argparse.Namespace) -> int:
    data = client_from(args).request("POST", f"/v1/incidents/{args.incident}/{args.decision}")
    inc = data["incident"]
    action = inc.get("action") or {}
    print(f"{inc['id']}: {args.decision}d {action.get('kind', '')} {action.get('target') or ''} "
          f"-> state {inc['state']}")
    return 0


def _guard(func):
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (ClientError, ConfigError) as err:
            print(f"artemis {args.command}: {err}", file=sys.stderr)
            return 1
    return run


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", metavar="URL", help="artemisd URL (default: $ARTEMIS_SERVER or Listen= of --config)")
    p.add_argument("--config", metavar="FILE", help=f"artemis.conf (default {DEFAULT_CONFIG} when present)")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("status", help="the daemon's mode, incident counts and recent jobs")
    _common(p)
    p.add_argument("--json", action="store_true", help="machine-readable")
    p.set_defaults(func=_guard(cmd_status))

    p = subparsers.add_parser("incidents", help="list incidents (incident contract with --json)")
    _common(p)
    p.add_argument("--json", action="store_true", help="one incident JSON object per line")
    p.add_argument("--all", action="store_true", help="include suspects and dismissed ones")
    p.add_argument("--job", metavar="JOBID", help="only this job's incidents")
    p.set_defaults(func=_guard(cmd_incidents))

    p = subparsers.add_parser("show", help="one incident with its evidence, actions and audit trail")
    _common(p)
    p.add_argument("incident", metavar="INC", help="incident id, e.g. INC-17")
    p.add_argument("--json", action="store_true", help="machine-readable")
    p.add_argument("--plot", metavar="OUT.png", help="write the job's throughput with the loop's steps marked, and per-rank busy/wait (PNG)")
    p.set_defaults(func=_guard(cmd_show))

    for decision, text in (("approve", "let a waiting action run"), ("deny", "refuse a waiting action")):
        p = subparsers.add_parser(decision, help=f"{text} (root, SlurmUser or AdminUids)")
        _common(p)
        p.add_argument("incident", metavar="INC", help="incident id, e.g. INC-17")
        p.set_defaults(func=_guard(cmd_decide), decision=decision)
