"""Hogwild! worker processes that live for the whole run.

PBG forks a pool per bucket; we start ``workers`` processes once (spawn: safe beside
the threads fsspec and torch start) and hand them, per bucket, shared-memory handles
to the bucket's embedding tables and edges. Each worker runs one intra-op thread, so
W workers on W cores do not oversubscribe.
"""

from __future__ import annotations

import logging
import queue
import time
import traceback
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.multiprocessing as mp

from job.config import ConfigSchema
from job.model.scoring import Model, Table
from job.train.allocator import keep_freed_memory
from job.train.batching import EdgeTensors, PlannedSlice, plan_batches
from job.train.optim import RelationAdagrad
from job.train.spawning import main_module_hidden
from job.train.step import BatchContext, BatchStats

logger = logging.getLogger("biggraph")


class SharedCursor:
    """Who takes which batch of a delayed slice: its owner from the front, the undelayed worker from the
    back, until they meet. Two int64 counters in shared memory (taken from the front, from the back) under
    the pool's lock, so each batch runs exactly once whichever worker gets it."""

    def __init__(self, counters: torch.Tensor, lock: Any) -> None:
        self.counters = counters
        self.lock = lock

    def claim(self, num_batches: int, from_back: bool) -> Optional[int]:
        """The next batch to run, or None when every batch of the slice is taken."""
        with self.lock:
            front, back = int(self.counters[0]), int(self.counters[1])
            if front + back >= num_batches:
                return None
            self.counters[1 if from_back else 0] += 1
            return num_batches - 1 - back if from_back else front

    def claims(self, num_batches: int, from_back: bool) -> Iterator[int]:
        while (k := self.claim(num_batches, from_back)) is not None:
            yield k

    def exhausted(self, num_batches: int) -> bool:
        with self.lock:
            return int(self.counters[0] + self.counters[1]) >= num_batches


def _wait(delay: float, cursor: SharedCursor, num_batches: int) -> None:
    """Sleep ``delay`` seconds, or less once the other worker has taken every batch."""
    deadline = time.monotonic() + delay
    while (left := deadline - time.monotonic()) > 0 and not cursor.exhausted(num_batches):
        time.sleep(min(left, 0.02))


def _run_task(ctx: BatchContext, task: dict[str, Any], lock: Any) -> BatchStats:
    """One slice of a bucket. PBG's ``hogwild_delay`` holds a slice's worker back; the worker with no delay,
    once its own slice is done, takes the delayed slices' batches from their back meanwhile. The same
    batches run, one worker alone at the start (the delay's point), but no worker idles while batches wait."""
    config = ctx.config
    generator = torch.Generator()
    generator.manual_seed(task["seed"])
    edges = task["edges"]
    total = BatchStats()
    if task["indices"].numel():
        planned = PlannedSlice(edges, plan_batches(edges.rel, task["indices"], config.batch_size,
                                                   config.dynamic_relations, generator))
        n = planned.plan.num_batches
        cursor = SharedCursor(task["cursor"], lock) if task.get("cursor") is not None else None
        if cursor is not None:
            _wait(task["delay"], cursor, n)
        elif task.get("delay"):
            time.sleep(task["delay"])
        for k in range(n) if cursor is None else cursor.claims(n, False):
            total.add(planned.run(ctx, k, generator, task["train"]))
    for indices, seed, counters in task.get("steal", ()):
        victim = PlannedSlice(edges, plan_batches(edges.rel, indices, config.batch_size, config.dynamic_relations,
                                                  torch.Generator().manual_seed(seed)))
        for k in SharedCursor(counters, lock).claims(victim.plan.num_batches, True):
            total.add(victim.run(ctx, k, generator, task["train"]))
    return total


