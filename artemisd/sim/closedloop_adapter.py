"""The whole loop at fleet scale, where the daemon's ``Loop`` (sim/loop.py) plugs into the fleet: the
modes and the settings each one's loop runs with (``mode_config``), the ``SimSlurm`` as the loop sees it
(``LoopSlurm``) and the loop deciding only the incidents it is told to (``FleetLoop``)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from artemisd.config import Config, load_config, parse_config_text
from artemisd.incident import IncidentState
from artemisd.sim.cluster import SimSlurm
from artemisd.sim.loop import Loop

S = IncidentState
MODES = ("none", "person", "artemis", "artemis-auto")
AUTO_POLICY = "PartitionPolicy=DEFAULT Auto=rebalance,correct,drain,requeue,escalate"
# Detect-only: every rung is a recommendation, so every incident the loop would act on goes to a person.
DETECT_ONLY_POLICY = "PartitionPolicy=DEFAULT Auto=escalate Approve="
PARTITION = "gpu"
PERSON = "person"


class LoopSlurm:
    """The SimSlurm as the loop sees it, with ``partition_nodes`` answered from a copy.

    The daemon reads the partition's nodes before every decision (the drain
    budget must see a person's resume at once); building a thousand
    ``NodeInfo`` for each of tens of thousands of decisions would be most of
    the run.  The copy is rebuilt whenever a drain or resume happens (the
    loop's, through this object, or a person's, through ``changed``): the
    drain flags and reasons the budget reads are always current; the base
    states (IDLE, ALLOCATED) in it are those of the last rebuild.
    """

    def __init__(self, slurm: SimSlurm):
        self._slurm = slurm
        self._nodes: dict[str, tuple] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._slurm, name)

    def changed(self) -> None:
        self._nodes.clear()

    def partition_nodes(self, partition: str) -> tuple:
        nodes = self._nodes.get(partition)
        if nodes is None:
            nodes = self._nodes[partition] = self._slurm.partition_nodes(partition)
        return nodes

    def drain(self, node: str, reason: str) -> None:
        self._slurm.drain(node, reason)
        self.changed()

    def resume(self, node: str) -> None:
        self._slurm.resume(node)
        self.changed()


class FleetLoop(Loop):
    """The loop, deciding only the incidents named: a fleet holds thousands of closed incidents,
    and ``Loop.tick`` walks them all on every turn."""

    def decide(self, ids: Iterable[str], now: float) -> None:
        for incident_id in ids:
            t = self.tracked(incident_id)
            if t.decide and t.inc.state in (S.CONFIRMED, S.UNRESOLVED, S.ESCALATED):
                self._decide(t, now)


def mode_config(mode: str, policy: str | Path | None = None) -> Config | None:
    """The settings a mode's loop runs with (None: the mode runs no loop)."""
    if mode == "artemis":
        return load_config(policy)
    if mode == "artemis-auto":
        return parse_config_text(AUTO_POLICY, "<artemis-auto>")
    if mode == "person":
        return parse_config_text(DETECT_ONLY_POLICY, "<person>")
    return None

