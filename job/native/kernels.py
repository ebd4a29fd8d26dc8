"""Typed calls into the native kernels (``rowkernels.c``, ``losskernels.c``, ``operatorkernels.c``), each answering
whether it ran.

A call that returns False (``row_adagrad``) or None (the others, which otherwise return their results) did
nothing: the kernels are unavailable (``job.native.library``), or the tensors are not what the kernel takes (not
on the CPU, not float32/float64 alike, not contiguous, another loss), and the caller runs its torch form
instead.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from job.native import library

# each kernel is built for these dtypes, its symbol's name ending in the suffix (row_adagrad_f32, ...)
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_SIDE_LOSSES = {"softmax": 0, "ranking": 1}  # losskernels.c's LOSS_* codes


def _fits(t: Tensor, dtype: torch.dtype) -> bool:
    return t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()


def _address(t: Optional[Tensor]) -> ctypes.c_void_p:
    """A tensor's data as a C pointer argument (NULL for None)."""
    return ctypes.c_void_p(None if t is None else t.data_ptr())


def row_adagrad(weight: Tensor, state: Tensor, lists: Sequence[tuple[Tensor, Tensor]], lr: float, eps: float,
                slots: Tensor) -> bool:
    """PBG's row-wise Adagrad for (ids, gradient rows) lists of one table, rows repeating or not; per-coordinate
    Adagrad when ``state`` has the table's shape (one sum per coordinate, ``entity_optimizer: adagrad``).

    Each distinct row gets one step with its summed gradient: state[row] += mean(g^2), then
    weight[row] -= lr * g / (sqrt(state[row]) + eps) (per coordinate: state[row, j] += g[j]^2 and each coordinate
    its own step size). The gradients are consumed (overwritten). ``slots``:
    an int32 scratch array of at least ``weight.shape[0]`` entries (``job.train.batch.rowops.scratch``).
    Raises IndexError when an id is outside the table (nothing written).
    """
    suffix = _SUFFIX.get(weight.dtype)
    if suffix is None:
        return False
    lib = library()
    if lib is None or weight.dim() != 2 or not _fits(weight, weight.dtype) or not _fits(state, weight.dtype):
        return False
    full = state.shape == weight.shape
    if not (full or state.shape == (weight.shape[0],)) or slots.dtype != torch.int32 or slots.numel() < weight.shape[0]:
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
    status = getattr(lib, f"{'full' if full else 'row'}_adagrad_{suffix}")(
        ctypes.c_int32(count), id_ptrs, grad_ptrs, counts, ctypes.c_int64(dim), _address(weight), _address(state),
        ctypes.c_int64(weight.shape[0]), _address(slots),
        ctypes.c_double(lr), ctypes.c_double(eps))
    if status != 0:
        ids = lists[-1 - status][0]
        bad = ids[(ids < 0) | (ids >= weight.shape[0])]
        raise IndexError(f"row id {int(bad[0])} is outside the table of {weight.shape[0]} rows")
    return True


@dataclass
class SideLoss:
    """What ``side_loss`` computed: the loss and violators as numbers, the positives' scores and gradients."""

    loss: float
    violators: float
    pos: Tensor  # (padded,)
    d_pos: Tensor  # (padded,)


