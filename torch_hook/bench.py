"""The matched micro-benchmark run on a ``probe`` directive.

Every rank of the job runs it at the same window boundary (the ranks agree
first, see ``probe.Probe._agree``), with identical sizes, so timings compare
across ranks under matched conditions:

1. a fixed-size GEMM on the rank's own device -> ``gemm_ms``, ``gemm_tflops``;
2. a fixed-size all-reduce within the rank's island -> ``allreduce_ms``;
3. the ring's links one pair at a time: rank r and r+1 ping-pong a fixed
   buffer while no other transfer touches either of them -> ``p2p`` (the
   round trip, reported by r towards peer r+1 and named with its node).  A
   slow link shows as slow round trips on the two pairs that use it, and
   nowhere else: in a ring where every rank sends and receives at once, each
   timing would also include the neighbour's incoming link, and the slowness
   would smear onto the next node.  The round trip is the pair's *fastest*
   of ``RING_REPS``: a host can delay a transfer but never speed one past
   what its link carries, so the fastest trip is the link's and the slower
   ones add the hosts' scheduling noise.  Each end also reports its
   process's run-queue wait (``wait_ms``: the sender's during that fastest
   trip; ``served_wait_ms``: the answering end's least over the trips it
   answered): on a loaded host a preempted end slows every transfer it takes
   part in exactly as a slow link would, and the daemon must be able to tell
   the two apart.

Other times are medians over a few repetitions after one warm-up.  Each phase is a
collective or follows one, and runs on every rank even if a previous phase
failed locally, so a local error can never leave the ranks out of step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torch_hook.telemetry.host import run_queue_wait_ms

# (GEMM n, all-reduce bytes, ring bytes): small on CPU so a probe costs well
# under a second on shared cores; large enough on GPUs to be bandwidth-bound.
CPU_SIZES = (384, 4 << 20, 1 << 20)
GPU_SIZES = (4096, 256 << 20, 64 << 20)
REPS = 3
# Round trips per ring pair, of which the fastest is reported (module docstring).
RING_REPS = 9


def _once(fn: Callable[[], Any], device: torch.device) -> float:
    """Milliseconds of one run of ``fn`` (device time on a GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()  # the probe is off the training path: waiting is fine here
        return float(start.elapsed_time(end))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Median milliseconds of ``fn`` over REPS runs after one warm-up."""
    fn()
    return float(statistics.median(_once(fn, device) for _ in range(REPS)))


def run(directive_id: str, *, rank: int, world: int, device: torch.device,
        island_group: Any, nodes: list[str] | None, errors: list[str]) -> dict[str, Any]:
    """Run the three phases; return the wire ``probe`` block (``cost_ms`` included)."""
    t_start = time.perf_counter()
    n, ar_bytes, p2p_bytes = GPU_SIZES if device.type == "cuda" else CPU_SIZES
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    out: dict[str, Any] = {"id": directive_id}

    try:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        gemm_ms = _timed(lambda: torch.mm(a, b), device)
        out["gemm_ms"] = round(gemm_ms, 4)
        out["gemm_tflops"] = round(2 * n**3 / (gemm_ms * 1e-3) / 1e12, 6)
    except Exception as err:  # noqa: BLE001
        errors.append(f"gemm: {err!r}")

    if world > 1:
        buf = torch.ones(ar_bytes // 4, device=device, dtype=torch.float32)
        try:
            out["allreduce_ms"] = round(_timed(lambda: dist.all_reduce(buf, group=island_group), device), 4)
        except Exception as err:  # noqa: BLE001
            errors.append(f"allreduce: {err!r}")

        try:
            entry, served_wait_ms = _ring_pairs(rank, world, device, p2p_bytes)
            if served_wait_ms is not None:
                out["served_wait_ms"] = served_wait_ms
            if entry is not None:
                if nodes and entry["peer"] < len(nodes):
                    entry["node"] = nodes[entry["peer"]]
                out["p2p"] = [entry]
        except Exception as err:  # noqa: BLE001
            errors.append(f"p2p: {err!r}")

    out["cost_ms"] = round((time.perf_counter() - t_start) * 1e3, 3)
    return out


def _ring_phases(world: int) -> list[list[int]]:
    """Pairs (k, k+1 mod world), named by k, grouped so no rank is in two pairs of one phase."""
    if world == 2:
        return [[0]]
    phases = [[k for k in range(world) if k % 2 == 0], [k for k in range(world) if k % 2 == 1]]
    if world % 2:
        # The closing pair (world-1, 0) shares rank 0 with pair 0: a phase of its own.
        phases[0].remove(world - 1)
        phases.append([world - 1])
    return phases


def _waited(before: float | None) -> float | None:
    after = run_queue_wait_ms()
    if before is None or after is None:
        return None
    return round(max(0.0, after - before), 4)


def _fastest_trip(round_trip: Callable[[], Any], device: torch.device) -> tuple[float, float | None]:
    """The fastest of RING_REPS round trips after one warm-up, and its sender's run-queue wait."""
    round_trip()
    best: tuple[float, float | None] | None = None
    for _ in range(RING_REPS):
        before = run_queue_wait_ms()
        ms = _once(round_trip, device)
        waited = _waited(before)
        if best is None or ms < best[0]:
            best = (ms, waited)
    assert best is not None
    return best


def _ring_pairs(rank: int, world: int, device: torch.device,
                nbytes: int) -> tuple[dict[str, Any] | None, float | None]:
    """Ping-pong each ring pair in turn.

    Returns this rank's entry as a pair's left end (its fastest round trip and
    that trip's run-queue wait) and, as the right end of the pair that ends at
    it, its least run-queue wait over the trips it answered: the answering end
    cannot tell which trip was the sender's fastest, and a host loaded enough
    to delay every trip delays its least-delayed one too.
    """
    buf = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    entry, served_wait_ms = None, None
    for phase in _ring_phases(world):
        dist.barrier()  # every rank enters the phase together: no pair waits on another
        for k in phase:
            left, right = k, (k + 1) % world
            if rank == left:
                def round_trip(peer: int = right) -> None:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                ms, wait_ms = _fastest_trip(round_trip, device)
                entry = {"peer": right, "ms": round(ms, 4)}
                if wait_ms is not None:
                    entry["wait_ms"] = wait_ms
            elif rank == right:
                waits = []
                for trip in range(RING_REPS + 1):  # the warm-up and each timed round trip
                    before = run_queue_wait_ms()
                    dist.recv(buf, left)
                    dist.send(buf, left)
                    waited = _waited(before)
                    if trip and waited is not None:
                        waits.append(waited)
                served_wait_ms = min(waits) if waits else None
    return entry, served_wait_ms
