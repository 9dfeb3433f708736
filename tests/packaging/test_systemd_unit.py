"""artemisd.service from the .deb under a real systemd: a Debian 12 container booted with systemd-nspawn.

test_packages.py runs the daemon by hand as the unit's user; only systemd itself
shows whether the unit's sandbox (ProtectSystem=strict, StateDirectory=, UMask=,
the syscall filter), LimitNOFILE=, ExecReload= and Restart= work as written.  So:
a minimal bookworm root (debootstrap from the mirror this machine's apt uses,
cached under ARTEMIS_NSPAWN_CACHE, default /var/cache/artemis-tests, keyed by the
package list), booted with ``systemd-nspawn --boot`` over a tmpfs overlay (the
cached tree is never written), with no network but its own loopback
(``--private-network``), driven with ``nsenter`` into the container's leader
(the host need not run systemd: nothing registers with machined).  The .deb is
installed with dpkg inside, as a site would, and the container is powered off
and waited for at the end.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.packaging.test_packages import CONTROLLER, VERSION, packages, run  # noqa: F401 (packages: the fixture)

# What the controller .deb depends on (control: python3.11, munge, procps, slurm-client,
# systemd), and systemd as PID 1 with its bus; nothing else, so that dpkg -i fails
# on a dependency the control file lacks and the unit finds only what the package
# declared (minbase has no /bin/kill, which the unit's ExecReload runs).
ROOTFS_PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3.11", "munge", "procps", "slurm-client")
SUITE = "bookworm"
CONTAINER_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
DEBS_INSIDE = "/mnt/artemis-debs"
UNIT = "artemisd.service"
CONFIG_ERROR_EXIT = 2  # artemisd's exit status for a config it refuses (server.main)

pytestmark = [pytest.mark.packaging, pytest.mark.timeout(900)]


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses for the suite (sources.list or deb822)."""
    proc = run("apt-get", "indextargets", "--format", "$(REPO_URI) $(RELEASE)", check=False)
    for line in proc.stdout.splitlines():
        uri, _, release = line.partition(" ")
        if release == SUITE:
            return uri
    return "http://deb.debian.org/debian/"


