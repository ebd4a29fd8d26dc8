"""Host copies of the partitions a rank keeps at a bucket switch, written behind in its write group
(job/checkpoint/write_groups.py)."""

from __future__ import annotations

import torch

from job.model.scoring import Table


class CopySlots:
    """Reusable host buffers for the kept partitions of a write group written behind (one slot per kept partition):
    allocated, and their pages touched, once per run rather than per switch, so that the copy on the training
    thread is a memcpy (a 96 MiB partition here: 0.03-0.11 s into a reused buffer, 0.21-0.30 s into fresh memory).
    The caller reuses the slots only once the group holding them is written (``PartitionStore.take_group``)."""

    def __init__(self) -> None:
        self._slots: list[torch.Tensor] = []

    def take(self, slot: int, table: Table) -> Table:
        """``table`` copied (float32, host) into ``slot``, grown if it is too small."""
        weight = table.weight.detach()
        sums = table.optim_sum.detach() if table.optim_sum is not None else None
        size = weight.numel()
        sums_size = sums.numel() if sums is not None else 0  # (rows,) row-wise, (rows, dim) per coordinate
        while len(self._slots) <= slot:
            self._slots.append(torch.empty(0))
        if self._slots[slot].numel() < size + sums_size:
            self._slots[slot] = torch.empty(size + sums_size, dtype=torch.float32)
        flat = self._slots[slot]
        copy = flat[:size].view(weight.shape).copy_(weight)
        optim_sum = flat[size:size + sums_size].view(sums.shape).copy_(sums) if sums is not None else None
        return Table(weight=copy, optim_sum=optim_sum)
