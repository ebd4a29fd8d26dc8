"""Row bookkeeping of a batch: unique rows without sorting, shared rows of two sides, cached scratch arrays,
and which rows a batch gathers (``select_rows``: the unique rows, or every occurrence where that pays).

Per-thread caches (``scratch``, ``positions``) keep the batch code from allocating every batch; a
captured CUDA graph keeps them alive through ``cached_tensors``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from job.model.scoring import Table, cached_masks


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
    return [*_SCRATCH.values(), *_POSITIONS.values(), *cached_masks()]


def positions(begin: int, end: int, device: torch.device) -> Tensor:
    key = (str(device), end)
    cached = _POSITIONS.get(key)
    if cached is None:
        cached = _POSITIONS[key] = torch.arange(end, device=device)
    return cached[begin:]


def occurrences_pay(lhs_table: Table, same_table: bool, all_negs: bool, train: bool) -> bool:
    """Whether to gather every occurrence of a batch's rows rather than its unique rows (CPU).

    On a large table the uniform draws barely repeat (~5% of 20,000 draws from 112k rows), so deduplicating
    saves few rows and costs what the fused scorer then has to undo: a copy of the negatives' rows out of the
    unique rows, a zero-filled gradient buffer and a scatter-add of every negative's gradient into it. With
    every occurrence gathered the negatives lie in draw order among the rows, are scored where they lie and
    their gradients are written in place (``job.model.fused.score_side``); the few repeats are merged before
    the Adagrad step (``row_adagrad_occurrences``). Small tables (the joint gather) keep deduplicating:
    there the draws collapse onto few rows. (The step asks ``KernelOptions.occurrences_on_cpu`` first: off, the
    unique rows, which tests/test_fused.py holds this path to.)
    """
    return train and not all_negs and not same_table and lhs_table.weight.device.type == "cpu"


@dataclass
class SelectedRows:
    """The rows a batch gathers per side, and where its positives and negatives sit among them."""

    lhs_uniq: Tensor
    lhs_inv: Tensor
    lhs_neg_inv: Optional[Tensor]
    rhs_uniq: Tensor
    rhs_inv: Tensor
    rhs_neg_inv: Optional[Tensor]
    same_table: bool  # both sides gather one set of rows
    static: bool  # every occurrence gathered (fixed shapes), not the unique rows


def select_rows(lhs_ids: Tensor, rhs_ids: Tensor, lhs_neg: Optional[Tensor], *, rhs_neg: Optional[Tensor],
                lhs_table: Table, rhs_table: Table, same_table: bool, all_negs: bool, static: bool) -> SelectedRows:
    """The unique rows per table (all of them with ``all_negs``; every occurrence when ``static``)."""
    num_pos = int(lhs_ids.shape[0])
    device = lhs_table.weight.device
    lhs_count = lhs_table.weight.shape[0]
    rhs_count = rhs_table.weight.shape[0]
    if static:
        # On a GPU finding the unique rows costs more than it saves: the number of unique rows is only
        # known after waiting for the device. Every occurrence is gathered instead (a few thousand rows
        # are nothing to a GPU), the shapes depend only on the batch size, and the Adagrad step sums the
        # gradients of repeated rows itself (``row_adagrad_repeated``): the same update, no waiting.
        return SelectedRows(*every_occurrence(lhs_ids, lhs_neg), *every_occurrence(rhs_ids, rhs_neg), False, True)
    if all_negs:
        lhs_uniq = torch.arange(lhs_count, device=device)
        rhs_uniq = lhs_uniq if same_table else torch.arange(rhs_count, device=device)
        return SelectedRows(lhs_uniq, lhs_ids, None, rhs_uniq, rhs_ids, None, same_table, False)
    if same_table:
        pieces = [lhs_ids, rhs_ids] + [n.reshape(-1) for n in (lhs_neg, rhs_neg) if n is not None]
        uniq, inverse = unique_inverse(torch.cat(pieces), lhs_count)
        offset = 2 * num_pos
        lhs_neg_inv = rhs_neg_inv = None
        if lhs_neg is not None:
            lhs_neg_inv = inverse[offset : offset + lhs_neg.numel()].view_as(lhs_neg)
            offset += lhs_neg.numel()
        if rhs_neg is not None:
            rhs_neg_inv = inverse[offset : offset + rhs_neg.numel()].view_as(rhs_neg)
        return SelectedRows(uniq, inverse[:num_pos], lhs_neg_inv, uniq, inverse[num_pos : 2 * num_pos],
                            rhs_neg_inv, True, False)

    def uniq_of(ids: Tensor, neg: Optional[Tensor], count: int) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        joined = ids if neg is None else torch.cat((ids, neg.reshape(-1)))
        uniq, inverse = unique_inverse(joined, count)
        neg_inv = None if neg is None else inverse[num_pos:].view_as(neg)
        return uniq, inverse[:num_pos], neg_inv

    return SelectedRows(*uniq_of(lhs_ids, lhs_neg, lhs_count), *uniq_of(rhs_ids, rhs_neg, rhs_count), False, False)
