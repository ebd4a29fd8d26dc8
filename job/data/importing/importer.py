"""The two passes of an import, as one class that ``biggraph grow`` subclasses (``job.growing.ingest``).

Pass 1 parses the files (``readers``), gives every distinct entity id a dense integer per type
(``table``) and spills the integer edge columns to a work directory. Partitions are assigned once
every entity and its count are known (``_assign``); pass 2 (``bucketing``) maps the spilled
integers to (partition, offset) and groups edges by bucket; ``run`` then writes the output
(``writing``), removing what it wrote if that fails. Memory is proportional to the number of
distinct entities, not of edges.

The underscore methods are the hooks a grow overrides (``_assign``, ``_relation_map``,
``_unknown_relation``) or calls (``_pass1``, ``_pass2_file``, ``_write_entities``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import zlib
from collections.abc import Callable, Mapping
from typing import IO, Any

import numpy as np

import storage_adapters as storage
from job.config import ConfigSchema
from job.data.importing import kernels
from job.data.importing.bucketing import SPILLED, Remap, bucket_spilled_file
from job.data.importing.hashing import hash_strings
from job.data.importing.options import ID_DTYPE, ImportOptions, ImportSummary
from job.data.importing.plan import make_plan
from job.data.importing.readers import Batch, Source
from job.data.importing.table import EntityTable, encode_edges
from job.data.importing.writing import write_buckets, write_entities
from job.errors import InputFormatError
from job.monitoring import task_progress

logger = logging.getLogger("biggraph")


class Importer:
    """One import of ``files`` (the i-th into ``config.edge_paths[i]``), working in the local ``workdir``."""

    def __init__(self, config: ConfigSchema, files: list[str], options: ImportOptions, workdir: str) -> None:
        self.config = config
        self.files = files
        self.options = options
        self.workdir = workdir
        self.plan = make_plan(config)
        self.tables = [EntityTable() for _ in self.plan.type_names]
        self.dynamic_names: dict[str, int] = {}
        self.dynamic_counts = np.zeros(0, dtype=np.int64)
        self.summary = ImportSummary()
        self.spilled: list[int] = []  # edges spilled per input file
        self._bar: Any = None  # the progress bar of the file being read
        self._rows_before = 0  # rows of that file before the current batch

    # Pass 1 -------------------------------------------------------------------------------

    def _relation_ids(self, batch: Batch) -> np.ndarray:
        """Relation id of each row: -1 for a name not in the config, -2 for an empty name."""
        n = len(batch.lhs)
        if batch.rel is None:
            return np.zeros(n, dtype=np.int64)
        rel = kernels.fill_null(batch.rel, "") if batch.rel.null_count else batch.rel
        encoded = kernels.dictionary_encode(rel)
        names = encoded.dictionary.to_pylist()
        if self.plan.dynamic:
            mapping = np.array([self.dynamic_names.setdefault(name, len(self.dynamic_names)) if name else -2 for name in names])
        else:
            mapping = np.array([self.plan.relation_ids.get(name, -1) if name else -2 for name in names])
        if not len(names):
            return np.zeros(n, dtype=np.int64)
        return mapping[encoded.indices.to_numpy(zero_copy_only=False)].astype(np.int64, copy=False)

    def _count_dynamic(self, rel: np.ndarray) -> None:
        counts = np.bincount(rel, minlength=len(self.dynamic_names))
        if len(counts) > len(self.dynamic_counts):
            counts[: len(self.dynamic_counts)] += self.dynamic_counts
            self.dynamic_counts = counts
        else:
            self.dynamic_counts[: len(counts)] += counts

    def _unknown_relation(self, name: str) -> str:
        """The problem reported for an edge whose relation type the config lacks."""
        return f"has relation type '{name}', which is not in the config"

    def _bad_row_rule(self) -> Callable[[list[str]], str | None]:
        options = self.options
        known = self.plan.relation_ids

        def is_bad(fields: list[str]) -> str | None:
            for flag, col in (("lhs", options.lhs_col), ("rhs", options.rhs_col), ("relation", options.rel_col)):
                if col is not None and col < len(fields) and fields[col] == "":
                    return f"has an empty {flag} id in column {col}"
            if options.rel_col is not None and not self.plan.dynamic and fields[options.rel_col] not in known:
                return self._unknown_relation(fields[options.rel_col])
            return None

        return is_bad

    def _fail(self, source: Source, generic: str, expected: str) -> None:
        where = source.locate(self._bad_row_rule())
        if where is None:
            raise InputFormatError(source.url, generic, expected=expected + "; or pass --skip-bad-rows")
        line, problem = where
        raise InputFormatError(source.url, problem, row=line, expected=expected + "; or pass --skip-bad-rows")

    def _refuse_bad_row(self, source: Source, batch: Batch, empty: bool, first: int) -> None:
        """Raise the error for the bad row ``first`` of ``batch`` (text files are rescanned for its line)."""
        row = self._rows_before + first + 1
        if source.format == "parquet":
            if empty:
                raise InputFormatError(
                    source.url, "has an empty or null id", row=row, expected="non-empty ids; or pass --skip-bad-rows"
                )
            name = batch.rel[first].as_py() if batch.rel is not None else ""
            raise InputFormatError(
                source.url,
                self._unknown_relation(name),
                row=row,
                expected=f"one of the config's relation names ({', '.join(self.plan.relation_ids)}); "
                "or pass --skip-bad-rows",
            )
        if empty:
            self._fail(source, "has an empty id", "non-empty ids")
        self._fail(
            source,
            "has a relation type not in the config",
            f"one of the config's relation names ({', '.join(self.plan.relation_ids)})",
        )

    def _drop_bad_rows(
        self, source: Source, batch: Batch, lengths: tuple[np.ndarray, np.ndarray], rel: np.ndarray
    ) -> np.ndarray | None:
        """The rows to keep (None: all), counting the dropped ones; refuses without --skip-bad-rows."""
        empty = (lengths[0] == 0) | (lengths[1] == 0) | (rel == -2)
        unknown = (rel == -1) & ~empty
        bad = empty | unknown
        if not bad.any():
            return None
        first = int(np.flatnonzero(bad)[0])
        if not self.options.skip_bad_rows:
            self._refuse_bad_row(source, batch, bool(empty[first]), first)
        self.summary.empty_id_rows += int(np.count_nonzero(empty))
        self.summary.unknown_relation_rows += int(np.count_nonzero(unknown))
        return np.flatnonzero(~bad)

    def _pass1_batch(self, file_index: int, source: Source, batch: Batch, spill: Mapping[str, IO[bytes]]) -> int:
        """Encode and spill one batch; the number of rows it held."""
        self.summary.malformed_rows += batch.malformed
        if batch.malformed and not self.options.skip_bad_rows:
            self._fail(
                source,
                f"has a row with a wrong number of fields: {source.first_malformed!r}",
                "the same number of fields on every row",
            )
        lhs = kernels.fill_null(batch.lhs, "") if batch.lhs.null_count else batch.lhs
        rhs = kernels.fill_null(batch.rhs, "") if batch.rhs.null_count else batch.rhs
        lhs_hash, lhs_len = hash_strings(lhs)
        rhs_hash, rhs_len = hash_strings(rhs)
        rel = self._relation_ids(batch)
        n = len(rel)
        self.summary.edges_read += n
        keep = self._drop_bad_rows(source, batch, (lhs_len, rhs_len), rel)
        if keep is not None:
            lhs_hash, rhs_hash, rel = lhs_hash[keep], rhs_hash[keep], rel[keep]
        self._rows_before += n
        if self.plan.dynamic:
            self._count_dynamic(rel)
        lhs_ids, rhs_ids = encode_edges(self.plan, self.tables, lhs, rhs, (lhs_hash, rhs_hash), rel, keep)
        spill["lhs"].write(lhs_ids.astype(ID_DTYPE).tobytes())
        spill["rhs"].write(rhs_ids.astype(ID_DTYPE).tobytes())
        spill["rel"].write(rel.astype(ID_DTYPE).tobytes())
        self.spilled[file_index] += len(rel)
        return n

    def _source(self, file_index: int, url: str) -> Source:
        """The reader of input ``file_index`` (a shard importer reads a byte range of it)."""
        return Source(url, self.options)

    def _pass1_file(self, file_index: int, url: str, spill: Mapping[str, IO[bytes]], started: float) -> None:
        source = self._source(file_index, url)
        self._rows_before = 0
        next_report = self.summary.edges_read + self.options.progress_every
        for batch in source.batches():
            self._bar.update(self._pass1_batch(file_index, source, batch, spill))
            if self.summary.edges_read >= next_report:
                elapsed = time.monotonic() - started
                logger.info(
                    "import: read %s edges (%s/s), %s distinct entities so far",
                    f"{self.summary.edges_read:,}",
                    f"{self.summary.edges_read / max(elapsed, 1e-9):,.0f}",
                    f"{sum(t.size for t in self.tables):,}",
                )
                next_report = self.summary.edges_read + self.options.progress_every

    def _pass1(self, started: float) -> None:
        """Read every input file: dense ids per type, relation ids, integer edges spilled to the work directory."""
        for file_index, url in enumerate(self.files):
            spill_dir = os.path.join(self.workdir, f"spill_{file_index}")
            os.makedirs(spill_dir)
            self.spilled.append(0)
            logger.info("import: pass 1, reading %s", url)
            with contextlib.ExitStack() as stack:
                spill = {name: stack.enter_context(open(os.path.join(spill_dir, name), "wb")) for name in SPILLED}
                self._bar = stack.enter_context(task_progress(f"import {os.path.basename(url)}", unit=" edges"))
                self._pass1_file(file_index, url, spill, started)
        pass1 = time.monotonic() - started
        logger.info(
            "import: pass 1 done: %s edges in %.1f s (%s/s); entities: %s",
            f"{self.summary.edges_read:,}",
            pass1,
            f"{self.summary.edges_read / max(pass1, 1e-9):,.0f}",
            ", ".join(f"{n}={t.size:,}" for n, t in zip(self.plan.type_names, self.tables)),
        )

    # Partition assignment --------------------------------------------------------------------

    def _assign(self) -> tuple[list[np.ndarray], list[np.ndarray], list[list[np.ndarray]]]:
        """Per type: partition and offset of each dense id (-1 when dropped), and the ids of each partition."""
        parts_of, offsets_of, members = [], [], []
        for type_index, (name, table) in enumerate(zip(self.plan.type_names, self.tables)):
            num_parts = self.config.entities[name].num_partitions
            counts = table.counts[: table.size]
            kept = np.flatnonzero(counts >= self.options.entity_min_count)
            seed = np.random.SeedSequence([self.options.seed & 0xFFFFFFFF, zlib.crc32(name.encode()), type_index])
            shuffled = np.random.default_rng(seed).permutation(kept)
            m = len(shuffled)
            # The same contiguous split sizes as PBG: partition p holds [ceil(p*m/P), ceil((p+1)*m/P)).
            bounds = [(p * m + num_parts - 1) // num_parts for p in range(num_parts + 1)]
            part = np.full(table.size, -1, dtype=np.int64)
            offset = np.full(table.size, -1, dtype=np.int64)
            position = np.arange(m, dtype=np.int64)
            part_of_position = np.searchsorted(np.array(bounds[1:]), position, side="right")
            part[shuffled] = part_of_position
            offset[shuffled] = position - np.array(bounds, dtype=np.int64)[part_of_position]
            parts_of.append(part)
            offsets_of.append(offset)
            members.append([shuffled[bounds[p] : bounds[p + 1]] for p in range(num_parts)])
            self.summary.entities[name] = m
        return parts_of, offsets_of, members

    def _relation_map(self) -> tuple[np.ndarray, list[str]]:
        """Dynamic relations: old id -> new id (-1 when below --relation-type-min-count), and the kept names."""
        names = list(self.dynamic_names)
        counts = self.dynamic_counts[: len(names)]
        kept = [i for i in range(len(names)) if counts[i] >= self.options.relation_type_min_count]
        mapping = np.full(max(len(names), 1), -1, dtype=np.int64)
        mapping[kept] = np.arange(len(kept))
        return mapping, [names[i] for i in kept]

    # Pass 2 and writing --------------------------------------------------------------------------

    def _pass2_file(
        self, file_index: int, parts_of: list[np.ndarray], offsets_of: list[np.ndarray], rel_map: np.ndarray | None
    ) -> tuple[str, np.ndarray]:
        """Remap one spilled file to (partition, offset) and append each edge to its bucket's spill files."""
        remap = Remap.build(self.config, self.plan, parts_of, offsets_of, rel_map)
        bucket_dir = os.path.join(self.workdir, f"buckets_{file_index}")
        source_dir = os.path.join(self.workdir, f"spill_{file_index}")
        rng = np.random.default_rng(np.random.SeedSequence([self.options.seed & 0xFFFFFFFF, 7919, file_index]))
        counts, filtered = bucket_spilled_file(self.plan, remap, source_dir, bucket_dir, self.spilled[file_index], rng)
        self.summary.filtered_edges += filtered
        shutil.rmtree(source_dir, ignore_errors=True)
        return bucket_dir, counts

    def _write_buckets(self, edge_path: str, bucket_dir: str, bucket_counts: np.ndarray, written: list[str]) -> None:
        self.summary.edges_written += write_buckets(edge_path, self.plan, bucket_dir, bucket_counts, written)

    def _write_entities(
        self, members: list[list[np.ndarray]], relation_names: list[str] | None, written: list[str],
        entity_path: str | None = None,
    ) -> None:
        target = entity_path or self.config.entity_path
        write_entities(target, self.plan, self.tables, members, relation_names, written)

    def run(self) -> ImportSummary:
        """Both passes, then the output; a failure while writing removes what this run wrote."""
        started = time.monotonic()
        self._pass1(started)
        parts_of, offsets_of, members = self._assign()
        rel_map: np.ndarray | None = None
        relation_names: list[str] | None = None
        if self.plan.dynamic:
            rel_map, relation_names = self._relation_map()
            self.summary.relations = len(relation_names)
        else:
            self.summary.relations = len(self.config.relations)
        buckets = [self._pass2_file(i, parts_of, offsets_of, rel_map) for i in range(len(self.files))]
        del parts_of, offsets_of
        written: list[str] = []
        try:
            for edge_path, (bucket_dir, counts) in zip(self.config.edge_paths, buckets):
                self._write_buckets(edge_path, bucket_dir, counts, written)
            self._write_entities(members, relation_names, written)
        except BaseException:
            for url in reversed(written):
                with contextlib.suppress(Exception):
                    storage.remove(url)
            raise
        self.summary.seconds = time.monotonic() - started
        return self.summary
