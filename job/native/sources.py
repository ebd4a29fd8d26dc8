"""What the native kernels are built from and how, shared by the wheel's build (setup.py loads this file by path,
before the package is importable) and the run-time build (job/native): one list of sources, one set of flags.

Standard library only, and no package imports: setup.py runs it without ``job`` on the path.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = tuple(HERE / name for name in ("rowkernels.c", "losskernels.c", "operatorkernels.c"))
HEADERS = (HERE / "bg_clones.h",)
# -O3 for the vectoriser, -fopenmp-simd for the `omp simd` loops (no OpenMP runtime); the per-CPU code comes from
# bg_clones.h's target_clones, not from -march, so one build runs on every x86-64 and uses AVX2/AVX-512 where present
COMPILE_FLAGS = ("-O3", "-fopenmp-simd", "-std=c11")
# linked against libm (exp, log, sqrt): the library names what it needs rather than counting on the process's
LIBRARIES = ("m",)
# where the wheel's build goes, relative to job/native (a directory without __init__.py: no importable module)
BUILT_RELATIVE = Path("_ext", "kernels.so")


def source_digest() -> str:
    """A hash of the kernels' source: built into the library (``bg_source_digest``), so that a library built from
    other sources (a stale in-place build of a checkout) is never loaded, and part of a run-time build's name."""
    return hashlib.sha256(b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))).hexdigest()[:16]


def digest_define(digest: str) -> str:
    """The compiler argument that embeds ``digest`` (read back by the loader)."""
    return f'-DBG_SOURCE_DIGEST="{digest}"'
