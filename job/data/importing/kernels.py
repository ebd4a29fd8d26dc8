"""The few Arrow compute kernels the importer runs, called by name from the kernel registry.

``pyarrow.compute`` builds a documented Python wrapper for each of its ~300 kernels when it is imported
(~25 ms of CPU here, with pydoc and its docstring parser), and array methods such as ``take`` and ``cast``
import it on first use; ``pa.array`` of a numpy array also imports ``numpy.ma`` (~8 ms) to check for a
masked array. Every import process pays both once, so every pod added pays them again: on the 20M-edge
bench, 4 pods paid them 4 times against once for one process (issue #46, bench/RESULTS.md). The registry's
own entry point (``call_function``, what every wrapper calls) and the option classes come from pyarrow's
compiled ``_compute`` module without the wrappers; numpy integer arrays are handed over as Arrow arrays
sharing their memory. Same kernels, same options, so the same results byte for byte.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa


def _registry() -> Any:
    """pyarrow's compiled compute module (``call_function`` and the option classes), or, should a pyarrow
    release move it, the public module that re-exports the same names."""
    try:
        import pyarrow._compute as compute  # ~5 ms: the registry without ~300 generated wrappers
    except ImportError:  # pragma: no cover - every pyarrow since 1.0 has it
        import pyarrow.compute as compute
    return compute


def numeric_array(values: np.ndarray, dtype: type) -> pa.Array:
    """An Arrow array of ``dtype`` over ``values``' memory (copied only if not already contiguous of that type)."""
    import pyarrow as pa  # ~0.3 s: kept off the start-up (see job.data.importing.hashing)

    values = np.ascontiguousarray(values, dtype=dtype)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def take(array: pa.Array | pa.ChunkedArray, indices: np.ndarray) -> Any:
    """``array.take(indices)`` (bounds checked, as the method does)."""
    compute = _registry()
    return compute.call_function("take", [array, numeric_array(indices, np.int64)], compute.TakeOptions(boundscheck=True))


def cast(array: pa.Array, target: pa.DataType) -> pa.Array:
    """``array.cast(target)`` (a safe cast, as the method's default); ``array`` itself when already of that type."""
    if array.type == target:
        return array
    compute = _registry()
    return compute.call_function("cast", [array], compute.CastOptions.safe(target))


def fill_null(array: pa.Array, value: str) -> pa.Array:
    """``array.fill_null(value)`` for a string array."""
    import pyarrow as pa  # ~0.3 s: kept off the start-up (see job.data.importing.hashing)

    return _registry().call_function("coalesce", [array, pa.scalar(value, array.type)])


def ascii_rpad(array: pa.Array, width: int, padding: str) -> pa.Array:
    """Each string padded with the one-byte ``padding`` to ``width`` bytes (``pyarrow.compute.ascii_rpad``).

    It counts bytes, not characters, whatever the bytes are, which is what the id hash wants. It also sizes its
    output to the bytes it can produce, where ``utf8_rpad`` first reserves four bytes a padding character (a
    batch's ~7 MiB of padded ids asked ~30 MiB of the heap twice a batch, pages every import process then
    faulted in: issue #46)."""
    compute = _registry()
    return compute.call_function("ascii_rpad", [array], compute.PadOptions(width=width, padding=padding))


def dictionary_encode(array: pa.Array) -> pa.Array:
    return _registry().call_function("dictionary_encode", [array])


def sort_indices(array: pa.Array) -> pa.Array:
    """Ascending, nulls last: ``pyarrow.compute.sort_indices``' defaults."""
    return _registry().call_function("sort_indices", [array])


def equal(left: pa.Array, right: pa.Array) -> pa.Array:
    return _registry().call_function("equal", [left, right])


def distinct(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` (sorted, each value once) for the importer's small integer arrays: numpy's own asks
    ``np.ma`` whether the array is masked, which imports ``numpy.ma`` (the module docstring)."""
    ordered = np.sort(values, kind="stable")
    if not len(ordered):
        return ordered
    keep = np.empty(len(ordered), dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]
