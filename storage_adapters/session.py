"""Storage settings that belong to one job, not to the process.

A job's storage settings (the config's ``storage_options``, its ``edge_read_mode``, where stage mode caches
edge files) travel with the job: an API call enters ``using(StorageSettings(...))`` and every storage call made
inside it - in this thread, or in a thread started through :func:`carry` - sees those settings and that job's
edge cache. Two jobs in one process (a notebook importing to MinIO while it evaluates a model on AWS) therefore
never see each other's endpoint, and nothing has to be reset afterwards.

The mechanism is a :class:`contextvars.ContextVar`, as :func:`decimal.localcontext` scopes a precision: it
follows the call stack rather than a module variable, so it cannot leak from one job into the next. Threads do
not inherit a context by themselves: whoever starts a worker thread that does storage I/O wraps its target with
:func:`carry`. Outside any ``using`` block the defaults apply: no extra filesystem arguments (endpoints and
credentials come from the environment, as boto and gcsfs read it), stage mode, a temporary cache.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from storage_adapters.cache import FileCache

EDGE_READ_MODES = ("stage", "stream")
T = TypeVar("T")


@dataclass(frozen=True)
class StorageSettings:
    """What a job says about its storage; ``options`` may hold credentials, so it is never shown by ``repr``."""

    options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    edge_read_mode: str = "stage"
    cache_dir: str | None = None  # stage mode's download cache (default: $BIGGRAPH_EDGE_CACHE_DIR or a temp dir)
    cache_bytes: int | None = None  # its bound (default: $BIGGRAPH_EDGE_CACHE_BYTES, else min(10 GiB, free/2))

    def __post_init__(self) -> None:
        if self.edge_read_mode not in EDGE_READ_MODES:
            raise ValueError(f"edge_read_mode must be one of {', '.join(EDGE_READ_MODES)}, got {self.edge_read_mode!r}")
        if not isinstance(self.options, Mapping):
            raise TypeError(f"storage options must be a mapping, got {type(self.options).__name__}")


class StorageSession:
    """The settings in force plus the state that goes with them (the stage-mode edge cache, made on first use)."""

    def __init__(self, settings: StorageSettings) -> None:
        self.settings = settings
        self._cache: FileCache | None = None
        self._memos: dict[str, dict[Any, Any]] = {}
        self._lock = threading.Lock()

    def memo(self, name: str) -> dict[Any, Any]:
        """A dictionary that lives as long as this session: what callers remember about URLs (a manifest read, a
        file verified) is only true under these settings (another endpoint may serve the same URL otherwise)."""
        with self._lock:
            return self._memos.setdefault(name, {})

    def cache(self) -> FileCache:
        with self._lock:
            if self._cache is None:
                directory = self.settings.cache_dir or os.environ.get("BIGGRAPH_EDGE_CACHE_DIR") or None
                max_bytes = self.settings.cache_bytes
                if max_bytes is None and os.environ.get("BIGGRAPH_EDGE_CACHE_BYTES"):
                    max_bytes = int(float(os.environ["BIGGRAPH_EDGE_CACHE_BYTES"]))
                self._cache = FileCache(directory, max_bytes)
            return self._cache

    def close(self) -> None:
        with self._lock:
            if self._cache is not None:
                self._cache.close()
                self._cache = None


_DEFAULT = StorageSession(StorageSettings())
_CURRENT: contextvars.ContextVar[StorageSession] = contextvars.ContextVar("biggraph_storage", default=_DEFAULT)


def current() -> StorageSession:
    """The session of the job this code runs for (the defaults outside any ``using`` block)."""
    return _CURRENT.get()


@contextlib.contextmanager
def using(settings: StorageSettings) -> Iterator[StorageSession]:
    """Run the block with ``settings``; its edge cache is closed (and its temporary files removed) at the end."""
    session = StorageSession(settings)
    token = _CURRENT.set(session)
    try:
        yield session
    finally:
        _CURRENT.reset(token)
        session.close()


def carry(func: Callable[..., T]) -> Callable[..., T]:
    """``func`` bound to the caller's storage session, to run in another thread (a pool worker, a prefetcher)."""
    session = _CURRENT.get()

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> T:
        token = _CURRENT.set(session)
        try:
            return func(*args, **kwargs)
        finally:
            _CURRENT.reset(token)

    return run
