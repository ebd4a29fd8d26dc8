"""Hogwild! worker processes that live for the whole run.

PBG forks a pool per bucket; we start ``workers`` processes once (from a fork server that has
imported torch, or spawned: never forked from the trainer, whose threads a fork would copy; see
``job.train.hogwild.spawning``) and hand them, per bucket, shared-memory handles to the bucket's embedding
tables and edges. Each worker runs one intra-op thread, so
W workers on W cores do not oversubscribe.
"""

from __future__ import annotations

import atexit
import errno
import logging
import multiprocessing
import queue
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any, Optional

import torch

from job import native
from job.config import ConfigSchema
from job.model.kernel_options import KernelOptions
from job.model.scoring import Model, Table
from job.train.batch.allocator import keep_freed_memory
from job.train.batch.batching import PlannedSlice, plan_batches
from job.train.batch.optim import RelationAdagrad
from job.train.batch.step import BatchContext, BatchStats, BucketAbandoned
from job.train.hogwild.spawning import (
    apply_environment,
    main_module_hidden,
    raise_open_file_limit,
    sigterm_blocked,
    worker_context,
    worker_environment,
)
from job.train.hogwild.work_sharing import SharedSlice
from job.train.inputs import EdgeTensors

logger = logging.getLogger("biggraph")

STOP_POLL_SECONDS = 0.5  # how often a trainer waiting on its workers polls its ``stop`` (``WorkerPool.run``)
PARENT_CHECK_SECONDS = 2.0  # how often an idle worker checks that its trainer still runs


def _wait(delay: float, shared: SharedSlice) -> None:
    """Sleep ``delay`` seconds, or less once other workers have taken every batch."""
    deadline = time.monotonic() + delay
    while (left := deadline - time.monotonic()) > 0 and not shared.exhausted():
        time.sleep(min(left, 0.02))


def _run_task(ctx: BatchContext, task: dict[str, Any], lock: Any) -> BatchStats:
    """One slice of a bucket, then batches of the delayed slices (``work_sharing``).

    A delayed slice's owner plans it, publishes the plan, waits out its delay (or until its batches are all
    taken) and takes the rest from the front; a worker done with its own slice takes delayed slices' batches
    from their back. The same batches run, one worker alone at the start (the delay's point), none idle."""
    config = ctx.config
    generator = torch.Generator()
    generator.manual_seed(task["seed"])
    if config.embedding_dropout > 0 and task["train"]:
        # its masks come from torch's global generator (F.dropout; a CUDA graph replays those draws correctly),
        # which every spawned or forked worker starts in the same state: without this the workers' k-th batches
        # would share their masks, in every bucket and every run
        torch.manual_seed(task["seed"])
    edges = task["edges"]
    total = BatchStats()
    own: Optional[SharedSlice] = task["shared"].with_lock(lock) if task["shared"] is not None else None
    if task["indices"].numel():
        plan = plan_batches(edges.rel, task["indices"], config.batch_size, config.dynamic_relations, generator)
        planned = PlannedSlice(edges, plan)
        if own is not None:
            own.publish(plan)
            _wait(task["delay"], own)
        for k in range(plan.num_batches) if own is None else own.claims(plan.num_batches, False):
            total.add(planned.run(ctx, k, generator, task["train"]))
        del planned, plan
    for shared in task["steal"]:
        shared = shared.with_lock(lock)
        if shared.exhausted():
            continue
        victim = PlannedSlice(edges, shared.plan(edges.rel, config.batch_size, config.dynamic_relations))
        for k in shared.claims(victim.plan.num_batches, True):
            total.add(victim.run(ctx, k, generator, task["train"]))
        del victim
    return total


