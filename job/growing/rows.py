"""The rows of the grown checkpoint: trained rows copied unchanged, new rows initialised.

``random`` draws new rows as a fresh run would (normal, ``init_scale``), seeded by type, partition
and version so that a grow is reproducible. ``neighbours`` places each new entity where the trained
model would score its new edges highly: an edge (u, r, v) scores ``c(u, f_r(v))``, so

- a new u linked to a trained v should be near ``f_r(v)``;
- a new v linked to a trained u should be near the pre-image of u under ``f_r``: the adjoint
  ``f_r^T(u)`` for the dot and cosine comparators (it maximises the dot product for a given norm),
  the inverse for the l2 comparators (it makes the distance zero);
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
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from job.config import ConfigSchema
from job.formats.checkpoint import CheckpointStorage
from job.growing.ingest import read_spilled_bucket
from job.train.optim import row_adagrad_state
from job.train.partitions import _sum_from_state

logger = logging.getLogger("biggraph")

Key = tuple[str, int]
NEIGHBOUR_SCALE = 0.25  # the length of a neighbour-initialised row, as a fraction of its targets' mean
NEIGHBOUR_ROUNDS = 3  # rounds of filling new entities from neighbours filled in earlier rounds
_L2_COMPARATORS = ("l2", "squared_l2")


@dataclass
class NewRows:
    """The initial values of one partition's new rows (their Adagrad sums start at zero)."""

    values: np.ndarray  # (new, dim) float32
    from_neighbours: int = 0


def random_rows(config: ConfigSchema, key: Key, count: int, version: int) -> np.ndarray:
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
        self.loaded: dict[Key, torch.Tensor] = {}

    def get(self, key: Key) -> torch.Tensor:
        if key not in self.loaded:
            if len(self.loaded) >= self.capacity:
                self.loaded.pop(next(iter(self.loaded)))
            values, _ = self.checkpoint.load_entity_partition(self.version, key[0], key[1])
            self.loaded[key] = torch.from_numpy(values)
        return self.loaded[key]


def adjoint(op: Any, y: torch.Tensor, rel: Optional[torch.Tensor], l2: bool) -> torch.Tensor:
    """Where an entity x should be so that ``op(x)`` matches ``y``: the adjoint (dot/cos) or inverse (l2) of ``op``."""
    kind = op.kind
    if kind == "none":
        return y
    if kind == "diagonal":
        d = op._get("diagonal", rel)
        if not l2:
            return y * d
        usable = d.abs() > 1e-6
        return torch.where(usable, y / torch.where(usable, d, torch.ones_like(d)), torch.zeros_like(y))
    if kind == "translation":
        return y - op._get("translation", rel) if l2 else y
    if kind in ("linear", "affine"):
        z = y - op._get("translation", rel) if (kind == "affine" and l2) else y
        table = getattr(op, "linear_transformations" if op.dynamic else "linear_transformation")
        maps = torch.linalg.pinv(table) if l2 else table.transpose(-1, -2)
        if op.dynamic:
            return torch.matmul(maps.index_select(0, rel), z.unsqueeze(-1)).squeeze(-1)
        return z @ maps.t()
    real = op.real.index_select(0, rel) if op.dynamic else op.real
    imag = op.imag.index_select(0, rel) if op.dynamic else op.imag
    half = y.shape[-1] // 2
    y_re, y_im = y[..., :half], y[..., half:]
    out = torch.cat((y_re * real + y_im * imag, y_im * real - y_re * imag), dim=-1)  # times the conjugate
    if l2:
        modulus = (real * real + imag * imag).clamp_min(1e-12)
        out = out / torch.cat((modulus, modulus), dim=-1)
    return out


def targets(model: Any, rel_idx: int, rel: Optional[torch.Tensor], y: torch.Tensor, new_on_lhs: bool, l2: bool) -> torch.Tensor:
    """Where a new entity on one side of edges of ``rel_idx`` should be, given the other side's rows ``y``."""
    if model.num_dynamic_rels > 0:
        forward, reverse = model.rhs_operators[0], model.lhs_operators[0]
        if new_on_lhs:  # c(x, f(y)) and c(g(x), y)
            return (forward(y, rel) + adjoint(reverse, y, rel, l2)) / 2
        return (adjoint(forward, y, rel, l2) + reverse(y, rel)) / 2  # c(y, f(x)) and c(g(y), x)
    operator = model.rhs_operators[rel_idx]
    return operator(y) if new_on_lhs else adjoint(operator, y, None, l2)


