"""Archive members stay 64-byte aligned at any size (issue 47, hazard 4).

zipfile adds a zip64 extra field (20 bytes) after the writer's alignment padding on its own when a member is near
2 GiB, which shifted the tensor bytes off the boundary that zero-copy readers rely on. Every member now has a zip64
local header, counted in the padding. The large case writes a member just under 2 GiB from a sparse file mapped in
memory (no 2 GiB buffer; the archive itself takes 2 GiB of disk for a few seconds).
"""

from __future__ import annotations

import mmap
import struct
import zipfile
from pathlib import Path

import pytest

from job.archive.container import ALIGNMENT, ZipReader, ZipWriter


def _local_extra_ids(path: Path, reader: ZipReader, name: str) -> list[int]:
    """The ids of the extra fields in ``name``'s local header, in order."""
    info = reader.infos[name]
    with open(path, "rb") as fh:
        fh.seek(info.header_offset)
        header = fh.read(30)
        name_len, extra_len = struct.unpack_from("<HH", header, 26)
        fh.seek(name_len, 1)
        extra = fh.read(extra_len)
    ids, offset = [], 0
    while offset + 4 <= len(extra):
        field_id, length = struct.unpack_from("<HH", extra, offset)
        ids.append(field_id)
        offset += 4 + length
    return ids


def test_every_member_has_a_counted_zip64_header(tmp_path: Path) -> None:
    path = tmp_path / "a.zip"
    names = [f"t/{'n' * k}.fb" for k in range(1, 70, 7)]
    with ZipWriter(str(path)) as writer:
        for k, name in enumerate(names):
            writer.write(name, bytes(range(256)) * (k + 1))
        writer.write("t/view.fb", memoryview(bytearray(b"v" * 1000)))
    reader = ZipReader(str(path))
    try:
        for k, name in enumerate(names):
            assert reader.data_offset(name) % ALIGNMENT == 0, name
            assert _local_extra_ids(path, reader, name) == [0xD935, 0x0001], name
            assert bytes(reader.member(name)) == bytes(range(256)) * (k + 1)
        assert bytes(reader.member("t/view.fb")) == b"v" * 1000
    finally:
        reader.close()
    with zipfile.ZipFile(path) as plain:  # any zip reader still reads it
        assert plain.testzip() is None


@pytest.mark.slow
def test_a_member_just_under_2_gib_stays_aligned(tmp_path: Path) -> None:
    size = 2**31 - 2**20  # past zipfile's own zip64 guess (size * 1.05 > 2**31 - 1)
    source = tmp_path / "sparse.bin"
    with open(source, "wb") as fh:
        fh.truncate(size)
        fh.seek(size - 5)
        fh.write(b"tail!")
    path = tmp_path / "big.zip"
    with open(source, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            with ZipWriter(str(path)) as writer:
                writer.write("t/small.fb", b"x" * 100)
                writer.write("t/params/0.fb", view)
                writer.write("t/after.fb", b"y" * 100)
        finally:
            view.release()
    source.unlink()
    reader = ZipReader(str(path))
    try:
        for name in ("t/small.fb", "t/params/0.fb", "t/after.fb"):
            assert reader.data_offset(name) % ALIGNMENT == 0, (name, reader.data_offset(name) % ALIGNMENT)
        big = reader.member("t/params/0.fb", verify=False)
        assert len(big) == size and bytes(big[-5:]) == b"tail!" and bytes(big[:8]) == b"\0" * 8
        del big
        assert bytes(reader.member("t/after.fb")) == b"y" * 100
    finally:
        reader.close()
