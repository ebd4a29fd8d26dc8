"""A Freebase86m-size graph written straight to PBG's input format v1, fast enough to make on a lent GPU machine.

Freebase86m itself (86,054,151 entities, 338,586,276 edges, 14,824 relations) is not on the device and cannot be
downloaded there, so the GPU epoch of issue #48 trains on a graph of its size and shape made on the spot. The shape
is what matters to a trainer's speed: one entity type, dynamic relations, a few hub entities that most batches
touch and a long tail that each is touched a few times, a few relations that hold most edges.

The distributions (the graph is a function of the sizes, the seed and ``block_edges`` alone):

- **Entities.** Each endpoint is drawn by popularity rank ``k = floor(N * u ** (1 / (1 - a)))`` with ``u`` uniform
  in [0, 1): a continuous power law, P(rank <= k) = (k / N) ** (1 - a), so an entity's expected degree falls as
  ``k ** -a``. Heads use ``a = 0.6`` and tails ``a = 0.75`` (objects are the more skewed side of a knowledge graph:
  types, countries, languages). At the full size the top head rank takes ~0.07% of the edges and the top tail
  rank ~1%, while the least popular entity expects ~2.5 edges, so some tail entities have none (Freebase86m has
  none without an edge; a trainer does not care). Ranks become ids through ``id = (k * m + c) mod N`` with ``m``
  coprime to N (one ``m, c`` per side), which scatters the hubs over the id range and so over the partitions, as
  the importer's random assignment would. Duplicate edges can occur among the hubs.
- **Relations.** Zipf with exponent 1.2 over the ids 0..R-1 (id 0 the most frequent), quantised to a table of
  2**20 slots, each relation at least one (so every relation id occurs, ~320 edges for the rarest at full size):
  the top relation holds ~20% of the edges and the top ten ~50%.
- **Partitions.** Contiguous ranges of ids: partition p holds ids ceil(p N / P) .. ceil((p+1) N / P) - 1, written to
  ``entity_count_node_{p}.txt``; an edge goes into ``edges_{l}_{r}.h5`` by its endpoints' partitions, with ids local
  to them. The same seed gives the same global graph at every P: only its split differs, so P=1 and P=4 train on
  the same edges.

Speed: the edges are made in blocks of ``block_edges`` (4Mi), block i from its own ``PCG64(SeedSequence([seed,
i]))``, on a thread pool (numpy's bulk generators and ufuncs release the GIL), each block sorted by bucket with
numpy's radix sort (a stable sort of 8- or 16-bit keys); then each bucket file is written once, its three
datasets created at their final size (contiguous int32, the format's smallest type for these ids; the reader
widens to int64) and filled block by block. So the output is identical whatever the thread count. No checksum
manifest is written (the importer's files have one; a file without one is read unverified, and every chunk is
still bounds-checked against the entity counts).

The training config written beside the graph (``config.json``) is ComplEx (``complex_diagonal`` + ``dot``,
``softmax`` loss) at dimension 100 with ``dynamic_relations`` and one epoch, as the GPU systems report
Freebase86m. Its defaults follow Marius's Freebase86m GPU recipe (marius-team/marius,
examples/training/configs/freebase86m_gpu.ini: batch_size 10000, 512 negatives of which degree_fraction 0.5 are
degree-based, Adagrad at lr 0.1): batch_size 10000, num_batch_negs 250 (PBG's in-batch negatives are drawn by
degree; 256 does not divide 10000, which our config requires) and num_uniform_negs 250, lr 0.1.

    python3 bench/freebase_like.py --out /tmp/fb --partitions 1            # the full Freebase86m size
    python3 bench/freebase_like.py --out /tmp/fb --entities 4302708 --edges 16929314 --partitions 4 --stats
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from job.formats.edges import EDGE_DATASETS, FORMAT_VERSION, FORMAT_VERSION_ATTR, edges_file  # noqa: E402
from job.formats.entities import write_dynamic_rel_count, write_entity_count  # noqa: E402

FREEBASE86M = {"entities": 86_054_151, "edges": 338_586_276, "relations": 14_824}
ENTITY_TYPE = "node"
ID_DTYPE = np.dtype(np.int32)
REL_TABLE_BITS = 20
GOLDEN = (math.sqrt(5) - 1) / 2  # the multipliers' starting point: far from any small ratio of N


class SpecError(ValueError):
    """Sizes the generator cannot make a graph of (the CLI prints it on one line and exits 2)."""


@dataclass(frozen=True)
class GraphSpec:
    """What the graph is made of; equal specs give byte-identical files whatever the thread count."""

    num_entities: int
    num_edges: int
    num_relations: int
    num_partitions: int = 1
    seed: int = 0
    block_edges: int = 1 << 22
    lhs_exponent: float = 0.6
    rhs_exponent: float = 0.75
    relation_exponent: float = 1.2

    def check(self) -> None:
        if not 1 <= self.num_entities <= np.iinfo(ID_DTYPE).max:
            raise SpecError(f"--entities {self.num_entities}: expected 1 .. {np.iinfo(ID_DTYPE).max}")
        if self.seed < 0:
            raise SpecError(f"--seed {self.seed}: expected a non-negative integer")
        if self.num_edges < 0:
            raise SpecError(f"--edges {self.num_edges}: expected a non-negative count")
        if not 1 <= self.num_relations <= 1 << (REL_TABLE_BITS - 1):
            raise SpecError(f"--relations {self.num_relations}: expected 1 .. {1 << (REL_TABLE_BITS - 1)}")
        if not 1 <= self.num_partitions <= min(256, self.num_entities):
            raise SpecError(f"--partitions {self.num_partitions}: expected 1 .. min(256, entities)")
        if self.block_edges < 1:
            raise SpecError(f"--block-edges {self.block_edges}: expected a positive count")
        for name in ("lhs_exponent", "rhs_exponent"):
            if not 0 <= getattr(self, name) < 1:
                raise SpecError(f"{name} {getattr(self, name)}: expected 0 <= a < 1")

    def partition_starts(self) -> np.ndarray:
        """The first id of every partition, and N at the end: ceil(p N / P)."""
        parts = np.arange(self.num_partitions + 1, dtype=np.int64)
        return (parts * self.num_entities + self.num_partitions - 1) // self.num_partitions

    def partition_counts(self) -> list[int]:
        return [int(c) for c in np.diff(self.partition_starts())]

    def num_blocks(self) -> int:
        return -(-self.num_edges // self.block_edges)


@dataclass(frozen=True)
class TrainSpec:
    """The training config's knobs that a bench varies (the rest is fixed: see the module docstring)."""

    dimension: int = 100
    batch_size: int = 10_000
    num_batch_negs: int = 250
    num_uniform_negs: int = 250
    lr: float = 0.1
    checkpoint_path: str | None = None  # default: OUT/checkpoint
    device: str | None = None  # default: the config's default (cpu)
    workers: int | None = None

    def check(self) -> None:
        if self.num_batch_negs < 1 or self.batch_size % self.num_batch_negs:
            raise SpecError(f"--batch-size {self.batch_size}: expected a multiple of --num-batch-negs "
                            f"{self.num_batch_negs} (the trainer's config refuses it otherwise)")


