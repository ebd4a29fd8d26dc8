"""``biggraph export``: turn a committed checkpoint into TSV, NumPy or Parquet files.

Why a separate command: checkpoints are HDF5 files split by partition and keyed by
offset, which is what training needs but not what downstream users (nearest-neighbour
indexes, notebooks, warehouses) want. Export joins each partition's embeddings with the
entity names written by the importer and writes one of:

- ``tsv``: exactly PBG's ``torchbiggraph_export_to_tsv`` layout, so scripts written for
  PBG keep working: ``entity_embeddings.tsv`` (name, then the values as ``%.9f``,
  tab-separated) and ``relation_types_parameters.tsv`` (relation name, side, operator,
  parameter name, shape ``AxB``, then the flattened values). ``--entities-output`` /
  ``--relation-types-output`` name the two files directly, as PBG's flags do.
- ``npy``: ``embeddings_{type}.npy`` (all partitions concatenated in partition order),
  ``names_{type}.json`` (same row order), ``relations.npz`` + ``relations.json``.
- ``parquet``: ``embeddings.parquet`` with columns ``entity_type, partition, offset,
  name, embedding (list<float32>)`` written one bounded row group at a time, and
  ``relations.parquet``.

Every format also gets ``manifest.json`` (checkpoint version, row ranges of each
partition, where the names came from), except when the TSV files are named directly.

Memory stays bounded by one partition: partitions are read, written and dropped one at
a time (the ``.npy`` header is rewritten at the end once the row count is known).

As PBG's exporter does, the learned global embedding of a type (if the model has one)
is added to every embedding of that type, since that sum is what the model scores with;
``--no-global-emb`` exports the raw table instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

import storage_adapters as storage
from job.errors import CheckpointError, InputFormatError, UserError
from job.session import storage_scoped

logger = logging.getLogger("biggraph.export")

FORMATS = ("tsv", "npy", "parquet")
TSV_ENTITIES = "entity_embeddings.tsv"
TSV_RELATIONS = "relation_types_parameters.tsv"
MANIFEST = "manifest.json"
DEFAULT_ROW_GROUP_ROWS = 65536

# Order in which PBG's operators declare their parameters (what ``named_parameters``
# yields, hence the row order of PBG's relation TSV); unknown names go last, sorted.
_PARAM_ORDER = (
    "linear_transformation", "linear_transformations", "translation", "translations",
    "diagonal", "diagonals", "real", "imag",
)
_RELATION_PARAM_RE = re.compile(r"^relations/(?P<idx>\d+)/operator/(?P<side>lhs|rhs)/(?P<param>[^/]+)$")
_GLOBAL_EMB_RE = re.compile(r"^entities/(?P<type>.+)/global_embedding$")


class ExportError(UserError):
    """The export cannot run: no checkpoint, inconsistent names, unwritable output."""


# Reading the checkpoint ---------------------------------------------------------------------


@dataclass
class RelationParam:
    """One relation operator parameter, for one relation type (dynamic ones are split per type)."""

    relation: str
    side: str
    operator: str
    param: str
    values: np.ndarray
    index: int  # the relation type id (position in config.relations or in the dynamic list)


@dataclass
class PartitionInfo:
    entity_type: str
    partition: int
    start: int
    rows: int
    names_source: str  # "names file" or "generated"


@dataclass
class ExportSummary:
    """What was written, for the CLI message and ``manifest.json``."""

    version: int
    format: str
    files: list[str] = field(default_factory=list)
    partitions: list[PartitionInfo] = field(default_factory=list)
    generated_names: list[str] = field(default_factory=list)  # "type/part" without a names file
    global_emb_added: list[str] = field(default_factory=list)
    dimension: dict[str, int] = field(default_factory=dict)

    def manifest(self) -> dict[str, Any]:
        return {
            "checkpoint_version": self.version,
            "format": self.format,
            "global_embedding_added": self.global_emb_added,
            "dimension": self.dimension,
            "partitions": [
                {"entity_type": p.entity_type, "partition": p.partition, "start": p.start, "rows": p.rows,
                 "names": p.names_source}
                for p in self.partitions
            ],
            "files": [url.rsplit("/", 1)[-1] for url in self.files],
        }


class CheckpointReader:
    """The committed (or a chosen) version of a checkpoint, read one partition at a time."""

    def __init__(self, config: Any, version: int | None = None) -> None:
        from job.formats.checkpoint import CheckpointStorage

        self.config = config
        self.storage = CheckpointStorage(config.checkpoint_path)
        committed = self.storage.load_version()
        if committed == 0:
            raise CheckpointError(
                f"{self.storage.version_file()}: no committed checkpoint yet in {config.checkpoint_path} "
                "(train first, or point -p checkpoint_path=... at a checkpoint directory)"
            )
        if version is None:
            version = committed
        elif version < 1 or version > committed:
            raise CheckpointError(
                f"{config.checkpoint_path}: version {version} is not committed (the committed version is {committed}; "
                "older versions are only kept in epoch_*/ snapshots: export those with -p checkpoint_path=.../epoch_N)"
            )
        self.version = version
        self._model: dict[str, np.ndarray] | None = None

    def model_params(self) -> dict[str, np.ndarray]:
        """The shared parameters (public names); empty when the version has no model file."""
        if self._model is None:
            if self.storage.has_model(self.version):
                self._model, _, _ = self.storage.load_model(self.version)
            else:
                self._model = {}
        return self._model

    def global_embedding(self, entity_type: str) -> np.ndarray | None:
        return self.model_params().get(f"entities/{entity_type}/global_embedding")

    def partition(self, entity_type: str, partition: int) -> np.ndarray:
        if not self.storage.has_entity_partition(self.version, entity_type, partition):
            raise CheckpointError(
                f"{self.storage.partition_file(self.version, entity_type, partition)}: missing "
                f"(checkpoint version {self.version} should hold every partition of '{entity_type}')"
            )
        embeddings, _ = self.storage.load_entity_partition(self.version, entity_type, partition)
        return embeddings

    def relation_params(self) -> list[RelationParam]:
        """Operator parameters in PBG's export order (see ``make_tsv_for_relation_types``)."""
        config = self.config
        found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
        for name, array in self.model_params().items():
            match = _RELATION_PARAM_RE.match(name)
            if match:
                found.setdefault((int(match["idx"]), match["side"]), {})[match["param"]] = np.asarray(array)

        def ordered(params: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
            rank = {p: i for i, p in enumerate(_PARAM_ORDER)}
            return sorted(params.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0]))

        out: list[RelationParam] = []
        if config.dynamic_relations:
            operator = config.relations[0].operator
            names = self._dynamic_relation_names()
            for side in ("lhs", "rhs"):
                for param, stacked in ordered(found.get((0, side), {})):
                    if names is None:
                        names = [f"rel_{i}" for i in range(stacked.shape[0])]
                    if stacked.shape[0] != len(names):
                        raise ExportError(
                            f"model parameter relations/0/operator/{side}/{param} has {stacked.shape[0]} rows but "
                            f"there are {len(names)} dynamic relation names"
                        )
                    for idx, rel_name in enumerate(names):
                        out.append(RelationParam(rel_name, side, operator, param, stacked[idx], idx))
            return out
        for idx, relation in enumerate(config.relations):
            for side in ("lhs", "rhs"):
                for param, values in ordered(found.get((idx, side), {})):
                    out.append(RelationParam(relation.name, side, relation.operator, param, values, idx))
        return out

    def _dynamic_relation_names(self) -> list[str] | None:
        from job.formats import entities

        url = entities.dynamic_rel_names_file(self.config.entity_path)
        if not storage.exists(url):
            logger.warning("%s is missing: dynamic relation types are named rel_0, rel_1, ...", url)
            return None
        return entities.read_dynamic_rel_names(self.config.entity_path)


