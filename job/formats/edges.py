"""Edge side of PBG's input format v1: one ``edges_{lhs}_{rhs}.h5`` per bucket.

Each file holds three 1-D integer datasets of equal length, ``rel``, ``lhs`` and
``rhs``, and the attribute ``format_version`` = 1 on the root group. Featurized
entity types store their features as ``lhsd_offsets``/``lhsd_data`` (and ``rhsd_*``)
tensor lists, as PBG does.

We write exact-size contiguous datasets in the smallest integer type holding the
values (PBG reads any integer type through HDF5's conversion); PBG's own importer
pre-allocates chunked int64 datasets, which is why its files are so large.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

import storage_adapters as storage
from job.errors import InputFormatError

FORMAT_VERSION_ATTR = "format_version"
FORMAT_VERSION = 1
EDGE_DATASETS = ("rel", "lhs", "rhs")


def edges_file(edge_path: str, lhs_partition: int, rhs_partition: int) -> str:
    return storage.join(edge_path, f"edges_{lhs_partition}_{rhs_partition}.h5")


@dataclass
class EdgeArrays:
    """A slice of a bucket's edges as int64 numpy arrays (plus feature lists when featurized)."""

    rel: np.ndarray
    lhs: np.ndarray
    rhs: np.ndarray
    lhs_features: tuple[np.ndarray, np.ndarray] | None = None  # (offsets, data)
    rhs_features: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.rel.shape[0])


def _smallest_int_dtype(*arrays: np.ndarray) -> np.dtype:
    high = max((int(a.max()) for a in arrays if a.size), default=0)
    low = min((int(a.min()) for a in arrays if a.size), default=0)
    if low >= np.iinfo(np.int32).min and high <= np.iinfo(np.int32).max:
        return np.dtype(np.int32)
    return np.dtype(np.int64)


# What h5py raises while reading a damaged file that did open (it maps HDF5's error classes onto these).
HDF5_READ_ERRORS = (OSError, KeyError, RuntimeError, ValueError, TypeError, IndexError)


@contextlib.contextmanager
def damaged_file_errors(url: str, expected: str = "an HDF5 edge file") -> Iterator[None]:
    """Turn h5py's errors from reading a damaged file into an InputFormatError naming it."""
    try:
        yield
    except HDF5_READ_ERRORS as err:
        raise InputFormatError(url, f"damaged HDF5 file ({_short(err)})", expected=expected) from None


@contextlib.contextmanager
def open_h5(url: str, mode: str = "r") -> Iterator[h5py.File]:
    """Open an HDF5 file at a URL for reading, turning HDF5's errors into clear ones."""
    if mode != "r":
        raise ValueError("open_h5 only reads; write through write_edges")
    if storage.is_local(url):
        path = storage.local_path(url)
        try:
            handle = h5py.File(path, "r")
        except FileNotFoundError:
            raise InputFormatError(url, "missing", expected="an HDF5 edge file") from None
        except OSError as err:
            raise InputFormatError(url, f"not a readable HDF5 file ({_short(err)})", expected="an HDF5 file") from None
        with handle, damaged_file_errors(url):
            yield handle
        return
    from storage_adapters.edge_reader import open_remote_h5

    with open_remote_h5(url) as handle, damaged_file_errors(url):
        yield handle


def _short(err: Exception) -> str:
    text = str(err)
    return text.split("(")[0].strip() or text[:80]


def check_edge_file(handle: h5py.File, url: str) -> int:
    """Check the cheap structural rules of a v1 edge file; return its number of edges."""
    version = handle.attrs.get(FORMAT_VERSION_ATTR, None)
    if version is None:
        raise InputFormatError(url, f"no '{FORMAT_VERSION_ATTR}' attribute", expected=f"format_version = {FORMAT_VERSION}")
    if int(np.asarray(version).reshape(-1)[0]) != FORMAT_VERSION:
        shown = np.asarray(version).tolist()
        raise InputFormatError(url, f"format_version is {shown!r}", expected=f"format_version = {FORMAT_VERSION}")
    lengths: dict[str, int] = {}
    for name in EDGE_DATASETS:
        if name not in handle:
            raise InputFormatError(url, "missing", dataset=name, expected="a 1-D integer dataset")
        dataset = handle[name]
        if not isinstance(dataset, h5py.Dataset) or dataset.ndim != 1:
            shape = getattr(dataset, "shape", "a group")
            raise InputFormatError(url, f"has shape {shape}", dataset=name, expected="a 1-D integer dataset")
        if dataset.dtype.kind not in "iu":
            raise InputFormatError(url, f"has dtype {dataset.dtype}", dataset=name, expected="an integer dtype")
        lengths[name] = int(dataset.shape[0])
    if len(set(lengths.values())) != 1:
        detail = ", ".join(f"{k}={v}" for k, v in lengths.items())
        raise InputFormatError(url, f"datasets differ in length ({detail})", expected="rel, lhs and rhs of equal length")
    return lengths["rel"]


