"""``bucket_order: buffer``: every bucket once, the loads of its walks against ``lower_bound_loads``, and that
bound against the fewest loads an exhaustive search finds on small grids."""

from __future__ import annotations

import heapq
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from job.config import BucketOrder
from job.train.schedule.buffer_walk import walk
from job.train.schedule.orders import all_buckets, buffer_order, lower_bound_loads, order_buckets, plan_loads
from job.types import Bucket


def fewest_loads(nparts: int, capacity: int, resident: int = 0, *, estimate: bool = False) -> int:
    """The fewest loads that train every bucket, by search over (partitions in memory, pairs met) states.

    Only lazy walks are searched (a partition leaves only to make room for a load: no walk loads fewer than its
    lazy version). Pruning keeps the search exact without using ``lower_bound_loads``: a state is dropped when
    another one with the same partitions in memory has met a superset of its pairs at no more loads; partitions
    done with (every pair met) are never loaded, and when one is in memory it is the one evicted; of moves that
    a swap of two interchangeable partitions maps onto each other only one is tried; the first ``capacity``
    partitions are any (the resident ones among them). Breadth first; with ``estimate`` best first by loads +
    max(partitions out of memory with a bucket left, pairs of distinct partitions left / (c - 1)), two counts no
    walk can beat (each of those partitions is loaded again, a load meets at most c - 1 new partners), for grids
    breadth first is slow on.
    """
    capacity = min(capacity, nparts)
    pair = [[0] * nparts for _ in range(nparts)]
    count = 0
    for a in range(nparts):
        for b in range(a, nparts):
            pair[a][b] = pair[b][a] = 1 << count
            count += 1
    everything = (1 << count) - 1
    row = [sum(pair[a][b] for b in range(nparts)) for a in range(nparts)]
    selves = sum(pair[a][a] for a in range(nparts))

    def meet(newcomer: int, held: int, met: int) -> int:
        for other in range(nparts):
            if held >> other & 1:
                met |= pair[newcomer][other]
        return met

    def partners(part: int, met: int) -> int:
        return sum(1 << other for other in range(nparts) if other != part and met & pair[part][other])

    def distinct(candidates: list[int], met: int) -> list[int]:
        kept: list[int] = []
        for part in candidates:
            mine = (partners(part, met), bool(met & pair[part][part]))
            if not any(mine[1] == bool(met & pair[o][o])
                       and mine[0] & ~(1 << o) == partners(o, met) & ~(1 << part) for o in kept):
                kept.append(part)
        return kept

    def cost_left(held: int, met: int) -> int:
        if not estimate:
            return 0
        outside = sum(1 for p in range(nparts) if not held >> p & 1 and row[p] & ~met)
        pairs_left = bin(everything & ~met & ~selves).count("1")
        return max(outside, -(-pairs_left // max(1, capacity - 1)))

    held = (1 << capacity) - 1
    met = 0
    for part in range(capacity):
        met = meet(part, held, met)
    loads = capacity - min(resident, capacity)
    if met == everything:
        return loads
    seen: dict[int, list[tuple[int, int]]] = {held: [(met, loads)]}
    queue = [(loads + cost_left(held, met), 0, loads, held, met)]
    best = -1  # the fewest loads of a walk found so far: done once no state left can do better
    while queue and (best < 0 or queue[0][0] < best):
        _, _, loads, held, met = heapq.heappop(queue)
        out = [p for p in range(nparts) if not held >> p & 1 and row[p] & ~met]
        done = [p for p in range(nparts) if held >> p & 1 and not row[p] & ~met]
        evictable = done[:1] or [p for p in range(nparts) if held >> p & 1]
        for evicted in distinct(evictable, met):
            for loaded in distinct(out, met):
                after = held & ~(1 << evicted) | 1 << loaded
                now = meet(loaded, after, met)
                if now == everything:
                    best = loads + 1 if best < 0 else min(best, loads + 1)
                    continue
                states = seen.setdefault(after, [])
                if any(m | now == m and n <= loads + 1 for m, n in states):
                    continue
                states[:] = [(m, n) for m, n in states if not (m | now == now and n >= loads + 1)]
                states.append((now, loads + 1))
                heapq.heappush(queue, (loads + 1 + cost_left(after, now), -bin(now).count("1"), loads + 1, after, now))
    if best < 0:
        raise AssertionError("every walk ends")
    return best


SMALL_GRIDS = [(3, 2), (4, 2), (4, 3), (5, 2), (5, 3), (5, 4), (6, 3), (6, 4), (6, 5), (7, 3), (7, 4), (7, 5), (7, 6),
               (8, 4), (8, 5), (8, 6), (8, 7)]


@pytest.mark.parametrize("nparts,capacity", SMALL_GRIDS)
def test_lower_bound_is_the_fewest_loads_on_small_grids(nparts: int, capacity: int) -> None:
    assert fewest_loads(nparts, capacity) == lower_bound_loads(nparts, capacity)
    for resident in range(1, capacity + 1):
        assert fewest_loads(nparts, capacity, resident) == lower_bound_loads(nparts, capacity, resident)


def test_lower_bound_is_short_of_the_fewest_loads_on_some_grids() -> None:
    """Sound but not tight for some c between P/3 and P/2 (also P = 10, c = 4: 18, a slower search): the counts
    allow one load fewer than any walk needs. ``buffer_order`` takes the fewest loads on these grids."""
    assert fewest_loads(9, 4, estimate=True) == lower_bound_loads(9, 4) + 1 == 15
    assert fewest_loads(11, 5, estimate=True) == lower_bound_loads(11, 5) + 1 == 18
    assert _check_walk(9, 4, seed=0) == 15 and _check_walk(11, 5, seed=0) == 18


def test_lower_bound_of_a_buffer_holding_everything_is_one_load_per_partition() -> None:
    assert lower_bound_loads(5, 5) == lower_bound_loads(5, 9) == 5
    assert lower_bound_loads(5, 9, resident=3) == 2
    # c >= P/2: the partitions loaded once fit together, the others are loaded twice
    assert lower_bound_loads(16, 8) == 24 and lower_bound_loads(64, 32) == 96
    with pytest.raises(ValueError):
        lower_bound_loads(4, 1)


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 12), st.data())
def test_no_order_loads_fewer_than_the_lower_bound(nparts: int, data: st.DataObject) -> None:
    capacity = data.draw(st.integers(2, nparts + 1))
    resident = data.draw(st.lists(st.integers(0, nparts - 1), max_size=min(capacity, nparts), unique=True))
    order = data.draw(st.permutations(all_buckets(nparts, nparts)))
    loads, evictions = plan_loads(order, capacity, resident)
    assert loads >= lower_bound_loads(nparts, capacity, len(resident))
    assert evictions == max(0, loads + len(resident) - capacity)  # lazy: it evicts only when full


