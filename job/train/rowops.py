"""Row bookkeeping of a batch: unique rows without sorting, shared rows of two sides, cached scratch arrays.

Per-thread caches (``scratch``, ``positions``) keep the batch code from allocating every batch; a
captured CUDA graph keeps them alive through ``cached_tensors``.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch
from torch import Tensor

from job.model.scoring import _MASK_CACHE


def unique_inverse(ids: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """``torch.unique(ids, return_inverse=True)`` without sorting (the rows come out in no particular order).

    Small partitions (knowledge graphs with a few thousand entities) are touched by many more ids per
    batch than they have rows: a presence bitmap finds them. Large ones are touched by few: each id
    writes its position into a per-process scratch array indexed by id, the position that survives is
    the id's representative, and every step is linear in the batch, where sorting was the slowest
    part of deduplicating (a sort of 2,000 int64 on this CPU costs as much as gathering 2,000 rows).
    """
    if count <= 8 * ids.numel():
        present = torch.zeros(count, dtype=torch.bool, device=ids.device)
        present[ids] = True
        uniq = torch.nonzero(present).flatten()
        position = torch.cumsum(present, 0) - 1
        return uniq, position[ids]
    slots = scratch(count, ids.device)
    positions = torch.arange(ids.numel(), dtype=torch.int32, device=ids.device)
    slots.scatter_(0, ids, positions)
    representative = slots.index_select(0, ids)  # never stale: every id was just written
    first = representative == positions
    uniq = ids[first]
    new_position = torch.cumsum(first, 0) - 1
    return uniq, new_position.index_select(0, representative.long())


def overlap(first: Tensor, second: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """Positions (in ``first``, in ``second``) of the ids two duplicate-free id lists share."""
    slots = scratch(count, first.device)
    slots.scatter_(0, first, torch.arange(first.numel(), dtype=torch.int32, device=first.device))
    # a slot not written by this call holds garbage; it is only believed where it points back at the id
    candidate = slots.index_select(0, second).long().clamp_(0, max(first.numel() - 1, 0))
    in_second = torch.nonzero(first.index_select(0, candidate) == second).flatten()
    return candidate.index_select(0, in_second), in_second


_SCRATCH: dict[tuple[str, int], Tensor] = {}


def scratch(count: int, device: torch.device) -> Tensor:
    """A reusable id -> int32 array of at least ``count`` entries, one per thread and device (a batch and an
    evaluation may run in different threads); its contents are never read before written."""
    key = (str(device), threading.get_ident())
    slots = _SCRATCH.get(key)
    if slots is None or slots.shape[0] < count:
        slots = torch.empty(count, dtype=torch.int32, device=device)
        _SCRATCH[key] = slots
    return slots[:count]


def every_occurrence(ids: Tensor, neg: Optional[Tensor]) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """A side's rows without deduplication: (ids, positives' positions, negatives' positions)."""
    num_pos = ids.shape[0]
    if neg is None:
        return ids, positions(0, num_pos, ids.device), None
    return (torch.cat((ids, neg.reshape(-1))), positions(0, num_pos, ids.device),
            positions(num_pos, num_pos + neg.numel(), ids.device).view_as(neg))


_POSITIONS: dict[tuple[str, int], Tensor] = {}


def cached_tensors() -> list[Tensor]:
    """Every tensor the batch code keeps between batches (scratch arrays, position ranges, batch masks).

    A captured CUDA graph holds their addresses, not references: it keeps this list alive so that a cache
    that grows or is cleared later cannot hand the memory to something else while the graph still uses it.
    """
    return [*_SCRATCH.values(), *_POSITIONS.values(), *_MASK_CACHE.values()]


def positions(begin: int, end: int, device: torch.device) -> Tensor:
    key = (str(device), end)
    cached = _POSITIONS.get(key)
    if cached is None:
        cached = _POSITIONS[key] = torch.arange(end, device=device)
    return cached[begin:]
