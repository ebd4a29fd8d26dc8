"""Records of the size and CRC-32 of the checkpoint files a trainer wrote.

A read of a file of the pass in progress is verified against these records (a committed version
has its manifest instead, :mod:`job.formats.checksums`).
"""

from __future__ import annotations

import threading
from typing import Any

Entry = tuple[int, str]  # (size, crc32) of one file


class SumRegistry:
    """Size and checksum of the files this trainer wrote, by URL; the latest write of a URL wins.

    Distributed trainers replace it with one that also shares the records between ranks
    (a partition written by one rank is read and rewritten by others within a pass).
    """

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()

    def record(self, url: str, entry: Entry) -> None:
        with self._lock:
            self._entries[url] = entry

    def get(self, url: str) -> Entry | None:
        with self._lock:
            return self._entries.get(url)


class SharedSumRegistry(SumRegistry):
    """Records also kept in a key-value store every rank reaches (torch.distributed's store: ``set``,
    ``get``, ``check``), so that a rank reading or committing a file another rank wrote can verify it.

    A rank releases a partition only after its upload finished and its record was set, so a reader
    that got the partition's lock always finds the latest record. Records of a trainer killed
    earlier in the pass are absent: such files are read unverified and checksummed at the commit.
    """

    def __init__(self, store: Any, namespace: str) -> None:
        super().__init__()
        self.store = store
        self.namespace = namespace

    def _key(self, url: str) -> str:
        return f"biggraph/sums/{self.namespace}/{url}"

    def record(self, url: str, entry: Entry) -> None:
        super().record(url, entry)
        self.store.set(self._key(url), f"{entry[0]} {entry[1]}")

    def get(self, url: str) -> Entry | None:
        key = self._key(url)
        if self.store.check([key]):
            size, digest = self.store.get(key).decode().split()
            return int(size), digest
        return super().get(url)
