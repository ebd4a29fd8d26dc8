"""The three export layouts: TSV (PBG's ``export_to_tsv``, byte for byte), ``.npy`` and Parquet.

Each output file is written to a local temporary file and becomes its URL only once complete
(``_output_file``), so a failure leaves nothing half-written. Partitions arrive one at a time
from ``iter_partitions`` and are written and dropped before the next (the ``.npy`` header is
rewritten at the end, once the row count is known).
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Iterator
from typing import IO

import numpy as np

import storage_adapters as storage
from job.data.export.reader import CheckpointReader, ExportError, ExportSummary, RelationParam, iter_partitions

FORMATS = ("tsv", "npy", "parquet")
TSV_ENTITIES = "entity_embeddings.tsv"
TSV_RELATIONS = "relation_types_parameters.tsv"
MANIFEST = "manifest.json"
DEFAULT_ROW_GROUP_ROWS = 65536


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
    _write_npy_relations(reader.relation_params(), out, summary, overwrite)


def _write_npy_relations(params: list[RelationParam], out: str, summary: ExportSummary, overwrite: bool) -> None:
    """``relations.npz`` (one array per parameter) and ``relations.json`` (what each array is)."""
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
            # numpy's stub types savez(..., allow_pickle: bool, **kwds): mypy checks **arrays against allow_pickle too
            np.savez(handle, **arrays)  # type: ignore[arg-type]
    with _output_file(table_url, overwrite) as tmp:
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(table, handle, indent=1)
    summary.files += [npz_url, table_url]


def export_parquet(
    reader: CheckpointReader, out: str, summary: ExportSummary, add_global: bool, overwrite: bool,
    row_group_rows: int = DEFAULT_ROW_GROUP_ROWS,
) -> None:
    import pyarrow as pa  # ~0.3 s: kept off the start-up (see job.data.importing.hashing)
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
    _write_parquet_relations(reader.relation_params(), out, summary, overwrite)


def _write_parquet_relations(params: list[RelationParam], out: str, summary: ExportSummary, overwrite: bool) -> None:
    import pyarrow as pa  # ~0.3 s: kept off the start-up (see job.data.importing.hashing)
    import pyarrow.parquet as pq

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
