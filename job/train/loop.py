"""The training loop (``Trainer``): iteration state, buckets, eval split, checkpoint commits, stats."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

import storage_adapters as storage
from job.config import BucketOrder, ConfigSchema
from job.errors import CheckpointError, UserError
from job.formats import edges as edge_format
from job.formats import entities as entity_format
from job.formats.checkpoint import CheckpointStorage, SharedSumRegistry
from job.model.scoring import Model, Table
from job.train.batching import EdgeTensors, process_edges
from job.train.buckets import Bucket, all_buckets, buffer_order, lower_bound_loads, order_buckets
from job.train.buffer import choose_capacity
from job.train.distributed import (
    PROGRESS_FILE,
    LockClient,
    LockServer,
    LockState,
    SharedParameters,
    init_distributed,
    leave,
    wait_all,
)
from job.train.hogwild import WorkerPool
from job.train.partitions import PartitionStore
from job.train.step import BatchContext, BatchStats, RelationAdagrad
from storage_adapters.edge_reader import prefetch

logger = logging.getLogger("biggraph")


@dataclass(frozen=True)
class Iteration:
    """One pass over all buckets: an (epoch, edge set, edge chunk) triple; its index is the checkpoint version it makes."""

    index: int
    epoch: int
    edge_path_idx: int
    chunk_idx: int


def pick_device(config: ConfigSchema) -> torch.device:
    want_cuda = config.device == "cuda" or (config.device == "auto" and config.num_gpus > 0)
    if want_cuda:
        if not torch.cuda.is_available():
            raise UserError(
                f"config asks for a GPU (device={config.device!r}, num_gpus={config.num_gpus}) but CUDA is not available "
                "on this machine; set num_gpus=0 / device=cpu"
            )
        # one process per GPU: under torchrun each local rank takes its own card (several share one when
        # there are more processes than cards, which is slower but correct)
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def read_entity_counts(config: ConfigSchema) -> dict[str, list[int]]:
    return {
        entity_type: entity_format.read_entity_counts(config.entity_path, entity_type, entity.num_partitions)
        for entity_type, entity in config.entities.items()
    }


def bucket_grid(config: ConfigSchema) -> tuple[int, int]:
    """Number of lhs and rhs partitions that buckets range over (1 when a side's types are all unpartitioned)."""
    lhs = max(config.entities[r.lhs].num_partitions for r in config.relations)
    rhs = max(config.entities[r.rhs].num_partitions for r in config.relations)
    return lhs, rhs


def count_edge_chunks(config: ConfigSchema) -> int:
    if config.num_edge_chunks is not None:
        return config.num_edge_chunks
    nparts_lhs, nparts_rhs = bucket_grid(config)
    most = 0
    for edge_path in config.edge_paths:
        for lhs in range(nparts_lhs):
            for rhs in range(nparts_rhs):
                url = edge_format.edges_file(edge_path, lhs, rhs)
                # an edge takes at least 3 bytes, so small files need no opening
                if storage.size(url) // 3 <= config.max_edges_per_chunk:
                    continue
                most = max(most, edge_format.count_edges(url))
    return max(1, math.ceil(most / config.max_edges_per_chunk))


def edge_limits(config: ConfigSchema, counts: dict[str, list[int]], num_dynamic_rels: int,
                bucket: Bucket) -> edge_format.EdgeLimits:
    """The ids a bucket's edge files may hold (relation count, entity counts of its partitions)."""
    num_rel_ids = num_dynamic_rels if config.dynamic_relations else len(config.relations)
    return edge_format.EdgeLimits.for_bucket(config, counts, num_rel_ids, (bucket.lhs, bucket.rhs))


def edge_tensors(arrays: edge_format.EdgeArrays) -> EdgeTensors:
    def features(pair: Optional[tuple[Any, Any]]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        return None if pair is None else (torch.from_numpy(pair[0]), torch.from_numpy(pair[1]))

    return EdgeTensors(torch.from_numpy(arrays.rel), torch.from_numpy(arrays.lhs), torch.from_numpy(arrays.rhs),
                       features(arrays.lhs_features), features(arrays.rhs_features))


def _split_almost_equally(n: int, parts: int) -> list[slice]:
    size = math.ceil(n / parts) if parts else n
    return [slice(i * size, min(n, (i + 1) * size)) for i in range(parts) if i * size < n]


class Trainer:
    """Owns the model, the partitions in memory, the worker pool and the checkpoint directory."""

    def __init__(self, config: ConfigSchema) -> None:
        from job.formats.validate import validate_cheap

        self.config = config
        from job.growing.journal import finish_committed_grow

        # a grown version whose input a crash left unpublished is completed before the input is checked; the
        # leftovers of an uncommitted grow go, like those of an uncommitted pass
        finish_committed_grow(config.checkpoint_path, clean_uncommitted=os.environ.get("RANK", "0") == "0")
        validate_cheap(config)
        self.device = pick_device(config)
        if config.half_precision:
            logger.warning("half_precision is accepted for PBG configs but not implemented: training in float32")
        if config.seed is not None:
            torch.manual_seed(config.seed)
        self.entity_counts = read_entity_counts(config)
        self.num_dynamic_rels = (
            entity_format.read_dynamic_rel_count(config.entity_path) if config.dynamic_relations else 0
        )
        self.dist = init_distributed()
        self.rank = self.dist.rank if self.dist else 0
        self.checkpoint = CheckpointStorage(config.checkpoint_path)
        self.all_keys = [(t, p) for t, e in config.entities.items() for p in range(e.num_partitions)]
        if self.rank == 0:
            self.checkpoint.prepare()
        if self.dist is not None:
            wait_all(self.dist, f"prepared-{self.dist.restart_count}")
        self.version = self.checkpoint.load_version()
        self.progress: Optional[dict[str, Any]] = self._read_progress() if self.dist is not None else None
        if self.dist is not None:
            # a partition written by one rank is read by others: they verify it against the writer's record
            self.checkpoint.sums = SharedSumRegistry(self.dist.store, str(self.dist.restart_count))
        if self.rank == 0:
            self._remove_temporary_files()
            self.checkpoint.drop_uncommitted_manifests(self.version)
            # a kill between a commit and the clean-up after it leaves the previous version's files and, before
            # the marker, the stats lines of a version that never committed
            self.checkpoint.drop_older(self.version, self.all_keys)
            self.checkpoint.trim_stats(self.version)
            if self.progress is None:
                # leftovers of a pass that crashed before its commit are garbage
                self.checkpoint.drop_uncommitted(self.version, self.all_keys)
        if self.dist is not None:
            wait_all(self.dist, f"cleaned-{self.dist.restart_count}")
        self.model = Model(config, self.num_dynamic_rels).to(self.device)
        for entity_type, entity in config.entities.items():
            frozen_global = self.model.global_emb(entity_type) if entity.frozen else None
            if frozen_global is not None:
                frozen_global.requires_grad_(False)  # no gradient: RelationAdagrad leaves it as it is
        self.relation_optimizer = RelationAdagrad(list(self.model.parameters()), config.relation_lr or config.lr)
        self._load_model()
        if self.device.type == "cpu":
            self.model.share_memory()
            self.relation_optimizer.share_memory()
        self.num_chunks = count_edge_chunks(config)
        # the checkpoint version the first pass of this run commits minus one (biggraph grow trains on after
        # the version it committed, so its passes start there)
        self.first_index = 0
        self.iterations = [
            Iteration(i, epoch, path_idx, chunk_idx)
            for i, (epoch, path_idx, chunk_idx) in enumerate(
                (e, p, c)
                for e in range(config.num_epochs)
                for p in range(len(config.edge_paths))
                for c in range(self.num_chunks)
            )
        ]
        self.finished_ok = False
        from job.monitoring import make_reporter

        # progress display, TensorBoard, Pushgateway: whatever the environment and config ask for
        self.reporter = make_reporter(config, rank=self.rank, total_passes=len(self.iterations),
                                      buckets_per_pass=bucket_grid(config)[0] * bucket_grid(config)[1])
        self.workers = 1 if self.device.type == "cuda" else config.effective_workers()
        self.pool: Optional[WorkerPool] = None
        self.store = PartitionStore(config, self.checkpoint, self.version, self.entity_counts, {}, self.device)
        self.store.capacity = choose_capacity(config, self.entity_counts, distributed=self.dist is not None)
        self.nparts_lhs, self.nparts_rhs = bucket_grid(config)
        self.shared: Optional[SharedParameters] = None
        if self.dist is not None:
            # relation parameters, global embeddings and unpartitioned tables are the same on every trainer
            tables = self.store.load_unpartitioned()
            self.shared = SharedParameters(list(self.model.parameters()) + [t.weight for t in tables])

    def _remove_temporary_files(self) -> None:
        """Files a killed writer left under their temporary names are never part of any version; local
        staging copies of uploads a killed trainer never finished are only wasted disk."""
        for path in storage.remove_stale_upload_dirs():
            logger.info("removed %s (left by a trainer that was killed during an upload)", path)
        for name in storage.listdir(self.config.checkpoint_path):
            if name.startswith(".tmp-"):
                storage.remove(storage.join(self.config.checkpoint_path, name))

    def _progress_url(self) -> str:
        return storage.join(self.config.checkpoint_path, PROGRESS_FILE)

    def _read_progress(self) -> Optional[dict[str, Any]]:
        """The lock server's persisted progress, if it belongs to the pass after the committed version."""
        try:
            data = json.loads(storage.read_text(self._progress_url()))
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return data if data.get("version") == self.version + 1 else None

    def _write_progress(self, state: dict[str, Any]) -> None:
        storage.write_text(self._progress_url(), json.dumps(state))

    # model and checkpoint ----------------------------------------------------------------------
    def _load_model(self) -> None:
        if self.version > 0:
            if not self.checkpoint.has_model(self.version):
                raise CheckpointError(
                    f"{self.checkpoint.model_file(self.version)}: missing although checkpoint_version.txt names "
                    f"version {self.version}"
                )
            params, optim_state, _ = self.checkpoint.load_model(self.version)
            self.model.load_public_state_dict(params, self.checkpoint.model_file(self.version))
            self.relation_optimizer.load_state_dict(optim_state, self.checkpoint.model_file(self.version))
            logger.info("resuming from checkpoint version %d in %s", self.version, self.config.checkpoint_path)
        elif self.config.init_path:
            init = CheckpointStorage(self.config.init_path)
            init_version = init.load_version()
            if init.has_model(init_version):
                params, _, _ = init.load_model(init_version)
                self.model.load_public_state_dict(params, init.model_file(init_version))
            logger.info("initialising embeddings from %s", self.config.init_path)

    def _metadata(self, iteration: Iteration) -> dict[str, Any]:
        return {
            "config/json": self.config.to_json(exclude=("storage_options",)),  # may hold credentials
            "iteration/num_epochs": self.config.num_epochs,
            "iteration/epoch_idx": iteration.epoch,
            "iteration/num_edge_paths": len(self.config.edge_paths),
            "iteration/edge_path_idx": iteration.edge_path_idx,
            "iteration/edge_path": self.config.edge_paths[iteration.edge_path_idx],
            "iteration/num_edge_chunks": self.num_chunks,
            "iteration/edge_chunk_idx": iteration.chunk_idx,
        }

    # main loop -------------------------------------------------------------------------------
    def run(self, stop_after_iterations: Optional[int] = None) -> dict:
        config = self.config
        if self.rank == 0:
            self.checkpoint.save_config(config.to_pbg_json())  # PBG rejects keys it does not know
        todo = [iteration for iteration in self.iterations if iteration.index >= self.version]
        if not todo:
            self.finished_ok = True
            logger.info("training already complete: checkpoint version %d covers all %d passes",
                        self.version, len(self.iterations))
            return {"version": self.version, "passes": 0}
        started = time.perf_counter()
        total_edges = 0
        last_eval: Optional[float] = None
        summary: dict[str, Any] = {}
        for done, iteration in enumerate(todo):
            if stop_after_iterations is not None and done >= stop_after_iterations:
                break
            pass_stats = self._run_pass(iteration) if self.dist is None else self._run_pass_distributed(iteration)
            total_edges += pass_stats["train_edges"]
            summary = pass_stats
            last_pass_of_epoch = (iteration.index - self.first_index + 1) % (len(config.edge_paths) * self.num_chunks) == 0
            if last_pass_of_epoch and config.early_stopping and pass_stats.get("eval_mrr") is not None:
                if last_eval is not None and pass_stats["eval_mrr"] < last_eval:
                    logger.info("early stopping: eval MRR fell from %.4f to %.4f", last_eval, pass_stats["eval_mrr"])
                    break
                last_eval = pass_stats["eval_mrr"]
        self.finished_ok = True
        elapsed = time.perf_counter() - started
        summary.update({"version": self.version, "train_edges": total_edges, "seconds": elapsed,
                        "edges_per_sec": total_edges / elapsed if elapsed > 0 else 0.0})
        logger.info("training finished: checkpoint version %d in %s (%.1f s, %.0f edges/s)",
                    self.version, config.checkpoint_path, elapsed, summary["edges_per_sec"])
        return summary

    def _run_pass(self, iteration: Iteration) -> dict[str, Any]:
        config = self.config
        edge_path = config.edge_paths[iteration.edge_path_idx]
        self.store.start_pass(self.version)
        self.store.metadata = self._metadata(iteration)
        seed_base = config.seed if config.seed is not None else random.randrange(2**31)
        rng = random.Random(seed_base * 7919 + iteration.index)
        buckets = self._pass_order(rng)
        needs = [self._needs(b) for b in buckets]
        resident_at_start = len(self.store.resident_partitioned())
        records: list[dict[str, Any]] = []
        pass_started = time.perf_counter()
        train_total = BatchStats()
        eval_total = BatchStats()
        train_seconds = 0.0
        for bucket_idx, bucket in enumerate(buckets):
            if bucket_idx + 1 < len(buckets):  # object stores: download the next bucket while this one trains
                following = buckets[bucket_idx + 1]
                prefetch(edge_format.edges_file(edge_path, following.lhs, following.rhs))
            record, train_stats, eval_stats, seconds = self._run_bucket(
                iteration, bucket, bucket_idx, edge_path, seed_base,
                first=(iteration.index == self.first_index and bucket_idx == 0), upcoming=needs[bucket_idx + 1:],
            )
            records.append(record)
            self.reporter.on_bucket(record)
            train_total.add(train_stats)
            eval_total.add(eval_stats)
            train_seconds += seconds
        summary_record: dict[str, Any] = {}

        def pass_records(version: int) -> list[dict[str, Any]]:
            summary_record.update({
                "epoch_idx": iteration.epoch, "edge_path_idx": iteration.edge_path_idx,
                "edge_chunk_idx": iteration.chunk_idx, "index": iteration.index, "pass_summary": True,
                "stats": {"count": train_total.count, "metrics": train_total.training_metrics()},
                "edges_per_sec": train_total.count / train_seconds if train_seconds > 0 else 0.0,
                "time": time.perf_counter() - pass_started, "checkpoint_version": version,
                **self._io_record(resident_at_start),
            })
            if eval_total.num_ranks:
                summary_record["eval_stats_after"] = {"count": eval_total.count, "metrics": eval_total.ranking_metrics()}
            return records + [summary_record]

        self._commit(iteration, pass_records)
        self.reporter.on_pass(summary_record)
        eval_mrr = eval_total.ranking_metrics()["mrr"] if eval_total.num_ranks else None
        message = (f"epoch {iteration.epoch + 1}/{config.num_epochs} edge path {iteration.edge_path_idx + 1}/"
                   f"{len(config.edge_paths)} chunk {iteration.chunk_idx + 1}/{self.num_chunks}: "
                   f"{train_total.count} edges, {summary_record['edges_per_sec']:.0f} edges/s, "
                   f"loss {train_total.training_metrics()['loss']:.4f}")
        if eval_mrr is not None:
            message += f", eval MRR {eval_mrr:.4f} (hits@10 {eval_total.ranking_metrics()['hits@10']:.4f})"
        if self.store.capacity is not None:
            message += (f"; partitions: {summary_record['partition_loads']} loads (lower bound "
                        f"{summary_record['partition_loads_lower_bound']}), {summary_record['partition_reads']} read "
                        f"({summary_record['bytes_read'] / 2**20:.0f} MiB), {summary_record['partition_writes']} written "
                        f"({summary_record['bytes_written'] / 2**20:.0f} MiB), blocked on I/O "
                        f"{summary_record['io_blocked_seconds']:.1f} s + commit {summary_record['commit_seconds']:.1f} s")
        logger.info(message, extra={"fields": {k: v for k, v in summary_record.items() if k != "stats"}})
        return {"train_edges": train_total.count, "eval_mrr": eval_mrr, "loss": train_total.training_metrics()["loss"],
                "edges_per_sec_pass": summary_record["edges_per_sec"]}

    def _io_record(self, resident_at_start: int) -> dict[str, Any]:
        """What the pass cost in partition I/O, beside the fewest loads its buffer allows (square grids)."""
        record: dict[str, Any] = self.store.stats.as_record()
        if self.store.capacity is not None and self.nparts_lhs == self.nparts_rhs:
            partitioned = max(1, sum(1 for e in self.config.entities.values() if e.num_partitions > 1))
            record["partition_loads_lower_bound"] = partitioned * lower_bound_loads(
                self.nparts_lhs, self.buffer_slots(), resident_at_start // partitioned)
        return record

    def _bucket_keys(self) -> dict[Bucket, frozenset]:
        """The partitioned (type, partition) keys each bucket locks."""
        config = self.config
        out = {}
        for bucket in all_buckets(self.nparts_lhs, self.nparts_rhs):
            keys = set()
            for relation in config.relations:
                if config.entities[relation.lhs].num_partitions > 1:
                    keys.add((relation.lhs, bucket.lhs))
                if config.entities[relation.rhs].num_partitions > 1:
                    keys.add((relation.rhs, bucket.rhs))
            out[bucket] = frozenset(keys)
        return out

    def _run_pass_distributed(self, iteration: Iteration) -> dict[str, Any]:
        """One pass shared by all ranks: buckets come from the lock server on rank 0; rank 0 commits."""
        config = self.config
        ctx = self.dist
        assert ctx is not None and self.shared is not None
        round_tag = f"{ctx.restart_count}-{iteration.index}"
        edge_path = config.edge_paths[iteration.edge_path_idx]
        self.store.start_pass(self.version)
        self.store.metadata = self._metadata(iteration)
        seed_base = (config.seed if config.seed is not None else random.randrange(2**31)) + 104_729 * self.rank
        server: Optional[LockServer] = None
        if self.rank == 0:
            state = LockState(self.nparts_lhs, self.nparts_rhs, self._bucket_keys(),
                              tree_init_order=config.distributed_tree_init_order and self.version == 0,
                              version=self.version + 1)
            if self.progress is not None and self.progress.get("version") == self.version + 1:
                state.restore(self.progress)
                state.forget_rank_locks()
                logger.info("resuming pass %d: %d of %d buckets already done, %d to redo", iteration.index + 1,
                            len(state.done), state.total, state.redone)
            self.progress = None
            server = LockServer(ctx.store, state, self._write_progress, self.shared.flatten(), seed_base)
        wait_all(ctx, f"pass-start-{round_tag}")
        client = LockClient(ctx.store, self.rank)
        self.shared.assign(client.sync(np.zeros_like(self.shared.synced)))
        train_total = BatchStats()
        eval_total = BatchStats()
        train_seconds = 0.0
        finished: Optional[Bucket] = None
        record: Optional[dict[str, Any]] = None
        bucket_idx = 0
        waits = 0
        while True:
            ctx.check_peers()
            kind, bucket, dirty = client.next_bucket(self.store.resident_partitioned(), finished, record)
            finished, record = None, None
            self.store.written = set(dirty)
            if kind == "done":
                break
            if kind == "wait" or bucket is None:
                # give our partitions back so that nobody waits on us, then ask again
                released = self.store.evict_partitioned()
                if released:
                    self._release(client, released)
                waits += 1
                time.sleep(min(0.05 * waits, 0.5))
                continue
            waits = 0
            record, train_stats, eval_stats, seconds = self._run_bucket(
                iteration, bucket, bucket_idx, edge_path, seed_base, first=False,
                on_evicted=lambda keys: self._release(client, keys),
            )
            record["rank"] = self.rank
            self.reporter.on_bucket(record)
            bucket_idx += 1
            train_total.add(train_stats)
            eval_total.add(eval_stats)
            train_seconds += seconds
            self.shared.sync(client)
            finished = bucket
        released = self.store.evict_partitioned()
        if released:
            self._release(client, released)
        self.shared.sync(client)
        wait_all(ctx, f"pass-written-{round_tag}")
        if server is not None:
            self.shared.assign(server.shared)
            self.store.written = set(server.state.dirty)
            records = server.take_records()
            summary = {
                "epoch_idx": iteration.epoch, "edge_path_idx": iteration.edge_path_idx,
                "edge_chunk_idx": iteration.chunk_idx, "index": iteration.index, "pass_summary": True,
                "world_size": ctx.world_size, "buckets_redone": server.state.redone,
                "buckets_trained": len(records), "restart_count": ctx.restart_count,
            }
            counts = sum(r["stats"]["count"] for r in records)
            metrics: dict[str, float] = {}
            for r in records:
                for k, v in r["stats"]["metrics"].items():
                    metrics[k] = metrics.get(k, 0.0) + v * r["stats"]["count"]
            summary["stats"] = {"count": counts, "metrics": {k: v / max(counts, 1) for k, v in metrics.items()}}
            server.stop()
            self._commit(iteration, lambda version: records + [summary])
            self.reporter.on_pass(summary)
            storage.remove(self._progress_url())
        wait_all(ctx, f"pass-committed-{round_tag}")
        if self.rank != 0:
            self.version += 1
        eval_mrr = eval_total.ranking_metrics()["mrr"] if eval_total.num_ranks else None
        edges_per_sec = train_total.count / train_seconds if train_seconds > 0 else 0.0
        logger.info("epoch %d/%d chunk %d/%d: this trainer did %d buckets, %d edges, %.0f edges/s, loss %.4f",
                    iteration.epoch + 1, config.num_epochs, iteration.chunk_idx + 1, self.num_chunks, bucket_idx,
                    train_total.count, edges_per_sec, train_total.training_metrics()["loss"])
        return {"train_edges": train_total.count, "eval_mrr": eval_mrr, "loss": train_total.training_metrics()["loss"],
                "edges_per_sec_pass": edges_per_sec}

    def _release(self, client: LockClient, keys: list) -> None:
        """Give partitions back once their files are stored: on object stores uploads run in the background,
        and the next holder (another rank) must read what we wrote, not an older file or none."""
        self.checkpoint.flush()
        client.release(keys)

    def _keys_for(self, bucket: Bucket) -> tuple[dict[int, tuple[str, int]], dict[int, tuple[str, int]]]:
        """Per relation, the (entity type, partition) of its lhs and rhs tables in ``bucket``."""
        config = self.config
        lhs_keys: dict[int, tuple[str, int]] = {}
        rhs_keys: dict[int, tuple[str, int]] = {}
        for rel_idx, relation in enumerate(config.relations):
            lhs_part = bucket.lhs if config.entities[relation.lhs].num_partitions > 1 else 0
            rhs_part = bucket.rhs if config.entities[relation.rhs].num_partitions > 1 else 0
            lhs_keys[rel_idx] = (relation.lhs, lhs_part)
            rhs_keys[rel_idx] = (relation.rhs, rhs_part)
        return lhs_keys, rhs_keys

    def _needs(self, bucket: Bucket) -> set[tuple[str, int]]:
        lhs_keys, rhs_keys = self._keys_for(bucket)
        return set(lhs_keys.values()) | set(rhs_keys.values())

    def _pass_order(self, rng: random.Random) -> list[Bucket]:
        """The pass's buckets; ``buffer`` walks a square grid for the fewest loads with this buffer, starting
        from the partitions already in memory."""
        config = self.config
        capacity = self.store.capacity
        if config.bucket_order is BucketOrder.BUFFER and capacity is not None and self.nparts_lhs == self.nparts_rhs:
            resident = sorted({p for _, p in self.store.resident_partitioned()})
            return buffer_order(self.nparts_lhs, self.buffer_slots(), rng, resident)
        return order_buckets(self.nparts_lhs, self.nparts_rhs, config.bucket_order, rng, self.buffer_slots())

    def buffer_slots(self) -> int:
        """Partition numbers the buffer holds (its capacity over the partitioned types)."""
        partitioned = max(1, sum(1 for e in self.config.entities.values() if e.num_partitions > 1))
        return max(2, (self.store.capacity or 2 * partitioned) // partitioned)

    def _tables_for(self, bucket: Bucket, upcoming: Sequence[set[tuple[str, int]]] = ()
                    ) -> tuple[dict[int, Table], dict[int, Table], list[tuple[str, int]]]:
        lhs_keys, rhs_keys = self._keys_for(bucket)
        evicted = self.store.hold(set(lhs_keys.values()) | set(rhs_keys.values()), upcoming)
        return (
            {r: self._training_view(k) for r, k in lhs_keys.items()},
            {r: self._training_view(k) for r, k in rhs_keys.items()},
            evicted,
        )

    def _training_view(self, key: tuple[str, int]) -> Table:
        """The resident table of ``key`` as batches see it: without its optimizer state when the type is frozen,
        which makes the step leave its rows (and that state, still held by the store) untouched."""
        table = self.store.get(key)
        return Table(table.weight, None) if self.config.entities[key[0]].frozen else table

    def _read_bucket_chunk(self, edge_path: str, bucket: Bucket, chunk_idx: int) -> EdgeTensors:
        url = edge_format.edges_file(edge_path, bucket.lhs, bucket.rhs)
        with edge_format.open_h5(url) as handle:
            num_edges = edge_format.check_edge_file(handle, url)
            begin, end = edge_format.chunk_bounds(num_edges, chunk_idx, self.num_chunks)
            arrays = edge_format.read_edges_from_handle(handle, url, begin, end)
        # before any update: an id beyond the partition would index another row (or wrap around)
        edge_limits(self.config, self.entity_counts, self.num_dynamic_rels, bucket).check(arrays, url, begin)
        return edge_tensors(arrays)

    def _run_bucket(
        self, iteration: Iteration, bucket: Bucket, bucket_idx: int, edge_path: str, seed_base: int, first: bool,
        on_evicted: Any = None, upcoming: Sequence[set[tuple[str, int]]] = (),
    ) -> tuple[dict[str, Any], BatchStats, BatchStats, float]:
        config = self.config
        io_before = self.store.io_seconds
        swap_started = time.perf_counter()
        lhs_tables, rhs_tables, evicted = self._tables_for(bucket, upcoming)
        if on_evicted is not None and evicted:
            on_evicted(evicted)
        if upcoming and config.prefetch_partitions:
            # while this bucket trains: write back what the next one evicts, read what it needs
            self.store.prepare(upcoming[0], self._needs(bucket), upcoming[1:])
        edges = self._read_bucket_chunk(edge_path, bucket, iteration.chunk_idx)
        if self.device.type == "cuda":
            edges = edges.to(self.device)
        io_seconds = time.perf_counter() - swap_started
        num_edges = len(edges)
        # the held-out edges depend only on where they are, so they are the same every epoch
        split_generator = torch.Generator()
        split_generator.manual_seed(zlib.crc32(f"{iteration.edge_path_idx}/{iteration.chunk_idx}/{bucket}".encode())
                                    + (config.seed or 0))
        num_eval = int(num_edges * config.eval_fraction)
        permutation = torch.randperm(num_edges, generator=split_generator)
        eval_indices = permutation[num_edges - num_eval:] if num_eval else permutation[:0]
        train_indices = permutation[: num_edges - num_eval]
        shuffle_generator = torch.Generator()
        shuffle_generator.manual_seed(seed_base * 1_000_003 + iteration.index * 10_007 + bucket_idx)
        train_indices = train_indices[torch.randperm(train_indices.numel(), generator=shuffle_generator)]
        train_indices = train_indices.to(self.device)
        eval_indices = eval_indices.to(self.device)

        eval_before = self._evaluate(edges, eval_indices, lhs_tables, rhs_tables, shuffle_generator) if num_eval else None
        if self.workers > 1 and self.pool is None and train_indices.numel() >= 2 * config.batch_size:
            # started on first need (small graphs never pay for it), and before the compute clock starts
            self.pool = WorkerPool(self.workers, config, self.model, self.relation_optimizer)
        compute_started = time.perf_counter()
        train_stats = self._train(edges, train_indices, lhs_tables, rhs_tables, shuffle_generator, first)
        compute_seconds = time.perf_counter() - compute_started
        eval_after = self._evaluate(edges, eval_indices, lhs_tables, rhs_tables, shuffle_generator) if num_eval else None
        record: dict[str, Any] = {
            "epoch_idx": iteration.epoch, "edge_path_idx": iteration.edge_path_idx,
            "edge_chunk_idx": iteration.chunk_idx, "lhs_partition": bucket.lhs, "rhs_partition": bucket.rhs,
            "index": iteration.index * self.nparts_lhs * self.nparts_rhs + bucket_idx,
            "stats": {"count": train_stats.count, "metrics": train_stats.training_metrics()},
            "edges_per_sec": train_stats.count / compute_seconds if compute_seconds > 0 else 0.0,
            "time": compute_seconds, "io_time": io_seconds, "swap_time": self.store.io_seconds - io_before,
        }
        eval_after_stats = BatchStats()
        if eval_before is not None and eval_after is not None:
            record["eval_stats_before"] = {"count": eval_before.count, "metrics": eval_before.ranking_metrics()}
            record["eval_stats_after"] = {"count": eval_after.count, "metrics": eval_after.ranking_metrics()}
            eval_after_stats = eval_after
        logger.debug("bucket %s: %s", bucket, json.dumps(record))
        return record, train_stats, eval_after_stats, compute_seconds

    def _context(self, lhs_tables: dict[int, Table], rhs_tables: dict[int, Table], train: bool) -> BatchContext:
        config = self.config
        return BatchContext(
            config=config, model=self.model, relation_optimizer=self.relation_optimizer if train else None,
            lhs_tables=lhs_tables, rhs_tables=rhs_tables,
            num_batch_negs=config.num_batch_negs if train else config.eval_num_batch_negs,
            num_uniform_negs=config.num_uniform_negs if train else config.eval_num_uniform_negs,
        )

    def _train(self, edges: EdgeTensors, indices: torch.Tensor, lhs_tables: dict[int, Table],
               rhs_tables: dict[int, Table], generator: torch.Generator, first: bool) -> BatchStats:
        config = self.config
        if self.pool is None or indices.numel() < 2 * config.batch_size:
            return process_edges(self._context(lhs_tables, rhs_tables, True), edges, indices, config.batch_size,
                                 config.dynamic_relations, generator, True)
        slices = [indices[s].clone() for s in _split_almost_equally(indices.numel(), self.workers)]
        seeds = [int(torch.randint(0, 2**62, (1,), generator=generator)) for _ in slices]
        delays = [0.0] + [config.hogwild_delay if first else 0.0] * (len(slices) - 1)
        edges.share_memory_()
        return self.pool.run(edges, slices, lhs_tables, rhs_tables, seeds, True, config.num_batch_negs,
                             config.num_uniform_negs, delays)

    def _evaluate(self, edges: EdgeTensors, indices: torch.Tensor, lhs_tables: dict[int, Table],
                  rhs_tables: dict[int, Table], generator: torch.Generator) -> BatchStats:
        config = self.config
        eval_tables_l = {r: Table(t.weight, None) for r, t in lhs_tables.items()}
        eval_tables_r = {r: Table(t.weight, None) for r, t in rhs_tables.items()}
        return process_edges(self._context(eval_tables_l, eval_tables_r, False), edges, indices, config.batch_size,
                             config.dynamic_relations, generator, False)

    def _commit(self, iteration: Iteration, records_of: Callable[[int], list[dict[str, Any]]]) -> None:
        """Write the whole next version and the pass's stats lines, then move the marker, then drop the old
        version. The lines go before the marker so that a kill after it loses none; a run resumed before it
        drops them (``trim_stats``)."""
        config = self.config
        new_version = self.version + 1
        self.store.finish_pass()
        state = self.model.public_state_dict()
        self.checkpoint.save_model(
            new_version,
            {name: (private, tensor.cpu().numpy()) for name, (private, tensor) in state.items()},
            self.relation_optimizer.state_dict(),
            self._metadata(iteration),
        )
        records = records_of(new_version)
        for record in records:
            record.setdefault("checkpoint_version", new_version)
        self.checkpoint.append_stats(records)
        self.checkpoint.save_version(new_version)  # the commit point
        old_version = self.version
        self.version = new_version
        end_of_epoch = (iteration.index - self.first_index + 1) % (len(config.edge_paths) * self.num_chunks) == 0
        interval = config.checkpoint_preservation_interval
        if end_of_epoch and interval is not None and (iteration.epoch + 1) % interval == 0:
            self.checkpoint.preserve(new_version, iteration.epoch, self.all_keys)
        if old_version > 0:
            self.checkpoint.drop_version(old_version, self.all_keys)

    def close(self) -> None:
        self.store.discard_prefetched()
        self.reporter.close()
        self.checkpoint.close()  # flush and stop background uploads on every exit path
        if self.dist is not None:
            if self.finished_ok:
                leave(self.dist)
            elif self.dist.heartbeat is not None:
                self.dist.heartbeat.stop()  # failing: exit now so that torchrun restarts the group
        if self.pool is not None:
            self.pool.close()
            self.pool = None

