"""NDArray members (schema/ndarray.fbs): encoding with 64-byte aligned data, zero-copy decoding, int8 rows.

int8 quantisation is symmetric and per row of the last axis: ``scale = max|x| / 127`` and
``q = round(x / scale)``, so every row keeps its own range (embedding norms vary a lot
between entities) and dequantisation is ``q * scale``; the error of one element is at most
``scale / 2``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import flatbuffers
import numpy as np

from job.archive.errors import ArchiveFormatError
from job.archive.fb import NDArray as fb_ndarray
from job.archive.fb.DType import DType

IDENTIFIER = b"BGND"
DATA_ALIGNMENT = 64
MAX_FLATBUFFER_BYTES = 2**31 - 1 - 4096

# storage names used on the command line / in graph.fb, and the numpy dtype of each code
STORAGE_DTYPES = {"fp32": DType.FLOAT32, "fp16": DType.FLOAT16, "int8": DType.INT8}
NUMPY_OF: dict[int, np.dtype] = {
    DType.FLOAT32: np.dtype("<f4"),
    DType.FLOAT16: np.dtype("<f2"),
    DType.INT8: np.dtype("i1"),
    DType.FLOAT64: np.dtype("<f8"),
    DType.INT32: np.dtype("<i4"),
    DType.INT64: np.dtype("<i8"),
}
DTYPE_NAMES = {
    DType.FLOAT32: "float32", DType.FLOAT16: "float16", DType.INT8: "int8",
    DType.FLOAT64: "float64", DType.INT32: "int32", DType.INT64: "int64",
}


def dtype_code_of(array: np.ndarray) -> int:
    for code, dtype in NUMPY_OF.items():
        if array.dtype == dtype or array.dtype == dtype.newbyteorder("="):
            return code
    raise TypeError(f"no NDArray dtype for numpy {array.dtype}")


def quantize_int8(array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row int8: (q, scales) with ``array ~= q * scales[..., None]``."""
    x = np.asarray(array, dtype=np.float32)
    if x.ndim == 0:
        x = x.reshape(1)
    rows = x.reshape(-1, x.shape[-1]) if x.size else x.reshape(-1, max(1, x.shape[-1]))
    peak = np.abs(rows).max(axis=1) if rows.shape[1] else np.zeros(rows.shape[0], np.float32)
    scales = (peak / 127.0).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1.0))
    q = np.clip(np.rint(rows / safe[:, None]), -127, 127).astype(np.int8)
    return q.reshape(x.shape), scales


def encode(array: np.ndarray, storage: str = "fp32", name: str = "array") -> bytes:
    """One NDArray FlatBuffer holding ``array`` converted to ``storage`` (fp32, fp16, int8 or the array's own dtype)."""
    array = np.asarray(array)
    scales: Optional[np.ndarray] = None
    if storage == "fp32":
        stored = np.ascontiguousarray(array, dtype="<f4")
    elif storage == "fp16":
        stored = np.ascontiguousarray(array, dtype="<f2")
    elif storage == "int8":
        stored, scales = quantize_int8(array)
    elif storage == "native":
        stored = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    else:
        raise ValueError(f"unknown storage dtype {storage}")
    code = dtype_code_of(stored)
    payload = stored.reshape(-1).view(np.uint8)
    total = payload.nbytes + (scales.nbytes if scales is not None else 0) + 8 * array.ndim + 1024
    if total > MAX_FLATBUFFER_BYTES:
        raise ValueError(f"{name}: {payload.nbytes} bytes is over the 2 GiB limit of one FlatBuffer "
                         "(use more partitions so that each table is smaller)")
    builder = flatbuffers.Builder(total)
    scales_off = builder.CreateNumpyVector(np.ascontiguousarray(scales, dtype="<f4")) if scales is not None else None
    shape_off = builder.CreateNumpyVector(np.asarray(array.shape, dtype="<i8"))
    # the data vector by hand, to align its first byte to DATA_ALIGNMENT (flatc's Python code ignores force_align)
    size = payload.nbytes
    builder.StartVector(1, size, DATA_ALIGNMENT)
    builder.head = builder.head - size
    builder.Bytes[builder.head:builder.head + size] = payload.tobytes()
    builder.vectorNumElems = size
    data_off = builder.EndVector()
    fb_ndarray.Start(builder)
    fb_ndarray.AddShape(builder, shape_off)
    fb_ndarray.AddDtype(builder, code)
    fb_ndarray.AddData(builder, data_off)
    if scales_off is not None:
        fb_ndarray.AddScales(builder, scales_off)
    builder.Finish(fb_ndarray.End(builder), file_identifier=IDENTIFIER)
    return bytes(builder.Output())


@dataclass
class Decoded:
    """A stored array as it lies in the member (a read-only view) and, for int8, its row scales."""

    stored: np.ndarray
    dtype: int
    scales: Optional[np.ndarray]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stored.shape)

    def to_float32(self) -> np.ndarray:
        """float32 values: the stored view itself for FLOAT32 (no copy), a decoded copy otherwise."""
        if self.dtype == DType.FLOAT32:
            return self.stored
        if self.dtype == DType.INT8:
            assert self.scales is not None
            if self.stored.ndim == 0:
                return (self.stored.astype(np.float32) * self.scales[0]).astype(np.float32)
            return self.stored.astype(np.float32) * self.scales.reshape(self.stored.shape[:-1] + (1,))
        return self.stored.astype(np.float32)


def decode(buf: memoryview, archive: str, member: str) -> Decoded:
    """Read an NDArray member without copying its data; every inconsistency is an ArchiveFormatError naming it."""
    if len(buf) < 8 or not flatbuffers.util.BufferHasIdentifier(buf, 0, IDENTIFIER):
        raise ArchiveFormatError(archive, "not an NDArray FlatBuffer (file identifier BGND missing)", member)
    try:
        table = fb_ndarray.NDArray.GetRootAs(buf, 0)
        shape = tuple(int(s) for s in table.ShapeAsNumpy()) if not table.ShapeIsNone() else ()
        code = table.Dtype()
        data = table.DataAsNumpy() if not table.DataIsNone() else np.zeros(0, np.uint8)
        scales = table.ScalesAsNumpy() if not table.ScalesIsNone() else None
    except Exception as err:  # any failure to walk the buffer means the same thing
        raise ArchiveFormatError(archive, f"malformed NDArray FlatBuffer ({type(err).__name__}: {err})", member) from None
    if code not in NUMPY_OF:
        raise ArchiveFormatError(archive, f"unknown dtype code {code}", member)
    if any(s < 0 for s in shape):
        raise ArchiveFormatError(archive, f"negative dimension in shape {shape}", member)
    dtype = NUMPY_OF[code]
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if isinstance(data, int) or data.nbytes != count * dtype.itemsize:
        have = 0 if isinstance(data, int) else data.nbytes
        raise ArchiveFormatError(
            archive, f"holds {have} data bytes but shape {shape} of {DTYPE_NAMES[code]} needs {count * dtype.itemsize}",
            member,
        )
    stored = data.view(dtype).reshape(shape)
    if code == DType.INT8:
        rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        if scales is None or isinstance(scales, int) or scales.size != rows:
            got = 0 if scales is None or isinstance(scales, int) else scales.size
            raise ArchiveFormatError(archive, f"int8 array of shape {shape} has {got} scales, expected {rows}", member)
        if len(shape) > 1:
            scales = scales.reshape(shape[:-1])
    else:
        scales = None
    return Decoded(stored, code, scales)
