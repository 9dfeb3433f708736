"""Replay: the analysis pipeline over a recorded trace, taking no action.

The records go through the very ``Analyzer`` the daemon runs, in arrival order;
what replay reports for a trace is what the daemon would have concluded live
(minus active probes, which need a running job: confirmation here is passive).
"""

from __future__ import annotations

from collections.abc import Iterable

from artemisd.config import Config
from artemisd.incident import Incident, IncidentState
from artemisd.pipeline import Analyzer, analyze_records
from artemisd.wire import NodeEvent, WindowReport

NOT_INCIDENTS = (IncidentState.SUSPECT, IncidentState.DISMISSED)


def replay_records(
    records: Iterable[WindowReport | NodeEvent],
    config: Config | None = None,
    include_unconfirmed: bool = False,
) -> list[Incident]:
    """Incidents found in ``records``, in the order they were opened.

    Suspects that never persisted are left out unless ``include_unconfirmed``:
    a one-off fluctuation is not an incident.
    """
    analyzer = Analyzer((config or Config()).analysis)
    analyze_records(records, analyzer)
    return [i for i in analyzer.incidents if include_unconfirmed or i.state not in NOT_INCIDENTS]
