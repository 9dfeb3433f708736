"""A plain DDP training job: gloo, CPU, one process per Slurm task.

There is deliberately no Artemis code here: under ``sbatch --artemis=on`` the
SPANK plugin puts the probe's autoload folder on PYTHONPATH and the job is
instrumented without being changed — which is what these tests prove.

Ranks come from Slurm (SLURM_PROCID / SLURM_NTASKS); MASTER_ADDR and
MASTER_PORT from the batch script.  The run ends after ``--steps`` steps,
``--seconds`` seconds, or when the file ``--stop-file`` appears.

The only test hook is the data-loader stall: while ``<stall dir>/<node>`` exists
and holds a number of seconds, every batch on that node waits that long in the
loader (per batch, so handing the rank fewer samples does not shorten it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--stop-file", type=Path)
    parser.add_argument("--stall-dir", type=Path)
    parser.add_argument("--progress-dir", type=Path)
    return parser.parse_args()


class LoaderStall:
    """collate_fn that waits while the node's stall file says so."""

    def __init__(self, folder: Path | None, node: str):
        self.path = folder / node if folder else None

    def __call__(self, batch):
        if self.path is not None:
            try:
                delay = float(self.path.read_text() or 0)
            except (OSError, ValueError):
                delay = 0.0
            if delay > 0:
                time.sleep(min(delay, 5.0))
        xs, ys = zip(*batch)
        return torch.stack(xs), torch.stack(ys)


def report_progress(folder: Path, rank: int, node: str, steps: int, seconds: float,
                    final: bool = False) -> None:
    """The job's own progress log (what a training script prints), one file per rank."""
    path = folder / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank, "node": node, "steps": steps,
                               "seconds": round(seconds, 3), "final": final}))
    os.replace(tmp, path)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    dist.init_process_group("gloo", rank=rank, world_size=world)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8192, args.width), torch.randn(8192, 1))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler,
                        collate_fn=LoaderStall(args.stall_dir, node))
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
        torch.nn.Linear(args.width, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    start, steps, epoch = time.monotonic(), 0, 0
    done = False
    while not done:
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            steps += 1
            if steps % 10:
                continue
            if args.progress_dir is not None:
                report_progress(args.progress_dir, rank, node, steps, time.monotonic() - start)
            stop = steps >= args.steps or time.monotonic() - start > args.seconds
            stop = stop or (args.stop_file is not None and args.stop_file.exists())
            # Every rank must leave the loop at the same step, or the others hang in all-reduce.
            flag = torch.tensor([1.0 if stop else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                done = True
                break
        epoch += 1
    if args.progress_dir is not None:
        report_progress(args.progress_dir, rank, node, steps, time.monotonic() - start, final=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
