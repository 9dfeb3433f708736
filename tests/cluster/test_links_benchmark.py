"""benchmarks/links.py runs on the test cluster's namespaces and writes the numbers issue 31 asks for.

One trial per case (the benchmark's rates come from ``--trials 10``, docs/benchmarks.md): the JSON
has every magnitude's right / wrong / unnamed / trials / median_s and the controls, no probe ever
names a wrong node or a healthy control's, and this testbed's veths count no fabric error, so the
counters name nothing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .netlab import namespaces_available

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def test_one_trial_per_case_names_no_wrong_node_and_no_healthy_link(tmp_path: Path) -> None:
    why = namespaces_available()
    if why:
        pytest.skip(why)
    for tool in ("tc", "taskset"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    out = tmp_path / "links.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "links.py"), "--trials", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert sorted(result["by_magnitude"], key=float) == ["5", "10", "20", "40"]
    for magnitude, row in result["by_magnitude"].items():
        assert set(row) == {"right", "wrong", "unnamed", "trials", "median_s"}, row
        assert row["trials"] == 2 and row["right"] + row["wrong"] + row["unnamed"] == 2, row
        assert row["wrong"] == 0, (magnitude, result["trials"])
    assert result["controls"]["trials"] == 2 and result["controls"]["named"] == 0, result["trials"]
    for evidence in ("counters", "both"):
        assert all(row["right"] == row["wrong"] == 0 for row in result["by_evidence"][evidence].values())