def _names_for(config: Any, entity_type: str, partition: int, rows: int, emb_url: str) -> tuple[list[str], str]:
    """The names of a partition's rows, or generated ``{type}_{part}_{offset}`` ids when no names file exists."""
    from job.formats import entities

    if not entities.has_entity_names(config.entity_path, entity_type, partition):
        return [f"{entity_type}_{partition}_{offset}" for offset in range(rows)], "generated"
    names = entities.read_entity_names(config.entity_path, entity_type, partition)
    if len(names) != rows:
        raise InputFormatError(
            entities.names_file(config.entity_path, entity_type, partition),
            f"holds {len(names)} names but {emb_url} has {rows} embedding rows",
            expected="one name per embedding row (was the entity path re-imported after training?)",
        )
    return names, "names file"


def iter_partitions(
    reader: CheckpointReader, summary: ExportSummary, add_global: bool
) -> Iterator[tuple[str, int, list[str], np.ndarray]]:
    """Yield (type, partition, names, embeddings) one partition at a time, in config order."""
    config = reader.config
    for entity_type, schema in config.entities.items():
        global_emb = reader.global_embedding(entity_type) if add_global else None
        if global_emb is not None:
            summary.global_emb_added.append(entity_type)
        start = 0
        for partition in range(schema.num_partitions):
            embeddings = reader.partition(entity_type, partition)
            if global_emb is not None:
                embeddings += global_emb.astype(np.float32)
            url = reader.storage.partition_file(reader.version, entity_type, partition)
            names, source = _names_for(config, entity_type, partition, embeddings.shape[0], url)
            if source == "generated":
                summary.generated_names.append(f"{entity_type}/{partition}")
            summary.dimension.setdefault(entity_type, int(embeddings.shape[1]))
            if embeddings.shape[1] != summary.dimension[entity_type]:
                raise InputFormatError(
                    url, f"has dimension {embeddings.shape[1]}", dataset="embeddings",
                    expected=f"{summary.dimension[entity_type]} like the other partitions of '{entity_type}'",
                )
            summary.partitions.append(PartitionInfo(entity_type, partition, start, embeddings.shape[0], source))
            start += embeddings.shape[0]
            yield entity_type, partition, names, embeddings
            del embeddings, names


