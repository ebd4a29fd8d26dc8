"""Reading new edges into an existing id space: the importer, with the trained entities preloaded.

``biggraph import`` gives each distinct name a dense id per type, then a (partition, offset). A grow
runs the same two passes (``job.data.importing.importer.Importer``: the same parsing, hashing, spilling, bad-row
rules and options) with three differences, each an override here:

- each type's table starts holding the trained entities' names, in partition-then-offset order, so
  a known name maps to its trained dense id and a new one to an id after them (``EntityTable.preload``);
  the same for dynamic relation names;
- partitions: a known entity keeps its partition and offset; new ones are appended, balanced so that
  partitions end as even as possible, in a seeded shuffled order (``_assign``);
- with dynamic relations the trained relation types are kept whatever their count in the new edges.

The new edges come out of pass 2 as per-bucket spill files in the final id space; ``write_merged_edges``
appends them to the old bucket files' edges into staged files.
"""

from __future__ import annotations

import contextlib
import os
import time
import zlib
from typing import Any

import numpy as np

import storage_adapters as storage
from job.config import ConfigSchema
from job.data.importing.importer import Importer
from job.data.importing.options import ID_DTYPE, ImportOptions
from job.formats import edges as edge_format
from job.formats import entities as ent
from job.formats.checksums import EDGE_MANIFEST
from job.growing.model_state import GrowError

_COPY_CHUNK = 1 << 20  # edges copied at a time from an old bucket file


def read_trained_names(config: ConfigSchema) -> tuple[dict[str, list[int]], dict[str, Any], list[str] | None]:
    """Per type: the partition counts and all names (partition-major) of the trained entities; the dynamic
    relation names. Names are required: a grow tells known entities from new ones by name."""
    import pyarrow as pa  # ~0.3 s: kept off the start-up (see job.data.importing.hashing)

    counts: dict[str, list[int]] = {}
    names: dict[str, Any] = {}
    for entity_type, entity in config.entities.items():
        counts[entity_type] = ent.read_entity_counts(config.entity_path, entity_type, entity.num_partitions)
        chunks = []
        for part, count in enumerate(counts[entity_type]):
            part_names = ent.read_entity_names(config.entity_path, entity_type, part)
            if len(part_names) != count:
                raise GrowError(f"{ent.names_file(config.entity_path, entity_type, part)}: holds {len(part_names)} names "
                                f"but entity_count_{entity_type}_{part}.txt says {count}")
            chunks.append(pa.array(part_names, type=pa.large_string()))
        names[entity_type] = pa.concat_arrays(chunks) if chunks else pa.array([], type=pa.large_string())
    relations = None
    if config.dynamic_relations:
        relations = ent.read_dynamic_rel_names(config.entity_path)
        count = ent.read_dynamic_rel_count(config.entity_path)
        if len(relations) != count:
            raise GrowError(f"{ent.dynamic_rel_names_file(config.entity_path)}: holds {len(relations)} names but "
                            f"dynamic_rel_count.txt says {count}")
    return counts, names, relations


def balanced_additions(old: np.ndarray, new: int) -> np.ndarray:
    """How many of ``new`` entities each partition gets so that the largest partition ends as small as possible.

    Water-filling: raise the smallest partitions to a common level L (the highest that ``new`` can pay
    for), then give the few left over to the lowest-numbered partitions at that level. Deterministic.
    """
    old = np.asarray(old, dtype=np.int64)
    if new == 0 or len(old) == 0:
        return np.zeros(len(old), dtype=np.int64)
    low, high = int(old.min()), int(old.max()) + new
    while low < high:  # the largest level L with sum(max(0, L - old)) <= new
        mid = (low + high + 1) // 2
        if int(np.maximum(0, mid - old).sum()) <= new:
            low = mid
        else:
            high = mid - 1
    added = np.maximum(0, low - old)
    left = new - int(added.sum())
    at_level = np.flatnonzero(old + added == low)
    added[at_level[:left]] += 1
    return added


