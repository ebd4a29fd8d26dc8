"""The per-type id tables of pass 1: every distinct id of an entity type gets a dense integer.

Lookup is sorted arrays of hashes searched with ``np.searchsorted``, so memory is proportional
to the number of distinct entities, not of edges, and no Python object is made per edge.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from job.data.importing import kernels
from job.data.importing.hashing import hash_strings

if TYPE_CHECKING:
    import pyarrow as pa

    from job.data.importing.plan import Plan


def _merge_sorted(
    keys: np.ndarray, values: np.ndarray, where: np.ndarray, new_keys: np.ndarray, new_values: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Insert sorted ``new_keys`` before positions ``where`` (from searchsorted): np.insert without its sort."""
    total = len(keys) + len(new_keys)
    slots = where + np.arange(len(new_keys), dtype=np.int64)
    old = np.ones(total, dtype=bool)
    old[slots] = False
    merged_keys = np.empty(total, dtype=keys.dtype)
    merged_values = np.empty(total, dtype=values.dtype)
    merged_keys[old] = keys
    merged_keys[slots] = new_keys
    merged_values[old] = values
    merged_values[slots] = new_values
    return merged_keys, merged_values


# The recent ids' lookup is merged into the main one once it holds more than 1/MERGE_RATIO of it (and at least
# MERGE_MIN): a batch with a few new ids then merges them into a small array, not into the whole table. Before, each
# batch that met any new id rewrote the table (4-10 ms at 1M ids): a uniform graph meets new ids in nearly every batch
# of a shard, and each of N pods pays that over its own table of ~all the ids (issue #46).
MERGE_RATIO = 8
MERGE_MIN = 1 << 16


