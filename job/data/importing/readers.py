"""Streaming the input files (TSV, CSV, Parquet; local or remote, compressed or not) as arrow batches.

The input can be far larger than memory, so each file is read in bounded chunks by pyarrow's
C++ readers; pyarrow reports no line numbers, so after an error the file is rescanned with
Python's csv module (``Source.locate``) to tell the user where to look. pyarrow is imported
inside the functions: see ``job.data.importing.hashing``.
"""

from __future__ import annotations

import contextlib
import csv
import io
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import storage_adapters as storage
from job.data.importing import kernels
from job.data.importing.options import ImportOptions
from job.errors import InputFormatError, UserError

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger("biggraph")

COMPRESSED_SUFFIXES = (".gz", ".bz2", ".zst", ".lz4", ".xz")


def detect_format(url: str, requested: str) -> str:
    if requested != "auto":
        return requested
    lower = url.lower()
    for suffix in COMPRESSED_SUFFIXES:
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
class Batch:
    """One chunk of rows as arrow string arrays (rel is None without --rel-col)."""

    lhs: pa.Array
    rhs: pa.Array
    rel: pa.Array | None
    malformed: int  # rows the parser dropped from this batch for a wrong column count


class Source:
    """One input file streamed as batches of the three columns we need."""

    def __init__(self, url: str, options: ImportOptions, byte_range: tuple[int, int] | None = None) -> None:
        self.url = url
        self.options = options
        self.byte_range = byte_range  # a shard of the file (``job.data.importing.shards``); None: all of it
        self.format = detect_format(url, options.input_format)
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
        import fsspec  # as in storage_adapters: only for remote URLs (a local import never loads it)

        return fsspec.open(self.url, "rb", compression="infer", **storage.storage_options_for(self.url)).open()

    def batches(self) -> Iterator[Batch]:
        if self.format == "parquet":
            yield from self._parquet_batches()
        else:
            yield from self._text_batches()

    def _parquet_batches(self) -> Iterator[Batch]:
        import pyarrow as pa  # ~0.3 s: kept off the start-up (see job.data.importing.hashing)
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
            yield Batch(arrays[0], arrays[1], arrays[2] if len(arrays) > 2 else None, 0)

    def _on_invalid_row(self, row: Any) -> str:
        self._malformed += 1
        if self.first_malformed is None:
            self.first_malformed = str(row.text)
        return "skip"

    def _text_input(self, whole: bool = False) -> Any:
        """What pyarrow reads: the file (``whole``) or this shard of it, or (``_terminate``) its decompressed bytes
        plus a final newline."""
        if self.byte_range is not None and not whole:
            from job.data.importing.shards import open_range  # shards imports this module

            return open_range(self.url, self.byte_range)
        source = self._open_binary()
        if not self._terminate:
            return source
        if isinstance(source, str):
            import pyarrow as pa  # ~0.3 s: kept off the start-up (see job.data.importing.hashing)

            source = pa.input_stream(source, compression="detect")
        return io.BufferedReader(_NewlineTerminated(source))

    def _text_reader(self, block_size: int, num_columns: int | None) -> Any:
        """The file's first rows (``num_columns`` None: to learn the column count), or this shard's rows as
        ``num_columns`` columns: a shard's own first row does not decide the count (it may be a bad row)."""
        import pyarrow as pa  # ~0.3 s: kept off the start-up (see job.data.importing.hashing)
        import pyarrow.csv as pacsv

        at_start = self.byte_range is None or self.byte_range[0] == 0 or num_columns is None
        skip = 1 if self.options.header and at_start else 0
        if num_columns is None:
            read = pacsv.ReadOptions(autogenerate_column_names=True, block_size=block_size, skip_rows=skip)
        else:
            read = pacsv.ReadOptions(column_names=[f"f{c}" for c in range(num_columns)], block_size=block_size,
                                     skip_rows=skip)
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
        return pacsv.open_csv(self._text_input(whole=num_columns is None), read_options=read, parse_options=parse,
                              convert_options=convert)

    def _text_batches(self) -> Iterator[Batch]:
        import pyarrow as pa  # ~0.3 s: kept off the start-up (see job.data.importing.hashing)

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
            num_columns = len(peek.schema)
            # Closed now rather than when this generator ends: the peek reader holds the blocks it parsed and
            # read ahead (~25 MiB at the first batch of a 20M-edge bench pod) while every batch of the file is
            # encoded, pages that each import process faults in (issue #46, bench/RESULTS.md).
            peek.close()
            del peek
            self._check_columns(num_columns)
            self._malformed = 0
            self.first_malformed = None
            if self._empty_range():
                return
            reader = self._text_reader(self.options.block_size, num_columns)
            names = [f"f{c}" for c in self.columns]
            while True:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    return
                malformed, self._malformed = self._malformed, 0
                arrays = [batch.column(name) for name in names]
                yield Batch(arrays[0], arrays[1], arrays[2] if len(arrays) > 2 else None, malformed)
        except (pa.ArrowInvalid, UnicodeDecodeError) as err:
            text = str(err).replace("\n", " ")
            raise InputFormatError(self.url, f"cannot be parsed ({text})", expected=f"a {self.format.upper()} file") from None

    def _empty_range(self) -> bool:
        """A byte range in which no line starts (pyarrow would call it an empty file)."""
        if self.byte_range is None:
            return False
        from job.data.importing.shards import RangeReader  # shards imports this module

        reader = RangeReader(self.url, self.byte_range)
        try:
            return reader.empty
        finally:
            reader.close()

    def locate(self, is_bad: Callable[[list[str]], str | None]) -> tuple[int, str] | None:
        """The 1-based line and problem of the first row ``is_bad`` rejects (slow path, only after an error).

        pyarrow does not report line numbers, so on error the file is rescanned with
        Python's csv module, applying the same rules, to tell the user where to look.
        """
        if self.format == "parquet":
            return None
        raw = self._open_binary()
        if isinstance(raw, str):
            import pyarrow as pa  # ~0.3 s: kept off the start-up (see job.data.importing.hashing)

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
    import pyarrow as pa  # ~0.3 s: kept off the start-up (see job.data.importing.hashing)

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        column = kernels.cast(column, pa.string())
    return column

