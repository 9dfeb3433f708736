"""The packages as a site gets them: built, inspected, installed here, used, removed.

``packaging/build-packages --fast`` builds the .deb and .rpm pairs once per
module (about a CPU-minute: the controller's venv and bytecode; gzip -1 instead
of xz is the only difference from a release build).  The contents are checked
with ``dpkg-deb`` and ``rpm -qp``, the .debs with lintian, and then — as root —
the .debs are installed on this machine with dpkg, smoke-tested (the commands,
the daemon as the unit's user with its state directory, the node programs, the
SPANK plugin loaded by a real sbatch in a one-node test cluster) and purged, so
the machine is left as it was.  Nothing here dials anything but 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
CONTROLLER, NODE = "artemis-hpc-controller", "artemis-hpc-node"
VENV = "/opt/artemis"
PYLIB = "/usr/lib/artemis/python"
AUTOLOAD = f"{PYLIB}/torch_hook/autoload"

pytestmark = [pytest.mark.packaging, pytest.mark.timeout(1500)]


def run(*argv: str | Path, timeout_s: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout_s, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))} exited {proc.returncode}:\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def slurm_major() -> str:
    return run(REPO / "packaging" / "slurm-major").stdout.strip()


def deb_paths(deb: Path) -> dict[str, str]:
    """Installed path -> dpkg-deb's listing line (mode, owner, link target)."""
    paths = {}
    for line in run("dpkg-deb", "-c", deb).stdout.splitlines():
        name = line.split(None, 5)[5].split(" -> ")[0]
        paths["/" + name.removeprefix("./").rstrip("/")] = line
    return paths


def rpm_query(rpm: Path, *args: str) -> list[str]:
    return run("rpm", "-qp", *args, rpm).stdout.splitlines()


def deb_field(deb: Path, field: str) -> str:
    return run("dpkg-deb", "-f", deb, field).stdout.strip()


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    missing = [t for t in ("dpkg-buildpackage", "dh", "rpmbuild", "gcc") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"packaging tools missing ({', '.join(missing)}): scripts/bootstrap installs them")
    if not Path("/usr/include/slurm/slurm_version.h").exists():
        pytest.skip("no Slurm headers (libslurm-dev) to build the SPANK plugin against")
    out = tmp_path_factory.mktemp("packages")
    run(REPO / "packaging" / "build-packages", "--fast", out, timeout_s=1200)

    def one(pattern: str) -> Path:
        found = sorted(out.glob(pattern))
        assert len(found) == 1, f"{pattern}: {found}"
        return found[0]

    return {
        "controller.deb": one(f"{CONTROLLER}_*.deb"), "node.deb": one(f"{NODE}_*.deb"),
        "controller.rpm": one(f"{CONTROLLER}-[0-9]*.rpm"), "node.rpm": one(f"{NODE}-[0-9]*.rpm"),
        "source": one("artemis-hpc-*.tar.gz"),
    }


# -- what the packages carry ---------------------------------------------------


def test_versions_come_from_pyproject_and_node_names_its_slurm_major(packages: dict[str, Path]) -> None:
    major = slurm_major()
    assert deb_field(packages["controller.deb"], "Version") == f"{VERSION}-1"
    assert deb_field(packages["node.deb"], "Version") == f"{VERSION}-1+slurm{major}"
    assert rpm_query(packages["controller.rpm"], "--qf", "%{VERSION}-%{RELEASE}") == [f"{VERSION}-1"]
    assert rpm_query(packages["node.rpm"], "--qf", "%{VERSION}-%{RELEASE}") == \
        [f"{VERSION}-1.slurm{major.replace('.', '')}"]
    # The plugin loads only into the major it was built for: both formats pin it.
    depends = deb_field(packages["node.deb"], "Depends")
    assert f"slurm-wlm-basic-plugins (>= {major}~)" in depends
    assert re.search(r"slurm-wlm-basic-plugins \(<< \d+\.\d+~\)", depends), depends
    assert any(r.startswith(f"(slurm >= {major} with slurm < ")
               for r in rpm_query(packages["node.rpm"], "--requires")), rpm_query(packages["node.rpm"], "--requires")
    # The source tarball carries the spec with its version filled in (rpmbuild -ta).
    listing = run("tar", "-xOzf", packages["source"], f"artemis-hpc-{VERSION}/packaging/rpm/artemis.spec").stdout
    assert f"%global artemis_version {VERSION}\n" in listing


