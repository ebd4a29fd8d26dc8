"""The zip side of a model archive: members read in place (memory-mapped), tags.txt and params.txt.

Layout (see docs/archive.md)::

    tags.txt                      tags, one per line, UTF-8, oldest first, no duplicates (case-insensitive)
    <tag>/graph.fb                the model structure (schema/graph.fbs)
    <tag>/params.txt              "<variable> <ref>" per line; ref is N (<tag>/params/N.fb) or <other tag>/N
    <tag>/params/N.fb             NDArrays (schema/ndarray.fbs)
    <tag>/trainingConfig.fb       config and training stats (schema/training.fbs)
    <tag>/updater.txt             "<variable> <ref> [<ref>...]" per line, refs into <tag>/updater/N.fb
    <tag>/updater/N.fb            optimizer state NDArrays

Every member is stored uncompressed and its data starts on a 64-byte boundary of the file
(zipalign-style padding in the local header's extra field), and the NDArray writer aligns the
array bytes to 64 within the member, so a reader maps the file and views arrays without a copy.

Only the standard library, numpy-free: the loader imports this without torch or h5py (storage_adapters
only to download an archive given as a storage URL).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import struct
import tempfile
import time
import zipfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import BinaryIO, Optional

from job.archive.errors import (
    ArchiveError,
    ArchiveFormatError,
    ArchiveIntegrityError,
    DanglingReferenceError,
    TagError,
)

TAGS_FILE = "tags.txt"
GRAPH_FILE = "graph.fb"
PARAMS_FILE = "params.txt"
PARAMS_DIR = "params"
TRAINING_FILE = "trainingConfig.fb"
UPDATER_FILE = "updater.txt"
UPDATER_DIR = "updater"
ALIGNMENT = 64
ALIGN_EXTRA_ID = 0xD935  # the extra-field id Android's zipalign uses for the same purpose

_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,99}$")
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_SIGNATURE = b"PK\x03\x04"
ZIP64_EXTRA_BYTES = 20  # the zip64 extra field of a local header: id, length, uncompressed and compressed sizes
_ZIP64_EXTRA_ID = 0x0001
_WRITE_SLICE = 64 * 2**20  # bytes handed to zipfile at a time (its CRC and the file write take any size)


def check_tag_name(tag: str, archive: str = "<archive>", member: Optional[str] = TAGS_FILE) -> str:
    """A tag is a portable file name: letters, digits, '_', '-', '.', '+', 1-100 characters, not '.'/'..'."""
    if not _TAG_RE.match(tag) or tag in (".", "..") or tag.endswith("."):
        raise TagError(
            archive, f"invalid tag '{tag}' (tags are 1-100 of A-Z a-z 0-9 _ - . + and may not start with '.' or '-' "
            "nor end with '.')", member,
        )
    return tag


def parse_tags(text: str, archive: str) -> list[str]:
    tags: list[str] = []
    seen: dict[str, str] = {}
    for line in text.splitlines():
        tag = line.strip()
        if not tag:
            continue
        check_tag_name(tag, archive)
        key = tag.casefold()
        if key in seen:
            raise TagError(archive, f"duplicate tag '{tag}' (tags are case-insensitive; '{seen[key]}' comes first)",
                           TAGS_FILE)
        seen[key] = tag
        tags.append(tag)
    return tags


def find_tag(tags: list[str], wanted: Optional[str], archive: str) -> str:
    """The stored spelling of ``wanted`` (case-insensitive), or the newest tag when ``wanted`` is None."""
    if not tags:
        raise TagError(archive, "holds no tags", TAGS_FILE)
    if wanted is None:
        return tags[-1]
    for tag in tags:
        if tag.casefold() == wanted.casefold():
            return tag
    raise TagError(archive, f"unknown tag '{wanted}' (tags: {', '.join(tags)})", TAGS_FILE)


@dataclass(frozen=True)
class Ref:
    """Where one array of a variable lives: ``<tag>/<dir>/<index>.fb``."""

    tag: str
    index: int

    def member(self, directory: str) -> str:
        return f"{self.tag}/{directory}/{self.index}.fb"

    def text(self, own_tag: str) -> str:
        return str(self.index) if self.tag == own_tag else f"{self.tag}/{self.index}"


def parse_refs(text: str, tag: str, tags: list[str], archive: str, member: str,
               single: bool) -> dict[str, list[Ref]]:
    """params.txt (one ref per name) or updater.txt (one or more): variable name -> refs."""
    by_key = {t.casefold(): t for t in tags}
    out: dict[str, list[Ref]] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) < 2 or (single and len(parts) != 2):
            expected = "'<name> <ref>'" if single else "'<name> <ref> [<ref>...]'"
            raise ArchiveFormatError(archive, f"line {lineno}: '{line[:80]}' (expected {expected})", member)
        name, raw_refs = parts[0], parts[1:]
        if name in out:
            raise ArchiveFormatError(archive, f"line {lineno}: variable '{name}' listed twice", member)
        refs = []
        for raw in raw_refs:
            ref_tag, _, index_text = raw.rpartition("/")
            if not index_text.isdigit():
                raise ArchiveFormatError(archive, f"line {lineno}: bad reference '{raw}' (expected N or <tag>/N)", member)
            if ref_tag:
                stored = by_key.get(ref_tag.casefold())
                if stored is None:
                    raise DanglingReferenceError(
                        archive, f"line {lineno}: '{name}' refers to '{raw}' but tag '{ref_tag}' is not in tags.txt", member
                    )
                ref_tag = stored
            refs.append(Ref(ref_tag or tag, int(index_text)))
        out[name] = refs
    return out


def format_refs(refs: dict[str, list[Ref]], own_tag: str) -> str:
    return "".join(f"{name} {' '.join(r.text(own_tag) for r in rs)}\n" for name, rs in refs.items())


def _open_archive_file(path: str) -> BinaryIO:
    """The archive as an open local file: the file itself, or for a storage URL (``s3://...``) a download
    that is unlinked at once (the open handle and the memory map keep its bytes until they are closed)."""
    scheme = path.split("://", 1)[0] if "://" in path else ""
    if scheme in ("", "file"):
        return open(path[len("file://"):] if scheme else path, "rb")
    # storage_adapters (fsspec) is imported for remote archives only: a local one needs numpy and flatbuffers alone
    import storage_adapters

    fd, tmp = tempfile.mkstemp(prefix="biggraph-archive-", suffix=".zip")
    os.close(fd)
    try:
        storage_adapters.get_file(path, tmp)
        return open(tmp, "rb")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


class ZipReader:
    """A zip file mapped into memory; members come back as zero-copy memoryviews, CRC-checked once."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._file = _open_archive_file(path)
        except FileNotFoundError:
            raise ArchiveError(path, "missing (expected a model archive written by biggraph archive)") from None
        except IsADirectoryError:
            raise ArchiveError(path, "is a directory (expected a model archive .zip)") from None
        self.size = os.fstat(self._file.fileno()).st_size
        self._map: Optional[mmap.mmap] = None
        self._view: memoryview = memoryview(b"")
        if self.size:
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            self._view = memoryview(self._map)
        try:
            with zipfile.ZipFile(self._file) as handle:
                infos = handle.infolist()
        except zipfile.BadZipFile as err:
            self._raise_unreadable(str(err))
        self.infos: dict[str, zipfile.ZipInfo] = {}
        for info in infos:
            if info.filename in self.infos:
                raise ArchiveFormatError(path, "appears twice in the zip directory", info.filename)
            self.infos[info.filename] = info
        self._verified: set[str] = set()

    def _raise_unreadable(self, reason: str) -> None:
        """No central directory: name the member cut short if the local headers show one, else the zip."""
        offset = 0
        data = self._view
        while offset + _LOCAL_HEADER.size <= self.size:
            fields = _LOCAL_HEADER.unpack_from(data, offset)
            if fields[0] != _LOCAL_SIGNATURE:
                break
            name_len, extra_len, size = fields[9], fields[10], fields[8]
            name = bytes(data[offset + 30:offset + 30 + name_len]).decode("utf-8", "replace")
            start = offset + 30 + name_len + extra_len
            if size == 0xFFFFFFFF:
                size = _zip64_size(bytes(data[offset + 30 + name_len:start])) or size
            if start + size > self.size:
                have = max(0, self.size - start)
                self.close()
                raise ArchiveIntegrityError(self.path, f"truncated: {have} of {size} bytes present (the archive is cut "
                                                       "short; its zip directory is missing)", name)
            offset = start + size
        self.close()
        raise ArchiveFormatError(self.path, f"not a readable zip archive ({reason})")

    def names(self) -> list[str]:
        return list(self.infos)

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def member(self, name: str, verify: bool = True) -> memoryview:
        info = self.infos.get(name)
        if info is None:
            raise DanglingReferenceError(self.path, "missing from the archive", name)
        if info.compress_type != zipfile.ZIP_STORED:
            raise ArchiveFormatError(self.path, f"is compressed (method {info.compress_type}); archive members must "
                                                "be stored uncompressed", name)
        offset = info.header_offset
        if offset + _LOCAL_HEADER.size > self.size:
            raise ArchiveIntegrityError(self.path, "truncated: its local header lies past the end of the file", name)
        fields = _LOCAL_HEADER.unpack_from(self._view, offset)
        if fields[0] != _LOCAL_SIGNATURE:
            raise ArchiveIntegrityError(self.path, f"no local file header at offset {offset}", name)
        start = offset + _LOCAL_HEADER.size + fields[9] + fields[10]
        end = start + info.compress_size
        if end > self.size:
            raise ArchiveIntegrityError(
                self.path, f"truncated: {max(0, self.size - start)} of {info.compress_size} bytes present", name
            )
        view = self._view[start:end]
        if verify and name not in self._verified:
            crc = zlib.crc32(view) & 0xFFFFFFFF
            if crc != info.CRC:
                raise ArchiveIntegrityError(
                    self.path, f"bad CRC-32: the zip records {info.CRC:08x}, the bytes give {crc:08x} (corrupted)", name
                )
            self._verified.add(name)
        return view

    def data_offset(self, name: str) -> int:
        """Where a member's bytes start in the file (for alignment checks)."""
        info = self.infos[name]
        fields = _LOCAL_HEADER.unpack_from(self._view, info.header_offset)
        return info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]

    def text(self, name: str) -> str:
        try:
            return bytes(self.member(name)).decode("utf-8")
        except UnicodeDecodeError:
            raise ArchiveFormatError(self.path, "not UTF-8 text", name) from None

    def close(self) -> None:
        # views handed out keep the map alive; releasing ours is enough for the mapping to go with the last one
        self._view = memoryview(b"")
        self._map = None
        if self._file is not None:
            self._file.close()


