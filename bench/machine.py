"""What the machine under a benchmark can do, printed beside its figures (this VM's CPU changes between
sessions: torch's float32 matmul is ~3x slower on the AMD kind than on the Intel one)."""

from __future__ import annotations

import time

import torch


def matmul_rate(size: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of a float32 ``size`` x ``size`` matrix product with torch's default threads."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up: thread pool and MKL's first-call set-up
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return repeats * 2 * size**3 / (time.perf_counter() - started) / 1e9