@torch.no_grad()
def initial_rows(
    config: ConfigSchema, model: Any, checkpoint: CheckpointStorage, old_version: int, new_version: int,
    old_counts: dict[Key, int], added: dict[Key, int], spills: list[tuple[str, np.ndarray]], grid: tuple[int, int],
) -> dict[Key, NewRows]:
    """The new rows of every partition (see the module docstring); ``spills`` hold the new edges per bucket."""
    rows = {key: NewRows(random_rows(config, key, n, new_version)) for key, n in added.items()}
    if config.grow_init != "neighbours" or not any(added.values()):
        return rows
    trained = _TrainedPartitions(checkpoint, old_version)
    known = {key: np.zeros(n, dtype=bool) for key, n in added.items()}
    global_embs = {t: model.global_emb(t) for t in config.entities}
    l2 = config.comparator in _L2_COMPARATORS
    dim = config.dimension

    def rows_of(key: Key, ids: np.ndarray) -> torch.Tensor:
        """Rows (plus the global embedding) of known entities, trained or filled in an earlier round."""
        values = trained.get(key)
        old = old_counts[key]
        out = torch.empty((len(ids), dim))
        is_old = ids < old
        out[torch.from_numpy(is_old)] = values.index_select(0, torch.from_numpy(ids[is_old]))
        out[torch.from_numpy(~is_old)] = torch.from_numpy(rows[key].values[ids[~is_old] - old])
        g = global_embs[key[0]]
        return out + g if g is not None else out

    for round_index in range(NEIGHBOUR_ROUNDS):
        acc = {key: torch.zeros((n, dim), dtype=torch.float64) for key, n in added.items()}
        hits = {key: torch.zeros(n, dtype=torch.float64) for key, n in added.items()}
        for bucket_dir, counts in spills:
            for bucket in np.flatnonzero(counts):
                lhs_part, rhs_part = divmod(int(bucket), grid[1])
                rel, lhs, rhs = read_spilled_bucket(bucket_dir, int(bucket))
                groups = [(0, slice(None))] if config.dynamic_relations else [
                    (int(r), rel == r) for r in np.unique(rel)]
                for rel_idx, chosen in groups:
                    relation = config.relations[rel_idx]
                    keys = [(relation.lhs, lhs_part if config.entities[relation.lhs].num_partitions > 1 else 0),
                            (relation.rhs, rhs_part if config.entities[relation.rhs].num_partitions > 1 else 0)]
                    ids = [lhs[chosen], rhs[chosen]]
                    rel_ids = torch.from_numpy(rel[chosen]) if config.dynamic_relations else None
                    is_new = [ids[s] >= old_counts[keys[s]] for s in (0, 1)]
                    is_known = []
                    for s in (0, 1):
                        filled = np.zeros(len(ids[s]), dtype=bool)
                        filled[is_new[s]] = known[keys[s]][ids[s][is_new[s]] - old_counts[keys[s]]]
                        is_known.append(~is_new[s] | filled)
                    for side, other in ((0, 1), (1, 0)):
                        take = np.flatnonzero(is_new[side] & ~is_known[side] & is_known[other])
                        if not len(take):
                            continue
                        y = rows_of(keys[other], ids[other][take])
                        selected = rel_ids.index_select(0, torch.from_numpy(take)) if rel_ids is not None else None
                        t = targets(model, rel_idx, selected, y, new_on_lhs=(side == 0), l2=l2)
                        if not l2:  # the operator's direction at the neighbour's scale (see the module docstring)
                            t = t * (y.norm(dim=1) / t.norm(dim=1).clamp_min(1e-12)).unsqueeze(1)
                        at = torch.from_numpy(ids[side][take] - old_counts[keys[side]])
                        acc[keys[side]].index_add_(0, at, t.double())
                        hits[keys[side]].index_add_(0, at, torch.ones(len(take), dtype=torch.float64))
        filled_now = 0
        for key in added:
            reached = (hits[key] > 0).numpy() & ~known[key]
            if not reached.any():
                continue
            mean = (acc[key] / hits[key].clamp_min(1).unsqueeze(1)).float() * NEIGHBOUR_SCALE
            g = global_embs[key[0]]
            if g is not None:
                mean = mean - g
            rows[key].values[reached] = mean.numpy()[reached]
            rows[key].from_neighbours += int(reached.sum())
            known[key] |= reached
            filled_now += int(reached.sum())
        logger.info("grow: neighbours round %d filled %d new rows", round_index + 1, filled_now)
        if not filled_now:
            break
    return rows


def write_grown_partitions(
    config: ConfigSchema, checkpoint: CheckpointStorage, old_version: int, new_version: int,
    rows: dict[Key, NewRows], metadata: dict[str, Any],
) -> None:
    """Every partition of ``new_version``: the trained rows and sums exactly as in ``old_version``, then the new
    rows with zero sums."""
    for key in sorted(rows):
        values, state = checkpoint.load_entity_partition(old_version, key[0], key[1])
        sums, step = _sum_from_state(state, values.shape[0])
        old_sums = sums.numpy() if sums is not None else np.zeros(values.shape[0], dtype=np.float32)
        grown = np.concatenate([values, rows[key].values.astype(np.float32)])
        new_sums = np.zeros(len(rows[key].values), dtype=np.float32)
        grown_sums = torch.from_numpy(np.concatenate([old_sums, new_sums]))
        checkpoint.save_entity_partition(new_version, key[0], key[1], grown,
                                         row_adagrad_state(grown_sums, config.lr, step), metadata)
