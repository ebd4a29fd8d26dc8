"""``BucketIndex``: the lock state's open buckets indexed by partition, so that ``next`` and ``reserve`` cost O(P).

Without it every request rebuilt the P² bucket grid and scanned it, and a reservation scanned it again per candidate
(bench/RESULTS.md, "The lock server's cost per bucket": about a second per ``reserve`` at 128 pods and P=256). Here
the grid is indexed once (the buckets touching each partition key, and each partition number), and two sets follow
every change of the state as it happens:

- ``free``: the open buckets (not done, not in flight, not reserved) that are eligible (the initialised-partition
  rule) and have no partition locked by anyone, kept sorted, so that any rank may take them;
- ``single``: the open eligible buckets whose locked partitions, if any, are all one rank's: the buckets some rank
  could take now (what a reservation must leave enough of to the ranks still waiting).

A change of one partition's lock moves the 2P-1 buckets touching it between those sets, each by the few set changes
its move needs (``lock_changed``: most stay where they were, or change owner); a bucket taken, given back or done
refreshes itself; a partition trained for the first time refreshes the buckets that touch it. The containers of
``LockState`` that these follow (``locks``, ``in_flight``, ``reserved``, ``done``, ``trained_parts``) report their
changes themselves (``WatchedDict``, ``WatchedSet``), so that no code path, the tests' included, can change the
state behind the index's back.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from job.types import Bucket, PartitionKey

MISSING = object()


class WatchedDict(dict):
    """A dict that reports every change of a key after it is made: ``on_change(key, old, new)``, with ``MISSING``
    for a key that was not there or is gone."""

    def __init__(self, on_change: Callable[[Any, Any, Any], None], items: Any = ()) -> None:
        super().__init__(items)
        self._on_change = on_change

    def __setitem__(self, key: Any, value: Any) -> None:
        old = self.get(key, MISSING)
        super().__setitem__(key, value)
        if old is MISSING or old != value:  # (a lock taken again by its holder changes nothing)
            self._on_change(key, old, value)

    def __delitem__(self, key: Any) -> None:
        old = self[key]
        super().__delitem__(key)
        self._on_change(key, old, MISSING)

    def pop(self, key: Any, default: Any = MISSING) -> Any:
        if key in self:
            value = self[key]
            del self[key]
            return value
        if default is MISSING:  # as dict.pop
            raise KeyError(key)
        return default

    def popitem(self) -> tuple[Any, Any]:
        key = next(reversed(self))
        return key, self.pop(key)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def clear(self) -> None:
        for key in list(self):
            del self[key]


class WatchedSet(set):
    """A set that reports every element added or removed (``on_change(element)``) after the change."""

    def __init__(self, on_change: Callable[[Any], None], items: Iterable[Any] = ()) -> None:
        super().__init__(items)
        self._on_change = on_change

    def add(self, element: Any) -> None:
        if element not in self:
            super().add(element)
            self._on_change(element)

    def discard(self, element: Any) -> None:
        if element in self:
            super().discard(element)
            self._on_change(element)

    def remove(self, element: Any) -> None:
        super().remove(element)
        self._on_change(element)

    def pop(self) -> Any:
        element = super().pop()
        self._on_change(element)
        return element

    def update(self, *others: Iterable[Any]) -> None:
        for other in others:
            for element in other:
                self.add(element)

    def difference_update(self, *others: Iterable[Any]) -> None:
        for other in others:
            for element in list(other):
                self.discard(element)

    def clear(self) -> None:
        for element in list(self):
            self.discard(element)

    def __ior__(self, other: Any) -> WatchedSet:  # type: ignore[misc]  # in place, as set does
        self.update(other)
        return self

    def __isub__(self, other: Any) -> WatchedSet:  # type: ignore[misc]  # in place, as set does
        self.difference_update(other)
        return self

    def __iand__(self, other: Any) -> WatchedSet:  # type: ignore[misc]  # in place, as set does
        self.difference_update([e for e in self if e not in other])
        return self

    def __ixor__(self, other: Any) -> WatchedSet:  # type: ignore[misc]  # in place, as set does
        for element in list(other):
            if element in self:
                self.discard(element)
            else:
                self.add(element)
        return self


class IndexedSet:
    """A set with O(1) add, remove and access by position (a list and each element's place in it, removal by
    swapping the last element in): a random choice among its elements costs O(1), whatever its size. Its order is
    that of the changes made to it, so a seeded choice is reproducible."""

    __slots__ = ("items", "_at")

    def __init__(self) -> None:
        self.items: list[Bucket] = []
        self._at: dict[Bucket, int] = {}

    def add(self, item: Bucket) -> None:
        if item not in self._at:
            self._at[item] = len(self.items)
            self.items.append(item)

    def discard(self, item: Bucket) -> None:
        at = self._at.pop(item, None)
        if at is None:
            return
        last = self.items.pop()
        if at < len(self.items):
            self.items[at] = last
            self._at[last] = at

    def __contains__(self, item: object) -> bool:
        return item in self._at

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Bucket]:
        return iter(self.items)


class BucketIndex:
    """The open buckets of a ``LockState`` by partition (see the module docstring). ``state``: anything with
    ``bucket_keys``, ``locks``, ``in_flight``, ``reserved``, ``done`` and ``eligible(bucket)``."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.by_key: dict[PartitionKey, list[Bucket]] = {}
        self.by_part: dict[int, list[Bucket]] = {}
        for bucket, keys in state.bucket_keys.items():
            for key in keys:
                self.by_key.setdefault(key, []).append(bucket)
            for part in {bucket.lhs, bucket.rhs}:
                self.by_part.setdefault(part, []).append(bucket)
        self.taken: Counter[Bucket] = Counter()  # in flight or reserved (a bucket is both only transiently)
        self.held: dict[int, set[PartitionKey]] = {}  # rank -> the keys it locks
        # the free buckets: all, and by how many partitions each needs (a reservation's cost for a bucket touching
        # none the rank holds); O(1) to change and to draw from
        self.free = IndexedSet()
        self.free_by_size: dict[int, IndexedSet] = {}
        self.single: set[Bucket] = set()
        self.single_count: Counter[PartitionKey] = Counter()  # key -> the single buckets touching it
        self.owned: dict[int, set[Bucket]] = {}  # rank -> the single buckets whose one owner it is (not free)
        self._owner: dict[Bucket, int] = {}
        self._pairs: dict[tuple[PartitionKey, PartitionKey], frozenset[Bucket]] = {}
        # key -> each bucket touching it with its other keys: what a lock change reads (``lock_changed``)
        self._around: dict[PartitionKey, list[tuple[Bucket, tuple[PartitionKey, ...]]]] = {
            key: [(b, tuple(k for k in state.bucket_keys[b] if k != key)) for b in buckets]
            for key, buckets in self.by_key.items()}
        self.rebuild()

    # following the state -------------------------------------------------------------------------------------

    def rebuild(self) -> None:
        self.taken = Counter(list(self.state.in_flight.values()) + list(self.state.reserved.values()))
        self.held = {}
        for key, rank in self.state.locks.items():
            self.held.setdefault(rank, set()).add(key)
        self.free, self.free_by_size, self.single = IndexedSet(), {}, set()
        self.single_count, self.owned, self._owner = Counter(), {}, {}
        for bucket in sorted(self.state.bucket_keys):
            self._classify(bucket)

    def lock_changed(self, key: PartitionKey, old: Any, new: Any) -> None:
        if old is not MISSING:
            self.held.get(old, set()).discard(key)
        if new is not MISSING:
            self.held.setdefault(new, set()).add(key)
        self._moved(key, None if new is MISSING else new)

    def _moved(self, key: PartitionKey, new: Any) -> None:
        """Incremental: each open bucket touching ``key`` (now locked by ``new``, None: by nobody) moves between
        ``free``, one owner's and several owners' by the few set changes that move needs, and a bucket whose class
        did not change (several owners before and after, or the same one) costs two lookups. Not the full
        ``refresh`` of each of the 2P-1 buckets: that was the serving thread's largest cost at P=256 (1.3 ms a
        lock change, bench/RESULTS.md "The lock server's serving thread"). tests/test_bucket_index.py checks the
        sets against a rebuild after every step of random passes."""
        state = self.state
        done, taken, locks = state.done, self.taken, state.locks
        check_eligible = state.tree_init_order
        free, owner_of, owned, single, counts = self.free, self._owner, self.owned, self.single, self.single_count
        keys_of = state.bucket_keys
        for bucket, others in self._around.get(key, ()):
            if bucket in done or bucket in taken or (check_eligible and not state.eligible(bucket)):
                continue  # (a closed bucket is in no set, whoever locks what)
            owner, several = new, False
            for other in others:
                holder = locks.get(other)
                if holder is not None and holder != owner:
                    if owner is not None:
                        several = True
                        break
                    owner = holder
            was = owner_of.get(bucket)
            if was is not None:  # one owner before
                if several:
                    del owner_of[bucket]
                    owned[was].discard(bucket)
                    single.discard(bucket)
                    for k in keys_of[bucket]:
                        counts[k] -= 1
                elif owner is None:
                    del owner_of[bucket]
                    owned[was].discard(bucket)
                    self._add_free(bucket, len(keys_of[bucket]))
                elif owner != was:
                    owner_of[bucket] = owner
                    owned[was].discard(bucket)
                    owned.setdefault(owner, set()).add(bucket)
            elif bucket in free:  # free before
                if several or owner is None:  # (not by one lock's change: the full refresh)
                    self.refresh(bucket)
                    continue
                free.discard(bucket)
                self.free_by_size[len(keys_of[bucket])].discard(bucket)
                owner_of[bucket] = owner
                owned.setdefault(owner, set()).add(bucket)
            elif not several:  # several owners before (open and eligible: in no set), at most one now
                single.add(bucket)
                for k in keys_of[bucket]:
                    counts[k] += 1
                if owner is None:
                    self._add_free(bucket, len(keys_of[bucket]))
                else:
                    owner_of[bucket] = owner
                    owned.setdefault(owner, set()).add(bucket)

    def taken_changed(self, rank: Any, old: Any, new: Any) -> None:
        if old is not MISSING:
            self.taken[old] -= 1
            if self.taken[old] <= 0:
                del self.taken[old]
            self.refresh(old)
        if new is not MISSING:
            self.taken[new] += 1
            self.refresh(new)

    def part_trained(self, part: int) -> None:
        for bucket in self.by_part.get(part, ()):
            self.refresh(bucket)

    def refresh(self, bucket: Bucket) -> None:
        keys = self.state.bucket_keys.get(bucket)
        if keys is None:  # a state without its grid (one only replayed to read its records): nothing to index
            return
        if bucket in self.free:
            self.free.discard(bucket)
            self.free_by_size[len(keys)].discard(bucket)
        if bucket in self.single:
            self.single.discard(bucket)
            counts = self.single_count
            for key in keys:
                counts[key] -= 1
        owner = self._owner.pop(bucket, None)
        if owner is not None:
            self.owned[owner].discard(bucket)
        self._classify(bucket)

    def _classify(self, bucket: Bucket) -> None:
        state = self.state
        if bucket in state.done or bucket in self.taken or not state.eligible(bucket):
            return
        keys = state.bucket_keys[bucket]
        locks = state.locks
        owners = {locks[key] for key in keys if key in locks}
        if not owners:
            self._add_free(bucket, len(keys))
        elif len(owners) == 1:
            (owner,) = owners
            self._owner[bucket] = owner
            self.owned.setdefault(owner, set()).add(bucket)
        if len(owners) <= 1:
            self.single.add(bucket)
            counts = self.single_count
            for key in keys:
                counts[key] += 1

    def _add_free(self, bucket: Bucket, size: int) -> None:
        self.free.add(bucket)
        by_size = self.free_by_size.get(size)
        if by_size is None:
            by_size = self.free_by_size[size] = IndexedSet()
        by_size.add(bucket)

    # queries ---------------------------------------------------------------------------------------------------

    def is_open(self, bucket: Bucket) -> bool:
        return bucket not in self.state.done and bucket not in self.taken

    def is_free(self, bucket: Bucket) -> bool:
        return bucket in self.free

    def owners(self, bucket: Bucket) -> set[int]:
        locks = self.state.locks
        return {locks[key] for key in self.state.bucket_keys[bucket] if key in locks}

    def near(self, keys: Iterable[PartitionKey]) -> Iterator[Bucket]:
        """The buckets touching any of ``keys`` (each once)."""
        seen: set[Bucket] = set()
        for key in keys:
            for bucket in self.by_key.get(key, ()):
                if bucket not in seen:
                    seen.add(bucket)
                    yield bucket

    def takes(self, rank: int, bucket: Bucket, also_trained: frozenset = frozenset()) -> bool:
        """Whether ``rank`` may take ``bucket`` now: open, eligible (or touching ``also_trained``: the partitions of
        the bucket it trains before this one), and no partition locked by another rank."""
        return bucket in self.free or (
            self.is_open(bucket)
            and (self.state.eligible(bucket) or bool({bucket.lhs, bucket.rhs} & also_trained))
            and self.owners(bucket) <= {rank})

    def extras(self, rank: int, also_trained: frozenset = frozenset()) -> set[Bucket]:
        """The buckets ``rank`` may take that are not free: those whose locked partitions are all its own
        (``owned``), and, under the initialised-partition rule, those eligible only through ``also_trained``."""
        extra = set(self.owned.get(rank, ()))
        if self.state.tree_init_order:
            extra.update(b for part in also_trained for b in self.by_part.get(part, ())
                         if b not in self.free and b not in extra and self.takes(rank, b, also_trained))
        return extra

    def near_takeable(self, rank: int, keys: Iterable[PartitionKey]) -> list[Bucket]:
        """The buckets ``rank`` may take (without ``also_trained``) that touch any of ``keys``."""
        owned = self.owned.get(rank, set())
        return [b for b in self.near(keys) if b in self.free or b in owned]

    def _both(self, one: PartitionKey, other: PartitionKey) -> frozenset[Bucket]:
        """The buckets touching both keys (at most two for one entity type: (a, b) and (b, a)), cached."""
        pair = (one, other) if one <= other else (other, one)
        both = self._pairs.get(pair)
        if both is None:
            if len(self._pairs) > 1 << 17:
                self._pairs.clear()
            both = self._pairs[pair] = frozenset(self.by_key.get(one, ())).intersection(self.by_key.get(other, ()))
        return both

    def open_to_others_count(self, rank: int, without: Iterable[PartitionKey]) -> int:
        """How many buckets some other rank could take now that touch none of ``without``: the ``single`` ones,
        less those whose one owner is ``rank`` (``owned``) and those touching ``without``. O(1) for a bucket of one
        or two new partitions (counts per partition, and the few buckets touching two given ones)."""
        mine = self.held.get(rank, set())
        owned = self.owned.get(rank, set())
        others = [k for k in without if k not in mine]  # a key of the rank's touches only buckets it owns or shares
        if len(others) > 2:  # buckets of several entity types: counted directly, O(P) per key
            excluded = {b for b in self.near(others) if b in self.single} | owned
            return len(self.single) - len(excluded)
        touching = sum(self.single_count[k] for k in others)
        if len(others) == 2:
            touching -= len(self._both(*others) & self.single)
        also_owned: set[Bucket] = set()
        for key in others:
            for own in mine:
                also_owned |= self._both(key, own)
        touching -= len(also_owned & self.single)
        return len(self.single) - len(owned) - touching
