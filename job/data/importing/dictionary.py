"""Phase 2 of a sharded import: one partition's dictionary, from the names its shards saw.

The partition's entities are the distinct ids over all shards (by hash, counts summed), less
those under ``--entity-min-count``, in sorted order of their UTF-8 bytes: a set and an order that
no number of pods, shard size or shard order can change. The names file is written straight to
``entity_path``; the count file, which marks the partition as present, waits for the end of the
import (``assemble.finish``). For phase 3 it leaves ``maps.bin``: for every group of shards, in order,
the final offset (or -1, dropped) of each entry of that group's list for this partition, so a
bucket's edges are turned into final offsets by one gather each.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

import storage_adapters as storage
from job.config import ConfigSchema
from job.data.importing import kernels
from job.data.importing.mapper import group_files
from job.data.importing.plan import Plan
from job.data.importing.staging import Staging
from job.errors import UserError
from job.formats import entities as ent

logger = logging.getLogger("biggraph")

MAP_DTYPE = np.int32


def dict_unit(type_index: int, part: int) -> str:
    return f"dict-{type_index:03d}-{part:06d}"


def map_file(staging: Staging, type_index: int, part: int) -> str:
    return staging.url("dicts", f"{type_index:03d}-{part:06d}", "maps.bin")


def dict_units(config: ConfigSchema, plan: Plan) -> list[tuple[int, int]]:
    """Every (entity type index, partition), in a fixed order."""
    return [(t, p) for t, name in enumerate(plan.type_names) for p in range(config.entities[name].num_partitions)]


def batch_index(config: ConfigSchema, plan: Plan, type_index: int, part: int) -> int:
    """The record batch of (type, partition) in a group's names.arrow."""
    before = sum(config.entities[name].num_partitions for name in plan.type_names[:type_index])
    return before + part


def read_batch(url: str, index: int) -> Any:
    """Record batch ``index`` of an Arrow IPC file (a ranged read where the storage allows it)."""
    import pyarrow as pa  # ~0.3 s: kept off the start-up (see job.data.importing.hashing)

    if storage.is_local(url):
        with pa.memory_map(storage.local_path(url)) as source:
            return pa.ipc.open_file(source).get_batch(index)
    with storage.open_file(url, "rb") as handle:
        return pa.ipc.open_file(handle).get_batch(index)


class HashCollision(UserError):
    """Two distinct ids of one entity type share a 64-bit hash (about n^2 / 2^65 likely with n ids)."""


