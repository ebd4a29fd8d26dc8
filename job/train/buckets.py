"""Bucket orders: PBG's four ways of walking the (lhs partition, rhs partition) grid.

Orders that make consecutive buckets share a partition save a swap (a write and a
read of a whole partition) per shared partition, which is what makes partitioned
training cheap when embeddings live on S3.
"""

from __future__ import annotations

import random
from typing import NamedTuple

from job.config import BucketOrder


class Bucket(NamedTuple):
    lhs: int
    rhs: int

    def __str__(self) -> str:
        return f"({self.lhs}, {self.rhs})"


def all_buckets(nparts_lhs: int, nparts_rhs: int) -> list[Bucket]:
    return [Bucket(lhs, rhs) for lhs in range(nparts_lhs) for rhs in range(nparts_rhs)]


def order_buckets(nparts_lhs: int, nparts_rhs: int, order: BucketOrder, rng: random.Random) -> list[Bucket]:
    """Every bucket exactly once, in the given order."""
    if order is BucketOrder.RANDOM:
        buckets = all_buckets(nparts_lhs, nparts_rhs)
        rng.shuffle(buckets)
        return buckets
    if order is BucketOrder.AFFINITY:
        return _affinity_order(nparts_lhs, nparts_rhs, rng)
    if order in (BucketOrder.INSIDE_OUT, BucketOrder.OUTSIDE_IN):
        layers = [_layer(nparts_lhs, nparts_rhs, i, rng) for i in range(min(nparts_lhs, nparts_rhs))]
        if order is BucketOrder.INSIDE_OUT:
            layers.reverse()
        return [b for layer in layers for b in layer]
    raise ValueError(f"unknown bucket order {order}")


def _layer(nparts_lhs: int, nparts_rhs: int, index: int, rng: random.Random) -> list[Bucket]:
    """Buckets whose smaller partition is ``index``; a bucket and its transpose stay adjacent."""
    pairs: list[list[Bucket]] = [[Bucket(index, index)]]
    for other in range(index + 1, max(nparts_lhs, nparts_rhs)):
        pair = []
        if other < nparts_lhs:
            pair.append(Bucket(other, index))
        if other < nparts_rhs:
            pair.append(Bucket(index, other))
        rng.shuffle(pair)
        pairs.append(pair)
    rng.shuffle(pairs)
    return [b for pair in pairs for b in pair]


def _affinity_order(nparts_lhs: int, nparts_rhs: int, rng: random.Random) -> list[Bucket]:
    """Greedy walk: next bucket shares as many partitions as possible with the previous one."""
    remaining = set(all_buckets(nparts_lhs, nparts_rhs))
    if not remaining:
        return []
    current = rng.choice(sorted(remaining))
    remaining.discard(current)
    order = [current]
    while remaining:
        transposed = Bucket(current.rhs, current.lhs)
        if transposed in remaining:
            current = transposed
        else:
            sharing = [b for b in remaining if b.lhs == current.lhs or b.rhs == current.rhs
                       or b.lhs == current.rhs or b.rhs == current.lhs]
            current = rng.choice(sorted(sharing or remaining))
        remaining.discard(current)
        order.append(current)
    return order


def swaps_needed(order: list[Bucket]) -> int:
    """How many partition loads a walk costs (both sides counted), for tests and the bench."""
    loads = 0
    previous: Bucket | None = None
    for bucket in order:
        if previous is None:
            loads += 1 if bucket.lhs == bucket.rhs else 2
        else:
            held = {previous.lhs, previous.rhs}
            loads += len({bucket.lhs, bucket.rhs} - held)
        previous = bucket
    return loads
