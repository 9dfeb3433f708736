"""FSDP2 and tensor parallel (DTensor) on real gloo ranks: the probe sees their collectives.

Before issue 10 the probe saw no collective of either: FSDP2 calls
``all_gather_single`` / ``reduce_scatter_single`` (not wrapped then), and
DTensor goes through functional collectives, where the rank that waits for a
slow peer looked busy.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from artemisd.wire import parse_record
from tests.probe.launch import run_job

pytestmark = [pytest.mark.probe, pytest.mark.timeout(300)]

JOB = Path(__file__).with_name("parallel_job.py")
W = 5


def _run(tmp_path: Path, spec: dict) -> tuple[list[dict], dict[int, list]]:
    trace = tmp_path / "trace.jsonl"
    results = run_job({**spec, "out": str(tmp_path)}, world=2, script=JOB, timeout_s=240,
                      env={"ARTEMIS_ENDPOINT": f"file:{trace}", "ARTEMIS_WINDOW_STEPS": str(W)})
    by_rank: dict[int, list] = {0: [], 1: []}
    for i, line in enumerate(trace.read_text().splitlines(), 1):
        report = parse_record(json.loads(line), f"{trace}:{i}")
        by_rank[report.rank].append(report)
    for res in results:
        assert res["stats"]["errors"] == 0 and res["stats"]["hook_errors"] == 0, res["stats"]
    return results, by_rank


def test_fsdp2_all_gathers_and_reduce_scatters_are_seen(tmp_path):
    _, by_rank = _run(tmp_path, {"mode": "fsdp2", "steps": 1 + 2 * W})
    for rank, reports in by_rank.items():
        assert len(reports) == 2, rank
        for report in reports:
            ops = {(c.op, c.group): c for c in report.collectives}
            gather, scatter = ops[("all_gather_single", "world")], ops[("reduce_scatter_single", "world")]
            # three sharded Linear layers: gathered for forward (and again for
            # backward), gradients reduce-scattered once per step
            assert gather.calls >= 3 * W and scatter.calls >= W, report.collectives
            assert gather.bytes > 0 and scatter.bytes > 0 and gather.ms > 0
            assert report.ms.comm_wait > 0


def test_tensor_parallel_waiting_rank_shows_comm_wait(tmp_path):
    _, by_rank = _run(tmp_path, {"mode": "tp", "steps": 1 + 3 * W, "slow_rank": 1, "slow_reps": 40})
    for reports in by_rank.values():
        for report in reports:
            ops = {(c.op, c.group): c for c in report.collectives}
            # the row-wise layer's partial sums: one functional all-reduce per step
            assert ops[("all_reduce", "world")].calls == W, report.collectives
    waiting = statistics.median(r.ms.comm_wait for r in by_rank[0])
    slow_busy = statistics.median(r.ms.busy for r in by_rank[1])
    busy = statistics.median(r.ms.busy for r in by_rank[0])
    # Rank 1 burns extra compute before each forward; rank 0 waits for it in
    # wait_tensor, so its wait is a good part of the difference in busy, and it
    # does not look busy itself.
    assert slow_busy >= 1.5 * busy, (slow_busy, busy)
    assert waiting >= 0.5 * (slow_busy - busy), (waiting, slow_busy, busy)
    assert statistics.median(r.ms.comm_wait for r in by_rank[1]) < waiting
