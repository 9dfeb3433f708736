"""One end-to-end run: a DDP job under ``sbatch --artemis=on``, a fault, the daemon's answer.

Shared by the end-to-end tests and the demo.  Every wait is bounded in time and
polls real state (the daemon's store, ``scontrol``), never sleeps a fixed time
to "let things happen".
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import faults
from .artemis import ArtemisDaemon, Mailbox
from .procs import ClusterError, tail, wait_until
from .slurm import SlurmCluster

TRAIN = Path(__file__).with_name("train_ddp.py")

# The analysis runs at the shipped defaults: nothing here sets a threshold,
# a confirmation rule, a probe budget or a verification rule.  What is set is
# the policy a site writes for a small partition that lets every rung act by
# itself (``SITE_POLICY``, printed by the demo beside the defaults it replaces).
# The probe's windows are the cluster's plugstack ``window_steps`` (20, default
# 50): shorter windows are noisier than the default's, never quieter.
SITE_POLICY: dict[str, tuple[str, str]] = {
    "Auto": ("correct,rebalance,drain,requeue,escalate",
             "every rung acts by itself, so each one is shown; a site adds rungs as it trusts them"),
    "MaxDrainFraction": ("0.5", "a 4-node partition: the default 0.1 allows no drain at all (0.1 x 4 < 1)"),
    "MaxDrainsPerHour": ("100", "the tests drain a node in several jobs within one hour"),
    "Cooldown": ("1", "faults follow each other in one job within minutes; at the default 15 min "
                      "the second fault's action would wait for the first's cooldown"),
}
WINDOW_STEPS_WHY = "this machine's ~50 ms steps make 20-step windows of about a second"
DAEMON_CONF = ("PartitionPolicy=main "
               + " ".join(f"{key}={value}" for key, (value, _) in SITE_POLICY.items()) + "\n")


def settings_beside_defaults(window_steps: int) -> list[str]:
    """What the rig sets that a fresh install does not, each with the shipped default and why:
    the defaults are read from the daemon's and the probe's own code, so this list cannot drift."""
    from artemisd.config import BLOCK_KEYS, DEFAULT_POLICY
    from torch_hook.config import ProbeConfig

    keys = BLOCK_KEYS["PartitionPolicy"].keys
    lines = []
    for key, (value, why) in SITE_POLICY.items():
        default = getattr(DEFAULT_POLICY, keys[key].field)
        shown = ",".join(default) if isinstance(default, tuple) else f"{default:g}"
        lines.append(f"{key}={value} (default {shown}): {why}")
    default_steps = ProbeConfig.__dataclass_fields__["window_steps"].default
    if window_steps != default_steps:
        lines.append(f"plugstack window_steps={window_steps} (default {default_steps}): {WINDOW_STEPS_WHY}")
    return lines


@contextmanager
def module_daemon(cluster: SlurmCluster, conf: str, mailbox: Mailbox | None) -> Iterator[ArtemisDaemon]:
    """One artemisd for a test module, on healthy emulated GPUs; its state is wiped afterwards
    (every module's daemon uses the cluster's one artemisd directory)."""
    faults.write_healthy_gpus(cluster)
    with ArtemisDaemon(cluster, conf, mailbox) as daemon:
        yield daemon
    daemon.wipe_state()


def batch_script(cluster: SlurmCluster, args: str, program: Path = TRAIN) -> str:
    """A batch script a user would write: rendezvous at the first node, then srun ``program``."""
    iface = next(iter(cluster.nodes.values())).iface
    return f"""#!/bin/bash