class EntityTable:
    """The distinct ids of one entity type: dense integers (batch by batch, in hash order within a batch), names, counts.

    Lookup is two sorted arrays of hashes (with the dense id beside each) searched with ``np.searchsorted``: the
    main one, and the ids added since it was last rebuilt. New ids are merged into the second once per batch, and
    the second into the first once it grows past an eighth of it, so the merges cost amortised linear time in the
    table however few new ids each batch brings. ``sorted_hashes``/``sorted_ids`` give the whole lookup as one.
    """

    def __init__(self) -> None:
        self._hashes = np.zeros(0, dtype=np.uint64)  # the main lookup: sorted hashes, each with its dense id
        self._ids = np.zeros(0, dtype=np.int64)
        self._recent_hashes = np.zeros(0, dtype=np.uint64)  # the ids added since the main lookup was rebuilt
        self._recent_ids = np.zeros(0, dtype=np.int64)
        self.name_chunks: list[pa.Array] = []
        self.counts = np.zeros(0, dtype=np.int64)
        self.size = 0

    @property
    def sorted_hashes(self) -> np.ndarray:
        """Every id's hash, sorted."""
        self._merge_recent()
        return self._hashes

    @property
    def sorted_ids(self) -> np.ndarray:
        """The dense id of each hash of ``sorted_hashes``."""
        self._merge_recent()
        return self._ids

    def _merge_recent(self) -> None:
        if len(self._recent_hashes):
            where = np.searchsorted(self._hashes, self._recent_hashes)
            self._hashes, self._ids = _merge_sorted(self._hashes, self._ids, where, self._recent_hashes, self._recent_ids)
            self._recent_hashes = self._recent_hashes[:0]
            self._recent_ids = self._recent_ids[:0]

    def preload(self, names: pa.Array) -> np.ndarray:
        """Make ``names`` the ids 0..n-1, in order (``biggraph grow``: an existing model's entities keep their ids).

        Returns the positions of names that repeat an earlier one (empty when all are distinct): the
        caller decides whether that is an error. Their counts start at 0, so ``counts`` afterwards
        counts only the occurrences in edges encoded later.
        """
        import pyarrow as pa  # ~0.3 s: kept off the start-up (see job.data.importing.hashing)

        hashes, _ = hash_strings(names)
        order = np.argsort(hashes, kind="stable")
        ordered = hashes[order]
        repeated = np.zeros(len(ordered), dtype=bool)
        if len(ordered) > 1:
            np.equal(ordered[1:], ordered[:-1], out=repeated[1:])
        self._hashes = ordered[~repeated]
        self._ids = order[~repeated].astype(np.int64)
        self._recent_hashes = self._recent_hashes[:0]
        self._recent_ids = self._recent_ids[:0]
        self.name_chunks = [kernels.cast(names, pa.large_string())] if len(names) else []
        self.size = len(names)
        self.counts = np.zeros(max(self.size, 1), dtype=np.int64)
        return np.sort(order[repeated])

    def hashes_of(self, ids: np.ndarray) -> np.ndarray:
        """The hashes of dense ids (the inverse of the lookup table, for the ids given)."""
        by_id = np.empty(self.size, dtype=np.uint64)
        by_id[self.sorted_ids] = self.sorted_hashes
        return by_id[ids]

    def _look_up(self, unique: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For sorted distinct ``unique``: (found, their dense ids where found, insertion points into the recent
        lookup of those not found)."""
        ids = np.empty(len(unique), dtype=np.int64)
        where = np.searchsorted(self._hashes, unique)
        found = where < len(self._hashes)
        found[found] = self._hashes[where[found]] == unique[found]
        ids[found] = self._ids[where[found]]
        missing = np.flatnonzero(~found)
        recent_where = np.searchsorted(self._recent_hashes, unique[missing])
        if len(self._recent_hashes) and len(missing):
            hit = recent_where < len(self._recent_hashes)
            hit[hit] = self._recent_hashes[recent_where[hit]] == unique[missing[hit]]
            found[missing[hit]] = True
            ids[missing[hit]] = self._recent_ids[recent_where[hit]]
            recent_where = recent_where[~hit]
        return found, ids, recent_where

    def encode(self, hashes: np.ndarray, names_at: Callable[[np.ndarray], pa.Array]) -> np.ndarray:
        """Dense ids of ``hashes``; ``names_at(positions)`` gives the strings at those positions (for new ids)."""
        n = len(hashes)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        order = np.argsort(hashes)
        ordered = hashes[order]
        first = np.empty(n, dtype=bool)
        first[0] = True
        np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
        starts = np.flatnonzero(first)
        unique = ordered[starts]
        run_lengths = np.diff(np.append(starts, n))
        known, unique_ids, recent_where = self._look_up(unique)
        new = ~known
        num_new = int(np.count_nonzero(new))
        if num_new:
            new_ids = np.arange(self.size, self.size + num_new, dtype=np.int64)
            unique_ids[new] = new_ids
            self.name_chunks.append(names_at(order[starts[new]]))
            if not len(self._hashes):
                # the first batch: every id is new and ``unique`` is already the sorted lookup, with no merge to pay
                self._hashes, self._ids = unique, new_ids
            else:
                self._recent_hashes, self._recent_ids = _merge_sorted(
                    self._recent_hashes, self._recent_ids, recent_where, unique[new], new_ids)
                if len(self._recent_hashes) > max(MERGE_MIN, len(self._hashes) // MERGE_RATIO):
                    self._merge_recent()
            self.size += num_new
            if self.size > len(self.counts):
                grown = np.zeros(max(self.size, 2 * len(self.counts)), dtype=np.int64)
                grown[: len(self.counts)] = self.counts
                self.counts = grown
        self.counts[unique_ids] += run_lengths
        ids = np.empty(n, dtype=np.int64)
        ids[order] = np.repeat(unique_ids, run_lengths)
        return ids

    def names(self) -> pa.ChunkedArray:
        import pyarrow as pa  # ~0.3 s: kept off the start-up (see job.data.importing.hashing)

        large = pa.large_string()
        return pa.chunked_array([kernels.cast(chunk, large) for chunk in self.name_chunks], type=large)


def _names_picker(
    lhs: pa.Array, rhs: pa.Array, left_rows: np.ndarray, right_rows: np.ndarray
) -> Callable[[np.ndarray], pa.Array]:
    """``names_at`` for ``EntityTable.encode`` over [lhs ids at left_rows] + [rhs ids at right_rows]."""
    num_left = len(left_rows)

    def names_at(positions: np.ndarray) -> pa.Array:
        import pyarrow as pa  # ~0.3 s: kept off the start-up (see job.data.importing.hashing)

        from_left = positions[positions < num_left]
        from_right = positions[positions >= num_left] - num_left
        # Order only needs to match `positions`' order of new ids: rebuild it by concatenating in place.
        is_left = positions < num_left
        picked = pa.concat_arrays(
            [
                kernels.cast(kernels.take(lhs, left_rows[from_left]), pa.large_string()),
                kernels.cast(kernels.take(rhs, right_rows[from_right]), pa.large_string()),
            ]
        )
        order = np.empty(len(positions), dtype=np.int64)
        order[np.flatnonzero(is_left)] = np.arange(len(from_left))
        order[np.flatnonzero(~is_left)] = len(from_left) + np.arange(len(from_right))
        return kernels.take(picked, order)

    return names_at


def encode_edges(
    plan: Plan, tables: list[EntityTable], lhs: pa.Array, rhs: pa.Array,
    hashes: tuple[np.ndarray, np.ndarray], rel: np.ndarray, keep: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Dense per-type ids for both sides (``hashes``: lhs and rhs, of the kept rows); each edge's entity types
    are looked up from its relation. ``keep``: the rows of ``lhs``/``rhs`` kept (None: all)."""
    lhs_hash, rhs_hash = hashes
    n = len(rel)
    if plan.dynamic:
        lhs_types = np.full(n, plan.lhs_type[0])
        rhs_types = np.full(n, plan.rhs_type[0])
    else:
        lhs_types = plan.lhs_type[rel]
        rhs_types = plan.rhs_type[rel]
    rows = np.arange(n, dtype=np.int64) if keep is None else keep
    lhs_ids = np.empty(n, dtype=np.int64)
    rhs_ids = np.empty(n, dtype=np.int64)
    num_types = len(plan.type_names)
    if num_types == 1:
        used_types = [0] if n else []
    else:
        used = np.bincount(lhs_types, minlength=num_types) + np.bincount(rhs_types, minlength=num_types)
        used_types = list(np.flatnonzero(used))
    for type_index in used_types:
        left = np.flatnonzero(lhs_types == type_index) if num_types > 1 else slice(None)
        right = np.flatnonzero(rhs_types == type_index) if num_types > 1 else slice(None)
        names_at = _names_picker(lhs, rhs, rows[left], rows[right])
        ids = tables[type_index].encode(np.concatenate([lhs_hash[left], rhs_hash[right]]), names_at)
        num_left = len(rows[left])
        lhs_ids[left] = ids[:num_left]
        rhs_ids[right] = ids[num_left:]
    return lhs_ids, rhs_ids
