"""The matched node probe: fixed-size GEMM and memory-copy rates per device.

Run by the node check (as a child with a timeout) after the node's fingerprint
changed — a new driver, comm library, kernel or firmware — so the daemon can
compare the node with itself before the change and with its peers under the
same workload.  Sizes are fixed, so two runs are comparable; small on CPU so
the probe costs well under a second.  Prints one JSON object:
``{"gemm_tflops": [...], "membw_gbs": [...]}`` (one entry per device).
Needs torch; exits 3 without it.
"""

from __future__ import annotations

import json
import sys
import time

GPU_N, GPU_BYTES = 8192, 1 << 30
CPU_N, CPU_BYTES = 512, 64 << 20
REPS = 5


def _median_s(fn, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(REPS):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure(torch, device) -> tuple[float, float]:
    on_gpu = device.type == "cuda"
    n, nbytes = (GPU_N, GPU_BYTES) if on_gpu else (CPU_N, CPU_BYTES)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    sync = (lambda: torch.cuda.synchronize(device)) if on_gpu else (lambda: None)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    gemm_s = _median_s(lambda: torch.mm(a, b), sync)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = _median_s(lambda: dst.copy_(src), sync)
    # A copy reads and writes every byte.
    return 2 * n**3 / gemm_s / 1e12, 2 * nbytes / copy_s / 1e9


def main() -> int:
    try:
        import torch
    except ImportError:
        print("node probe needs torch", file=sys.stderr)
        return 3
    if torch.cuda.is_available():  # ROCm builds answer here too
        devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    else:
        devices = [torch.device("cpu")]
    results = [measure(torch, device) for device in devices]
    print(json.dumps({"gemm_tflops": [round(g, 4) for g, _ in results],
                      "membw_gbs": [round(m, 3) for _, m in results]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
