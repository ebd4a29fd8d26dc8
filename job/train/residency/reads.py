"""Reading a partition into memory: from this pass's version, the committed one, ``init_path``, or fresh.

``PartitionReader`` decides where a partition's rows come from and reads them (with their Adagrad state) into host
memory, or, for a large fresh partition of a GPU store, draws them on the card. It changes no state of the store
(``job/train/residency/partitions.py``) and may run in the store's prefetch thread.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from job.config import ConfigSchema
from job.formats.checkpoint import CheckpointStorage
from job.train.batch.optim import sums_from_state
from job.train.residency.budget import per_coordinate
from job.train.residency.device_copies import DeviceCopies, Uploaded
from job.train.residency.io_stats import IOStats
from job.types import PartitionKey

# a fresh partition of at least this many values is initialised on the GPU itself (a store on one), by the device's
# generator seeded as the CPU's would be: a Freebase86m-size table (8.6G values) takes ~30 s on one CPU core and
# as long again to upload; smaller ones are drawn on the CPU as everywhere, so that a seeded run is the same on both
DEVICE_INIT_VALUES = 1 << 24


@dataclass
class PartitionRead:
    """A partition read into host memory (or, on a GPU, already on the card: ``uploaded``), not yet placed."""

    weight: torch.Tensor
    optim_sum: Optional[torch.Tensor]
    step: int
    seconds: float
    nbytes: int
    uploaded: Optional[Uploaded] = None  # a GPU store's read ahead: already copied to the device (side stream)


class PartitionReader:
    """Where each partition is read from, and the read; one per partition store."""

    def __init__(self, config: ConfigSchema, checkpoint: CheckpointStorage, counts: dict[str, list[int]],
                 device: torch.device, gpu: Optional[DeviceCopies]) -> None:
        self.config = config
        self.checkpoint = checkpoint
        self.counts = counts
        self.device = device
        self.gpu = gpu
        self.init_storage = CheckpointStorage(config.init_path) if config.init_path else None
        self._init_version: Optional[int] = None

    def read(self, key: PartitionKey, *, written: bool, committed: int, stats: IOStats) -> PartitionRead:
        """A partition's values and optimizer state in host memory (a large fresh one on a GPU: on the device);
        changes no state of the store (it may run in the prefetch thread)."""
        entity_type, part = key
        count = self.counts[entity_type][part]
        dim = self.config.entity_dimension(entity_type)
        started = time.perf_counter()
        source = self.source(key, written=written, committed=committed)
        if source is None and self.gpu is not None and count * dim >= DEVICE_INIT_VALUES:
            uploaded = self.gpu.fill_normal((count, dim), stable_seed(self.config.seed, entity_type, part),
                                            self.config.init_std(entity_type, sum(self.counts[entity_type])))
            stats.add(loads=1)
            return PartitionRead(uploaded.tensors[0], None, 0, time.perf_counter() - started, 0, uploaded)
        weight = torch.empty((count, dim), dtype=torch.float32)
        if self.device.type == "cpu":
            # Into shared memory before any page is touched: sharing a filled tensor copies it, which
            # doubles the peak memory of a partition for a moment.
            weight.share_memory_()
        optim_sum: Optional[torch.Tensor] = None
        nbytes = 0
        if source is not None:
            storage, version = source
            array, state = storage.load_entity_partition(version, entity_type, part, out=weight.numpy())
            # from init_path too: PBG 1.0.0 loads the Adagrad state saved beside the embeddings it starts from
            # (torchbiggraph/train.py, load_embeddings and swap_partitioned_embeddings); none saved: zero sums
            optim_sum, step = sums_from_state(state, count, dim, per_coordinate(self.config, entity_type))
            nbytes = array.nbytes
            stats.add(reads=1, bytes_read=nbytes + (optim_sum.numel() if optim_sum is not None else count) * 4)
        else:
            generator = torch.Generator()
            generator.manual_seed(stable_seed(self.config.seed, entity_type, part))
            std = self.config.init_std(entity_type, sum(self.counts[entity_type]))
            weight.normal_(0.0, 1.0, generator=generator).mul_(std)
            step = 0
        stats.add(loads=1)
        return PartitionRead(weight, optim_sum, step, time.perf_counter() - started, nbytes)

    def source(self, key: PartitionKey, *, written: bool, committed: int) -> Optional[tuple[CheckpointStorage, int]]:
        """Where ``key``'s rows are read from: this pass's version, the committed one, ``init_path``; None: fresh."""
        entity_type, part = key
        if written:
            return self.checkpoint, committed + 1
        if committed > 0 and self.checkpoint.has_entity_partition(committed, entity_type, part):
            return self.checkpoint, committed
        if self.init_storage is not None:
            version = self._init_storage_version()
            if self.init_storage.has_entity_partition(version, entity_type, part):
                return self.init_storage, version
        return None

    def _init_storage_version(self) -> int:
        if self._init_version is None:
            assert self.init_storage is not None
            # PBG's init_path may be a plain directory of unversioned files or a checkpoint directory.
            self._init_version = self.init_storage.load_version()
        return self._init_version


def stable_seed(seed: Optional[int], entity_type: str, part: int) -> int:
    base = 0 if seed is None else int(seed)
    if seed is None:
        entropy = np.random.SeedSequence().entropy  # fresh OS entropy: always an int when none is given
        if not isinstance(entropy, int):
            raise TypeError(f"numpy SeedSequence entropy is {type(entropy).__name__}, expected int")
        base = int(entropy % (2**31))
    return (base * 1_000_003 + zlib.crc32(f"{entity_type}/{part}".encode())) % (2**63)
