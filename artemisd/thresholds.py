"""The thresholds that say a GPU, a host or a link shows a fault: one table for every stage.

Localize reads them in the job's own telemetry (against the peers); policy
reads the same ones in root-side node checks before a hard action, and before
undoing a drain.  Both must agree on what a fault looks like: a drain
corroborated by a reading localize would not call a fault, or the reverse,
is a decision made on two different definitions.
"""

from __future__ import annotations

# A clock below 92 % of its maximum (or of its peers') has stopped boosting.
CLOCK_DROP = 0.92
# A power limit 3 % under the default (or the peers') was lowered on purpose.
POWER_LIMIT_DROP = 0.97
# Throttle reasons (the wire vocabulary, NVML's and AMD SMI's mapped onto it) by the cause they show.
THERMAL_REASONS = frozenset({"sw_thermal", "hw_thermal"})
POWER_REASONS = frozenset({"sw_power_cap", "hw_power_brake"})
CLOCK_REASONS = frozenset({"applications_clocks", "hw_slowdown"})
# A GPU reading counts as evidence only under load: utilization at least this
# (an idle GPU reads 0 %; a training GPU, even a throttled one, reads > 90 %).
LOAD_UTIL_PCT = 50.0
# TCP retransmits (or fabric retries) per second that a healthy node does not show...
RETRANSMITS_PER_S = 5.0
# ...and, against the job's other nodes, this many times theirs.
RETRANSMIT_FACTOR = 5.0
# A GPU this much hotter than its peers is running hot.
HOT_DELTA_C = 10.0
# A rank whose cgroup CPU quota ran out in this many percentage points more of its periods than its peers'
# (``cpu_throttled_pct``) is held back by the quota.
THROTTLED_DELTA_PCT = 10.0
# Receive-side fabric errors per second (symbol errors, CRC errors, link recoveries, received
# packets in error) that a healthy link does not show: a clean link reads 0 for hours; a marginal
# cable or transceiver counts thousands an hour.  A link that went down or lost its carrier in the
# interval counts at any rate.
FABRIC_ERRORS_PER_S = 0.5
# ...and, where the job's other nodes report the same counter, this many times theirs (a fabric-wide
# storm is no evidence against one node).
FABRIC_ERROR_FACTOR = 10.0
# A port trained below this share of its peers' rate (or a PCIe link below its own maximum) runs slow.
RATE_DROP = 0.75
