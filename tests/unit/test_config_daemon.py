"""artemis.conf daemon, mail and PartitionPolicy keys: values, defaults, errors with file:line:key."""

from __future__ import annotations

from pathlib import Path

import pytest

from artemisd.config import ConfigError, load_config, parse_config_text

EXAMPLE = Path(__file__).resolve().parents[2] / "packaging" / "artemis.conf.example"


def test_defaults_are_safe():
    config = parse_config_text("")
    d = config.daemon
    assert d.auth_type == "munge" and d.enabled and not d.dry_run and d.hard_action_evidence == "root"
    pol = config.policy_for("anything")
    assert pol.auto == ("rebalance", "escalate") and "drain" in pol.approve


def test_values_and_units():
    config = parse_config_text(
        'Listen=127.0.0.1:7000 AuthType=none AdminUids=1001,1002\n'
        'probemininterval=15m ProbeMaxPerHour=2 EvidenceMaxAge=1h\n'
        'MailRelay=smtp.example.org:25 MailTo="a@example.org, b@example.org"\n'
        'PartitionPolicy=gpu* Auto=correct,drain Approve=requeue MaxDrainFraction=0.05 Cooldown=30m\n')
    d = config.daemon
    assert d.admin_uids == (1001, 1002) and d.probe_min_interval == 900 and d.evidence_max_age == 3600
    assert config.mail.mail_to == ("a@example.org", "b@example.org")
    [pol] = config.policies
    assert pol.name == "gpu*" and pol.cooldown == 1800 and pol.approve == ("requeue",)


def test_auto_without_approve_leaves_the_rest_to_approval():
    [pol] = parse_config_text("PartitionPolicy=p Auto=drain\n").policies
    assert "drain" not in pol.approve and "requeue" in pol.approve


@pytest.mark.parametrize("text,key,line", [
    ("\nListen=0.0.0.0:7600 AuthType=none\n", "AuthType", 2),
    ("PartitionPolicy=x Auto=reboot\n", "Auto", 1),
    ("Listen=7600\n", "Listen", 1),
    ("\n\nPartitionPolicy=x MaxDrainFraction=2\n", "MaxDrainFraction", 3),
    ("PartitionPolicy=x Bogus=1\n", "Bogus", 1),
    ("PartitionPolicy=x Auto=drain Approve=drain\n", "Approve", 1),  # issue 27: not the block's opening key
    ("RetryBackoff=soon\n", "RetryBackoff", 1),
    ("MaxBodySize=lots\n", "MaxBodySize", 1),
    ("MaxBodySize=4M\nMaxBodyMemory=1M\n", "MaxBodyMemory", 2),
    ("MaxConnections=0\n", "MaxConnections", 1),
    ("MaxDrainFraction=0.1\n", "MaxDrainFraction", 1),  # a policy key outside a PartitionPolicy line
])
def test_errors_name_file_line_and_key(text, key, line):
    with pytest.raises(ConfigError) as err:
        parse_config_text(text, "site.conf")
    assert (err.value.file, err.value.line, err.value.key) == ("site.conf", line, key)


def test_policies_from_includes_keep_file_order(tmp_path):
    (tmp_path / "policy.d").mkdir()
    (tmp_path / "policy.d" / "10-gpu.conf").write_text("PartitionPolicy=gpu Auto=drain\n")
    (tmp_path / "policy.d" / "99-default.conf").write_text("PartitionPolicy=DEFAULT Auto=escalate\n")
    (tmp_path / "artemis.conf").write_text("DryRun=yes\nInclude policy.d/*.conf\n")
    config = load_config(tmp_path / "artemis.conf")
    assert [p.name for p in config.policies] == ["gpu", "DEFAULT"] and config.daemon.dry_run


def test_shipped_example_parses():
    config = load_config(EXAMPLE)
    assert config.policies


def test_transport_limits_and_sizes():
    d = parse_config_text("MaxBodySize=4M MaxBodyMemory=1G ReadTimeout=5s IdleTimeout=1m MaxConnections=64\n").daemon
    assert (d.max_body_size, d.max_body_memory) == (4 << 20, 1 << 30)
    assert (d.read_timeout, d.idle_timeout, d.max_connections) == (5.0, 60.0, 64)
    assert parse_config_text("MaxBodySize=65536\n").daemon.max_body_size == 65536
    assert parse_config_text("MaxBodySize=512KiB\n").daemon.max_body_size == 512 << 10


def test_the_unit_gives_the_default_connection_cap_its_files():
    from artemisd.transport import FD_RESERVE

    unit = (EXAMPLE.parent / "systemd" / "artemisd.service").read_text()
    [limit] = [int(line.split("=", 1)[1]) for line in unit.splitlines() if line.startswith("LimitNOFILE=")]
    assert limit >= parse_config_text("").daemon.max_connections + FD_RESERVE


@pytest.mark.parametrize("soft, hard, want, expect", [
    (1024, 20000, 4096, (4096, 4096 + 256)),  # soft raised towards the hard limit
    (1024, 1024, 4096, (1024 - 256, 1024)),   # cannot: the cap shrinks below the limit
    (8192, 8192, 4096, (4096, 8192)),         # fits already: nothing changes
])
def test_connection_cap_is_fitted_to_the_open_file_limit(soft, hard, want, expect):
    import resource
    import subprocess
    import sys

    # In a child: the test must not change this process's own limits.
    code = f"from artemisd.transport import fit_connections_to_fd_limit as f; print(*f({want}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    assert tuple(int(x) for x in done.stdout.split()) == expect
