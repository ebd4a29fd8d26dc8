"""The 64-bit id hash, computed with numpy over a whole arrow string column.

Ids are deduplicated by a hash of their UTF-8 bytes rather than by Python strings: no Python
object is created per edge (PBG builds a ``str`` and a tensor per edge, which is why it manages
~69k edges/s). Two distinct ids sharing a hash would be merged; with n entities per type that
happens with probability about n^2 / 2^65 (3e-8 at a million). Ids of at most 7 bytes are
hashed exactly (no two share a key).

pyarrow is imported inside the functions (here and in the other importing modules): it costs
~0.3 s, and ``biggraph --help`` imports this package to build its parser.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from job.data.importing import kernels

if TYPE_CHECKING:
    import pyarrow as pa

_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_LENGTH_MULT = np.uint64(0x9E3779B97F4A7C15)
_FAST_WIDTH = 32  # ids up to this many bytes are padded by pyarrow in one C++ call (the common case)


def _string_buffers(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Zero-copy (offsets rebased to 0, bytes) views of a string/large_string array without nulls."""
    import pyarrow as pa  # ~0.3 s: kept off the start-up (module docstring)

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

    Fast path: pad every id to the same number of bytes with pyarrow's ``ascii_rpad`` (one C++ call; it pads
    bytes, so any UTF-8 id gets the zero bytes the numpy path gives it), then view the bytes as a (rows, words)
    uint64 matrix without copying. Long ids take the numpy path, grouping rows by padded width so memory stays
    ~2x the bytes.
    """
    offsets, data = _string_buffers(array)
    lengths = np.diff(offsets)
    n = len(lengths)
    if n == 0:
        return np.zeros(0, dtype=np.uint64), lengths
    longest = int(lengths.max())
    width = max(8, (longest + 7) // 8 * 8)
    if width <= _FAST_WIDTH:
        padded = kernels.ascii_rpad(array, width=width, padding="\x00")
        padded_offsets, padded_data = _string_buffers(padded)
        if padded_data.size == n * width:  # every id was padded to exactly `width` bytes
            return _hash_words(padded_data.view(np.uint64).reshape(n, width // 8), lengths), lengths
    hashes = np.empty(n, dtype=np.uint64)
    widths = np.maximum(8, 1 << np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64))
    for group_width in kernels.distinct(widths):
        rows = np.flatnonzero(widths == group_width)
        if len(rows) == n:
            group_offsets, group_data = offsets, data
        else:
            group_offsets, group_data = _string_buffers(kernels.take(array, rows))
        hashes[rows] = _hash_words(_padded_words(group_offsets, group_data, int(group_width)), lengths[rows])
    return hashes, lengths



_PART_SALT = np.uint64(0x632BE59BD9B4E019)


def partition_of(hashes: np.ndarray, num_parts: int, seed: int = 0) -> np.ndarray:
    """The partition of each entity, from its id hash alone (``--seed`` salts it).

    A pure function of the name, so every pod places an entity in the same partition without
    any shared dictionary. The hash is mixed again first: ids of at most 7 bytes are their raw
    bytes, whose low bits (the first characters) are far from uniform.
    """
    if num_parts <= 1:
        return np.zeros(len(hashes), dtype=np.int64)
    salt = _mix(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64) ^ _PART_SALT)[0]
    return (_mix(hashes ^ salt) % np.uint64(num_parts)).astype(np.int64)


def spread_of(lhs_hashes: np.ndarray, rhs_hashes: np.ndarray, num_parts: int) -> np.ndarray:
    """The bucket side of edges whose entity type has one partition: spread over ``num_parts``, as PBG
    expects, by a hash of the edge's two ids (not a random draw, so any pod computes the same)."""
    if num_parts <= 1:
        return np.zeros(len(lhs_hashes), dtype=np.int64)
    mixed = _mix(_mix(lhs_hashes ^ _PART_SALT) ^ rhs_hashes)
    return (mixed % np.uint64(num_parts)).astype(np.int64)
