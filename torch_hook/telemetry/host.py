"""Host telemetry: this process's CPU use and preemption, how long its threads
waited for a CPU, how often its cgroup's CPU quota held it back, the node's
steal and iowait, and the node's TCP retransmits.

Counters are cumulative; ``HostSampler.sample`` returns rates over the time
since its previous call (one window).  ``psutil`` is used when importable;
otherwise, on Linux, the same counters are read from ``/proc``.  TCP
``RetransSegs`` always comes from ``/proc/net/snmp`` (psutil has no such
counter).  ``read_counters`` gathers, ``host_block`` computes: the latter is a
pure function tested with recorded counters.
"""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass
from typing import Any

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class HostCounters:
    """Cumulative counters at one instant (``None`` = not available here)."""

    wall_s: float
    proc_cpu_s: float | None = None
    ctx_invol: int | None = None
    cpu_total_s: float | None = None
    cpu_steal_s: float | None = None
    cpu_iowait_s: float | None = None
    tcp_retrans: int | None = None
    cgroup_periods: int | None = None  # CPU-quota enforcement periods elapsed (cpu.stat nr_periods)
    cgroup_throttled_periods: int | None = None  # periods in which the quota ran out (nr_throttled)
    run_wait_ms: float | None = None  # run-queue wait of this process's threads (see run_queue_wait_ms)


def parse_snmp_retrans(text: str) -> int | None:
    """``RetransSegs`` from the two ``Tcp:`` lines of /proc/net/snmp."""
    rows = [line.split() for line in text.splitlines() if line.startswith("Tcp:")]
    if len(rows) < 2:
        return None
    header, values = rows[0], rows[1]
    try:
        return int(values[header.index("RetransSegs")])
    except (ValueError, IndexError):
        return None


def parse_proc_stat_cpu(text: str) -> tuple[float, float, float] | None:
    """(total, steal, iowait) seconds from the aggregate ``cpu`` line of /proc/stat."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            ticks = [int(v) for v in line.split()[1:]]
            # user nice system idle iowait irq softirq steal [guest guest_nice]:
            # guest time is already counted in user, so it is left out of total.
            total = sum(ticks[:8])
            iowait = ticks[4] if len(ticks) > 4 else 0
            steal = ticks[7] if len(ticks) > 7 else 0
            return total / _CLK_TCK, steal / _CLK_TCK, iowait / _CLK_TCK
    return None


def parse_proc_self(stat_text: str, status_text: str) -> tuple[float | None, int | None]:
    """(process CPU seconds, involuntary context switches) from /proc/self/{stat,status}."""
    cpu = None
    # The command name (field 2) may contain spaces; fields resume after ')'.
    rest = stat_text.rsplit(")", 1)[-1].split()
    if len(rest) > 12:
        cpu = (int(rest[11]) + int(rest[12])) / _CLK_TCK  # utime, stime
    invol = None
    for line in status_text.splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            invol = int(line.split()[1])
    return cpu, invol


def cgroup_cpu_stat_path(proc_cgroup: str) -> str | None:
    """Where this process's ``cpu.stat`` lives, from the text of /proc/self/cgroup.

    cgroup v1 names the ``cpu`` controller's hierarchy (``3:cpu,cpuacct:/a/b``);
    v2 has the single ``0::/a/b`` line.  The file is looked up again every
    window, since a job's tasks may be moved between cgroups while they run.
    """
    v2 = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, path = parts[1].split(","), parts[2]
        if "cpu" in controllers:
            for mount in (",".join(controllers), "cpu"):
                candidate = f"/sys/fs/cgroup/{mount}{path.rstrip('/')}/cpu.stat"
                if os.path.exists(candidate):
                    return candidate
        elif parts[0] == "0" and parts[1] == "":
            v2 = f"/sys/fs/cgroup{path.rstrip('/')}/cpu.stat"
    return v2 if v2 and os.path.exists(v2) else None


def parse_cpu_stat_periods(text: str) -> tuple[int, int] | None:
    """(quota periods, throttled periods) from cpu.stat (``nr_periods``, ``nr_throttled``; v1 and v2)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key in ("nr_periods", "nr_throttled"):
            values[key] = int(value)
    if len(values) < 2:
        return None
    return values["nr_periods"], values["nr_throttled"]