def cached_rootfs() -> Path:
    """A debootstrapped bookworm with ROOTFS_PACKAGES: built once per package list and mirror, then reused."""
    mirror = debian_mirror()
    key = hashlib.sha256(json.dumps([SUITE, "minbase", ROOTFS_PACKAGES, mirror]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("ARTEMIS_NSPAWN_CACHE", "/var/cache/artemis-tests"))
    cache.mkdir(parents=True, exist_ok=True)
    rootfs = cache / f"nspawn-{SUITE}-{key}"
    # Two test runs at once build it once; a half-built tree is never at `rootfs` (renamed when complete).
    with open(cache / f"nspawn-{SUITE}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not rootfs.is_dir():
            partial = cache / f"nspawn-{SUITE}-{key}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            run("debootstrap", "--variant=minbase", f"--include={','.join(ROOTFS_PACKAGES)}",
                SUITE, partial, mirror, timeout_s=900)
            partial.rename(rootfs)
    return rootfs


class Container:
    """One booted container; ``sh`` runs a command in all of its namespaces, as its root."""

    def __init__(self, rootfs: Path, debs: Path, log: Path):
        self.name = f"artemis-unit-{os.getpid()}"
        self.log = log
        with open(log, "wb") as out:
            self.nspawn = subprocess.Popen(
                ["systemd-nspawn", "--quiet", "--directory", str(rootfs), "--boot", "--volatile=overlay",
                 "--register=no", "--keep-unit", "--private-network", "--console=pipe",
                 f"--machine={self.name}", f"--bind-ro={debs}:{DEBS_INSIDE}"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        self.leader = 0

    def wait_booted(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.nspawn.poll() is not None:
                # The container never came up: this machine cannot run one (no user or PID
                # namespaces, no overlayfs, a seccomp wall...).  nspawn says which.
                pytest.skip(f"systemd-nspawn cannot boot a container here (exit {self.nspawn.returncode}): "
                            f"{self.log.read_text(errors='replace')[-1500:]}")
            if not self.leader:
                children = Path(f"/proc/{self.nspawn.pid}/task/{self.nspawn.pid}/children").read_text().split()
                self.leader = int(children[0]) if children else 0
            elif self.sh("systemctl", "is-system-running", check=False).stdout.strip() in ("running", "degraded"):
                return
            time.sleep(0.5)
        raise AssertionError(f"the container's systemd did not finish booting in {timeout_s} s:\n"
                             f"{self.sh('systemctl', '--failed', '--no-pager', check=False).stdout}")

    def sh(self, *argv: str, timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run("nsenter", f"--target={self.leader}", "--all", "--", *argv, timeout_s=timeout_s, check=check,
                   env={"PATH": CONTAINER_PATH, "LANG": "C.UTF-8"}, cwd="/")

    def power_off(self, timeout_s: float = 90) -> None:
        if self.nspawn.poll() is None and self.leader:
            self.sh("systemctl", "--no-block", "poweroff", check=False)
        try:
            self.nspawn.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # SIGTERM asks nspawn to shut the container down; SIGKILL takes its processes with it.
            self.nspawn.send_signal(signal.SIGTERM)
            try:
                self.nspawn.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.nspawn.kill()
                self.nspawn.wait(timeout=30)


@pytest.fixture(scope="module")
def container(packages: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:  # noqa: F811
    """The container, booted, with the controller .deb installed by dpkg (not started: --no-enable)."""
    if os.geteuid() != 0:
        pytest.skip("systemd-nspawn needs root")
    missing = [t for t in ("systemd-nspawn", "debootstrap", "nsenter") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} missing: scripts/bootstrap installs systemd-container and debootstrap")
    rootfs = cached_rootfs()
    debs = tmp_path_factory.mktemp("debs")
    shutil.copy(packages["controller.deb"], debs)
    box = Container(rootfs, debs, tmp_path_factory.mktemp("nspawn") / "console.log")
    try:
        box.wait_booted()
        box.sh("dpkg", "-i", f"{DEBS_INSIDE}/{packages['controller.deb'].name}", timeout_s=300)
        yield box
    finally:
        box.power_off()
    assert box.nspawn.returncode == 0, box.log.read_text(errors="replace")[-3000:]


def show(box: Container, *props: str, unit: str = UNIT) -> dict[str, str]:
    out = box.sh("systemctl", "show", unit, *(f"--property={p}" for p in props)).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait_unit(box: Container, want: dict[str, str], timeout_s: float = 90) -> dict[str, str]:
    """Polls the unit's properties until they have ``want``'s values; returns all of them."""
    props = ("ActiveState", "SubState", "MainPID", "NRestarts", "Result", "ExecMainStatus")
    deadline = time.monotonic() + timeout_s
    while True:
        state = show(box, *props, *want)
        if all(state.get(k) == v for k, v in want.items()):
            return state
        if time.monotonic() > deadline:
            journal = box.sh("journalctl", "-u", UNIT, "--no-pager", "-n", "40", check=False).stdout
            raise AssertionError(f"{UNIT} never reached {want}: {state}\n{journal}")
        time.sleep(0.5)


def health(box: Container, port: int = 7600, timeout_s: float = 60) -> dict:
    """GET /v1/health inside the container (its network is its own loopback), retried for ``timeout_s``."""
    script = (
        "import json, sys, time, urllib.request\n"
        f"deadline = time.monotonic() + {timeout_s}\n"
        "while True:\n"
        "    try:\n"
        f"        with urllib.request.urlopen('http://127.0.0.1:{port}/v1/health', timeout=5) as r:\n"
        "            print(json.dumps(json.load(r))); break\n"
        "    except OSError as err:\n"
        "        if time.monotonic() > deadline: sys.exit(f'no answer: {err}')\n"
        "        time.sleep(0.3)\n")
    return json.loads(box.sh("/opt/artemis/bin/python", "-c", script, timeout_s=timeout_s + 30).stdout)


def journal_since(box: Container, cursor: str) -> str:
    after = [f"--after-cursor={cursor}"] if cursor else []  # no cursor: the unit had not logged yet
    return box.sh("journalctl", "-u", UNIT, "--no-pager", "-o", "cat", *after).stdout


def journal_cursor(box: Container) -> str:
    # Exit 1 and "-- No entries --" when the unit has not logged yet.
    out = box.sh("journalctl", "-u", UNIT, "-n", "0", "--show-cursor", "--no-pager", check=False).stdout
    return out.rsplit("-- cursor: ", 1)[-1].strip() if "-- cursor: " in out else ""


def running(box: Container) -> dict[str, str]:
    """The daemon up (started here if an earlier test did not leave it running): its unit's properties."""
    # Type=notify: start returns once artemisd said READY=1, i.e. it listens and handles SIGHUP.
    box.sh("systemctl", "start", UNIT)
    return wait_unit(box, {"ActiveState": "active", "SubState": "running"})


def uid_of(box: Container, user: str) -> int:
    return int(box.sh("id", "-u", user).stdout)


def test_install_leaves_the_unit_stopped_and_the_files_private(container: Container) -> None:
    box = container
    assert box.sh("systemctl", "is-enabled", UNIT, check=False).stdout.strip() == "disabled"
    assert show(box, "ActiveState")["ActiveState"] == "inactive"
    # The user came from the package's sysusers.d file; its home is the state directory, no shell.
    entry = box.sh("getent", "passwd", "artemis").stdout.strip().split(":")
    assert (entry[5], entry[6]) == ("/var/lib/artemis", "/usr/sbin/nologin"), entry
    stat = box.sh("stat", "-c", "%U:%G %a", "/var/lib/artemis", "/etc/artemis/artemis.conf",
                  "/etc/default/artemisd").stdout.split("\n")
    assert stat[:3] == ["artemis:artemis 750", "root:root 644", "root:root 644"], stat


def test_start_serves_as_artemis_with_the_units_limits(container: Container) -> None:
    box = container
    box.sh("systemctl", "start", UNIT)
    state = wait_unit(box, {"ActiveState": "active", "SubState": "running"})
    reply = health(box)
    assert (reply["ok"], reply["version"], reply["role"]) == (True, VERSION, "leader"), reply
    pid = state["MainPID"]
    status = box.sh("cat", f"/proc/{pid}/status").stdout
    artemis = uid_of(box, "artemis")
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    assert uids == [str(artemis)] * 4, uids
    assert "NoNewPrivs:\t1" in status
    limits = box.sh("cat", f"/proc/{pid}/limits").stdout
    nofile = next(line.split()[3:5] for line in limits.splitlines() if line.startswith("Max open files"))
    assert nofile == ["8192", "8192"], limits
    # State the daemon wrote: its own, and (UMask=0027) unreadable to others.
    db = box.sh("stat", "-c", "%U:%G %a", "/var/lib/artemis/artemis.db").stdout.strip()
    assert db == "artemis:artemis 640", db
    # ProtectSystem=strict: the daemon's user cannot write its own config even if a mode allowed it.
    writable = box.sh("sh", "-c", f"test -w /proc/{pid}/root/etc/artemis && echo yes || echo no").stdout.strip()
    assert writable == "no"


def test_reload_rereads_the_config_in_the_same_process(container: Container) -> None:
    box = container
    # Reloaded the moment start returns: with Type=simple systemd said "active" before artemisd
    # handled SIGHUP, and a reload that early killed it (a clean exit to systemd: not restarted).
    box.sh("systemctl", "stop", UNIT)
    before = running(box)
    cursor = journal_cursor(box)
    box.sh("systemctl", "reload", UNIT)
    after = wait_unit(box, {"ActiveState": "active", "SubState": "running"})
    assert after["MainPID"] == before["MainPID"] and after["NRestarts"] == before["NRestarts"]
    deadline = time.monotonic() + 30
    while "config reloaded" not in journal_since(box, cursor):
        assert time.monotonic() < deadline, journal_since(box, cursor)
        time.sleep(0.5)
    assert health(box)["ok"] is True


def test_killed_daemon_is_restarted_by_systemd(container: Container) -> None:
    box = container
    before = running(box)
    box.sh("kill", "-9", before["MainPID"])
    # RestartSec=5s, then the daemon's start-up: generous on a loaded machine.
    restarts = str(int(before["NRestarts"]) + 1)
    after = wait_unit(box, {"ActiveState": "active", "SubState": "running", "NRestarts": restarts}, timeout_s=120)
    assert after["MainPID"] != before["MainPID"]
    assert health(box)["ok"] is True


def test_stop_ends_the_daemon_cleanly(container: Container) -> None:
    box = container
    pid = running(box)["MainPID"]
    box.sh("systemctl", "stop", UNIT, timeout_s=120)
    state = wait_unit(box, {"ActiveState": "inactive"})
    # SIGTERM is a clean stop for artemisd (exit 0), not a failure systemd would restart.
    assert (state["Result"], state["ExecMainStatus"]) == ("success", "0"), state
    assert box.sh("test", "-e", f"/proc/{pid}", check=False).returncode != 0


def test_password_file_readable_by_the_daemons_user_only(container: Container) -> None:
    """StatePasswordFile under the unit: 0600 and the daemon's own is read; wider, or another owner's, is refused.

    There is no PostgreSQL in the container: the check ends where the password has been read and the
    daemon connects.  The exit status 2 of a refused file must not be restarted (RestartPreventExitStatus).
    """
    box = container
    password = "/etc/artemis/state.password"
    dropin = "/etc/systemd/system/artemisd.service.d"
    box.sh("sh", "-c", f"printf 'not-a-real-secret\\n' > {password} && chown artemis:artemis {password} && "
                       f"chmod 600 {password}")
    # A database nobody answers for (port 9 on the container's own loopback): the password is read at start,
    # before the first connection, and the daemon then waits for its database instead of exiting.
    conf = "/etc/artemis/pg.conf"
    box.sh("sh", "-c", f"printf 'Include /etc/artemis/artemis.conf\\n"
                       f"StateURL=postgresql://artemis@127.0.0.1:9/artemis\\nStatePasswordFile={password}\\n' > {conf}"
                       f" && mkdir -p {dropin} && printf '[Service]\\nEnvironment=\"ARTEMISD_OPTS=--config {conf}\"\\n'"
                       f" > {dropin}/state.conf && systemctl daemon-reload")
    try:
        # Another local user cannot read it; the daemon's user can.
        assert box.sh("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "cat", password,
                      check=False).returncode != 0
        assert box.sh("setpriv", f"--reuid={uid_of(box, 'artemis')}", "--regid=artemis", "--init-groups",
                      "cat", password).stdout == "not-a-real-secret\n"

        for mode, owner, refusal in (("640", "artemis", "lets group or others read the password"),
                                     ("600", "root", "cannot read: Permission denied")):
            box.sh("sh", "-c", f"chown {owner}:artemis {password} && chmod {mode} {password}")
            cursor = journal_cursor(box)
            box.sh("systemctl", "start", UNIT, check=False)
            state = wait_unit(box, {"ActiveState": "failed"}, timeout_s=60)
            assert state["ExecMainStatus"] == str(CONFIG_ERROR_EXIT), state
            assert refusal in journal_since(box, cursor), journal_since(box, cursor)
            # A config error is not retried every RestartSec: it needs the admin, not a restart.
            time.sleep(7)
            assert show(box, "ActiveState", "NRestarts") == {"ActiveState": "failed", "NRestarts": "0"}
            box.sh("systemctl", "reset-failed", UNIT)

        # Its own 0600 file is read: the daemon gets as far as the database (there is none in the container,
        # and the first connection comes only after the password was read), never to a StatePasswordFile error.
        # Type=notify: never ready without its database, so the start itself fails (and is retried).
        box.sh("sh", "-c", f"chown artemis:artemis {password} && chmod 600 {password}")
        cursor = journal_cursor(box)
        box.sh("systemctl", "start", UNIT, check=False)
        deadline = time.monotonic() + 60
        while "port 9 failed" not in journal_since(box, cursor):
            assert time.monotonic() < deadline, journal_since(box, cursor)
            time.sleep(0.5)
        assert "StatePasswordFile" not in journal_since(box, cursor)
    finally:
        box.sh("sh", "-c", f"systemctl stop {UNIT}; systemctl reset-failed {UNIT}; rm -rf {dropin} {conf} "
                           f"{password}; systemctl daemon-reload", check=False)


def test_the_template_runs_several_instances_on_one_host(container: Container) -> None:
    """artemisd@HOST:PORT.service: two instances from the one artemis.conf, each its own unit and process
    on its own address, one leading and one standing by over the state they share (the SQLite file
    here: the container has no PostgreSQL)."""
    box = container
    box.sh("systemctl", "stop", UNIT)
    ports = (7611, 7612)
    units = [f"artemisd@127.0.0.1:{port}.service" for port in ports]
    try:
        for unit in units:
            box.sh("systemctl", "start", unit)  # Type=notify: returns once that instance listens
        replies = [health(box, port) for port in ports]
        assert sorted(reply["role"] for reply in replies) == ["leader", "standby"], replies
        leader = next(reply for reply in replies if reply["role"] == "leader")["leader"]["instance"]
        assert all(reply["leader"]["instance"] == leader for reply in replies), replies
        assert leader.endswith((":127.0.0.1:7611", ":127.0.0.1:7612")), leader
        states = [show(box, "ActiveState", "MainPID", "User", unit=unit) for unit in units]
        assert [state["ActiveState"] for state in states] == ["active", "active"], states
        assert states[0]["MainPID"] != states[1]["MainPID"] and {s["User"] for s in states} == {"artemis"}
        command = box.sh("cat", f"/proc/{states[1]['MainPID']}/cmdline").stdout.split("\0")
        assert command[-3:-1] == ["--listen", "127.0.0.1:7612"], command
    finally:
        box.sh("systemctl", "stop", *units, check=False)
