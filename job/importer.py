"""``biggraph import``: turn edge lists (TSV, CSV, Parquet) with string ids into PBG's v1 input layout.

Why it is built the way it is:

- The input can be far larger than memory (100M+ edges), so it is streamed twice in
  bounded chunks, never held whole. Pass 1 parses the files with pyarrow, gives every
  distinct entity id a dense integer (per entity type) and spills the integer edge
  columns to a temporary directory. Partitions can only be assigned once every entity
  (and its count, for ``--entity-min-count``) is known; pass 2 then maps the spilled
  integers to (partition, offset), groups edges by bucket and writes the bucket files.
  Memory is therefore proportional to the number of distinct entities, not of edges.
- Ids are deduplicated by a 64-bit hash of their UTF-8 bytes computed with numpy over
  the whole batch, and a sorted hash table searched with ``np.searchsorted``: no Python
  object is created per edge (PBG builds a Python ``str`` and a tensor per edge, which is
  why it manages ~69k edges/s). Two distinct ids sharing a hash would be merged; with
  n entities per type that happens with probability about n^2 / 2^65 (3e-8 at a million).
- Nothing is written to ``entity_path`` or ``edge_paths`` until both passes succeeded,
  so a bad row (which always surfaces in pass 1) leaves no output behind; a failure
  while writing removes what this run wrote.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import logging
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

import storage_adapters as storage
from job.errors import InputFormatError, UserError
from job.reporting import task_progress
from job.session import storage_scoped

if TYPE_CHECKING:
    import pyarrow as pa

    from job.config import ConfigSchema

logger = logging.getLogger("biggraph")

FORMATS = ("tsv", "csv", "parquet")
_COMPRESSED_SUFFIXES = (".gz", ".bz2", ".zst", ".lz4", ".xz")
_ID_DTYPE = np.int32  # spilled entity / relation ids; 2^31 distinct ids per type is far beyond any names file
_PASS2_CHUNK = 1 << 20  # edges remapped and bucketed at a time in pass 2


# Command line ---------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    from job.cli import add_config_arguments

    parser = subparsers.add_parser(
        "import",
        help="convert TSV/CSV/Parquet edge lists with string ids into PBG's partitioned input format",
        description=(
            "Read edge lists (one edge per row, entity and relation names as strings), assign every entity "
            "a partition and an offset, and write entity_path (counts and names of each partition) and one "
            "edges_{lhs}_{rhs}.h5 per bucket in each edge_paths directory. The i-th FILE goes to the i-th "
            "entry of the config's edge_paths. Put -p overrides after the files (or end them with --)."
        ),
    )
    add_config_arguments(parser)
    parser.add_argument("files", nargs="+", metavar="FILE", help="input edge list(s): paths or URLs, .gz etc. allowed")
    add_import_arguments(parser)
    parser.set_defaults(func=run)


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    """The column and parsing options of ``biggraph import`` (``biggraph grow`` reads new edges with the same ones)."""
    parser.add_argument("-l", "--lhs-col", type=int, required=True, help="0-based column of the source entity")
    parser.add_argument("-r", "--rhs-col", type=int, required=True, help="0-based column of the target entity")
    parser.add_argument(
        "--rel-col", type=int, default=None, help="0-based column of the relation name (without it every edge is relation 0)"
    )
    parser.add_argument(
        "--relation-type-min-count",
        type=int,
        default=1,
        help="with dynamic_relations, drop relation types seen fewer times (and their edges)",
    )
    parser.add_argument(
        "--entity-min-count", type=int, default=1, help="drop entities seen fewer times (and the edges touching them)"
    )
    parser.add_argument(
        "--format", choices=("auto", *FORMATS), default="auto", help="input format (auto: by extension, default tsv)"
    )
    parser.add_argument("--delimiter", default=None, help="field delimiter for tsv/csv (default: tab for tsv, ',' for csv)")
    parser.add_argument("--header", action="store_true", help="tsv/csv files start with a header line to skip")
    parser.add_argument(
        "--skip-bad-rows",
        action="store_true",
        help="skip malformed rows, empty ids and unknown relation names (and report how many) instead of failing",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random partition assignment (default 0)")
    parser.add_argument("--block-size", type=int, default=8, metavar="MIB", help="input read chunk in MiB (default 8)")
    parser.add_argument("--tmp-dir", default=None, help="local directory for temporary files (default: system temp)")
    parser.add_argument(
        "--progress-every", type=float, default=5.0, metavar="MILLIONS", help="log progress every this many million edges"
    )


def run(args: argparse.Namespace) -> int:
    from job.cli import overrides_of
    from job.config import load_config

    config = load_config(args.config, overrides_of(args))
    summary = import_edges(config, args.files, import_options(args))
    print(summary.describe())
    return 0


def import_options(args: argparse.Namespace) -> ImportOptions:
    """The ``ImportOptions`` of parsed ``add_import_arguments`` flags."""
    return ImportOptions(
        lhs_col=args.lhs_col,
        rhs_col=args.rhs_col,
        rel_col=args.rel_col,
        input_format=args.format,
        delimiter=args.delimiter,
        header=args.header,
        skip_bad_rows=args.skip_bad_rows,
        seed=args.seed,
        block_size=args.block_size << 20,
        entity_min_count=args.entity_min_count,
        relation_type_min_count=args.relation_type_min_count,
        tmp_dir=args.tmp_dir,
        progress_every=max(1, int(args.progress_every * 1_000_000)),
    )


@dataclass
class ImportOptions:
    """Everything that controls an import besides the config (the CLI flags)."""

    lhs_col: int
    rhs_col: int
    rel_col: int | None = None
    input_format: str = "auto"
    delimiter: str | None = None
    header: bool = False
    skip_bad_rows: bool = False
    seed: int = 0
    block_size: int = 8 << 20
    entity_min_count: int = 1
    relation_type_min_count: int = 1
    tmp_dir: str | None = None
    progress_every: int = 5_000_000


@dataclass
class ImportSummary:
    """What an import did, for the final report line and for tests."""

    edges_read: int = 0
    edges_written: int = 0
    malformed_rows: int = 0
    empty_id_rows: int = 0
    unknown_relation_rows: int = 0
    filtered_edges: int = 0
    entities: dict[str, int] = field(default_factory=dict)
    relations: int = 0
    seconds: float = 0.0

    @property
    def skipped_rows(self) -> int:
        return self.malformed_rows + self.empty_id_rows + self.unknown_relation_rows

    def describe(self) -> str:
        rate = self.edges_read / self.seconds if self.seconds > 0 else 0.0
        entities = ", ".join(f"{name}={count:,}" for name, count in self.entities.items())
        text = (
            f"imported {self.edges_written:,} edges ({self.edges_read:,} rows read) in {self.seconds:.1f} s "
            f"({rate:,.0f} edges/s); entities: {entities}; relation types: {self.relations:,}"
        )
        if self.skipped_rows:
            text += (
                f"; skipped {self.skipped_rows:,} bad rows ({self.malformed_rows:,} malformed, "
                f"{self.empty_id_rows:,} with an empty id, {self.unknown_relation_rows:,} with an unknown relation)"
            )
        if self.filtered_edges:
            text += f"; dropped {self.filtered_edges:,} edges below --entity-min-count/--relation-type-min-count"
        return text


# Hashing and the per-type id tables -------------------------------------------------------


_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_LENGTH_MULT = np.uint64(0x9E3779B97F4A7C15)
_FAST_WIDTH = 32  # ids up to this many bytes are padded by pyarrow in one C++ call (the common case)


def _string_buffers(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Zero-copy (offsets rebased to 0, bytes) views of a string/large_string array without nulls."""
    import pyarrow as pa

    offset_dtype = np.int64 if pa.types.is_large_string(array.type) else np.int32
    _, offsets_buf, data_buf = array.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=offset_dtype)[array.offset : array.offset + len(array) + 1].astype(np.int64)
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    data = data[offsets[0] : offsets[-1]] if len(offsets) else data[:0]
    return offsets - (offsets[0] if len(offsets) else 0), data


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection on 64 bits that spreads every input bit over the output."""
    values = values ^ (values >> np.uint64(30))
    values *= _MIX1
    values ^= values >> np.uint64(27)
    values *= _MIX2
    values ^= values >> np.uint64(31)
    return values


def _hash_words(words: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The id hash from each string's zero-padded 8-byte words (one row per string).

    Ids of at most 7 bytes get their padded bytes plus the length in the top byte, which
    is exact (no two such ids share a key); longer ids chain the words through ``_mix``.
    Only words inside the string count, so the result does not depend on the padding width.
    """
    num_words = (lengths + 7) // 8
    hashes = lengths.astype(np.uint64) * _LENGTH_MULT
    for j in range(words.shape[1]):
        updated = _mix(hashes ^ words[:, j])
        hashes = np.where(num_words > j, updated, hashes)
    if words.shape[1]:
        short = lengths <= 7
        hashes[short] = words[short, 0] | (lengths[short].astype(np.uint64) << np.uint64(56))
    return hashes


