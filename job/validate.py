"""``biggraph validate``: check a graph's input files against its config before training.

A malformed input found after an hour of training wastes the hour, and PBG's own
failures on bad input are index errors deep inside a worker. This command reads
everything a training run would read and reports every problem it finds, each as one
line naming the file, the dataset, the first bad row (0-based) and what was expected:

- entity counts: a ``entity_count_{type}_{part}.txt`` for every (type, partition),
  each holding a non-negative integer; files for partitions the config does not have
  (``part >= num_partitions``) are errors, because they mean the config and the data
  disagree on the partitioning; files for types the config does not name are warnings.
- ``dynamic_rel_count.txt`` when ``dynamic_relations`` is set.
- one ``edges_{l}_{r}.h5`` per bucket in each edge path, where ``l``/``r`` range over the
  number of partitions of each *side* exactly as PBG computes it (unpartitioned types
  do not count, so a side whose types are all unpartitioned has a single partition),
  and no bucket files beyond those.
- every edge file: readable HDF5, ``format_version`` = 1, 1-D integer ``rel``/``lhs``/``rhs``
  of equal length; then, reading ``CHUNK_ROWS`` rows at a time so memory stays bounded on
  files of any size: ``rel`` in ``[0, number of relations)`` (the dynamic count with dynamic
  relations), ``lhs``/``rhs`` in ``[0, count)`` of the relation's entity type in the
  bucket's partition (partition 0 for an unpartitioned type). Indices of featurized
  types are not range-checked (PBG stores -1 there; their features live in ``lhsd_*``).

Zero entities in a partition: an error when any edge points into that partition (PBG
would index an empty embedding table), otherwise a warning (legal, if suspicious).

``validate_cheap`` runs the checks that need no scan of the values and raises the first
problem; ``train`` calls it before touching anything. ``validate_full`` returns all
problems as strings.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from job.errors import InputFormatError, UserError
from job.formats.edges import EdgeLimits, verify_edge_file
from job.session import storage_scoped

if TYPE_CHECKING:
    import h5py
    import numpy as np

    from job.config import ConfigSchema

CHUNK_ROWS = 1 << 20
MAX_PROBLEMS_PER_FILE = 20

_COUNT_FILE_RE = re.compile(r"^entity_count_(?P<type>.+)_(?P<part>\d+)\.txt$")
_TRUNCATED_RE = re.compile(r"truncated file: eof = (?P<eof>\d+).*stored_eof = (?P<stored>\d+)")
_EDGE_FILE_RE = re.compile(r"^edges_(?P<lhs>\d+)_(?P<rhs>\d+)\.h5$")


@dataclass
class ValidationReport:
    """Everything ``validate`` found: problems (errors), warnings and what it looked at."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    count_files: int = 0
    total_entities: int = 0
    edge_files: int = 0
    edges_per_path: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


class _Collector:
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


def side_partitions(config: ConfigSchema, side: str) -> int:
    """The number of bucket partitions on one side, as PBG's ``get_partitioned_types``.

    Only types that are actually used on that side of some relation and are really
    partitioned (num_partitions > 1) count; a side with only unpartitioned types has 1.
    """
    parts = {config.entities[getattr(rel, side)].num_partitions for rel in config.relations} - {1}
    return max(parts, default=1)


def _num_relation_ids(config: ConfigSchema, collect: _Collector) -> int | None:
    """How many relation ids edges may use (None when the dynamic count is unreadable)."""
    if not config.dynamic_relations:
        return len(config.relations)
    from job.formats.entities import read_dynamic_rel_count

    try:
        return read_dynamic_rel_count(config.entity_path)
    except InputFormatError as err:
        collect.error(err)
        return None


def _missing_bucket(url: str, collect: _Collector) -> bool:
    """Report a missing bucket as such (not as a missing directory); True when it was one."""
    import storage_adapters as storage

    try:
        storage.check_bucket(url)
    except storage.StorageError as err:
        collect.error(UserError(str(err)))
        return True
    return False


