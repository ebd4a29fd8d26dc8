"""The partition buffer: how many partitions stay in memory, which one leaves, and what the I/O cost.

A bucket (l, r) needs partition l of its lhs types and partition r of its rhs types. PBG holds
exactly the current bucket's partitions, so nearly every bucket change writes one partition and
reads another, and the trainer waits for both. biggraph holds up to ``capacity`` partitions
(``partition_buffer`` per partitioned type, or as many of the largest as ``memory_budget`` allows):

- a partition leaves only when the buffer is full, and then the one whose next use in the pass
  is farthest away (Belady's rule: optimal for a known sequence of buckets);
- with ``prefetch_partitions``, while a bucket trains a background thread writes back the partition
  the next bucket will evict (when the current bucket does not use it) and then reads the one it
  needs into the freed memory: the same loads as without, the buffer never exceeded, the wait gone;
- distributed trainers hold only the current bucket's partitions (the others may need the rest);
  with ``prefetch_partitions`` the lock server reserves their next bucket early and they read its
  missing partitions within the same capacity while the current bucket trains;
- ``bucket_order: buffer`` (job/train/schedule/orders.py) walks the buckets so that the loads per pass
  come close to the lower bound for the buffer size.

``IOStats`` counts what a pass read and wrote and how long training waited for it.
"""

from __future__ import annotations

import logging
from typing import Optional

import storage_adapters as storage
from job.config import ConfigSchema
from job.errors import ConfigError
from job.formats.uploads import MAX_PENDING_UPLOADS, UPLOAD_THREADS
from storage_adapters.multipart import transfer_buffer_bytes

logger = logging.getLogger("biggraph")

PROCESS_FALLBACK_BYTES = 192 * 2**20  # a process with torch loaded, measured ~170-185 MiB anonymous here
# how many buckets' partitions a distributed trainer keeps after they left, for their next holder
# (``partition_handoff``): with one, the partition a peer asks for had often been dropped already (2 trainers, P=8:
# 4-7 of ~10 asks a pass read the file); with two, about none
KEPT_BUCKETS = 2


def per_coordinate(config: ConfigSchema, entity_type: str) -> bool:
    """Whether ``entity_type``'s Adagrad state has a sum per coordinate (``entity_optimizer: adagrad``; a frozen
    type is never stepped, so it keeps the one float per row it has always had)."""
    return config.entity_optimizer == "adagrad" and not config.entities[entity_type].frozen


def row_bytes(config: ConfigSchema, entity_type: str) -> int:
    """Bytes a row of ``entity_type`` takes in memory: its float32 embedding and its Adagrad state (one float32 with
    PBG's row-wise Adagrad, one per coordinate with ``entity_optimizer: adagrad``)."""
    dim = config.entity_dimension(entity_type)
    return (dim + (dim if per_coordinate(config, entity_type) else 1)) * 4


def partition_bytes(config: ConfigSchema, counts: dict[str, list[int]]) -> int:
    """Bytes of the largest partition of a partitioned type: embeddings (float32) + Adagrad state."""
    return max((count * row_bytes(config, t)
                for t, e in config.entities.items() if e.num_partitions > 1 for count in counts[t]), default=0)


def unpartitioned_bytes(config: ConfigSchema, counts: dict[str, list[int]]) -> int:
    return sum(counts[t][0] * row_bytes(config, t) for t, e in config.entities.items() if e.num_partitions == 1)


