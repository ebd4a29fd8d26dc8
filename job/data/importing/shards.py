"""The input split into shards: whole files, or line-aligned byte ranges of an uncompressed TSV file.

A shard is the unit one pod reads (and redoes after a crash). Shards are defined by the files and
``--shard-size`` alone, never by the number of pods, and a byte range holds exactly the lines that
*start* inside it, so the shards of a file, concatenated in order, are the file's rows in order. That
is what makes the import's output independent of how the shards were spread over pods.

Only uncompressed TSV is cut into byte ranges: a compressed stream cannot be entered in the middle,
Parquet is columnar, and a CSV field may hold a quoted newline (a line break is then not a row break).
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Any

import storage_adapters as storage
from job.data.importing.options import ImportOptions
from job.data.importing.readers import COMPRESSED_SUFFIXES, detect_format

_SCAN = 1 << 16  # bytes read at a time while looking for the next line break


@dataclass(frozen=True)
class Shard:
    """Bytes [start, end) of input file ``file_index`` (``end`` None: the whole file, of ``size`` bytes)."""

    index: int
    file_index: int
    url: str
    start: int
    end: int | None
    size: int

    @property
    def byte_range(self) -> tuple[int, int] | None:
        return None if self.end is None else (self.start, self.end)


def splittable(url: str, options: ImportOptions) -> bool:
    """Whether ``url`` may be cut into byte ranges (uncompressed TSV; see the module docstring)."""
    return detect_format(url, options.input_format) == "tsv" and not url.lower().endswith(COMPRESSED_SUFFIXES)


def plan_shards(files: list[str], sizes: list[int], options: ImportOptions) -> list[Shard]:
    """The shards of ``files`` (whose byte sizes are ``sizes``), in input order."""
    shards: list[Shard] = []
    step = options.shard_size
    for file_index, (url, size) in enumerate(zip(files, sizes)):
        if step <= 0 or size <= step or not splittable(url, options):
            shards.append(Shard(len(shards), file_index, url, 0, None, size))
            continue
        for start in range(0, size, step):
            end = min(size, start + step)
            shards.append(Shard(len(shards), file_index, url, start, end, end - start))
    return shards


@dataclass(frozen=True)
class Group:
    """Consecutive shards one pod reads with one entity table: the unit of phase 1 (committed, redone) at once.

    A table per group rather than per shard: every distinct id of a group is hashed into the table and
    exchanged through staging once, not once per shard that holds it (with 16 shards of a uniform graph, 15 of
    16 such entries are saved when one process reads them all). ``group_size`` bounds what a group holds, so
    its table, and what a lost pod redoes. Groups depend on the pod count; the output does not.
    """

    index: int
    pod: int
    shards: tuple[Shard, ...]


def plan_groups(shards: list[Shard], pods: int, group_size: int) -> list[Group]:
    """Pod i reads the i-th of ``pods`` contiguous runs of shards (as even in bytes as whole shards allow), cut
    into groups of at most ``group_size`` bytes (at least one shard each)."""
    total = sum(s.size for s in shards)
    groups: list[Group] = []
    done = 0
    current: list[Shard] = []
    pod = 0
    for shard in shards:
        # the pod whose share of the bytes this shard's middle falls in
        owner = min(pods - 1, int((done + shard.size / 2) * pods / max(total, 1)))
        if current and (owner != pod or sum(s.size for s in current) + shard.size > group_size):
            groups.append(Group(len(groups), pod, tuple(current)))
            current = []
        pod = owner
        current.append(shard)
        done += shard.size
    if current:
        groups.append(Group(len(groups), pod, tuple(current)))
    return groups


def _line_start_at_or_after(handle: Any, position: int, size: int) -> int:
    """The offset of the first line that starts at or after ``position`` (``size`` when none does)."""
    if position <= 0:
        return 0
    if position >= size:
        return size
    handle.seek(position - 1)
    scanned = position - 1
    while scanned < size:
        block = handle.read(_SCAN)
        if not block:
            return size
        found = block.find(b"\n")
        if found >= 0:
            return scanned + found + 1
        scanned += len(block)
    return size


class RangeReader(io.RawIOBase):
    """The lines of one byte-range shard of a file, as a readable binary stream ending in a line break.

    ``bounds`` are the line-aligned [begin, end) actually read, computed on opening; ``empty`` is true
    when no line starts inside the range (a range shorter than one line).
    """

    def __init__(self, url: str, byte_range: tuple[int, int]) -> None:
        super().__init__()
        self._handle = _open(url)
        size = storage.size(url) if not storage.is_local(url) else _local_size(self._handle)
        begin = _line_start_at_or_after(self._handle, byte_range[0], size)
        end = _line_start_at_or_after(self._handle, byte_range[1], size) if byte_range[1] < size else size
        self.bounds = (begin, max(begin, end))
        self.empty = self.bounds[0] >= self.bounds[1]
        self._handle.seek(begin)
        self._left = self.bounds[1] - begin
        self._last = b"\n"
        self._terminated = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if not len(buffer):
            return 0
        if self._left > 0:
            data = self._handle.read(min(len(buffer), self._left))
            if data:
                self._left -= len(data)
                self._last = data[-1:]
                buffer[: len(data)] = data
                return len(data)
            self._left = 0
        if self._terminated or self._last == b"\n":
            return 0
        # the file's last line may lack its line break: add one so the parser sees a complete row
        self._terminated = True
        buffer[0:1] = b"\n"
        return 1

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._handle.close()
        super().close()


def _open(url: str) -> Any:
    if storage.is_local(url):
        return open(storage.local_path(url), "rb")  # noqa: SIM115 - closed by RangeReader.close
    return storage.open_file(url, "rb")


def _local_size(handle: Any) -> int:
    handle.seek(0, io.SEEK_END)
    return int(handle.tell())


def open_range(url: str, byte_range: tuple[int, int]) -> io.BufferedReader:
    """A buffered stream over the lines of ``byte_range`` of ``url`` (see ``RangeReader``)."""
    return io.BufferedReader(RangeReader(url, byte_range), buffer_size=1 << 20)
