"""Every API the probe wraps keeps its exact signature: called positionally and by keyword.

One in-process gloo group of world size 1 (a HashStore, no sockets), the probe
installed with no endpoint.  Lightning builds ``DistributedDataParallel(module=model,
...)``; a wrapper that names its own first parameter ``module`` breaks it.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_hook
from torch_hook.config import ProbeConfig


@pytest.fixture(scope="module")
def probe():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert torch_hook.install(ProbeConfig(endpoint=None, job="sig", job_step="0", node="n0"))
    yield
    torch_hook.uninstall()
    dist.destroy_process_group()


def _model() -> torch.nn.Module:
    return torch.nn.Linear(4, 2)


def test_ddp_wrappers_keep_signatures(probe):
    for name in ("__init__", "register_comm_hook", "_register_builtin_comm_hook"):
        wrapper = DDP.__dict__[name]
        assert wrapper.__wrapped__ is not wrapper
        assert inspect.signature(wrapper) == inspect.signature(wrapper.__wrapped__), name


def test_ddp_module_by_keyword(probe):
    model = DDP(module=_model(), process_group=None)  # how Lightning calls it
    model(torch.randn(3, 4)).sum().backward()
    positional = DDP(_model())
    positional(torch.randn(3, 4)).sum().backward()
    assert torch_hook.stats()["hook_errors"] == 0


def test_register_comm_hook_by_keyword(probe):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model = DDP(_model())
    model.register_comm_hook(state=None, hook=allreduce_hook)
    model(torch.randn(3, 4)).sum().backward()
    other = DDP(_model())
    other._register_builtin_comm_hook(comm_hook_type=dist.BuiltinCommHookType.ALLREDUCE)
    other(torch.randn(3, 4)).sum().backward()
