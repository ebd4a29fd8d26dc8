"""The rows of the grown checkpoint: trained rows copied unchanged, new rows initialised.

``random`` draws new rows as a fresh run would (normal, ``init_scale``), seeded by type, partition
and version so that a grow is reproducible. ``neighbours`` places each new entity where the trained
model would score its new edges highly: an edge (u, r, v) scores ``c(u, f_r(v))``, so

- a new u linked to a trained v should be near ``f_r(v)``;
- a new v linked to a trained u should be near the pre-image of u under ``f_r``: the adjoint
  ``f_r^T(u)`` for the dot and cosine comparators (it maximises the dot product for a given norm),
  the inverse for the l2 comparators (it makes the distance zero); each operator kind says how
  (``OperatorKind.adjoint`` in ``job.model.operators``), each comparator whether it is distance-based;
- with dynamic relations each side also has the reverse operator ``g_r`` (``c(g_r(u), v)``), and the
  two views are averaged.

For dot and cosine the adjoint gives a direction, but scales by the operator's gain (a trained ComplEx
diagonal has modulus well above 1), so each target is rescaled to its neighbour's norm. A new entity's
row is then the mean of its targets over its edges to trained entities, times ``NEIGHBOUR_SCALE``,
minus its type's global embedding (targets live where rows plus the global embedding do).

Why shrink it: a mean of targets is a centroid, and centroids are hubs. At full length a new row
scores above the trained answers of many old queries it has nothing to do with (on the WordNet bench,
filtered MRR of old test edges fell from 0.070 to 0.054 before any training, and was still 0.053-0.058
after five passes), because no negative has yet taught it otherwise. A quarter of the length keeps its
direction, which is what ranks it for its own edges, while it ranks below the trained answers of other
queries until training has placed it; see bench/RESULTS.md for the scales tried. New rows start with
zero Adagrad sums in both modes, like a fresh run's rows: their first steps are full-size, which is what
a row that still has to find its place needs (with its neighbours' sums it barely moves).

Entities linked only to other new entities get their row in a later round, from neighbours filled in
the rounds before; the few with no path to a trained entity keep their random row.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from job.config import ConfigSchema
from job.formats.checkpoint import CheckpointStorage
from job.growing.ingest import read_spilled_bucket
from job.model.comparators import COMPARATORS
from job.train.batch.optim import entity_adagrad_state, sums_from_state
from job.train.residency.budget import per_coordinate
from job.types import PartitionKey

logger = logging.getLogger("biggraph")

NEIGHBOUR_SCALE = 0.25  # the length of a neighbour-initialised row, as a fraction of its targets' mean
NEIGHBOUR_ROUNDS = 3  # rounds of filling new entities from neighbours filled in earlier rounds


@dataclass
class NewRows:
    """The initial values of one partition's new rows (their Adagrad sums start at zero)."""

    values: np.ndarray  # (new, dim) float32
    from_neighbours: int = 0


def random_rows(config: ConfigSchema, key: PartitionKey, count: int, version: int) -> np.ndarray:
    generator = torch.Generator()
    seed = (config.seed or 0) * 1_000_003 + zlib.crc32(f"grow/{version}/{key[0]}/{key[1]}".encode())
    generator.manual_seed(seed % (2**63))
    return (torch.randn((count, config.dimension), generator=generator) * config.init_scale).numpy()


class _TrainedPartitions:
    """The trained partitions of the version being grown, read on demand; a few kept in memory."""

    def __init__(self, checkpoint: CheckpointStorage, version: int, capacity: int = 4) -> None:
        self.checkpoint = checkpoint
        self.version = version
        self.capacity = capacity
        self.loaded: dict[PartitionKey, torch.Tensor] = {}

    def get(self, key: PartitionKey) -> torch.Tensor:
        if key not in self.loaded:
            if len(self.loaded) >= self.capacity:
                self.loaded.pop(next(iter(self.loaded)))
            values, _ = self.checkpoint.load_entity_partition(self.version, key[0], key[1])
            self.loaded[key] = torch.from_numpy(values)
        return self.loaded[key]


