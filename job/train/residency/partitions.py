"""Which embedding partitions are in memory, and swapping them through checkpoint storage.

Up to ``capacity`` partitions of partitioned types are held (job/train/residency/budget.py), plus the
unpartitioned types. ``exclusive`` stores (distributed trainers: what they hold is locked from the
others) keep exactly the current bucket's partitions, plus, within ``capacity``, those of the next
bucket read ahead (no capacity: no read-ahead, as PBG); what they let go at a bucket's start is written, with the
partitions they keep, as one *write group* (``write_group``: staged names, one server record, then the PBG names;
job/checkpoint/write_groups.py), on the I/O thread while the bucket trains with ``prefetch_partitions``. A
partition leaving memory is written into the *next*, uncommitted checkpoint version, exactly as
PBG does: the committed version stays intact until the pass ends and the version marker moves,
so a crash at any moment — a background write included — leaves a loadable checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

import storage_adapters as storage
from job.checkpoint.write_groups import WriteGroup, publish_group
from job.config import ConfigSchema
from job.formats.checkpoint import CheckpointStorage
from job.model.scoring import Table
from job.train.batch.optim import entity_adagrad_state
from job.train.residency.budget import per_coordinate
from job.train.residency.copy_slots import CopySlots
from job.train.residency.device_copies import DeviceCopies
from job.train.residency.eviction import pick_victim
from job.train.residency.io_stats import IOStats
from job.train.residency.reads import PartitionRead, PartitionReader
from job.types import PartitionKey

if TYPE_CHECKING:  # a torchrun group's (partition_handoff); the store itself knows nothing of groups
    from job.train.distributed.handoff import PartitionHandoff

logger = logging.getLogger("biggraph")



@dataclass(frozen=True)
class Residency:
    """What a store may hold: ``capacity`` partitioned partitions at most (None: the bucket's only), and whether
    what it holds is locked from other trainers (``exclusive``: distributed; resident = the current bucket's, plus
    the next one's read ahead). Fixed for the store's life: decided once from the memory budget and the mode."""

    capacity: Optional[int] = None
    exclusive: bool = False


class PartitionStore:
    def __init__(
        self,
        config: ConfigSchema,
        checkpoint: CheckpointStorage,
        committed_version: int,
        entity_counts: dict[str, list[int]],
        metadata: Callable[[], dict],
        device: torch.device,
        residency: Residency = Residency(),
    ) -> None:
        self.config = config
        self.checkpoint = checkpoint
        self.committed = committed_version
        self.counts = entity_counts
        self.metadata = metadata  # the checkpoint manager's: what the files written now carry
        self.device = device
        self.loaded: dict[PartitionKey, Table] = {}
        self.steps: dict[PartitionKey, int] = {}
        self.written: set[PartitionKey] = set()
        self.io_seconds = 0.0
        self.io_bytes = 0
        self.pending: dict[PartitionKey, Future[PartitionRead]] = {}  # prefetched reads not yet taken by ``get``
        self.writing: dict[PartitionKey, Future[None]] = {}  # background write-backs not yet known to be done
        self._prefetcher: Optional[ThreadPoolExecutor] = None
        self.prefetched_reads = 0  # partitions taken from a prefetch (tests read it)
        self.residency = residency
        self.stats = IOStats()
        self._copies = CopySlots()  # host buffers the kept partitions of a write group are copied to
        self._group_behind: Optional[Future[None]] = None  # the last write group written on the I/O thread
        # a GPU store: uploads and downloads on a stream of their own (job/train/residency/device_copies.py)
        self.gpu = DeviceCopies(device) if device.type == "cuda" else None
        self.reader = PartitionReader(config, checkpoint, entity_counts, device, self.gpu)
        # partition_handoff (job/train/distributed/handoff.py): rows kept in a rank's memory, taken before the file
        self.peers: Optional[PartitionHandoff] = None

    @property
    def capacity(self) -> Optional[int]:
        return self.residency.capacity

    @property
    def exclusive(self) -> bool:
        return self.residency.exclusive

    def set_written(self, keys: Iterable[PartitionKey]) -> None:
        """The partitions of the next version already written, by any trainer (a torchrun group's lock server
        keeps that record): they are read from the next version, not the committed one."""
        self.written = set(keys)

    @property
    def next_version(self) -> int:
        return self.committed + 1

    def all_keys(self) -> list[PartitionKey]:
        return [(t, p) for t, e in self.config.entities.items() for p in range(e.num_partitions)]

    # loading ------------------------------------------------------------------------------------
    def get(self, key: PartitionKey) -> Table:
        table = self.loaded.get(key)
        if table is None:
            pending = self.pending.pop(key, None)
            if pending is not None:
                self.prefetched_reads += 1
                self.stats.add(prefetched=1)
            if pending is None:
                self._wait_written(key)  # a background write-back of it must land before it is read again
                if self.exclusive:
                    self.drain()  # distributed: the tables being written still take room in the buffer
            table = self._place(key, pending.result() if pending is not None else self._read(key))
            self.loaded[key] = table
        return table

    def _wait_written(self, key: PartitionKey) -> None:
        future = self.writing.pop(key, None)
        if future is not None:
            future.result()

    def _executor(self) -> ThreadPoolExecutor:
        # one thread: a write-back and the read into the memory it frees run in that order
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="biggraph-prefetch")
        return self._prefetcher

    def prefetch(self, keys: set[PartitionKey]) -> None:
        """Start reading the partitions among ``keys`` that are not resident, in a background thread.

        Used (``prefetch_partitions``) with the next bucket's partitions while the current bucket trains:
        those are not resident, so nothing writes them meanwhile and their source (this pass's version,
        the committed one, ``init_path`` or random) cannot change before ``get`` takes them. They are read
        into host memory; moving to a GPU happens in ``get``, on the training thread.
        """
        for key in sorted(keys):
            if key in self.loaded or key in self.pending:
                continue
            self.pending[key] = self._executor().submit(storage.carry(self._read_ahead), key)

    def discard_prefetched(self) -> None:
        """Drop reads that will not be used (the run stops); background writes finish (into the uncommitted
        version: nothing committed depends on them)."""
        for future in self.pending.values():
            future.cancel()
        self.pending.clear()
        self.writing.clear()
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True, cancel_futures=True)
            self._prefetcher = None

    # the buffer ---------------------------------------------------------------------------------
    def _held_partitioned(self) -> list[PartitionKey]:
        return [k for k in list(self.loaded) + list(self.pending) if self.is_partitioned(k)]

    def _victim_for(self, keys: set[PartitionKey], upcoming: Sequence[set[PartitionKey]]) -> Optional[PartitionKey]:
        """The resident partition to make room for ``keys`` (Belady over ``upcoming``); ``hold`` and ``prepare``
        must agree on it, or the background swap would change the loads of the plan."""
        return pick_victim([k for k in self.loaded if self.is_partitioned(k) and k not in keys], upcoming)

    def hold(self, keys: set[PartitionKey], upcoming: Sequence[set[PartitionKey]] = ()) -> list[PartitionKey]:
        """Make ``keys`` resident within the buffer; when it is full, write out the partition needed again
        latest in ``upcoming`` (the buckets after this one). Returns the partitions written out."""
        started = time.perf_counter()
        if self.capacity is None or self.exclusive:
            evicted = self.hold_only(keys)
            self.stats.blocked_seconds += time.perf_counter() - started
            return evicted
        evicted = []
        for key in sorted(keys):
            if key in self.loaded or key in self.pending or not self.is_partitioned(key):
                continue
            while len(self._held_partitioned()) >= self.capacity:
                victim = self._victim_for(keys, upcoming)
                if victim is None:
                    raise RuntimeError(f"partition buffer of {self.capacity} cannot hold the bucket's {sorted(keys)}")
                self.evict(victim)
                evicted.append(victim)
            self.get(key)  # at once: the room just made is this key's
        for key in sorted(keys):
            self.get(key)
        self.stats.blocked_seconds += time.perf_counter() - started
        return evicted

    def prepare(self, following: set[PartitionKey], current: set[PartitionKey], upcoming: Sequence[set[PartitionKey]]) -> None:
        """While the current bucket trains: in the background, write back what the following bucket will
        evict and read what it needs into the room it frees. The victim is the one ``hold`` would pick for
        the following bucket (so the loads stay those of the plan); when that one is in use by the current
        bucket, nothing happens early and ``hold`` swaps in the foreground. The buffer is never exceeded.
        ``exclusive`` (distributed): nothing is evicted early (the rest were written back when the bucket
        started); as many of the following bucket's partitions are read as the buffer has room for."""
        if self.capacity is None:
            return
        if self.exclusive:
            missing = sorted(k for k in following if self.is_partitioned(k) and k not in self.loaded)
            room = max(0, self.capacity - len(self._held_partitioned()))
            self.prefetch(set(missing[:room]))
            return
        for key in sorted(following):
            if key in self.loaded or key in self.pending or not self.is_partitioned(key):
                continue
            if len(self._held_partitioned()) >= self.capacity:
                victim = self._victim_for(following, upcoming)
                if victim is None or victim in current:
                    return
                self.evict_behind(victim)
            self.pending[key] = self._executor().submit(storage.carry(self._read_after), key,
                                                        self.writing.pop(key, None))

    def _read_after(self, key: PartitionKey, write: Optional[Future[None]]) -> PartitionRead:
        """Read ``key`` once its own write-back (queued before on the same thread) is done; if that write
        failed, fail too rather than read an older copy."""
        if write is not None:
            write.result()
        return self._read_ahead(key)

    def _read_ahead(self, key: PartitionKey) -> PartitionRead:
        """``_read`` for a prefetch, in the I/O thread: on a GPU the partition is uploaded there too (the side
        stream), so that the bucket that takes it waits for nothing but an event."""
        read = self._read(key)
        if self.gpu is not None and read.weight.device.type == "cpu":
            started = time.perf_counter()
            host = [read.weight] + ([read.optim_sum] if read.optim_sum is not None else [])
            read.uploaded = self.gpu.upload(*host)
            read.seconds += time.perf_counter() - started
        return read

    def drain(self) -> None:
        """Wait for every background write-back (their errors surface here, before anything is committed)."""
        for key in list(self.writing):
            self._wait_written(key)

    def _load(self, key: PartitionKey) -> Table:
        return self._place(key, self._read(key))

    def _read(self, key: PartitionKey) -> PartitionRead:
        """A partition's rows and optimizer state: from a rank that keeps its current rows (``partition_handoff``),
        else from where they are now (job/train/residency/reads.py); changes no state of the store (it may run in the
        prefetch thread)."""
        if self.peers is not None:  # the last grant named a rank keeping the current rows: the file's bytes, no read
            entity_type, part = key
            count = self.counts[entity_type][part]
            dim = self.config.entity_dimension(entity_type)
            started = time.perf_counter()
            rows = self.peers.take(key, (count, dim), per_coordinate(self.config, entity_type), self.device.type == "cpu")
            if rows is not None:
                self.stats.add(loads=1, handed_in=1 if rows.received else 0, bytes_handed_in=rows.received,
                               kept_hits=0 if rows.received else 1)
                return PartitionRead(rows.weight, rows.optim_sum, rows.step, time.perf_counter() - started, 0)
            # a holder whose rows a cut stored (writes behind): the cut may be newer than what this rank heard
            told_stored = self.peers.told_stored(key)
        else:
            told_stored = False
        return self.reader.read(key, written=key in self.written or told_stored, committed=self.committed,
                                stats=self.stats)

    def _place(self, key: PartitionKey, read: PartitionRead) -> Table:
        started = time.perf_counter()
        self.steps[key] = read.step
        per_row = not per_coordinate(self.config, key[0])
        if read.uploaded is not None and self.gpu is not None:
            # read ahead (or initialised) on the side stream: this stream waits for the copy, the host does not
            tensors = self.gpu.ready(read.uploaded)
            weight = tensors[0]
            optim_sum = tensors[1] if len(tensors) > 1 else torch.zeros(
                read.weight.shape[0] if per_row else read.weight.shape, device=weight.device)
        else:
            sums = read.optim_sum
            if sums is None:
                sums = torch.zeros(read.weight.shape[0] if per_row else read.weight.shape)
            weight = read.weight.to(self.device)
            optim_sum = sums.to(self.device)
        if self.device.type == "cpu":
            weight.share_memory_()
            optim_sum.share_memory_()
        self.io_bytes += read.nbytes
        self.io_seconds += read.seconds + time.perf_counter() - started
        return Table(weight=weight, optim_sum=optim_sum)

    # writing ------------------------------------------------------------------------------------
    def evict(self, key: PartitionKey) -> None:
        table = self.loaded.pop(key)
        self._write(key, table)

    def evict_behind(self, key: PartitionKey) -> None:
        """Take ``key`` out of memory and write it back in the background thread; a read of it (``get``,
        ``prefetch``) runs after that write, on the same thread or by waiting for it."""
        table = self.loaded.pop(key)
        after = self.gpu.mark() if self.gpu is not None else None  # a GPU: what training wrote, nothing after
        self.writing[key] = self._executor().submit(storage.carry(self._write), key, table, after)
        self.stats.add(written_behind=1)

    def _write(self, key: PartitionKey, table: Table, after: Optional[torch.cuda.Event] = None) -> None:
        """Write ``key`` under its PBG name in the next version (a single process, and a pass's final write)."""
        self._save(key, table, after=after)
        self.written.add(key)

    def _host(self, tensor: torch.Tensor, after: Optional[torch.cuda.Event]) -> torch.Tensor:
        """``tensor`` in host memory: on a GPU copied on the store's side stream once ``after`` (the training
        thread's event when it let the table go; None: now) has happened, never queued behind later batches."""
        if self.gpu is not None and tensor.device.type == "cuda":
            return self.gpu.to_host(tensor, after)
        return tensor.detach().cpu()

    def _save(self, key: PartitionKey, table: Table, name: Optional[str] = None,
              after: Optional[torch.cuda.Event] = None) -> None:
        """``table`` into the next version: under the PBG name of ``key``, or under ``name`` (a staged write)."""
        entity_type, part = key
        started = time.perf_counter()
        weight = self._host(table.weight, after).numpy()
        optim_sum = self._host(table.optim_sum, after) if table.optim_sum is not None else None
        state = entity_adagrad_state(optim_sum, self.config.lr, self.steps.get(key, 0)) if optim_sum is not None else None
        self.checkpoint.save_entity_partition(self.next_version, entity_type, part, weight, state, self.metadata(),
                                              name=name)
        state_floats = optim_sum.numel() + weight.shape[0] if optim_sum is not None and optim_sum.dim() == 2 else weight.shape[0]
        self.stats.add(writes=1, bytes_written=weight.nbytes + state_floats * 4)
        self.io_bytes += weight.nbytes
        self.io_seconds += time.perf_counter() - started

    # write groups (distributed) -------------------------------------------------------------------
    def write_group(self, keep: set[PartitionKey], commit: Callable[[WriteGroup], None],
                    behind: bool) -> tuple[list[PartitionKey], Optional[Future[None]]]:
        """An exclusive store at a bucket switch: let go of the resident partitions not in ``keep`` by writing them
        and the kept ones as one group (``take_group``), staged, then ``commit(group)`` (the scheduler's: the
        server's record, ``publish``, the locks freed). With ``behind`` on the I/O thread (a read of a leaving
        partition waits for the whole group, publication included); else now. Returns the partitions leaving and,
        behind, the group's future (its error raises there). Nothing leaves: no group, nothing written."""
        group = self.take_group(keep, copy_kept=behind)
        if group is None:
            return [], None
        after = self.gpu.mark() if self.gpu is not None else None  # a GPU: the leaving tables as training left them

        def task() -> None:
            self.stage(group, after=after)
            commit(group)

        if not behind:
            task()
            return group.leaving, None
        future = self._executor().submit(storage.carry(task))
        self._group_behind = future
        for key in group.leaving:
            self.writing[key] = future
        self.stats.add(written_behind=len(group.names))
        return group.leaving, future

    def take_group(self, keep: set[PartitionKey], copy_kept: bool) -> Optional[WriteGroup]:
        """The group of a switch to a bucket holding ``keep``: the resident partitions not in it leave memory, the
        others stay (``copy_kept``: their tables as host copies, for a write while the next bucket trains on
        them; ``memory_budget`` counts them, job/train/residency/budget.py). None when nothing leaves: then every done
        bucket's rows are still all in memory and nothing needs writing."""
        resident = self.resident_partitioned()
        leaving = sorted(resident - keep)
        if not leaving:
            return None
        if copy_kept and self._group_behind is not None:
            self._group_behind.result()  # its copies are in the slots about to be reused (normally long done)
        tables = {key: self.loaded.pop(key) for key in leaving}
        for slot, key in enumerate(sorted(resident & keep)):
            table = self.loaded[key]
            tables[key] = self._copies.take(slot, table) if copy_kept else table
        return WriteGroup.of(self.next_version, leaving, tables)

    def stage(self, group: WriteGroup, keys: Optional[Sequence[PartitionKey]] = None,
              after: Optional[torch.cuda.Event] = None) -> None:
        """Write ``keys`` of ``group`` (all by default) under their staged names (``after``: see ``_host``)."""
        for key in group.keys if keys is None else keys:
            self._save(key, group.tables[key], group.names[key], after=after)

    def publish(self, group: WriteGroup, keys: Optional[Sequence[PartitionKey]] = None) -> None:
        """Move ``keys`` of ``group`` (all by default; the server recorded the group) to their PBG names: read
        from the next version from now on."""
        published = group.keys if keys is None else list(keys)
        publish_group(self.checkpoint, group, published)
        self.written.update(published)

    def hold_only(self, keys: set[PartitionKey]) -> list[PartitionKey]:
        """Make exactly ``keys`` resident: write out the others, load the missing ones; return those written out."""
        evicted = [k for k in self.loaded if k not in keys]
        for key in evicted:
            self.evict(key)
        for key in sorted(keys):
            self.get(key)
        return evicted

    def is_partitioned(self, key: PartitionKey) -> bool:
        return self.config.entities[key[0]].num_partitions > 1

    def resident_partitioned(self) -> set[PartitionKey]:
        return {k for k in self.loaded if self.is_partitioned(k)}

    def load_unpartitioned(self) -> list[Table]:
        return [self.get((t, 0)) for t, e in self.config.entities.items() if e.num_partitions == 1]

    def finish_pass(self) -> None:
        """Write every partition into the next version so that it is complete on its own.

        Resident partitions stay in memory: the next pass usually starts with some of them.
        """
        started = time.perf_counter()
        self.drain()
        for key, table in self.loaded.items():
            self._write(key, table)
        for key in self.all_keys():
            if key not in self.written:
                # never touched by this pass (an entity type no relation uses): carry it over
                self._write(key, self._load(key))
        self.stats.commit_seconds += time.perf_counter() - started

    def start_pass(self, committed_version: int) -> None:
        self.committed = committed_version
        self.written.clear()
        self.stats = IOStats()
