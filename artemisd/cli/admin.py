"""``artemis status | incidents | show | approve | deny``: talk to the running artemisd.

The daemon's address comes from ``--server URL``, else ``$ARTEMIS_SERVER``,
else ``Listen=`` in artemis.conf (``--config``, default /etc/artemis/artemis.conf).
Requests that change something (approve, deny) are signed with a munge
credential of the caller (``munge -s <sha256 of body>``), as the daemon
requires; reads are open.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from datetime import datetime, timezone
from typing import Any

from artemisd.cli.replay import format_table
from artemisd.config import ConfigError, load_config
from artemisd.incident import Incident, Result

DEFAULT_CONFIG = "/etc/artemis/artemis.conf"
TIMEOUT_S = 30.0


class ClientError(RuntimeError):
    pass


class Client:
    def __init__(self, server: str, munge_socket: str | None, sign: bool):
        self.server = server.rstrip("/")
        self.munge_socket = munge_socket
        self.sign = sign

    def _credential(self, body: bytes) -> str:
        argv = ["munge", "-s", hashlib.sha256(body).hexdigest()]
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
        req = urllib.request.Request(f"{self.server}{path}", data=body if method == "POST" else None, method=method)
        req.add_header("Content-Type", "application/json")
        if self.sign and method == "POST":
            req.add_header("Authorization", f"Munge {self._credential(body)}")
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
    counts = ", ".join(f"{n} {s}" for s, n in sorted(status["incidents"].items())) or "none"
    print(f"incidents: {counts}")
    print(f"open actions: {status['open_actions']}   stored records: {status['records']}")
    for job in status["jobs"][:10]:
        print(f"  job {job['job']:<10} partition {job['partition'] or '-':<10} last window "
              f"{job['last_window'] if job['last_window'] is not None else '-':<6} seen {_time(job['last_seen'])}")
    return 0


def cmd_incidents(args: argparse.Namespace) -> int:
    data = client_from(args).request("GET", "/v1/incidents" + ("?all=1" if args.all else ""))
    incidents = [i for i in data["incidents"] if args.job is None or i["job"] == args.job]
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
        if inc.loss_pct is not None or inc.measured_loss_pct is not None:
            print(f"\nloss: {inc.loss_pct} % of throughput from the subject's excess per step; "
                  f"measured {inc.measured_loss_pct} % from the job's samples/s against healthy")
        result = inc.result
        if result is not None:
            print("\n" + format_result(result))
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
        windows = client.request("GET", f"/v1/incidents/{args.incident}/windows")
        plot_timeline(windows, args.plot)
        print(f"\nwrote {args.plot}", file=sys.stderr)
    return 0


def format_result(result: Result) -> str:
    """The job's throughput as every view names it: healthy, slowed (up to the action), after."""
    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    line = (f"throughput (samples/s): healthy {num(result.throughput_healthy)}, "
            f"slowed {num(result.throughput_before)}, after {num(result.throughput_after)}")
    if result.throughput_after is not None and result.throughput_healthy:
        line += f" ({100.0 * result.throughput_after / result.throughput_healthy:.0f} % of healthy)"
    return line + f"; recovered {'not yet judged' if result.recovered is None and result.throughput_after is None else result.recovered}"


def plot_timeline(data: dict[str, Any], path: str) -> None:
    """Per-rank busy (solid) and comm_wait (dotted) per window, the incident's windows shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inc = data["incident"]
    by_rank: dict[int, list[tuple[int, float | None, float | None]]] = {}
    for w in data["windows"]:
        if w["rank"] is None or w["seq"] is None:
            continue
        by_rank.setdefault(int(w["rank"]), []).append((int(w["seq"]), w["busy"], w["comm_wait"]))
    fig, (ax_busy, ax_wait) = plt.subplots(2, 1, sharex=True, figsize=(10, 6))
    subject = inc.get("rank")
    for rank in sorted(by_rank):
        rows = sorted(by_rank[rank])
        seqs = [r[0] for r in rows]
        highlight = rank == subject
        style = {"linewidth": 2.2 if highlight else 0.8, "alpha": 1.0 if highlight else 0.5,
                 "label": f"rank {rank}" if highlight or len(by_rank) <= 8 else None}
        ax_busy.plot(seqs, [r[1] for r in rows], **style)
        ax_wait.plot(seqs, [r[2] for r in rows], linestyle=":", **style)
    for ax in (ax_busy, ax_wait):
        if inc.get("onset_window") is not None:
            end = inc.get("confirmed_window") or inc.get("flagged_window") or inc["onset_window"]
            ax.axvspan(inc["onset_window"], end, color="tab:red", alpha=0.12)
        ax.grid(alpha=0.3)
    ax_busy.set_ylabel("busy ms/step")
    ax_wait.set_ylabel("comm_wait ms/step")
    ax_wait.set_xlabel("window")
    ax_busy.set_title(f"{inc['id']} job {inc['job']}: {inc['cause']} "
                      f"{'rank ' + str(subject) if subject is not None else inc.get('node') or ''} "
                      f"({inc['state']})")
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
    p.add_argument("--plot", metavar="OUT.png", help="write a per-rank busy/wait timeline (matplotlib)")
    p.set_defaults(func=_guard(cmd_show))

    for decision, text in (("approve", "let a waiting action run"), ("deny", "refuse a waiting action")):
        p = subparsers.add_parser(decision, help=f"{text} (root, SlurmUser or AdminUids)")
        _common(p)
        p.add_argument("incident", metavar="INC", help="incident id, e.g. INC-17")
        p.set_defaults(func=_guard(cmd_decide), decision=decision)
