"""Which resident partition leaves when the buffer is full: the one needed again latest (Belady's rule, optimal for
a known sequence of buckets; job/train/residency/budget.py says how many stay)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from job.types import PartitionKey


def next_use(key: PartitionKey, upcoming: Sequence[set[PartitionKey]]) -> int:
    """Buckets until ``key`` is needed again (len(upcoming) + 1: not in this pass)."""
    return next((i for i, keys in enumerate(upcoming) if key in keys), len(upcoming) + 1)


def pick_victim(candidates: Sequence[PartitionKey], upcoming: Sequence[set[PartitionKey]]) -> Optional[PartitionKey]:
    """The candidate needed again latest (ties: the smallest key, so runs are reproducible)."""
    if not candidates:
        return None
    return max(sorted(candidates), key=lambda k: next_use(k, upcoming))
