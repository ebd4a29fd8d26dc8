"""The training loop (``Trainer``): passes over buckets, checkpoint commits.

One ``_run_pass`` serves a single process and a torchrun group alike: what differs (who picks the
next bucket, who commits, how shared parameters travel) is behind the ``BucketScheduler`` and the
``ParameterSync`` of job/train/schedule/interfaces.py, chosen once at start-up. A bucket's own work is in
job/train/bucket_run.py, the pass summary in job/train/pass_stats.py, what a run starts from (the
committed version, clean-up after killed runs, the model state to load) in job/train/resume.py.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from job.checkpoint import CheckpointManager, ModelState
from job.checkpoint.group_progress import Progress
from job.checkpoint.journal_checks import GrowInputs
from job.config import BucketOrder, ConfigSchema
from job.eval_protocol import protocol_label
from job.formats import edges as edge_format
from job.model.kernel_options import KernelOptions
from job.model.scoring import Model
from job.monitoring import make_reporter
from job.train.batch.allocator import keep_freed_memory
from job.train.batch.optim import RelationAdagrad
from job.train.batch.precision import training_dtype
from job.train.batch.step import BatchStats, BucketAbandoned
from job.train.bucket_run import BucketRunner, BucketWork, HogwildStagger, all_negs_cost
from job.train.distributed.group import config_digest, init_distributed, leave
from job.train.distributed.protocol import SERVER_RANK
from job.train.distributed.shared_params import group_shared
from job.train.edge_source import ChunkedEdges, EdgeSource
from job.train.hogwild.spawning import server_processes, start_worker_server
from job.train.input_check import checked_input
from job.train.inputs import bucket_grid, pick_device
from job.train.lr_schedule import lr_scale
from job.train.pass_stats import add_io, eval_mrr_of, pass_message, pass_summary
from job.train.residency.budget import (
    checkpoint_transfer_bytes,
    choose_capacity,
    device_capacity,
    shared_values,
    sync_memory_bytes,
)
from job.train.residency.partitions import PartitionStore, Residency
from job.train.resume import GroupBarrier, load_model_state
from job.train.schedule.group import LockServerScheduler
from job.train.schedule.interfaces import BucketScheduler, Iteration, LocalScheduler, NoSync, ParameterSync, PassGather
from job.train.schedule.orders import buffer_order, lower_bound_loads, order_buckets
from job.train.schedule.shared_sync import SharedSync
from job.train.startup import StartupClock
from job.train.validation import Validation
from job.types import Bucket
from storage_adapters.edge_reader import prefetch

logger = logging.getLogger("biggraph")


@dataclass(frozen=True)
class PassPlan:
    """Which passes a run makes: every (epoch, edge set, chunk) of the config, numbered from ``first_index`` (the
    committed version the first one follows: ``biggraph grow`` trains on after the version it committed)."""

    first_index: int = 0

    def iterations(self, config: ConfigSchema, num_chunks: int) -> list[Iteration]:
        triples = ((e, p, c) for e in range(config.num_epochs) for p in range(len(config.edge_paths))
                   for c in range(num_chunks))
        return [Iteration(self.first_index + i, e, p, c) for i, (e, p, c) in enumerate(triples)]


@dataclass(frozen=True)
class Collaborators:
    """What a caller may give a trainer instead of its defaults (PBG's ``train(config, model, trainer, evaluator)``
    idea): where the edges come from, which passes to make, what ``config.json`` describes, whether Hogwild
    worker processes may run (False: slices one after another in this process, as on a GPU), and which of the
    step's kernels run (tests and benchmarks choose the reference paths here)."""

    edge_source: EdgeSource = field(default_factory=ChunkedEdges)
    plan: PassPlan = PassPlan()
    described_config: Optional[ConfigSchema] = None  # config.json's (default: the training config)
    hogwild: bool = True
    kernel_options: KernelOptions = KernelOptions()  # no config key or variable sets one: the defaults train


