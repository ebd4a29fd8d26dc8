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

import re
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import storage_adapters as storage
from job.errors import InputFormatError, UserError
from job.formats.edges import EdgeLimits, edges_file
from job.formats.entities import count_file, read_count_file, read_dynamic_rel_count
from job.formats.validate_edges import MAX_PROBLEMS_PER_FILE, Collector, ValidationReport, check_edge_file
from job.session import storage_scoped
from job.types import PartitionKey

if TYPE_CHECKING:
    from job.config import ConfigSchema

__all__ = [
    "CHUNK_ROWS", "MAX_PROBLEMS_PER_FILE", "ValidationReport", "run_validation", "side_partitions", "validate_cheap",
    "validate_full",
]

CHUNK_ROWS = 1 << 20
REMOTE_CHECKS = 16  # bucket files the cheap check opens at once on an object store

_COUNT_FILE_RE = re.compile(r"^entity_count_(?P<type>.+)_(?P<part>\d+)\.txt$")
_EDGE_FILE_RE = re.compile(r"^edges_(?P<lhs>\d+)_(?P<rhs>\d+)\.h5$")


def side_partitions(config: ConfigSchema, side: str) -> int:
    """The number of bucket partitions on one side, as PBG's ``get_partitioned_types``.

    Only types that are actually used on that side of some relation and are really
    partitioned (num_partitions > 1) count; a side with only unpartitioned types has 1.
    """
    parts = {config.entities[getattr(rel, side)].num_partitions for rel in config.relations} - {1}
    return max(parts, default=1)


def _num_relation_ids(config: ConfigSchema, collect: Collector) -> int | None:
    """How many relation ids edges may use (None when the dynamic count is unreadable)."""
    if not config.dynamic_relations:
        return len(config.relations)
    try:
        return read_dynamic_rel_count(config.entity_path)
    except InputFormatError as err:
        collect.error(err)
        return None


def _missing_bucket(url: str, collect: Collector) -> bool:
    """Report a missing bucket as such (not as a missing directory); True when it was one."""
    try:
        storage.check_bucket(url)
    except storage.StorageError as err:
        collect.error(UserError(str(err)))
        return True
    return False


def _entity_path_exists(config: ConfigSchema, collect: Collector) -> bool:
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


def _check_counts(config: ConfigSchema, collect: Collector) -> dict[str, list[int | None]]:
    """Read every count file; None marks a partition whose count is unknown (already reported)."""
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


def _check_extra_count_files(config: ConfigSchema, collect: Collector) -> None:
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


def _edge_path_exists(edge_path: str, collect: Collector, key: str = "edge_paths") -> bool:
    if storage.isdir(edge_path):
        return True
    if _missing_bucket(edge_path, collect):
        return False
    collect.error(
        InputFormatError(edge_path, "directory not found",
                         expected=f"{'an' if key[0] in 'aeiou' else 'a'} {key} directory holding edges_{{l}}_{{r}}.h5 files")
    )
    return False


def _check_extra_edge_files(edge_path: str, nparts: tuple[int, int], collect: Collector) -> None:
    for name in storage.listdir(edge_path):
        match = _EDGE_FILE_RE.match(name)
        if match and (int(match.group("lhs")) >= nparts[0] or int(match.group("rhs")) >= nparts[1]):
            collect.error(
                InputFormatError(
                    storage.join(edge_path, name), "unexpected bucket file",
                    expected=f"buckets edges_{{l}}_{{r}}.h5 with l < {nparts[0]} and r < {nparts[1]} for this config",
                )
            )


@storage_scoped
def run_validation(
    config: ConfigSchema, *, full: bool = True, fail_fast: bool = False, chunk_rows: int = CHUNK_ROWS
) -> ValidationReport:
    """Check the config's input files; ``full`` scans every value, ``fail_fast`` raises the first problem."""
    report = ValidationReport()
    collect = Collector(report, fail_fast)
    counts: dict[str, list[int | None]] = {}
    num_rel_ids: int | None = len(config.relations)
    if _entity_path_exists(config, collect):
        counts = _check_counts(config, collect)
        report.entity_counts = counts
        if full:
            _check_extra_count_files(config, collect)
        num_rel_ids = _num_relation_ids(config, collect)
    nparts = (side_partitions(config, "lhs"), side_partitions(config, "rhs"))
    empty_referenced: set[PartitionKey] = set()

    def check_path(edge_path: str, key: str, scan: bool) -> int | None:
        """The edges of one directory (None: it is missing); ``scan``: every value checked."""
        per_file: list[int]
        if not _edge_path_exists(edge_path, collect, key):
            return None
        if full:
            _check_extra_edge_files(edge_path, nparts, collect)
        buckets = [(lhs_part, rhs_part) for lhs_part in range(nparts[0]) for rhs_part in range(nparts[1])]
        if not scan and collect.fail_fast and not storage.is_local(edge_path):
            # the cheap check on an object store: ~3 requests per bucket file, P^2 files (P=16: ~800 requests,
            # ~10 s one after another, paid again by every trainer a torchrun round restarts); in flight together,
            # the first problem in bucket order still raised first (pool.map yields in order)
            with ThreadPoolExecutor(REMOTE_CHECKS) as pool:
                per_file = list(pool.map(storage.carry(lambda url: check_edge_file(
                    url, collect, False, None, chunk_rows, empty_referenced)),
                    [edges_file(edge_path, lhs, rhs) for lhs, rhs in buckets]))
            report.edge_files += len(buckets)
        else:
            per_file = []
            for lhs_part, rhs_part in buckets:
                ctx = None
                if scan and num_rel_ids is not None and counts:
                    ctx = EdgeLimits.for_bucket(config, counts, num_rel_ids, (lhs_part, rhs_part))
                url = edges_file(edge_path, lhs_part, rhs_part)
                per_file.append(check_edge_file(url, collect, scan, ctx, chunk_rows, empty_referenced))
                report.edge_files += 1
        total = sum(per_file)
        report.edges_per_path[edge_path] = total
        report.largest_edge_file[edge_path] = max(per_file, default=0)
        return total

    for edge_path in config.edge_paths:
        check_path(edge_path, "edge_paths", full)
    # validation edges are read whole at every validation, after an epoch of training: every value is checked now,
    # also by the cheap check that train runs first
    for edge_path in config.validation_edge_paths:
        if check_path(edge_path, "validation_edge_paths", True) == 0:
            collect.error(InputFormatError(edge_path, "no edges (config key 'validation_edge_paths')",
                                           expected="the validation split's edges, imported like edge_paths"))
    for edge_path in config.validation_filter_paths:
        check_path(edge_path, "validation_filter_paths", True)
    for entity_type, per_part in counts.items():
        for part, count in enumerate(per_part):
            if count == 0 and (entity_type, part) not in empty_referenced:
                report.warnings.append(
                    f"{count_file(config.entity_path, entity_type, part)}: partition {part} of entity type "
                    f"'{entity_type}' has 0 entities (no edge points into it, but it cannot be trained)"
                )
    return report


def validate_cheap(config: ConfigSchema) -> ValidationReport:
    """Raise the first problem found without scanning values (counts, bucket files, edge file headers); returns
    what it read (the entity counts, each path's largest bucket file: a trainer takes them from here)."""
    return run_validation(config, full=False, fail_fast=True)


def validate_full(config: ConfigSchema, chunk_rows: int = CHUNK_ROWS) -> list[str]:
    """Every problem of the config's input files, one line each (empty when all is well)."""
    return run_validation(config, full=True, chunk_rows=chunk_rows).problems