def test_controller_deb_layout(packages: dict[str, Path]) -> None:
    deb = packages["controller.deb"]
    paths = deb_paths(deb)
    for path in (f"{VENV}/bin/artemisd", f"{VENV}/bin/artemis", f"{VENV}/pyvenv.cfg",
                 "/etc/artemis/artemis.conf", "/etc/default/artemisd",
                 "/lib/systemd/system/artemisd.service", "/lib/systemd/system/artemisd@.service",
                 "/usr/lib/sysusers.d/artemis-hpc.conf",
                 "/var/lib/artemis"):
        assert path in paths, path
    # Debian compresses documentation over 4 kB.
    assert f"/usr/share/doc/{CONTROLLER}/admin-guide.md.gz" in paths
    assert paths["/usr/sbin/artemisd"].endswith(f"-> {VENV}/bin/artemisd")
    assert paths["/usr/bin/artemis"].endswith(f"-> {VENV}/bin/artemis")
    conffiles = run("dpkg-deb", "--info", deb, "conffiles").stdout.split()
    assert sorted(conffiles) == ["/etc/artemis/artemis.conf", "/etc/default/artemisd"]
    site = f"{VENV}/lib/python3.11/site-packages"
    assert f"{site}/pydantic" in paths and f"{site}/artemisd/server.py" in paths
    # Never torch (the probe uses the job's own), and no pip to install into a package-owned tree.
    assert not any(p.startswith((f"{site}/torch/", f"{site}/pip/")) for p in paths)
    # Python's own (not a pyenv's or conda's): the symlink is what targets have.
    assert paths[f"{VENV}/bin/python3.11"].endswith("-> /usr/bin/python3.11")
    # Built without leaving the build root's path anywhere (build-venv checks the
    # staged tree; this checks the shipped file).
    data = run("sh", "-c", f"dpkg-deb --fsys-tarfile {deb} | tar -xOf - ./opt/artemis/bin/artemisd "
                           f"./opt/artemis/pyvenv.cfg").stdout
    assert data.startswith(f"#!{VENV}/bin/python\n"), data[:80]
    assert "artemis-pkg." not in data and "debian/" not in data, data


def test_node_deb_layout_leaves_the_plugin_disabled(packages: dict[str, Path]) -> None:
    deb = packages["node.deb"]
    paths = deb_paths(deb)
    plugindir = "/usr/lib/" + run("dpkg-architecture", "-qDEB_HOST_MULTIARCH").stdout.strip() + "/slurm-wlm"
    for path in (f"{plugindir}/spank_artemis.so", "/etc/artemis/plugstack.conf", "/etc/artemis/node.conf",
                 f"{AUTOLOAD}/sitecustomize.py", f"{PYLIB}/torch_hook/telemetry/__init__.py",
                 "/usr/lib/artemis/node/artemis_node.py"):
        assert path in paths, path
    for program in ("artemis-prolog", "artemis-epilog", "artemis-nodecheck"):
        assert paths[f"/usr/libexec/artemis/{program}"].endswith(f"-> ../../lib/artemis/node/{program}")
        assert paths[f"/usr/lib/artemis/node/{program}"].startswith("-rwxr-xr-x")
    # pyxis practice: nothing in Slurm's own config; the admin links the snippet.
    assert not any(p.startswith("/etc/slurm") for p in paths)
    # torch_hook travels as source for whatever Python the job runs.
    assert not any(p.endswith(".pyc") or "__pycache__" in p for p in paths)
    assert sorted(run("dpkg-deb", "--info", deb, "conffiles").stdout.split()) == \
        ["/etc/artemis/node.conf", "/etc/artemis/plugstack.conf"]
    snippet = run("sh", "-c", f"dpkg-deb --fsys-tarfile {deb} | tar -xOf - ./etc/artemis/plugstack.conf").stdout
    active = [line for line in snippet.splitlines() if line and not line.startswith("#")]
    assert active == [f"optional {plugindir}/spank_artemis.so endpoint=http://artemisd.example.org:7600 "
                      f"default=off window_steps=50 autoload={AUTOLOAD}"]


