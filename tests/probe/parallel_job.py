"""FSDP2 and tensor-parallel (DTensor) training on real gloo ranks, under the probe.

``python parallel_job.py SPEC_JSON`` with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set (tests/probe/launch.py starts it).  ``spec["mode"]``:

* ``fsdp2`` -- ``fully_shard`` on each layer and the root: parameters are
  all-gathered (``dist.all_gather_single``) before use and gradients
  reduce-scattered (``dist.reduce_scatter_single``), none of it through DDP;
* ``tp`` -- a column-/row-wise parallel MLP on a 1-D DeviceMesh: the row-wise
  layer's partial output is all-reduced by a functional collective
  (``_functional_collectives.all_reduce`` → ``wait_tensor``).

``slow_rank`` burns extra compute before each forward, so its peers wait at the
first collective of the step.  Each rank writes ``rank<N>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def _burn(reps: int, n: int = 256) -> None:
    x = torch.randn(n, n)
    for _ in range(reps):
        x = torch.tanh(x @ x)


def _fsdp2(width: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _tp(width: int, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.ReLU(), torch.nn.Linear(4 * width, width))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if spec.get("install", True) and not os.environ.get("ARTEMIS_ENABLED"):
        import torch_hook

        torch_hook.install()
    dist.init_process_group("gloo")
    import torch_hook

    rank, world = dist.get_rank(), dist.get_world_size()
    width, batch = spec.get("width", 64), spec.get("batch", 8)
    model = _fsdp2(width) if spec["mode"] == "fsdp2" else _tp(width, world)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + (rank if spec["mode"] == "fsdp2" else 0))  # TP: same input everywhere
    for _ in range(spec["steps"]):
        x = torch.randn(batch, width, generator=g)
        if rank == spec.get("slow_rank"):
            _burn(spec.get("slow_reps", 8))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    result = {"rank": rank, "stats": torch_hook.stats(), "loss": float(loss)}
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
