"""One bucket of a pass: hold its partitions, read its edges, hold out its eval edges, train, evaluate.

``BucketRunner`` works on one bucket whoever scheduled it. The trainer (job/train/trainer.py) owns one, built from
its collaborators (``BucketWork``: the model, the partition store, the edge source ...); the runner owns the
Hogwild worker pool it starts on first need.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from job.config import ConfigSchema
from job.errors import UserError
from job.eval_protocol import largest_partition, protocol_fields, resolve_protocol
from job.model.kernel_options import KernelOptions
from job.model.scoring import Model, Table
from job.train.batch.batching import process_edges, process_slices, split_almost_equally
from job.train.batch.graphs import GraphedSteps
from job.train.batch.optim import RelationAdagrad
from job.train.batch.ranking import rank_bucket
from job.train.batch.step import BatchContext, BatchStats, BucketAbandoned
from job.train.edge_source import EdgeSource
from job.train.hogwild.pool import WorkerPool
from job.train.inputs import EdgeTensors, edge_limits
from job.train.residency.partitions import PartitionStore
from job.train.schedule.interfaces import Iteration
from job.types import Bucket, PartitionKey

logger = logging.getLogger("biggraph")

DEVICE_SHUFFLE_EDGES = 1 << 24  # a GPU bucket of at least this many edges is shuffled on the GPU (``_split``)

# BENCHMARK ONLY (bench/scale_bench.py). Set, it replaces a bucket's batch arithmetic by a wait of its training
# edges / this rate (edges per second): no batch runs, no row changes, held-out edges are not ranked, and the
# bucket's stats count its edges with zero loss. Everything else (partitions held, read, handed over, written; the
# lock server; the shared-parameter sync, of a zero change) runs for real. Why: one 2-vCPU machine can then host
# the coordination of 16 pods at the speed of a real pod (200k edges/s) or a GPU (1.8M). Unset: training as usual.
SIMULATED_COMPUTE_ENV = "BIGGRAPH_BENCH_SIMULATED_EDGES_PER_S"


def simulated_edges_per_s() -> Optional[float]:
    """The rate of ``SIMULATED_COMPUTE_ENV`` when it is set (read once, by each ``BucketRunner``), else None."""
    raw = os.environ.get(SIMULATED_COMPUTE_ENV, "").strip()
    if not raw:
        return None
    try:
        rate = float(raw)
    except ValueError:
        rate = 0.0
    if not rate > 0 or rate == float("inf"):
        raise UserError(f"environment variable {SIMULATED_COMPUTE_ENV}={raw!r}: expected a positive number of "
                        f"edges per second (a benchmark-only setting; unset it to train)")
    return rate


def simulate_compute(num_edges: int, rate: float, stop: Optional[Callable[[], bool]] = None) -> BatchStats:
    """Wait ``num_edges / rate`` seconds in place of training them (``SIMULATED_COMPUTE_ENV``), polling ``stop``
    as the batches would (True gives the bucket up: ``BucketAbandoned``)."""
    deadline = time.perf_counter() + num_edges / rate
    while (left := deadline - time.perf_counter()) > 0:
        if stop is not None and stop():
            raise BucketAbandoned("the round ends: the bucket in (simulated) training is given up")
        time.sleep(min(left, 0.05))
    return BatchStats(count=num_edges, loss=0.0)



@dataclass(frozen=True, kw_only=True)
class BucketWork:
    """What training a bucket needs, given once (the trainer builds it; ``biggraph grow`` passes its edge source)."""

    config: ConfigSchema
    model: Model
    relation_optimizer: RelationAdagrad
    store: PartitionStore
    device: torch.device
    workers: int  # Hogwild processes (1 on a GPU, or when the trainer is asked for none)
    slices_per_bucket: int  # PBG's workers: how many slices a bucket's edges are cut into, on every device
    entity_counts: dict[str, list[int]]
    num_dynamic_rels: int
    num_chunks: int
    grid: tuple[int, int]  # partitions on the lhs and rhs sides: buckets per pass = lhs x rhs
    edge_source: EdgeSource
    kernel_options: KernelOptions  # the training step's kernels, here and in every Hogwild worker


class BucketRunner:
    """Trains and evaluates one bucket with the trainer's model, partition store and its own worker pool."""

    def __init__(self, work: BucketWork) -> None:
        self.work = work
        self.config = work.config
        self.model = work.model
        self.relation_optimizer = work.relation_optimizer
        self.store = work.store
        self.device = work.device
        self.entity_counts = work.entity_counts
        self.pool: Optional[WorkerPool] = None  # started on first need (small graphs never pay for it)
        self.lr_scale = 1.0  # the learning-rate schedule's factor for the pass in flight (``set_lr_scale``)
        # a GPU's captured training steps, kept across buckets (job/train/batch/graphs.py): made on first need
        self.graphs: Optional[GraphedSteps] = None
        self.simulated_rate = simulated_edges_per_s()  # benchmark only: see SIMULATED_COMPUTE_ENV

    def set_lr_scale(self, scale: float) -> None:
        """The learning-rate schedule's factor for the buckets that follow (job/train/lr_schedule.py): for this
        process's batches and relation optimizer now, for the Hogwild workers with each bucket's tasks."""
        self.lr_scale = scale
        self.relation_optimizer.scale = scale

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.graphs is not None:
            # now, not whenever the collector finds the runner: a CUDA graph destroyed while another is being
            # captured (a later trainer in this process) breaks that capture (seen on an H200, torch 2.11)
            self.graphs.release()
            self.graphs = None

    def _keys_for(self, bucket: Bucket) -> tuple[dict[int, PartitionKey], dict[int, PartitionKey]]:
        """Per relation, the (entity type, partition) of its lhs and rhs tables in ``bucket``."""
        config = self.config
        lhs_keys: dict[int, PartitionKey] = {}
        rhs_keys: dict[int, PartitionKey] = {}
        for rel_idx, relation in enumerate(config.relations):
            lhs_part = bucket.lhs if config.entities[relation.lhs].num_partitions > 1 else 0
            rhs_part = bucket.rhs if config.entities[relation.rhs].num_partitions > 1 else 0
            lhs_keys[rel_idx] = (relation.lhs, lhs_part)
            rhs_keys[rel_idx] = (relation.rhs, rhs_part)
        return lhs_keys, rhs_keys

    def needs(self, bucket: Bucket) -> set[PartitionKey]:
        """The partitions ``bucket`` holds."""
        lhs_keys, rhs_keys = self._keys_for(bucket)
        return set(lhs_keys.values()) | set(rhs_keys.values())

    def _tables_for(self, bucket: Bucket, upcoming: Sequence[set[PartitionKey]] = ()
                    ) -> tuple[dict[int, Table], dict[int, Table], list[PartitionKey]]:
        lhs_keys, rhs_keys = self._keys_for(bucket)
        evicted = self.store.hold(set(lhs_keys.values()) | set(rhs_keys.values()), upcoming)
        return (
            {r: self._training_view(k) for r, k in lhs_keys.items()},
            {r: self._training_view(k) for r, k in rhs_keys.items()},
            evicted,
        )

    def _training_view(self, key: PartitionKey) -> Table:
        """The resident table of ``key`` as batches see it: without its optimizer state when the type is frozen,
        which makes the step leave its rows (and that state, still held by the store) untouched."""
        table = self.store.get(key)
        return Table(table.weight, None) if self.config.entities[key[0]].frozen else table

    def _split(self, iteration: Iteration, bucket: Bucket, bucket_idx: int, num_edges: int, seed_base: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
        """(shuffled training edges, held-out eval edges, the bucket's generator). The held-out edges depend
        only on where they are, so they are the same every epoch."""
        config = self.config
        # a large bucket on a GPU is shuffled there, by the device's generator seeded alike (a 338M-edge bucket
        # takes ~10 s per permutation on a CPU core); smaller ones on the CPU, so a seeded run is the same on both
        where = self.device if self.device.type == "cuda" and num_edges >= DEVICE_SHUFFLE_EDGES else torch.device("cpu")
        split_generator = torch.Generator(device=where)
        split_generator.manual_seed(zlib.crc32(f"{iteration.edge_path_idx}/{iteration.chunk_idx}/{bucket}".encode())
                                    + (config.seed or 0))
        num_eval = int(num_edges * config.eval_fraction)
        permutation = torch.randperm(num_edges, generator=split_generator, device=where)
        eval_indices = permutation[num_edges - num_eval:] if num_eval else permutation[:0]
        train_indices = permutation[: num_edges - num_eval]
        shuffle_seed = seed_base * 1_000_003 + iteration.index * 10_007 + bucket_idx
        shuffle_generator = torch.Generator()  # the batches' negatives are drawn from it, on the CPU everywhere
        shuffle_generator.manual_seed(shuffle_seed)
        if where.type == "cuda":
            on_device = torch.Generator(device=where)
            on_device.manual_seed(shuffle_seed)
            order = torch.randperm(train_indices.numel(), generator=on_device, device=where)
        else:
            order = torch.randperm(train_indices.numel(), generator=shuffle_generator)
        train_indices = train_indices[order]
        return train_indices.to(self.device), eval_indices.to(self.device), shuffle_generator

    def run(
        self, iteration: Iteration, bucket: Bucket, bucket_idx: int, *, edge_path: str, seed_base: int, delayed: bool,
        on_evicted: Optional[Callable[[list[PartitionKey]], None]] = None, upcoming: Sequence[set[PartitionKey]] = (),
        stop: Optional[Callable[[], bool]] = None, on_edges: Optional[Callable[[EdgeTensors], None]] = None,
    ) -> tuple[dict[str, Any], BatchStats, float]:
        """Train one bucket; returns its stats record, its training sums and its compute seconds. ``delayed``:
        Hogwild workers but the first start ``hogwild_delay`` seconds late (PBG: every bucket of epoch 0).
        ``stop``: polled while it trains; True gives the bucket up (``BucketAbandoned``, its tables then hold part
        of its update and the caller must not write them). ``on_edges``: called with the bucket's edges once read,
        before anything reads the model (a group's pull of the relation rows they name)."""
        config = self.config
        io_before = self.store.io_seconds
        swap_started = time.perf_counter()
        lhs_tables, rhs_tables, evicted = self._tables_for(bucket, upcoming)
        if on_evicted is not None and evicted:
            on_evicted(evicted)
        if upcoming and config.prefetch_partitions:
            # while this bucket trains: write back what the next one evicts, read what it needs
            self.store.prepare(upcoming[0], self.needs(bucket), upcoming[1:])
        work = self.work
        edges = work.edge_source.read(iteration, edge_path, bucket, work.num_chunks,
                                      edge_limits(self.config, self.entity_counts, work.num_dynamic_rels, bucket))
        if on_edges is not None:
            on_edges(edges)
        if self.device.type == "cuda":
            edges = edges.to(self.device)
        io_seconds = time.perf_counter() - swap_started
        train_indices, eval_indices, generator = self._split(iteration, bucket, bucket_idx, len(edges), seed_base)
        if self.simulated_rate is not None:  # benchmark only (SIMULATED_COMPUTE_ENV): a wait, not the arithmetic
            compute_started = time.perf_counter()
            simulated = simulate_compute(train_indices.numel(), self.simulated_rate, stop)
            return (self._record(iteration, bucket, bucket_idx, simulated, time.perf_counter() - compute_started,
                                 io_seconds, io_before), simulated, time.perf_counter() - compute_started)
        evaluating = eval_indices.numel() > 0
        eval_before = self._evaluate(edges, eval_indices, lhs_tables, rhs_tables, generator) if evaluating else None
        if work.workers > 1 and self.pool is None and train_indices.numel() >= 2 * config.batch_size:
            # started on first need (small graphs never pay for it), and before the compute clock starts
            self.pool = WorkerPool(work.workers, config, self.model, self.relation_optimizer, work.kernel_options)
        compute_started = time.perf_counter()
        train_stats = self._train(edges, train_indices, lhs_tables, rhs_tables, generator, delayed, stop)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the kernels run behind the host: the clock stops when they end
        compute_seconds = time.perf_counter() - compute_started
        eval_after = self._evaluate(edges, eval_indices, lhs_tables, rhs_tables, generator) if evaluating else None
        record = self._record(iteration, bucket, bucket_idx, train_stats, compute_seconds, io_seconds, io_before)
        if eval_before is not None and eval_after is not None:
            protocol = protocol_fields(self.eval_protocol())
            record["eval_stats_before"] = {"count": eval_before.count, "metrics": eval_before.ranking_metrics(), **protocol}
            record["eval_stats_after"] = {"count": eval_after.count, "metrics": eval_after.ranking_metrics(), **protocol}
        logger.debug("bucket %s: %s", bucket, json.dumps(record))
        return record, train_stats, compute_seconds

    def _record(self, iteration: Iteration, bucket: Bucket, bucket_idx: int, train_stats: BatchStats,
                compute_seconds: float, io_seconds: float, io_before: float) -> dict[str, Any]:
        """The bucket's stats record (training_stats.json), without its held-out ranks."""
        grid = self.work.grid
        return {
            "epoch_idx": iteration.epoch, "edge_path_idx": iteration.edge_path_idx,
            "edge_chunk_idx": iteration.chunk_idx, "lhs_partition": bucket.lhs, "rhs_partition": bucket.rhs,
            "index": iteration.index * grid[0] * grid[1] + bucket_idx,
            "stats": {"count": train_stats.count, "metrics": train_stats.training_metrics()},
            "edges_per_sec": train_stats.count / compute_seconds if compute_seconds > 0 else 0.0,
            "time": compute_seconds, "io_time": io_seconds, "swap_time": self.store.io_seconds - io_before,
        }

    def _context(self, lhs_tables: dict[int, Table], rhs_tables: dict[int, Table], train: bool,
                 stop: Optional[Callable[[], bool]] = None) -> BatchContext:
        config = self.config
        return BatchContext(
            config=config, model=self.model, relation_optimizer=self.relation_optimizer if train else None,
            lhs_tables=lhs_tables, rhs_tables=rhs_tables,
            num_batch_negs=config.num_batch_negs if train else config.eval_num_batch_negs,
            num_uniform_negs=config.num_uniform_negs if train else config.eval_num_uniform_negs,
            options=self.work.kernel_options, lr_scale=self.lr_scale if train else 1.0, stop=stop,
        )

    def _train(self, edges: EdgeTensors, indices: torch.Tensor, lhs_tables: dict[int, Table],
               rhs_tables: dict[int, Table], generator: torch.Generator, delayed: bool,
               stop: Optional[Callable[[], bool]] = None) -> BatchStats:
        """Train on the shuffled edges ``indices``, cut as PBG 1.0.0 cuts them (torchbiggraph/train.py,
        ``train_and_report_stats``): exactly ``workers`` slices of floor/ceil sizes, each processed in batches
        of ``batch_size`` per relation, so a bucket takes PBG's number of optimizer steps whatever its size
        and device. The slices run on the Hogwild pool when there is one and the bucket is worth it (at
        least two full batches); otherwise one after another in this process (a GPU, a tiny bucket): the
        same batches, without the overlap of concurrent workers."""
        config = self.config
        slices = [indices[s] for s in split_almost_equally(indices.numel(), self.work.slices_per_bucket)]
        if self.pool is None or indices.numel() < 2 * config.batch_size:
            if self.device.type == "cuda" and self.graphs is None:
                self.graphs = GraphedSteps()
            return process_slices(self._context(lhs_tables, rhs_tables, True, stop), edges, slices, config.batch_size,
                                  config.dynamic_relations, generator, True, graphs=self.graphs)
        slices = [s.clone() for s in slices]
        seeds = [int(torch.randint(0, 2**62, (1,), generator=generator)) for _ in slices]
        # PBG delays every worker but the first by hogwild_delay on each bucket of epoch 0 (train.py,
        # train_and_report_stats: ``delay=... if epoch_idx == 0 and rank > 0``); meanwhile the workers already
        # running take the delayed slices' batches (work_sharing.py)
        delays = [0.0] + [config.hogwild_delay if delayed else 0.0] * (len(slices) - 1)
        edges.share_memory_()
        return self.pool.run(edges, slices, lhs_tables, rhs_tables, seeds=seeds, train=True, num_batch_negs=config.num_batch_negs,
                             num_uniform_negs=config.num_uniform_negs, delays=delays, lr_scale=self.lr_scale, stop=stop)

    def eval_protocol(self) -> str:
        """The protocol of the held-out ranks (``eval_protocol``; ``auto`` decided by the largest partition a
        side is ranked against, so every bucket of the run uses the same one)."""
        return resolve_protocol(self.config.eval_protocol, self.config, largest_partition(self.config, self.entity_counts))

    def _evaluate(self, edges: EdgeTensors, indices: torch.Tensor, lhs_tables: dict[int, Table],
                  rhs_tables: dict[int, Table], generator: torch.Generator) -> BatchStats:
        config = self.config
        eval_tables_l = {r: Table(t.weight, None) for r, t in lhs_tables.items()}
        eval_tables_r = {r: Table(t.weight, None) for r, t in rhs_tables.items()}
        protocol = self.eval_protocol()
        if protocol != "pbg":
            return rank_bucket(config, self.model, eval_tables_l, eval_tables_r, edges, indices, protocol, generator)
        return process_edges(self._context(eval_tables_l, eval_tables_r, False), edges, indices, config.batch_size,
                             config.dynamic_relations, generator, False)


class HogwildStagger:
    """Which buckets of epoch 0 hold every Hogwild worker but the first back by ``hogwild_delay`` seconds.

    PBG's reason for the delay is fresh rows: on a table nobody has trained yet, workers starting together
    make their first large updates to the same rows at once. That holds for a bucket with a partition this
    process has not trained before, not for the other buckets of epoch 0, which PBG 1.0.0 delays too (P x P
    per edge path and chunk: at P=16 with 2 workers an epoch of the generated 2M-entity graph took 86.8 s
    against 59.9 s without the delay, bench/RESULTS.md). ``first_visit`` (the default) delays a bucket only
    when one of its partitions is new to this process, so at most one bucket per partition; ``epoch_0`` is
    PBG's rule. A resumed epoch 0 forgets what the killed process trained: it delays those buckets again,
    which costs seconds and changes nothing that matters."""

    def __init__(self, config: ConfigSchema, workers: int, enabled: bool) -> None:
        self.seconds = config.hogwild_delay
        self.every_bucket = config.hogwild_delay_scope == "epoch_0"
        self.workers = workers
        self.enabled = enabled and workers > 1 and config.hogwild_delay > 0
        self.trained: set[PartitionKey] = set()

    def delays(self, epoch: int, partitions: set[PartitionKey]) -> bool:
        """Whether the bucket of ``epoch`` holding ``partitions`` staggers its workers; records them as trained."""
        fresh = not partitions <= self.trained
        self.trained |= partitions
        return self.enabled and epoch == 0 and (self.every_bucket or fresh)

    def cost_note(self, buckets_in_epoch_0: int, partitions: int) -> Optional[str]:
        """What the delay will cost the first epoch, when it is worth a line in the log: the running workers
        take the held ones' batches (``work_sharing.py``), so what is lost is (W-1)/W of the delay per bucket."""
        delayed = buckets_in_epoch_0 if self.every_bucket else min(buckets_in_epoch_0, partitions)
        if not self.enabled or delayed < 2:
            return None
        lost = self.seconds * delayed * (self.workers - 1) / self.workers
        which = ("each of the {} buckets of epoch 0 (hogwild_delay_scope: epoch_0, PBG's rule)" if self.every_bucket
                 else "at most {} buckets of epoch 0, those with a partition not trained before")
        return (f"hogwild_delay: one of {self.workers} Hogwild workers trains alone for the first {self.seconds:g} s "
                f"of {which.format(delayed)}, up to {lost:.0f} s of wall time; hogwild_delay: 0 skips it")


ALL_NEGS_NOTE_ENTITIES = 50_000  # candidates per batch above which all_negs is worth a warning


def all_negs_cost(config: ConfigSchema, entity_counts: dict[str, list[int]]) -> Optional[str]:
    """A warning when ``all_negs`` makes every batch a product with a large table, else None.

    With ``all_negs`` each batch scores both sides of its edges against every entity of the partition: about
    12 x batch x entities x dimension FLOPs with the gradients. On the 112k-entity WordNet KG that is ~134 GFLOP
    per batch of 500, and one epoch took 877 s where ten epochs of ``quality_sampled`` (sampled negatives) took
    415 s and ranked better (bench/RESULTS.md). A user who set ``preset: quality`` on a large graph should learn
    that before the epoch, not after it.
    """
    worst: Optional[tuple[int, str, str]] = None
    for relation in config.relations:
        if not relation.all_negs:
            continue
        for entity_type in (relation.lhs, relation.rhs):
            candidates = max(entity_counts.get(entity_type) or [0])
            if candidates > ALL_NEGS_NOTE_ENTITIES and (worst is None or candidates > worst[0]):
                worst = (candidates, relation.name, entity_type)
    if worst is None:
        return None
    candidates, relation_name, entity_type = worst
    gflop = 12 * config.batch_size * candidates * config.entity_dimension(entity_type) / 1e9
    return (f"all_negs: relation '{relation_name}' scores every batch of {config.batch_size} edges against all "
            f"{candidates:,} entities of a partition of type '{entity_type}' (~{gflop:,.0f} GFLOP per batch with its "
            f"gradients); for types this large, sampled negatives (preset: quality_sampled, or all_negs: false) "
            f"train far faster per unit of MRR (docs/quality-preset.md)")
