"""Checksum manifests: which bytes a committed checkpoint version or an imported edge directory holds.

HDF5 keeps no checksum on contiguous datasets, so a flipped bit or a truncated object on
storage reads back as different numbers without any error. Every file we write therefore
gets its size and CRC-32 recorded in a small JSON manifest beside it:

- a checkpoint version N: ``checksums.v{N}.json`` in ``checkpoint_path``, written after all
  files of the version and *before* ``checkpoint_version.txt`` (so a committed version always
  has its manifest; a leftover manifest of an uncommitted version is dropped like its files);
- an edge directory written by ``biggraph import``: ``checksums.json`` in that ``edge_paths`` entry.

Readers verify a file against its manifest entry: edge files before parsing them (once per process),
checkpoint files when the read ends, before the data is returned (h5py's read leaves the file in the
page cache, so the check is a pass over memory). Directories without a manifest (written by PBG or by
older biggraph versions) are read as before. CRC-32 comes from ``zlib`` (no dependency;
~3 GB/s on one core here), which catches every burst error up to 32 bits and random
damage with probability 1 - 2^-32.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO

import storage_adapters as storage
from job.errors import InputFormatError

ALGORITHM = "crc32"
EDGE_MANIFEST = "checksums.json"
MANIFEST_FORMAT = 1
_BLOCK = 8 * 2**20


def checksum_stream(handle: IO[bytes]) -> tuple[int, str]:
    """(size, crc32 hex) of everything ``handle`` yields from its current position."""
    crc = 0
    size = 0
    while True:
        block = handle.read(_BLOCK)
        if not block:
            break
        crc = zlib.crc32(block, crc)
        size += len(block)
    return size, f"{crc:08x}"


def checksum_file(path: str) -> tuple[int, str]:
    """(size, crc32 hex) of a local file."""
    with open(path, "rb", buffering=0) as handle:
        return checksum_stream(handle)


@dataclass
class Manifest:
    """File name (relative to the manifest's directory) -> (size in bytes, checksum)."""

    files: dict[str, tuple[int, str]] = field(default_factory=dict)
    version: int | None = None

    def to_json(self) -> str:
        body = {
            "format": MANIFEST_FORMAT,
            "algorithm": ALGORITHM,
            "version": self.version,
            "files": {name: {"size": size, ALGORITHM: digest} for name, (size, digest) in sorted(self.files.items())},
        }
        return json.dumps(body, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, url: str) -> Manifest:
        """Parse a manifest; anything malformed is an error naming it (a damaged manifest is damage too)."""
        expected = f"a biggraph checksum manifest (format {MANIFEST_FORMAT}, algorithm {ALGORITHM})"
        try:
            body = json.loads(text)
        except ValueError:
            raise InputFormatError(url, "not valid JSON", expected=expected) from None
        if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT or body.get("algorithm") != ALGORITHM:
            raise InputFormatError(url, "unknown manifest format or algorithm", expected=expected)
        files = body.get("files")
        if not isinstance(files, dict):
            raise InputFormatError(url, "no 'files' mapping", expected=expected)
        parsed: dict[str, tuple[int, str]] = {}
        for name, entry in files.items():
            size = entry.get("size") if isinstance(entry, dict) else None
            digest = entry.get(ALGORITHM) if isinstance(entry, dict) else None
            if not isinstance(size, int) or size < 0 or not isinstance(digest, str) or len(digest) != 8:
                raise InputFormatError(url, f"bad entry for '{name}'", expected="{size: int >= 0, crc32: 8 hex digits}")
            parsed[name] = (size, digest)
        version = body.get("version")
        return cls(parsed, version if isinstance(version, int) else None)


def read_manifest(url: str) -> Manifest | None:
    """The manifest at ``url``, or None when there is none (a directory written by PBG)."""
    try:
        text = storage.read_text(url)
    except FileNotFoundError:
        return None
    return Manifest.from_json(text, url)


def write_manifest(url: str, manifest: Manifest) -> None:
    storage.write_text(url, manifest.to_json())


def mismatch_error(url: str, expected: tuple[int, str], got: tuple[int, str]) -> InputFormatError:
    """The error for a file whose bytes are not the ones its manifest recorded."""
    if got[0] != expected[0]:
        problem = f"damaged: {got[0]} bytes where {expected[0]} were written (truncated or overwritten)"
    else:
        problem = f"damaged: {ALGORITHM} {got[1]} where the file was written with {expected[1]}"
    return InputFormatError(url, problem, expected="the bytes that were committed; restore the file or retrain (if "
                            "another tool such as PBG rewrote it, delete the version's checksums manifest)")


def verify_local(url: str, path: str, expected: tuple[int, str]) -> None:
    """Check the local copy ``path`` of ``url`` against its manifest entry; raise naming ``url``."""
    size = os.path.getsize(path)
    got = (size, "") if size != expected[0] else checksum_file(path)
    if got != expected:
        raise mismatch_error(url, expected, got)


def build_manifest(directory: str, names: Iterable[str], known: dict[str, tuple[int, str]] | None = None,
                   version: int | None = None) -> Manifest:
    """A manifest of ``names`` in ``directory``: from ``known`` where given, else by reading the files."""
    manifest = Manifest(version=version)
    for name in names:
        entry = (known or {}).get(name)
        if entry is None:
            url = storage.join(directory, name)
            with storage.local_copy_for_reading(url) as path:
                entry = checksum_file(path)
        manifest.files[name] = entry
    return manifest