def _worker_main(
    worker_id: int,
    config: ConfigSchema,
    model: Model,
    relation_sums: list[torch.Tensor],
    relation_steps: torch.Tensor,
    tasks: Any,
    results: Any,
    lock: Any,
) -> None:
    torch.set_num_threads(1)
    keep_freed_memory()
    relation_optimizer = RelationAdagrad(list(model.parameters()), config.relation_lr or config.lr)
    relation_optimizer.sums = relation_sums
    relation_optimizer.steps = relation_steps
    results.put(("ready", worker_id, None, None))
    ctx: Optional[BatchContext] = None  # the current task's; dropped (None) between tasks, see below
    stats: Optional[BatchStats] = None
    while True:
        task = tasks.get()
        if task is None:
            return
        task_id = task["id"]
        try:
            ctx = BatchContext(
                config=config,
                model=model,
                relation_optimizer=relation_optimizer if task["train"] else None,
                lhs_tables=task["lhs_tables"],
                rhs_tables=task["rhs_tables"],
                num_batch_negs=task["num_batch_negs"],
                num_uniform_negs=task["num_uniform_negs"],
            )
            stats = _run_task(ctx, task, lock)
            results.put((task_id, worker_id, stats, None))
        except BaseException:  # reported to the parent, which fails the run with it
            results.put((task_id, worker_id, None, traceback.format_exc()))
        # drop this bucket's tables and edges now, not at the next task: an evicted partition's shared
        # memory is freed only when no process maps it (the partition buffer counts on that)
        task = ctx = stats = None  # noqa: F841


class WorkerPool:
    def __init__(self, num_workers: int, config: ConfigSchema, model: Model, relation_optimizer: RelationAdagrad) -> None:
        context = mp.get_context("spawn")
        self.tasks = context.Queue()
        self.results = context.Queue()
        self.lock = context.Lock()  # guards the SharedCursors of delayed slices; inherited by the workers
        self.processes = []
        self._next_id = 0
        for worker_id in range(num_workers):
            process = context.Process(
                target=_worker_main,
                args=(worker_id, config, model, relation_optimizer.sums, relation_optimizer.steps, self.tasks, self.results,
                      self.lock),
                daemon=True,
                name=f"biggraph-hogwild-{worker_id}",
            )
            with main_module_hidden():  # the API works from a script without a main guard, or from stdin
                process.start()
            self.processes.append(process)
        # Wait until every worker has imported torch and unpickled the model: starting up costs seconds
        # of CPU, which would otherwise be taken from the first buckets' training.
        ready = 0
        while ready < num_workers:
            try:
                message = self.results.get(timeout=5.0)
            except queue.Empty:
                dead = [p.name for p in self.processes if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"Hogwild worker(s) died while starting: {', '.join(dead)}") from None
                continue
            ready += message[0] == "ready"

    def run(
        self,
        edges: EdgeTensors,
        index_slices: list[torch.Tensor],
        lhs_tables: dict[int, Table],
        rhs_tables: dict[int, Table],
        seeds: list[int],
        train: bool,
        num_batch_negs: int,
        num_uniform_negs: int,
        delays: Optional[list[float]] = None,
    ) -> BatchStats:
        """Process each slice of edges on its own worker; wait for all and sum their stats. ``delays``: seconds
        each slice's worker waits (PBG's ``hogwild_delay``); the first slice with none takes the batches of the
        delayed ones from their back while they wait (``_run_task``)."""
        delays = list(delays) if delays else [0.0] * len(index_slices)
        cursors = [torch.zeros(2, dtype=torch.long).share_memory_() if d > 0 else None for d in delays]
        thief = next((i for i, d in enumerate(delays) if d <= 0), None)
        pending = set()
        for indices in index_slices:
            indices.share_memory_()
        for i, indices in enumerate(index_slices):
            self._next_id += 1
            pending.add(self._next_id)
            steal = [(index_slices[j], seeds[j], cursors[j]) for j in range(len(index_slices))
                     if cursors[j] is not None] if i == thief else []
            self.tasks.put({
                "id": self._next_id, "edges": edges, "indices": indices, "lhs_tables": lhs_tables,
                "rhs_tables": rhs_tables, "seed": seeds[i], "train": train, "num_batch_negs": num_batch_negs,
                "num_uniform_negs": num_uniform_negs, "delay": delays[i], "cursor": cursors[i], "steal": steal,
            })
        total = BatchStats()
        while pending:
            try:
                task_id, worker_id, stats, error = self.results.get(timeout=5.0)
            except queue.Empty:
                dead = [p.name for p in self.processes if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"worker(s) died: {', '.join(dead)} (out of memory? is /dev/shm big enough?)") from None
                continue
            if error is not None:
                raise RuntimeError(f"Hogwild worker {worker_id} failed:\n{error}")
            pending.discard(task_id)
            total.add(stats)
        return total

    def close(self) -> None:
        for _ in self.processes:
            self.tasks.put(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
        self.processes = []
