"""Edge side of PBG's input format v1: one ``edges_{lhs}_{rhs}.h5`` per bucket.

Each file holds three 1-D integer datasets of equal length, ``rel``, ``lhs`` and
``rhs``, and the attribute ``format_version`` = 1 on the root group. Featurized
entity types store their features as ``lhsd_offsets``/``lhsd_data`` (and ``rhsd_*``)
tensor lists, as PBG does.

We write exact-size contiguous datasets in the smallest integer type holding the
values (PBG reads any integer type through HDF5's conversion); PBG's own importer
pre-allocates chunked int64 datasets, which is why its files are so large.

Reading is defensive twice over: a directory written by ``biggraph import`` has a checksum
manifest (``checksums.json``) and every file is verified against it once per process
before its values are used; and every chunk read for training or evaluation is
bounds-checked against the entity counts of its bucket (``EdgeLimits``), so an edited or
foreign file fails naming its first bad row instead of training on wrapped-around rows.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

import storage_adapters as storage
from job.errors import InputFormatError
from job.formats.checksums import (
    EDGE_MANIFEST,
    Manifest,
    checksum_file,
    checksum_stream,
    mismatch_error,
    read_manifest,
    verify_local,
    write_manifest,
)
from storage_adapters.edge_reader import open_h5 as open_edge_h5
from storage_adapters.errors import NotHDF5Error

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
        raise InputFormatError(url, f"damaged HDF5 file ({short_error(err)})", expected=expected) from None


# Checksum manifests of edge directories, and the files already verified, per storage session (what a URL holds is
# only known under the settings it was read with). A manifest is re-read when its local file changes; remote ones
# are read once (write_edge_manifest refreshes them).
_lock = threading.Lock()


def _manifests() -> dict[str, tuple[Any, Manifest | None]]:
    return storage.current().memo("edge-manifests")


def _verified() -> dict[tuple[Any, ...], bool]:
    return storage.current().memo("edge-files-verified")


def _manifest_of(directory: str) -> Manifest | None:
    url = storage.join(directory, EDGE_MANIFEST)
    try:
        identity: Any = storage.change_marker(url) or "remote"  # a local manifest rewritten is read again
    except FileNotFoundError:
        return None
    with _lock:
        cached = _manifests().get(directory)
    if cached is not None and cached[0] == identity:
        return cached[1]
    manifest = read_manifest(url)
    with _lock:
        _manifests()[directory] = (identity, manifest)
    return manifest


def expected_edge_entry(url: str) -> tuple[int, str] | None:
    """The (size, crc32) the importer recorded for an edge file; None without a manifest or entry."""
    directory, _, name = url.rstrip("/").rpartition("/")
    manifest = _manifest_of(directory)
    return None if manifest is None else manifest.files.get(name)


def verify_edge_file(url: str, path: str | None) -> None:
    """Check an edge file (its local copy ``path``, or the object itself when None) against its manifest,
    once per process and file version."""
    expected = expected_edge_entry(url)
    if expected is None:
        return
    if path is not None:
        stat = os.stat(path)
        key: tuple[Any, ...] = (path, stat.st_size, stat.st_mtime_ns, expected)
    else:
        key = (url, expected)
    if key in _verified():
        return
    try:
        if path is not None:
            verify_local(url, path, expected)
        else:
            with storage.open_file(url, "rb") as handle:
                got = checksum_stream(handle)
            if got != expected:
                raise mismatch_error(url, expected, got)
    except InputFormatError as err:
        raise InputFormatError(url, err.problem, expected=f"the bytes `biggraph import` wrote (listed in {EDGE_MANIFEST}; "
                               "if another tool rewrote the edge files, delete that manifest)") from None
    _verified()[key] = True


def write_edge_manifest(edge_path: str, entries: dict[str, tuple[int, str]]) -> None:
    """Record the edge files just written into ``edge_path`` (file name -> (size, crc32))."""
    write_manifest(storage.join(edge_path, EDGE_MANIFEST), Manifest(dict(entries)))
    forget_edge_manifest(edge_path)


def forget_edge_manifest(edge_path: str) -> None:
    """Drop the session's cached manifest of ``edge_path`` (``biggraph grow`` replaced it with another's)."""
    with _lock:
        _manifests().pop(edge_path.rstrip("/"), None)
        _manifests().pop(edge_path, None)


@contextlib.contextmanager
def open_h5(url: str, mode: str = "r", verify: bool = True) -> Iterator[h5py.File]:
    """Open an HDF5 file at a URL for reading (verified against its manifest unless ``verify`` is false: a
    look at the header only must not download a whole remote file), turning HDF5's errors into clear ones."""
    if mode != "r":
        raise ValueError("open_h5 only reads; write through write_edges")
    check = (lambda path: verify_edge_file(url, path)) if verify else None
    with contextlib.ExitStack() as stack:
        try:  # only the opening: an error of the caller's block must pass through unchanged
            handle = stack.enter_context(open_edge_h5(url, check))
        except FileNotFoundError:
            raise InputFormatError(url, "missing", expected="an HDF5 edge file") from None
        except NotHDF5Error as err:
            raise InputFormatError(url, f"not a readable HDF5 file ({err.reason})", expected="an HDF5 file") from None
        with damaged_file_errors(url):
            yield handle


