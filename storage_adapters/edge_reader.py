"""Opening remote HDF5 files: staged to a local cache, or streamed with read-ahead."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

import h5py

import storage_adapters as storage
from job.errors import InputFormatError

STREAM_BLOCK_SIZE = 50 * 2**20  # measured: 166-216 MB/s from moto with 50 MiB, 15-18 MB/s with 1 MiB

_mode = "stage"


def set_edge_read_mode(mode: str) -> None:
    global _mode
    if mode not in ("stage", "stream"):
        raise ValueError(mode)
    _mode = mode


@contextlib.contextmanager
def open_remote_h5(url: str) -> Iterator[h5py.File]:
    fs, path = storage.get_filesystem(url)
    if not fs.exists(path):
        raise InputFormatError(url, "missing", expected="an HDF5 edge file")
    if _mode == "stream":
        with fs.open(path, "rb", block_size=STREAM_BLOCK_SIZE, cache_type="readahead") as raw:
            try:
                handle = h5py.File(raw, "r")
            except OSError as err:
                raise InputFormatError(url, f"not a readable HDF5 file ({err})", expected="an HDF5 file") from None
            with handle:
                yield handle
        return
    tmpdir = tempfile.mkdtemp(prefix="biggraph-stage-")
    local = os.path.join(tmpdir, os.path.basename(path))
    try:
        fs.get_file(path, local)
        try:
            handle = h5py.File(local, "r")
        except OSError as err:
            raise InputFormatError(url, f"not a readable HDF5 file ({err})", expected="an HDF5 file") from None
        with handle:
            yield handle
    finally:
        with contextlib.suppress(OSError):
            os.unlink(local)
            os.rmdir(tmpdir)
