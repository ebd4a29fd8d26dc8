"""Opening remote HDF5 edge files: staged through a bounded local cache, or streamed with read-ahead.

``stage`` (the default) downloads the whole bucket file into the local cache
(:mod:`storage_adapters.cache`) and lets h5py open the local copy: every read after that
is at local-disk speed, and :func:`prefetch` fetches the next bucket in the background
while the current one trains. ``stream`` opens the object through fsspec with a large
read-ahead block (50 MiB) and lets h5py read it in place: no local disk is used, but
each read waits on the network. Local paths (a mounted volume) are opened directly in
both modes.

The trainer calls ``prefetch(edges_file(edge_path, lhs, rhs))`` for the bucket after the
current one; it is a no-op for local paths and in stream mode.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import h5py

import storage_adapters as storage
from storage_adapters.errors import NotHDF5Error
from storage_adapters.fs import is_local, local_path
from storage_adapters.retry import call_with_retry
from storage_adapters.session import EDGE_READ_MODES, current

logger = logging.getLogger("biggraph.storage")

STREAM_BLOCK_SIZE = 50 * 2**20  # measured: 166-216 MB/s from moto with 50 MiB, 15-18 MB/s with 1 MiB
__all__ = ["EDGE_READ_MODES", "STREAM_BLOCK_SIZE", "RetryingFile", "get_edge_read_mode", "open_h5", "prefetch"]


_gc_lock = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic cycle collection, in any thread, during the block (nested and concurrent uses count).

    h5py holds its global lock while it calls a Python file object's methods. A stream-mode read waits there on
    fsspec's event-loop thread; if the cycle collector ran on that thread (or on any other thread the read waits
    for, such as an in-process S3 server) and found an unreachable h5py object, freeing it would wait for the
    lock the reader holds: a deadlock no timeout can break (h5py issue #2019; it hung CI runs in S3 stream tests).
    Objects are still freed by reference counting meanwhile; the collector resumes when the last read ends.
    """
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


def get_edge_read_mode() -> str:
    """The job's ``edge_read_mode`` (see :mod:`storage_adapters.session`)."""
    return current().settings.edge_read_mode


def prefetch(url: str) -> Future | None:
    """Start downloading the edge file ``url`` into the stage cache in the background.

    Returns at once (a Future, or None when there is nothing to do: a local path or
    stream mode). Failures are not raised here: the later ``open_h5`` reports them.
    """
    if storage.is_local(url) or get_edge_read_mode() != "stage":
        return None
    try:
        return current().cache().prefetch(url)
    except Exception as err:  # prefetching is only ever an optimisation
        logger.debug("prefetch of %s not started: %s", url, type(err).__name__)
        return None


def _open_h5(source: Any, url: str) -> h5py.File:
    try:
        return h5py.File(source, "r")
    except FileNotFoundError:
        raise
    except OSError as err:
        text = str(err)
        raise NotHDF5Error(url, text.split("(")[0].strip() or text[:80], text) from None


@contextlib.contextmanager
def open_h5(url: str, verify: Callable[[str | None], None] | None = None) -> Iterator[h5py.File]:
    """An h5py handle on an HDF5 file at any URL; ``verify`` is called first with a local path holding its bytes
    (the file itself, or stage mode's staged copy) or None (stream mode: it must read the object itself).

    A missing object raises ``FileNotFoundError``, bytes that are not HDF5 ``NotHDF5Error``.
    """
    if is_local(url):
        path = local_path(url)
        if verify is not None:
            verify(path)
        with _open_h5(path, url) as handle:
            yield handle
        return
    if get_edge_read_mode() == "stream":
        if verify is not None:
            verify(None)
        raw = RetryingFile(url, block_size=STREAM_BLOCK_SIZE)
        with raw, _open_h5(raw, url) as handle:
            yield handle
        return
    staged = current().cache().acquire(url)
    path = staged.__enter__()
    try:
        if verify is not None:
            verify(path)
        with _open_h5(path, url) as handle:
            yield handle
    finally:
        staged.__exit__(None, None, None)


class RetryingFile(io.RawIOBase):
    """A read-only remote file for h5py whose reads survive transient failures: fsspec's read-ahead cache over
    ranged reads (one per ``block_size``), each retried (``storage_adapters.retry``) and checked whole, so h5py
    never sees a hiccup."""

    def __init__(self, url: str, block_size: int = STREAM_BLOCK_SIZE) -> None:
        from fsspec.caching import ReadAheadCache

        super().__init__()
        self.url, self._pos, self._size = url, 0, storage.size(url)
        fs, path = storage.get_filesystem(url)

        def fetch(start: int, end: int) -> bytes:
            def attempt() -> bytes:
                data = fs.cat_file(path, start=start, end=end)
                if len(data) != end - start:
                    raise ConnectionResetError(f"short read: {len(data)} of {end - start} bytes")
                return data

            with collector_paused():  # h5py holds its lock around this call: see collector_paused
                return call_with_retry(url, "read", attempt)

        self._cache = ReadAheadCache(block_size, fetch, self._size)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos}.get(whence, self._size) + offset
        return self._pos

    def read(self, size: int = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._pos + size)
        data = self._cache._fetch(self._pos, end)  # fsspec's cache interface (what its own file objects call)
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._cache.cache = b""  # the read-ahead block (50 MiB) goes with the file, not with its last reference
        super().close()
