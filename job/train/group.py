"""The torchrun group: joining it, a heartbeat that notices a lost peer, store barriers, leaving in order.

Everything travels through the rendezvous TCPStore that ``init_process_group`` already connected
every rank to; the lock server (job/train/distributed.py) uses the same store.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from job.errors import UserError

# How fast rank 0 gives up on a silent peer (env BIGGRAPH_PEER_INTERVAL / BIGGRAPH_PEER_TIMEOUT). The timeout
# is the first term of the recovery time after a lost pod (bench/elastic_bench.py: 15 s of a 47 s recovery
# before). 6 s is six missed beats: a beat comes from its own thread and only needs the GIL for a moment,
# so it survives partition writes and training (measured: torch.save of a 400 MB optimizer state holds the
# GIL for 0.4 s, h5py reads and writes and torch kernels release it). A false alarm costs a group restart
# (about 20 s) and the in-flight buckets, never data.
DEFAULT_PEER_INTERVAL_S = 1.0
DEFAULT_PEER_TIMEOUT_S = 6.0


@dataclass
class DistributedContext:
    rank: int
    world_size: int
    store: Any
    restart_count: int
    heartbeat: Optional[Heartbeat] = None

    def check_peers(self) -> None:
        """Raise when a peer stopped: torchrun then restarts the group and training resumes from progress."""
        if self.heartbeat is not None and self.heartbeat.dead_rank is not None:
            raise RuntimeError(
                f"rank {self.heartbeat.dead_rank} stopped responding for {self.heartbeat.dead_after:.0f} s; "
                "exiting so that torchrun re-forms the group without it"
            )


class Heartbeat:
    """Every rank bumps a counter in the store; rank 0 notices a rank whose counter stops moving.

    torchrun's agents do not restart survivors when a node dies and no collective is pending (our
    trainers only talk to the store), so without this the survivors would wait for its bucket forever.
    """

    def __init__(self, store: Any, rank: int, world_size: int, interval: float = DEFAULT_PEER_INTERVAL_S,
                 dead_after: float = DEFAULT_PEER_TIMEOUT_S) -> None:
        self.store = store.clone()
        self.rank = rank
        self.world_size = world_size
        self.interval = interval
        self.dead_after = dead_after
        self.dead_rank: Optional[int] = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="biggraph-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        last_value: dict[int, int] = {}
        last_change: dict[int, float] = {}
        while not self._stop.wait(self.interval):
            try:
                self.store.add(f"biggraph/heartbeat/{self.rank}", 1)
                if self.rank != 0:
                    continue
                now = time.monotonic()
                for peer in range(1, self.world_size):
                    value = int(self.store.add(f"biggraph/heartbeat/{peer}", 0))
                    if last_value.get(peer) != value:
                        last_value[peer] = value
                        last_change[peer] = now
                    elif now - last_change[peer] > self.dead_after:
                        self.dead_rank = peer
            except Exception:  # the store is gone: the main thread will fail on its next call
                return

    def stop(self) -> None:
        self._stop.set()


def init_distributed() -> Optional[DistributedContext]:
    """Join the torchrun group when launched by torchrun (or with WORLD_SIZE > 1)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # Under torchrun even a group of one uses the lock server: an elastic job that shrinks to one node
    # must resume its pass from the persisted progress, and grow again later.
    launched_by_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if world_size <= 1 and not launched_by_torchrun:
        return None
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and os.environ.get("BIGGRAPH_BACKEND") == "nccl" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
    store = distributed_c10d._get_default_store()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    interval, dead_after = peer_timing(os.environ)
    return DistributedContext(
        rank=rank, world_size=world_size, store=store,
        restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        heartbeat=Heartbeat(store, rank, world_size, interval=interval, dead_after=dead_after),
    )


def peer_timing(env: Any) -> tuple[float, float]:
    """(heartbeat interval, dead-peer timeout) in seconds from BIGGRAPH_PEER_INTERVAL / BIGGRAPH_PEER_TIMEOUT."""
    values = []
    for name, default in (("BIGGRAPH_PEER_INTERVAL", DEFAULT_PEER_INTERVAL_S), ("BIGGRAPH_PEER_TIMEOUT", DEFAULT_PEER_TIMEOUT_S)):
        text = env.get(name, "")
        try:
            value = float(text) if text.strip() else default
        except ValueError:
            raise UserError(f"{name}={text!r}: expected a number of seconds") from None
        if not value > 0:
            raise UserError(f"{name}={text!r}: must be more than 0 seconds")
        values.append(value)
    interval, timeout = values
    if timeout < 2 * interval:
        # one late beat would already count as a dead peer
        raise UserError(f"BIGGRAPH_PEER_TIMEOUT ({timeout:g} s) must be at least twice BIGGRAPH_PEER_INTERVAL "
                        f"({interval:g} s)")
    return interval, timeout


def wait_all(context: DistributedContext, name: str, timeout_s: float = 1800.0) -> None:
    """A store-based barrier (each name used once per rendezvous round)."""
    key = f"biggraph/barrier/{name}"
    context.store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while int(context.store.add(key, 0)) < context.world_size:
        context.check_peers()
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: not every rank arrived in {timeout_s:.0f} s")
        time.sleep(0.05)


def leave(context: DistributedContext, timeout_s: float = 60.0) -> None:
    """Leave in order: rank 0 hosts the store, so it goes last (others would see a dead store otherwise)."""
    try:
        context.store.add("biggraph/left", 1)
        if context.rank == 0:
            deadline = time.monotonic() + timeout_s
            while int(context.store.add("biggraph/left", 0)) < context.world_size and time.monotonic() < deadline:
                time.sleep(0.05)
    except Exception:  # a peer or the store is already gone; nothing more to coordinate
        pass
    if context.heartbeat is not None:
        context.heartbeat.stop()