@dataclass
class Block:
    """One block's edges, sorted by bucket (lhs partition * P + rhs partition), ids local to their partitions."""

    rel: np.ndarray
    lhs: np.ndarray
    rhs: np.ndarray
    offsets: np.ndarray  # bucket b's edges are [offsets[b], offsets[b + 1])


def coprime_multiplier(n: int, fraction: float) -> int:
    """The first integer at or above ``fraction * n`` coprime to n: ``k -> (k * m + c) mod n`` is then a bijection."""
    m = max(1, int(fraction * n))
    while math.gcd(m, n) != 1:
        m += 1
    return m


def relation_table(num_relations: int, exponent: float, bits: int = REL_TABLE_BITS) -> np.ndarray:
    """2**bits slots holding relation ids in proportion to Zipf(exponent), every id in at least one slot; a uniform
    slot index is then a draw (one gather, instead of a search per edge)."""
    slots = 1 << bits
    weights = np.arange(1, num_relations + 1, dtype=np.float64) ** -exponent
    counts = np.maximum(1, np.floor(weights / weights.sum() * slots)).astype(np.int64)
    counts[0] += slots - int(counts.sum())  # the rounding's remainder (either sign) to the most frequent id
    if counts[0] < 1:
        raise SpecError(f"--relations {num_relations}: too many for a {slots}-slot table")
    return np.repeat(np.arange(num_relations, dtype=ID_DTYPE), counts)


