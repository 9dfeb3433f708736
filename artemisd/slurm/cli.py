"""SlurmBackend over the Slurm commands (the tested default).

Reads use ``sinfo --json`` and ``squeue --json`` (openapi v0.0.38 on 22.05;
``scontrol show … --json`` does not exist there) and fall back to ``sacct``
for jobs that have left slurmctld's memory.  Writes use ``scontrol update``
and, for a finished job's AdminComment, ``sacctmgr modify job`` (a running
job's AdminComment reaches the accounting database only when it ends —
design.md §5).  sacctmgr 22.05 lowercases the value it stores there
("artemis: inc-17 …"), quoted or not; readers compare case-insensitively.
Hostlists are expanded with python-hostlist.

The commands find the cluster the usual way (``SLURM_CONF`` or the
configless DNS record), exactly as an admin's shell would.
"""

from __future__ import annotations

import json
import pwd
import subprocess
from collections.abc import Sequence
from typing import Any

import hostlist

from artemisd.slurm.api import JobInfo, NodeInfo, SlurmError, check_features, check_job_id, check_name
from artemisd.slurm.scope import CURRENT_SCOPE

# Messages that mean the request itself is wrong, so retrying cannot help.
_PERMANENT = ("invalid job id", "invalid node name", "invalid feature", "job is no longer pending",
              "requested operation is presently disabled", "only batch jobs", "not requeueable",
              "access/permission denied", "already completing or completed")


def expand_hostlist(text: str) -> tuple[str, ...]:
    """``n[1-3],x5`` -> ("n1", "n2", "n3", "x5"); empty and Slurm's "(null)" give ()."""
    text = (text or "").strip()
    if not text or text == "(null)":
        return ()
    return tuple(hostlist.expand_hostlist(text))


def collect_hostlist(nodes: Sequence[str]) -> str:
    return hostlist.collect_hostlist(list(nodes)) if nodes else ""


class CliSlurm:
    def __init__(self, timeout: float = 30.0, env: dict[str, str] | None = None):
        self.timeout = timeout
        self.env = env

    # --- plumbing -------------------------------------------------------

    def _run(self, *argv: str) -> str:
        """The command's stdout; killed when the read it serves is cancelled (``CancelScope``)."""
        scope = CURRENT_SCOPE.get()
        if scope is not None and scope.cancelled:
            raise SlurmError(f"{' '.join(argv[:3])}: cancelled, nobody waits for the answer", transient=False)
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=self.env)
        except FileNotFoundError:
            raise SlurmError(f"{argv[0]}: not installed", transient=False) from None
        if scope is not None:
            scope.started(proc)
        try:
            stdout, stderr = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise SlurmError(f"{' '.join(argv[:3])}: no answer in {self.timeout:.0f} s") from None
        finally:
            if scope is not None:
                scope.finished(proc)
        if scope is not None and scope.cancelled:
            raise SlurmError(f"{' '.join(argv[:3])}: cancelled, nobody waits for the answer", transient=False)
        if proc.returncode != 0:
            message = (stderr or stdout).strip().splitlines()
            text = message[-1] if message else f"exit status {proc.returncode}"
            permanent = any(p in text.lower() for p in _PERMANENT)
            raise SlurmError(f"{' '.join(argv[:3])}: {text}", transient=not permanent)
        return stdout

    def _json(self, *argv: str) -> dict[str, Any]:
        out = self._run(*argv)
        try:
            return json.loads(out)
        except json.JSONDecodeError as err:
            raise SlurmError(f"{argv[0]}: unreadable JSON ({err.msg})") from None

    # --- reads ----------------------------------------------------------

    def node(self, name: str) -> NodeInfo:
        data = self._json("sinfo", "--json", f"--nodes={check_name('node', name)}")
        for entry in data.get("nodes", []):
            if entry.get("name") == name:
                return _node_from_json(entry)
        raise SlurmError(f"sinfo: no node {name}", transient=False)

    def partition_nodes(self, partition: str) -> tuple[NodeInfo, ...]:
        data = self._json("sinfo", "--json", f"--partition={check_name('partition', partition)}")
        # Filtered here too: the node list is what budgets are computed over.
        nodes = (_node_from_json(e) for e in data.get("nodes", []) if partition in (e.get("partitions") or ()))
        return tuple({n.name: n for n in nodes}.values())

    def job(self, job_id: str) -> JobInfo | None:
        data = self._json("squeue", "--json", f"--jobs={check_job_id(job_id)}")
        for entry in data.get("jobs", []):
            if str(entry.get("job_id")) == job_id:
                return _job_from_json(entry)
        return self._job_from_sacct(job_id)

    def _job_from_sacct(self, job_id: str) -> JobInfo | None:
        # An allocation's line has no task count (NTasks is per step); NCPUS bounds its ranks.
        fields = ("JobID", "UID", "State", "Partition", "NodeList", "NCPUS", "AdminComment")
        try:
            out = self._run("sacct", "--noheader", "--parsable2", "--allocations",
                            f"--jobs={check_job_id(job_id)}", f"--format={','.join(fields)}")
        except SlurmError as err:
            if "accounting storage is disabled" in str(err).lower():
                return None
            raise
        for line in out.splitlines():
            cols = line.split("|", len(fields) - 1)
            if len(cols) == len(fields) and cols[0] == job_id:
                return JobInfo(job_id=job_id, user_id=int(cols[1] or -1), state=cols[2].split()[0].upper(),
                               partition=cols[3], nodes=expand_hostlist(cols[4]),
                               cpus=int(cols[5]) if cols[5].isdigit() else None, admin_comment=cols[6])
        return None

    def uid_of(self, user: str) -> int | None:
        try:
            return pwd.getpwnam(user).pw_uid
        except KeyError:
            return int(user) if user.isdigit() else None

    # --- writes ---------------------------------------------------------

    def drain(self, node: str, reason: str) -> None:
        self._run("scontrol", "update", f"NodeName={check_name('node', node)}", "State=DRAIN", f"Reason={reason}")

    def resume(self, node: str) -> None:
        self._run("scontrol", "update", f"NodeName={check_name('node', node)}", "State=RESUME")

    def requeue_hold(self, job_id: str) -> None:
        self._run("scontrol", "requeuehold", check_job_id(job_id))

    def release(self, job_id: str) -> None:
        self._run("scontrol", "release", check_job_id(job_id))
        # A requeued job gets a BeginTime ~ now + 2 x MinJobAge; start it now.
        self._run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def set_excluded_nodes(self, job_id: str, nodes: tuple[str, ...]) -> None:
        for node in nodes:
            check_name("node", node)
        self._run("scontrol", "update", f"JobId={check_job_id(job_id)}", f"ExcNodeList={collect_hostlist(nodes)}")

    def set_features(self, job_id: str, features: str) -> None:
        self._run("scontrol", "update", f"JobId={check_job_id(job_id)}", f"Features={check_features(features)}")

    def set_admin_comment(self, job_id: str, comment: str, finished: bool) -> None:
        if finished:
            self._run("sacctmgr", "-i", "modify", "job", "where", f"JobID={check_job_id(job_id)}",
                      "set", f"AdminComment={comment}")
        else:
            self._run("scontrol", "update", f"JobId={check_job_id(job_id)}", f"AdminComment={comment}")