# Writing ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _output_file(url: str, overwrite: bool) -> Iterator[str]:
    """A local path whose content becomes ``url`` only once writing succeeded."""
    if not overwrite and storage.exists(url):
        raise ExportError(f"{url}: already exists (pass --overwrite to replace it)")
    try:
        with storage.local_file_for_writing(url) as tmp:
            yield tmp
    except PermissionError as err:
        raise ExportError(f"{url}: cannot be written ({err.strerror or err})") from None


def check_writable_dir(url: str) -> None:
    """Fail before reading any checkpoint if the output directory cannot be created or written."""
    if storage.is_local(url):
        path = os.path.abspath(storage.local_path(url))
        if os.path.exists(path) and not os.path.isdir(path):
            raise ExportError(f"{url}: exists and is not a directory")
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as err:
            raise ExportError(f"{url}: output directory cannot be created ({err.strerror or err})") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ExportError(f"{url}: output directory is not writable")
        return
    try:
        storage.makedirs(url)
    except PermissionError as err:
        raise ExportError(f"{url}: output location is not writable ({err})") from None


def _format_row(fmt_cache: dict[int, str], values: np.ndarray) -> str:
    dim = values.shape[-1]
    fmt = fmt_cache.get(dim)
    if fmt is None:
        fmt = fmt_cache[dim] = "\t".join(["%.9f"] * dim)
    return fmt % tuple(values.tolist())