def _worker_main(
    worker_id: int,
    config: ConfigSchema,
    setup: Any,
    *,
    tasks: Any,
    results: Any,
    lock: Any,
    environment: dict[str, str],
    options: KernelOptions,
) -> None:
    """A worker's life: take the trainer's environment, then the shared model from ``setup`` (a pipe's end: see
    ``WorkerPool``), then tasks until a ``None`` or until the trainer is gone. ``options``: the trainer's kernel
    options, for every batch it runs (a module global set in the trainer would not reach a forked or spawned
    worker: it imports the module afresh).

    A SIGTERM is the trainer's to act on, never the worker's: torchrun's agent stops a worker by signalling its
    whole process group, Hogwild workers included, and the trainer then finishes its bucket and gives back what it
    holds, or gives the bucket up (job/train/schedule/group.py). A worker ended by it would lose the slice its trainer
    still waits for. So a worker ignores SIGTERM from birth (started with it blocked: ``spawning.sigterm_blocked``;
    ignored here before it is unblocked), and ends only by its pool (a ``None`` task, or a kill when the bucket is
    given up), by its trainer's death (below), or by the agent's SIGKILL 30 s after its SIGTERM (issue 44: this
    held only by timing before, a SIGTERM racing the handler that judged it)."""
    trainer = multiprocessing.parent_process()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a SIGTERM pending since birth is dropped
    apply_environment(environment)  # before anything reads it: a forked worker has the fork server's
    torch.set_num_threads(1)
    keep_freed_memory()
    try:
        model, relation_sums, relation_steps = setup.recv()
    except EOFError:  # the trainer gave up before sending (it says why)
        return
    setup.close()
    relation_optimizer = RelationAdagrad(list(model.parameters()), config.relation_lr or config.lr)
    relation_optimizer.sums = relation_sums
    relation_optimizer.steps = relation_steps
    results.put(("ready", worker_id, None, None))
    ctx: Optional[BatchContext] = None  # the current task's; dropped (None) between tasks, see below
    stats: Optional[BatchStats] = None
    while True:
        try:
            task = tasks.get(timeout=PARENT_CHECK_SECONDS)
        except queue.Empty:
            # A killed trainer (SIGKILL, an OOM kill, torchrun tearing a group down) sends no None. The workers,
            # which hold the queue's write end themselves, would wait for ever - and keep the fork server alive.
            if trainer is not None and not trainer.is_alive():
                return
            continue
        if task is None:
            return
        task_id = task["id"]
        try:
            # the schedule's factor for this bucket (job/train/lr_schedule.py): the config this worker took at start
            # holds the configured rates only
            relation_optimizer.scale = task["lr_scale"]
            ctx = BatchContext(
                config=config,
                model=model,
                relation_optimizer=relation_optimizer if task["train"] else None,
                lhs_tables=task["lhs_tables"],
                rhs_tables=task["rhs_tables"],
                num_batch_negs=task["num_batch_negs"],
                num_uniform_negs=task["num_uniform_negs"],
                options=options,
                lr_scale=task["lr_scale"],
            )
            stats = _run_task(ctx, task, lock)
            results.put((task_id, worker_id, stats, None))
        except BaseException:  # reported to the parent, which fails the run with it
            results.put((task_id, worker_id, None, traceback.format_exc()))
        # drop this bucket's tables and edges now, not at the next task: an evicted partition's shared
        # memory is freed only when no process maps it (the partition buffer counts on that)
        task = ctx = stats = None  # noqa: F841