def test_rpms_carry_the_same_files_as_the_debs(packages: dict[str, Path]) -> None:
    """One file list (packaging/install-files) for both formats; only distribution paths differ."""
    rename = {"/etc/sysconfig/artemisd": "/etc/default/artemisd",
              "/usr/lib/systemd/system/": "/lib/systemd/system/",
              "/usr/lib64/slurm/": "/usr/lib/x86_64-linux-gnu/slurm-wlm/"}

    def normal(path: str) -> str | None:
        # The formats name doc directories differently; lintian overrides are Debian's own.
        if path in ("/", "/usr/share") or path.startswith(("/usr/share/doc", "/usr/share/lintian")):
            return None
        for old, new in rename.items():
            path = path.replace(old, new)
        return path

    for part in ("controller", "node"):
        deb = {p for p in deb_paths(packages[f"{part}.deb"]) if normal(p)}
        rpm = {normal(p) for p in rpm_query(packages[f"{part}.rpm"], "--list") if normal(p)}
        # dpkg-deb lists parent directories the RPM does not own (/usr, /etc, ...).
        only_deb = {p for p in deb - rpm if not any(q.startswith(p + "/") for q in rpm)}
        assert not only_deb and not (rpm - deb), (part, sorted(only_deb)[:10], sorted(rpm - deb)[:10])
    configs = rpm_query(packages["controller.rpm"], "--configfiles") + rpm_query(packages["node.rpm"], "--configfiles")
    assert sorted(configs) == ["/etc/artemis/artemis.conf", "/etc/artemis/node.conf",
                               "/etc/artemis/plugstack.conf", "/etc/sysconfig/artemisd"]
    # %config(noreplace): a site's edits survive upgrades.
    flags = rpm_query(packages["controller.rpm"], "--qf", "[%{FILENAMES} %{FILEFLAGS:fflags}\n]")
    assert "/etc/artemis/artemis.conf cn" in flags
    modes = rpm_query(packages["controller.rpm"], "--qf", "[%{FILENAMES} %{FILEMODES:perms} %{FILEUSERNAME}\n]")
    assert "/var/lib/artemis drwxr-x--- artemis" in modes
    scripts = "\n".join(rpm_query(packages["controller.rpm"], "--scripts"))
    assert "useradd -r -g artemis" in scripts and "preset artemisd.service" in scripts