def _write_tsv_entities(handle: IO[str], rows: Iterator[tuple[str, int, list[str], np.ndarray]]) -> None:
    cache: dict[int, str] = {}
    for _, _, names, embeddings in rows:
        for start in range(0, len(names), 4096):
            block = embeddings[start : start + 4096]
            block_names = names[start : start + 4096]
            handle.write("".join(f"{name}\t{_format_row(cache, row)}\n" for name, row in zip(block_names, block, strict=True)))


def _write_tsv_relations(handle: IO[str], params: list[RelationParam]) -> None:
    cache: dict[int, str] = {}
    for p in params:
        shape = "x".join(str(d) for d in p.values.shape)
        flat = np.asarray(p.values, dtype=np.float64).reshape(-1)
        values = _format_row(cache, flat) if flat.size else ""
        handle.write(f"{p.relation}\t{p.side}\t{p.operator}\t{p.param}\t{shape}\t{values}\n")


def export_tsv(
    reader: CheckpointReader, entities_url: str, relations_url: str, summary: ExportSummary,
    add_global: bool, overwrite: bool,
) -> None:
    with _output_file(entities_url, overwrite) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as handle:
        _write_tsv_entities(handle, iter_partitions(reader, summary, add_global))
    summary.files.append(entities_url)
    with _output_file(relations_url, overwrite) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as handle:
        _write_tsv_relations(handle, reader.relation_params())
    summary.files.append(relations_url)


_NPY_HEADER_BYTES = 128  # magic (6) + version (2) + length (2) + dict padded with spaces + "\n"


def _npy_header(rows: int, dim: int) -> bytes:
    """A fixed-size ``.npy`` v1.0 header, so it can be rewritten in place once the row count is known."""
    text = f"{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {dim}), }}"
    text = text.ljust(_NPY_HEADER_BYTES - 10 - 1) + "\n"
    if len(text) + 10 != _NPY_HEADER_BYTES:
        raise ValueError(f"shape ({rows}, {dim}) does not fit a {_NPY_HEADER_BYTES}-byte header")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin1")


class _JsonListWriter:
    """Streams a JSON list of strings without holding it (names of billions of entities)."""

    def __init__(self, handle: IO[str]) -> None:
        self.handle = handle
        self.first = True
        handle.write("[")

    def extend(self, items: list[str]) -> None:
        if not items:
            return
        text = ",\n".join(json.dumps(item, ensure_ascii=False) for item in items)
        self.handle.write(("\n" if self.first else ",\n") + text)
        self.first = False

    def close(self) -> None:
        self.handle.write("\n]\n")


def export_npy(reader: CheckpointReader, out: str, summary: ExportSummary, add_global: bool, overwrite: bool) -> None:
    partitions = iter_partitions(reader, summary, add_global)
    pending = next(partitions, None)
    while pending is not None:
        entity_type = pending[0]
        emb_url = storage.join(out, f"embeddings_{entity_type}.npy")
        names_url = storage.join(out, f"names_{entity_type}.json")
        with contextlib.ExitStack() as stack:
            emb_tmp = stack.enter_context(_output_file(emb_url, overwrite))
            names_tmp = stack.enter_context(_output_file(names_url, overwrite))
            emb_handle = stack.enter_context(open(emb_tmp, "wb"))
            names_handle = stack.enter_context(open(names_tmp, "w", encoding="utf-8"))
            dim = pending[3].shape[1]
            emb_handle.write(_npy_header(0, dim))
            names_writer = _JsonListWriter(names_handle)
            rows = 0
            while pending is not None and pending[0] == entity_type:
                _, _, names, embeddings = pending
                emb_handle.write(np.ascontiguousarray(embeddings, dtype="<f4").tobytes())
                names_writer.extend(names)
                rows += embeddings.shape[0]
                pending = next(partitions, None)
            names_writer.close()
            emb_handle.seek(0)
            emb_handle.write(_npy_header(rows, dim))
        summary.files += [emb_url, names_url]
    params = reader.relation_params()
    npz_url = storage.join(out, "relations.npz")
    table_url = storage.join(out, "relations.json")
    table = []
    arrays: dict[str, np.ndarray] = {}
    for p in params:
        key = f"{p.index}.{p.side}.{p.param}"
        arrays[key] = np.asarray(p.values, dtype=np.float32)
        table.append({"key": key, "relation": p.relation, "index": p.index, "side": p.side, "operator": p.operator,
                      "param": p.param, "shape": list(p.values.shape)})
    with _output_file(npz_url, overwrite) as tmp:
        with open(tmp, "wb") as handle:
            np.savez(handle, **arrays)
    with _output_file(table_url, overwrite) as tmp:
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(table, handle, indent=1)
    summary.files += [npz_url, table_url]


