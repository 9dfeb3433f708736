"""A private munged: its own key and socket under a temp dir, stopped by PID.

Slurm (``AuthInfo=socket=…``), artemisd and the probe all talk to this socket, so
a test cluster never touches the machine's /run/munge or /etc/munge.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

from .procs import Daemon, run, spawn, wait_until


class Munged:
    """``with Munged() as m: m.socket`` — a running munged for this test session."""

    def __init__(self, workdir: Path | None = None):
        self._own_dir = workdir is None
        self.dir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="artemis-munge-"))
        self.socket = self.dir / "munge.socket"
        self.key = self.dir / "munge.key"
        self.daemon: Daemon | None = None

    def __enter__(self) -> Munged:
        # munged refuses a socket directory others can write; clients of any uid
        # must still reach the socket, hence 0755.
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o755)
        self.key.write_bytes(os.urandom(1024))
        os.chmod(self.key, 0o400)
        self.daemon = spawn("munged", [
            "munged", "--foreground", "--force",
            f"--key-file={self.key}", f"--socket={self.socket}",
            f"--pid-file={self.dir / 'munged.pid'}", f"--seed-file={self.dir / 'munged.seed'}",
            f"--log-file={self.dir / 'munged.log'}", "--num-threads=4",
        ], self.dir / "munged.out")
        try:
            wait_until(self._answers, "munged to answer", timeout_s=15, daemon=self.daemon)
        except BaseException:
            self.stop()
            raise
        return self

    def _answers(self) -> bool:
        if not self.socket.exists():
            return False
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(str(self.socket))
            return True
        except OSError:
            return False
        finally:
            probe.close()

    def credential(self, payload: bytes) -> str:
        """A credential whose payload is ``payload`` (what a client would send)."""
        return run(["munge", "-S", str(self.socket), "-s", payload.decode()]).stdout.strip()

    def decode(self, credential: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["unmunge", "-S", str(self.socket)], input=credential,
                              capture_output=True, text=True, timeout=10)

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