def short_error(err: Exception) -> str:
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
) -> tuple[int, str]:
    """Write one bucket file; it appears at ``url`` only once complete. Returns its (size, crc32) for the
    directory's manifest (``write_edge_manifest``)."""
    if not (len(rel) == len(lhs) == len(rhs)):
        raise ValueError("rel, lhs and rhs must have the same length")
    features = {k: v for k, v in (("lhsd", lhsd), ("rhsd", rhsd)) if v is not None}
    with storage.local_file_for_writing(url) as tmp:
        write_edges_to_local(tmp, np.asarray(rel), np.asarray(lhs), np.asarray(rhs), **features)
        entry = checksum_file(tmp)  # before the rename/upload publishes it, from the page cache
    return entry


@dataclass(frozen=True)
class EdgeLimits:
    """The ids one bucket's edges may hold: per relation id, the entity count of its lhs and rhs type's
    partition in the bucket (int64 max where unknown), and which sides are checked (featurized types
    store -1 by design)."""

    num_rel_ids: int
    limits: dict[str, np.ndarray]
    checked: dict[str, np.ndarray]
    labels: dict[str, list[tuple[str, int, str]]]  # (entity type, partition, relation name) per id
    dynamic: bool

    @classmethod
    def for_bucket(cls, config: Any, counts: Mapping[str, Sequence[int | None]], num_rel_ids: int,
                   bucket: tuple[int, int]) -> EdgeLimits:
        relations = config.relations
        # with dynamic relations every id uses the single relation's entity types
        per_id = [relations[0]] * num_rel_ids if config.dynamic_relations else list(relations)
        limits, checked, labels = {}, {}, {}
        for side, part in (("lhs", bucket[0]), ("rhs", bucket[1])):
            side_limits = np.empty(len(per_id), dtype=np.int64)
            side_checked = np.ones(len(per_id), dtype=bool)
            side_labels = []
            for rel_id, relation in enumerate(per_id):
                entity_type = getattr(relation, side)
                schema = config.entities[entity_type]
                type_part = part if schema.num_partitions > 1 else 0
                known = counts.get(entity_type, [])
                count = known[type_part] if type_part < len(known) else None
                side_limits[rel_id] = np.iinfo(np.int64).max if count is None else count
                side_checked[rel_id] = not schema.featurized
                side_labels.append((entity_type, type_part, relation.name))
            limits[side], checked[side], labels[side] = side_limits, side_checked, side_labels
        return cls(num_rel_ids, limits, checked, labels, bool(config.dynamic_relations))

    def describe(self, dataset: str, kind: str, value: int, rel_id: int) -> tuple[str, str]:
        """(problem, expected) for a bad value of one kind ("range", "negative", "empty")."""
        if dataset == "rel":
            what = "dynamic relations" if self.dynamic else "relation types"
            return f"relation id {value} out of range", f"0 <= rel < {self.num_rel_ids}, the number of {what}"
        entity_type, part, relation = self.labels[dataset][rel_id]
        limit = int(self.limits[dataset][rel_id])
        expected = f"0 <= {dataset} < {limit}, the count of '{entity_type}' partition {part}"
        if kind == "negative":
            return f"negative index {value} for entity type '{entity_type}' (relation '{relation}')", expected
        if kind == "empty":
            return (
                f"edge points into entity type '{entity_type}' partition {part}, which has 0 entities (relation '{relation}')",
                f"no edges into an empty partition, or a positive count in entity_count_{entity_type}_{part}.txt",
            )
        return f"index {value} out of range for entity type '{entity_type}' partition {part} (relation '{relation}')", expected

    def bad_rows(self, rel: np.ndarray, values: dict[str, np.ndarray]) -> Iterator[tuple[str, str, np.ndarray, np.ndarray]]:
        """(dataset, kind, mask of bad rows, relation id per row) for every kind of bad value present."""
        bad_rel = (rel < 0) | (rel >= self.num_rel_ids)
        yield "rel", "range", bad_rel, rel
        if self.num_rel_ids == 0:
            return
        good = ~bad_rel
        safe_rel = np.where(good, rel, 0)
        for side in ("lhs", "rhs"):
            side_values = values[side]
            limits = self.limits[side][safe_rel]
            checked = good & self.checked[side][safe_rel]
            too_big = checked & (side_values >= limits)
            yield side, "negative", checked & (side_values < 0), safe_rel
            yield side, "range", too_big & (limits != 0), safe_rel
            yield side, "empty", too_big & (limits == 0), safe_rel

    def check(self, arrays: EdgeArrays, url: str, first_row: int) -> None:
        """Raise for the first row (counted from the file's start) whose ids do not fit this bucket.

        A min/max per dataset first: a valid chunk (the usual case) costs three reductions per side.
        """
        if not len(arrays):
            return
        fits = (int(arrays.rel.min()) >= 0 and int(arrays.rel.max()) < self.num_rel_ids)
        if fits and self.num_rel_ids:
            for side in ("lhs", "rhs"):
                values = getattr(arrays, side)
                # featurized sides hold -1 by design: such buckets take the exact path below
                fits = (fits and bool(self.checked[side].all()) and int(values.min()) >= 0
                        and int(values.max()) < int(self.limits[side].min()))
        if fits:
            return
        first: tuple[int, str, str, np.ndarray, np.ndarray] | None = None
        values = {"lhs": arrays.lhs, "rhs": arrays.rhs, "rel": arrays.rel}
        for dataset, kind, bad, rel_ids in self.bad_rows(arrays.rel, values):
            if bad.any():
                row = int(np.argmax(bad))
                if first is None or row < first[0]:
                    first = (row, dataset, kind, values[dataset], rel_ids)
        if first is None:
            return
        row, dataset, kind, column, rel_ids = first
        problem, expected = self.describe(dataset, kind, int(column[row]), int(rel_ids[row]))
        raise InputFormatError(url, problem, dataset=dataset, row=first_row + row, expected=expected)
