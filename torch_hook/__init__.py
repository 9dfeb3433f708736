"""torch_hook: Artemis's per-rank probe (stdlib + torch only).

    import torch_hook
    torch_hook.install()          # or automatically: ARTEMIS_ENABLED=1 + autoload/ on PYTHONPATH
    ...                           # training loop, unchanged
    torch_hook.uninstall()        # restores everything it patched

Step boundaries come from every optimizer's ``step()``; a loop without an
optimizer calls ``torch_hook.step()`` once per iteration (after which optimizer
steps are no longer counted).  Samples are counted from DataLoader batch sizes
unless the loop reports them with ``step(samples=n)`` / ``add_samples(n)``.

Configuration (environment): ``ARTEMIS_ENDPOINT`` (``http://host:port`` or
``file:/path.jsonl``), ``ARTEMIS_WINDOW_STEPS`` (50), ``ARTEMIS_WINDOW_SECONDS``
(60), ``ARTEMIS_JOB_ID`` / ``SLURM_JOB_ID``, ``ARTEMIS_STEP_ID`` /
``SLURM_STEP_ID``, ``ARTEMIS_NODE`` / ``SLURMD_NODENAME``, ``ARTEMIS_TELEMETRY``,
``ARTEMIS_MUNGE_SOCKET``, ``ARTEMIS_QUEUE``, ``ARTEMIS_HTTP_TIMEOUT``,
``ARTEMIS_BOUNDARY_SYNC`` (1), ``ARTEMIS_COMPLETION_HOOKS`` (1: on NCCL groups,
time collectives with the process group's completion hooks).

Rebalancing: ``work_share()`` is this rank's relative share of the work (1.0
unless a rebalance directive changed it); ``WeightedDistributedSampler`` applies
the shares to a DataLoader with no other change to the training script.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from torch_hook.config import ConfigError, ProbeConfig
from torch_hook.sampler import WeightedDistributedSampler

__all__ = [
    "ConfigError", "ProbeConfig", "WeightedDistributedSampler", "add_samples", "install",
    "installed", "stats", "step", "uninstall", "work_share", "work_shares",
]

_lock = threading.Lock()
_probe: Any = None
# (next step, next window seq) of the last uninstalled probe: a reinstall in the
# same process continues the numbering, so the daemon never sees a seq twice.
_resume: tuple[int, int] = (0, 0)


def install(config: ProbeConfig | None = None) -> bool:
    """Instrument this process; idempotent.  Returns True when the probe is active.

    Install before wrapping models in DistributedDataParallel (the autoload does
    it when the process group is created).
    """
    global _probe
    with _lock:
        if _probe is not None:
            return True
        from torch_hook.probe import Probe

        probe = Probe(config or ProbeConfig.from_env(), resume=_resume)
        try:
            probe.install()
        except Exception as err:  # noqa: BLE001 -- a torch without some hook point
            probe.uninstall()
            print(f"artemis: probe not installed: {err!r}", file=sys.stderr)
            return False
        _probe = probe
        return True


def uninstall() -> None:
    """Restore every patched function and stop the sender (flushing for up to 3 s)."""
    global _probe, _resume
    with _lock:
        probe, _probe = _probe, None
    if probe is not None:
        _resume = (probe.recorder.step + (1 if probe.recorder.started else 0), probe.recorder.seq)
        probe.uninstall()


def installed() -> bool:
    return _probe is not None


def step(samples: float | None = None) -> None:
    """Mark a step boundary explicitly (loops without an optimizer)."""
    probe = _probe
    if probe is not None:
        probe.step(samples)


def add_samples(n: float) -> None:
    """Count ``n`` training samples in the step in progress."""
    probe = _probe
    if probe is not None:
        try:
            probe.recorder.add_samples(float(n))
        except Exception as err:  # noqa: BLE001
            probe._fail("add_samples", err)


def opt_in_to_rebalancing() -> None:
    """Tell the daemon this job applies work shares (the sampler and ``work_share()`` do it):
    without it, no rebalance is ever sent to the job."""
    probe = _probe
    if probe is not None:
        probe.rebalance_opt_in = True


def work_shares() -> dict[int, float]:
    """Agreed work shares by rank (absent ranks 1.0); empty unless rebalanced."""
    probe = _probe
    return probe.work_shares() if probe is not None else {}


def work_share() -> float:
    """This rank's relative work share (1.0 unless a rebalance directive set it)."""
    probe = _probe
    if probe is None:
        return 1.0
    rank, _ = probe.rank_world()
    return probe.work_shares().get(rank, 1.0)


def stats() -> dict[str, Any]:
    """Counters for tests and debugging: steps, windows, sent, dropped, errors, probes."""
    probe = _probe
    return probe.stats() if probe is not None else {}