def _merged(batches: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The groups' entries in hash order: (order, first, counts). ``order`` lists the entries (groups' lists
    concatenated) by hash, a hash's entries in group order; ``first`` marks each hash's first entry there;
    ``counts`` sums each distinct hash's counts. Each list is sorted already, so the stable sort (timsort) only
    merges runs: linear in the entries, with no hash table and no string touched (issue #46)."""
    hashes = np.concatenate([batch.column(0).to_numpy() for batch in batches]) if batches else np.zeros(0, np.uint64)
    counts = np.concatenate([batch.column(1).to_numpy() for batch in batches]) if batches else np.zeros(0, np.int64)
    order = np.argsort(hashes, kind="stable")
    ordered = hashes[order]
    first = np.ones(len(ordered), dtype=bool)
    if len(ordered) > 1:
        np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    return order, first, np.add.reduceat(counts[order], starts) if len(starts) else np.zeros(0, np.int64)


def _lengths(names: Any) -> np.ndarray:
    """Byte length of each string of a large_string array (from its offsets: no copy of the bytes)."""
    offsets = np.frombuffer(names.buffers()[1], dtype=np.int64)[names.offset : names.offset + len(names) + 1]
    return np.diff(offsets)


def _check_duplicates(type_name: str, batches: list[Any], where: tuple[np.ndarray, np.ndarray],
                      pairs: tuple[np.ndarray, np.ndarray]) -> None:
    """Refuse two distinct names that share a hash: ``pairs`` are (entry, the first entry of its hash), as
    positions in the concatenated lists that ``where`` = (group, row) locates. Ids of at most 7 bytes are hashed
    exactly (``hashing``), so equal lengths of at most 7 bytes prove equal names; only longer ids, or lengths that
    differ, have their bytes compared. A uniform graph's groups repeat most ids, so this is what keeps phase 2 from
    copying every repeated name (issue #46)."""
    import pyarrow as pa  # ~0.3 s: kept off the start-up (see job.data.importing.hashing)

    if not len(pairs[0]):
        return
    group, row = where
    lengths = np.concatenate([_lengths(batch.column(2)) for batch in batches])
    suspect = (lengths[pairs[0]] != lengths[pairs[1]]) | (lengths[pairs[0]] > 7)
    if not suspect.any():
        return
    dup, first = pairs[0][suspect], pairs[1][suspect]

    def names_at(positions: np.ndarray) -> Any:
        pieces, slots = [], []
        for g in kernels.distinct(group[positions]).tolist():
            mine = np.flatnonzero(group[positions] == g)
            pieces.append(kernels.take(batches[g].column(2), row[positions[mine]]))
            slots.append(mine)
        back = np.empty(len(positions), dtype=np.int64)
        back[np.concatenate(slots)] = np.arange(len(positions), dtype=np.int64)
        return kernels.take(pa.concat_arrays(pieces), back)

    a, b = names_at(dup), names_at(first)
    differ = np.flatnonzero(~kernels.equal(a, b).to_numpy(zero_copy_only=False))
    if len(differ):
        i = int(differ[0])
        raise HashCollision(
            f"import: the {type_name} ids {a[i].as_py()!r} and {b[i].as_py()!r} share the same 64-bit hash, so the "
            "importer cannot tell them apart; rename one of them in the input"
        )


def build_dictionary(
    config: ConfigSchema, plan: Plan, unit: tuple[int, int], group_records: list[dict[str, Any]], *,
    entity_min_count: int, staging: Staging,
) -> None:
    """Phase 2 for (type, partition) ``unit``: its names file into entity_path, its maps into staging, its marker.

    Each distinct id's name is copied once, from the first group that holds it: the groups' sorted hash lists are
    merged with numpy, not grouped by a hash table over every group's names (a uniform graph's 4 pods hold ~all
    ids each: 4x the entries of one process; issue #46). A hash two groups hold under different names is refused
    (``HashCollision``) rather than merged."""
    import pyarrow as pa  # ~0.3 s: kept off the start-up (see job.data.importing.hashing)

    type_index, part = unit
    type_name = plan.type_names[type_index]
    index = batch_index(config, plan, type_index, part)
    batches = []
    for group, record in enumerate(group_records):
        if record["parts"][type_index][part]:
            batches.append(read_batch(group_files(staging, group)[0], index))
    sizes = np.array([batch.num_rows for batch in batches], dtype=np.int64)
    group_of = np.repeat(np.arange(len(batches), dtype=np.int64), sizes)
    row_of = np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    order, first, counts = _merged(batches)
    distinct = np.cumsum(first) - 1  # the distinct hash of each entry of `order`
    _check_duplicates(type_name, batches, (group_of, row_of), (order[~first], order[first][distinct[~first]]))
    kept = np.flatnonzero(counts >= entity_min_count)
    firsts = order[first][kept]  # one entry per kept id: its name is taken from there alone
    pieces, kept_slots = [], []
    for g in kernels.distinct(group_of[firsts]).tolist():
        mine = np.flatnonzero(group_of[firsts] == g)
        pieces.append(kernels.take(batches[g].column(2), row_of[firsts[mine]]))
        kept_slots.append(mine)
    kept_names = pa.concat_arrays(pieces) if pieces else pa.array([], pa.large_string())
    slot_of = np.concatenate(kept_slots) if kept_slots else np.zeros(0, np.int64)  # kept index of each name
    by_name = kernels.sort_indices(kept_names).to_numpy()
    offset_of_kept = np.empty(len(kept), dtype=np.int64)
    offset_of_kept[slot_of[by_name]] = np.arange(len(kept), dtype=np.int64)
    offset = np.full(len(counts), -1, dtype=MAP_DTYPE)
    offset[kept] = offset_of_kept
    entry_offset = np.empty(len(order), dtype=MAP_DTYPE)
    entry_offset[order] = offset[distinct]  # in the groups' own order: each group's slice is its map
    with storage.local_file_for_writing(map_file(staging, type_index, part)) as tmp, open(tmp, "wb") as out:
        out.write(entry_offset.tobytes())
    names = kernels.take(kept_names, by_name).to_pylist() if len(kept) else []
    storage.makedirs(config.entity_path)
    # the same JSON list as write_entity_names, through json's C encoder (no indent): 10x faster
    storage.write_text(ent.names_file(config.entity_path, type_name, part), json.dumps(names))
    staging.commit(dict_unit(type_index, part), {"count": len(kept), "distinct": len(counts)})
    logger.info("import: dictionary of %s partition %d: %s entities", type_name, part, f"{len(kept):,}")
