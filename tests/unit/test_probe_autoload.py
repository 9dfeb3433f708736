"""autoload/sitecustomize.py in fresh interpreters: inert when disabled, chains, hooks init_process_group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
AUTOLOAD = ROOT / "torch_hook" / "autoload"


def _python(code: str, env: dict[str, str], timeout: float = 90) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ARTEMIS_")}
    done = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def site(tmp_path: Path) -> Path:
    other = tmp_path / "site"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['SITE_CHAINED'] = 'yes'\n")
    return other


def test_disabled_does_nothing_but_chain(site):
    out = _python("import sys, os, json; print(json.dumps(["
                  "'torch' in sys.modules, os.environ.get('SITE_CHAINED'),"
                  "[type(f).__name__ for f in sys.meta_path]]))",
                  {"PYTHONPATH": f"{AUTOLOAD}:{site}"})
    imported_torch, chained, finders = json.loads(out)
    assert imported_torch is False and chained == "yes"
    assert "_DistributedFinder" not in finders


def test_enabled_never_imports_torch_by_itself(site):
    out = _python("import sys, os; print('torch' in sys.modules, os.environ.get('SITE_CHAINED'))",
                  {"PYTHONPATH": f"{AUTOLOAD}:{site}", "ARTEMIS_ENABLED": "1"})
    assert out == "False yes"


def test_enabled_installs_when_the_process_group_starts(tmp_path):
    trace = tmp_path / "t.jsonl"
    code = (
        "import torch, torch.distributed as dist, torch_hook\n"
        "assert not torch_hook.installed()\n"
        "dist.init_process_group('gloo', rank=0, world_size=1, init_method='tcp://127.0.0.1:0')\n"
        "assert torch_hook.installed()\n"
        "m = torch.nn.Linear(4, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(7):\n"
        "    m(torch.ones(2, 4)).sum().backward(); opt.step()\n"
        "torch_hook.uninstall(); dist.destroy_process_group()\n"
        "print(dist.init_process_group.__name__)\n"
    )
    _python(code, {"PYTHONPATH": f"{AUTOLOAD}:{ROOT}", "ARTEMIS_ENABLED": "1", "ARTEMIS_WINDOW_STEPS": "3",
                   "ARTEMIS_ENDPOINT": f"file:{trace}", "ARTEMIS_TELEMETRY": "none", "ARTEMIS_JOB_ID": "5"})
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [r["window"]["seq"] for r in lines] == [0, 1]  # 6 timed steps, W=3
    assert all(r["job"] == "5" and r["world"] == 1 for r in lines)


def test_uninstall_restores_every_patch():
    code = (
        "import torch, torch.distributed as dist, torch_hook\n"
        "from torch.utils.data import dataloader\n"
        "from torch.optim import optimizer\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "c10d = dist.distributed_c10d\n"
        "before = [dist.all_reduce, c10d.all_reduce, c10d.Work.wait, dataloader._BaseDataLoaderIter.__next__,"
        " DDP.__init__, DDP.register_comm_hook, dist.barrier]\n"
        "for _ in range(2):\n"
        "    torch_hook.install(); assert dist.all_reduce is not before[0]\n"
        "    torch_hook.uninstall()\n"
        "after = [dist.all_reduce, c10d.all_reduce, c10d.Work.wait, dataloader._BaseDataLoaderIter.__next__,"
        " DDP.__init__, DDP.register_comm_hook, dist.barrier]\n"
        "print(all(a is b for a, b in zip(before, after)), len(optimizer._global_optimizer_post_hooks))\n"
    )
    assert _python(code, {"PYTHONPATH": str(ROOT), "ARTEMIS_TELEMETRY": "none"}) == "True 0"