class WorkerPool:
    """``num_workers`` Hogwild processes sharing ``model`` and its relation optimizer state, started once; each
    trains with ``options`` (the trainer's kernel options, handed over at start)."""

    def __init__(self, num_workers: int, config: ConfigSchema, model: Model, relation_optimizer: RelationAdagrad,
                 options: KernelOptions) -> None:
        context = worker_context()
        # the native kernels are compiled (on a first run) here, once, not by every worker at its first batch
        native.library()
        self.config = config
        self.tasks = context.Queue()
        self.results = context.Queue()
        self.lock = context.Lock()  # guards the SharedSlices of delayed slices; inherited by the workers
        # ``close`` at the interpreter's exit too, before multiprocessing's own exit hook (whose SIGTERM the workers
        # ignore, and whose join has no timeout)
        atexit.register(self.close)
        self.processes = []
        self._next_id = 0
        # The shared tensors go through a pipe once the worker runs, not with its start: a fork server takes at
        # most ~250 file descriptors with a start (one per shared tensor: a model of 300 relations failed); a
        # pipe passes any number. Every worker is started before any is sent its share: a send blocks until its
        # worker reads, and spawned workers import torch meanwhile, all at once.
        raise_open_file_limit()  # each shared tensor is an open descriptor until every worker has taken it
        senders = []
        for worker_id in range(num_workers):
            receive, send = context.Pipe(duplex=False)
            process = context.Process(
                target=_worker_main,
                args=(worker_id, config, receive),
                kwargs=dict(tasks=self.tasks, results=self.results, lock=self.lock, environment=worker_environment(),
                            options=options),
                daemon=True,
                name=f"biggraph-hogwild-{worker_id}",
            )
            # the API works from a script without a main guard, or from stdin; the worker starts with SIGTERM blocked
            with main_module_hidden(), sigterm_blocked():
                process.start()
            receive.close()  # the worker's copy only: a worker that dies before reading breaks the pipe
            self.processes.append(process)
            senders.append(send)
        shared = (model, relation_optimizer.sums, relation_optimizer.steps)
        for worker_id, send in enumerate(senders):
            try:
                send.send(shared)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the worker died; the wait below says so
            except OSError as error:
                for other in senders:  # the workers still waiting for their share end (EOF) instead of hanging
                    other.close()
                self.close()
                hint = (" (the open file limit, `ulimit -n`, must cover a descriptor per parameter tensor)"
                        if error.errno == errno.EMFILE else "")
                raise RuntimeError(f"could not hand the shared model to Hogwild worker {worker_id}: {error}{hint}") from None
            finally:
                send.close()
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
        *,
        seeds: list[int],
        train: bool,
        num_batch_negs: int,
        num_uniform_negs: int,
        delays: Optional[list[float]] = None,
        lr_scale: float = 1.0,
        stop: Optional[Callable[[], bool]] = None,
    ) -> BatchStats:
        """Process each slice of edges on its own worker; wait for all and sum their stats. ``delays``: seconds
        each slice's worker waits (PBG's ``hogwild_delay``); meanwhile the workers done with their own slice take
        the delayed slices' batches (``_run_task``). ``lr_scale``: the learning-rate schedule's factor for this
        bucket (job/train/lr_schedule.py), for every optimizer the workers step. ``stop``: polled while the workers
        train (every ``STOP_POLL_SECONDS``); True gives the bucket up: the workers, mid-slice, are killed
        (``abandon``) and ``BucketAbandoned`` raised."""
        delays = list(delays) if delays else [0.0] * len(index_slices)
        shared = [SharedSlice.allocate(indices, seed, self.config.batch_size, len(self.config.relations))
                  if delay > 0 else None for indices, seed, delay in zip(index_slices, seeds, delays)]
        pending = set()
        for i, indices in enumerate(index_slices):
            self._next_id += 1
            pending.add(self._next_id)
            self.tasks.put({
                "id": self._next_id, "edges": edges, "indices": indices.share_memory_(), "lhs_tables": lhs_tables,
                "rhs_tables": rhs_tables, "seed": seeds[i], "train": train, "num_batch_negs": num_batch_negs,
                "num_uniform_negs": num_uniform_negs, "delay": delays[i], "shared": shared[i],
                "steal": [s for j, s in enumerate(shared) if s is not None and j != i],
                "lr_scale": lr_scale,
            })
        total = BatchStats()
        while pending:
            if stop is not None and stop():
                self.abandon()
                raise BucketAbandoned(f"given up with {len(pending)} of {len(index_slices)} slices in training")
            try:
                task_id, worker_id, stats, error = self.results.get(timeout=5.0 if stop is None else STOP_POLL_SECONDS)
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

    def abandon(self) -> None:
        """Kill the workers in the middle of their slices (their bucket is given up: nothing they would still
        write is read), so that the process can leave now; the pool is unusable afterwards."""
        for process in self.processes:
            process.kill()
        self.close()

    def close(self) -> None:
        atexit.unregister(self.close)
        for _ in self.processes:
            self.tasks.put(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        self.processes = []
