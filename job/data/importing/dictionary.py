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
from job.data.importing.mapper import NAMES_SCHEMA_FIELDS, group_files
from job.data.importing.plan import Plan
from job.data.importing.staging import Staging
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


def build_dictionary(
    config: ConfigSchema, plan: Plan, unit: tuple[int, int], group_records: list[dict[str, Any]], *,
    entity_min_count: int, staging: Staging,
) -> None:
    """Phase 2 for (type, partition) ``unit``: its names file into entity_path, its maps into staging, its marker."""
    import pyarrow as pa  # ~0.3 s: kept off the start-up (see job.data.importing.hashing)
    import pyarrow.compute as pc

    type_index, part = unit
    type_name = plan.type_names[type_index]
    schema = pa.schema([(name, getattr(pa, kind)()) for name, kind in NAMES_SCHEMA_FIELDS])
    index = batch_index(config, plan, type_index, part)
    batches = []
    for group, record in enumerate(group_records):
        if record["parts"][type_index][part]:
            batches.append(read_batch(group_files(staging, group)[0], index))
    table = pa.Table.from_batches(batches, schema=schema)
    grouped = table.group_by("hash").aggregate([("count", "sum"), ("name", "min")])
    hashes = grouped.column("hash").to_numpy()
    kept = np.flatnonzero(grouped.column("count_sum").to_numpy() >= entity_min_count)
    kept_names = grouped.column("name_min").take(pa.array(kept)).combine_chunks()
    by_name = pc.sort_indices(kept_names).to_numpy()
    offset = np.full(len(hashes), -1, dtype=np.int64)
    offset[kept[by_name]] = np.arange(len(kept), dtype=np.int64)
    by_hash = np.argsort(hashes)
    sorted_hashes, sorted_offset = hashes[by_hash], offset[by_hash].astype(MAP_DTYPE)
    maps = [sorted_offset[np.searchsorted(sorted_hashes, batch.column(0).to_numpy())] for batch in batches]
    with storage.local_file_for_writing(map_file(staging, type_index, part)) as tmp, open(tmp, "wb") as out:
        for values in maps:
            out.write(values.tobytes())
    names = kept_names.take(pa.array(by_name)).to_pylist() if len(kept) else []
    storage.makedirs(config.entity_path)
    # the same JSON list as write_entity_names, through json's C encoder (no indent): 10x faster
    storage.write_text(ent.names_file(config.entity_path, type_name, part), json.dumps(names))
    staging.commit(dict_unit(type_index, part), {"count": len(kept), "distinct": len(hashes)})
    logger.info("import: dictionary of %s partition %d: %s entities", type_name, part, f"{len(kept):,}")