def test_lintian_finds_no_errors(packages: dict[str, Path]) -> None:
    if shutil.which("lintian") is None:
        pytest.skip("lintian not installed")
    proc = run("lintian", "--fail-on", "error", packages["controller.deb"], packages["node.deb"],
               timeout_s=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- installed on this machine ---------------------------------------------------


def installed_version(package: str) -> str | None:
    proc = run("dpkg-query", "-W", "-f=${Status} ${Version}", package, check=False)
    return proc.stdout.split()[-1] if "install ok installed" in proc.stdout else None


@pytest.fixture(scope="module")
def installed(packages: dict[str, Path]) -> Iterator[None]:
    """Both .debs installed with dpkg; purged afterwards, with the user the install created."""
    if os.geteuid() != 0:
        pytest.skip("installing packages needs root")
    present = [p for p in (CONTROLLER, NODE) if installed_version(p)]
    if present:
        pytest.skip(f"{', '.join(present)} already installed here; not touching a real installation")
    had_user = run("getent", "passwd", "artemis", check=False).returncode == 0
    had_state = Path("/var/lib/artemis").exists()
    try:
        run("dpkg", "-i", packages["controller.deb"], packages["node.deb"], timeout_s=300)
        yield
    finally:
        run("dpkg", "--purge", CONTROLLER, NODE, timeout_s=300, check=False)
        if not had_user:
            run("userdel", "artemis", check=False)
            run("groupdel", "artemis", check=False)
        if not had_state:
            shutil.rmtree("/var/lib/artemis", ignore_errors=True)
    for path in (VENV, "/usr/lib/artemis", "/usr/libexec/artemis", "/etc/artemis"):
        assert not os.path.lexists(path), f"{path} left behind by the purge"


def test_installed_commands_and_config(installed: None) -> None:
    # By full path: the test may run with a development venv first on PATH.
    assert run("/usr/sbin/artemisd", "--version").stdout.strip() == f"artemisd {VERSION}"
    assert run("/usr/bin/artemis", "--version").stdout.strip() == f"artemis {VERSION}"
    check = run("/usr/bin/artemis", "config", "check", "/etc/artemis/artemis.conf")
    assert "/etc/artemis/artemis.conf: OK" in check.stdout
    # The unit as systemd would load it (syntax, the ExecStart binary, the user).
    run("systemd-analyze", "verify", "/lib/systemd/system/artemisd.service")
    run("systemd-analyze", "verify", "/lib/systemd/system/artemisd@.service")
    # StateURL=postgresql://... works from the package alone: psycopg with its own libpq.
    libpq = run("/opt/artemis/bin/python", "-c", "import psycopg; print(psycopg.pq.version())").stdout
    assert int(libpq) >= 140000
    assert run("getent", "passwd", "artemis").stdout.split(":")[5] == "/var/lib/artemis"
    state = Path("/var/lib/artemis").stat()
    assert (state.st_mode & 0o777, state.st_uid) == (0o750, int(run("id", "-u", "artemis").stdout))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unit_setting(key: str) -> list[str]:
    unit = Path("/lib/systemd/system/artemisd.service").read_text()
    return re.findall(rf"^{key}=(.*)$", unit, flags=re.MULTILINE)


def test_installed_daemon_serves_as_its_own_user_and_reloads(installed: None) -> None:
    """artemisd from the package, as the unit runs it: user artemis, state in /var/lib/artemis, SIGHUP."""
    assert unit_setting("User") == ["artemis"] and unit_setting("ExecReload") == ["/bin/kill -HUP $MAINPID"]
    port = free_port()
    confdir = Path(tempfile.mkdtemp(prefix="artemis-pkgtest-"))
    confdir.chmod(0o755)
    conf = confdir / "artemis.conf"
    conf.write_text(f"Include /etc/artemis/artemis.conf\nListen=127.0.0.1:{port}\nAuthType=none\n")
    conf.chmod(0o644)
    log = confdir / "artemisd.log"
    with open(log, "wb") as out:
        daemon = subprocess.Popen(["runuser", "-u", "artemis", "--", "/usr/sbin/artemisd", "--config", str(conf)],
                                  stdout=out, stderr=subprocess.STDOUT, cwd="/var/lib/artemis")
    try:
        health = wait_health(port, daemon, log)
        assert (health["ok"], health["version"], health["role"]) == (True, VERSION, "leader")  # alone: it leads
        db = Path("/var/lib/artemis/artemis.db")
        assert db.stat().st_uid == int(run("id", "-u", "artemis").stdout)
        # What `systemctl reload artemisd` sends: the daemon re-reads and keeps serving.
        os.kill(daemon.pid, signal.SIGHUP)
        assert _steady(wait_health(port, daemon, log)) == _steady(health)
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=10)
        shutil.rmtree(confdir, ignore_errors=True)


