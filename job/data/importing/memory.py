"""How an import process takes memory: from one heap that keeps what it frees, in 4 KiB pages (issue #46).

Most of an import pod's system time is the kernel handing it fresh memory: each page is zeroed when first
touched, and in a virtual machine a page the host has taken back costs far more than the zeroing. A pod pays
for its whole working set, whatever its share of the edges, so every pod added costs one working set more;
with four pods on the 20M-edge bench that was over half of their CPU beyond one process's (bench/RESULTS.md).
Three settings make the working set cheaper, in every import process (pods and the one-process import alike):

- glibc's malloc keeps the blocks a batch frees for the next batch (``keep_freed_memory``), in one arena: pyarrow's
  reader threads would otherwise each get an arena of their own, whose freed blocks the main thread's numpy arrays
  cannot reuse (on the 20M-edge bench: 16-22% fewer page faults, peak RSS 409-456 MiB against 446-560);
- pyarrow allocates from that same heap (its system pool) rather than from mimalloc, which keeps its own
  segments beside glibc's heap and backs them with 2 MiB huge pages;
- numpy does not ask for huge pages on its large arrays: a huge page is zeroed whole at its first touch, 2 MiB
  for an array that may use a few KiB of it before it is freed, and then not reused by the next batch's arrays
  of another size.

None of this changes what is computed: the output is the same byte for byte. ``BIGGRAPH_IMPORT_MEMORY=default``
leaves the libraries' own choices (for comparisons: bench/import_pods_bench.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

from job.train.batch.allocator import keep_freed_memory

logger = logging.getLogger("biggraph")

ENV_SWITCH = "BIGGRAPH_IMPORT_MEMORY"  # "default": leave malloc, pyarrow's pool and numpy's huge pages alone
_M_ARENA_MAX = -8  # mallopt parameter (malloc.h)


def settle_import_memory() -> bool:
    """Apply the settings above to this process (idempotent); False when the switch leaves the defaults."""
    if os.environ.get(ENV_SWITCH, "") == "default":
        return False
    keep_freed_memory()
    if sys.platform.startswith("linux"):  # before pyarrow starts its threads: a thread's arena is picked once
        try:
            ctypes.CDLL(None).mallopt(_M_ARENA_MAX, 1)
        except (OSError, AttributeError):  # not glibc
            logger.debug("malloc arenas not tunable in this C library")
    import pyarrow as pa  # ~0.3 s, but every import reads its input through it anyway

    if pa.default_memory_pool().backend_name != "system":
        pa.set_memory_pool(pa.system_memory_pool())
    # numpy reads NUMPY_MADVISE_HUGEPAGE when it is imported (before this runs); this is its switch at run time
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # numpy 2 / 1.x
    switch = getattr(core.multiarray, "_set_madvise_hugepage", None)
    if switch is not None:
        switch(False)
    return True
