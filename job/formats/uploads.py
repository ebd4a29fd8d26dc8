"""Background uploads of the files of a checkpoint version built locally (object stores only).

A version's files are uploaded several at a time while the trainer goes on; the commit waits for all
of them (:meth:`UploadQueue.flush`) before it writes the marker, so the marker is the last object written.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import storage_adapters as storage

UPLOAD_THREADS = 8  # uploads of one version in flight at once
MAX_PENDING_UPLOADS = 16  # files built locally and not yet uploaded (bounds the local disk used)


class UploadQueue:
    """Uploads by destination URL; a new upload waits while too many are pending (local disk is bounded)."""

    def __init__(self) -> None:
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def wait(self, url: str) -> None:
        """Wait for a background upload of ``url`` (if any); raise its error."""
        with self._lock:
            future = self._pending.pop(url, None)
        if future is not None:
            future.result()

    def make_room(self) -> None:
        """Wait for the oldest uploads until fewer than ``MAX_PENDING_UPLOADS`` are pending."""
        while True:  # the background swap thread writes too: look at the uploads under the lock
            with self._lock:
                oldest = next(iter(self._pending)) if len(self._pending) >= MAX_PENDING_UPLOADS else None
            if oldest is None:
                return
            self.wait(oldest)

    def submit(self, url: str, upload: Callable[[], None]) -> None:
        """Run ``upload`` (which stores ``url``) in the background, in this job's storage scope."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=UPLOAD_THREADS, thread_name_prefix="biggraph-upload")
            self._pending[url] = self._executor.submit(storage.carry(upload))

    def flush(self) -> None:
        """Wait for every background upload; raise the first error (after all have finished)."""
        with self._lock:
            futures = list(self._pending.values())
            self._pending.clear()
        error: BaseException | None = None
        for future in futures:
            try:
                future.result()
            except BaseException as err:  # re-raised below
                error = error or err
        if error is not None:
            raise error

    def close(self) -> None:
        """Flush, then stop the upload threads."""
        try:
            self.flush()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
