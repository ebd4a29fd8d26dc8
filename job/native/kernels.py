"""Typed calls into the native row kernels (``rowkernels.c``), each answering whether it ran.

A call that returns False did nothing: the kernels are unavailable (``job.native.library``), or the tensors
are not what the kernel takes (not on the CPU, not float32/float64 alike, not contiguous), and the caller
runs its torch form instead.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import Tensor

from job.native import library

_KERNELS = {torch.float32: "row_adagrad_f32", torch.float64: "row_adagrad_f64"}


def _fits(t: Tensor, dtype: torch.dtype) -> bool:
    return t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()


def row_adagrad(weight: Tensor, state: Tensor, lists: Sequence[tuple[Tensor, Tensor]], lr: float, eps: float,
                slots: Tensor) -> bool:
    """PBG's row-wise Adagrad for (ids, gradient rows) lists of one table, rows repeating or not.

    Each distinct row gets one step with its summed gradient: state[row] += mean(g^2), then
    weight[row] -= lr * g / (sqrt(state[row]) + eps). The gradients are consumed (overwritten). ``slots``:
    an int32 scratch array of at least ``weight.shape[0]`` entries (``job.train.rowops.scratch``).
    Raises IndexError when an id is outside the table (nothing written).
    """
    kernel = _KERNELS.get(weight.dtype)
    if kernel is None:
        return False
    lib = library()
    if lib is None or weight.dim() != 2 or not _fits(weight, weight.dtype) or not _fits(state, weight.dtype):
        return False
    if state.shape != (weight.shape[0],) or slots.dtype != torch.int32 or slots.numel() < weight.shape[0]:
        return False
    dim = weight.shape[1]
    for ids, grad in lists:
        if not _fits(ids, torch.int64) or not _fits(grad, weight.dtype) or grad.shape != (ids.numel(), dim):
            return False
    total = sum(ids.numel() for ids, _ in lists)
    if total >= 2**31:
        return False
    count = len(lists)
    id_ptrs = (ctypes.c_void_p * count)(*(ids.data_ptr() for ids, _ in lists))
    grad_ptrs = (ctypes.c_void_p * count)(*(grad.data_ptr() for _, grad in lists))
    counts = (ctypes.c_int64 * count)(*(ids.numel() for ids, _ in lists))
    status = getattr(lib, kernel)(
        ctypes.c_int32(count), id_ptrs, grad_ptrs, counts, ctypes.c_int64(dim), ctypes.c_void_p(weight.data_ptr()),
        ctypes.c_void_p(state.data_ptr()), ctypes.c_int64(weight.shape[0]), ctypes.c_void_p(slots.data_ptr()),
        ctypes.c_double(lr), ctypes.c_double(eps))
    if status != 0:
        ids = lists[-1 - status][0]
        bad = ids[(ids < 0) | (ids >= weight.shape[0])]
        raise IndexError(f"row id {int(bad[0])} is outside the table of {weight.shape[0]} rows")
    return True
