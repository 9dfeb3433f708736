"""Starts real gloo ranks of tests/probe/job.py as subprocesses on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

JOB = Path(__file__).with_name("job.py")
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(spec: dict, *, world: int = 4, env: dict[str, str] | None = None, timeout_s: float = 150.0,
            script: Path = JOB) -> list[dict]:
    """Run one job (``script``, by default job.py) to completion; return each rank's result dict (rank order).

    Raises if any rank exits other than 0 (a signal, e.g. SIGABRT at exit, included).
    """
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        rank_env = {k: v for k, v in os.environ.items() if not k.startswith(("ARTEMIS_", "SLURM"))}
        rank_env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                         "PYTHONPATH": str(ROOT), "ARTEMIS_JOB_ID": "4242", "ARTEMIS_TELEMETRY": "none",
                         # one rank per emulated node, as on a cluster with one GPU per node
                         "ARTEMIS_NODE": f"n{rank}", "PYTHONFAULTHANDLER": "1"})
        rank_env.update(env or {})
        log = open(out / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(script), json.dumps(spec)], env=rank_env,
                                       stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout_s
    timed_out = False
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                # SIGABRT first: with PYTHONFAULTHANDLER the rank's log gets
                # every thread's stack, which says where it hung.
                proc.send_signal(signal.SIGABRT)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            log.close()
    codes = [p.returncode for p, _ in procs]
    if timed_out or any(codes):
        logs = "\n".join((out / f"rank{r}.log").read_text()[-4000:] for r in range(world))
        what = f"timed out after {timeout_s:.0f} s" if timed_out else "failed"
        raise AssertionError(f"job {what}, exit codes {codes}:\n{logs}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
