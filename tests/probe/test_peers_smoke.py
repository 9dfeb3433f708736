"""benchmarks/peers.py end to end, smaller than --quick: the jobs run, every tool is wired, the table comes out.

Detection results are not asserted here (on shared CI cores they are the
benchmark's to measure, docs/benchmarks.md); what is asserted is that the
comparison itself is sound: each job ran with the three tools in it, the
fault was applied from outside at the iteration the rank announced, Artemis
reported every rank in every window, NVRx reported at every interval, the
overhead job timed every mode in every round, and the table has one row per
system with the five columns.  Needs the peers' venv (.venv-peers), which
scripts/bootstrap creates with ``benchmarks/peers.py --setup``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.probe.launch import ROOT

pytestmark = [pytest.mark.probe, pytest.mark.timeout(600)]

W, HEALTHY, FAULTED, ROUNDS = 8, 4, 3, 2


def test_quick_comparison_runs_with_every_tool(tmp_path):
    if not (ROOT / ".venv-peers" / "bin" / "python").exists():
        pytest.fail(".venv-peers is missing: scripts/bootstrap runs `benchmarks/peers.py --setup`")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--quick", "--window", str(W),
                           "--healthy-windows", str(HEALTHY), "--faulted-windows", str(FAULTED),
                           "--rounds", str(ROUNDS), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=560, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].split()[:6] == ["system", "latency_steps", "false_blames", "healthy_flags", "cause",
                                    "overhead_pct"]
    assert [line.split()[0] for line in lines[1:4]] == ["artemis", "nvrx", "megatron"]

    result = json.loads((tmp_path / "peers.json").read_text())
    fault_at = HEALTHY * W + 1
    for name in ("slowed", "intermittent"):
        job = result["jobs"][name]
        assert job["mechanism"], f"{name}: no fault was applied"
        # the driver starts the fault once the rank announces the iteration; it lands within a few
        assert fault_at <= job["onset"] <= fault_at + 3, (name, job["onset"])
    for name, job in result["jobs"].items():
        iterations = (HEALTHY + FAULTED) * W + 1 + (FAULTED * W // 2 if name == "intermittent" else 0)
        # NVRx on rank 0: one report at every `iteration % W == 0`, as its usage guide loops
        assert [r["done"] for r in job["nvrx_raw"]] == list(range(1, iterations + 1, W)), name
        # the probe counted no fault of its own and Artemis's trace covers every window of every rank
        assert all(s["errors"] == 0 and s["hook_errors"] == 0 for s in job["probe_stats"]), name
        trace = [json.loads(line) for line in (tmp_path / name / "trace.jsonl").read_text().splitlines()]
        windows = {(r["window"]["seq"], r["rank"]) for r in trace if r["type"] == "window"}
        full = (iterations - 1) // W
        assert {(s, r) for s in range(full) for r in range(4)} <= windows, name
    rows = {row["system"]: row for row in result["rows"]}
    assert rows["megatron"]["ran"] is False and "torch.cuda.is_available()" in rows["megatron"]["note"]
    assert rows["nvrx"]["ran"] is True and rows["artemis"]["ran"] is True
    assert len(result["overhead_rounds"]) == ROUNDS
    for block in result["overhead_rounds"]:
        assert set(block) == {"none", "artemis", "nvrx", "megatron"}
        assert all(math.isfinite(ms) and ms > 0 for ms in block.values())