def count_edges(url: str) -> int:
    with open_h5(url) as handle:
        return check_edge_file(handle, url)


def _read_features(handle: h5py.File, key: str, begin: int, end: int) -> tuple[np.ndarray, np.ndarray] | None:
    if f"{key}_offsets" not in handle:
        return None
    offsets = handle[f"{key}_offsets"][begin : end + 1].astype(np.int64)
    data = handle[f"{key}_data"][int(offsets[0]) : int(offsets[-1])].astype(np.int64) if len(offsets) else np.empty(0, np.int64)
    return offsets - (offsets[0] if len(offsets) else 0), data


def read_edges_from_handle(handle: h5py.File, url: str, begin: int = 0, end: int | None = None) -> EdgeArrays:
    num_edges = check_edge_file(handle, url)
    end = num_edges if end is None else min(end, num_edges)
    begin = max(0, min(begin, end))
    arrays = {}
    for name in EDGE_DATASETS:
        out = np.empty(end - begin, dtype=np.int64)
        if end > begin:
            handle[name].read_direct(out, source_sel=np.s_[begin:end])
        arrays[name] = out
    return EdgeArrays(
        rel=arrays["rel"],
        lhs=arrays["lhs"],
        rhs=arrays["rhs"],
        lhs_features=_read_features(handle, "lhsd", begin, end),
        rhs_features=_read_features(handle, "rhsd", begin, end),
    )


def read_edges(url: str, begin: int = 0, end: int | None = None) -> EdgeArrays:
    """Read edges [begin, end) of a bucket file (the whole file by default)."""
    with open_h5(url) as handle:
        return read_edges_from_handle(handle, url, begin, end)


def chunk_bounds(num_edges: int, chunk_idx: int, num_chunks: int) -> tuple[int, int]:
    """The [begin, end) of an edge chunk, split exactly as PBG splits it."""
    return int(chunk_idx * num_edges / num_chunks), int((chunk_idx + 1) * num_edges / num_chunks)


def write_edges_to_local(path: str, rel: np.ndarray, lhs: np.ndarray, rhs: np.ndarray, **features: Any) -> None:
    dtype = _smallest_int_dtype(rel, lhs, rhs)
    with h5py.File(path, "w") as handle:
        handle.attrs[FORMAT_VERSION_ATTR] = FORMAT_VERSION
        for name, values in (("rel", rel), ("lhs", lhs), ("rhs", rhs)):
            handle.create_dataset(name, data=np.asarray(values, dtype=dtype))
        for key, (offsets, data) in features.items():
            handle.create_dataset(f"{key}_offsets", data=np.asarray(offsets, dtype=np.int64))
            handle.create_dataset(f"{key}_data", data=np.asarray(data, dtype=np.int64))


def write_edges(
    url: str,
    rel: np.ndarray,
    lhs: np.ndarray,
    rhs: np.ndarray,
    lhsd: tuple[np.ndarray, np.ndarray] | None = None,
    rhsd: tuple[np.ndarray, np.ndarray] | None = None,
) -> None:
    """Write one bucket file; it appears at ``url`` only once complete."""
    if not (len(rel) == len(lhs) == len(rhs)):
        raise ValueError("rel, lhs and rhs must have the same length")
    features = {k: v for k, v in (("lhsd", lhsd), ("rhsd", rhsd)) if v is not None}
    with storage.local_file_for_writing(url) as tmp:
        write_edges_to_local(tmp, np.asarray(rel), np.asarray(lhs), np.asarray(rhs), **features)
