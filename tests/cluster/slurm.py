"""``SlurmCluster``: the real Slurm 22.05 daemons of Debian, brought up by hand.

Bring-up order (each step waits until the daemon answers):

    munged → [network lab] → MariaDB → slurmdbd → sacctmgr add cluster
           → slurmctld → N × slurmd (each in its node's cgroup, and namespace)

Two network layouts:

* ``netns`` (default where it works): one network namespace per node on the
  test bridge (``netlab.py``), so each node has its own address, its own link
  that a fault can degrade, and its own ``ip netns pids``.  slurmd is started
  with ``nsenter --net=…`` — ``ip netns exec`` remounts /sys and slurmd then
  fails on cgroups (design.md §5).
* ``loopback``: every slurmd on 127.0.0.1 with its own port.  Always works,
  but there is no per-node link to degrade.

Client commands use ``cluster.env`` (``SLURM_CONF`` points at the generated
slurm.conf, whose ``AuthInfo`` points at the private munged).  Teardown stops
every daemon by PID, kills what is left in each node's cgroup and namespace,
and removes cgroups, namespaces, bridge and — last — the safety route.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from .cgroups import NodeCgroup
from .mariadb import MariaDB
from .munge import Munged
from .netlab import NetLab, namespaces_available
from .procs import ClusterError, Daemon, run, spawn, wait_until

REPO = Path(__file__).resolve().parents[2]
SLURM_PLUGIN_DIR = Path("/usr/lib/x86_64-linux-gnu/slurm-wlm")
TERMINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
    "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
})


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class Node:
    """One emulated compute node as the tests see it."""

    name: str
    address: str          # where slurmctld and peers reach it
    iface: str            # GLOO_SOCKET_IFNAME for ranks on it
    port: int             # slurmd port
    netns: str | None     # None in the loopback layout
    host_veth: str | None
    cgroup: NodeCgroup

    def pids(self) -> list[int]:
        return self.cgroup.pids()


class SlurmCluster:
    """``with SlurmCluster(nodes=4) as c: c.sbatch(...)`` — see the module docstring.

    ``network`` is ``"auto"`` (namespaces when available, else loopback),
    ``"netns"`` or ``"loopback"``.  ``munged`` may be shared with the caller;
    otherwise the cluster runs its own.  ``artemis`` installs the project's
    SPANK plugin, prolog, epilog and node check (when they are built/present),
    pointed at ``artemis_endpoint`` — where the test's artemisd listens
    (``artemis_listen``) — with ``window_steps`` steps per report window, and
    the node check every ``health_interval_s`` seconds (0: never).
    """

    def __init__(
        self,
        nodes: int = 4,
        network: str = "auto",
        munged: Munged | None = None,
        artemis: bool = True,
        health_interval_s: int = 0,
        window_steps: int = 20,
        workdir: Path | None = None,
        keep_workdir: bool = False,
    ):
        if network not in ("auto", "netns", "loopback"):
            raise ValueError(f"network must be auto, netns or loopback, not {network!r}")
        self.node_count = nodes
        self.node_names = [f"n{i}" for i in range(1, nodes + 1)]
        self.requested_network = network
        self.network = network
        self.artemis = artemis
        self.health_interval_s = health_interval_s
        self.window_steps = window_steps
        self.keep_workdir = keep_workdir
        self.dir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="artemis-cluster-"))
        self.tag = self.dir.name.rsplit("-", 1)[-1].lower()
        self.name = f"art{self.tag}"[:20]
        self.hostname = socket.gethostname()
        self._munged = munged
        self._stack = ExitStack()
        self.lab: NetLab | None = None
        self.nodes: dict[str, Node] = {}
        self.daemons: list[Daemon] = []
        self.slurmd: dict[str, Daemon] = {}
        self.controller_address = "127.0.0.1"
        self.artemis_port = free_port()
        self.conf = self.dir / "etc" / "slurm.conf"
        self.bring_up_s: float | None = None
        # The project's node-side pieces, once installed (None: not built / absent).
        self.plugin: Path | None = None
        self.prolog: Path | None = None
        self.epilog: Path | None = None
        self.nodecheck: Path | None = None

    # -- what tests use ----------------------------------------------------

    @property
    def munge(self) -> Munged:
        assert self._munged is not None
        return self._munged

    @property
    def munge_socket(self) -> Path:
        return self.munge.socket

    @property
    def env(self) -> dict[str, str]:
        """Environment for sbatch/srun/scontrol/sinfo/sacct against this cluster."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        for leaked in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_NODELIST", "SLURM_JOB_NODELIST"):
            env.pop(leaked, None)
        return env

    @property
    def artemis_listen(self) -> tuple[str, int]:
        """Address artemisd must listen on so every node (namespace) reaches it."""
        return self.controller_address, self.artemis_port

    @property
    def artemis_endpoint(self) -> str:
        host, port = self.artemis_listen
        return f"http://{host}:{port}"

    @property
    def node_conf(self) -> Path:
        """The node-side Artemis config the prolog, epilog and node check read."""
        return self.dir / "etc" / "artemis" / "node.conf"

    @property
    def emulated_gpu_dir(self) -> Path:
        return self.dir / "gpus"

    def cmd(self, *argv: str, timeout_s: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster."""
        return run(argv, env=self.env, timeout_s=timeout_s, check=check)

    def scontrol(self, *args: str, check: bool = True) -> str:
        return self.cmd("scontrol", *args, check=check).stdout

    def sbatch(self, script: str | Path, *args: str, env: dict[str, str] | None = None) -> str:
        """Submit a batch script (a path or its text); returns the job id."""
        argv = ["sbatch", "--parsable", *args]
        if isinstance(script, Path):
            argv.append(str(script))
            stdin = None
        else:
            stdin = script
        full_env = self.env | (env or {})
        proc = subprocess.run(argv, input=stdin, env=full_env, capture_output=True, text=True,
                              timeout=30, cwd=self.dir)
        if proc.returncode != 0:
            raise ClusterError(f"sbatch {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict ({} once the job has left slurmctld)."""
        proc = self.cmd("scontrol", "-o", "show", "job", job_id, check=False)
        if proc.returncode != 0:
            return {}
        # Values may hold spaces (AdminComment, Reason): a value runs to the next " Key=".
        return dict(re.findall(r"(\w+)=(.*?)(?= \w+=|$)", proc.stdout.strip()))

    def job_state(self, job_id: str) -> str:
        state = self.job(job_id).get("JobState")
        if state:
            return state
        out = self.cmd("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State", check=False).stdout
        return out.split("\n")[0].split()[0] if out.strip() else "UNKNOWN"

    def wait_job(self, job_id: str, states: Sequence[str] = tuple(TERMINAL_STATES),
                 timeout_s: float = 120.0) -> str:
        wanted = set(states)
        seen: list[str] = []

        def reached() -> bool:
            state = self.job_state(job_id)
            if not seen or seen[-1] != state:
                seen.append(state)
            return state in wanted

        wait_until(reached, f"job {job_id} to reach {sorted(wanted)} (saw {seen})",
                   timeout_s=timeout_s, interval_s=0.25)
        return seen[-1]

    def node_info(self) -> dict[str, dict[str, str]]:
        out = self.cmd("sinfo", "-h", "-N", "-o", "%N|%T|%E|%U").stdout
        info: dict[str, dict[str, str]] = {}
        for line in out.splitlines():
            name, state, reason, user = (line.split("|") + ["", "", ""])[:4]
            info[name] = {"state": state, "reason": reason, "user": user}
        return info

    def drain_reasons(self) -> dict[str, str]:
        """``sinfo -R``: node → reason, for every drained/down node."""
        out = self.cmd("sinfo", "-R", "-h", "-N", "-o", "%N|%E").stdout
        return dict(line.split("|", 1) for line in out.splitlines() if "|" in line)

    def wait_nodes_idle(self, timeout_s: float = 60.0) -> None:
        wait_until(lambda: all(v["state"] == "idle" for v in self.node_info().values())
                   and len(self.node_info()) == self.node_count,
                   f"all {self.node_count} nodes idle", timeout_s=timeout_s, interval_s=0.2)

    def reset(self) -> None:
        """Between tests: cancel every job, lift faults, resume every drained node."""
        self.cmd("scancel", "--full", "-u", "root", check=False)
        for node in self.nodes.values():
            node.cgroup.set_quota(None)
        wait_until(lambda: not self.cmd("squeue", "-h", "-o", "%i").stdout.strip(),
                   "the queue to empty", timeout_s=60, interval_s=0.25)
        for name in self.drain_reasons():
            self.scontrol("update", f"NodeName={name}", "State=RESUME", check=False)
        self.wait_nodes_idle()

    # -- bring-up ------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        start = time.monotonic()
        try:
            self._bring_up()
        except BaseException:
            self.close()
            raise
        self.bring_up_s = time.monotonic() - start
        return self

    def _bring_up(self) -> None:
        if os.geteuid() != 0:
            raise ClusterError("the test cluster runs Slurm's daemons as root")
        os.chmod(self.dir, 0o755)
        for sub in ("etc/artemis", "state", "spool", "log", "run", "bin", "jobs"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        if self._munged is None:
            self._munged = self._stack.enter_context(Munged(self.dir / "munge"))
        if self.network == "auto":
            self.network = "netns" if namespaces_available() is None else "loopback"
        if self.network == "netns":
            why_not = namespaces_available()
            if why_not:
                raise ClusterError(f"network=netns: {why_not}")
            self.lab = self._stack.enter_context(NetLab(self.node_names))
            self.controller_address = self.lab.bridge_address
        self._make_nodes()
        self._install_artemis()
        db = self._stack.enter_context(MariaDB(self.dir / "mysql", free_port()))
        self._write_configs(db)
        self._start_slurmdbd()
        self._start_slurmctld()
        for node in self.nodes.values():
            self._start_slurmd(node)
        self.wait_nodes_idle()

    def _make_nodes(self) -> None:
        for name in self.node_names:
            group = NodeCgroup(self.name, name)
            group.create()
            # The cgroup is torn down before the lab: its processes die first.
            self._stack.callback(group.remove)
            if self.lab is not None:
                net = self.lab.nodes[name]
                node = Node(name, net.address, net.iface, 6818, net.netns, net.host_veth, group)
            else:
                node = Node(name, "127.0.0.1", "lo", free_port(), None, None, group)
            self.nodes[name] = node

    def _install_artemis(self) -> None:
        """Wire the project's node-side pieces into this cluster, where they exist."""
        self.emulated_gpu_dir.mkdir(parents=True, exist_ok=True)
        if not self.artemis:
            return
        if (REPO / "spank" / "Makefile").exists():
            run(["make", "-s", "-C", str(REPO / "spank")], timeout_s=120)
            self.plugin = REPO / "spank" / "artemis.so"
        node_env = {
            "ARTEMIS_NODE_CONF": str(self.node_conf),
            "PYTHONPATH": str(REPO),
            "ARTEMIS_TELEMETRY": "emulated",
            "ARTEMIS_EMULATED_GPU_DIR": str(self.emulated_gpu_dir),
        }
        for attr, script in (("prolog", "artemis-prolog"), ("epilog", "artemis-epilog"),
                             ("nodecheck", "artemis-nodecheck")):
            source = REPO / "prolog_epilog" / script
            if not source.exists():
                continue
            # slurmd gives Prolog/Epilog/HealthCheckProgram a fresh environment, so
            # the test's settings travel in a wrapper, as a site's would in a
            # packaged /etc/artemis/node.conf.
            wrapper = self.dir / "bin" / script
            exports = "".join(f"export {k}={v}\n" for k, v in node_env.items())
            wrapper.write_text(f"#!/bin/sh\n{exports}exec {sys.executable} {source} \"$@\"\n")
            wrapper.chmod(0o755)
            setattr(self, attr, wrapper)

    def _write_configs(self, db: MariaDB) -> None:
        etc = self.dir / "etc"
        self.dbd_port, self.ctld_port = free_port(), free_port()
        munge = f"socket={self.munge_socket}"
        dbd_conf = etc / "slurmdbd.conf"
        dbd_conf.write_text(textwrap.dedent(f"""\
            AuthType=auth/munge
            AuthInfo={munge}
            DbdHost=localhost
            DbdPort={self.dbd_port}
            SlurmUser=root
            LogFile={self.dir}/log/slurmdbd.log
            PidFile={self.dir}/run/slurmdbd.pid
            StorageType=accounting_storage/mysql
            StorageHost=127.0.0.1
            StoragePort={db.port}
            StorageUser={db.user}
            StoragePass={db.password}
            StorageLoc=slurm_acct_db
            """))
        dbd_conf.chmod(0o600)  # slurmdbd refuses a world-readable config (it holds a password)
        lines = [
            f"ClusterName={self.name}",
            f"SlurmctldHost={self.hostname}({self.controller_address})",
            f"SlurmctldPort={self.ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo={munge}",
            "CredType=cred/munge",
            f"StateSaveLocation={self.dir}/state",
            f"SlurmdSpoolDir={self.dir}/spool/%n",
            f"SlurmctldPidFile={self.dir}/run/slurmctld.pid",
            f"SlurmdPidFile={self.dir}/run/slurmd.%n.pid",
            f"SlurmctldLogFile={self.dir}/log/slurmctld.log",
            f"SlurmdLogFile={self.dir}/log/slurmd.%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # No cgroup plugins: the nodes' cgroups are ours (fault injection).
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=batch_sched_delay=0",
            "SlurmdParameters=config_overrides",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdTimeout=300",
            "InactiveLimit=0",
            "KillWait=3",
            "MinJobAge=600",
            "MailProg=/bin/true",
            "AccountingStorageType=accounting_storage/slurmdbd",
            f"AccountingStorageHost={self.controller_address}",
            f"AccountingStoragePort={self.dbd_port}",
            # For auth/munge this names the munged socket of the slurmdbd link
            # (AuthInfo only covers slurmctld/slurmd traffic).
            f"AccountingStoragePass={self.munge_socket}",
            f"PlugStackConfig={etc}/plugstack.conf",
        ]
        if self.prolog or self.epilog:
            lines.append("PrologFlags=Alloc")  # at allocation, on every node, not at first step
        if self.prolog:
            lines.append(f"Prolog={self.prolog}")
        if self.epilog:
            lines.append(f"Epilog={self.epilog}")
        if self.nodecheck and self.health_interval_s > 0:
            lines += [f"HealthCheckProgram={self.nodecheck}",
                      f"HealthCheckInterval={self.health_interval_s}"]
        cpus = os.cpu_count() or 1
        for node in self.nodes.values():
            lines.append(
                f"NodeName={node.name} NodeAddr={node.address} NodeHostname={self.hostname} "
                f"Port={node.port} CPUs={cpus} RealMemory=1000 State=UNKNOWN"
            )
        lines.append("PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        plugstack = [f"include {etc}/plugstack.conf.d/*.conf"]
        (etc / "plugstack.conf.d").mkdir(exist_ok=True)
        (etc / "plugstack.conf").write_text("\n".join(plugstack) + "\n")
        self._point_nodes_at(self.artemis_endpoint)

    def _point_nodes_at(self, endpoint: str, window_steps: int | None = None) -> None:
        """Where jobs' probes (the SPANK plugin's ``endpoint=``) and the prolog, epilog and node
        check (node.conf ``Endpoint``) send: read at each job step and each run, no restart."""
        if self.plugin is not None:
            (self.dir / "etc" / "plugstack.conf.d" / "artemis.conf").write_text(
                f"optional {self.plugin} endpoint={endpoint} default=off "
                f"window_steps={window_steps or self.window_steps} "
                f"autoload={REPO / 'torch_hook' / 'autoload'}\n"
            )
        self.node_conf.write_text(textwrap.dedent(f"""\
            # Node-side Artemis settings of this test cluster (prolog_epilog/node.conf.example).
            Endpoint={endpoint}
            MungeSocket={self.munge_socket}
            TimeoutSeconds=5
            """))

    @contextmanager
    def endpoints(self, urls: Sequence[str], window_steps: int | None = None) -> Iterator[None]:
        """Nodes and new jobs report to every daemon of ``urls`` (``a,b``: issue 12's failover list),
        new jobs' probes in windows of ``window_steps`` steps (None: the cluster's)."""
        self._point_nodes_at(",".join(urls), window_steps)
        try:
            yield
        finally:
            self._point_nodes_at(self.artemis_endpoint)

    def _start_slurmdbd(self) -> None:
        env = self.env | {"SLURM_CONF": str(self.conf)}
        dbd = spawn("slurmdbd", ["slurmdbd", "-D"], self.dir / "log" / "slurmdbd.out",
                    env=env | {"SLURMDBD_CONF": str(self.dir / "etc" / "slurmdbd.conf")})
        self._track(dbd)

        def registered() -> bool:
            proc = self.cmd("sacctmgr", "-i", "add", "cluster", self.name, check=False)
            return proc.returncode == 0 or "already exists" in proc.stdout + proc.stderr

        wait_until(registered, "slurmdbd to accept the cluster", timeout_s=60, daemon=dbd)
        self.cmd("sacctmgr", "-i", "add", "account", "artemis", f"Cluster={self.name}", check=False)
        self.cmd("sacctmgr", "-i", "add", "user", "root", "Account=artemis",
                 f"Cluster={self.name}", check=False)

    def _start_slurmctld(self) -> None:
        ctld = spawn("slurmctld", ["slurmctld", "-D", "-c"], self.dir / "log" / "slurmctld.out",
                     env=self.env)
        self._track(ctld)
        wait_until(lambda: self.cmd("scontrol", "ping", check=False).stdout.count("UP") > 0,
                   "slurmctld to answer", timeout_s=60, daemon=ctld)

    def _start_slurmd(self, node: Node) -> None:
        argv = ["slurmd", "-D", "-N", node.name]
        if node.netns is not None:
            argv = ["nsenter", f"--net=/run/netns/{node.netns}", *argv]
        daemon = spawn(f"slurmd {node.name}", argv, self.dir / "log" / f"slurmd.{node.name}.out",
                       env=self.env, preexec=node.cgroup.enter)
        self.slurmd[node.name] = daemon
        self._track(daemon)

    def _track(self, daemon: Daemon) -> None:
        self.daemons.append(daemon)
        self._stack.callback(daemon.stop)

    # -- teardown ------------------------------------------------------------

    def close(self) -> None:
        if any(d.name == "slurmctld" and d.alive() for d in self.daemons):
            self.cmd("scancel", "--full", "-u", "root", check=False, timeout_s=10)
        try:
            self._stack.close()  # reverse order: slurmd…, slurmctld, slurmdbd, db, cgroups, lab, munged
        finally:
            self.daemons.clear()
            if not self.keep_workdir:
                shutil.rmtree(self.dir, ignore_errors=True)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def describe(self) -> str:
        return json.dumps({
            "name": self.name, "network": self.network, "dir": str(self.dir),
            "controller": self.controller_address, "endpoint": self.artemis_endpoint,
            "nodes": {n.name: n.address for n in self.nodes.values()},
            "bring_up_s": self.bring_up_s,
        }, indent=2)