def _check_walk(nparts: int, capacity: int, seed: int, resident: tuple[int, ...] = ()) -> int:
    order = buffer_order(nparts, capacity, random.Random(seed), resident)
    assert len(order) == nparts * nparts and set(order) == set(all_buckets(nparts, nparts))
    loads, _ = plan_loads(order, capacity, resident)
    assert loads >= lower_bound_loads(nparts, capacity, len(resident))
    # Belady's rule replays the walk: its loads, less the partitions already in memory
    assert loads == len(walk(nparts, max(2, min(capacity, nparts)))) - len(resident)
    return loads


@pytest.mark.parametrize("nparts,capacity", [(1, 2), (2, 2), (3, 5), (5, 2), (7, 3), (9, 9)])
def test_buffer_order_trains_every_bucket_exactly_once(nparts: int, capacity: int) -> None:
    for seed in range(3):
        _check_walk(nparts, capacity, seed)
    with pytest.raises(ValueError):
        buffer_order(4, 1, random.Random(0))


def _grid(nparts: int) -> list[int]:
    return sorted({3, 4, nparts // 8, nparts // 4, nparts // 2, nparts - 1} - {0, 1, 2})


@pytest.mark.parametrize("nparts", [8, 16, 32])
def test_buffer_order_loads_within_ten_per_cent_of_the_lower_bound(nparts: int) -> None:
    """The issue's target. Measured: at the bound for c = 3 and c >= P/2; P = 16, c = 4: 43 (bound 42);
    P = 32, c = 4: 169 (168), c = 8: 82 (75)."""
    for capacity in _grid(nparts):
        loads = _check_walk(nparts, capacity, seed=capacity)
        bound = lower_bound_loads(nparts, capacity)
        assert loads <= bound * 1.10, (nparts, capacity, loads, bound)
        if capacity == 3 or 2 * capacity >= nparts:
            assert loads == bound, (nparts, capacity, loads, bound)
        for pbg_order in (BucketOrder.INSIDE_OUT, BucketOrder.AFFINITY):  # PBG's orders, same buffer
            pbg_loads = plan_loads(order_buckets(nparts, nparts, pbg_order, random.Random(0)), capacity)[0]
            assert loads < pbg_loads or loads == pbg_loads == bound


@pytest.mark.slow
def test_buffer_order_loads_for_64_partitions() -> None:
    """P = 64 (~25 s of walks): c = 3, 4, 8, 16 take 1017, 688, 310, 162 loads against 1010, 674, 292, 143; the
    changes of group still waste most where c is P/4 to P/3."""
    within = {3: 1.01, 4: 1.03, 8: 1.07, 16: 1.14, 32: 1.0, 63: 1.0}
    for capacity in _grid(64):
        loads = _check_walk(64, capacity, seed=capacity)
        assert loads <= lower_bound_loads(64, capacity) * within[capacity], (capacity, loads)


def test_buffer_order_reaches_the_lower_bound_when_half_the_partitions_fit() -> None:
    for nparts in range(4, 25):
        for capacity in range((nparts + 1) // 2, nparts + 1):
            assert _check_walk(nparts, capacity, seed=nparts) == lower_bound_loads(nparts, capacity), (nparts, capacity)


def test_buffer_order_reaches_the_fewest_loads_on_small_grids() -> None:
    for nparts, capacity in SMALL_GRIDS:
        assert _check_walk(nparts, capacity, seed=1) == fewest_loads(nparts, capacity), (nparts, capacity)


@pytest.mark.parametrize("nparts,capacity", [(8, 3), (12, 4), (16, 4), (6, 6)])
def test_a_pass_starting_with_partitions_in_memory_starts_with_them_and_loads_that_many_fewer(
        nparts: int, capacity: int) -> None:
    fresh = _check_walk(nparts, capacity, seed=0)
    for resident in [(5,), (5, 2), (0, 3, 1)][: capacity]:
        order = buffer_order(nparts, capacity, random.Random(0), resident)
        assert {order[0].lhs, order[0].rhs} <= set(resident)
        assert _check_walk(nparts, capacity, seed=3, resident=resident) == fresh - len(resident)


def _next_use(order: list[Bucket], part: int, position: int) -> int:
    return next((i for i in range(position, len(order)) if part in order[i]), len(order))


def _belady_by_scanning(order: list[Bucket], capacity: int, resident: list[int]) -> int:
    """Belady's rule the slow way: scan ahead for each partition in memory at each eviction."""
    held, loads = list(resident), 0
    for position, bucket in enumerate(order):
        for part in dict.fromkeys(bucket):
            if part in held:
                continue
            if len(held) >= capacity:
                candidates = [p for p in held if p not in bucket]
                held.remove(max(candidates, key=lambda p: _next_use(order, p, position)))
            held.append(part)
            loads += 1
    return loads


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 9), st.integers(2, 5), st.randoms(use_true_random=False))
def test_plan_loads_is_beladys_rule(nparts: int, capacity: int, rng: random.Random) -> None:
    order = all_buckets(nparts, nparts) * 2
    rng.shuffle(order)
    resident = rng.sample(range(nparts), min(capacity, nparts, rng.randint(0, 2)))
    assert plan_loads(order, capacity, resident)[0] == _belady_by_scanning(order, capacity, resident)
