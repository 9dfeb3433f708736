"""Group: a window's flagged ranks become the subjects that incidents are about.

Subjects are keyed by what an incident names: ``("rank", r)``, ``("node",
name)``, ``("job",)`` (a job-wide slowdown, later localized as a link, an
island or left job-wide) and ``("change",)`` (a known workload slower under
new software).  Two or more flagged ranks on one node are one node subject:
they share the node's cooling, power, host and links, so one incident says it
once, where a rank incident each would send a person to the same node twice.
A rank incident already open grows into its node's when a second rank of the
node is flagged (never two incidents for one node), and a rank of a node
whose incident is open is part of it.

Pure: the keys of the subjects already under watch go in, the grouping and
the regrouping of those subjects come out; the Analyzer applies it to its
incidents.
"""

from __future__ import annotations

from collections.abc import Hashable, Set
from dataclasses import dataclass, field

import numpy as np

from artemisd.frame import WindowFrame


@dataclass
class Grouping:
    """One window's straggler subjects, and what becomes of those already watched."""

    subjects: dict[Hashable, np.ndarray] = field(default_factory=dict)  # key -> its flagged rows
    # (rank key, node key): the rank's incident grows into its node's, in this order.
    grown: list[tuple[Hashable, Hashable]] = field(default_factory=list)
    # Rank keys whose node already has an incident: theirs is dropped.
    absorbed: list[Hashable] = field(default_factory=list)


def straggler_subjects(frame: WindowFrame, rows: np.ndarray, watched: Set[Hashable]) -> Grouping:
    """Flagged rows grouped: 2+ ranks on one node → a node subject, else rank subjects.

    ``watched`` holds the keys of the subjects whose incidents are open.
    """
    grouping = Grouping()
    if not rows.size:
        return grouping
    # The watched keys as they will be once the regrouping so far is applied:
    # a node's first watched rank grows into its incident, the next ones join it.
    open_keys = set(watched)
    by_node: dict[int, list[int]] = {}
    for row in rows.tolist():
        by_node.setdefault(int(frame.node[row]), []).append(row)
    for node_code, node_rows in by_node.items():
        node = frame.node_names[node_code]
        if len(node_rows) >= 2:
            key = ("node", node)
            for row in node_rows:
                rank_key = ("rank", int(frame.rank[row]))
                if rank_key in open_keys and key not in open_keys:
                    grouping.grown.append((rank_key, key))
                    open_keys.discard(rank_key)
                    open_keys.add(key)
                elif rank_key in open_keys:
                    grouping.absorbed.append(rank_key)
                    open_keys.discard(rank_key)
            grouping.subjects[key] = np.array(node_rows)
        else:
            rank_key = ("rank", int(frame.rank[node_rows[0]]))
            node_key = ("node", node)
            grouping.subjects[node_key if node_key in open_keys else rank_key] = np.array(node_rows)
    return grouping


def rows_of(frame: WindowFrame, key: Hashable) -> np.ndarray:
    """The frame's rows a subject covers, as a mask (a job-wide subject covers all)."""
    kind = key[0]
    if kind == "rank":
        return frame.rank == key[1]
    if kind == "node":
        try:
            return frame.node == frame.node_names.index(key[1])
        except ValueError:
            return np.zeros(frame.size, dtype=bool)
    return np.ones(frame.size, dtype=bool)


def subject_label(key: tuple) -> str:
    return "/".join(str(k) for k in key)