def targets(model: Any, rel_idx: int, rel: Optional[torch.Tensor], y: torch.Tensor, new_on_lhs: bool,
            distance: bool) -> torch.Tensor:
    """Where a new entity on one side of edges of ``rel_idx`` should be, given the other side's rows ``y``
    (``distance``: the comparator scores by distance, so operators are inverted rather than transposed)."""
    if model.reciprocal:  # dynamic relations (rel_idx 0), or static ones with reciprocal_relations (rel None)
        forward, reverse = model.rhs_operators[rel_idx], model.lhs_operators[rel_idx]
        if new_on_lhs:  # c(x, f(y)) and c(g(x), y)
            return (forward(y, rel) + reverse.adjoint(y, rel, inverse=distance)) / 2
        return (forward.adjoint(y, rel, inverse=distance) + reverse(y, rel)) / 2  # c(y, f(x)) and c(g(y), x)
    operator = model.rhs_operators[rel_idx]
    return operator(y) if new_on_lhs else operator.adjoint(y, None, inverse=distance)


@dataclass
class _EdgeGroup:
    """The new edges of one relation type (of all of them, with dynamic relations) in one bucket."""

    rel_idx: int
    keys: list[PartitionKey]  # the partitions of the lhs and rhs sides
    ids: list[np.ndarray]  # lhs and rhs ids, in their partitions
    rel_ids: Optional[torch.Tensor]  # each edge's relation type, with dynamic relations


def _edge_groups(config: ConfigSchema, spills: list[tuple[str, np.ndarray]], grid: tuple[int, int]
                 ) -> Iterator[_EdgeGroup]:
    """The spilled new edges, bucket by bucket, grouped by relation type unless relations are dynamic."""
    for bucket_dir, counts in spills:
        for bucket in np.flatnonzero(counts):
            lhs_part, rhs_part = divmod(int(bucket), grid[1])
            rel, lhs, rhs = read_spilled_bucket(bucket_dir, int(bucket))
            groups = [(0, slice(None))] if config.dynamic_relations else [(int(r), rel == r) for r in np.unique(rel)]
            for rel_idx, chosen in groups:
                relation = config.relations[rel_idx]
                keys = [(relation.lhs, lhs_part if config.entities[relation.lhs].num_partitions > 1 else 0),
                        (relation.rhs, rhs_part if config.entities[relation.rhs].num_partitions > 1 else 0)]
                rel_ids = torch.from_numpy(rel[chosen]) if config.dynamic_relations else None
                yield _EdgeGroup(rel_idx, keys, [lhs[chosen], rhs[chosen]], rel_ids)


