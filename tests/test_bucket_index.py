"""``BucketIndex`` (job/train/distributed/bucket_index.py) follows ``LockState`` through every kind of change, the
tests' own direct edits included: after each step of random passes, the index equals the state recomputed from
scratch, and the choices ``next_bucket`` and ``reserve`` make keep every rule of the scheduler."""

from __future__ import annotations

import random

import pytest
from helpers_distributed import partition_keys

from job.train.distributed.bucket_index import BucketIndex
from job.train.distributed.lock_state import LockState
from job.types import Bucket


def brute_free_and_single(state: LockState) -> tuple[list[Bucket], set[Bucket]]:
    taken = set(state.in_flight.values()) | set(state.reserved.values())
    free, single = [], set()
    for bucket in sorted(state.bucket_keys):
        if bucket in state.done or bucket in taken or not state.eligible(bucket):
            continue
        owners = {state.locks[k] for k in state.bucket_keys[bucket] if k in state.locks}
        if not owners:
            free.append(bucket)
        if len(owners) <= 1:
            single.add(bucket)
    return free, single


def brute_open_to(state: LockState, rank: int, also: frozenset = frozenset()) -> list[Bucket]:
    taken = set(state.in_flight.values()) | set(state.reserved.values())
    return [b for b in sorted(state.bucket_keys) if b not in state.done and b not in taken
            and all(state.locks.get(k, rank) == rank for k in state.bucket_keys[b])
            and (state.eligible(b) or bool({b.lhs, b.rhs} & also))]


def assert_index_matches(state: LockState, ranks: int) -> None:
    free, single = brute_free_and_single(state)
    assert sorted(state.index.free) == free and len(state.index.free) == len(free)
    assert state.index.single == single
    assert sorted(b for bs in state.index.free_by_size.values() for b in bs) == free
    held = {rank: {k for k, owner in state.locks.items() if owner == rank} for rank in range(ranks)}
    assert {r: keys for r, keys in state.index.held.items() if keys} == {r: k for r, k in held.items() if k}
    all_keys = sorted({k for ks in state.bucket_keys.values() for k in ks})
    for rank in range(ranks):
        owned = {b for b in single if {state.locks[k] for k in state.bucket_keys[b] if k in state.locks} == {rank}}
        assert state.index.owned_by(rank) == owned
        for size in (1, 2, 3):  # the count a reservation weighs, for sets of new partitions of every size
            new = frozenset(random.Random(rank * 7 + size).sample(all_keys, size))
            brute = sum(1 for b in single if rank not in {state.locks[k] for k in state.bucket_keys[b]
                                                          if k in state.locks} and not state.bucket_keys[b] & new)
            assert state.index.open_to_others_count(rank, new) == brute
        current = state.in_flight.get(rank)
        also = frozenset((current.lhs, current.rhs)) if current is not None else frozenset()
        assert sorted(state._open_to(rank, also)) == brute_open_to(state, rank, also)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("tree", [False, True])
def test_the_index_follows_the_state_through_random_passes(seed: int, tree: bool) -> None:
    rng = random.Random(seed)
    ranks, nparts = 4, 6
    keys = partition_keys(nparts)
    state = LockState(nparts, nparts, keys, world_size=ranks, tree_init_order=tree)
    current: dict[int, Bucket | None] = {r: None for r in range(ranks)}
    for _ in range(400):
        rank = rng.randrange(ranks)
        held = set(keys[current[rank]]) if current[rank] is not None else set()
        action = rng.random()
        if action < 0.55:
            kind, bucket = state.next_bucket(rank, held, current[rank], rng)
            if kind == "bucket":
                assert bucket is not None
                assert all(state.locks.get(k) == rank for k in keys[bucket])  # never a partition of another rank
                leaving = held - set(keys[bucket])
                state.release(rank, sorted(leaving))
            current[rank] = bucket if kind == "bucket" else None
        elif action < 0.85:
            ahead = state.reserve(rank, rng)
            if ahead is not None:
                assert ahead not in state.done and all(state.locks.get(k) == rank for k in keys[ahead])
        elif action < 0.93:
            state.stop(rank, current[rank])
            state.release(rank, sorted(held))
            current[rank] = None
        elif action < 0.97:  # a restart: the state replayed from its snapshot, nobody holding anything
            snapshot = state.to_json()
            state = LockState(nparts, nparts, keys, world_size=ranks, tree_init_order=tree)
            state.restore(snapshot)
            state.forget_rank_locks()
            current = {r: None for r in range(ranks)}
        else:  # a test's direct edits, as tests/test_distributed_prefetch.py makes them
            free = sorted(state.index.free)
            if free:
                state.done |= {free[0]}
        state.drain_journal()
        assert_index_matches(state, ranks)
        if state.finished():
            break


def test_a_pass_of_one_rank_trains_every_bucket_once_through_the_index() -> None:
    state = LockState(5, 5, partition_keys(5), world_size=1)
    rng = random.Random(3)
    trained: list[Bucket] = []
    bucket = None
    while True:
        held = set(state.bucket_keys[bucket]) if bucket is not None else set()
        kind, bucket = state.next_bucket(0, held, bucket, rng)
        if kind != "bucket":
            break
        assert bucket is not None
        trained.append(bucket)
    assert kind == "done" and sorted(trained) == sorted(state.bucket_keys)


def index_sets(index: BucketIndex) -> tuple:
    """What a lock change moves, as plain values."""
    return (sorted(index.free), index.single, {s: sorted(bs) for s, bs in index.free_by_size.items() if len(bs)},
            {k: n for k, n in index.single_count.items() if n}, {r: bs for r, bs in index.owned.items() if bs})


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("types", [1, 2])
def test_a_lock_change_moves_each_bucket_as_a_full_rebuild_would(seed: int, types: int) -> None:
    """``lock_changed`` reclassifies the buckets touching its key only (vectorised): after every one of
    random lock changes (taken, given back, passed between ranks, on buckets of one or two entity types, so of one
    to four partitions), with buckets done and taken among them, the index equals one built from scratch."""
    rng = random.Random(seed)
    nparts, ranks = 5, 4
    keys = {b: frozenset({(t, p) for t in ("node", "user")[:types] for p in (b.lhs, b.rhs)})
            for b in partition_keys(nparts)}
    state = LockState(nparts, nparts, keys, world_size=ranks, tree_init_order=seed % 2 == 1)
    all_keys = sorted({k for ks in keys.values() for k in ks})
    for step in range(300):
        action = rng.random()
        key = rng.choice(all_keys)
        if action < 0.5:
            state.locks[key] = rng.randrange(ranks)
        elif action < 0.8:
            state.locks.pop(key, None)
        elif action < 0.9:
            state.done.add(rng.choice(sorted(keys)))
        elif action < 0.95:
            state.in_flight[rng.randrange(ranks)] = rng.choice(sorted(keys))
        else:
            state.trained_parts.add(rng.randrange(nparts))
        assert index_sets(state.index) == index_sets(BucketIndex(state)), f"step {step}"