def export_parquet(
    reader: CheckpointReader, out: str, summary: ExportSummary, add_global: bool, overwrite: bool,
    row_group_rows: int = DEFAULT_ROW_GROUP_ROWS,
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([
        ("entity_type", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("name", pa.string()),
        ("embedding", pa.list_(pa.float32())),
    ])
    emb_url = storage.join(out, "embeddings.parquet")
    with _output_file(emb_url, overwrite) as tmp, pq.ParquetWriter(tmp, schema) as writer:
        for entity_type, partition, names, embeddings in iter_partitions(reader, summary, add_global):
            dim = embeddings.shape[1]
            for start in range(0, embeddings.shape[0], row_group_rows):
                block = np.ascontiguousarray(embeddings[start : start + row_group_rows], dtype=np.float32)
                n = block.shape[0]
                offsets = pa.array(np.arange(0, (n + 1) * dim, dim, dtype=np.int64), type=pa.int64())
                lists = pa.LargeListArray.from_arrays(offsets, pa.array(block.reshape(-1), type=pa.float32()))
                table = pa.Table.from_arrays(
                    [
                        pa.array([entity_type] * n, type=pa.string()),
                        pa.array(np.full(n, partition, dtype=np.int32)),
                        pa.array(np.arange(start, start + n, dtype=np.int64)),
                        pa.array(names[start : start + n], type=pa.string()),
                        lists.cast(pa.list_(pa.float32())),
                    ],
                    schema=schema,
                )
                writer.write_table(table, row_group_size=n)
    summary.files.append(emb_url)
    params = reader.relation_params()
    rel_url = storage.join(out, "relations.parquet")
    rel_schema = pa.schema([
        ("relation", pa.string()), ("index", pa.int32()), ("side", pa.string()), ("operator", pa.string()),
        ("param", pa.string()), ("shape", pa.list_(pa.int64())), ("values", pa.list_(pa.float32())),
    ])
    rel_table = pa.Table.from_pylist(
        [
            {"relation": p.relation, "index": p.index, "side": p.side, "operator": p.operator, "param": p.param,
             "shape": list(p.values.shape), "values": np.asarray(p.values, dtype=np.float32).reshape(-1).tolist()}
            for p in params
        ],
        schema=rel_schema,
    )
    with _output_file(rel_url, overwrite) as tmp:
        pq.write_table(rel_table, tmp)
    summary.files.append(rel_url)


@storage_scoped
def run_export(
    config: Any,
    *,
    out: str | None = None,
    fmt: str = "tsv",
    version: int | None = None,
    entities_output: str | None = None,
    relation_types_output: str | None = None,
    add_global: bool = True,
    overwrite: bool = False,
    row_group_rows: int = DEFAULT_ROW_GROUP_ROWS,
) -> ExportSummary:
    """Export one checkpoint version; see the module docstring for the layouts."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format '{fmt}' (expected one of {', '.join(FORMATS)})")
    named_tsv = entities_output is not None or relation_types_output is not None
    if named_tsv:
        if entities_output is None or relation_types_output is None:
            raise ExportError("--entities-output and --relation-types-output must be given together")
        if fmt != "tsv":
            raise ExportError("--entities-output/--relation-types-output write TSV; do not combine them with --format")
        for url in (entities_output, relation_types_output):
            parent = url.rstrip("/").rsplit("/", 1)[0] if "/" in url.rstrip("/") else "."
            check_writable_dir(parent)
    elif out is None:
        raise ExportError("give --out DIR (or PBG's --entities-output FILE --relation-types-output FILE)")
    else:
        check_writable_dir(out)
    reader = CheckpointReader(config, version)
    summary = ExportSummary(version=reader.version, format=fmt)
    if named_tsv:
        assert entities_output is not None and relation_types_output is not None
        export_tsv(reader, entities_output, relation_types_output, summary, add_global, overwrite)
    else:
        assert out is not None
        if fmt == "tsv":
            export_tsv(reader, storage.join(out, TSV_ENTITIES), storage.join(out, TSV_RELATIONS), summary,
                       add_global, overwrite)
        elif fmt == "npy":
            export_npy(reader, out, summary, add_global, overwrite)
        else:
            export_parquet(reader, out, summary, add_global, overwrite, row_group_rows)
        manifest_url = storage.join(out, MANIFEST)
        summary.files.append(manifest_url)
        storage.write_text(manifest_url, json.dumps(summary.manifest(), indent=1) + "\n")
    if summary.generated_names:
        logger.warning(
            "no entity_names_{type}_{part}.json in %s for %s: names were generated as {type}_{part}_{offset}",
            config.entity_path, ", ".join(summary.generated_names),
        )
    return summary


# CLI ----------------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    from job.cli import add_config_arguments

    parser = subparsers.add_parser(
        "export",
        help="write the embeddings and relation parameters of a checkpoint as TSV, .npy or Parquet",
        description="Export the latest committed checkpoint (or --version N) of config.checkpoint_path, joined with "
        "the entity names of config.entity_path. TSV is byte-for-byte PBG's export_to_tsv layout.",
    )
    add_config_arguments(parser)
    parser.add_argument("--out", metavar="DIR", help="output directory (path or URL)")
    parser.add_argument("--format", choices=FORMATS, default=None, help="output format for --out (default: tsv)")
    parser.add_argument("--version", type=int, default=None, help="checkpoint version (default: the committed one)")
    parser.add_argument("--entities-output", metavar="FILE", help="PBG-style: the entity TSV file")
    parser.add_argument("--relation-types-output", metavar="FILE", help="PBG-style: the relation parameter TSV file")
    parser.add_argument("--no-global-emb", action="store_true",
                        help="do not add the learned global embedding of each type (PBG's exporter adds it)")
    parser.add_argument("--overwrite", action="store_true", help="replace output files that already exist")
    parser.add_argument("--row-group-rows", type=int, default=DEFAULT_ROW_GROUP_ROWS,
                        help="Parquet rows per row group (bounds memory while writing)")
    parser.set_defaults(func=_export_command)


def _export_command(args: argparse.Namespace) -> int:
    from job.cli import overrides_of
    from job.config import load_config

    if args.row_group_rows < 1:
        raise ExportError("--row-group-rows must be a positive integer")
    config = load_config(args.config, overrides_of(args))
    summary = run_export(
        config,
        out=args.out,
        fmt=args.format or "tsv",
        version=args.version,
        entities_output=args.entities_output,
        relation_types_output=args.relation_types_output,
        add_global=not args.no_global_emb,
        overwrite=args.overwrite,
        row_group_rows=args.row_group_rows,
    )
    rows = sum(p.rows for p in summary.partitions)
    print(f"exported checkpoint version {summary.version}: {rows} embeddings of {len(summary.dimension)} entity type(s)")
    for url in summary.files:
        print(f"  {url}")
    if summary.generated_names:
        print(f"  note: no names files for {', '.join(summary.generated_names)}; names are {{type}}_{{part}}_{{offset}}")
    return 0
