"""Start, wait for and stop the daemons the test cluster runs — always by PID."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


class ClusterError(RuntimeError):
    """A daemon of the test cluster failed to start or to answer."""


def tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Daemon:
    """One process we started; ``stop`` signals exactly this PID."""

    name: str
    proc: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        if not self.alive():
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


def spawn(
    name: str,
    argv: Sequence[str],
    log: Path,
    env: Mapping[str, str] | None = None,
    preexec: Callable[[], None] | None = None,
) -> Daemon:
    """Run ``argv`` in the foreground of a child, stdout and stderr into ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            preexec_fn=preexec,
            start_new_session=True,  # a Ctrl-C in pytest must not reach the daemons first
        )
    return Daemon(name, proc, log)


def wait_until(
    ready: Callable[[], bool],
    what: str,
    timeout_s: float = 30.0,
    interval_s: float = 0.1,
    daemon: Daemon | None = None,
) -> None:
    """Poll ``ready`` (bounded by time) and fail with the daemon's log if it never is."""
    deadline = time.monotonic() + timeout_s
    while True:
        if ready():
            return
        if daemon is not None and not daemon.alive():
            raise ClusterError(
                f"{daemon.name} exited with status {daemon.proc.returncode} before {what}:\n"
                f"{tail(daemon.log)}"
            )
        if time.monotonic() > deadline:
            detail = f":\n{tail(daemon.log)}" if daemon is not None else ""
            raise ClusterError(f"timed out after {timeout_s:.0f} s waiting for {what}{detail}")
        time.sleep(interval_s)


def run(argv: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float = 30.0,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a short command; on failure the error carries its output."""
    proc = subprocess.run(
        list(argv), env=dict(env) if env is not None else None, capture_output=True,
        text=True, timeout=timeout_s,
    )
    if check and proc.returncode != 0:
        raise ClusterError(
            f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}".rstrip()
        )
    return proc


def kill_pids(pids: Sequence[int], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL whatever of ``pids`` is left (pids we own: a cgroup or netns of ours)."""
    live = [pid for pid in pids if pid != os.getpid()]
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        for pid in live:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while live and time.monotonic() < deadline:
            live = [pid for pid in live if pid_alive(pid)]
            time.sleep(0.05)
        if not live:
            return


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still "exists"; it is gone for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def own_tmpdir(prefix: str) -> Iterator[str]:
    """Give every process started inside the block (ranks under torchrun, srun and sbatch, the
    daemons) a ``TMPDIR`` of its own, removed when the block ends.  A rank's node relay binds its
    socket there, and ranks killed by a signal leave theirs behind.  This process keeps the temp
    directory it had (pytest's ``tmp_path`` included)."""
    tempfile.gettempdir()  # fixed now, before TMPDIR changes
    path = tempfile.mkdtemp(prefix=prefix)
    os.chmod(path, 0o1777)  # like /tmp: jobs that run as nobody write there too
    prior = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = path
    try:
        yield path
    finally:
        if prior is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = prior
        shutil.rmtree(path, ignore_errors=True)
