"""Bucket orders: PBG's four ways of walking the (lhs partition, rhs partition) grid.

Orders that make consecutive buckets share a partition save a swap (a write and a
read of a whole partition) per shared partition, which is what makes partitioned
training cheap when embeddings live on S3.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import NamedTuple

from job.config import BucketOrder


class Bucket(NamedTuple):
    lhs: int
    rhs: int

    def __str__(self) -> str:
        return f"({self.lhs}, {self.rhs})"


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
    partitions in memory (``bucket_order: buffer``).

    The partitions are cut into groups of ``capacity - 1``. While a group is held, every partition of the
    later groups passes through the one remaining slot, so each load pairs the newcomer with all of the
    group: ``capacity - 1`` new pairs per load, which is the most a load can add. The last partition to
    pass through belongs to the next group, so it is already in memory when that group takes over. The
    partitions already ``resident`` form the first group (nothing to load to start). Loads per pass stay
    within ~10% of ``lower_bound_loads`` (tests/test_train.py checks several grids).
    """
    if capacity < 2:
        raise ValueError("a bucket needs two partitions in memory: capacity >= 2")
    first = [p for p in dict.fromkeys(resident) if 0 <= p < nparts]
    rest = [p for p in range(nparts) if p not in first]
    rng.shuffle(rest)
    indices = first + rest
    if capacity >= nparts:
        groups = [indices]
    else:
        size = capacity - 1
        groups = [indices[i: i + size] for i in range(0, nparts, size)]
    order: list[Bucket] = []
    done: set[Bucket] = set()

    def emit(a: int, b: int) -> None:
        for bucket in (Bucket(a, b), Bucket(b, a)):
            if bucket not in done:
                done.add(bucket)
                order.append(bucket)

    for k, group in enumerate(groups):
        # buckets within the group, spread between the newcomers: while one trains, the last newcomer
        # (used no more) is written back and the next one read in the background (prefetch_partitions)
        inside = [(a, b) for i, a in enumerate(group) for b in group[i:]]
        inside.reverse()
        if inside:
            emit(*inside.pop())
        later = [p for g in groups[k + 1:] for p in g]
        if k + 1 < len(groups):  # end on a partition of the next group: it stays for the next phase
            nxt = next((p for p in groups[k + 1] if p not in first), groups[k + 1][0])
            later.remove(nxt)
            later.append(nxt)
        if k == 0:  # partitions already in memory beyond the first group pass through first: no load
            extra = [p for p in first[len(group):] if p in later[:-1]]
            later = extra + [p for p in later if p not in extra]
        for newcomer in later:
            emit(newcomer, newcomer)
            for member in group:
                emit(newcomer, member)
            if inside:
                emit(*inside.pop())
        while inside:
            emit(*inside.pop())
    return order


def lower_bound_loads(nparts: int, capacity: int, resident: int = 0) -> int:
    """The fewest partition loads that train every bucket of a square grid with ``capacity`` partitions in
    memory, ``resident`` of them already there: every pair of partitions must meet in memory once, a full
    buffer holds C(c, 2) pairs, and each further load can add at most ``capacity - 1`` new pairs."""
    if capacity >= nparts:
        return nparts - min(resident, nparts)
    pairs_left = nparts * (nparts - 1) // 2 - capacity * (capacity - 1) // 2
    return capacity - min(resident, capacity) + -(-pairs_left // (capacity - 1))


def plan_loads(order: Sequence[Bucket], capacity: int, resident: Sequence[int] = ()) -> tuple[int, int]:
    """(loads, evictions) of walking ``order`` with ``capacity`` partitions in memory, evicting the
    partition whose next use is farthest away (Belady's rule, optimal for a known sequence)."""
    held = list(dict.fromkeys(resident))[:capacity]
    loads = evictions = 0
    for position, bucket in enumerate(order):
        for part in dict.fromkeys((bucket.lhs, bucket.rhs)):
            if part in held:
                continue
            if len(held) >= capacity:
                victim = farthest_next_use(held, order, position, keep={bucket.lhs, bucket.rhs})
                held.remove(victim)
                evictions += 1
            held.append(part)
            loads += 1
    return loads, evictions


def farthest_next_use(held: Sequence[int], order: Sequence[Bucket], position: int, keep: set[int]) -> int:
    """Among ``held`` (minus ``keep``), the partition next used latest after ``position`` (never: first)."""
    best, best_distance = None, -1
    for part in held:
        if part in keep:
            continue
        distance = next(
            (i for i in range(position, len(order)) if part in (order[i].lhs, order[i].rhs)), len(order) + 1
        )
        if distance > best_distance:
            best, best_distance = part, distance
    if best is None:
        raise ValueError("no partition can be evicted: the bucket needs more than the buffer holds")
    return best
