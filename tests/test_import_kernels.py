"""The importer's Arrow kernels, called from pyarrow's registry (job.data.importing.kernels), give what the
array methods and ``pyarrow.compute`` give: the importer's output depends on it byte for byte."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from job.data.importing import kernels

NAMES = pa.array(["b", "a", None, "ccc", "", "a", "dddddddddd"])


def test_take_and_the_numeric_arrays_match_the_methods() -> None:
    rows = np.array([6, 0, 3, 3, 1])
    assert kernels.take(NAMES, rows).equals(NAMES.take(pa.array(rows)))
    chunked = pa.chunked_array([NAMES.slice(0, 3), NAMES.slice(3)])
    assert kernels.take(chunked, rows).equals(chunked.take(pa.array(rows)))
    with pytest.raises(IndexError):
        kernels.take(NAMES, np.array([7]))  # bounds checked, as the method is
    strided = np.arange(10, dtype=np.int64)[::2]  # not contiguous: copied, not misread
    assert kernels.numeric_array(strided, np.int64).to_pylist() == [0, 2, 4, 6, 8]
    hashes = np.array([2**64 - 1, 0, 5], dtype=np.uint64)
    assert kernels.numeric_array(hashes, np.uint64).equals(pa.array(hashes, pa.uint64()))


def test_the_string_kernels_match_pyarrow_compute() -> None:
    assert kernels.fill_null(NAMES, "").equals(NAMES.fill_null(""))
    assert kernels.cast(NAMES, pa.large_string()).equals(NAMES.cast(pa.large_string()))
    large = NAMES.cast(pa.large_string())
    assert kernels.cast(large, pa.large_string()) is large
    assert kernels.cast(pa.array([1, 22]), pa.string()).equals(pc.cast(pa.array([1, 22]), pa.string()))
    filled = NAMES.fill_null("")
    assert kernels.ascii_rpad(filled, 8, "\x00").equals(pc.ascii_rpad(filled, width=8, padding="\x00"))
    assert kernels.dictionary_encode(NAMES).equals(pc.dictionary_encode(NAMES))
    assert kernels.sort_indices(NAMES).equals(pc.sort_indices(NAMES))
    assert kernels.equal(NAMES, NAMES.take(pa.array([1, 1, 2, 3, 4, 5, 6]))).equals(
        pc.equal(NAMES, NAMES.take(pa.array([1, 1, 2, 3, 4, 5, 6]))))


@pytest.mark.parametrize("values", [[], [3], [5, 1, 5, 0, 1, 9], [2**40, 8, 8, 16]])
def test_distinct_is_numpy_unique(values: list[int]) -> None:
    array = np.array(values, dtype=np.int64)
    assert np.array_equal(kernels.distinct(array), np.unique(array))
