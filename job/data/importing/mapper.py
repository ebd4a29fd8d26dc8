"""Phase 1 of a sharded import: a group of shards' rows -> its entities per partition and its edges per bucket.

Each shard of a group (``shards.Group``) is parsed, checked and hashed exactly as a single-process
import parses a file (the same ``Importer`` pass 1, through a byte-range reader), into one entity table.
Each entity's partition is a hash of its name (``hashing.partition_of``), so the group can bucket its
edges at once, with no global dictionary. It leaves in staging:

- ``names.arrow``: per (entity type, partition), the distinct ids it saw, sorted by hash, with
  their counts (an Arrow IPC file, one record batch per partition: read back without pickling);
- ``edges.bin``: per shard, per bucket, its edges as int32 (rel, lhs, rhs), lhs/rhs being positions in
  the group's list for the partition (phase 2 turns them into final offsets), in input order;
- its marker, last, with the counts the later phases need to find their slices of both files.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import IO

import numpy as np

import storage_adapters as storage
from job.config import ConfigSchema
from job.data.importing import kernels
from job.data.importing.bucketing import (
    PIECES_IN_MEMORY,
    SPILLED,
    BucketedChunk,
    append_to_buckets,
    keep_by_bucket,
    read_spilled,
)
from job.data.importing.hashing import partition_of, spread_of
from job.data.importing.importer import Importer
from job.data.importing.options import ImportOptions
from job.data.importing.readers import Source
from job.data.importing.shards import Group
from job.data.importing.staging import Staging

logger = logging.getLogger("biggraph")

# edges bucketed at a time: ~110 B of numpy temporaries an edge, over the group's layouts; at 1M a chunk set a pod's
# peak (446 MiB against 375 at the end of pass 1, issue #46), at 256k pass 1 sets it. The output does not depend on it.
CHUNK = 1 << 18
NAMES_SCHEMA_FIELDS = (("hash", "uint64"), ("count", "int64"), ("name", "large_string"))


def group_unit(index: int) -> str:
    return f"group-{index:06d}"


def group_files(staging: Staging, index: int) -> tuple[str, str]:
    """(names.arrow, edges.bin) of group ``index``."""
    return staging.url("groups", f"{index:06d}", "names.arrow"), staging.url("groups", f"{index:06d}", "edges.bin")


@dataclass
class _TypeLayout:
    """Where each shard-local entity of one type goes, and its hash."""

    packed: np.ndarray  # ``partition << 32 | position there`` per local id: one gather places an edge's side
    hashes: np.ndarray  # per local id
    order: np.ndarray  # local ids sorted by (partition, hash)
    sizes: np.ndarray  # entities per partition


class GroupImporter(Importer):
    """Pass 1 of ``Importer`` over the shards of a group (each its byte range only), as its "files"."""

    def __init__(self, config: ConfigSchema, group: Group, options: ImportOptions, workdir: str) -> None:
        super().__init__(config, [shard.url for shard in group.shards], options, workdir)
        self.group = group

    def _source(self, file_index: int, url: str) -> Source:
        return Source(url, self.options, self.group.shards[file_index].byte_range)

    def read(self) -> None:
        self._pass1(time.monotonic())

    def layouts(self) -> list[_TypeLayout]:
        """Each type's entities ordered by (partition, hash). The table's lookup arrays already hold them in hash
        order (every id once: a group's table is never preloaded), so a stable sort by partition alone finishes the
        order; on a small integer key numpy's stable sort is a radix sort, linear where a two-key lexsort was
        n log n. Every pod of a uniform graph orders nearly every id, so this is paid once per pod, and its arrays
        (a few per id) set a pod's peak memory after the reading: built in place, without an array per id that
        only leads to another (issue #46)."""
        layouts = []
        for name, table in zip(self.plan.type_names, self.tables):
            num_parts = self.config.entities[name].num_partitions
            by_hash = table.sorted_ids
            assert len(by_hash) == table.size, "a group's table holds each id once"
            part_by_hash = partition_of(table.sorted_hashes, num_parts, self.options.seed)
            sizes = np.bincount(part_by_hash, minlength=num_parts).astype(np.int64)
            key = part_by_hash.astype(np.int16) if num_parts <= np.iinfo(np.int16).max else part_by_hash
            del part_by_hash
            order = by_hash[np.argsort(key, kind="stable")]
            del key
            # in (partition, hash) order, the i-th id's packed place is partition << 32 | (i - the partition's start)
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
            place = np.arange(table.size, dtype=np.int64)
            place -= np.repeat(starts - (np.arange(num_parts, dtype=np.int64) << 32), sizes)
            packed = np.empty(table.size, dtype=np.int64)
            packed[order] = place
            del place
            hashes = np.empty(table.size, dtype=np.uint64)
            hashes[by_hash] = table.sorted_hashes
            layouts.append(_TypeLayout(packed, hashes, order, sizes))
        return layouts


def _write_names(url: str, importer: GroupImporter, layouts: list[_TypeLayout]) -> None:
    import pyarrow as pa  # ~0.3 s: kept off the start-up (see job.data.importing.hashing)

    schema = pa.schema([(name, getattr(pa, kind)()) for name, kind in NAMES_SCHEMA_FIELDS])
    with storage.local_file_for_writing(url) as tmp, pa.OSFile(tmp, "wb") as sink:
        with pa.ipc.new_file(sink, schema) as writer:
            for table, layout in zip(importer.tables, layouts):
                names = table.names() if table.size else None
                start = 0
                for size in layout.sizes.tolist():
                    rows = layout.order[start : start + size]
                    start += size
                    picked = (kernels.take(names, rows).combine_chunks() if names is not None and size
                              else pa.array([], pa.large_string()))
                    writer.write_batch(pa.record_batch(
                        [kernels.numeric_array(layout.hashes[rows], np.uint64),
                         kernels.numeric_array(table.counts[rows], np.int64), picked],
                        schema=schema,
                    ))


def _side(types: np.ndarray, ids: np.ndarray, layouts: list[_TypeLayout], single: bool) -> tuple[np.ndarray, np.ndarray]:
    """(partition, position) of each edge's entity on one side (``types``: its entity type index): one gather
    of the packed ``partition << 32 | position`` per type, the costly part of bucketing."""
    if single:
        packed = layouts[0].packed[ids]
    else:
        packed = np.empty(len(ids), dtype=np.int64)
        for type_index in kernels.distinct(types).tolist():
            rows = np.flatnonzero(types == type_index)
            packed[rows] = layouts[type_index].packed[ids[rows]]
    return packed >> 32, packed & 0xFFFFFFFF


def _hashes(types: np.ndarray, ids: np.ndarray, layouts: list[_TypeLayout]) -> np.ndarray:
    hashes = np.empty(len(ids), dtype=np.uint64)
    for type_index in kernels.distinct(types).tolist():
        rows = np.flatnonzero(types == type_index)
        hashes[rows] = layouts[type_index].hashes[ids[rows]]
    return hashes


def _bucket_edges(importer: GroupImporter, layouts: list[_TypeLayout], bucket_dir: str, shard: int,
                  pieces: dict[tuple[int, str], list[bytes]] | None) -> np.ndarray:
    """Group the spilled edges of the group's ``shard``-th shard by bucket, into ``pieces`` (None: local files in
    ``bucket_dir``); the count per bucket."""
    plan = importer.plan
    num_buckets = plan.parts_lhs * plan.parts_rhs
    unpartitioned = np.array([importer.config.entities[n].num_partitions == 1 for n in plan.type_names])
    single = len(plan.type_names) == 1
    source_dir = os.path.join(importer.workdir, f"spill_{shard}")
    os.makedirs(bucket_dir, exist_ok=True)
    counts = np.zeros(num_buckets, dtype=np.int64)
    total = importer.spilled[shard]
    for begin in range(0, total, CHUNK):
        end = min(total, begin + CHUNK)
        rel, lhs, rhs = (read_spilled(source_dir, name, begin, end) for name in SPILLED)
        if plan.dynamic or single:
            lhs_types = np.full(len(rel), plan.lhs_type[0])
            rhs_types = np.full(len(rel), plan.rhs_type[0])
        else:
            lhs_types, rhs_types = plan.lhs_type[rel], plan.rhs_type[rel]
        lhs_part, lhs_index = _side(lhs_types, lhs, layouts, single)
        rhs_part, rhs_index = _side(rhs_types, rhs, layouts, single)
        # Unpartitioned types sit in any bucket of their side: spread by a hash of the edge (as PBG spreads them).
        for parts, side_part, side_types in ((plan.parts_lhs, lhs_part, lhs_types), (plan.parts_rhs, rhs_part, rhs_types)):
            spread = np.flatnonzero(unpartitioned[side_types]) if parts > 1 and unpartitioned.any() else None
            if spread is not None and len(spread):
                side_part[spread] = spread_of(_hashes(lhs_types[spread], lhs[spread], layouts),
                                              _hashes(rhs_types[spread], rhs[spread], layouts), parts)
        chunk = BucketedChunk(rel, lhs_index, rhs_index, lhs_part * plan.parts_rhs + rhs_part, 0)
        counts += append_to_buckets(bucket_dir, num_buckets, chunk) if pieces is None else \
            keep_by_bucket(pieces, num_buckets, chunk)
    shutil.rmtree(source_dir, ignore_errors=True)
    return counts


def _append_pieces(out: IO[bytes], bucket_dir: str, counts: np.ndarray,
                   pieces: dict[tuple[int, str], list[bytes]] | None) -> None:
    for bucket in np.flatnonzero(counts).tolist():
        for name in SPILLED:
            if pieces is not None:
                for piece in pieces.pop((bucket, name)):
                    out.write(piece)
                continue
            path = os.path.join(bucket_dir, f"{bucket}.{name}")
            with open(path, "rb") as part:
                shutil.copyfileobj(part, out, 1 << 20)
            os.unlink(path)


def read_group(config: ConfigSchema, group: Group, options: ImportOptions, staging: Staging, workdir: str) -> None:
    """Phase 1 for ``group``: its names and edges pieces into staging, then its marker."""
    started = time.monotonic()
    cpu = [time.process_time()]  # after reading, after the names file, after bucketing: where a group's CPU goes
    group_dir = os.path.join(workdir, f"group_{group.index}")
    os.makedirs(group_dir)
    counts = []
    try:
        importer = GroupImporter(config, group, options, group_dir)
        importer.read()
        cpu.append(time.process_time())
        layouts = importer.layouts()
        names_url, edges_url = group_files(staging, group.index)
        _write_names(names_url, importer, layouts)
        cpu.append(time.process_time())
        bucket_dir = os.path.join(group_dir, "buckets")
        with storage.local_file_for_writing(edges_url) as tmp, open(tmp, "wb") as out:
            for position in range(len(group.shards)):
                pieces: dict[tuple[int, str], list[bytes]] | None = \
                    {} if importer.spilled[position] <= PIECES_IN_MEMORY else None
                counts.append(_bucket_edges(importer, layouts, bucket_dir, position, pieces))
                _append_pieces(out, bucket_dir, counts[-1], pieces)
        cpu.append(time.process_time())
    finally:
        shutil.rmtree(group_dir, ignore_errors=True)
    summary = importer.summary
    relation_names = list(importer.dynamic_names)
    staging.commit(group_unit(group.index), {
        "edges_read": summary.edges_read,
        "malformed_rows": summary.malformed_rows,
        "empty_id_rows": summary.empty_id_rows,
        "unknown_relation_rows": summary.unknown_relation_rows,
        "shards": [shard.index for shard in group.shards],
        "buckets": [c.tolist() for c in counts],
        "parts": [layout.sizes.tolist() for layout in layouts],
        "relations": relation_names,
        "relation_counts": importer.dynamic_counts[: len(relation_names)].tolist(),
        "seconds": round(time.monotonic() - started, 3),
    })
    read, names, bucketed = (later - earlier for earlier, later in zip(cpu, cpu[1:]))
    logger.info("import: group %d (%d shards) read: %s edges, %s distinct ids; CPU: %.2f s reading, %.2f s the names "
                "file, %.2f s bucketing", group.index, len(group.shards), f"{summary.edges_read:,}",
                f"{sum(t.size for t in importer.tables):,}", read, names, bucketed)
