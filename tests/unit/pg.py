"""A throwaway PostgreSQL server for the store's tests and benchmark.

``initdb`` in a fresh temporary directory, ``postgres`` listening on a unix
socket in that directory only (no TCP port to collide with anything), password
(scram) authentication so ``StatePasswordFile`` is exercised for real, stopped
by its PID (SIGINT: fast shutdown) and the directory removed.  PostgreSQL
refuses to run as root: as root it runs as the ``postgres`` user (the Debian
package creates it), owning the directory.

``PgServer.start()`` raises ``PgUnavailable`` with the reason where no server can
be had (no binaries, no unprivileged user); the tests skip on that, CI installs
``postgresql`` (scripts/apt-packages-test.txt) so there they run.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PASSWORD = "artemis-test-password"
USER = "artemis"


class PgUnavailable(RuntimeError):
    pass


def _bindir() -> Path:
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name),
                            reverse=True):
        if Path(candidate, "initdb").exists() and Path(candidate, "postgres").exists():
            return Path(candidate)
    found = shutil.which("initdb")
    if found and shutil.which("postgres"):
        return Path(found).parent
    raise PgUnavailable("no PostgreSQL server binaries (initdb, postgres): apt-get install postgresql")


class PgServer:
    def __init__(self, durable: bool = False):
        # durable=False: fsync off, as a test's data dies with it; the benchmark
        # keeps PostgreSQL's defaults (every commit flushed).
        self.durable = durable
        self.dir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._admin_db = "postgres"

    def start(self) -> PgServer:
        bindir = _bindir()
        user: pwd.struct_passwd | None = None
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                raise PgUnavailable("running as root and no 'postgres' user to run PostgreSQL as") from None
        # Under /tmp, not pytest's tmp_path: the postgres user must reach it (root's is mode 700).
        self.dir = Path(tempfile.mkdtemp(prefix="artemis-pg-", dir="/tmp"))
        try:
            self._start(bindir, user)
        except BaseException:
            self.stop()
            raise
        return self

    def _run_as(self, user: pwd.struct_passwd | None) -> dict[str, object]:
        if user is None:
            return {}
        return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}

    def _start(self, bindir: Path, user: pwd.struct_passwd | None) -> None:
        assert self.dir is not None
        data = self.dir / "data"
        pwfile = self.dir / "pwfile"
        pwfile.write_text(PASSWORD + "\n")
        if user is not None:
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            os.chown(pwfile, user.pw_uid, user.pw_gid)
        pwfile.chmod(0o600)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}
        out = subprocess.run(
            [str(bindir / "initdb"), "-D", str(data), "-U", USER, f"--pwfile={pwfile}", "--auth=scram-sha-256",
             "--encoding=UTF8", "--locale=C", "--no-instructions"],
            capture_output=True, env=env, cwd=self.dir, timeout=120, **self._run_as(user))  # type: ignore[arg-type]
        pwfile.unlink()
        if out.returncode != 0:
            raise PgUnavailable(f"initdb failed: {out.stderr.decode(errors='replace')[-2000:]}")
        self._bindir, self._user = bindir, user
        self._launch()

    def _launch(self) -> None:
        assert self.dir is not None
        settings = ["-c", "listen_addresses=", "-c", f"unix_socket_directories={self.dir}", "-c", "port=5432",
                    "-c", "max_connections=20", "-c", "shared_buffers=32MB"]
        if not self.durable:
            settings += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}
        log = open(self.dir / "postgres.log", "ab")  # noqa: SIM115 - the server's, closed with it
        self.proc = subprocess.Popen([str(self._bindir / "postgres"), "-D", str(self.dir / "data"), *settings],
                                     stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.dir,
                                     **self._run_as(self._user))  # type: ignore[arg-type]
        log.close()
        self._wait_ready()

    def restart(self) -> None:
        """Fast shutdown (every client's connection is cut), then the same server on the same data again."""
        self._halt()
        self._launch()

    @contextmanager
    def down(self) -> Iterator[None]:
        """The server stopped (fast shutdown) for the ``with`` block, then started again on the same data."""
        self._halt()
        try:
            yield
        finally:
            self._launch()

    def _halt(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # fast shutdown: clients cut, no checkpoint wait for them
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # immediate; the directory goes anyway
                self.proc.wait(timeout=10)
        self.proc = None

    def _wait_ready(self, timeout: float = 60.0) -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None and self.dir is not None
            if self.proc.poll() is not None:
                raise PgUnavailable(f"postgres exited ({self.proc.returncode}): {self.log()[-2000:]}")
            try:
                psycopg.connect(self.url(self._admin_db), password=PASSWORD, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise PgUnavailable(f"postgres did not accept connections in {timeout:.0f} s: "
                                        f"{self.log()[-2000:]}") from None
                time.sleep(0.05)

    def log(self) -> str:
        try:
            return (self.dir / "postgres.log").read_text(errors="replace") if self.dir else ""
        except OSError:
            return ""

    def url(self, database: str) -> str:
        """A StateURL for ``database``: the socket directory goes in ``host`` (libpq's way)."""
        return f"postgresql://{USER}@/{database}?host={self.dir}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url(self._admin_db), password=PASSWORD, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        import psycopg

        with psycopg.connect(self.url(self._admin_db), password=PASSWORD, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        self._halt()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