class Generator:
    """Makes the blocks of one ``GraphSpec`` (thread-safe: a block depends on its index alone)."""

    def __init__(self, spec: GraphSpec) -> None:
        spec.check()
        self.spec = spec
        self.table = relation_table(spec.num_relations, spec.relation_exponent)
        n = spec.num_entities
        self.sides = (
            (1 / (1 - spec.lhs_exponent), coprime_multiplier(n, GOLDEN), n // 3),
            (1 / (1 - spec.rhs_exponent), coprime_multiplier(n, GOLDEN / 2), (2 * n) // 3),
        )
        self.starts = spec.partition_starts()

    def entity_ids(self, rng: np.random.Generator, size: int, side: int) -> np.ndarray:
        """Global ids of one side's endpoints (int64): power-law ranks, scattered by the side's bijection."""
        power, multiplier, offset = self.sides[side]
        n = self.spec.num_entities
        u = rng.random(size)
        np.power(u, power, out=u)
        u *= n
        ranks = u.astype(np.int64)
        np.minimum(ranks, n - 1, out=ranks)  # u * n rounds up to n for u within an ulp of 1
        ranks *= multiplier
        ranks += offset
        ranks %= n
        return ranks

    def block(self, index: int) -> Block:
        spec = self.spec
        begin = index * spec.block_edges
        size = min(spec.block_edges, spec.num_edges - begin)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([spec.seed, index])))
        rel = self.table[rng.integers(0, len(self.table), size=size, dtype=np.int32)]
        lhs = self.entity_ids(rng, size, 0)
        rhs = self.entity_ids(rng, size, 1)
        parts = spec.num_partitions
        if parts == 1:
            return Block(rel, lhs.astype(ID_DTYPE), rhs.astype(ID_DTYPE), np.array([0, size], dtype=np.int64))
        key_dtype = np.uint8 if parts * parts <= 256 else np.uint16  # radix-sorted by numpy's stable sort
        starts = self.starts.astype(ID_DTYPE)
        sides = []
        for ids in (lhs, rhs):
            part = (ids * parts // spec.num_entities).astype(key_dtype)
            local = ids.astype(ID_DTYPE)
            local -= starts[part]
            sides.append((part, local))
        key = sides[0][0] * key_dtype(parts) + sides[1][0]  # < P*P: fits the key's type
        order = np.argsort(key, kind="stable")
        # the sorted keys' boundaries: cheaper than a bincount, which widens the keys to intp first
        # (needles of the keys' own type, so that the sorted keys are not widened to a common type)
        firsts = np.searchsorted(key[order], np.arange(parts * parts, dtype=key_dtype), side="left")
        offsets = np.append(firsts, size).astype(np.int64)
        return Block(rel[order], sides[0][1][order], sides[1][1][order], offsets)

    def blocks(self, threads: int) -> list[Block]:
        count = self.spec.num_blocks()
        if threads <= 1 or count <= 1:
            return [self.block(i) for i in range(count)]
        with ThreadPoolExecutor(max_workers=threads) as pool:
            return list(pool.map(self.block, range(count)))


def write_bucket(path: Path, blocks: Sequence[Block], bucket: int) -> int:
    """Write one bucket file (datasets sized once, filled block by block) under a temporary name, then rename it:
    a reader never sees half a file. Returns its size in bytes."""
    total = sum(int(b.offsets[bucket + 1] - b.offsets[bucket]) for b in blocks)
    partial = path.with_name(path.name + ".partial")
    with h5py.File(partial, "w") as handle:
        handle.attrs[FORMAT_VERSION_ATTR] = FORMAT_VERSION
        datasets = {name: handle.create_dataset(name, shape=(total,), dtype=ID_DTYPE) for name in EDGE_DATASETS}
        at = 0
        for block in blocks:
            begin, end = int(block.offsets[bucket]), int(block.offsets[bucket + 1])
            if end > begin:
                for name, dataset in datasets.items():
                    dataset[at : at + end - begin] = getattr(block, name)[begin:end]
                at += end - begin
    os.replace(partial, path)
    return path.stat().st_size


def training_config(out: Path, spec: GraphSpec, train: TrainSpec) -> dict[str, Any]:
    config: dict[str, Any] = {
        "entity_path": str(out),
        "edge_paths": [str(out / "edges")],
        "checkpoint_path": train.checkpoint_path or str(out / "checkpoint"),
        "entities": {ENTITY_TYPE: {"num_partitions": spec.num_partitions}},
        "relations": [{"name": "all", "lhs": ENTITY_TYPE, "rhs": ENTITY_TYPE, "operator": "complex_diagonal"}],
        "dynamic_relations": True,
        "global_emb": False,  # the config refuses per-type global embeddings with dynamic relations
        "dimension": train.dimension,
        "comparator": "dot",
        "loss_fn": "softmax",
        "num_epochs": 1,
        "batch_size": train.batch_size,
        "num_batch_negs": train.num_batch_negs,
        "num_uniform_negs": train.num_uniform_negs,
        "lr": train.lr,
        "eval_fraction": 0.0,
    }
    if train.device is not None:
        config["device"] = train.device
    if train.workers is not None:
        config["workers"] = train.workers
    return config


def write_graph(out: Path, spec: GraphSpec, train: TrainSpec, threads: int) -> dict[str, Any]:
    """Write the graph and its config into ``out``; returns what was written and how long each phase took."""
    started = time.perf_counter()
    generator = Generator(spec)
    (out / "edges").mkdir(parents=True, exist_ok=True)
    for part, count in enumerate(spec.partition_counts()):
        write_entity_count(str(out), ENTITY_TYPE, part, count)
    write_dynamic_rel_count(str(out), spec.num_relations)
    blocks = generator.blocks(threads)
    generated = time.perf_counter()
    parts = spec.num_partitions
    edge_bytes = 0
    for bucket in range(parts * parts):
        path = Path(edges_file(str(out / "edges"), bucket // parts, bucket % parts))
        edge_bytes += write_bucket(path, blocks, bucket)
    written = time.perf_counter()
    config_path = out / "config.json"
    config_path.write_text(json.dumps(training_config(out, spec, train), indent=2) + "\n")
    return {"config": str(config_path), "entities": spec.num_entities, "edges": spec.num_edges,
            "relations": spec.num_relations, "partitions": parts, "threads": threads, "blocks": len(blocks),
            "edge_bytes": edge_bytes, "generate_s": round(generated - started, 3),
            "write_s": round(written - generated, 3), "total_s": round(time.perf_counter() - started, 3)}


def degree_stats(out: Path, spec: GraphSpec) -> dict[str, Any]:
    """Degrees (head + tail) read back from the written files: the skew the trainer will see."""
    starts = spec.partition_starts()
    degree = np.zeros(spec.num_entities, dtype=np.int64)
    rel_counts = np.zeros(spec.num_relations, dtype=np.int64)
    parts = spec.num_partitions
    for lhs_part in range(parts):
        for rhs_part in range(parts):
            with h5py.File(edges_file(str(out / "edges"), lhs_part, rhs_part), "r") as handle:
                degree += np.bincount(handle["lhs"][:] + starts[lhs_part], minlength=spec.num_entities)
                degree += np.bincount(handle["rhs"][:] + starts[rhs_part], minlength=spec.num_entities)
                rel_counts += np.bincount(handle["rel"][:], minlength=spec.num_relations)
    top_rel = np.sort(rel_counts)[::-1]
    return {"max_degree": int(degree.max()), "median_degree": float(np.median(degree)),
            "mean_degree": float(degree.mean()), "zero_degree_fraction": float((degree == 0).mean()),
            "top_relation_share": float(top_rel[0] / max(1, spec.num_edges)),
            "top10_relation_share": float(top_rel[:10].sum() / max(1, spec.num_edges))}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="directory for the graph and config.json")
    parser.add_argument("--entities", type=int, default=FREEBASE86M["entities"])
    parser.add_argument("--edges", type=int, default=FREEBASE86M["edges"])
    parser.add_argument("--relations", type=int, default=FREEBASE86M["relations"])
    parser.add_argument("--partitions", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--block-edges", type=int, default=GraphSpec.block_edges,
                        help="edges per seeded block (part of the graph's definition, like the seed)")
    parser.add_argument("--dimension", type=int, default=TrainSpec.dimension)
    parser.add_argument("--batch-size", type=int, default=TrainSpec.batch_size)
    parser.add_argument("--num-batch-negs", type=int, default=TrainSpec.num_batch_negs)
    parser.add_argument("--num-uniform-negs", type=int, default=TrainSpec.num_uniform_negs)
    parser.add_argument("--lr", type=float, default=TrainSpec.lr)
    parser.add_argument("--checkpoint-path", default=None, help="default: OUT/checkpoint")
    parser.add_argument("--device", default=None, help="the config's device (default: left out, i.e. cpu)")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--stats", action="store_true", help="read the files back and print degree statistics")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    spec = GraphSpec(num_entities=args.entities, num_edges=args.edges, num_relations=args.relations,
                     num_partitions=args.partitions, seed=args.seed, block_edges=args.block_edges)
    train = TrainSpec(dimension=args.dimension, batch_size=args.batch_size, num_batch_negs=args.num_batch_negs,
                      num_uniform_negs=args.num_uniform_negs, lr=args.lr, checkpoint_path=args.checkpoint_path,
                      device=args.device, workers=args.workers)
    try:
        spec.check()
        train.check()
        summary = write_graph(args.out, spec, train, max(1, args.threads))
    except SpecError as err:
        print(f"freebase_like: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"freebase_like: cannot write {args.out}: {err.strerror or err}", file=sys.stderr)
        return 2
    if args.stats:
        summary.update(degree_stats(args.out, spec))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