def process_bytes() -> int:
    """This process's own memory now (anonymous pages: torch's runtime, the model, buffers), which each
    Hogwild worker process costs about as much of; a fixed guess where /proc is not there."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return PROCESS_FALLBACK_BYTES


def checkpoint_transfer_bytes(checkpoint_url: str) -> int:
    """What the storage layer holds for a checkpoint's transfers at most: on S3, a part per background upload
    and a prefetch's and a foreground read's chunks (s3fs' own transfers would hold 500 MiB a file); nothing
    for local files (the page cache is the kernel's)."""
    if storage.scheme_of(checkpoint_url) not in storage.S3_SCHEMES:
        return 0
    return transfer_buffer_bytes(uploads=UPLOAD_THREADS, downloads=2)


def choose_capacity(config: ConfigSchema, counts: dict[str, list[int]], distributed: bool, processes: int = 1,
                    runtime_bytes: Optional[int] = None, transfer_bytes: int = 0, sync_bytes: int = 0) -> Optional[int]:
    """How many partitions (of partitioned types) the buffer holds; None: exactly the current bucket's, as
    PBG. Logs why. Distributed trainers keep only the current bucket's partitions resident (the partitions
    they hold are locked from the others); with ``prefetch_partitions`` the capacity bounds those plus the
    ones read ahead for the reserved next bucket, without it they hold the bucket's only (None).

    ``memory_budget`` is the whole trainer's memory (what a container limit is): the ``processes`` (the
    trainer and its Hogwild workers) cost ``runtime_bytes`` each (default: measured on this one), the
    unpartitioned types are held whole, one partition is in flight at a swap (the one arriving is
    allocated before every process has let go of the one leaving), ``transfer_bytes`` are the storage
    layer's transfer buffers (object stores: the parts of uploads and downloads in flight), and ``sync_bytes``
    the shared parameters' copies a distributed trainer keeps to sync them (``sync_memory_bytes`` in
    job/train/distributed/lock_server.py: a fixed number per rank, more on the lock server's); a distributed trainer also
    holds host copies of the partitions it keeps at a switch while its write group is written behind
    (``kept_copy_bytes``); the rest is the buffer (in whose room a distributed trainer's hand-off keeps
    partitions: ``handoff_kept_partitions``)."""
    partitioned = [t for t, e in config.entities.items() if e.num_partitions > 1]
    if not partitioned or (distributed and not config.prefetch_partitions):
        return None
    total = sum(config.entities[t].num_partitions for t in partitioned)
    per_part = partition_bytes(config, counts)
    per_bucket = 2 * len(partitioned)  # what one bucket may need at most
    if config.partition_buffer is not None:
        capacity, why = config.partition_buffer * len(partitioned), "partition_buffer"
    elif (budget := config.memory_budget_bytes) is not None:
        runtime = processes * (process_bytes() if runtime_bytes is None else runtime_bytes)
        copies = kept_copy_bytes(config, counts) if distributed else 0
        fixed = unpartitioned_bytes(config, counts) + runtime + per_part + transfer_bytes + sync_bytes + copies
        capacity = (budget - fixed) // per_part if per_part else total
        why = (f"memory_budget {_gib(budget)}: {_gib(runtime)} for {processes} process(es), "
               f"{_gib(unpartitioned_bytes(config, counts))} for unpartitioned types, {_gib(per_part)} for a "
               "partition in flight" + (f", {_gib(transfer_bytes)} for transfers to and from the object store"
                                        if transfer_bytes else "")
               + (f", {_gib(sync_bytes)} to sync the shared parameters" if sync_bytes else "")
               + (f", {_gib(copies)} for the kept partitions' copies of a write group" if copies else ""))
        if capacity < per_bucket:
            raise ConfigError(
                f"config key 'memory_budget': {config.memory_budget} holds {max(capacity, 0)} partition(s) of "
                f"{_gib(per_part)} next to {_gib(fixed)} for the processes, unpartitioned types, "
                + ("the shared parameters' sync with the group, " if sync_bytes else "")
                + f"and a partition in flight; a bucket needs {per_bucket}: raise it to at least "
                f"{_gib(per_bucket * per_part + fixed)} or use more partitions"
            )
    else:
        # one more than a bucket needs: room for the next partition to arrive while another bucket trains
        extra = len(partitioned) if config.prefetch_partitions else 0
        capacity = per_bucket + extra
        why = "default: a bucket's partitions" + (" + one to swap in the background" if extra else " (PBG)")
    capacity = max(per_bucket, min(capacity, total))
    if distributed:
        why += "; distributed: the current bucket's partitions + the next bucket's read ahead, nothing else kept"
    logger.info("partition buffer: %d of %d partitions in memory (%s; up to %s each, %s in all)", capacity, total,
                why, _gib(per_part), _gib(capacity * per_part))
    return capacity


# a GPU's memory beyond the resident partitions: the bucket's edges and their shuffle (~64 B an edge), the batch
# step's workspace and captured graphs, CUDA's own context; the larger of a fixed floor and a share of the card
DEVICE_RESERVE_FLOOR = 4 * 2**30
DEVICE_RESERVE_SHARE = 0.2


def device_capacity(config: ConfigSchema, counts: dict[str, list[int]], free_bytes: int) -> Optional[int]:
    """How many partitions a single trainer on a GPU holds on the card when ``partition_buffer`` is unset: as many
    as fit in ``free_bytes`` (the card's free memory at start) beside a reserve for the bucket's edges and the
    step's workspace, at least a bucket's. A card that holds every partition never swaps after the first pass's
    loads (the CUDA graphs captured for a bucket are replayed for every later bucket with the same tables), which
    is what makes P>1 cost about what P=1 does; one that holds fewer swaps through the host, as the CPU trainer
    does with its buffer. None: nothing is partitioned."""
    partitioned = [t for t, e in config.entities.items() if e.num_partitions > 1]
    if not partitioned:
        return None
    total = sum(config.entities[t].num_partitions for t in partitioned)
    per_part = partition_bytes(config, counts)
    per_bucket = 2 * len(partitioned)
    reserve = max(DEVICE_RESERVE_FLOOR, int(DEVICE_RESERVE_SHARE * free_bytes))
    room = free_bytes - reserve - unpartitioned_bytes(config, counts)
    fits = room // per_part if per_part else total
    capacity = max(per_bucket, min(total, fits))
    logger.info("partition buffer on the GPU: %d of %d partitions (%s free, %s kept for edges and workspace, up to "
                "%s a partition)", capacity, total, _gib(free_bytes), _gib(reserve), _gib(per_part))
    return capacity


def kept_copy_bytes(config: ConfigSchema, counts: dict[str, list[int]]) -> int:
    """The host copies a distributed trainer takes at a bucket switch of the partitions it keeps, to write them
    in its write group while the next bucket trains on the originals (job/checkpoint/write_groups.py): at most a
    bucket's partitions less the one leaving. (The partitions ``partition_handoff`` keeps after they left live in
    the buffer's room: ``handoff_kept_partitions``.)"""
    partitioned = [t for t, e in config.entities.items() if e.num_partitions > 1]
    return max(0, 2 * len(partitioned) - 1) * partition_bytes(config, counts)


def _held_by_a_distributed_trainer(config: ConfigSchema) -> int:
    """The partitions a distributed trainer's buffer holds: the current bucket's and the next one's read ahead."""
    return 2 * 2 * sum(1 for e in config.entities.values() if e.num_partitions > 1)


def _budgets_the_buffer(config: ConfigSchema, capacity: Optional[int]) -> bool:
    """Whether ``capacity`` came from ``memory_budget`` (not from ``partition_buffer``, nor None: no buffer sized)."""
    return config.memory_budget_bytes is not None and config.partition_buffer is None and capacity is not None


def handoff_kept_partitions(config: ConfigSchema, capacity: Optional[int]) -> int:
    """How many partitions a distributed trainer keeps after they left, for their next holder (``partition_handoff``;
    job/train/distributed/handoff.py): two buckets' (``KEPT_BUCKETS``). Under a ``memory_budget`` they live in the
    room of the buffer that a distributed trainer does not use (``choose_capacity`` sizes ``capacity`` partitions;
    it holds only its bucket's and the next one's read ahead): as many as fit there, none when none do (the rank
    still takes partitions from the others, and reads the files of what it did not keep). So hand-offs never make
    a budget too small; a tight one keeps fewer partitions."""
    partitioned = sum(1 for e in config.entities.values() if e.num_partitions > 1)
    most = KEPT_BUCKETS * 2 * partitioned
    if capacity is None or not _budgets_the_buffer(config, capacity):
        return most
    return min(most, max(0, capacity - _held_by_a_distributed_trainer(config)))


def pinned_partitions(config: ConfigSchema, capacity: Optional[int]) -> Optional[int]:
    """Written behind (``write_behind_buckets``), how many partitions a distributed trainer may keep pinned between
    cuts (rows released unwritten, never dropped before a cut stores them; job/train/distributed/cuts.py) within its
    ``memory_budget``: the buffer's room that a distributed trainer does not use (``choose_capacity`` gives it
    ``capacity`` partitions, and it holds only its bucket's and the next one's read ahead), where the hand-off's
    kept partitions live too (``handoff_kept_partitions``); with no room sized by the budget (``partition_buffer``
    set, or no buffer without ``prefetch_partitions``), the hand-off's kept partitions. The server makes a cut due
    before a rank's next switch could pass it. None without a budget: unbounded (at most every partition the rank
    released since the last cut)."""
    if config.memory_budget_bytes is None:
        return None
    room = max(0, (capacity or 0) - _held_by_a_distributed_trainer(config))
    if _budgets_the_buffer(config, capacity):
        return room
    return handoff_kept_partitions(config, capacity) + room


def shared_memory_bytes(config: ConfigSchema, counts: dict[str, list[int]], capacity: Optional[int]) -> int:
    """What a CPU trainer keeps in /dev/shm (torch's shared memory, where every table is allocated even with no
    Hogwild worker): the ``capacity`` resident partitions (None: a bucket's, as ``choose_capacity`` means it),
    one more in flight at a swap, and the unpartitioned types, each with its row-wise Adagrad sums: the
    tables ``choose_capacity`` counts in ``memory_budget``."""
    partitioned = [t for t, e in config.entities.items() if e.num_partitions > 1]
    resident = (capacity if capacity is not None else 2 * len(partitioned)) + (1 if partitioned else 0)
    return resident * partition_bytes(config, counts) + unpartitioned_bytes(config, counts)


def staging_bytes(config: ConfigSchema, counts: dict[str, list[int]]) -> int:
    """The local disk (TMPDIR) a trainer stages checkpoint files in when checkpoint_path is on an object store:
    whole files read (the one needed now and one read ahead) and the files of a version built before their
    upload (at most ``MAX_PENDING_UPLOADS`` at once), each up to the largest table; nothing for a local one."""
    if storage.is_local(config.checkpoint_path):
        return 0
    tables = [count * row_bytes(config, t) for t in config.entities for count in counts[t]]
    return (2 + min(MAX_PENDING_UPLOADS, len(tables))) * max(tables, default=0)


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"


# the shared vector's copies, for memory_budget (``sync_memory_bytes``): a trainer's synced values and transfer
# buffer (``SharedParameters``); the server's served and stored vectors and its transfer slots (``LockServer``,
# job/train/distributed/transfers.py)
TRANSFER_SLOTS = 3  # vectors for transfers in flight: up to two frozen peers leave one for everybody else
# updates of buckets done but not yet saved that the server keeps in memory (``SharedVector``); more wait in local
# temporary files, so rank 0's memory does not grow with the group
PENDING_VECTORS = 4
# the server's buffers of sparse payloads in flight (a bucket's changed rows, a pull's rows: job/train/distributed/
# shared_rows.py), this many vectors' values in all; a sparse payload past them waits for one to end
SPARSE_TRANSFER_VECTORS = 1
CLIENT_VECTORS = 3  # synced, the transfer buffer, a sparse payload or pull (at most half a vector)
# served, stored, persisted (what the progress files hold), the copy a progress write of the whole vector takes
# (job/train/distributed/commits.py: one at a time)
SERVER_VECTORS = 4 + TRANSFER_SLOTS + PENDING_VECTORS + SPARSE_TRANSFER_VECTORS


def shared_values(parameters: int, config: ConfigSchema, counts: dict[str, list[int]]) -> int:
    """How many values ``shared_state`` holds: the model's ``parameters`` and their dense Adagrad sums, each
    unpartitioned table's rows and their row sums (from the config and the entity counts, before anything is
    loaded: what ``memory_budget`` and a pod's sizing count)."""
    # the sums: (rows,) row-wise, (rows, dim) per coordinate (``entity_optimizer: adagrad``)
    return 2 * parameters + sum(
        counts[t][0] * config.entity_dimension(t) * (2 if per_coordinate(config, t) else 1) + (
            0 if per_coordinate(config, t) else counts[t][0])
        for t, e in config.entities.items() if e.num_partitions == 1)


# ``shared_shards`` (job/train/distributed/shard_routing.py): a trainer's pushes and pulls are sparse whatever their
# size, up to a whole vector, and a pull is assembled from its owners' parts in one more
SHARD_CLIENT_VECTORS = 2
# a shard's slice of 1/M of the rows (shard_service.py): served, stored, persisted, at most ``PENDING_VECTORS`` updates
SHARD_VECTORS = 3 + PENDING_VECTORS


def sync_memory_bytes(values: int, serves: bool, shards: int = 0) -> int:
    """The shared parameters' sync memory of one trainer process (what ``memory_budget`` counts for it): its
    ``CLIENT_VECTORS``, and on the server's rank the server's ``SERVER_VECTORS`` too (served, stored, persisted, the copy
    a whole-vector progress write takes, the transfer
    slots, the sparse payloads' buffers, and at most ``PENDING_VECTORS`` updates of buckets done but not yet saved:
    the rest wait on local disk). ``shards``: with ``shared_shards``, the group's size (each rank but 0 serves a
    slice of 1/shards of the rows: ``SHARD_VECTORS`` of it; every trainer ``SHARD_CLIENT_VECTORS`` more)."""
    vectors = CLIENT_VECTORS + (SERVER_VECTORS if serves else 0)
    shard = values * (SHARD_CLIENT_VECTORS + (0 if serves else SHARD_VECTORS / shards)) if shards > 1 else 0
    return 4 * (values * vectors + int(shard))