def _entity_path_exists(config: ConfigSchema, collect: _Collector) -> bool:
    import storage_adapters as storage

    if storage.isdir(config.entity_path):
        return True
    if _missing_bucket(config.entity_path, collect):
        return False
    collect.error(
        InputFormatError(
            config.entity_path, "directory not found",
            expected="the entity_path directory holding entity_count_{type}_{part}.txt files",
        )
    )
    return False


def _check_counts(config: ConfigSchema, collect: _Collector) -> dict[str, list[int | None]]:
    """Read every count file; None marks a partition whose count is unknown (already reported)."""
    from job.formats.entities import count_file, read_count_file

    counts: dict[str, list[int | None]] = {}
    for entity_type, schema in config.entities.items():
        counts[entity_type] = []
        for part in range(schema.num_partitions):
            try:
                value: int | None = read_count_file(count_file(config.entity_path, entity_type, part))
                collect.report.count_files += 1
                collect.report.total_entities += value or 0
            except InputFormatError as err:
                collect.error(err)
                value = None
            counts[entity_type].append(value)
    return counts


def _check_extra_count_files(config: ConfigSchema, collect: _Collector) -> None:
    import storage_adapters as storage

    for name in storage.listdir(config.entity_path):
        match = _COUNT_FILE_RE.match(name)
        if not match:
            continue
        entity_type, part = match.group("type"), int(match.group("part"))
        url = storage.join(config.entity_path, name)
        if entity_type not in config.entities:
            collect.warn(f"{url}: entity type '{entity_type}' is not in the config (ignored)")
        elif part >= config.entities[entity_type].num_partitions:
            parts = config.entities[entity_type].num_partitions
            collect.error(
                InputFormatError(
                    url, f"unexpected count file for partition {part} of entity type '{entity_type}'",
                    expected=f"partitions 0..{parts - 1} only, as entities.{entity_type}.num_partitions = {parts}",
                )
            )


def _edge_path_exists(edge_path: str, collect: _Collector) -> bool:
    import storage_adapters as storage

    if storage.isdir(edge_path):
        return True
    if _missing_bucket(edge_path, collect):
        return False
    collect.error(
        InputFormatError(edge_path, "directory not found", expected="an edge_paths directory holding edges_{l}_{r}.h5 files")
    )
    return False


def _check_extra_edge_files(edge_path: str, nparts: tuple[int, int], collect: _Collector) -> None:
    import storage_adapters as storage

    for name in storage.listdir(edge_path):
        match = _EDGE_FILE_RE.match(name)
        if match and (int(match.group("lhs")) >= nparts[0] or int(match.group("rhs")) >= nparts[1]):
            collect.error(
                InputFormatError(
                    storage.join(edge_path, name), "unexpected bucket file",
                    expected=f"buckets edges_{{l}}_{{r}}.h5 with l < {nparts[0]} and r < {nparts[1]} for this config",
                )
            )


def _check_structure(handle: h5py.File, url: str, collect: _Collector) -> int | None:
    """The cheap rules of one edge file; returns its edge count when the values can be scanned."""
    import h5py
    import numpy as np

    from job.formats.edges import EDGE_DATASETS, FORMAT_VERSION, FORMAT_VERSION_ATTR

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
    collect: _Collector, empty_referenced: set[tuple[str, int]],
) -> None:
    """Range-check rel/lhs/rhs, ``chunk_rows`` rows at a time; report the first bad row of each kind."""
    import numpy as np

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


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:120] if text else type(err).__name__


