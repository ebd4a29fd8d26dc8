"""An entity type's names for ``graph.fb``, streamed: never the whole type's names in memory.

The names index of a type (graph.fb's ``names_utf8``: every name of every partition, in row order, joined by NUL)
is as large as the type; a type with a hundred million names does not fit a pod's memory as a Python list (PBG's
names files are JSON lists). So each partition's names file is parsed incrementally (``iter_json_list``: a bounded
window of the file at a time) and the joined bytes are spooled to a local temporary file; the archive writer copies
that file into the zip member a slice at a time (``serialize.graph_member``). Memory is bounded by the read window
and the longest name, whatever the type's size.
"""

from __future__ import annotations

import io
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, BinaryIO, Optional

import storage_adapters as storage
from job.archive.errors import ArchiveError
from job.errors import CheckpointError, InputFormatError
from job.formats import entities as entity_format

WINDOW = 1 << 18  # characters of a names file parsed at a time
COPY_SLICE = 1 << 20  # bytes of the spool copied into the archive at a time
_WHITESPACE = " \t\n\r"
_EXPECTED = "a JSON list of names"


def iter_json_list(stream: IO[str], url: str, window: int = WINDOW) -> Iterator[str]:
    """The elements of the JSON list in ``stream`` (each as ``str``, as ``read_entity_names`` gives them), parsed a
    ``window`` of characters at a time. A malformed file raises InputFormatError naming ``url`` and the line."""
    decoder = json.JSONDecoder()
    reader = _Window(stream, url, window)
    if reader.next_char() != "[":
        raise reader.error("does not start a JSON list")
    reader.pos += 1
    if reader.next_char() == "]":
        reader.pos += 1
        reader.expect_end()
        return
    while True:
        reader.next_char()
        value = reader.decode(decoder)
        yield value if isinstance(value, str) else str(value)
        separator = reader.next_char()
        reader.pos += 1
        if separator == "]":
            reader.expect_end()
            return
        if separator != ",":
            raise reader.error(f"expected ',' or ']', found {separator!r}")


class _Window:
    """A sliding window over a text stream: what ``iter_json_list`` has not consumed yet, and where it is."""

    def __init__(self, stream: IO[str], url: str, window: int) -> None:
        self.stream, self.url, self.window = stream, url, window
        self.buf, self.pos, self.eof, self.lines_before = "", 0, False, 0

    def more(self, wanted: int) -> bool:
        """Read on (dropping what is consumed); False at the end of the stream."""
        if self.eof:
            return False
        chunk = self.stream.read(max(wanted, self.window))
        if not chunk:
            self.eof = True
            return False
        self.lines_before += self.buf.count("\n", 0, self.pos)
        self.buf, self.pos = self.buf[self.pos:] + chunk, 0
        return True

    def next_char(self) -> str:
        """The next character that is not whitespace ('' at the end), not consumed."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in _WHITESPACE:
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more(self.window):
                return ""

    def decode(self, decoder: json.JSONDecoder) -> object:
        """One JSON value at ``pos``, reading on while it may run past the window (a long name, a number cut short)."""
        if self.buf[self.pos] != '"':  # a number or a literal: whole once a delimiter follows it ("-1." parses as -1)
            while not any(c in self.buf[self.pos:] for c in ",]" + _WHITESPACE) and self.more(self.window):
                pass
        while True:
            try:
                value, end = decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError:
                if self.more(2 * (len(self.buf) - self.pos)):
                    continue
                raise self.error("invalid JSON") from None
            if end == len(self.buf) and self.more(self.window):
                continue  # the value may go on in what follows (more() kept it whole from ``pos``)
            self.pos = end
            return value

    def expect_end(self) -> None:
        if self.next_char():
            raise self.error("holds more after its list")

    def error(self, problem: str) -> InputFormatError:
        line = self.lines_before + self.buf.count("\n", 0, self.pos) + 1
        return InputFormatError(self.url, f"{problem} at line {line}", expected=_EXPECTED)


@dataclass
class NamesIndex:
    """A type's names index spooled to a local file: ``size`` bytes (names joined by NUL)."""

    spool: BinaryIO
    size: int
    generated: bool

    def chunks(self) -> Iterator[bytes]:
        self.spool.seek(0)
        while True:
            chunk = self.spool.read(COPY_SLICE)
            if not chunk:
                return
            yield chunk

    def close(self) -> None:
        self.spool.close()


def spool_names(entity_path: str, entity_type: str, counts: list[int], *, archive: str,
                tmp_dir: Optional[str] = None) -> NamesIndex:
    """The names index of ``entity_type`` (partitions with ``counts`` rows), spooled to a temporary file. A partition
    without a names file gets generated names (``<type>_<partition>_<offset>``, as the exporter does)."""
    spool = tempfile.TemporaryFile(dir=tmp_dir)
    written, first, generated = 0, True, False
    try:
        for part, count in enumerate(counts):
            if entity_format.has_entity_names(entity_path, entity_type, part):
                names: Iterator[str] = _read_names(entity_path, entity_type, part)
            else:
                names, generated = (f"{entity_type}_{part}_{offset}" for offset in range(count)), True
            seen = 0
            for name in names:
                seen += 1
                if seen > count:
                    break
                if "\0" in name:
                    raise ArchiveError(archive, f"entity type '{entity_type}': a name holds a NUL character")
                data = name.encode("utf-8")
                if not first:
                    spool.write(b"\0")
                    written += 1
                spool.write(data)
                written += len(data)
                first = False
            if seen != count:
                url = entity_format.names_file(entity_path, entity_type, part)
                held = f"{seen}" if seen < count else f"more than {count}"
                raise CheckpointError(f"{url}: {held} names but the partition has {count} entities")
    except BaseException:
        spool.close()
        raise
    return NamesIndex(spool, written, generated)


def _read_names(entity_path: str, entity_type: str, part: int) -> Iterator[str]:
    url = entity_format.names_file(entity_path, entity_type, part)
    with storage.open_file(url, "rb") as raw:
        try:
            yield from iter_json_list(io.TextIOWrapper(raw, encoding="utf-8"), url)
        except UnicodeDecodeError:
            raise InputFormatError(url, "is not UTF-8", expected=_EXPECTED) from None