NODE0=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
export MASTER_ADDR=$(scontrol show node "$NODE0" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export GLOO_SOCKET_IFNAME={iface}
srun --kill-on-bad-exit=1 {sys.executable} {program} {args}
"""


@dataclass
class TrainingJob:
    cluster: SlurmCluster
    daemon: ArtemisDaemon | None
    job_id: str
    out: Path
    stall_dir: Path
    progress_dir: Path

    @classmethod
    def submit(cls, cluster: SlurmCluster, daemon: ArtemisDaemon | None, *, nodes: int = 3,
               artemis: str | None = "on", seconds: float = 240.0,
               sbatch_args: tuple[str, ...] = (), program: tuple[Path, str] | None = None,
               env: dict[str, str] | None = None) -> TrainingJob:
        """``program``: another training script and its arguments than train_ddp.py's (whose
        progress log ``steps`` reads); ``env``: more of the submitting user's environment."""
        stall_dir = cluster.dir / "stall"
        stall_dir.mkdir(exist_ok=True)
        progress = cluster.dir / "progress" / f"{time.time_ns()}"
        progress.mkdir(parents=True)
        flags = [f"--artemis={artemis}"] if artemis else []
        out = cluster.dir / "jobs" / "train-%j.out"
        job_id = cluster.sbatch(
            batch_script(cluster, f"--seconds {seconds:g} --stall-dir {stall_dir} --progress-dir {progress}")
            if program is None else batch_script(cluster, program[1], program[0]),
            *flags, "-N", str(nodes), "--ntasks-per-node=1", "--requeue", "-J", "train",
            "-o", str(out), *sbatch_args,
            # The site's runtime environment on these emulated nodes: where munged
            # listens and which telemetry backend plays the GPUs.
            env={"ARTEMIS_MUNGE_SOCKET": str(cluster.munge_socket),
                 "ARTEMIS_TELEMETRY": "emulated",
                 "ARTEMIS_EMULATED_GPU_DIR": str(cluster.emulated_gpu_dir), **(env or {})},
        )
        return cls(cluster, daemon, job_id, Path(str(out).replace("%j", job_id)), stall_dir, progress)

    # -- what the job is doing ------------------------------------------------

    def info(self) -> dict[str, str]:
        return self.cluster.job(self.job_id)

    def nodes(self) -> list[str]:
        nodelist = self.info().get("NodeList", "")
        if not nodelist or nodelist == "(null)":
            return []
        return self.cluster.cmd("scontrol", "show", "hostnames", nodelist).stdout.split()

    def rank_node(self, rank: int) -> str:
        """Node of ``rank`` (one task per node, block distribution: rank i on the i-th node)."""
        return self.nodes()[rank]

    def wait_running(self, timeout_s: float = 60.0) -> None:
        self.cluster.wait_job(self.job_id, ["RUNNING"], timeout_s=timeout_s)

    def steps(self) -> int:
        """Training steps every rank has completed (from the job's own progress log)."""
        counts = []
        for path in self.progress_dir.glob("rank*.json"):
            try:
                counts.append(json.loads(path.read_text())["steps"])
            except (OSError, ValueError, KeyError):
                return 0
        return min(counts) if counts else 0

    def wait_steps(self, count: int, timeout_s: float = 120.0) -> None:
        """Until every rank trained ``count`` steps (``count / window_steps`` baseline windows)."""

        def enough() -> bool:
            state = self.cluster.job_state(self.job_id)
            if state not in ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING"):
                raise ClusterError(f"job {self.job_id} is {state}:\n{tail(self.out)}")
            return self.steps() >= count

        wait_until(enough, f"{count} training steps of job {self.job_id}", timeout_s=timeout_s,
                   interval_s=0.5)

    def wait_incident(self, match: Callable[[dict[str, Any]], bool], what: str,
                      timeout_s: float = 120.0) -> dict[str, Any]:
        assert self.daemon is not None
        found: list[dict[str, Any]] = []

        def seen() -> bool:
            found[:] = [i for i in self.daemon.incidents(everything=True)  # type: ignore[union-attr]
                        if i.get("job") == self.job_id and match(i)]
            return bool(found)

        try:
            wait_until(seen, what, timeout_s=timeout_s, interval_s=1.0)
        except ClusterError as err:
            incidents = self.daemon.incidents(everything=True)
            raise ClusterError(f"{err}\nincidents: {incidents}\n{self.daemon.log_tail(20)}") from None
        return found[-1]

    def cancel(self) -> None:
        self.cluster.cmd("scancel", self.job_id, check=False)


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = 90.0) -> Any:
    box: list[Any] = []

    def check() -> bool:
        value = predicate()
        box[:] = [value]
        return bool(value)

    wait_until(check, what, timeout_s=timeout_s, interval_s=1.0)
    return box[0]


def elapsed(since: float) -> str:
    return f"{time.monotonic() - since:5.1f}s"