class ZipWriter:
    """Writes stored, 64-byte aligned members to a new zip file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._zip = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True)

    def write(self, name: str, data: bytes | memoryview, date_time: tuple[int, int, int, int, int, int] | None = None) -> None:
        """Add a stored member whose bytes start on a 64-byte boundary of the file. ``data`` is written in slices:
        a memoryview (of a mapped file, say) is never copied whole."""
        view = memoryview(data).cast("B")
        self.write_chunks(name, len(view), (view[start:start + _WRITE_SLICE] for start in range(0, len(view), _WRITE_SLICE)),
                          date_time=date_time)

    def write_chunks(self, name: str, size: int, chunks: Iterable[bytes | memoryview],
                     date_time: tuple[int, int, int, int, int, int] | None = None) -> None:
        """Add a stored member of ``size`` bytes from ``chunks`` (a member larger than memory, such as a graph.fb
        with a large type's names, streamed from a spool file), aligned as ``write``'s.

        Every member gets a zip64 local header: zipfile adds that extra field (20 bytes) after ours on its own for a
        member near 2 GiB (it guesses from the size), which would shift the data off the boundary. Forcing it for all
        members makes the header's length known, and it is counted in the padding."""
        info = zipfile.ZipInfo(name, date_time=date_time or _now())
        info.compress_type = zipfile.ZIP_STORED
        info.create_system = 3  # unix
        info.external_attr = 0o644 << 16
        info.file_size = size
        assert self._zip.fp is not None
        header_start = self._zip.fp.tell()
        base = header_start + _LOCAL_HEADER.size + len(name.encode("utf-8")) + 6 + ZIP64_EXTRA_BYTES
        pad = (-base) % ALIGNMENT
        info.extra = struct.pack("<HHH", ALIGN_EXTRA_ID, 2 + pad, ALIGNMENT) + b"\0" * pad
        written = 0
        with self._zip.open(info, mode="w", force_zip64=True) as member:
            for chunk in chunks:
                written += member.write(chunk)
        if written != size:
            raise ValueError(f"zip member {name}: {written} bytes written, {size} announced")

    def close(self) -> None:
        self._zip.close()

    def __enter__(self) -> ZipWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _zip64_size(extra: bytes) -> int | None:
    """The compressed size recorded in a local header's zip64 extra field (None without one)."""
    offset = 0
    while offset + 4 <= len(extra):
        field_id, length = struct.unpack_from("<HH", extra, offset)
        if field_id == _ZIP64_EXTRA_ID and length >= 16:
            if offset + 20 > len(extra):  # a header cut short (or damaged): no size to read
                return None
            return int(struct.unpack_from("<Q", extra, offset + 12)[0])
        offset += 4 + length
    return None


def _now() -> tuple[int, int, int, int, int, int]:
    t = time.localtime()
    return (max(t.tm_year, 1980), t.tm_mon, t.tm_mday, t.tm_hour, t.tm_min, t.tm_sec)
