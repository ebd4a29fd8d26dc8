"""Keep the memory a batch frees inside the process for the next batch.

A batch on a mid-size graph allocates a dozen 10-20 MB temporaries per side (gathered rows, their
gradients, the chunk-by-negatives products). glibc serves blocks above its mmap threshold (128 KiB at
start, raised adaptively only up to what was last freed) with fresh ``mmap`` calls and gives them back on
``free``, so every batch pays a page fault per 4 KiB page of every temporary, zeroed by the kernel. In
a virtual machine a fault costs microseconds: on the 2-vCPU VM the WordNet-KG batch spent a fifth of
its time faulting (bench/RESULTS.md). Raising the threshold to glibc's ceiling (32 MiB on 64-bit) and
the heap's trim threshold keeps those blocks in the heap, where the next batch reuses them.

The trainer's peak memory does not grow: the same temporaries existed before, they are now reused rather
than returned. What changes is that a process keeps its high-water mark between batches, which is what
``memory_budget`` already charges for each process. Partitions (hundreds of MiB) stay above the threshold
and are still returned to the system when evicted. Other C libraries (musl) have no such knobs: then
nothing happens.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger("biggraph")

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold above HEAP_MAX/2: 32 MiB on 64-bit
MMAP_THRESHOLD_BYTES = 32 << 20
# free memory kept at the top of the heap before it is trimmed back to the system
TRIM_THRESHOLD_BYTES = 1 << 30

# set to "0" to leave the C library's defaults alone (for comparisons: bench/train_bench.py)
ENV_SWITCH = "BIGGRAPH_KEEP_FREED_MEMORY"

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Tune glibc's malloc so that batch temporaries are reused; True when it took effect.

    Called once per process that trains (the trainer and each Hogwild worker, which are spawned, not
    forked, and so start with the defaults), and by each pod of an import (``job.data.importing.pods``),
    whose batches of parsed edges allocate temporaries the same way. Idempotent.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(ENV_SWITCH, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # both or neither: a raised mmap threshold without the trim threshold would give the memory back anyway
    if mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        _applied = True
    else:
        logger.debug("malloc tuning not available in this C library; batch temporaries are returned each batch")
    return _applied
