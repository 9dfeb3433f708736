"""Issue 27, findings 7 and 8: what artemisd refuses to start from.

7. artemisd read an artemis.conf that anyone could write (mode 0666, or in a
   directory anyone could write, or owned by another user): whoever can change
   the file chooses AuthType, Listen, the policy and the mail relay of a daemon
   that drains nodes.  munged and slurmctld refuse such files; artemisd now
   does too, at start and at SIGHUP (the running config stays).  The ``artemis``
   command only reads and is not refused.
8. ``AuthType=none`` (every caller trusted as root) was allowed with a Listen
   that only *looked* loopback (``127.example.org``, ``localhost``: a name
   resolves anywhere), and its refusal blamed the section's last key given
   (``StateDir``) instead of AuthType; every cross-key error now names its key.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from artemisd.cli import main as artemis
from artemisd.conf_syntax import check_config_file_secure
from artemisd.config import ConfigError, load_config, parse_config_text
from tests.unit.test_cli_admin import Artemisd

NOBODY = pwd.getpwnam("nobody")
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to give a file to another user)")


def conf_in(directory: Path, text: str = "DryRun=yes\n", mode: int = 0o644, dir_mode: int = 0o755) -> Path:
    directory.mkdir(exist_ok=True)
    directory.chmod(dir_mode)
    path = directory / "artemis.conf"
    path.write_text(text)
    path.chmod(mode)
    return path


# --- finding 7: who may have written the file ----------------------------------------------

@pytest.mark.parametrize("mode", [0o666, 0o664, 0o646, 0o660, 0o606, 0o620, 0o602, 0o777])
def test_a_file_group_or_others_may_write_is_refused(tmp_path, mode, capsys):
    conf = conf_in(tmp_path / "etc", mode=mode)
    with pytest.raises(ConfigError) as err:
        load_config(conf, secure=True)
    assert err.value.file == str(conf) and f"mode {mode:04o}" in str(err.value)
    assert str(err.value).startswith(f"{conf}: ")
    # The artemis command only reads the file: it is not refused.
    assert load_config(conf).daemon.dry_run
    assert artemis(["config", "check", str(conf)]) == 0 and f"{conf}: OK" in capsys.readouterr().out


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o600, 0o444, 0o400, 0o755])
def test_a_file_only_its_owner_may_write_is_read(tmp_path, mode):
    assert load_config(conf_in(tmp_path / "etc", mode=mode), secure=True).daemon.dry_run


@pytest.mark.parametrize("dir_mode", [0o777, 0o775, 0o757, 0o770, 0o730])
def test_a_directory_others_may_write_without_the_sticky_bit_is_refused(tmp_path, dir_mode):
    """Anyone who may write the directory may rename the file away and put their own in its place."""
    conf = conf_in(tmp_path / "etc", dir_mode=dir_mode)
    with pytest.raises(ConfigError) as err:
        load_config(conf, secure=True)
    assert err.value.file == str(conf)
    assert f"{conf.parent} (mode {dir_mode:04o})" in str(err.value)
    conf.parent.chmod(dir_mode | 0o1000)  # sticky, as /tmp: only the file's owner may replace it
    assert load_config(conf, secure=True).daemon.dry_run


@ROOT_ONLY
def test_a_file_owned_by_another_user_is_refused(tmp_path):
    conf = conf_in(tmp_path / "etc", mode=0o600)
    os.chown(conf, NOBODY.pw_uid, NOBODY.pw_gid)
    with pytest.raises(ConfigError) as err:
        load_config(conf, secure=True)
    assert err.value.file == str(conf) and f"uid {NOBODY.pw_uid}" in str(err.value)
    # The daemon's own user may own it (artemisd runs as artemis, or as SlurmUser).
    check_config_file_secure(conf, euid=NOBODY.pw_uid)
    os.chown(conf, 0, 0)
    check_config_file_secure(conf, euid=NOBODY.pw_uid)  # root always may
    os.chown(conf.parent, NOBODY.pw_uid, NOBODY.pw_gid)  # ... and whoever owns the directory may replace it
    with pytest.raises(ConfigError, match=f"{conf.parent} is owned by uid {NOBODY.pw_uid}"):
        check_config_file_secure(conf, euid=0)


def test_an_owner_that_is_neither_root_nor_the_daemon_is_refused(tmp_path):
    """The same rule without root: the file is ours, the daemon (euid) someone else."""
    conf = conf_in(tmp_path / "etc", mode=0o644)
    if os.geteuid() == 0:
        pytest.skip("a file root owns is always accepted")
    with pytest.raises(ConfigError, match=f"owned by uid {os.geteuid()}"):
        check_config_file_secure(conf, euid=os.geteuid() + 1)


def test_an_included_file_is_held_to_the_same_rule(tmp_path):
    conf = conf_in(tmp_path / "etc", text="DryRun=yes\nInclude policy.d/*.conf\n")
    (conf.parent / "policy.d").mkdir(mode=0o755)
    policy = conf.parent / "policy.d" / "10-gpu.conf"
    policy.write_text("PartitionPolicy=gpu Auto=drain\n")
    policy.chmod(0o666)
    with pytest.raises(ConfigError) as err:
        load_config(conf, secure=True)
    assert err.value.file == str(policy) and "mode 0666" in str(err.value)
    policy.chmod(0o644)
    (conf.parent / "policy.d").chmod(0o777)
    with pytest.raises(ConfigError, match="policy.d \\(mode 0777\\)"):
        load_config(conf, secure=True)
    (conf.parent / "policy.d").chmod(0o755)
    assert [p.name for p in load_config(conf, secure=True).policies] == ["gpu"]


def test_a_link_is_judged_by_the_file_it_reaches_and_both_directories(tmp_path):
    open_dir = tmp_path / "open"
    target = conf_in(open_dir, dir_mode=0o777)
    link = tmp_path / "etc" / "artemis.conf"
    link.parent.mkdir(mode=0o755)
    link.symlink_to(target)
    with pytest.raises(ConfigError, match=f"{open_dir} \\(mode 0777\\)"):
        load_config(link, secure=True)
    open_dir.chmod(0o755)
    target.chmod(0o666)
    with pytest.raises(ConfigError, match="mode 0666"):
        load_config(link, secure=True)
    target.chmod(0o644)
    assert load_config(link, secure=True).daemon.dry_run
    link.parent.chmod(0o777)  # the link itself can be replaced
    with pytest.raises(ConfigError, match=f"{link.parent} \\(mode 0777\\)"):
        load_config(link, secure=True)


def test_artemisd_does_not_start_from_a_file_others_may_write(tmp_path):
    conf = conf_in(tmp_path / "etc", text=f"Listen=127.0.0.1:7600\nAuthType=none\nStateDir={tmp_path}/state\n",
                   mode=0o666)
    done = subprocess.run([sys.executable, "-m", "artemisd.server", "--config", str(conf)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"artemisd: {conf}: mode 0666") and not (tmp_path / "state").exists()


def test_sighup_keeps_the_running_config_when_the_file_became_writable(tmp_path):
    d = Artemisd(tmp_path).start()
    try:
        good = d.conf.read_text()
        d.conf.write_text(good + "DryRun=yes\n")
        d.conf.chmod(0o666)
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while "config reload failed" not in d.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        [logged] = [json.loads(x) for x in d.log.read_text().splitlines() if "config reload failed" in x]
        assert logged["file"] == str(d.conf) and "mode 0666" in logged["error"]
        assert d.get("/v1/status")["dry_run"] is False
        # The artemis command still reads it (for Listen): reading is not trusting.
        assert artemis(["status", "--config", str(d.conf)]) == 0
        d.conf.chmod(0o644)
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while not d.get("/v1/status")["dry_run"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert d.get("/v1/status")["dry_run"] is True
    finally:
        d.stop()


# --- finding 8: AuthType=none, and which key a cross-key error names ---------------------

@pytest.mark.parametrize("listen", ["0.0.0.0:7600", "10.0.0.5:7600", "127.example.org:7600", "localhost:7600",
                                    "127.0.0.1.nip.io:7600", "127.1:7600", "[::]:7600", "[::ffff:127.0.0.1]:7600",
                                    "[fe80::1]:7600", "[::2]:7600", "128.0.0.1:7600"])
def test_auth_none_needs_a_literal_loopback_address(listen):
    text = f"Listen={listen}\nAuthType=none\nStateDir=/var/lib/artemis\n"
    with pytest.raises(ConfigError) as err:
        parse_config_text(text, "site.conf")
    # Before: "site.conf:3: StateDir: bad value '/var/lib/artemis': ...", the section's last key given.
    assert (err.value.file, err.value.line, err.value.key) == ("site.conf", 2, "AuthType")
    assert listen in str(err.value) and "Listen" in str(err.value)


@pytest.mark.parametrize("listen", ["127.0.0.1:7600", "127.8.9.10:7600", "127.255.255.254:1", "[::1]:7600"])
def test_auth_none_with_a_loopback_address(listen):
    assert parse_config_text(f"Listen={listen}\nAuthType=none\n").daemon.auth_type == "none"


@pytest.mark.parametrize("text,key,line", [
    ("Listen=0.0.0.0:7600\nAuthType=none\nStateDir=/x\n", "AuthType", 2),
    ("AuthType=none\nListen=0.0.0.0:7600\nDryRun=yes\n", "AuthType", 1),
    ("MaxBodyMemory=1M\nMaxBodySize=4M\nDryRun=yes\n", "MaxBodyMemory", 1),
    ("MaxBodySize=128M\nDryRun=yes\n", "MaxBodySize", 1),  # over the default MaxBodyMemory
    ("StateURL=mysql://h/db\nDryRun=yes\n", "StateURL", 1),
    ("StateURL=postgresql://artemis:hunter2@h/db\nStateDir=/x\n", "StateURL", 1),
    ("StateURL=postgresql://h/db?password=hunter2\nStateDir=/x\n", "StateURL", 1),
    ("StatePasswordFile=/etc/artemis/pw\nStateDir=/x\n", "StatePasswordFile", 1),
    ("PartitionPolicy=x Approve=drain Auto=drain,escalate Cooldown=1m\n", "Approve", 1),
])
def test_cross_key_errors_name_their_key_and_line(text, key, line):
    with pytest.raises(ConfigError) as err:
        parse_config_text(text, "site.conf")
    assert (err.value.file, err.value.line, err.value.key) == ("site.conf", line, key)
    assert "hunter2" not in str(err.value)


def test_a_cross_key_error_names_the_file_the_key_is_in(tmp_path):
    (tmp_path / "auth.conf").write_text("# loopback tests only\nAuthType=none\n")
    conf = tmp_path / "artemis.conf"
    conf.write_text("Include auth.conf\nListen=0.0.0.0:7600\nStateDir=/x\n")
    with pytest.raises(ConfigError) as err:
        load_config(conf)
    assert (err.value.file, err.value.line, err.value.key) == (str(tmp_path / "auth.conf"), 2, "AuthType")
    # Listen given as an option (artemisd --listen): the file's AuthType is still the key named.
    conf.write_text("Include auth.conf\nStateDir=/x\n")
    with pytest.raises(ConfigError) as err:
        load_config(conf, [("Listen", "10.0.0.5:7600")])
    assert (err.value.file, err.value.line, err.value.key) == (str(tmp_path / "auth.conf"), 2, "AuthType")
    assert "10.0.0.5:7600" in str(err.value)


def test_every_cross_key_check_names_its_keys():
    """A model-level check raising a bare ValueError has no key: pydantic gives it no location.
    Every ``mode="after"`` validator of artemisd/config.py must raise CrossKeyError with its fields."""
    import ast

    import artemisd.config as config

    tree = ast.parse(Path(config.__file__).read_text())
    checks = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
              and any("model_validator" in ast.unparse(d) and "after" in ast.unparse(d) for d in f.decorator_list)]
    assert len(checks) >= 4
    for check in checks:
        for node in ast.walk(check):
            if isinstance(node, ast.Raise):
                assert isinstance(node.exc, ast.Call) and ast.unparse(node.exc.func) == "CrossKeyError", \
                    f"{check.name}: {ast.unparse(node)}"
                fields = [a.value for a in node.exc.args[1:] if isinstance(a, ast.Constant)]
                assert fields and all(any(f in model.model_fields for model in (
                    *config.SECTIONS.values(), config.PartitionPolicy)) for f in fields), (check.name, fields)
