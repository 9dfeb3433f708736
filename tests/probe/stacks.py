"""One training stack, run as one real gloo rank per process by the stack matrix.

``python stacks.py SPEC_JSON`` with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT set, and the probe's autoload on PYTHONPATH with ARTEMIS_ENABLED=1
(as ``sbatch --artemis=on`` runs a job).  The rank trains the stack twice from
the same seed in one process, so the matrix pays a cold start once per stack:

1. *probed*: the probe as the autoload installed it when the stack created its
   process group; ``spec["slow_rank"]`` sleeps ``slow_ms`` before each of its
   iterations from ``slow_from`` on (a sleep, not a CPU burn: on a shared
   2-core machine a burn would also slow the other ranks);
2. *plain*: ``torch_hook.uninstall()``, then the same training without the
   probe and without the slowdown (a sleep changes no number).

Each rank writes ``rank<N>.json``: per-step losses and a digest of its
parameters (its shard, for FSDP and tensor parallel) from both runs, and the
probe's stats.  Iteration i is 0-based; the probe's first step boundary only
starts its clock, so probe step p is iteration p + 1.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# Wide enough that a rank's own work is milliseconds, not lost in scheduling noise.
WIDTH = 256


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])


def _world() -> int:
    # Lightning's teardown drops WORLD_SIZE from the environment; the group outlives it.
    return dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])


def _batch(rank: int, step: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch for this step, the same in both runs whatever the global RNG did."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, 1, generator=g)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                               torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 1))


def _digest(params: Any) -> float:
    total = 0.0
    for p in params:
        t = p.detach()
        if hasattr(t, "to_local"):  # DTensor: this rank's shard
            t = t.to_local()
        total += float(t.double().sum())
    return total


class Slowdown:
    """``slow_rank`` sleeps ``slow_ms`` before each iteration from ``slow_from`` on, or (a job on
    the test cluster, benchmarks/held_out_stacks.py) once the file ``slow_file`` exists: as many
    milliseconds as the file says (the benchmark sizes it by the job's healthy step)."""

    def __init__(self, spec: dict, enabled: bool):
        self.ms = float(spec.get("slow_ms", 0)) if enabled and _rank() == spec.get("slow_rank") else 0.0
        self.start = spec.get("slow_from", 1 << 30)
        self.file = spec.get("slow_file") if self.ms else None

    def __call__(self, iteration: int) -> None:
        if self.file is not None and os.path.exists(self.file):
            self.ms, self.file, self.start = float(Path(self.file).read_text() or self.ms), None, 0
        if self.ms and iteration >= self.start:
            time.sleep(self.ms / 1e3)


def _init_gloo() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def _loop(model: torch.nn.Module, steps: int, slow: Slowdown,
          backward: Callable[[torch.nn.Module, int], float] | None = None) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for i in range(steps):
        slow(i)
        if backward is None:
            x, y = _batch(_rank(), i)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            value = float(loss)
        else:
            opt.zero_grad()
            value = backward(model, i)
        opt.step()
        losses.append(value)
    return losses


# -- the stacks: each returns (per-step losses, parameter digest) --------------

def run_ddp(spec: dict, slow: Slowdown) -> tuple[list[float], float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init_gloo()
    model = DDP(_mlp(), bucket_cap_mb=spec.get("bucket_cap_mb", 25))
    return _loop(model, spec["steps"], slow), _digest(model.parameters())


def run_compiled(spec: dict, slow: Slowdown) -> tuple[list[float], float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init_gloo()
    torch._dynamo.reset()  # the second run compiles afresh, as a new job would
    ddp = DDP(_mlp())
    model = torch.compile(ddp, backend=spec.get("backend", "aot_eager"))
    return _loop(model, spec["steps"], slow), _digest(ddp.parameters())


def run_manual(spec: dict, slow: Slowdown) -> tuple[list[float], float]:
    """No wrapper: gradients accumulated over micro-batches, then one all_reduce per parameter."""
    _init_gloo()
    model, accum, world = _mlp(), spec.get("accum", 2), _world()

    def backward(m: torch.nn.Module, i: int) -> float:
        total = 0.0
        for micro in range(accum):
            x, y = _batch(_rank(), i * accum + micro, n=16)
            loss = torch.nn.functional.mse_loss(m(x), y) / accum
            loss.backward()
            total += float(loss)
        for p in m.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        return total

    return _loop(model, spec["steps"], slow, backward), _digest(model.parameters())


def run_fsdp1(spec: dict, slow: Slowdown) -> tuple[list[float], float]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    _init_gloo()
    # One FSDP unit per Linear: several all-gathers and reduce-scatters per step.
    model = FSDP(_mlp(), auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}), use_orig_params=True,
                 device_id=torch.device("cpu"))  # FSDP1 refuses CPU unless told
    return _loop(model, spec["steps"], slow), _digest(model.parameters())


def run_fsdp2(spec: dict, slow: Slowdown) -> tuple[list[float], float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init_gloo()
    mesh = init_device_mesh("cpu", (_world(),))
    model = _mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _loop(model, spec["steps"], slow), _digest(model.parameters())


def run_tp(spec: dict, slow: Slowdown) -> tuple[list[float], float]:
    """Megatron-style MLP: column- then row-parallel; every rank sees the same batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    _init_gloo()
    mesh = init_device_mesh("cpu", (_world(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.ReLU(), torch.nn.Linear(4 * WIDTH, WIDTH))
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def backward(m: torch.nn.Module, i: int) -> float:
        x, y = _batch(0, i)  # tensor parallel: one batch, replicated
        loss = torch.nn.functional.mse_loss(m(x).mean(-1, keepdim=True), y)
        loss.backward()
        return float(loss)

    return _loop(model, spec["steps"], slow, backward), _digest(model.parameters())


def run_hf(spec: dict, slow: Slowdown) -> tuple[list[float], float]:
    """transformers' Trainer (DDP through accelerate) on a 2-layer GPT-2 built from a config."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    class Slow(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            slow(state.global_step)

    class Recording(Trainer):
        losses: list[float] = []

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.losses.append(float(loss))
            return loss

    config = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (256, 16), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=spec["out"] + "/hf", per_device_train_batch_size=4, max_steps=spec["steps"],
                             learning_rate=1e-3, logging_strategy="no", save_strategy="no", report_to=[],
                             use_cpu=True, dataloader_num_workers=0, seed=0, ddp_backend="gloo",
                             disable_tqdm=True)
    trainer = Recording(model=model, args=args, train_dataset=data, callbacks=[Slow()])
    trainer.losses = []
    trainer.train()
    return trainer.losses, _digest(model.parameters())


def run_lightning(spec: dict, slow: Slowdown) -> tuple[list[float], float]:
    """Lightning Trainer(strategy="ddp") with the environment's ranks, as under srun."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss))
            return loss

        def on_train_batch_start(self, batch, batch_idx):
            slow(self.global_step)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(512, WIDTH, generator=g), torch.randn(512, 1, generator=g))
    module = Module()
    # Under srun (the test cluster), as a Lightning user there writes it: the tasks of a node, the nodes.
    nodes = int(os.environ.get("SLURM_NNODES", "1")) if "SLURM_NTASKS" in os.environ else 1
    trainer = L.Trainer(accelerator="cpu", devices=_world() // nodes, num_nodes=nodes, strategy="ddp",
                        max_steps=spec["steps"],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=spec["out"] + "/lightning")
    trainer.fit(module, DataLoader(data, batch_size=8, shuffle=False))
    return module.losses, _digest(module.net.parameters())


STACKS = {"ddp": run_ddp, "compiled": run_compiled, "manual": run_manual, "fsdp1": run_fsdp1,
          "fsdp2": run_fsdp2, "tp": run_tp, "hf": run_hf, "lightning": run_lightning}


def main() -> None:
    spec = json.loads(sys.argv[1])
    for ours, slurm in (("RANK", "SLURM_PROCID"), ("WORLD_SIZE", "SLURM_NTASKS"), ("LOCAL_RANK", "SLURM_LOCALID")):
        if ours not in os.environ and slurm in os.environ:  # one task per rank under srun
            os.environ[ours] = os.environ[slurm]
    torch.set_num_threads(1)
    run = STACKS[spec["stack"]]
    t0 = time.monotonic()
    probed_losses, probed_digest = run(spec, Slowdown(spec, enabled=True))
    import torch_hook  # after the stack: the autoload, not this script, installed the probe

    installed, stats = torch_hook.installed(), torch_hook.stats()
    torch_hook.uninstall()
    t1 = time.monotonic()
    plain_losses, plain_digest = run(spec, Slowdown(spec, enabled=False))
    result = {"rank": dist.get_rank(), "installed": installed, "stats": stats,
              "probed": {"losses": probed_losses, "digest": probed_digest, "s": t1 - t0},
              "plain": {"losses": plain_losses, "digest": plain_digest, "s": time.monotonic() - t1}}
    Path(spec["out"], f"rank{dist.get_rank()}.json").write_text(json.dumps(result, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
