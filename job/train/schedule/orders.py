"""Bucket orders: PBG's four ways of walking the (lhs partition, rhs partition) grid, and ``buffer``.

Orders that make consecutive buckets share a partition save a swap (a write and a
read of a whole partition) per shared partition, which is what makes partitioned
training cheap when embeddings live on S3. ``buffer`` walks for a buffer of several
partitions (``buffer_walk``); ``plan_loads`` counts what an order costs such a buffer.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from job.config import BucketOrder
from job.train.schedule.buffer_walk import lower_bound_loads, walk
from job.types import Bucket

__all__ = ["all_buckets", "buffer_order", "lower_bound_loads", "order_buckets", "plan_loads", "swaps_needed"]


def all_buckets(nparts_lhs: int, nparts_rhs: int) -> list[Bucket]:
    return [Bucket(lhs, rhs) for lhs in range(nparts_lhs) for rhs in range(nparts_rhs)]


def order_buckets(nparts_lhs: int, nparts_rhs: int, order: BucketOrder, rng: random.Random,
                  capacity: int = 2) -> list[Bucket]:
    """Every bucket exactly once, in the given order (``buffer``: for ``capacity`` partitions in memory; on a
    grid with one unpartitioned side every order loads each partition once, so it walks inside_out)."""
    if order is BucketOrder.BUFFER:
        if nparts_lhs == nparts_rhs:
            return buffer_order(nparts_lhs, capacity, rng)
        order = BucketOrder.INSIDE_OUT
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


def buffer_order(nparts: int, capacity: int, rng: random.Random, resident: Sequence[int] = ()) -> list[Bucket]:
    """Every bucket of a square grid once, in an order that needs few partition loads with ``capacity``
    partitions in memory (``bucket_order: buffer``): ``buffer_walk.walk``'s loads over labels, the labels given
    to the partitions at random except that the partitions already ``resident`` take the labels loaded first,
    so a pass that starts with r of them in memory loads exactly r fewer. Each bucket comes right after the load
    that brings its second partition in; Belady's rule (``plan_loads``, the trainer's buffer) replays the walk's
    loads. Loads per pass against ``lower_bound_loads``: tests/test_bucket_order.py.
    """
    if capacity < 2:
        raise ValueError("a bucket needs two partitions in memory: capacity >= 2")
    steps = walk(nparts, max(2, min(capacity, nparts)))  # c >= P: every partition fits, one walk for them all
    first = [p for p in dict.fromkeys(resident) if 0 <= p < nparts][: min(capacity, nparts)]
    rest = [p for p in range(nparts) if p not in first]
    rng.shuffle(rest)
    partition = first + rest  # label -> partition
    order: list[Bucket] = []
    done: set[Bucket] = set()
    held: list[int] = []
    for evicted, loaded in steps:
        if evicted >= 0:
            held.remove(partition[evicted])
        newcomer = partition[loaded]
        held.append(newcomer)
        for other in held:
            for bucket in (Bucket(newcomer, other), Bucket(other, newcomer)):
                if bucket not in done:
                    done.add(bucket)
                    order.append(bucket)
    return order


def plan_loads(order: Sequence[Bucket], capacity: int, resident: Sequence[int] = ()) -> tuple[int, int]:
    """(loads, evictions) of walking ``order`` with ``capacity`` partitions in memory, ``resident`` there at the
    start, evicting the partition whose next use is farthest away (Belady's rule, what the trainer does:
    ``buffer.pick_victim``). Each partition's uses are indexed once, so a pass of P = 64 plans in milliseconds."""
    uses: dict[int, list[int]] = {}
    for position, bucket in enumerate(order):
        for part in dict.fromkeys((bucket.lhs, bucket.rhs)):
            uses.setdefault(part, []).append(position)
    following = dict.fromkeys(uses, 0)  # index into uses[part] of its next use at or after the current bucket
    never = len(order)
    held = list(dict.fromkeys(resident))[:capacity]
    loads = evictions = 0
    for bucket in order:
        parts = tuple(dict.fromkeys((bucket.lhs, bucket.rhs)))
        for part in parts:
            if part in held:
                continue
            if len(held) >= capacity:
                candidates = [p for p in held if p not in parts]
                if not candidates:
                    raise ValueError("no partition can be evicted: the bucket needs more than the buffer holds")
                victim = max(candidates, key=lambda p: _next_use(uses.get(p, ()), following.get(p, 0), never))
                held.remove(victim)
                evictions += 1
            held.append(part)
            loads += 1
        for part in parts:
            following[part] += 1
    return loads, evictions


def _next_use(positions: Sequence[int], index: int, never: int) -> int:
    return positions[index] if index < len(positions) else never