class GrowImporter(Importer):
    """The importer over an id space that already holds the trained entities (see the module docstring)."""

    def __init__(self, config: ConfigSchema, files: list[str], options: ImportOptions, workdir: str,
                 old_counts: dict[str, list[int]], old_names: dict[str, Any], old_relations: list[str] | None) -> None:
        super().__init__(config, files, options, workdir)
        self.old_counts = old_counts
        self.old_sizes = [int(sum(old_counts[name])) for name in self.plan.type_names]
        self.old_hashes = []
        for name, table in zip(self.plan.type_names, self.tables):
            repeated = table.preload(old_names[name])
            if len(repeated):
                raise GrowError(f"{config.entity_path}: entity name '{old_names[name][int(repeated[0])].as_py()}' appears "
                                f"twice among the '{name}' entities; names must be unique per type to grow by name")
            self.old_hashes.append(table.sorted_hashes.copy())
        self.old_num_relations = len(old_relations) if old_relations is not None else len(config.relations)
        if old_relations is not None:
            self.dynamic_names = {name: i for i, name in enumerate(old_relations)}
            self.dynamic_counts = np.zeros(len(old_relations), dtype=np.int64)
        self.added: dict[str, np.ndarray] = {}

    def _unknown_relation(self, name: str) -> str:
        return (f"has relation type '{name}', which is not in the config, so the entity types of its ends are unknown "
                "(declare a new relation type in the config's relations, with its lhs and rhs entity types)")

    def check_names(self) -> None:
        """Refuse a new entity whose name the model knows as another type: names are per type, so it would
        become a second, unrelated entity, which is almost always an edge of the wrong relation type."""
        if len(self.tables) < 2:
            return
        for index, (name, table) in enumerate(zip(self.plan.type_names, self.tables)):
            new_ids = np.arange(self.old_sizes[index], table.size, dtype=np.int64)
            if not len(new_ids):
                continue
            hashes = table.hashes_of(new_ids)
            for other_index, other in enumerate(self.plan.type_names):
                if other_index == index:
                    continue
                hit = np.flatnonzero(np.isin(hashes, self.old_hashes[other_index]))
                if len(hit):
                    entity = table.names().take([int(new_ids[hit[0]])])[0].as_py()
                    raise GrowError(
                        f"new edges put '{entity}' on a side of entity type '{name}', but the model knows '{entity}' as "
                        f"a '{other}' entity: it would become a second, unrelated entity (names are per type); check "
                        "the relation type of its edges, or rename it")

    def _assign(self) -> tuple[list[np.ndarray], list[np.ndarray], list[list[np.ndarray]]]:
        parts_of, offsets_of, members = [], [], []
        for type_index, (name, table) in enumerate(zip(self.plan.type_names, self.tables)):
            old = np.array(self.old_counts[name], dtype=np.int64)
            starts = np.concatenate([[0], np.cumsum(old)]).astype(np.int64)
            old_total = int(starts[-1])
            part = np.full(table.size, -1, dtype=np.int64)
            offset = np.full(table.size, -1, dtype=np.int64)
            part[:old_total] = np.repeat(np.arange(len(old)), old)
            offset[:old_total] = np.arange(old_total) - starts[part[:old_total]]
            new_ids = np.arange(old_total, table.size, dtype=np.int64)
            kept = new_ids[table.counts[new_ids] >= self.options.entity_min_count]
            seed = np.random.SeedSequence([self.options.seed & 0xFFFFFFFF, zlib.crc32(name.encode()), type_index, old_total])
            shuffled = np.random.default_rng(seed).permutation(kept)
            added = balanced_additions(old, len(shuffled))
            bounds = np.concatenate([[0], np.cumsum(added)]).astype(np.int64)
            type_members = []
            for p in range(len(old)):
                ids = shuffled[bounds[p] : bounds[p + 1]]
                part[ids] = p
                offset[ids] = old[p] + np.arange(len(ids))
                type_members.append(np.concatenate([np.arange(starts[p], starts[p + 1]), ids]))
            parts_of.append(part)
            offsets_of.append(offset)
            members.append(type_members)
            self.added[name] = added
            self.summary.entities[name] = old_total + len(shuffled)
        return parts_of, offsets_of, members

    def _relation_map(self) -> tuple[np.ndarray, list[str]]:
        names = list(self.dynamic_names)
        counts = np.zeros(len(names), dtype=np.int64)
        counts[: min(len(names), len(self.dynamic_counts))] = self.dynamic_counts[: len(names)]
        old = self.old_num_relations
        kept = list(range(old)) + [i for i in range(old, len(names)) if counts[i] >= self.options.relation_type_min_count]
        mapping = np.full(max(len(names), 1), -1, dtype=np.int64)
        mapping[kept] = np.arange(len(kept))
        return mapping, [names[i] for i in kept]

    def ingest(self) -> tuple[list[list[np.ndarray]], list[str] | None, list[tuple[str, np.ndarray]]]:
        """Both passes: (members per type and partition, dynamic relation names, per file its bucket spill
        directory and edge counts). Every check that can refuse the grow runs here, before any output."""
        self._pass1(time.monotonic())
        self.check_names()
        parts_of, offsets_of, members = self._assign()
        rel_map, relation_names = (self._relation_map() if self.plan.dynamic else (None, None))
        self.summary.relations = len(relation_names) if relation_names is not None else len(self.config.relations)
        buckets = [self._pass2_file(i, parts_of, offsets_of, rel_map) for i in range(len(self.files))]
        return members, relation_names, buckets

    def write_entities(self, members: list[list[np.ndarray]], relation_names: list[str] | None, entity_dir: str) -> list[str]:
        """Counts and names of every partition (trained names first, new ones after) into ``entity_dir``."""
        written: list[str] = []
        self._write_entities(members, relation_names, written, entity_path=entity_dir)
        return written


