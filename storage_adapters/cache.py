"""A bounded local cache of remote files, with background prefetch.

``edge_read_mode = stage`` downloads each bucket's edge file here before h5py opens it.
The cache holds at most ``max_bytes`` of *unused* files: when a new file needs room, the
least recently used files that nobody has open are deleted. Files in use (pinned) and
downloads in flight are never evicted; a file bigger than the bound is still downloaded
(training needs it) and is the only one kept.

Where and how much: ``BIGGRAPH_EDGE_CACHE_DIR`` (default: a fresh temporary directory
removed at exit) and ``BIGGRAPH_EDGE_CACHE_BYTES`` (default: 10 GiB or half the free
disk there, whichever is smaller), or the job's ``StorageSettings(cache_dir=..., cache_bytes=...)``.
A cached copy is reused only while the object's size and ETag (or mtime) are unchanged.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import storage_adapters as storage

logger = logging.getLogger("biggraph.storage")

_PREFIX = "bgc-"
DEFAULT_MAX_BYTES = 10 * 2**30


@dataclass
class _Entry:
    url: str
    path: str
    identity: tuple[Any, ...]
    size: int
    pins: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    last_used: float = 0.0


def _identity(meta: dict[str, Any]) -> tuple[Any, ...]:
    tag = meta.get("ETag") or meta.get("etag") or meta.get("md5Hash") or meta.get("LastModified") or meta.get("mtime")
    return (int(meta.get("size") or 0), str(tag))


class FileCache:
    def __init__(self, directory: str | None = None, max_bytes: int | None = None) -> None:
        self._own_dir = directory is None
        if directory is None:
            directory = tempfile.mkdtemp(prefix="biggraph-edge-cache-")
            atexit.register(shutil.rmtree, directory, True)
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        for name in os.listdir(directory):  # leftovers of an earlier process: we cannot trust them
            if name.startswith(_PREFIX):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))
        if max_bytes is None:
            free = shutil.disk_usage(directory).free
            max_bytes = max(256 * 2**20, min(DEFAULT_MAX_BYTES, free // 2))
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="biggraph-prefetch")
        self.downloads = 0  # how many files were fetched (tests and the benchmark read it)
        self.hits = 0

    # bookkeeping (call with the lock held) ---------------------------------------------------
    def _bytes(self) -> int:
        return sum(e.size for e in self._entries.values())

    def _drop(self, entry: _Entry) -> None:
        if self._entries.get(entry.url) is entry:
            del self._entries[entry.url]
        with contextlib.suppress(OSError):
            os.unlink(entry.path)

    def _make_room(self, needed: int) -> bool:
        """Evict unused files (oldest first) until ``needed`` more bytes fit; False if they cannot."""
        for entry in list(self._entries.values()):
            if self._bytes() + needed <= self.max_bytes:
                break
            if entry.pins == 0 and entry.done.is_set():
                self._drop(entry)
        return self._bytes() + needed <= self.max_bytes

    def _path_for(self, url: str) -> str:
        digest = hashlib.sha1(url.encode()).hexdigest()[:16]
        base = "".join(c if c.isalnum() or c in "._-" else "_" for c in url.rstrip("/").rsplit("/", 1)[-1])[-80:]
        return os.path.join(self.directory, f"{_PREFIX}{digest}-{base}")

    def _claim(self, url: str, meta: dict[str, Any], pin: bool, optional: bool) -> tuple[_Entry | None, bool]:
        """The entry for ``url`` (pinned if asked) and whether the caller must download it."""
        identity = _identity(meta)
        with self._lock:
            entry = self._entries.get(url)
            if entry is not None and entry.done.is_set() and (entry.error is not None or entry.identity != identity):
                if entry.pins == 0:
                    self._drop(entry)
                else:
                    del self._entries[url]  # still open elsewhere: leave its file to its readers' exit
                entry = None
            if entry is not None:
                if pin:
                    entry.pins += 1
                entry.last_used = time.monotonic()
                self._entries.move_to_end(url)
                return entry, False
            size = int(meta.get("size") or 0)
            if not self._make_room(size):
                if optional:
                    return None, False
                if size > self.max_bytes:
                    logger.warning("%s: %d bytes is more than the whole edge cache (%d bytes)", url, size, self.max_bytes)
            entry = _Entry(url, self._path_for(url), identity, size, pins=1 if pin else 0, last_used=time.monotonic())
            self._entries[url] = entry
            return entry, True

    def _download(self, entry: _Entry) -> None:
        part = f"{entry.path}.part{threading.get_ident()}"
        try:
            storage.get_file(entry.url, part)
            os.replace(part, entry.path)
            self.downloads += 1
        except BaseException as err:  # handed to whoever waits on the entry
            entry.error = err
            with contextlib.suppress(OSError):
                os.unlink(part)
        finally:
            entry.done.set()

    # public ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def acquire(self, url: str) -> Iterator[str]:
        """A local path with the bytes of ``url``, kept (not evicted) until the block ends."""
        meta = storage.info(url)
        for attempt in (0, 1):
            claimed, mine = self._claim(url, meta, pin=True, optional=False)
            assert claimed is not None  # optional=False: _claim always returns an entry
            entry: _Entry = claimed
            if mine:
                self._download(entry)
            else:
                entry.done.wait()
            if entry.error is None:
                break
            with self._lock:
                entry.pins -= 1
                if entry.pins == 0:
                    self._drop(entry)
            if mine or attempt == 1:
                raise entry.error  # a failed prefetch is retried once in the foreground
        if not mine:
            self.hits += 1
        try:
            yield entry.path
        finally:
            with self._lock:
                entry.pins -= 1
                entry.last_used = time.monotonic()
                if self._entries.get(url) is not entry and entry.pins == 0:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)  # replaced by a newer version of the object meanwhile
                self._make_room(0)

    def prefetch(self, url: str) -> Future | None:
        """Start downloading ``url`` in the background if it is not cached yet and fits."""

        def work() -> None:
            try:
                meta = storage.info(url)
            except Exception as err:  # the foreground read will report it
                logger.debug("prefetch of %s skipped: %s", url, type(err).__name__)
                return
            entry, mine = self._claim(url, meta, pin=False, optional=True)
            if entry is None:
                logger.debug("prefetch of %s skipped: the cache is full of files in use", url)
            elif mine:
                self._download(entry)
                if entry.error is not None:
                    with self._lock:
                        self._drop(entry)

        return self._executor.submit(storage.carry(work))  # the job's endpoint, in the pool thread too

    def cached(self, url: str) -> bool:
        with self._lock:
            entry = self._entries.get(url)
            return entry is not None and entry.done.is_set() and entry.error is None

    def total_bytes(self) -> int:
        with self._lock:
            return self._bytes()

    def clear(self) -> None:
        with self._lock:
            for entry in list(self._entries.values()):
                if entry.pins == 0 and entry.done.is_set():
                    self._drop(entry)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self.clear()
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)