def run_queue_wait_ms() -> float | None:
    """Milliseconds this process's threads have spent runnable but not running (all threads).

    The second field of ``/proc/<tid>/schedstat`` (the kernel's sched_info,
    on in every distribution kernel): time the host could not give the
    process a CPU — other processes, or its cgroup's quota.  All threads, as
    a communication library moves data on threads of its own.  A thread that
    ends takes its share with it (a window then reads low, never high).
    None where it cannot be read.
    """
    total, seen = 0, False
    for path in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(path, encoding="ascii") as handle:
                total += int(handle.read().split()[1])
            seen = True
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e6 if seen else None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def read_counters() -> HostCounters:
    now = time.monotonic()
    proc_cpu = invol = total = steal = iowait = None
    try:
        import psutil
    except ImportError:
        psutil = None  # type: ignore[assignment]
    if psutil is not None:
        try:
            proc = psutil.Process()
            times = proc.cpu_times()
            proc_cpu = times.user + times.system
            invol = proc.num_ctx_switches().involuntary
            node = psutil.cpu_times()
            total = sum(getattr(node, f) for f in ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal") if hasattr(node, f))
            steal = getattr(node, "steal", None)
            iowait = getattr(node, "iowait", None)
        except Exception:  # noqa: BLE001 -- psutil.Error on exotic kernels
            pass
    else:
        stat, status = _read("/proc/self/stat"), _read("/proc/self/status")
        if stat and status:
            proc_cpu, invol = parse_proc_self(stat, status)
        node_stat = _read("/proc/stat")
        parsed = parse_proc_stat_cpu(node_stat) if node_stat else None
        if parsed:
            total, steal, iowait = parsed
    snmp = _read("/proc/net/snmp")
    periods = None
    cgroup = _read("/proc/self/cgroup")
    stat_path = cgroup_cpu_stat_path(cgroup) if cgroup else None
    cpu_stat = _read(stat_path) if stat_path else None
    if cpu_stat:
        periods = parse_cpu_stat_periods(cpu_stat)
    return HostCounters(now, proc_cpu, invol, total, steal, iowait, parse_snmp_retrans(snmp) if snmp else None,
                        *(periods or (None, None)), run_wait_ms=run_queue_wait_ms())


def host_block(prev: HostCounters, cur: HostCounters) -> dict[str, Any]:
    """Wire ``host`` block for the interval between two counter readings."""
    dt = cur.wall_s - prev.wall_s
    out: dict[str, Any] = {}
    if dt <= 0:
        return out
    if cur.proc_cpu_s is not None and prev.proc_cpu_s is not None:
        out["cpu_pct"] = round(max(0.0, cur.proc_cpu_s - prev.proc_cpu_s) / dt * 100.0, 2)
    if cur.ctx_invol is not None and prev.ctx_invol is not None:
        out["ctx_invol_per_s"] = round(max(0, cur.ctx_invol - prev.ctx_invol) / dt, 3)
    if cur.run_wait_ms is not None and prev.run_wait_ms is not None:
        out["run_wait_ms_per_s"] = round(max(0.0, cur.run_wait_ms - prev.run_wait_ms) / dt, 3)
    if None not in (cur.cpu_total_s, prev.cpu_total_s):
        span = cur.cpu_total_s - prev.cpu_total_s  # type: ignore[operator]
        if span > 0:
            for field, a, b in (("steal_pct", cur.cpu_steal_s, prev.cpu_steal_s),
                                ("iowait_pct", cur.cpu_iowait_s, prev.cpu_iowait_s)):
                if a is not None and b is not None:
                    out[field] = round(max(0.0, a - b) / span * 100.0, 3)
    if None not in (cur.cgroup_periods, prev.cgroup_periods, cur.cgroup_throttled_periods,
                    prev.cgroup_throttled_periods):
        # Per quota period, not per second of throttled time: cpu.stat sums the
        # throttled time over the cgroup's CPUs, which reads as 159 % on a
        # two-CPU quota.  The share of periods whose quota ran out is 0..100.
        periods = cur.cgroup_periods - prev.cgroup_periods  # type: ignore[operator]
        throttled = cur.cgroup_throttled_periods - prev.cgroup_throttled_periods  # type: ignore[operator]
        # A task moved to another cgroup mid-window restarts the counters: no value then.
        if periods == 0:
            out["cpu_throttled_pct"] = 0.0  # no quota, or no period ran: nothing held back
        elif 0 <= throttled <= periods:
            out["cpu_throttled_pct"] = round(100.0 * throttled / periods, 3)
    if cur.tcp_retrans is not None and prev.tcp_retrans is not None:
        out["net_retransmits_per_s"] = round(max(0, cur.tcp_retrans - prev.tcp_retrans) / dt, 3)
    return out


class HostSampler:
    """Rates since the previous ``sample()`` (the first call primes the counters)."""

    def __init__(self) -> None:
        self._prev = read_counters()

    def sample(self) -> dict[str, Any]:
        cur = read_counters()
        block = host_block(self._prev, cur)
        self._prev = cur
        return block
