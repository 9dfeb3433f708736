"""Host telemetry: CPU-quota throttling of the rank's cgroup, from recorded files."""

import pytest

from torch_hook.telemetry import host
from torch_hook.telemetry.host import HostCounters, host_block, parse_cpu_stat_periods

V1_STAT = "nr_periods 1200\nnr_throttled 900\nthrottled_time 6500000000\nnr_bursts 0\nburst_time 0\n"
V2_STAT = "usage_usec 9000000\nuser_usec 8000000\nsystem_usec 1000000\nnr_periods 100\nnr_throttled 40\n" \
          "throttled_usec 2500000\n"


def test_quota_periods_from_v1_and_v2_cpu_stat():
    assert parse_cpu_stat_periods(V1_STAT) == (1200, 900)
    assert parse_cpu_stat_periods(V2_STAT) == (100, 40)
    assert parse_cpu_stat_periods("usage_usec 1\n") is None


def test_cpu_stat_path_follows_the_cpu_controller(tmp_path, monkeypatch):
    made = []
    monkeypatch.setattr(host.os.path, "exists", lambda p: p in made)
    made.append("/sys/fs/cgroup/cpu,cpuacct/slurm/uid_0/job_7/cpu.stat")
    v1 = "9:name=systemd:/\n3:cpu,cpuacct:/slurm/uid_0/job_7\n2:memory:/x\n0::/\n"
    assert host.cgroup_cpu_stat_path(v1) == made[0]
    made[:] = ["/sys/fs/cgroup/cpu/artemis-test/n2/cpu.stat"]
    assert host.cgroup_cpu_stat_path("1:cpu:/artemis-test/n2\n2:cpuacct:/artemis-test/n2\n") == made[0]
    made[:] = ["/sys/fs/cgroup/system.slice/slurmstepd.scope/cpu.stat"]
    assert host.cgroup_cpu_stat_path("0::/system.slice/slurmstepd.scope\n") == made[0]
    made[:] = []
    assert host.cgroup_cpu_stat_path("0::/gone\n") is None


def test_throttled_share_of_the_window():
    before = HostCounters(wall_s=100.0, cgroup_periods=1200, cgroup_throttled_periods=900)
    after = HostCounters(wall_s=110.0, cgroup_periods=2200, cgroup_throttled_periods=1150)
    assert host_block(before, after)["cpu_throttled_pct"] == pytest.approx(25.0)
    assert "cpu_throttled_pct" not in host_block(HostCounters(wall_s=1.0), HostCounters(wall_s=2.0))