class _NeighbourFill:
    """Fills new rows from their known neighbours, round by round (see the module docstring).

    ``known`` marks the new rows filled so far; a round places only new rows not yet known, and only
    from edges whose other end is known (trained, or filled in an earlier round).
    """

    def __init__(self, config: ConfigSchema, model: Any, trained: _TrainedPartitions, old_counts: dict[PartitionKey, int],
                 rows: dict[PartitionKey, NewRows]) -> None:
        self.model = model
        self.trained = trained
        self.old_counts = old_counts
        self.rows = rows
        self.dim = config.dimension
        self.distance = not COMPARATORS.get(config.comparator).dot_product
        self.global_embs = {t: model.global_emb(t) for t in config.entities}
        self.known = {key: np.zeros(len(r.values), dtype=bool) for key, r in rows.items()}

    def rows_of(self, key: PartitionKey, ids: np.ndarray) -> torch.Tensor:
        """Rows (plus the global embedding) of known entities, trained or filled in an earlier round."""
        values = self.trained.get(key)
        old = self.old_counts[key]
        out = torch.empty((len(ids), self.dim))
        is_old = ids < old
        out[torch.from_numpy(is_old)] = values.index_select(0, torch.from_numpy(ids[is_old]))
        out[torch.from_numpy(~is_old)] = torch.from_numpy(self.rows[key].values[ids[~is_old] - old])
        g = self.global_embs[key[0]]
        return out + g if g is not None else out

    def _is_new_and_known(self, key: PartitionKey, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        is_new = ids >= self.old_counts[key]
        filled = np.zeros(len(ids), dtype=bool)
        filled[is_new] = self.known[key][ids[is_new] - self.old_counts[key]]
        return is_new, ~is_new | filled

    def accumulate(self, group: _EdgeGroup, acc: dict[PartitionKey, torch.Tensor],
                   hits: dict[PartitionKey, torch.Tensor]) -> None:
        """Add the targets that ``group``'s edges give their new, not yet known ends to ``acc`` (counted in ``hits``)."""
        keys, ids = group.keys, group.ids
        is_new, is_known = zip(*(self._is_new_and_known(keys[s], ids[s]) for s in (0, 1)))
        for side, other in ((0, 1), (1, 0)):
            take = np.flatnonzero(is_new[side] & ~is_known[side] & is_known[other])
            if not len(take):
                continue
            y = self.rows_of(keys[other], ids[other][take])
            selected = group.rel_ids.index_select(0, torch.from_numpy(take)) if group.rel_ids is not None else None
            t = targets(self.model, group.rel_idx, selected, y, new_on_lhs=(side == 0), distance=self.distance)
            if not self.distance:  # the operator's direction at the neighbour's scale (see the module docstring)
                t = t * (y.norm(dim=1) / t.norm(dim=1).clamp_min(1e-12)).unsqueeze(1)
            at = torch.from_numpy(ids[side][take] - self.old_counts[keys[side]])
            acc[keys[side]].index_add_(0, at, t.double())
            hits[keys[side]].index_add_(0, at, torch.ones(len(take), dtype=torch.float64))

    def fill(self, acc: dict[PartitionKey, torch.Tensor], hits: dict[PartitionKey, torch.Tensor]) -> int:
        """Set each new row reached this round to its targets' mean, scaled; returns how many were set."""
        filled = 0
        for key, known in self.known.items():
            reached = (hits[key] > 0).numpy() & ~known
            if not reached.any():
                continue
            mean = (acc[key] / hits[key].clamp_min(1).unsqueeze(1)).float() * NEIGHBOUR_SCALE
            g = self.global_embs[key[0]]
            if g is not None:
                mean = mean - g
            self.rows[key].values[reached] = mean.numpy()[reached]
            self.rows[key].from_neighbours += int(reached.sum())
            known |= reached
            filled += int(reached.sum())
        return filled


@torch.no_grad()
def initial_rows(
    config: ConfigSchema, model: Any, checkpoint: CheckpointStorage, *, old_version: int, new_version: int,
    old_counts: dict[PartitionKey, int], added: dict[PartitionKey, int], spills: list[tuple[str, np.ndarray]],
    grid: tuple[int, int],
) -> dict[PartitionKey, NewRows]:
    """The new rows of every partition (see the module docstring); ``spills`` hold the new edges per bucket."""
    rows = {key: NewRows(random_rows(config, key, n, new_version)) for key, n in added.items()}
    if config.grow_init != "neighbours" or not any(added.values()):
        return rows
    neighbours = _NeighbourFill(config, model, _TrainedPartitions(checkpoint, old_version), old_counts, rows)
    for round_index in range(NEIGHBOUR_ROUNDS):
        acc = {key: torch.zeros((n, config.dimension), dtype=torch.float64) for key, n in added.items()}
        hits = {key: torch.zeros(n, dtype=torch.float64) for key, n in added.items()}
        for group in _edge_groups(config, spills, grid):
            neighbours.accumulate(group, acc, hits)
        filled_now = neighbours.fill(acc, hits)
        logger.info("grow: neighbours round %d filled %d new rows", round_index + 1, filled_now)
        if not filled_now:
            break
    return rows


def write_grown_partitions(
    config: ConfigSchema, checkpoint: CheckpointStorage, old_version: int, new_version: int,
    rows: dict[PartitionKey, NewRows], metadata: dict[str, Any],
) -> None:
    """Every partition of ``new_version``: the trained rows and sums exactly as in ``old_version``, then the new
    rows with zero sums."""
    for key in sorted(rows):
        values, state = checkpoint.load_entity_partition(old_version, key[0], key[1])
        # per coordinate with entity_optimizer: adagrad (one float per row otherwise), as the trainer keeps them
        sum_shape = values.shape if per_coordinate(config, key[0]) else values.shape[:1]
        sums, step = sums_from_state(state, values.shape[0], values.shape[1], len(sum_shape) == 2)
        old_sums = sums.numpy() if sums is not None else np.zeros(sum_shape, dtype=np.float32)
        grown = np.concatenate([values, rows[key].values.astype(np.float32)])
        new_sums = np.zeros((len(rows[key].values), *sum_shape[1:]), dtype=np.float32)
        grown_sums = torch.from_numpy(np.concatenate([old_sums, new_sums]))
        checkpoint.save_entity_partition(new_version, key[0], key[1], grown,
                                         entity_adagrad_state(grown_sums, config.lr, step), metadata)
