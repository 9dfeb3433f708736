"""The layering contracts in pyproject.toml hold, and they are live: a forbidden import breaks each."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True, timeout=120)


def test_the_pure_core_and_the_probe_keep_their_layers():
    run = lint(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "4 kept, 0 broken" in run.stdout, run.stdout


def test_a_forbidden_import_breaks_each_contract(tmp_path):
    for part in ("artemisd", "torch_hook", "pyproject.toml"):
        source = ROOT / part
        if source.is_dir():
            shutil.copytree(source, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, tmp_path / part)
    # An analysis stage reaching for the store, the simulated loop and a daemon part reaching into the
    # daemon's wiring, and the probe reaching for the daemon's wire models: the mistakes the contracts
    # exist to stop.
    with open(tmp_path / "artemisd" / "verify.py", "a") as f:
        f.write("\nimport artemisd.store  # noqa\n")
    with open(tmp_path / "artemisd" / "sim" / "loop.py", "a") as f:
        f.write("\nimport artemisd.service  # noqa\n")
    with open(tmp_path / "artemisd" / "acting.py", "a") as f:
        f.write("\nimport artemisd.service  # noqa\n")
    with open(tmp_path / "torch_hook" / "__init__.py", "a") as f:
        f.write("\nimport artemisd.wire  # noqa\n")
    run = lint(tmp_path)
    assert run.returncode != 0
    assert "0 kept, 4 broken" in run.stdout, run.stdout
    assert "artemisd.verify -> artemisd.store" in run.stdout, run.stdout
    assert "artemisd.sim.loop -> artemisd.service" in run.stdout, run.stdout
    assert "artemisd.acting -> artemisd.service" in run.stdout, run.stdout
