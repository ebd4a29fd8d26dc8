"""The checks of one edge bucket file for ``validate`` (see :mod:`job.formats.validate`), and the report
they fill: structure (format version, datasets, dtypes, lengths), then in a full run every value range.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

import storage_adapters as storage
from job.errors import InputFormatError, UserError
from job.formats.edges import (
    EDGE_DATASETS,
    FORMAT_VERSION,
    FORMAT_VERSION_ATTR,
    HDF5_READ_ERRORS,
    EdgeLimits,
    verify_edge_file,
)
from job.types import PartitionKey
from storage_adapters.edge_reader import open_h5 as open_edge_h5
from storage_adapters.errors import NotHDF5Error

MAX_PROBLEMS_PER_FILE = 20

_TRUNCATED_RE = re.compile(r"truncated file: eof = (?P<eof>\d+).*stored_eof = (?P<stored>\d+)")


@dataclass
class ValidationReport:
    """Everything ``validate`` found: problems (errors), warnings and what it looked at."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    count_files: int = 0
    total_entities: int = 0
    edge_files: int = 0
    edges_per_path: dict[str, int] = field(default_factory=dict)
    # what a trainer reads anyway, kept so that it need not read it again (job/train/input_check.py): each entity
    # type's counts per partition (None: unreadable, reported), and the edges of each path's largest bucket file
    # (what the number of edge chunks is sized by)
    entity_counts: dict[str, list[int | None]] = field(default_factory=dict)
    largest_edge_file: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


class Collector:
    """Collects problems, or raises the first one (``fail_fast``, for ``validate_cheap``)."""

    def __init__(self, report: ValidationReport, fail_fast: bool) -> None:
        self.report = report
        self.fail_fast = fail_fast

    def error(self, err: UserError) -> None:
        if self.fail_fast:
            raise err
        self.report.problems.append(str(err))

    def warn(self, message: str) -> None:
        self.report.warnings.append(message)


def _check_structure(handle: h5py.File, url: str, collect: Collector) -> int | None:
    """The cheap rules of one edge file; returns its edge count when the values can be scanned."""
    version = handle.attrs.get(FORMAT_VERSION_ATTR, None)
    expected_version = f"{FORMAT_VERSION_ATTR} = {FORMAT_VERSION} on the root group"
    if version is None:
        collect.error(InputFormatError(url, f"no '{FORMAT_VERSION_ATTR}' attribute", expected=expected_version))
    else:
        try:
            good = int(np.asarray(version).reshape(-1)[0]) == FORMAT_VERSION
        except (TypeError, ValueError, IndexError):
            good = False
        if not good:
            collect.error(InputFormatError(url, f"format_version is {_show(version)}", expected=expected_version))
    lengths: dict[str, int] = {}
    scannable = True
    for name in EDGE_DATASETS:
        if name not in handle:
            collect.error(InputFormatError(url, "missing", dataset=name, expected="a 1-D integer dataset"))
            scannable = False
            continue
        dataset = handle[name]
        if not isinstance(dataset, h5py.Dataset):
            collect.error(InputFormatError(url, "is a group", dataset=name, expected="a 1-D integer dataset"))
            scannable = False
            continue
        if dataset.ndim != 1:
            collect.error(InputFormatError(url, f"has shape {dataset.shape}", dataset=name, expected="a 1-D integer dataset"))
            scannable = False
            continue
        if dataset.dtype.kind not in "iu":
            collect.error(
                InputFormatError(url, f"has dtype {dataset.dtype}", dataset=name, expected="an integer dtype (ids are offsets)")
            )
            scannable = False
        lengths[name] = int(dataset.shape[0])
    if len(set(lengths.values())) > 1:
        detail = ", ".join(f"{k}={v}" for k, v in lengths.items())
        collect.error(InputFormatError(url, f"datasets differ in length ({detail})", expected="rel, lhs and rhs of equal length"))
        scannable = False
    if not scannable or len(lengths) != len(EDGE_DATASETS):
        return None
    return lengths["rel"]


def _show(value: Any) -> str:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if hasattr(value, "tolist"):
        value = value.tolist()
    return repr(value)


@dataclass
class _BadRows:
    """The first bad row of one kind of problem in one dataset, and how many rows share it."""

    row: int
    value: int
    problem: str
    expected: str
    count: int = 0