def side_loss(kind: str, margin: float, batch: Optional[Tensor], uniform: Optional[Tensor], pos: Optional[Tensor],
              num_pos: int) -> Optional[SideLoss]:
    """PBG's ``softmax`` or ``ranking`` loss of one side's score blocks, and its gradient, in one pass per row.

    ``batch`` (chunks x chunk x chunk): the anchors against their chunk's positives, each positive's own score
    on the diagonal; ``uniform`` (padded x N): against the uniform negatives; ``pos`` (padded,): the positives'
    scores when there is no ``batch``. Rows past ``num_pos`` are padding. The blocks are overwritten with the
    gradients of the loss, as ``job.model.fused_losses.blockwise_loss`` leaves them, and the batch block's
    diagonal with the positives' (where ``blockwise_loss`` leaves 0 for the caller to fill). None: nothing ran
    (another loss, dtype or layout, or no kernels), the caller's torch form runs.
    """
    code = _SIDE_LOSSES.get(kind)
    given = [t for t in (batch, uniform, pos) if t is not None]
    if code is None or not given:
        return None
    dtype = given[0].dtype
    if dtype not in _SUFFIX or not all(_fits(t, dtype) for t in given):
        return None
    if batch is not None:
        if batch.dim() != 3 or batch.shape[1] != batch.shape[2]:
            return None
        chunk, padded = batch.shape[1], batch.shape[0] * batch.shape[1]
    elif pos is not None and pos.dim() == 1:
        chunk, padded = 1, pos.shape[0]
    else:
        return None
    if (uniform is not None and (uniform.dim() != 2 or uniform.shape[0] != padded)) or not 0 < num_pos <= padded:
        return None
    lib = library()
    if lib is None:
        return None
    pos_out = torch.empty(padded, dtype=dtype)
    d_pos = torch.empty(padded, dtype=dtype)
    sums = (ctypes.c_double * 2)()
    status = getattr(lib, f"side_loss_{_SUFFIX[dtype]}")(
        ctypes.c_int32(code), ctypes.c_double(margin), _address(batch), ctypes.c_int64(chunk), _address(uniform),
        ctypes.c_int64(0 if uniform is None else uniform.shape[1]), _address(pos if batch is None else None),
        _address(pos_out), _address(d_pos), ctypes.c_int64(padded), ctypes.c_int64(num_pos), sums)
    if status != 0:
        raise ValueError(f"side_loss: the native kernel does not compute the {kind!r} loss")
    return SideLoss(sums[0], sums[1], pos_out, d_pos)


def _complex_layout(x: Tensor, real: Tensor, imag: Tensor) -> Optional[tuple[bool, int, int]]:
    """(per row, rows, half) when the kernels take these tensors, else None."""
    dtype = x.dtype
    if dtype not in _SUFFIX or not all(_fits(t, dtype) for t in (x, real, imag)) or real.shape != imag.shape:
        return None
    half = x.shape[-1] // 2
    if x.dim() < 1 or x.shape[-1] != 2 * half or real.shape[-1] != half:
        return None
    rows = x.numel() // max(2 * half, 1)
    if real.dim() == 1:
        return False, rows, half
    if tuple(real.shape) == tuple(x.shape[:-1]) + (half,):
        return True, rows, half
    return None


def complex_diagonal(x: Tensor, real: Tensor, imag: Tensor, conjugate: bool) -> Optional[Tensor]:
    """Rows ``x`` ([real | imag] halves) times (real + i imag), or its conjugate; None when not run."""
    layout = _complex_layout(x, real, imag)
    lib = library() if layout is not None else None
    if layout is None or lib is None:
        return None
    per_row, rows, half = layout
    out = torch.empty_like(x)
    getattr(lib, f"complex_diagonal_forward_{_SUFFIX[x.dtype]}")(
        _address(x), _address(real), _address(imag), ctypes.c_int32(per_row), ctypes.c_int32(conjugate),
        ctypes.c_int64(rows), ctypes.c_int64(half), _address(out))
    return out


def complex_diagonal_backward(x: Tensor, real: Tensor, imag: Tensor, grad: Tensor,
                              conjugate: bool) -> Optional[tuple[Tensor, Tensor, Tensor]]:
    """(d x, d real, d imag) of ``complex_diagonal`` given the output's gradient; the parameters' summed over the
    rows when they are one pair for all (static). None when not run."""
    layout = _complex_layout(x, real, imag)
    lib = library() if layout is not None else None
    if layout is None or lib is None or not _fits(grad, x.dtype) or grad.shape != x.shape:
        return None
    per_row, rows, half = layout
    d_x, d_real, d_imag = torch.empty_like(x), torch.empty_like(real), torch.empty_like(imag)
    status = getattr(lib, f"complex_diagonal_backward_{_SUFFIX[x.dtype]}")(
        _address(x), _address(real), _address(imag), _address(grad), ctypes.c_int32(per_row),
        ctypes.c_int32(conjugate), ctypes.c_int64(rows), ctypes.c_int64(half), _address(d_x), _address(d_real),
        _address(d_imag))
    if status != 0:
        raise MemoryError("complex_diagonal_backward: no memory for the parameters' sums")
    return d_x, d_real, d_imag
