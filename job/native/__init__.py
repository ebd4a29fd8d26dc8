"""Native kernels: C compiled on first use by the machine's C compiler and loaded through ctypes.

Why C: the row-wise Adagrad step of a large-table batch (~42,000 gradient rows of 200 floats) was a fifth of a
WordNet batch in torch ops, five passes over the rows (bench/RESULTS.md, eighth session); the kernel in
``rowkernels.c`` is one. A side's softmax or ranking loss over its score blocks was ~25 torch ops over the
blocks; ``losskernels.c`` makes it one pass per row, and ``operatorkernels.c`` ComplEx's operator one pass
forward and one backward. Why not a torch C++ extension: torch's headers take a
minute to compile against and the runtime image drops them; these sources need only libc, build in about a
second and are called with raw pointers.

Where the library comes from, first found wins:
1. ``job/native/_prebuilt/`` in the installed package (``biggraph build-native``, run by the image build);
2. the user's cache (``$BIGGRAPH_NATIVE_CACHE``, else ``$XDG_CACHE_HOME``/``~/.cache`` ``/biggraph/native``, else a
   private directory under the system temp dir), compiled there by ``$CC`` / ``cc`` / ``gcc`` if missing.
The file name carries a hash of the source and flags, so an upgraded source never loads an old build. Writes go
to a temporary name and are renamed into place, so Hogwild workers starting together never load half a file.

No compiler, a failed build, or ``BIGGRAPH_NATIVE=0``: ``library()`` returns None (logged once) and callers take
their torch path, which computes the same step (tests/test_native.py holds the two to each other).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("rowkernels.c", "losskernels.c", "operatorkernels.c"))
# every exported function and what it returns (a status, or nothing)
SYMBOLS = {**dict.fromkeys(("row_adagrad_f32", "row_adagrad_f64", "full_adagrad_f32", "full_adagrad_f64",
                            "side_loss_f32", "side_loss_f64",
                            "complex_diagonal_backward_f32", "complex_diagonal_backward_f64"), ctypes.c_int),
           **dict.fromkeys(("complex_diagonal_forward_f32", "complex_diagonal_forward_f64"), None)}
PREBUILT = Path(__file__).with_name("_prebuilt")
FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp-simd", "-std=c11")
BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_loaded: dict[str, Optional[ctypes.CDLL]] = {}


def enabled() -> bool:
    """Off when ``BIGGRAPH_NATIVE`` is 0/false/no/off (the torch path then runs everywhere)."""
    return os.environ.get("BIGGRAPH_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def library_name() -> str:
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES) + " ".join(FLAGS).encode()).hexdigest()[:16]
    return f"rowkernels-{sys.platform}-{os.uname().machine}-{digest}.so"


def cache_dir() -> Path:
    """Where builds made at run time go; created private (0700) when under the shared temp dir."""
    explicit = os.environ.get("BIGGRAPH_NATIVE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or (str(Path.home() / ".cache") if Path.home().is_dir() else "")
    if base and os.access(base if Path(base).exists() else Path(base).parent, os.W_OK):
        return Path(base) / "biggraph" / "native"
    return Path(tempfile.gettempdir()) / f"biggraph-native-{os.getuid()}"


def compiler() -> Optional[str]:
    for candidate in (os.environ.get("CC"), "cc", "gcc"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def build(into: Path, private: bool = True) -> Path:
    """Compile the kernels into ``into`` (atomically) and return the library's path. Raises OSError with the
    compiler's message when it fails or no compiler is found. ``private``: a new directory is 0700 (a
    run-time cache), else 0755 (the package's prebuilt directory, read by every user of an image)."""
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler found ($CC, cc, gcc)")
    into.mkdir(parents=True, exist_ok=True, mode=0o700 if private else 0o755)
    target = into / library_name()
    fd, partial = tempfile.mkstemp(dir=into, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", partial, *map(str, SOURCES)], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S, check=False)
        if done.returncode != 0:
            detail = done.stderr.strip()[-2000:] or f"exit status {done.returncode}, no message"
            raise OSError(f"{cc} failed on {', '.join(source.name for source in SOURCES)}: {detail}")
        os.chmod(partial, 0o700 if private else 0o755)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _trusted(directory: Path) -> bool:
    """A run-time cache is only loaded from when it is ours and nobody else can write to it."""
    try:
        info = directory.stat()
    except OSError:
        return True  # not there yet: build() creates it 0700
    return info.st_uid == os.getuid() and not info.st_mode & 0o022


def _locate() -> ctypes.CDLL:
    name = library_name()
    prebuilt = PREBUILT / name
    if prebuilt.is_file():
        return ctypes.CDLL(str(prebuilt))
    directory = cache_dir()
    if not _trusted(directory):
        raise OSError(f"{directory} is writable by others or not owned by this user; set BIGGRAPH_NATIVE_CACHE")
    path = directory / name
    if not path.is_file():
        path = build(directory)
        log.info("built the native kernels: %s", path)
    return ctypes.CDLL(str(path))


def library() -> Optional[ctypes.CDLL]:
    """The loaded kernels, or None (torch fallback); decided (and built) once per process, since every batch asks."""
    if "lib" in _loaded:
        return _loaded["lib"]
    with _lock:
        if "lib" not in _loaded and not enabled():
            _loaded["lib"] = None
        elif "lib" not in _loaded:
            try:
                lib = _locate()
                for symbol, returns in SYMBOLS.items():
                    getattr(lib, symbol).restype = returns
                _loaded["lib"] = lib
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("native kernels unavailable, using torch ops (slower): %s", exc)
                _loaded["lib"] = None
        return _loaded["lib"]
