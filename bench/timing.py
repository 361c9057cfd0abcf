"""One timer for the kernel benchmarks: median of CUDA-event timings (one wall-clock run on CPU)."""

from __future__ import annotations

import time

import torch


def timed(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn`` over ``iters`` CUDA-event timings after ``warmup`` calls; on CPU one
    wall-clock run (smoke paths only, no speed claim)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2] * 1e-3
