"""Phase 3 of a sharded import: each bucket file written once, from every shard's piece; then the commit.

A bucket's edges are its pieces from the shards of its input file, in shard order (so in input
order), each read from its group's file and turned into final offsets through the partition maps of phase 2 and filtered by the
min counts. The file goes straight to its edge path; only the checksum manifest, the relation
names, the entity count files and the import marker wait for every bucket (``finish``), written
by pod 0 in that order: a reader that finds the count files finds everything they describe.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import storage_adapters as storage
from job.config import ConfigSchema
from job.data.importing import kernels
from job.data.importing.bucketing import PIECES_IN_MEMORY
from job.data.importing.dictionary import MAP_DTYPE, dict_unit, map_file
from job.data.importing.mapper import group_files
from job.data.importing.options import ID_DTYPE, ImportSummary
from job.data.importing.plan import Plan
from job.data.importing.shards import Group
from job.data.importing.staging import Staging, write_import_marker
from job.formats import entities as ent
from job.formats.edges import edges_file, write_edge_manifest, write_edges
from storage_adapters.fs import call

logger = logging.getLogger("biggraph")

CHUNK = 1 << 20  # edges read from a piece at a time
MAP_CACHE = 1 << 25  # partition map entries (int32) a pod keeps between buckets: 128 MiB
_ITEM = np.dtype(ID_DTYPE).itemsize


def bucket_unit(edge_index: int, lhs_part: int, rhs_part: int) -> str:
    return f"bucket-{edge_index:03d}-{lhs_part:05d}-{rhs_part:05d}"


def bucket_units(config: ConfigSchema, plan: Plan) -> list[tuple[int, int, int]]:
    return [(e, lp, rp) for e in range(len(config.edge_paths)) for lp in range(plan.parts_lhs) for rp in range(plan.parts_rhs)]


def read_range(url: str, start: int, length: int) -> bytes:
    """``length`` bytes of ``url`` from ``start`` (one ranged GET on an object store)."""
    if length <= 0:
        return b""
    if storage.is_local(url):
        with open(storage.local_path(url), "rb") as handle:
            handle.seek(start)
            return handle.read(length)
    fs, path = storage.get_filesystem(url)
    return bytes(call(url, "read", lambda: fs.cat_file(path, start=start, end=start + length)))


def relation_maps(group_records: list[dict[str, Any]], min_count: int) -> tuple[list[str], list[np.ndarray]]:
    """Dynamic relations: the kept names in sorted order, and per group its local id -> kept id (-1: dropped)."""
    totals: dict[str, int] = {}
    for record in group_records:
        for name, count in zip(record["relations"], record["relation_counts"]):
            totals[name] = totals.get(name, 0) + count
    names = sorted(name for name, count in totals.items() if count >= min_count)
    index = {name: i for i, name in enumerate(names)}
    maps = [np.array([index.get(n, -1) for n in record["relations"]] or [-1], dtype=np.int64) for record in group_records]
    return names, maps


@dataclass
class BucketJob:
    """What phase 3 needs to know of the whole import (built once per pod from the phase 1 and 2 markers)."""

    config: ConfigSchema
    plan: Plan
    groups: list[Group]
    group_records: list[dict[str, Any]]
    staging: Staging
    rel_maps: list[np.ndarray] | None  # dynamic relations only
    unpartitioned: list[bool] = field(default_factory=list)
    _maps: dict[tuple[int, int, int], np.ndarray] = field(default_factory=dict)
    _cached: int = 0

    def __post_init__(self) -> None:
        self.unpartitioned = [self.config.entities[n].num_partitions == 1 for n in self.plan.type_names]

    def map_slice(self, group: int, type_index: int, part: int) -> np.ndarray:
        """Group ``group``'s entries of (type, partition) as final offsets. Kept for the pod's next buckets (the
        buckets of one lhs partition all need the same slices) up to ``MAP_CACHE`` entries, oldest dropped first."""
        key = (group, type_index, part)
        found = self._maps.get(key)
        if found is not None:
            return found
        sizes = [record["parts"][type_index][part] for record in self.group_records]
        data = read_range(map_file(self.staging, type_index, part), sum(sizes[:group]) * 4, sizes[group] * 4)
        values = np.frombuffer(data, dtype=MAP_DTYPE)
        while self._maps and self._cached + len(values) > MAP_CACHE:
            self._cached -= len(self._maps.pop(next(iter(self._maps))))
        self._maps[key] = values
        self._cached += len(values)
        return values


def _final_side(job: BucketJob, group: int, types: np.ndarray, local: np.ndarray, part: int,
                cache: dict[tuple[int, int], np.ndarray]) -> np.ndarray:
    if len(job.plan.type_names) == 1:
        return _slice(job, group, 0, part, cache)[local].astype(np.int64)
    out = np.empty(len(local), dtype=np.int64)
    for type_index in kernels.distinct(types).tolist():
        rows = np.flatnonzero(types == type_index)
        out[rows] = _slice(job, group, type_index, part, cache)[local[rows]]
    return out


def _slice(job: BucketJob, group: int, type_index: int, part: int, cache: dict[tuple[int, int], np.ndarray]) -> np.ndarray:
    key = (type_index, 0 if job.unpartitioned[type_index] else part)
    if key not in cache:
        cache[key] = job.map_slice(group, *key)
    return cache[key]


def _piece(job: BucketJob, group: int, position: int, bucket: int, parts: tuple[int, int],
           files: list[Any]) -> tuple[int, int]:
    """Append the edges of ``bucket`` of the ``position``-th shard of ``group``, as final ids, to ``files``;
    (edges kept, edges dropped)."""
    record = job.group_records[group]
    counts = record["buckets"][position]
    n = counts[bucket]
    before = sum(sum(c) for c in record["buckets"][:position]) + sum(counts[:bucket])
    base = 3 * _ITEM * before
    url = group_files(job.staging, group)[1]
    plan = job.plan
    cache: dict[tuple[int, int], np.ndarray] = {}
    kept = dropped = 0
    for begin in range(0, n, CHUNK):
        size = min(CHUNK, n - begin)
        rel, lhs, rhs = (
            np.frombuffer(read_range(url, base + (k * n + begin) * _ITEM, size * _ITEM), dtype=ID_DTYPE).astype(np.int64)
            for k in range(3)
        )
        if plan.dynamic or len(plan.type_names) == 1:
            lhs_types = np.full(size, plan.lhs_type[0])
            rhs_types = np.full(size, plan.rhs_type[0])
        else:
            lhs_types, rhs_types = plan.lhs_type[rel], plan.rhs_type[rel]
        lhs = _final_side(job, group, lhs_types, lhs, parts[0], cache)
        rhs = _final_side(job, group, rhs_types, rhs, parts[1], cache)
        if job.rel_maps is not None:
            rel = job.rel_maps[group][rel]
        keep = (lhs >= 0) & (rhs >= 0) & (rel >= 0)
        if not keep.all():
            rel, lhs, rhs = rel[keep], lhs[keep], rhs[keep]
        for handle, values in zip(files, (rel, lhs, rhs)):
            handle.write(values.astype(ID_DTYPE).tobytes())
        kept += len(rel)
        dropped += size - len(rel)
    return kept, dropped


def _gather(job: BucketJob, pieces: list[tuple[int, int]], bucket: int, parts: tuple[int, int],
            files: list[Any]) -> tuple[int, int]:
    kept = dropped = 0
    for group, position in pieces:
        got, lost = _piece(job, group, position, bucket, parts, files)
        kept, dropped = kept + got, dropped + lost
    return kept, dropped


def assemble_bucket(job: BucketJob, unit: tuple[int, int, int], workdir: str) -> None:
    """Phase 3 for bucket ``unit`` = (edge path index, lhs partition, rhs partition): its file, then its marker.
    Its columns are gathered in memory, or in local files when the bucket is large (``PIECES_IN_MEMORY``)."""
    edge_index, lhs_part, rhs_part = unit
    bucket = lhs_part * job.plan.parts_rhs + rhs_part
    pieces = [(group.index, position) for group in job.groups  # in input order: groups are runs of shards, in order
              for position, shard in enumerate(group.shards)
              if shard.file_index == edge_index and job.group_records[group.index]["buckets"][position][bucket]]
    url = edges_file(job.config.edge_paths[edge_index], lhs_part, rhs_part)
    if sum(job.group_records[g]["buckets"][p][bucket] for g, p in pieces) <= PIECES_IN_MEMORY:
        columns = [io.BytesIO() for _ in range(3)]
        kept, dropped = _gather(job, pieces, bucket, (lhs_part, rhs_part), columns)
        arrays = [np.frombuffer(column.getbuffer(), dtype=ID_DTYPE) for column in columns]
        size, crc = write_edges(url, arrays[0], arrays[1], arrays[2])
        del arrays
    else:
        local = os.path.join(workdir, f"bucket_{edge_index}_{lhs_part}_{rhs_part}")
        os.makedirs(local)
        paths = [os.path.join(local, name) for name in ("rel", "lhs", "rhs")]
        try:
            files = [open(path, "wb") for path in paths]  # noqa: SIM115 - closed below
            try:
                kept, dropped = _gather(job, pieces, bucket, (lhs_part, rhs_part), files)
            finally:
                for handle in files:
                    handle.close()
            arrays = [np.memmap(p, dtype=ID_DTYPE, mode="r") if kept else np.zeros(0, ID_DTYPE) for p in paths]
            size, crc = write_edges(url, arrays[0], arrays[1], arrays[2])
            del arrays
        finally:
            shutil.rmtree(local, ignore_errors=True)
    job.staging.commit(bucket_unit(*unit), {"size": size, "crc": crc, "edges": kept, "dropped": dropped})


def finish(job: BucketJob, dict_records: dict[tuple[int, int], dict[str, Any]], relation_names: list[str] | None,
           digest: str, summary: ImportSummary) -> ImportSummary:
    """The commit (pod 0, after every bucket): manifests, relation names, count files, the import marker."""
    config, plan, staging = job.config, job.plan, job.staging
    units = bucket_units(config, plan)
    records = staging.read(bucket_unit(*u) for u in units)
    for edge_index, edge_path in enumerate(config.edge_paths):
        entries = {
            edges_file(edge_path, lp, rp).rsplit("/", 1)[-1]: (record["size"], record["crc"])
            for (e, lp, rp), record in zip(units, records) if e == edge_index
        }
        write_edge_manifest(edge_path, entries)
    summary.edges_written = sum(r["edges"] for r in records)
    summary.filtered_edges = sum(r["dropped"] for r in records)
    if relation_names is not None:
        ent.write_dynamic_rel_names(config.entity_path, relation_names)
        ent.write_dynamic_rel_count(config.entity_path, len(relation_names))
    for (type_index, part), record in sorted(dict_records.items()):
        name = plan.type_names[type_index]
        ent.write_entity_count(config.entity_path, name, part, record["count"])
        summary.entities[name] = summary.entities.get(name, 0) + record["count"]
    write_import_marker(config, digest, summary)
    staging.remove()
    return summary


def dict_records_of(staging: Staging, units: list[tuple[int, int]]) -> dict[tuple[int, int], dict[str, Any]]:
    return dict(zip(units, staging.read(dict_unit(*u) for u in units)))

