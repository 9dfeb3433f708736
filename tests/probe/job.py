"""A small DDP training job, run as one real gloo rank per process by the probe tests.

``python job.py SPEC_JSON`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set.
The spec switches faults on by step index, so one job can play several
scenarios in a row: ``slow`` (extra compute on one rank), ``stall`` (a
data-loader stall on one rank), ``collectives`` (explicit torch.distributed
calls), ``faults`` (exceptions raised inside the probe), ``reinstall``
(uninstall then install again mid-run).  Each rank writes ``rank<N>.json``
(stats, final parameter checksum) into ``spec["out"]``.  ``finish`` is how the
script ends: ``barrier`` (default: barrier, then destroy_process_group),
``destroy`` (destroy_process_group right after the last step, as many training
scripts do) or ``exit`` (neither: the interpreter exits with the group alive).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


class Samples(Dataset):
    def __init__(self, n: int, width: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, width, generator=g)
        self.y = torch.randn(n, 1, generator=g)
        self.stall_s = 0.0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.stall_s:
            time.sleep(self.stall_s)
        return self.x[i], self.y[i]


def active(window: list[int] | None, iteration: int) -> bool:
    """Whether ``iteration`` falls in a phase given in the probe's step indices.

    The probe's first step boundary only starts its clock, so its step p is
    training iteration p + 1.
    """
    return bool(window) and window[0] <= iteration - 1 < window[1]


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
    width, batch = spec.get("width", 256), spec.get("batch", 16)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                    torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = Samples(spec.get("samples", 4096), width)
    if spec.get("sampler"):
        loader = DataLoader(data, batch_sampler=torch_hook.WeightedDistributedSampler(data, batch, shuffle=False))
    else:
        loader = DataLoader(data, batch_size=batch, shuffle=False)
    burn = torch.randn(spec.get("slow_n", 192), spec.get("slow_n", 192))
    extra = torch.ones(1 << 14)
    steps, step = spec["steps"], 0
    local_batches: list[int] = []
    epoch = 0
    while step < steps:
        if hasattr(loader.batch_sampler, "set_epoch"):
            loader.batch_sampler.set_epoch(epoch)
        epoch += 1
        for x, y in loader:
            if step >= steps:
                break
            data.stall_s = spec.get("stall_s", 0.02) if rank == spec.get("stall_rank") and active(spec.get("stall"), step + 1) else 0.0
            local_batches.append(len(x))
            if rank == spec.get("slow_rank") and active(spec.get("slow"), step):
                for _ in range(spec.get("slow_reps", 6)):
                    burn = torch.tanh(burn @ burn)
            if active(spec.get("faults"), step) and step % 3 == 0:
                from torch_hook import window

                def broken(self):  # an exception inside the probe's own code
                    raise RuntimeError("injected probe fault")

                window.ClosedWindow.report_fields = broken
            if spec.get("faults") and step == spec["faults"][1]:
                import importlib

                import torch_hook.window

                importlib.reload(torch_hook.window)  # heal: later windows report again
                torch_hook.uninstall()
                torch_hook.install()
            if spec.get("reinstall") == step:
                torch_hook.uninstall()
                torch_hook.install()
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            if active(spec.get("collectives"), step):
                dist.all_reduce(extra)
                out = torch.empty(extra.numel() * world)
                dist.all_gather_into_tensor(out, extra)
                dist.broadcast(extra, src=0)
                work = dist.all_reduce(extra, async_op=True)
                work.wait()
                dist.barrier()
            opt.step()
            step += 1
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    result = {"rank": rank, "stats": torch_hook.stats(), "digest": digest, "loss": float(loss),
              "installed": torch_hook.installed(), "local_batches": local_batches,
              "share": torch_hook.work_share()}
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(result))
    finish = spec.get("finish", "barrier")
    if finish == "barrier":
        dist.barrier()
    if finish in ("barrier", "destroy"):
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
