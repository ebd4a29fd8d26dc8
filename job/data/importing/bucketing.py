"""Pass 2 of an import: spilled dense ids -> (partition, offset), edges grouped into per-bucket spill files.

Partitions can only be assigned once pass 1 has seen every entity (and its count, for
``--entity-min-count``), so pass 1 spills integer edges and this pass re-reads them a bounded
chunk at a time, remaps them and appends each edge to its bucket's files; the bucket files are
then written from those (``writing``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from job.config import ConfigSchema
from job.data.importing.options import ID_DTYPE
from job.data.importing.plan import Plan

PASS2_CHUNK = 1 << 20  # edges remapped and bucketed at a time in pass 2
SPILLED = ("rel", "lhs", "rhs")


@dataclass
class Remap:
    """The partition assignment as flat arrays: dense id of type t is row ``base[t] + id``."""

    base: np.ndarray
    part: np.ndarray  # partition of each row, -1 when the entity was dropped
    offset: np.ndarray
    unpartitioned: np.ndarray  # per type: one partition only (its edges are spread over the buckets)
    rel_map: np.ndarray | None  # dynamic relations: old id -> kept id (-1: dropped)

    @classmethod
    def build(
        cls, config: ConfigSchema, plan: Plan, parts_of: list[np.ndarray], offsets_of: list[np.ndarray],
        rel_map: np.ndarray | None,
    ) -> Remap:
        num_types = len(plan.type_names)
        sizes = np.array([len(p) for p in parts_of], dtype=np.int64)
        base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        part = np.concatenate(parts_of) if num_types else np.zeros(0, np.int64)
        offset = np.concatenate(offsets_of) if num_types else np.zeros(0, np.int64)
        unpartitioned = np.array([config.entities[n].num_partitions == 1 for n in plan.type_names])
        return cls(base, part, offset, unpartitioned, rel_map)


@dataclass
class BucketedChunk:
    """Remapped edges of one chunk, with the bucket of each."""

    rel: np.ndarray
    lhs: np.ndarray
    rhs: np.ndarray
    bucket: np.ndarray
    filtered: int  # edges dropped (an entity or relation type below its min count)


def _remap_chunk(
    plan: Plan, remap: Remap, rel: np.ndarray, lhs: np.ndarray, rhs: np.ndarray, rng: np.random.Generator
) -> BucketedChunk:
    if plan.dynamic:
        lhs_types = np.full(len(rel), plan.lhs_type[0])
        rhs_types = np.full(len(rel), plan.rhs_type[0])
    else:
        lhs_types = plan.lhs_type[rel]
        rhs_types = plan.rhs_type[rel]
    lhs_flat = remap.base[lhs_types] + lhs
    rhs_flat = remap.base[rhs_types] + rhs
    lhs_part, rhs_part = remap.part[lhs_flat], remap.part[rhs_flat]
    lhs_off, rhs_off = remap.offset[lhs_flat], remap.offset[rhs_flat]
    keep = (lhs_part >= 0) & (rhs_part >= 0)
    if remap.rel_map is not None:
        rel = remap.rel_map[rel]
        keep &= rel >= 0
    # Unpartitioned types may sit in any bucket of their side: spread their edges uniformly, as PBG expects.
    if plan.parts_lhs > 1 and remap.unpartitioned.any():
        spread = remap.unpartitioned[lhs_types]
        lhs_part[spread] = rng.integers(0, plan.parts_lhs, int(spread.sum()))
    if plan.parts_rhs > 1 and remap.unpartitioned.any():
        spread = remap.unpartitioned[rhs_types]
        rhs_part[spread] = rng.integers(0, plan.parts_rhs, int(spread.sum()))
    filtered = 0
    if not keep.all():
        filtered = int(len(keep) - np.count_nonzero(keep))
        rel, lhs_off, rhs_off, lhs_part, rhs_part = (a[keep] for a in (rel, lhs_off, rhs_off, lhs_part, rhs_part))
    return BucketedChunk(rel, lhs_off, rhs_off, lhs_part * plan.parts_rhs + rhs_part, filtered)


# Edges (one shard's, or one bucket file's) whose per-bucket pieces are kept in memory (int32 triples: 24 MiB) rather
# than in local files: creating and deleting a file costs ~0.2 ms on ext4 here, hundreds a shard or bucket (#46).
PIECES_IN_MEMORY = 1 << 21


def _by_bucket(num_buckets: int, chunk: BucketedChunk) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...]]:
    """The chunk's edges ordered by bucket (stable: input order within a bucket), the count and start of each."""
    rel, lhs_off, rhs_off = chunk.rel, chunk.lhs, chunk.rhs
    if num_buckets > 1:
        bucket = chunk.bucket
        order = np.argsort(bucket.astype(np.uint16) if num_buckets <= 1 << 16 else bucket, kind="stable")
        rel, lhs_off, rhs_off = rel[order], lhs_off[order], rhs_off[order]
        counts = np.bincount(bucket, minlength=num_buckets)
    else:
        counts = np.array([len(rel)], dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return counts, bounds, (rel, lhs_off, rhs_off)


def append_to_buckets(bucket_dir: str, num_buckets: int, chunk: BucketedChunk) -> np.ndarray:
    """Append each edge of ``chunk`` to its bucket's three spill files; the edge count per bucket."""
    counts, bounds, columns = _by_bucket(num_buckets, chunk)
    for b in np.flatnonzero(counts):
        lo, hi = bounds[b], bounds[b + 1]
        for name, values in zip(SPILLED, columns):
            with open(os.path.join(bucket_dir, f"{b}.{name}"), "ab") as fh:
                fh.write(values[lo:hi].astype(ID_DTYPE).tobytes())
    return counts


def keep_by_bucket(pieces: dict[tuple[int, str], list[bytes]], num_buckets: int, chunk: BucketedChunk) -> np.ndarray:
    """``append_to_buckets`` into memory: ``pieces[bucket, name]`` gets what that bucket's file would."""
    counts, bounds, columns = _by_bucket(num_buckets, chunk)
    for b in np.flatnonzero(counts).tolist():
        lo, hi = bounds[b], bounds[b + 1]
        for name, values in zip(SPILLED, columns):
            pieces.setdefault((b, name), []).append(values[lo:hi].astype(ID_DTYPE).tobytes())
    return counts


def read_spilled(source_dir: str, name: str, begin: int, end: int) -> np.ndarray:
    # np.fromfile rather than a memory map: the pages read do not linger in this process's RSS.
    path = os.path.join(source_dir, name)
    item = np.dtype(ID_DTYPE).itemsize
    return np.fromfile(path, dtype=ID_DTYPE, count=end - begin, offset=begin * item).astype(np.int64)


def bucket_spilled_file(
    plan: Plan, remap: Remap, source_dir: str, bucket_dir: str, total: int, rng: np.random.Generator
) -> tuple[np.ndarray, int]:
    """Remap the ``total`` spilled edges of ``source_dir`` into per-bucket files in ``bucket_dir``.

    Returns the edge count of each bucket and the number of edges dropped by the min counts.
    """
    num_buckets = plan.parts_lhs * plan.parts_rhs
    os.makedirs(bucket_dir, exist_ok=True)
    bucket_counts = np.zeros(num_buckets, dtype=np.int64)
    filtered = 0
    for begin in range(0, total, PASS2_CHUNK):
        end = min(total, begin + PASS2_CHUNK)
        rel, lhs, rhs = (read_spilled(source_dir, name, begin, end) for name in SPILLED)
        chunk = _remap_chunk(plan, remap, rel, lhs, rhs, rng)
        filtered += chunk.filtered
        bucket_counts += append_to_buckets(bucket_dir, num_buckets, chunk)
    return bucket_counts, filtered