def read_spilled_bucket(bucket_dir: str, bucket: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The new edges of one bucket (rel, lhs offset, rhs offset), as pass 2 spilled them."""
    out = []
    for name in ("rel", "lhs", "rhs"):
        path = os.path.join(bucket_dir, f"{bucket}.{name}")
        out.append(np.fromfile(path, dtype=ID_DTYPE).astype(np.int64) if os.path.exists(path) else np.zeros(0, np.int64))
    return out[0], out[1], out[2]


def write_merged_edges(edge_path: str, target_dir: str, grid: tuple[int, int], bucket_dir: str,
                       workdir: str) -> tuple[list[int], list[str]]:
    """Each bucket file of ``edge_path`` with the new edges appended, written into ``target_dir`` with its
    checksum manifest. Returns the old edge count per bucket (where the new edges start) and the URLs written.

    Old edges are copied a chunk at a time into a local file and the result is memory-mapped, so memory
    stays bounded by the chunk whatever the bucket's size (the importer writes the same way).
    """
    boundaries: list[int] = []
    written: list[str] = []
    entries: dict[str, tuple[int, str]] = {}
    merged = os.path.join(workdir, "merged")
    for lhs in range(grid[0]):
        for rhs in range(grid[1]):
            bucket = lhs * grid[1] + rhs
            new_rel, new_lhs, new_rhs = read_spilled_bucket(bucket_dir, bucket)
            url = edge_format.edges_file(edge_path, lhs, rhs)
            num_old = 0
            with contextlib.ExitStack() as stack:
                outs = {n: stack.enter_context(open(f"{merged}.{n}", "wb")) for n in edge_format.EDGE_DATASETS}
                if storage.exists(url):
                    with edge_format.open_h5(url) as handle:
                        num_old = edge_format.check_edge_file(handle, url)
                        for begin in range(0, num_old, _COPY_CHUNK):
                            arrays = edge_format.read_edges_from_handle(handle, url, begin, begin + _COPY_CHUNK)
                            for n in edge_format.EDGE_DATASETS:
                                outs[n].write(getattr(arrays, n).tobytes())
                for n, values in (("rel", new_rel), ("lhs", new_lhs), ("rhs", new_rhs)):
                    outs[n].write(values.astype(np.int64).tobytes())
            total = num_old + len(new_rel)
            columns = [np.memmap(f"{merged}.{n}", dtype=np.int64, mode="r") if total else np.zeros(0, np.int64)
                       for n in edge_format.EDGE_DATASETS]
            target = edge_format.edges_file(target_dir, lhs, rhs)
            written.append(target)
            # columns: rel, lhs, rhs (EDGE_DATASETS order)
            entries[target.rsplit("/", 1)[-1]] = edge_format.write_edges(target, columns[0], columns[1], columns[2])
            del columns
            boundaries.append(num_old)
    written.append(storage.join(target_dir, EDGE_MANIFEST))
    edge_format.write_edge_manifest(target_dir, entries)
    for n in edge_format.EDGE_DATASETS:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{merged}.{n}")
    return boundaries, written
