"""Clean exit: 4-rank gloo jobs under the probe, many times, never an abnormal exit.

Each run ends the way training scripts do -- barrier then
``destroy_process_group``, ``destroy_process_group`` straight after the last
step, or just returning with the group alive -- and its last step is a window
boundary, so the probe has just issued its boundary agreement (an
asynchronous all-reduce) when the script ends.  A rank that aborts at exit
(SIGABRT, "terminate called without an active exception") fails ``run_job``
with its exit code and log.  Issue 10 asks for >= 50 clean runs of a 4-rank
job across the test tiers; this file contributes RUNS = 36 of them, the stack
matrix (test_stacks.py) 8, test_probe_jobs.py 3 and the peers' smoke test 3:
50 in every CI run, each failing its test on any non-zero exit.
"""

from __future__ import annotations

import pytest

from tests.probe.launch import run_job

pytestmark = [pytest.mark.probe, pytest.mark.timeout(1500)]

RUNS = 36
FINISH = ("barrier", "destroy", "exit")


def test_four_rank_jobs_always_exit_cleanly(tmp_path):
    for run in range(RUNS):
        out = tmp_path / str(run)
        # steps = W + 1: the first boundary only starts the clock, the last closes window 0.
        results = run_job({"out": str(out), "steps": 6, "width": 32, "samples": 256,
                           "finish": FINISH[run % len(FINISH)]},
                          world=4, timeout_s=240,
                          env={"ARTEMIS_ENDPOINT": f"file:{out / 'trace.jsonl'}", "ARTEMIS_WINDOW_STEPS": "5"})
        for res in results:
            assert res["stats"]["windows"] == 1 and res["stats"]["errors"] == 0, (run, res["stats"])