def _steady(health: dict) -> dict:
    """The health answer without the lease's ages, which move on between two calls."""
    leader = {k: v for k, v in (health.get("leader") or {}).items() if k not in ("held_s", "renewed_s_ago")}
    return {**health, "leader": leader}


def wait_health(port: int, daemon: subprocess.Popen, log: Path, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise AssertionError(f"artemisd exited {daemon.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health", timeout=5) as reply:
                return json.load(reply)
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"artemisd did not answer on 127.0.0.1:{port}:\n{log.read_text()[-3000:]}")


def test_installed_node_programs_never_fail(installed: None, tmp_path: Path) -> None:
    """The Prolog with no daemon configured exits 0, and finds the probe's telemetry through its link."""
    conf = tmp_path / "node.conf"
    conf.write_text("TimeoutSeconds=5\nTelemetry=none\n")  # no Endpoint: report nothing
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "ARTEMIS_NODE_CONF": str(conf),
           "SLURM_JOB_ID": "1", "SLURMD_NODENAME": "n1", "SPANK_ARTEMIS": "on"}
    for program in ("artemis-prolog", "artemis-epilog"):
        assert run(f"/usr/libexec/artemis/{program}", env=env, cwd="/").returncode == 0
    probe = run("/usr/bin/python3", "-c",
                "import sys; sys.path.insert(0, '/usr/lib/artemis/node'); import artemis_node; "
                "print(artemis_node.import_telemetry().__file__)", env=env, cwd="/")
    assert probe.stdout.strip() == "/usr/lib/artemis/node/torch_hook/telemetry/__init__.py"


def test_installed_spank_plugin_loads_in_a_real_sbatch(installed: None) -> None:
    """The admin's one step — link the snippet into plugstack.conf.d — and sbatch --artemis=on works."""
    from tests.cluster.slurm import SlurmCluster

    with SlurmCluster(nodes=1, network="loopback", artemis=False) as cluster:
        (cluster.conf.parent / "plugstack.conf.d" / "artemis.conf").symlink_to("/etc/artemis/plugstack.conf")
        assert "--artemis" in run("sbatch", "--help", env=cluster.env).stdout
        out = cluster.dir / "jobs"
        script = ("#!/bin/sh\nenv | grep -E '^(ARTEMIS_|PYTHONPATH=)' | sort\n"
                  "srun python3 -c 'import importlib.util as u; s = u.find_spec(\"sitecustomize\"); "
                  "print(\"sitecustomize\", s and s.origin)'\n")
        on = cluster.sbatch(script, "--artemis=on", f"--output={out}/on.out")
        off = cluster.sbatch(script, f"--output={out}/off.out")
        # The user guide's other spelling: the option as a batch script directive.
        directive = cluster.sbatch(script.replace("\n", "\n#SBATCH --artemis=on\n", 1),
                                   f"--output={out}/directive.out")
        for job in (on, off, directive):
            assert cluster.wait_job(job) == "COMPLETED", (job, cluster.job(job))
        lines = (out / "on.out").read_text().splitlines()
        assert f"ARTEMIS_JOB_ID={on}" in lines, lines
        assert (out / "directive.out").read_text().splitlines() == \
            [f"ARTEMIS_JOB_ID={directive}" if line == f"ARTEMIS_JOB_ID={on}" else line for line in lines]
        assert "ARTEMIS_ENABLED=1" in lines, lines
        assert "ARTEMIS_ENDPOINT=http://artemisd.example.org:7600" in lines, lines
        assert "ARTEMIS_WINDOW_STEPS=50" in lines, lines
        assert any(line.startswith(f"PYTHONPATH={AUTOLOAD}") for line in lines), lines
        assert f"sitecustomize {AUTOLOAD}/sitecustomize.py" in lines, lines
        assert not any(line.startswith("ARTEMIS_") for line in (out / "off.out").read_text().splitlines())