def _scan_values(
    handle: h5py.File, url: str, num_edges: int, ctx: EdgeLimits, chunk_rows: int,
    collect: Collector, empty_referenced: set[PartitionKey],
) -> None:
    """Range-check rel/lhs/rhs, ``chunk_rows`` rows at a time; report the first bad row of each kind."""
    found: dict[tuple[str, str], _BadRows] = {}
    buffers = {name: np.empty(min(chunk_rows, num_edges), dtype=np.int64) for name in ("rel", "lhs", "rhs")}

    def note(dataset: str, kind: str, bad: np.ndarray, values: np.ndarray, rel: np.ndarray, begin: int) -> None:
        if not bad.any():
            return
        first = int(np.argmax(bad))
        entry = found.get((dataset, kind))
        if entry is None:
            problem, expected = ctx.describe(dataset, kind, int(values[first]), int(rel[first]))
            entry = found[(dataset, kind)] = _BadRows(begin + first, int(values[first]), problem, expected)
        entry.count += int(bad.sum())

    for begin in range(0, num_edges, chunk_rows):
        end = min(begin + chunk_rows, num_edges)
        arrays = {}
        for name, buffer in buffers.items():
            out = buffer[: end - begin]
            try:
                handle[name].read_direct(out, source_sel=np.s_[begin:end])
            except (OSError, ValueError, TypeError) as err:
                collect.error(
                    InputFormatError(
                        url, f"cannot read rows {begin}..{end - 1} ({_first_line(err)}); the file is truncated or corrupt",
                        dataset=name, row=begin, expected="a complete HDF5 file",
                    )
                )
                return
            arrays[name] = out
        for dataset, kind, bad, rel_ids in ctx.bad_rows(arrays["rel"], arrays):
            note(dataset, kind, bad, arrays[dataset], rel_ids, begin)
            if kind == "empty":
                for rel_id in np.unique(rel_ids[bad]):
                    empty_referenced.add(ctx.labels[dataset][int(rel_id)][:2])

    for (dataset, _kind), entry in sorted(found.items(), key=lambda item: item[1].row):
        more = f"; {entry.count} bad rows in all" if entry.count > 1 else ""
        collect.error(InputFormatError(url, entry.problem + more, dataset=dataset, row=entry.row, expected=entry.expected))


def _first_line(err: BaseException | str) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:120] if text else type(err).__name__


@contextlib.contextmanager
def _open_edge_file(url: str) -> Iterator[h5py.File]:
    """Open a bucket file, telling a truncated file (the common corruption: an interrupted copy) from garbage."""
    with contextlib.ExitStack() as stack:
        try:  # only the opening (the checksum is checked by the caller, full scans only)
            handle = stack.enter_context(open_edge_h5(url))
        except FileNotFoundError:
            raise InputFormatError(url, "missing", expected="an HDF5 edge file") from None
        except NotHDF5Error as err:
            match = _TRUNCATED_RE.search(err.detail)
            if match:
                raise InputFormatError(
                    url, f"truncated HDF5 file ({match.group('eof')} bytes, its header says {match.group('stored')})",
                    expected="a complete HDF5 file",
                ) from None
            raise InputFormatError(url, f"not a readable HDF5 file ({_first_line(err.detail)})",
                                   expected="an HDF5 file") from None
        yield handle


def check_edge_file(
    url: str, collect: Collector, full: bool, ctx: EdgeLimits | None, chunk_rows: int,
    empty_referenced: set[PartitionKey],
) -> int:
    """Check one bucket file; returns its number of edges (0 when unreadable)."""
    if not storage.exists(url):
        collect.error(InputFormatError(url, "missing", expected="one edges_{l}_{r}.h5 file per bucket (an empty one is fine)"))
        return 0
    per_file = Collector(ValidationReport(), collect.fail_fast)
    num_edges: int | None = None
    try:
        if full:  # the importer's checksum manifest, when the directory has one
            verify_edge_file(url, storage.local_path_if_local(url))
        with _open_edge_file(url) as handle:
            num_edges = _check_structure(handle, url, per_file)
            if full and num_edges and ctx is not None:
                _scan_values(handle, url, num_edges, ctx, chunk_rows, per_file, empty_referenced)
    except InputFormatError as err:
        if collect.fail_fast:
            raise
        per_file.error(err)
    except HDF5_READ_ERRORS as err:  # HDF5 errors past opening: metadata damaged or cut off by truncation
        per_file.error(InputFormatError(url, f"not a readable HDF5 file ({_first_line(err)})", expected="a complete HDF5 file"))
    problems = per_file.report.problems
    if len(problems) > MAX_PROBLEMS_PER_FILE:
        dropped = len(problems) - MAX_PROBLEMS_PER_FILE
        problems = problems[:MAX_PROBLEMS_PER_FILE] + [f"{url}: {dropped} more problems not shown"]
    collect.report.problems.extend(problems)
    return num_edges or 0