@contextlib.contextmanager
def _open_edge_file(url: str) -> Iterator[h5py.File]:
    """Open a bucket file, telling a truncated file (the common corruption: an interrupted copy) from garbage."""
    import h5py

    import storage_adapters as storage
    from job.formats.edges import open_h5

    if not storage.is_local(url):
        with open_h5(url, verify=False) as handle:  # the checksum is checked by the caller (full scans only)
            yield handle
        return
    try:
        handle = h5py.File(storage.local_path(url), "r")
    except OSError as err:
        match = _TRUNCATED_RE.search(str(err))
        if match:
            raise InputFormatError(
                url, f"truncated HDF5 file ({match.group('eof')} bytes, its header says {match.group('stored')})",
                expected="a complete HDF5 file",
            ) from None
        raise InputFormatError(url, f"not a readable HDF5 file ({_first_line(err)})", expected="an HDF5 file") from None
    with handle:
        yield handle


def _check_edge_file(
    url: str, collect: _Collector, full: bool, ctx: EdgeLimits | None, chunk_rows: int,
    empty_referenced: set[tuple[str, int]],
) -> int:
    """Check one bucket file; returns its number of edges (0 when unreadable)."""
    import storage_adapters as storage
    from job.formats.edges import HDF5_READ_ERRORS

    if not storage.exists(url):
        collect.error(InputFormatError(url, "missing", expected="one edges_{l}_{r}.h5 file per bucket (an empty one is fine)"))
        return 0
    per_file = _Collector(ValidationReport(), collect.fail_fast)
    num_edges: int | None = None
    try:
        if full:  # the importer's checksum manifest, when the directory has one
            verify_edge_file(url, storage.local_path(url) if storage.is_local(url) else None)
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


@storage_scoped
def run_validation(
    config: ConfigSchema, *, full: bool = True, fail_fast: bool = False, chunk_rows: int = CHUNK_ROWS
) -> ValidationReport:
    """Check the config's input files; ``full`` scans every value, ``fail_fast`` raises the first problem."""
    from job.formats.edges import edges_file

    report = ValidationReport()
    collect = _Collector(report, fail_fast)
    counts: dict[str, list[int | None]] = {}
    num_rel_ids: int | None = len(config.relations)
    if _entity_path_exists(config, collect):
        counts = _check_counts(config, collect)
        if full:
            _check_extra_count_files(config, collect)
        num_rel_ids = _num_relation_ids(config, collect)
    nparts = (side_partitions(config, "lhs"), side_partitions(config, "rhs"))
    empty_referenced: set[tuple[str, int]] = set()
    for edge_path in config.edge_paths:
        total = 0
        if not _edge_path_exists(edge_path, collect):
            continue
        if full:
            _check_extra_edge_files(edge_path, nparts, collect)
        for lhs_part in range(nparts[0]):
            for rhs_part in range(nparts[1]):
                ctx = None
                if full and num_rel_ids is not None and counts:
                    ctx = EdgeLimits.for_bucket(config, counts, num_rel_ids, (lhs_part, rhs_part))
                url = edges_file(edge_path, lhs_part, rhs_part)
                total += _check_edge_file(url, collect, full, ctx, chunk_rows, empty_referenced)
                report.edge_files += 1
        report.edges_per_path[edge_path] = total
    from job.formats.entities import count_file

    for entity_type, per_part in counts.items():
        for part, count in enumerate(per_part):
            if count == 0 and (entity_type, part) not in empty_referenced:
                report.warnings.append(
                    f"{count_file(config.entity_path, entity_type, part)}: partition {part} of entity type "
                    f"'{entity_type}' has 0 entities (no edge points into it, but it cannot be trained)"
                )
    return report


def validate_cheap(config: ConfigSchema) -> None:
    """Raise the first problem found without scanning values (counts, bucket files, edge file headers)."""
    run_validation(config, full=False, fail_fast=True)


def validate_full(config: ConfigSchema, chunk_rows: int = CHUNK_ROWS) -> list[str]:
    """Every problem of the config's input files, one line each (empty when all is well)."""
    return run_validation(config, full=True, chunk_rows=chunk_rows).problems

