"""The stack matrix: the probe under ``--artemis=on`` on the training stacks people use.

One real gloo job per stack (tests/probe/stacks.py), CPU only, tiny models
built from code or configs (nothing downloaded), the probe loaded by the
autoload exactly as the SPANK plugin arranges it.  Each rank trains the stack
with the probe -- healthy, then one rank sleeping before each iteration -- and
again without it, in the same process.  Per stack:

* training output (every step's loss, the rank's final parameters) is
  bit-identical with and without the probe;
* every rank exits 0 (``run_job`` raises on any other status, SIGABRT at exit
  included) and the probe counted no fault of its own;
* the reports are there for every rank and window, aligned, with
  ``busy + comm_wait = step`` and the stack's collectives;
* ``artemis replay`` of the healthy windows names no rank, node or link, and
  of the whole trace names the slowed rank and no other.

Nine jobs: eight stacks with 4 ranks, plain DDP again with 2 ranks (a small
job must get a per-rank incident too).  Versions: the ``stacks`` extra in
pyproject.toml, installed by scripts/bootstrap.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from artemisd.wire import WindowReport, parse_record
from tests.probe.launch import ROOT, run_job

pytestmark = [pytest.mark.probe, pytest.mark.timeout(420)]

W = 8  # steps per window
HEALTHY, SLOWED = 6, 6  # windows: 6 slowed windows of ~0.9 s are more than ConfirmSeconds (2 s)
SLOW_MS = 100
# Probe step p is iteration p + 1 (the first boundary only starts the clock),
# so slowing iterations from 1 + HEALTHY*W on makes window HEALTHY the first slow one.
STEPS = 1 + (HEALTHY + SLOWED) * W

# stack -> what its reports must show: op-name prefixes that must appear, and
# the exact all_reduce calls per step where the stack fixes them.
EXPECTED_OPS = {
    "ddp": ("all_reduce",),  # the reducer's buckets, through the comm hook
    "compiled": ("all_reduce",),
    "hf": ("all_reduce",),
    "lightning": ("all_reduce",),
    "manual": ("all_reduce",),  # 6 parameters, one all_reduce each per step
    "fsdp1": ("all_gather", "reduce_scatter"),
    "fsdp2": ("all_gather", "reduce_scatter"),
    "tp": ("all_reduce",),  # RowwiseParallel's functional all_reduce of partial outputs
}
CASES = [(stack, 4) for stack in EXPECTED_OPS] + [("ddp", 2)]
NEEDS = {"hf": ("transformers", "accelerate"), "lightning": ("lightning",)}


def _reports(path: Path) -> list[WindowReport]:
    return [parse_record(json.loads(line), f"{path}:{i}") for i, line in enumerate(path.read_text().splitlines(), 1)]


def _table(reports: list[WindowReport]) -> dict[int, dict[int, WindowReport]]:
    table: dict[int, dict[int, WindowReport]] = defaultdict(dict)
    for r in reports:
        table[r.window.seq][r.rank] = r
    return table


def replay(trace: Path) -> list[dict]:
    """``artemis replay TRACE --json``, as a person would run it: one incident per line."""
    done = subprocess.run([sys.executable, "-m", "artemisd.cli", "replay", str(trace), "--json"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def named(incident: dict) -> bool:
    return incident.get("rank") is not None or incident.get("node") is not None or incident.get("link") is not None


class Job:
    def __init__(self, stack: str, world: int, out: Path):
        self.stack, self.world, self.out = stack, world, out
        self.slow_rank = world - 2 if world > 2 else 1
        self.trace = out / "trace.jsonl"
        env = {"ARTEMIS_ENABLED": "1", "ARTEMIS_ENDPOINT": f"file:{self.trace}", "ARTEMIS_WINDOW_STEPS": str(W),
               "PYTHONPATH": f"{ROOT / 'torch_hook' / 'autoload'}:{ROOT}",
               "HF_HUB_OFFLINE": "1", "HF_HOME": str(out / "hf-home"), "TOKENIZERS_PARALLELISM": "false"}
        spec = {"stack": stack, "out": str(out), "steps": STEPS, "slow_rank": self.slow_rank,
                "slow_from": 1 + HEALTHY * W, "slow_ms": SLOW_MS}
        self.results = run_job(spec, world=world, env=env, timeout_s=360, script=ROOT / "tests/probe/stacks.py")
        self.reports = _reports(self.trace)
        self.table = _table(self.reports)
        self.healthy_trace = out / "healthy.jsonl"
        self.healthy_trace.write_text("".join(
            line + "\n" for line in self.trace.read_text().splitlines()
            if json.loads(line)["window"]["seq"] < HEALTHY))


@pytest.fixture(scope="module", params=CASES, ids=[f"{s}-{w}ranks" for s, w in CASES])
def job(request, tmp_path_factory) -> Job:
    stack, world = request.param
    missing = [m for m in NEEDS.get(stack, ()) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"{stack}: {', '.join(missing)} not installed: scripts/bootstrap installs the [stacks] extra")
    return Job(stack, world, tmp_path_factory.mktemp(f"{stack}-{world}ranks"))


def test_training_is_identical_with_and_without_the_probe(job):
    for res in job.results:
        assert res["installed"], f"rank {res['rank']}: the autoload did not install the probe"
        probed, plain = res["probed"], res["plain"]
        assert len(probed["losses"]) == STEPS
        assert probed["losses"] == plain["losses"], f"rank {res['rank']}: losses differ under the probe"
        assert probed["digest"] == plain["digest"], f"rank {res['rank']}: parameters differ under the probe"
        assert all(loss == loss for loss in plain["losses"]), "the model diverged (nan): the comparison is void"


def test_probe_counted_no_fault_of_its_own(job):
    for res in job.results:
        stats = res["stats"]
        assert stats["errors"] == 0 and stats["hook_errors"] == 0, stats


def test_reports_have_every_rank_and_the_stacks_collectives(job):
    assert sorted(job.table) == list(range(HEALTHY + SLOWED))
    for seq, ranks in job.table.items():
        assert sorted(ranks) == list(range(job.world)), f"window {seq} is missing ranks"
        assert {(r.window.first_step, r.window.steps) for r in ranks.values()} == {(seq * W, W)}
        for r in ranks.values():
            assert r.job == "4242" and r.world == job.world and r.dropped_reports == 0
            assert r.ms.busy + r.ms.comm_wait == pytest.approx(r.ms.step, abs=0.01)
            ops = {c.op: c for c in r.collectives}
            for prefix in EXPECTED_OPS[job.stack]:
                seen = [c for op, c in ops.items() if op.startswith(prefix)]
                assert seen and sum(c.calls for c in seen) >= W and sum(c.bytes for c in seen) > 0, (
                    f"{job.stack} rank {r.rank} window {seq}: no {prefix} in {sorted(ops)}")
            if job.stack == "manual":
                assert ops["all_reduce"].calls == 6 * W


def test_slowed_rank_is_busy_and_its_peers_wait(job):
    # Compared within each window, not against the healthy phase: on a shared
    # machine the load, and with it every step time, can change twofold between phases.
    slow, others = job.slow_rank, [r for r in range(job.world) if r != job.slow_rank]
    slowed = range(HEALTHY + 1, HEALTHY + SLOWED)  # past the window where the phase starts
    med = statistics.median
    busy_excess = med([job.table[s][slow].ms.busy - med([job.table[s][r].ms.busy for r in others]) for s in slowed])
    assert busy_excess >= 0.5 * SLOW_MS, f"the slowed rank's busy exceeds its peers' by {busy_excess:.1f} ms"
    for r in others:
        extra_wait = med([job.table[s][r].ms.comm_wait - job.table[s][slow].ms.comm_wait for s in slowed])
        assert extra_wait >= 0.5 * SLOW_MS, f"rank {r} waits only {extra_wait:.1f} ms/step longer than the slowed rank"


def test_replay_names_nothing_in_the_healthy_run(job):
    incidents = replay(job.healthy_trace)
    assert not [i for i in incidents if named(i)], incidents


def test_replay_names_the_slowed_rank_and_no_other(job):
    incidents = replay(job.trace)
    summary = [(i["kind"], i["rank"], i["node"], i["cause"]) for i in incidents]
    slow_node = f"n{job.slow_rank}"
    assert any(i["rank"] == job.slow_rank or i["node"] == slow_node for i in incidents), summary
    assert not [i for i in incidents if named(i) and i["rank"] != job.slow_rank and i["node"] != slow_node], summary
