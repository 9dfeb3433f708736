"""A private MariaDB for slurmdbd, started by hand (no systemd, no /etc/mysql).

``--no-defaults`` keeps the machine's my.cnf out; the root account uses socket
authentication, so slurmdbd gets its own password account on 127.0.0.1.
"""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path
from types import TracebackType

from .procs import Daemon, run, spawn, wait_until


class MariaDB:
    def __init__(self, workdir: Path, port: int):
        self.dir = Path(workdir)
        self.port = port
        self.socket = self.dir / "mysqld.sock"
        self.user = "slurm"
        self.password = secrets.token_hex(12)
        self.daemon: Daemon | None = None

    def __enter__(self) -> MariaDB:
        data, tmp = self.dir / "data", self.dir / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        shutil.chown(self.dir, "mysql", "mysql")
        shutil.chown(tmp, "mysql", "mysql")
        # A private tmpdir: two installs at once in /tmp collide on temp table names.
        run(["mariadb-install-db", "--no-defaults", "--user=mysql", f"--datadir={data}",
             f"--tmpdir={tmp}", "--skip-test-db", "--auth-root-authentication-method=socket"],
            timeout_s=120)
        self.daemon = spawn("mariadbd", [
            "mariadbd", "--no-defaults", "--user=mysql", f"--datadir={data}",
            f"--port={self.port}", "--bind-address=127.0.0.1", f"--socket={self.socket}",
            f"--tmpdir={tmp}",
            f"--pid-file={self.dir / 'mysqld.pid'}", f"--log-error={self.dir / 'mysqld.err'}",
            "--skip-log-bin", "--innodb-buffer-pool-size=32M", "--innodb-log-file-size=16M",
            # slurmdbd's schema conversion is slow with durable commits; a test DB needs none.
            "--innodb-flush-log-at-trx-commit=0", "--innodb-doublewrite=0",
        ], self.dir / "mysqld.out")
        try:
            wait_until(lambda: self._sql("SELECT 1", check=False).returncode == 0,
                       "MariaDB to accept connections", timeout_s=60, daemon=self.daemon)
            self._sql(
                f"CREATE USER '{self.user}'@'127.0.0.1' IDENTIFIED BY '{self.password}';"
                f"GRANT ALL ON *.* TO '{self.user}'@'127.0.0.1';"
            )
        except BaseException:
            self.stop()
            raise
        return self

    def _sql(self, statement: str, check: bool = True):
        return run(["mariadb", "--no-defaults", f"--socket={self.socket}", "-u", "root",
                    "-e", statement], check=check, timeout_s=30)

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop(grace_s=30)
            self.daemon = None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