class Trainer:
    """Owns the model, the partitions in memory, the bucket runner, the scheduler and the checkpoint directory."""

    def __init__(self, config: ConfigSchema, take_over: bool = False, parts: Collaborators = Collaborators()) -> None:
        self.config = config
        self.parts = parts
        self.clock = StartupClock()  # where this trainer's start-up goes, logged after its first bucket
        self.clock.mark("imports")
        self.dist = init_distributed(config_digest(config.to_json(exclude=("storage_options",))), self.clock)
        self.rank = self.dist.rank if self.dist else 0
        self.all_keys = [(t, p) for t, e in config.entities.items() for p in range(e.num_partitions)]
        self.checkpoints = CheckpointManager(config.checkpoint_path, self.all_keys, GrowInputs.of(config),
                                             take_over=take_over,
                                             fence=self.dist.fence if self.dist is not None else None)
        self.checkpoint = self.checkpoints.storage  # the format's file I/O, for the partition store and scheduler
        # the directory taken (one writer) and cleaned; a grown version whose input a crash left unpublished is
        # completed before the input is checked
        self._open_checkpoint()
        self.clock.mark("checkpoint open")
        try:
            self._set_up(config)
        except BaseException:
            self.checkpoints.close()
            raise

    def _set_up(self, config: ConfigSchema) -> None:
        # checked and read once per group, by rank 0 (job/train/input_check.py); a refusal stops every rank
        facts = checked_input(config, self.dist, self.checkpoints)
        self.clock.mark("input check")
        self.device = pick_device(config)
        keep_freed_memory()  # this process trains batches too (workers=1, evaluation, a GPU's host side)
        # scores and products in compute_dtype (half_precision's on a GPU); a device without it fails here
        self.compute_dtype = training_dtype(config, self.device)
        if config.seed is not None:
            torch.manual_seed(config.seed)
        self.entity_counts = facts.entity_counts
        self.num_dynamic_rels = facts.num_dynamic_rels
        self._build_model()
        self.clock.mark("model")
        self.num_chunks = facts.num_chunks
        self.first_index = self.parts.plan.first_index
        self.iterations = self.parts.plan.iterations(config, self.num_chunks)
        self.finished_ok = False
        self.nparts_lhs, self.nparts_rhs = bucket_grid(config)
        # progress display, TensorBoard, Pushgateway: whatever the environment and config ask for; passes are
        # counted by checkpoint version, as on any resume
        self.reporter = make_reporter(config, rank=self.rank, total_passes=self.first_index + len(self.iterations),
                                      buckets_per_pass=self.nparts_lhs * self.nparts_rhs)
        hogwild = self.device.type != "cuda" and self.parts.hogwild
        self.workers = config.effective_workers() if hogwild else 1
        if self.workers > 1:
            start_worker_server()  # its imports overlap the set-up below; the pool forks from it later
        self.iteration = self.iterations[0] if self.iterations else None  # the pass in flight (file metadata)
        self.checkpoints.add_metadata_provider(self._metadata)
        # the trainer, its Hogwild workers and the fork server they start from
        processes = 1 + (self.workers + server_processes() if self.workers > 1 else 0)
        if self.device.type == "cuda" and self.dist is None and config.partition_buffer is None:
            # one GPU trainer: the buffer is the card's memory (what a host budget says does not bound it)
            capacity = device_capacity(config, self.entity_counts, torch.cuda.mem_get_info(self.device)[0])
        else:
            capacity = choose_capacity(config, self.entity_counts, distributed=self.dist is not None,
                                       processes=processes, transfer_bytes=checkpoint_transfer_bytes(config.checkpoint_path),
                                       sync_bytes=self._sync_bytes())
        # distributed: what a trainer holds is locked from the others
        self.store = PartitionStore(config, self.checkpoint, self.version, self.entity_counts,
                                    self.checkpoints.metadata, self.device, Residency(capacity, self.dist is not None))
        self.clock.mark("partition buffer")
        # PBG cuts every bucket into one slice per worker (slices_per_bucket); a GPU trains them one after another
        self.buckets = BucketRunner(BucketWork(
            config=config, model=self.model, relation_optimizer=self.relation_optimizer, store=self.store,
            device=self.device, workers=self.workers, slices_per_bucket=config.effective_workers(),
            entity_counts=self.entity_counts, num_dynamic_rels=self.num_dynamic_rels, num_chunks=self.num_chunks,
            grid=(self.nparts_lhs, self.nparts_rhs), edge_source=self.parts.edge_source,
            kernel_options=self.parts.kernel_options))
        self.scheduler, self.sync = self._make_scheduler()
        self.stagger = HogwildStagger(config, self.workers, enabled=self.scheduler.delays_hogwild)
        self.validation = Validation(config, self.checkpoints)  # validation_edge_paths: scored after commits
        self.clock.mark("scheduler")

    def _open_checkpoint(self) -> None:
        """The committed version, cleaned of what killed runs left; in a torchrun group, the lock server's
        persisted progress of an interrupted pass (its first pass resumes it, so its files are kept)."""
        self.progress: Optional[Progress] = None
        group = GroupBarrier(self.dist) if self.dist is not None else None
        self.version = self.checkpoints.open(group)
        self.progress = self.checkpoints.resumed

    def _build_model(self) -> None:
        config = self.config
        self.model = Model(config, self.num_dynamic_rels).to(self.device)
        self.model.compute_dtype = self.compute_dtype
        for entity_type, entity in config.entities.items():
            frozen_global = self.model.global_emb(entity_type) if entity.frozen else None
            if frozen_global is not None:
                frozen_global.requires_grad_(False)  # no gradient: RelationAdagrad leaves it as it is
        self.relation_optimizer = RelationAdagrad(list(self.model.parameters()), config.relation_lr or config.lr)
        load_model_state(self.model, self.relation_optimizer, self.checkpoint, self.version, config)
        if self.device.type == "cpu":
            self.model.share_memory()
            self.relation_optimizer.share_memory()

    def _sync_bytes(self) -> int:
        """What syncing the shared parameters (model parameters and unpartitioned tables, as ``_make_scheduler``
        gathers them) costs this process in a group: nothing alone."""
        if self.dist is None:
            return 0
        values = shared_values(sum(p.numel() for p in self.model.parameters()), self.config, self.entity_counts)
        return sync_memory_bytes(values, serves=self.dist.rank == SERVER_RANK,
                                 shards=self.dist.world_size if self.config.shared_shards else 0)

    def _make_scheduler(self) -> tuple[BucketScheduler, ParameterSync]:
        """The one place that knows whether this process trains alone."""
        if self.dist is None:
            return LocalScheduler(self._pass_order, self.buckets.needs), NoSync()
        # relation parameters, global embeddings and unpartitioned tables are the same on every trainer
        shared, layout = group_shared(self.model, self.relation_optimizer.sums, self.store.load_unpartitioned(),
                                      self.num_dynamic_rels)
        scheduler = LockServerScheduler(self.dist, self.config, self.store, self.checkpoint,
                                        (self.nparts_lhs, self.nparts_rhs), self.progress, shared.flatten, layout)
        self.progress = None
        return scheduler, SharedSync(shared, scheduler)

    # checkpoint metadata ------------------------------------------------------------------------
    def _metadata(self) -> dict[str, Any]:
        """The metadata of the files written during the pass in flight (a provider of the checkpoint manager)."""
        iteration = self.iteration
        if iteration is None:
            return {}
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
    def _ends_epoch(self, iteration: Iteration) -> bool:
        return (iteration.index - self.first_index + 1) % (len(self.config.edge_paths) * self.num_chunks) == 0

    def run(self, stop_after_iterations: Optional[int] = None) -> dict:
        config = self.config
        if self.rank == 0:
            # PBG rejects keys it does not know; a grow's passes describe the user's config, not theirs
            self.checkpoint.save_config((self.parts.described_config or config).to_pbg_json())
        todo = [iteration for iteration in self.iterations if iteration.index >= self.version]
        if todo and (ended := self.validation.ended(self.version)) is not None:
            # a pod restarted or a Job resubmitted after early stopping ended the run: it trains no further
            self.finished_ok = True
            logger.info(ended)
            return {"version": self.version, "passes": 0}
        if not todo:
            self.finished_ok = True
            logger.info("training already complete: checkpoint version %d covers all %d passes",
                        self.version, len(self.iterations))
            return {"version": self.version, "passes": 0}
        buckets = self.nparts_lhs * self.nparts_rhs * self.num_chunks * len(config.edge_paths)
        if todo[0].epoch == 0 and (note := self.stagger.cost_note(buckets, len(self.all_keys))):
            logger.info(note)
        if note := all_negs_cost(config, self.entity_counts):
            logger.warning(note)
        started = time.perf_counter()
        self.validation.start()
        total_edges = 0
        last_eval: Optional[float] = None
        summary: dict[str, Any] = {}
        for done, iteration in enumerate(todo):
            if stop_after_iterations is not None and done >= stop_after_iterations:
                break
            pass_stats = self._run_pass(iteration)
            total_edges += pass_stats["train_edges"]
            summary = pass_stats
            # the pass's MRR is the same on every rank (``BucketScheduler.publish``): all stop together
            eval_mrr = pass_stats.get("eval_mrr")
            # so is its validation line (validation_edge_paths), which early stopping then follows
            if pass_stats.get("validation") is not None and self.validation.stops(pass_stats["validation"]):
                break
            if (self._ends_epoch(iteration) and config.early_stopping and eval_mrr is not None
                    and not self.validation.enabled):
                label = protocol_label(self.buckets.eval_protocol())
                logger.info("early stopping check after epoch %d: eval MRR %.6f (%s)", iteration.epoch + 1, eval_mrr,
                            label)
                if last_eval is not None and eval_mrr < last_eval:
                    logger.info("early stopping: eval MRR fell from %.4f to %.4f (%s)", last_eval, eval_mrr, label)
                    break
                last_eval = eval_mrr
        self.finished_ok = True
        elapsed = time.perf_counter() - started
        summary.update({"version": self.version, "train_edges": total_edges, "seconds": elapsed,
                        "edges_per_sec": total_edges / elapsed if elapsed > 0 else 0.0})
        logger.info("training finished: checkpoint version %d in %s (%.1f s, %.0f edges/s)",
                    self.version, config.checkpoint_path, elapsed, summary["edges_per_sec"])
        if (best := self.validation.summary()) is not None:
            logger.info(best)
        return summary

    def _run_pass(self, iteration: Iteration) -> dict[str, Any]:
        """One pass over every bucket, whoever schedules them; the committing process writes the version and
        the stats lines, every process returns the same ``eval_mrr`` (the whole pass's)."""
        config = self.config
        self.store.start_pass(self.version)
        self.iteration = iteration
        self._schedule_lr(iteration)
        seed_base = (config.seed if config.seed is not None else random.randrange(2**31)) + 104_729 * self.rank
        resident_at_start = len(self.store.resident_partitioned())
        pass_started, cpu_started = time.perf_counter(), time.process_time()
        self.scheduler.start_pass(iteration.index, seed_base, self.version)
        self.sync.pull()
        self.clock.mark("pass start")
        own, own_seconds, own_buckets = self._train_buckets(iteration, seed_base)
        self.scheduler.end_buckets()
        self.sync.sync()
        gathered = self.scheduler.gather(self.store.stats.as_record())
        self.sync.settle()
        summary = None
        validation = None
        if gathered is not None:
            summary = self._commit_pass(iteration, gathered, pass_started, resident_at_start)
            if self.validation.due(iteration.epoch, self._ends_epoch(iteration)):
                validation = self.validation.score(iteration.epoch, self.version)
        published = self.scheduler.publish({"eval_mrr": eval_mrr_of(summary), "validation": validation})
        eval_mrr = published["eval_mrr"]
        if summary is None:
            self.version += 1  # committed by rank 0
        edges_per_sec = own.count / own_seconds if own_seconds > 0 else 0.0
        loss = own.training_metrics()["loss"]
        if summary is not None:
            logger.info(pass_message(iteration, config.num_epochs, len(config.edge_paths), self.num_chunks, summary,
                                     self.store.capacity is not None),
                        extra={"fields": {k: v for k, v in summary.items() if k != "stats"}})
        if self.dist is not None:
            logger.info("epoch %d/%d chunk %d/%d: this trainer did %d buckets, %d edges, %.0f edges/s, loss %.4f; "
                        "waited %.3f s on the scheduler, %.3f s on partitions; %.3f s of CPU in %.3f s",
                        iteration.epoch + 1, config.num_epochs, iteration.chunk_idx + 1, self.num_chunks,
                        own_buckets, own.count, edges_per_sec, loss, self.waited_s, self.store.stats.blocked_seconds,
                        time.process_time() - cpu_started, time.perf_counter() - pass_started)
        return {"train_edges": own.count, "eval_mrr": eval_mrr, "loss": loss, "edges_per_sec_pass": edges_per_sec,
                "validation": published["validation"]}

    def _schedule_lr(self, iteration: Iteration) -> None:
        """Set the pass's learning-rate factor (``lr_decay``, ``lr_plateau_factor``) on every optimizer: derived from
        the epoch and the validation lines up to the committed version (job/train/lr_schedule.py), so a resumed run
        and every trainer of a group use the same rate."""
        scale = lr_scale(self.config, iteration.epoch, self.validation.lines, self.version)
        if scale != self.buckets.lr_scale:
            logger.info("learning rate for epoch %d: lr %.6g, relation_lr %.6g (x%.6g: lr_decay %g, lr_plateau_factor "
                        "%g)", iteration.epoch + 1, self.config.lr * scale,
                        (self.config.relation_lr or self.config.lr) * scale, scale, self.config.lr_decay,
                        self.config.lr_plateau_factor)
        self.buckets.set_lr_scale(scale)

    def _train_buckets(self, iteration: Iteration, seed_base: int) -> tuple[BatchStats, float, int]:
        """Train the buckets the scheduler hands this process; returns their training sums, compute seconds
        and number. Prefetch only where the scheduler knows what comes next (see job/train/schedule/interfaces.py)."""
        edge_path = self.config.edge_paths[iteration.edge_path_idx]
        total = BatchStats()
        seconds, bucket_idx = 0.0, 0
        record: Optional[dict[str, Any]] = None
        self.waited_s, waited = 0.0, self._wait_mark()  # on the scheduler: next bucket, shared sync (logged)
        while (bucket := self.scheduler.next_bucket(record)) is not None:
            self.waited_s += self._wait_mark() - waited
            self.clock.mark("bucket handed out")
            following, needs = self.scheduler.upcoming()
            if following:  # object stores: download the next bucket while this one trains
                prefetch(edge_format.edges_file(edge_path, following[0].lhs, following[0].rhs))
            # PBG staggers its workers on every bucket of epoch 0 (torchbiggraph/train.py, train_and_report_stats);
            # by default only those with a partition not trained before (HogwildStagger)
            delayed = self.stagger.delays(iteration.epoch, self.buckets.needs(bucket))
            try:
                record, stats, compute_seconds = self.buckets.run(
                    iteration, bucket, bucket_idx, edge_path=edge_path, seed_base=seed_base, delayed=delayed,
                    on_evicted=self.scheduler.release, upcoming=needs, stop=self.scheduler.stop_check(),
                    on_edges=self.sync.prepare)
            except BucketAbandoned as abandoned:
                self.scheduler.abandon(str(abandoned))  # raises: this process leaves its round
                raise
            record["rank"] = self.rank
            self.clock.mark("bucket trained")
            self.clock.report("first bucket trained")
            self.reporter.on_bucket(record)
            total.add(stats)
            seconds += compute_seconds
            bucket_idx += 1
            waited = self._wait_mark()
            self.sync.sync()
        self.waited_s += self._wait_mark() - waited
        return total, seconds, bucket_idx

    def _wait_mark(self) -> float:
        """Wall time less the time blocked on partition I/O: the scheduler's calls, net of the writes they wait on."""
        return time.perf_counter() - self.store.stats.blocked_seconds

    def _commit_pass(self, iteration: Iteration, gathered: PassGather, pass_started: float,
                     resident_at_start: int) -> dict[str, Any]:
        """Commit the pass with its bucket records and summary line; returns the summary."""
        summary: dict[str, Any] = {}

        def records_of(version: int) -> list[dict[str, Any]]:
            io = add_io(self._io_record(resident_at_start), gathered.others_io)
            summary.update(pass_summary(iteration, gathered, time.perf_counter() - pass_started, io, version))
            return gathered.records + [summary]

        self._commit(iteration, records_of)
        self.reporter.on_pass(summary)
        return summary

    def _io_record(self, resident_at_start: int) -> dict[str, Any]:
        """What the pass cost in partition I/O, beside the fewest loads its buffer allows (square grids)."""
        record: dict[str, Any] = self.store.stats.as_record()
        if self.store.capacity is not None and not self.store.exclusive and self.nparts_lhs == self.nparts_rhs:
            partitioned = max(1, sum(1 for e in self.config.entities.values() if e.num_partitions > 1))
            record["partition_loads_lower_bound"] = partitioned * lower_bound_loads(
                self.nparts_lhs, self.buffer_slots(), resident_at_start // partitioned)
        return record

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

    def _commit(self, iteration: Iteration, records_of: Callable[[int], list[dict[str, Any]]]) -> None:
        """Write the whole next version and the pass's stats lines, then move the marker, then drop the old
        version. The lines go before the marker so that a kill after it loses none; a run resumed before it
        drops them (``trim_stats``)."""
        new_version = self.version + 1
        self.store.finish_pass()
        state = self.model.public_state_dict()
        self.checkpoints.write_model(new_version, ModelState(
            {name: (private, tensor.cpu().numpy()) for name, (private, tensor) in state.items()},
            self.relation_optimizer.state_dict()))
        records = records_of(new_version)
        for record in records:
            record.setdefault("checkpoint_version", new_version)
        interval = self.config.checkpoint_preservation_interval
        keep = self._ends_epoch(iteration) and interval is not None and (iteration.epoch + 1) % interval == 0
        self.checkpoints.commit(new_version, records, snapshot_epoch=iteration.epoch if keep else None)
        self.version = new_version

    def close(self) -> None:
        self.store.discard_prefetched()
        self.reporter.close()
        self.checkpoints.close()  # flush and stop background uploads on every exit path; the directory given up
        if self.dist is not None:
            if self.finished_ok:
                leave(self.dist)
            elif self.dist.heartbeat is not None:
                self.dist.heartbeat.stop()  # failing: exit now so that torchrun restarts the group
        self.buckets.close()