def _padded_words(offsets: np.ndarray, data: np.ndarray, width: int) -> np.ndarray:
    """Strings (none longer than ``width`` bytes) copied into zero-padded rows of ``width`` bytes."""
    n = len(offsets) - 1
    lengths = np.diff(offsets)
    padded = np.zeros(n * width, dtype=np.uint8)
    target = np.arange(data.size, dtype=np.int64)
    target += np.repeat(np.arange(n, dtype=np.int64) * width - offsets[:-1], lengths)
    padded[target] = data
    return padded.view(np.uint64).reshape(n, width // 8)


def hash_strings(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """64-bit hashes and byte lengths of every string of an arrow string array (no nulls), vectorized.

    Fast path: pad every id to the same width with pyarrow's ``utf8_rpad`` (one C++ call),
    then view the bytes as a (rows, words) uint64 matrix without copying. Non-ASCII or long
    ids take the numpy path, grouping rows by padded width so memory stays ~2x the bytes.
    """
    import pyarrow.compute as pc

    offsets, data = _string_buffers(array)
    lengths = np.diff(offsets)
    n = len(lengths)
    if n == 0:
        return np.zeros(0, dtype=np.uint64), lengths
    longest = int(lengths.max())
    width = max(8, (longest + 7) // 8 * 8)
    if width <= _FAST_WIDTH:
        padded = pc.utf8_rpad(array, width=width, padding="\x00")
        padded_offsets, padded_data = _string_buffers(padded)
        if padded_data.size == n * width:  # every id was padded to exactly `width` bytes (ASCII)
            return _hash_words(padded_data.view(np.uint64).reshape(n, width // 8), lengths), lengths
    hashes = np.empty(n, dtype=np.uint64)
    widths = np.maximum(8, 1 << np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64))
    for group_width in np.unique(widths):
        rows = np.flatnonzero(widths == group_width)
        if len(rows) == n:
            group_offsets, group_data = offsets, data
        else:
            group_offsets, group_data = _string_buffers(array.take(rows))
        hashes[rows] = _hash_words(_padded_words(group_offsets, group_data, int(group_width)), lengths[rows])
    return hashes, lengths


def _merge_sorted(
    keys: np.ndarray, values: np.ndarray, where: np.ndarray, new_keys: np.ndarray, new_values: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Insert sorted ``new_keys`` before positions ``where`` (from searchsorted): np.insert without its sort."""
    total = len(keys) + len(new_keys)
    slots = where + np.arange(len(new_keys), dtype=np.int64)
    old = np.ones(total, dtype=bool)
    old[slots] = False
    merged_keys = np.empty(total, dtype=keys.dtype)
    merged_values = np.empty(total, dtype=values.dtype)
    merged_keys[old] = keys
    merged_keys[slots] = new_keys
    merged_values[old] = values
    merged_values[slots] = new_values
    return merged_keys, merged_values


class EntityTable:
    """The distinct ids of one entity type: dense integers (batch by batch, in hash order within a batch), names, counts.

    Lookup is a sorted array of hashes (with the dense id beside each) searched with
    ``np.searchsorted``; new ids are merged in with ``np.insert`` once per batch, which is
    linear in the table but amortised over a whole batch of edges.
    """

    def __init__(self) -> None:
        self.sorted_hashes = np.zeros(0, dtype=np.uint64)
        self.sorted_ids = np.zeros(0, dtype=np.int64)
        self.name_chunks: list[pa.Array] = []
        self.counts = np.zeros(0, dtype=np.int64)
        self.size = 0

    def preload(self, names: pa.Array) -> np.ndarray:
        """Make ``names`` the ids 0..n-1, in order (``biggraph grow``: an existing model's entities keep their ids).

        Returns the positions of names that repeat an earlier one (empty when all are distinct): the
        caller decides whether that is an error. Their counts start at 0, so ``counts`` afterwards
        counts only the occurrences in edges encoded later.
        """
        import pyarrow as pa

        hashes, _ = hash_strings(names)
        order = np.argsort(hashes, kind="stable")
        ordered = hashes[order]
        repeated = np.zeros(len(ordered), dtype=bool)
        if len(ordered) > 1:
            np.equal(ordered[1:], ordered[:-1], out=repeated[1:])
        self.sorted_hashes = ordered[~repeated]
        self.sorted_ids = order[~repeated].astype(np.int64)
        self.name_chunks = [names.cast(pa.large_string())] if len(names) else []
        self.size = len(names)
        self.counts = np.zeros(max(self.size, 1), dtype=np.int64)
        return np.sort(order[repeated])

    def hashes_of(self, ids: np.ndarray) -> np.ndarray:
        """The hashes of dense ids (the inverse of the lookup table, for the ids given)."""
        by_id = np.empty(self.size, dtype=np.uint64)
        by_id[self.sorted_ids] = self.sorted_hashes
        return by_id[ids]

    def encode(self, hashes: np.ndarray, names_at: Callable[[np.ndarray], pa.Array]) -> np.ndarray:
        """Dense ids of ``hashes``; ``names_at(positions)`` gives the strings at those positions (for new ids)."""
        n = len(hashes)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        order = np.argsort(hashes)
        ordered = hashes[order]
        first = np.empty(n, dtype=bool)
        first[0] = True
        np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
        starts = np.flatnonzero(first)
        unique = ordered[starts]
        run_lengths = np.diff(np.append(starts, n))
        where = np.searchsorted(self.sorted_hashes, unique)
        known = where < len(self.sorted_hashes)
        known[known] = self.sorted_hashes[where[known]] == unique[known]
        unique_ids = np.empty(len(unique), dtype=np.int64)
        unique_ids[known] = self.sorted_ids[where[known]]
        new = ~known
        num_new = int(np.count_nonzero(new))
        if num_new:
            new_ids = np.arange(self.size, self.size + num_new, dtype=np.int64)
            unique_ids[new] = new_ids
            self.name_chunks.append(names_at(order[starts[new]]))
            merged = _merge_sorted(self.sorted_hashes, self.sorted_ids, where[new], unique[new], new_ids)
            self.sorted_hashes, self.sorted_ids = merged
            self.size += num_new
            if self.size > len(self.counts):
                grown = np.zeros(max(self.size, 2 * len(self.counts)), dtype=np.int64)
                grown[: len(self.counts)] = self.counts
                self.counts = grown
        self.counts[unique_ids] += run_lengths
        ids = np.empty(n, dtype=np.int64)
        ids[order] = np.repeat(unique_ids, run_lengths)
        return ids

    def names(self) -> pa.ChunkedArray:
        import pyarrow as pa

        return pa.chunked_array([chunk.cast(pa.large_string()) for chunk in self.name_chunks], type=pa.large_string())


# Reading the input ------------------------------------------------------------------------


def _detect_format(url: str, requested: str) -> str:
    if requested != "auto":
        return requested
    lower = url.lower()
    for suffix in _COMPRESSED_SUFFIXES:
        if lower.endswith(suffix):
            lower = lower[: -len(suffix)]
    if lower.endswith((".parquet", ".pq")):
        return "parquet"
    if lower.endswith(".csv"):
        return "csv"
    return "tsv"


def _delimiter(fmt: str, requested: str | None) -> str:
    if requested is None:
        return "," if fmt == "csv" else "\t"
    value = requested.encode().decode("unicode_escape") if "\\" in requested else requested
    if len(value) != 1:
        raise UserError(f"--delimiter must be a single character, got {requested!r}")
    return value


@dataclass
class _Batch:
    """One chunk of rows as arrow string arrays (rel is None without --rel-col)."""

    lhs: pa.Array
    rhs: pa.Array
    rel: pa.Array | None
    malformed: int  # rows the parser dropped from this batch for a wrong column count


class _Source:
    """One input file streamed as batches of the three columns we need."""

    def __init__(self, url: str, options: ImportOptions) -> None:
        self.url = url
        self.options = options
        self.format = _detect_format(url, options.input_format)
        self.delimiter = _delimiter(self.format, options.delimiter) if self.format != "parquet" else ""
        self.first_malformed: str | None = None
        self._malformed = 0
        self._terminate = False  # read through _NewlineTerminated (see _text_batches)
        self.columns = [options.lhs_col, options.rhs_col] + ([options.rel_col] if options.rel_col is not None else [])

    def _check_columns(self, num_columns: int) -> None:
        for flag, col in (
            ("--lhs-col", self.options.lhs_col),
            ("--rhs-col", self.options.rhs_col),
            ("--rel-col", self.options.rel_col),
        ):
            if col is not None and col >= num_columns:
                unit = "columns" if self.format == "parquet" else "columns in its first row"
                raise InputFormatError(
                    self.url,
                    f"{flag} {col} is out of range: the file has {num_columns} {unit}",
                    expected=f"a column index < {num_columns}",
                )

    def _open_binary(self) -> Any:
        """Local paths go straight to pyarrow (native I/O); URLs through fsspec, decompressing by extension."""
        if storage.is_local(self.url):
            return storage.local_path(self.url)
        import fsspec

        return fsspec.open(self.url, "rb", compression="infer", **storage.storage_options_for(self.url)).open()

    def batches(self) -> Iterator[_Batch]:
        if self.format == "parquet":
            yield from self._parquet_batches()
        else:
            yield from self._text_batches()

    def _parquet_batches(self) -> Iterator[_Batch]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            handle = pq.ParquetFile(self._open_binary())
        except (pa.ArrowInvalid, OSError) as err:
            raise InputFormatError(self.url, f"not a readable Parquet file ({err})", expected="a Parquet file") from None
        names = handle.schema_arrow.names
        self._check_columns(len(names))
        wanted = [names[c] for c in self.columns]
        rows = max(65536, self.options.block_size // 32)
        for batch in handle.iter_batches(batch_size=rows, columns=list(dict.fromkeys(wanted))):
            arrays = [_as_strings(batch.column(name)) for name in wanted]
            yield _Batch(arrays[0], arrays[1], arrays[2] if len(arrays) > 2 else None, 0)

    def _on_invalid_row(self, row: Any) -> str:
        self._malformed += 1
        if self.first_malformed is None:
            self.first_malformed = str(row.text)
        return "skip"

    def _text_input(self) -> Any:
        """What pyarrow reads: the file itself, or (``_terminate``) its decompressed bytes plus a final newline."""
        source = self._open_binary()
        if not self._terminate:
            return source
        if isinstance(source, str):
            import pyarrow as pa

            source = pa.input_stream(source, compression="detect")
        return io.BufferedReader(_NewlineTerminated(source))

    def _text_reader(self, block_size: int, num_columns: int | None) -> Any:
        import pyarrow as pa
        import pyarrow.csv as pacsv

        read = pacsv.ReadOptions(autogenerate_column_names=True, block_size=block_size, skip_rows=1 if self.options.header else 0)
        parse = pacsv.ParseOptions(
            delimiter=self.delimiter,
            quote_char='"' if self.format == "csv" else False,
            invalid_row_handler=self._on_invalid_row,
        )
        if num_columns is None:
            convert = pacsv.ConvertOptions()
        else:
            names = [f"f{c}" for c in dict.fromkeys(self.columns)]
            convert = pacsv.ConvertOptions(column_types={n: pa.string() for n in names}, include_columns=names)
        return pacsv.open_csv(self._text_input(), read_options=read, parse_options=parse, convert_options=convert)

    def _text_batches(self) -> Iterator[_Batch]:
        import pyarrow as pa

        try:
            try:
                peek = self._text_reader(1 << 20, None)
            except pa.ArrowInvalid as err:
                if "Empty CSV file" not in str(err):
                    raise
                # pyarrow also says so of a file holding one line without a final newline: read it newline-terminated
                self._terminate = True
                try:
                    peek = self._text_reader(1 << 20, None)
                except pa.ArrowInvalid as again:
                    if "Empty CSV file" in str(again):
                        logger.warning("%s is empty", self.url)
                        return
                    raise
            self._check_columns(len(peek.schema))
            self._malformed = 0
            self.first_malformed = None
            reader = self._text_reader(self.options.block_size, len(peek.schema))
            names = [f"f{c}" for c in self.columns]
            while True:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    return
                malformed, self._malformed = self._malformed, 0
                arrays = [batch.column(name) for name in names]
                yield _Batch(arrays[0], arrays[1], arrays[2] if len(arrays) > 2 else None, malformed)
        except (pa.ArrowInvalid, UnicodeDecodeError) as err:
            text = str(err).replace("\n", " ")
            raise InputFormatError(self.url, f"cannot be parsed ({text})", expected=f"a {self.format.upper()} file") from None

    def locate(self, is_bad: Callable[[list[str]], str | None]) -> tuple[int, str] | None:
        """The 1-based line and problem of the first row ``is_bad`` rejects (slow path, only after an error).

        pyarrow does not report line numbers, so on error the file is rescanned with
        Python's csv module, applying the same rules, to tell the user where to look.
        """
        if self.format == "parquet":
            return None
        raw = self._open_binary()
        if isinstance(raw, str):
            import pyarrow as pa

            raw = pa.input_stream(raw, compression="detect")
        with contextlib.closing(raw):
            text = io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline="")
            if self.format == "csv":
                reader = csv.reader(text, delimiter=self.delimiter, quotechar='"')
            else:
                reader = csv.reader(text, delimiter=self.delimiter, quoting=csv.QUOTE_NONE)
            expected: int | None = None
            for index, fields in enumerate(reader):
                if index == 0 and self.options.header:
                    continue
                if not fields:
                    continue
                if expected is None:
                    expected = len(fields)
                if len(fields) != expected:
                    shown = self.delimiter.join(fields)
                    shown = shown if len(shown) <= 80 else shown[:77] + "..."
                    return reader.line_num, f"has {len(fields)} fields, not {expected} as in the first row: {shown!r}"
                problem = is_bad(fields)
                if problem is not None:
                    return reader.line_num, problem
        return None


class _NewlineTerminated(io.RawIOBase):
    """A binary stream followed by one b"\\n"."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._done or not len(buffer):
            return 0
        data = self._raw.read(len(buffer))
        if not data:
            self._done = True
            buffer[0:1] = b"\n"
            return 1
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._raw.close()
        super().close()


def _as_strings(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A column of any scalar type as a plain string array (ids may be stored as integers in Parquet)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        column = pc.cast(column, pa.string())
    return column


# The import itself ---------------------------------------------------------------------------


@dataclass
class _Plan:
    """How relation ids map to entity types, derived from the config once."""

    type_names: list[str]
    dynamic: bool
    relation_ids: dict[str, int]  # config relation name -> index (static relations)
    lhs_type: np.ndarray  # per static relation id: index into type_names
    rhs_type: np.ndarray
    parts_lhs: int
    parts_rhs: int


def _plan(config: ConfigSchema, options: ImportOptions) -> _Plan:
    type_names = list(config.entities)
    index = {name: i for i, name in enumerate(type_names)}
    relation_ids: dict[str, int] = {}
    for i, relation in enumerate(config.relations):
        relation_ids.setdefault(relation.name, i)
    lhs_type = np.array([index[r.lhs] for r in config.relations], dtype=np.int64)
    rhs_type = np.array([index[r.rhs] for r in config.relations], dtype=np.int64)
    # As in PBG, each side has as many partitions as its most partitioned entity type.
    parts_lhs = max(config.entities[r.lhs].num_partitions for r in config.relations)
    parts_rhs = max(config.entities[r.rhs].num_partitions for r in config.relations)
    return _Plan(type_names, config.dynamic_relations, relation_ids, lhs_type, rhs_type, parts_lhs, parts_rhs)


def _check_request(config: ConfigSchema, files: list[str], options: ImportOptions) -> None:
    if len(files) != len(config.edge_paths):
        raise UserError(
            f"got {len(files)} input file(s) but the config's edge_paths lists {len(config.edge_paths)} "
            f"({', '.join(config.edge_paths)}); the i-th file is written to the i-th edge path"
        )
    for flag, col in (("--lhs-col", options.lhs_col), ("--rhs-col", options.rhs_col), ("--rel-col", options.rel_col)):
        if col is not None and col < 0:
            raise UserError(f"{flag} must be a column index >= 0, got {col}")
    if options.entity_min_count < 1 or options.relation_type_min_count < 1:
        raise UserError("--entity-min-count and --relation-type-min-count must be >= 1")
    if options.block_size < 1 << 10:
        raise UserError("--block-size must be at least 1 (MiB)")
    if config.dynamic_relations and options.rel_col is None:
        raise UserError("the config has dynamic_relations enabled, so --rel-col is required")
    featurized = [name for name, entity in config.entities.items() if entity.featurized]
    if featurized:
        raise UserError(f"entity type(s) {', '.join(featurized)} are featurized; import only handles plain entities")
    for url in files:
        try:
            present = storage.exists(url) and not storage.isdir(url)
        except (UserError, storage.StorageError):
            raise
        except Exception as err:  # noqa: BLE001 - any backend error means we cannot read it
            raise UserError(f"input file {url}: cannot be accessed ({err})") from None
        if not present:
            raise UserError(f"input file {url}: not found")


class _Importer:
    def __init__(self, config: ConfigSchema, files: list[str], options: ImportOptions, workdir: str) -> None:
        self.config = config
        self.files = files
        self.options = options
        self.workdir = workdir
        self.plan = _plan(config, options)
        self.tables = [EntityTable() for _ in self.plan.type_names]
        self.dynamic_names: dict[str, int] = {}
        self.dynamic_counts = np.zeros(0, dtype=np.int64)
        self.summary = ImportSummary()
        self.spilled: list[int] = []  # edges spilled per input file

    # Pass 1 -------------------------------------------------------------------------------

    def _relation_ids(self, source: _Source, batch: _Batch) -> np.ndarray:
        import pyarrow.compute as pc

        n = len(batch.lhs)
        if batch.rel is None:
            return np.zeros(n, dtype=np.int64)
        rel = batch.rel.fill_null("") if batch.rel.null_count else batch.rel
        encoded = pc.dictionary_encode(rel)
        names = encoded.dictionary.to_pylist()
        # -1: a name not in the config; -2: an empty name.
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

    def _fail(self, source: _Source, generic: str, expected: str) -> None:
        where = source.locate(self._bad_row_rule())
        if where is None:
            raise InputFormatError(source.url, generic, expected=expected + "; or pass --skip-bad-rows")
        line, problem = where
        raise InputFormatError(source.url, problem, row=line, expected=expected + "; or pass --skip-bad-rows")

    def _pass1_file(self, file_index: int, url: str, spill: dict[str, Any], started: float) -> None:

        source = _Source(url, self.options)
        options = self.options
        plan = self.plan
        rows_before = 0
        next_report = self.summary.edges_read + options.progress_every
        for batch in source.batches():
            self.summary.malformed_rows += batch.malformed
            if batch.malformed and not options.skip_bad_rows:
                self._fail(
                    source,
                    f"has a row with a wrong number of fields: {source.first_malformed!r}",
                    "the same number of fields on every row",
                )
            lhs = batch.lhs.fill_null("") if batch.lhs.null_count else batch.lhs
            rhs = batch.rhs.fill_null("") if batch.rhs.null_count else batch.rhs
            lhs_hash, lhs_len = hash_strings(lhs)
            rhs_hash, rhs_len = hash_strings(rhs)
            rel = self._relation_ids(source, batch)
            empty = (lhs_len == 0) | (rhs_len == 0) | (rel == -2)
            unknown = (rel == -1) & ~empty
            n = len(rel)
            self.summary.edges_read += n
            bad = empty | unknown
            if bad.any():
                first = int(np.flatnonzero(bad)[0])
                if not options.skip_bad_rows:
                    if source.format == "parquet":
                        if empty[first]:
                            raise InputFormatError(
                                url,
                                "has an empty or null id",
                                row=rows_before + first + 1,
                                expected="non-empty ids; or pass --skip-bad-rows",
                            )
                        name = batch.rel[first].as_py() if batch.rel is not None else ""
                        raise InputFormatError(
                            url,
                            self._unknown_relation(name),
                            row=rows_before + first + 1,
                            expected=f"one of the config's relation names ({', '.join(plan.relation_ids)}); "
                            "or pass --skip-bad-rows",
                        )
                    if empty[first]:
                        self._fail(source, "has an empty id", "non-empty ids")
                    self._fail(
                        source,
                        "has a relation type not in the config",
                        f"one of the config's relation names ({', '.join(plan.relation_ids)})",
                    )
                self.summary.empty_id_rows += int(np.count_nonzero(empty))
                self.summary.unknown_relation_rows += int(np.count_nonzero(unknown))
                keep = np.flatnonzero(~bad)
                lhs_hash, rhs_hash, rel = lhs_hash[keep], rhs_hash[keep], rel[keep]
            else:
                keep = None
            rows_before += n
            if plan.dynamic:
                self._count_dynamic(rel)
            lhs_ids, rhs_ids = self._encode(lhs, rhs, lhs_hash, rhs_hash, rel, keep)
            spill["lhs"].write(lhs_ids.astype(_ID_DTYPE).tobytes())
            spill["rhs"].write(rhs_ids.astype(_ID_DTYPE).tobytes())
            spill["rel"].write(rel.astype(_ID_DTYPE).tobytes())
            self.spilled[file_index] += len(rel)
            self._bar.update(n)
            if self.summary.edges_read >= next_report:
                elapsed = time.monotonic() - started
                logger.info(
                    "import: read %s edges (%s/s), %s distinct entities so far",
                    f"{self.summary.edges_read:,}",
                    f"{self.summary.edges_read / max(elapsed, 1e-9):,.0f}",
                    f"{sum(t.size for t in self.tables):,}",
                )
                next_report = self.summary.edges_read + options.progress_every

    def _encode(
        self, lhs: pa.Array, rhs: pa.Array, lhs_hash: np.ndarray, rhs_hash: np.ndarray, rel: np.ndarray, keep: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Dense per-type ids for both sides; entity types are looked up from each edge's relation."""
        plan = self.plan
        n = len(rel)
        if plan.dynamic:
            lhs_types = np.full(n, plan.lhs_type[0])
            rhs_types = np.full(n, plan.rhs_type[0])
        else:
            lhs_types = plan.lhs_type[rel]
            rhs_types = plan.rhs_type[rel]
        rows = np.arange(n, dtype=np.int64) if keep is None else keep
        lhs_ids = np.empty(n, dtype=np.int64)
        rhs_ids = np.empty(n, dtype=np.int64)
        if len(plan.type_names) == 1:
            used_types = [0] if n else []
        else:
            used = np.bincount(lhs_types, minlength=len(plan.type_names)) + np.bincount(rhs_types, minlength=len(plan.type_names))
            used_types = list(np.flatnonzero(used))
        for type_index in used_types:
            left = np.flatnonzero(lhs_types == type_index) if len(plan.type_names) > 1 else slice(None)
            right = np.flatnonzero(rhs_types == type_index) if len(plan.type_names) > 1 else slice(None)
            left_rows = rows[left]
            right_rows = rows[right]
            num_left = len(left_rows)

            def names_at(
                positions: np.ndarray,
                left_rows: np.ndarray = left_rows,
                right_rows: np.ndarray = right_rows,
                num_left: int = num_left,
            ) -> pa.Array:
                import pyarrow as pa

                from_left = positions[positions < num_left]
                from_right = positions[positions >= num_left] - num_left
                # Order only needs to match `positions`' order of new ids: rebuild it by concatenating in place.
                is_left = positions < num_left
                picked = pa.concat_arrays(
                    [
                        lhs.take(left_rows[from_left]).cast(pa.large_string()),
                        rhs.take(right_rows[from_right]).cast(pa.large_string()),
                    ]
                )
                order = np.empty(len(positions), dtype=np.int64)
                order[np.flatnonzero(is_left)] = np.arange(len(from_left))
                order[np.flatnonzero(~is_left)] = len(from_left) + np.arange(len(from_right))
                return picked.take(order)

            ids = self.tables[type_index].encode(np.concatenate([lhs_hash[left], rhs_hash[right]]), names_at)
            lhs_ids[left] = ids[:num_left]
            rhs_ids[right] = ids[num_left:]
        return lhs_ids, rhs_ids

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

    # Pass 2 -------------------------------------------------------------------------------------

    def _pass2_file(
        self, file_index: int, parts_of: list[np.ndarray], offsets_of: list[np.ndarray], rel_map: np.ndarray | None
    ) -> tuple[str, np.ndarray]:
        """Remap one spilled file to (partition, offset) and append each edge to its bucket's spill files."""
        plan = self.plan
        num_types = len(plan.type_names)
        sizes = np.array([len(p) for p in parts_of], dtype=np.int64)
        base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        flat_part = np.concatenate(parts_of) if num_types else np.zeros(0, np.int64)
        flat_offset = np.concatenate(offsets_of) if num_types else np.zeros(0, np.int64)
        unpartitioned = np.array([self.config.entities[n].num_partitions == 1 for n in plan.type_names])
        num_buckets = plan.parts_lhs * plan.parts_rhs
        bucket_dir = os.path.join(self.workdir, f"buckets_{file_index}")
        os.makedirs(bucket_dir, exist_ok=True)
        bucket_counts = np.zeros(num_buckets, dtype=np.int64)
        source_dir = os.path.join(self.workdir, f"spill_{file_index}")
        total = self.spilled[file_index]
        rng = np.random.default_rng(np.random.SeedSequence([self.options.seed & 0xFFFFFFFF, 7919, file_index]))
        item = np.dtype(_ID_DTYPE).itemsize

        def read(name: str, begin: int, end: int) -> np.ndarray:
            # np.fromfile rather than a memory map: the pages read do not linger in this process's RSS.
            path = os.path.join(source_dir, name)
            return np.fromfile(path, dtype=_ID_DTYPE, count=end - begin, offset=begin * item).astype(np.int64)

        for begin in range(0, total, _PASS2_CHUNK):
            end = min(total, begin + _PASS2_CHUNK)
            rel, lhs, rhs = read("rel", begin, end), read("lhs", begin, end), read("rhs", begin, end)
            if plan.dynamic:
                lhs_types = np.full(len(rel), plan.lhs_type[0])
                rhs_types = np.full(len(rel), plan.rhs_type[0])
            else:
                lhs_types = plan.lhs_type[rel]
                rhs_types = plan.rhs_type[rel]
            lhs_flat = base[lhs_types] + lhs
            rhs_flat = base[rhs_types] + rhs
            lhs_part, rhs_part = flat_part[lhs_flat], flat_part[rhs_flat]
            lhs_off, rhs_off = flat_offset[lhs_flat], flat_offset[rhs_flat]
            keep = (lhs_part >= 0) & (rhs_part >= 0)
            if rel_map is not None:
                rel = rel_map[rel]
                keep &= rel >= 0
            # Unpartitioned types may sit in any bucket of their side: spread their edges uniformly, as PBG expects.
            if plan.parts_lhs > 1 and unpartitioned.any():
                spread = unpartitioned[lhs_types]
                lhs_part[spread] = rng.integers(0, plan.parts_lhs, int(spread.sum()))
            if plan.parts_rhs > 1 and unpartitioned.any():
                spread = unpartitioned[rhs_types]
                rhs_part[spread] = rng.integers(0, plan.parts_rhs, int(spread.sum()))
            if not keep.all():
                self.summary.filtered_edges += int(len(keep) - np.count_nonzero(keep))
                rel, lhs_off, rhs_off, lhs_part, rhs_part = (a[keep] for a in (rel, lhs_off, rhs_off, lhs_part, rhs_part))
            bucket = lhs_part * plan.parts_rhs + rhs_part
            if num_buckets > 1:
                order = np.argsort(bucket.astype(np.uint16) if num_buckets <= 1 << 16 else bucket, kind="stable")
                rel, lhs_off, rhs_off = rel[order], lhs_off[order], rhs_off[order]
                counts = np.bincount(bucket, minlength=num_buckets)
            else:
                counts = np.array([len(rel)], dtype=np.int64)
            bounds = np.concatenate([[0], np.cumsum(counts)])
            for b in np.flatnonzero(counts):
                lo, hi = bounds[b], bounds[b + 1]
                for name, values in (("rel", rel), ("lhs", lhs_off), ("rhs", rhs_off)):
                    with open(os.path.join(bucket_dir, f"{b}.{name}"), "ab") as fh:
                        fh.write(values[lo:hi].astype(_ID_DTYPE).tobytes())
            bucket_counts += counts
        shutil.rmtree(source_dir, ignore_errors=True)
        return bucket_dir, bucket_counts

    # Writing ----------------------------------------------------------------------------------

    def _write_buckets(self, edge_path: str, bucket_dir: str, bucket_counts: np.ndarray, written: list[str]) -> None:
        from job.formats.checksums import EDGE_MANIFEST
        from job.formats.edges import edges_file, write_edge_manifest, write_edges

        storage.makedirs(edge_path)
        plan = self.plan
        entries: dict[str, tuple[int, str]] = {}
        for lhs_part in range(plan.parts_lhs):
            for rhs_part in range(plan.parts_rhs):
                b = lhs_part * plan.parts_rhs + rhs_part
                arrays = []
                for name in ("rel", "lhs", "rhs"):
                    path = os.path.join(bucket_dir, f"{b}.{name}")
                    # A memory map lets write_edges stream the (possibly huge) bucket without copying it into memory.
                    arrays.append(np.memmap(path, dtype=_ID_DTYPE, mode="r") if bucket_counts[b] else np.zeros(0, _ID_DTYPE))
                url = edges_file(edge_path, lhs_part, rhs_part)
                written.append(url)
                entries[url.rsplit("/", 1)[-1]] = write_edges(url, arrays[0], arrays[1], arrays[2])
                del arrays
                for name in ("rel", "lhs", "rhs"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(bucket_dir, f"{b}.{name}"))
                self.summary.edges_written += int(bucket_counts[b])
        # after every file it lists, so a manifest never names a file that is not there yet
        written.append(storage.join(edge_path, EDGE_MANIFEST))
        write_edge_manifest(edge_path, entries)

    def _write_entities(
        self, members: list[list[np.ndarray]], relation_names: list[str] | None, written: list[str],
        entity_path: str | None = None,
    ) -> None:
        from job.formats import entities as ent

        entity_path = entity_path or self.config.entity_path
        storage.makedirs(entity_path)
        # Names first and counts last: a count file is what marks a partition as present.
        for name, table, parts in zip(self.plan.type_names, self.tables, members):
            all_names = table.names() if table.size else None
            for part, ids in enumerate(parts):
                names = all_names.take(ids).to_pylist() if all_names is not None and len(ids) else []
                url = ent.names_file(entity_path, name, part)
                written.append(url)
                # The same JSON list write_entity_names produces, but through json's C encoder (no indent): 10x faster.
                storage.write_text(url, json.dumps(names))
        if relation_names is not None:
            written.append(ent.dynamic_rel_names_file(entity_path))
            ent.write_dynamic_rel_names(entity_path, relation_names)
        for name, parts in zip(self.plan.type_names, members):
            for part, ids in enumerate(parts):
                written.append(ent.count_file(entity_path, name, part))
                ent.write_entity_count(entity_path, name, part, len(ids))
        if relation_names is not None:
            written.append(ent.dynamic_rel_count_file(entity_path))
            ent.write_dynamic_rel_count(entity_path, len(relation_names))

    def _pass1(self, started: float) -> None:
        """Read every input file: dense ids per type, relation ids, integer edges spilled to the work directory."""
        for file_index, url in enumerate(self.files):
            spill_dir = os.path.join(self.workdir, f"spill_{file_index}")
            os.makedirs(spill_dir)
            self.spilled.append(0)
            logger.info("import: pass 1, reading %s", url)
            with contextlib.ExitStack() as stack:
                spill = {name: stack.enter_context(open(os.path.join(spill_dir, name), "wb")) for name in ("lhs", "rhs", "rel")}
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

    def run(self) -> ImportSummary:
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


@storage_scoped
def import_edges(config: ConfigSchema, files: list[str], options: ImportOptions) -> ImportSummary:
    """Import ``files`` (the i-th into ``config.edge_paths[i]``) and write ``config.entity_path``."""
    _check_request(config, files, options)
    workdir = tempfile.mkdtemp(prefix="biggraph-import-", dir=options.tmp_dir)
    try:
        summary = _Importer(config, files, options, workdir).run()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if summary.skipped_rows:
        logger.warning(
            "import: skipped %s bad rows (%s malformed, %s with an empty id, %s with an unknown relation)",
            f"{summary.skipped_rows:,}",
            f"{summary.malformed_rows:,}",
            f"{summary.empty_id_rows:,}",
            f"{summary.unknown_relation_rows:,}",
        )
    logger.info("import: %s", summary.describe())
    return summary
