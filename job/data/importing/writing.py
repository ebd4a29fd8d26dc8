"""The output of an import: bucket edge files (with their checksum manifest) and the entity counts and names.

Every URL is appended to ``written`` before it is written, so that a failure part-way lets the
caller remove exactly what this run wrote. ``job.formats`` (h5py) is imported when writing: the
command line imports this package to build its parser, and h5py costs 0.2 s.
"""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np

import storage_adapters as storage
from job.data.importing import kernels
from job.data.importing.bucketing import SPILLED
from job.data.importing.options import ID_DTYPE
from job.data.importing.plan import Plan
from job.data.importing.table import EntityTable
from job.formats import entities as ent
from job.formats.checksums import EDGE_MANIFEST
from job.formats.edges import edges_file, write_edge_manifest, write_edges


def write_buckets(edge_path: str, plan: Plan, bucket_dir: str, bucket_counts: np.ndarray, written: list[str]) -> int:
    """Every ``edges_{l}_{r}.h5`` of ``edge_path`` from pass 2's spill files, then the manifest; the edges written."""

    storage.makedirs(edge_path)
    entries: dict[str, tuple[int, str]] = {}
    edges_written = 0
    for lhs_part in range(plan.parts_lhs):
        for rhs_part in range(plan.parts_rhs):
            b = lhs_part * plan.parts_rhs + rhs_part
            arrays = []
            for name in SPILLED:
                path = os.path.join(bucket_dir, f"{b}.{name}")
                # A memory map lets write_edges stream the (possibly huge) bucket without copying it into memory.
                arrays.append(np.memmap(path, dtype=ID_DTYPE, mode="r") if bucket_counts[b] else np.zeros(0, ID_DTYPE))
            url = edges_file(edge_path, lhs_part, rhs_part)
            written.append(url)
            entries[url.rsplit("/", 1)[-1]] = write_edges(url, arrays[0], arrays[1], arrays[2])
            del arrays
            for name in SPILLED:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(bucket_dir, f"{b}.{name}"))
            edges_written += int(bucket_counts[b])
    # after every file it lists, so a manifest never names a file that is not there yet
    written.append(storage.join(edge_path, EDGE_MANIFEST))
    write_edge_manifest(edge_path, entries)
    return edges_written


def write_entities(
    entity_path: str, plan: Plan, tables: list[EntityTable], members: list[list[np.ndarray]],
    relation_names: list[str] | None, written: list[str],
) -> None:
    """Names first and counts last: a count file is what marks a partition as present."""

    storage.makedirs(entity_path)
    for name, table, parts in zip(plan.type_names, tables, members):
        all_names = table.names() if table.size else None
        for part, ids in enumerate(parts):
            names = kernels.take(all_names, ids).to_pylist() if all_names is not None and len(ids) else []
            url = ent.names_file(entity_path, name, part)
            written.append(url)
            # The same JSON list write_entity_names produces, but through json's C encoder (no indent): 10x faster.
            storage.write_text(url, json.dumps(names))
    if relation_names is not None:
        written.append(ent.dynamic_rel_names_file(entity_path))
        ent.write_dynamic_rel_names(entity_path, relation_names)
    for name, parts in zip(plan.type_names, members):
        for part, ids in enumerate(parts):
            written.append(ent.count_file(entity_path, name, part))
            ent.write_entity_count(entity_path, name, part, len(ids))
    if relation_names is not None:
        written.append(ent.dynamic_rel_count_file(entity_path))
        ent.write_dynamic_rel_count(entity_path, len(relation_names))
