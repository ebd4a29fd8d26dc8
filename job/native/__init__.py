"""Native kernels: C compiled on first use by the machine's C compiler and loaded through ctypes.

Why C: the row-wise Adagrad step of a large-table batch (~42,000 gradient rows of 200 floats) was a fifth of a
WordNet batch in torch ops, five passes over the rows (bench/RESULTS.md, eighth session); the kernel in
``rowkernels.c`` is one. A side's softmax or ranking loss over its score blocks was ~25 torch ops over the
blocks; ``losskernels.c`` makes it one pass per row, and ``operatorkernels.c`` ComplEx's operator one pass
forward and one backward. Why not a torch C++ extension: torch's headers take a
minute to compile against and the runtime image drops them; these sources need only libc, build in about a
second and are called with raw pointers.

Where the library comes from, first found wins (``loaded()`` and one log line say which):
1. ``job/native/_ext/kernels.so``: built into the wheel by setup.py (an ``Extension`` over the same sources and
   flags, ``sources.py``), so an installed wheel needs no compiler; an editable install builds it in place;
2. ``job/native/_prebuilt/`` in the installed package (``biggraph build-native``, for a source install without one);
3. the user's cache (``$BIGGRAPH_NATIVE_CACHE``, else ``$XDG_CACHE_HOME``/``~/.cache`` ``/biggraph/native``, else a
   private directory under the system temp dir), compiled there by ``$CC`` / ``cc`` / ``gcc`` if missing: the
   fallback of a source install whose build had no compiler.
Every library carries the digest of the sources it was built from (``bg_source_digest``): one built from other
sources (an in-place build older than an edit) is passed over with a warning. A run-time build's file name also
carries the digest and the flags. Writes go to a temporary name and are renamed into place, so Hogwild workers
starting together never load half a file.

Each library holds the hot loops once per x86-64 level (``bg_clones.h``: AVX-512, AVX2 + FMA, SSE2), the CPU's
best picked at load, so neither the wheel nor the image is tied to the CPU it was built on.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from job.native.sources import BUILT_RELATIVE, COMPILE_FLAGS, LIBRARIES, SOURCES, digest_define, source_digest

log = logging.getLogger(__name__)

# every exported function and what it returns (a status, or nothing)
SYMBOLS = {**dict.fromkeys(("row_adagrad_f32", "row_adagrad_f64", "full_adagrad_f32", "full_adagrad_f64",
                            "side_loss_f32", "side_loss_f64",
                            "complex_diagonal_backward_f32", "complex_diagonal_backward_f64"), ctypes.c_int),
           **dict.fromkeys(("complex_diagonal_forward_f32", "complex_diagonal_forward_f64"), None)}
BUILT = Path(__file__).parent / BUILT_RELATIVE  # the wheel's (setup.py)
PREBUILT = Path(__file__).with_name("_prebuilt")
FLAGS = ("-shared", "-fPIC", *COMPILE_FLAGS)
LINK = tuple(f"-l{name}" for name in LIBRARIES)  # after the sources
ORIGINS = {"package": "built with the package", "prebuilt": "prebuilt by biggraph build-native",
           "cache": "built at run time"}
CLONE_LEVELS = {4: "x86-64-v4 (AVX-512) clones", 3: "x86-64-v3 (AVX2) clones", 0: "baseline code",
                -1: "per-CPU clones"}
BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_loaded: dict[str, Optional["Loaded"]] = {}  # "lib": what library() decided, once per process


@dataclass(frozen=True)
class Loaded:
    """Which library a process runs: ``origin`` is a key of ORIGINS (the wheel's build, prebuilt, run-time build);
    ``clone_level`` is what ``bg_clone_level`` answers (4, 3, 0 or -1: see CLONE_LEVELS)."""

    lib: ctypes.CDLL
    path: Path
    origin: str
    clone_level: int

    def describe(self) -> str:
        return (f"native kernels: {ORIGINS[self.origin]}, {CLONE_LEVELS.get(self.clone_level, 'unknown code')} "
                f"({self.path})")


def enabled() -> bool:
    """Off when ``BIGGRAPH_NATIVE`` is 0/false/no/off (the torch path then runs everywhere)."""
    return os.environ.get("BIGGRAPH_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def library_name() -> str:
    flags = hashlib.sha256(" ".join((*FLAGS, *LINK)).encode()).hexdigest()[:8]
    return f"rowkernels-{sys.platform}-{os.uname().machine}-{source_digest()}-{flags}.so"


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


def build(into: Path, *, private: bool = True, digest: Optional[str] = None) -> Path:
    """Compile the kernels into ``into`` (atomically) and return the library's path. Raises OSError with the
    compiler's message when it fails or no compiler is found. ``private``: a new directory is 0700 (a
    run-time cache), else 0755 (the package's prebuilt directory, read by every user of an image). ``digest``:
    the source digest to embed (tests give a wrong one to make a stale library); default the sources'."""
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler found ($CC, cc, gcc)")
    into.mkdir(parents=True, exist_ok=True, mode=0o700 if private else 0o755)
    target = into / library_name()
    fd, partial = tempfile.mkstemp(dir=into, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, digest_define(digest or source_digest()), "-o", partial,
                               *map(str, SOURCES), *LINK], capture_output=True, text=True,
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


def _open(path: Path, origin: str) -> Optional[Loaded]:
    """The library at ``path`` when it was built from these sources, else None (a warning: it is passed over)."""
    lib = ctypes.CDLL(str(path))
    try:
        built_from = ctypes.string_at(ctypes.addressof(ctypes.c_char.in_dll(lib, "bg_source_digest"))).decode()
        level = int(ctypes.CFUNCTYPE(ctypes.c_int)(("bg_clone_level", lib))())
    except (AttributeError, ValueError):
        built_from, level = "", 0
    if built_from != source_digest():
        log.warning("passing over the %s kernels %s: built from other sources than %s holds (rebuild: pip install "
                    "the package again, or biggraph build-native)", origin, path, Path(__file__).parent)
        return None
    return Loaded(lib, path, origin, level)


def _locate() -> Loaded:
    for path, origin in ((BUILT, "package"), (PREBUILT / library_name(), "prebuilt")):
        found = _open(path, origin) if path.is_file() else None
        if found is not None:
            return found
    directory = cache_dir()
    if not _trusted(directory):
        raise OSError(f"{directory} is writable by others or not owned by this user; set BIGGRAPH_NATIVE_CACHE")
    path = directory / library_name()
    if not path.is_file():
        path = build(directory)
        log.info("built the native kernels: %s", path)
    found = _open(path, "cache")
    if found is None:
        raise OSError(f"{path} was not built from the installed sources")
    return found


def loaded() -> Optional[Loaded]:
    """Which library ``library()`` loaded (None: none, the torch path runs); loads it when not decided yet."""
    library()
    return _loaded.get("lib")


def library() -> Optional[ctypes.CDLL]:
    """The loaded kernels, or None (torch fallback); decided (and built) once per process, since every batch asks."""
    if "lib" not in _loaded:
        with _lock:
            if "lib" not in _loaded and not enabled():
                _loaded["lib"] = None
            elif "lib" not in _loaded:
                try:
                    found = _locate()
                    for symbol, returns in SYMBOLS.items():
                        getattr(found.lib, symbol).restype = returns
                    _loaded["lib"] = found
                    log.info("%s", found.describe())
                except (OSError, subprocess.SubprocessError) as exc:
                    log.warning("native kernels unavailable, using torch ops (slower): %s", exc)
                    _loaded["lib"] = None
    decided = _loaded["lib"]
    return None if decided is None else decided.lib