def _node_from_json(entry: dict[str, Any]) -> NodeInfo:
    state = entry.get("state", "")
    states = {s.upper() for s in (state if isinstance(state, list) else [state]) if s}
    states |= {s.upper() for s in entry.get("state_flags", []) or []}
    return NodeInfo(name=entry["name"], states=frozenset(states), reason=entry.get("reason") or "",
                    partitions=tuple(entry.get("partitions") or ()))


def _job_from_json(entry: dict[str, Any]) -> JobInfo:
    state_reason = str(entry.get("state_reason") or "")
    return JobInfo(
        job_id=str(entry["job_id"]),
        user_id=int(entry.get("user_id", -1)),
        state=str(entry.get("job_state", "")).upper(),
        partition=str(entry.get("partition") or ""),
        nodes=expand_hostlist(str(entry.get("nodes") or "")),
        batch=bool(entry.get("batch_flag", True)),
        requeue=bool(entry.get("requeue", False)),
        held=state_reason.startswith("JobHeld") or entry.get("priority") == 0,
        excluded_nodes=expand_hostlist(str(entry.get("excluded_nodes") or "")),
        features=str(entry.get("features") or ""),
        admin_comment=str(entry.get("admin_comment") or ""),
        tasks=_count(entry.get("tasks")),
        cpus=_count(entry.get("cpus")),
        end_time=_count(entry.get("end_time")),
        unlimited=_unlimited(entry.get("time_limit", _ABSENT)),
        extra={"state_reason": state_reason},
    )


# Slurm's INFINITE and NO_VAL (uint32): a time limit of either is no limit.
_INFINITE_MINUTES = (0xFFFFFFFF, 0xFFFFFFFE)
_ABSENT = object()


def _unlimited(value: Any) -> bool:
    """A job's ``time_limit`` (minutes) says it has none: ``null`` in 22.05's ``squeue --json``
    (seen on the test cluster, MaxTime=INFINITE), INFINITE as a plain number, or the
    ``{"infinite": true}`` of later data parsers.  Absent: not known, not unlimited."""
    if value is None:
        return True
    if isinstance(value, dict):
        return bool(value.get("infinite")) or not value.get("set", True)
    return isinstance(value, int) and not isinstance(value, bool) and value in _INFINITE_MINUTES


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
