"""After an outage, the probes' backlogs are the same run of the job, and no loss of throughput.

While the daemon (or its database) could not take reports, every rank's probe
kept its windows and sends them once it is answered again; one rank's backlog
arrives seconds before another's (each waits out its own jittered backoff).  Seen
while writing the PostgreSQL-restart test with a real job (tests/cluster/test_ha_training.py):
the second rank's backlog, far below the first rank's newest window, was taken for a
requeued job's new run, and the windows analysed with one rank's samples read as the
job's throughput halved — a verification running then would undo a correct drain.
"""

from __future__ import annotations

import math
import os
import random

from artemisd.auth import TRUSTED_LOCAL
from artemisd.config import parse_config_text
from artemisd.runs import RESTART_GAP, RUN_SEP, JobRun
from artemisd.service import Daemon
from artemisd.slurm.cli import CliSlurm
from tests.unit.windows import lockstep

WORLD = 2


def test_a_ranks_own_order_tells_a_new_run_from_a_backlog():
    run = JobRun()
    for seq in range(12):
        assert not any(run.place(rank, seq) for rank in range(WORLD))
    assert not any(run.place(0, seq) for seq in range(12, 32))  # rank 0's backlog
    assert not any(run.place(1, seq) for seq in range(12, 32))  # rank 1's, 19 windows below rank 0's newest
    assert not run.place(1, 31)  # a batch sent again (stored, the answer lost): the same run
    assert run.number == 0
    assert run.place(1, 0) and run.number == 1  # requeued: rank 1 starts again from window 0
    assert not run.place(0, 0) and not run.place(0, 1) and run.number == 1  # its peers join that run
    for seq in range(2, 11):
        run.place(0, seq)
    assert not run.place(0, 10 - RESTART_GAP) and run.number == 1  # back by the gap: late, not a restart
    assert run.place(0, 10 - RESTART_GAP - 1) and run.number == 2  # back past it: a restart


def daemon(state) -> Daemon:
    config = parse_config_text(f"StateDir={state}\nAuthType=none\n")
    return Daemon(config, CliSlurm(timeout=2, env={"SLURM_CONF": "/nonexistent", "PATH": os.environ["PATH"]}))


def test_a_backlog_after_an_outage_is_analysed_as_the_same_run_without_a_false_slowdown(tmp_path):
    rng = random.Random(7)
    windows = [lockstep(seq, [50.0 * (1 + rng.gauss(0, 0.02)) for _ in range(WORLD)], job="77",
                        nodes=["a", "b"]) for seq in range(44)]
    d = daemon(tmp_path / "state")
    try:
        def send(reports):
            result = d.accept(list(enumerate(reports)), TRUSTED_LOCAL, {}, [])
            assert result.accepted == len(reports) and not result.rejected

        for seq in range(12):
            send(windows[seq])
        for rank in range(WORLD):  # the outage's backlog, rank after rank
            send([windows[seq][rank] for seq in range(12, 32)])
        for seq in range(32, 44):
            send(windows[seq])
        assert d.analyzer.window_shapes("77", f"0{RUN_SEP}1") == []  # no new run was made up
        series = d.analyzer.throughput("77", "0")
        measured = [t for _, t in series if math.isfinite(t)]
        healthy = sorted(measured)[len(measured) // 2]
        assert len(measured) >= 20 and min(measured) > 0.9 * healthy, measured
        assert not d.store.incidents(job="77")
    finally:
        d.store.close()


def test_an_incident_with_a_window_a_rank_missed_is_still_strict_json(tmp_path):
    """The window's throughput is not measured (NaN inside): the API says null, never the non-JSON NaN."""
    import json

    import pytest

    from tests.unit.test_server import SLOW_BUSY, Clock, Harness, cluster, hot_gpu_confirmed, run

    def refuse(constant):
        pytest.fail(f"{constant} in the body: not JSON")

    async def scenario():
        async with Harness(tmp_path, "", cluster(), Clock()) as h:
            await hot_gpu_confirmed(h)
            await h.post(lockstep(12, SLOW_BUSY, nodes=[f"n{r // 2}" for r in range(len(SLOW_BUSY))])[:-1])
            await h.windows(range(13, 16), SLOW_BUSY)  # the partial window 12 is analysed without its last rank
            [inc] = await h.incidents()
            text = await (await h.client.get(f"/v1/incidents/{inc['id']}")).text()
            throughput = dict(json.loads(text, parse_constant=refuse)["throughput"])
            assert throughput[12] is None and all(v is not None for seq, v in throughput.items() if seq != 12)
    run(scenario)
