"""The torchrun group: joining it, agreeing on its round, a heartbeat that notices a lost peer, store barriers,
leaving in order.

Everything travels through the rendezvous TCPStore that ``init_process_group`` already connected
every rank to; the lock server (job/train/distributed/lock_server.py) uses the same store for its requests. The
shared parameters' vectors travel over a gloo group of their own, formed here right after the round is
agreed (``TensorTransport.for_group``, job/train/distributed/transport.py): a worker restarted into a new round
forms a new one with the others.

The round: every time torchrun forms the group (first start, a restart after a lost pod, a scale change) its
ranks agree on one round id, drawn by rank 0 and broadcast over the process group (``agree_round``), and every
store key of ours (barriers, heartbeats, the lock server's queues, checksum records, pass results) lives under
``biggraph/<round>/``. ``TORCHELASTIC_RESTART_COUNT`` cannot name a round: each torchrun agent counts its own
restarts, so a replaced pod (a fresh agent, 0) and the survivors (1) would wait on different barriers forever.
The count is kept only as reported information (``restart_count`` of the pass summary).
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import secrets
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from job.errors import UserError
from job.train.distributed import auth
from job.train.distributed.heartbeat import (  # noqa: F401 - Heartbeat and round_key are this module's API too
    DEFAULT_PEER_INTERVAL_S,
    DEFAULT_PEER_TIMEOUT_S,
    Heartbeat,
    round_key,
)
from job.train.distributed.liveness import Liveness, store_host
from job.train.distributed.protocol import RoundGone
from job.train.distributed.transport import TensorTransport
from job.train.startup import StartupClock

logger = logging.getLogger("biggraph")

MIN_TRANSFER_TIMEOUT_S = 30.0  # a shared-parameter transfer's least timeout (init_distributed)
# How long rank 0 keeps serving, once the round ends, for the live ranks to finish their bucket and give back what they
# hold (``LockServerScheduler``; env BIGGRAPH_DRAIN_TIMEOUT). Under the torchrun agent's grace between its SIGTERM and
# its SIGKILL (30 s, ``LocalElasticAgent._shutdown``'s default, which torchrun's command line cannot set): a rank 0
# killed while others still give back would cut their write groups short
DEFAULT_DRAIN_TIMEOUT_S = 25.0


@dataclass
class DistributedContext:
    rank: int
    world_size: int
    store: Any
    restart_count: int  # this agent's own count: reported, never used to name anything shared
    heartbeat: Optional[Heartbeat] = None
    liveness: Optional[Liveness] = None  # the round's liveness connections (distributed/liveness.py), closed by ``leave``
    round_id: str = "0"  # the same on every rank of this group (``agree_round``): names every store key of ours
    run_id: str = ""  # the job this group trains for (``run_identity``), rank 0's: binds the lock server's progress
    transport: Optional[TensorTransport] = None  # the shared parameters' point-to-point transport (this round's)
    _fence_store: Any = None  # a store client of its own for ``fence`` (called from writer threads too)
    _fence_lock: threading.Lock = field(default_factory=threading.Lock)
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S  # see DEFAULT_DRAIN_TIMEOUT_S
    _terminated: Optional[str] = None  # why this process was asked to stop (SIGTERM), set by ``catch_sigterm``

    def __post_init__(self) -> None:
        """Connect ``fence``'s client now, while the round's store certainly answers. Connected lazily, by the first
        write of a rank that was frozen before it wrote anything in this round, the client would dial a store that
        is gone for the whole timeout of the store it is cloned from (``init_process_group``'s: 30 min), the rank
        stuck in it while the others finish without it (tests/test_cluster_box.py, the ``write`` freeze); an
        open connection to a store that is gone fails at once."""
        if self._fence_store is None and self.store is not None:
            self._fence_store = self.store.clone()
            self._fence_store.set_timeout(datetime.timedelta(seconds=60))

    def key(self, name: str) -> str:
        """The store key ``name`` of this round (a key of an earlier round, or of a rank that counts rounds
        otherwise, never meets it)."""
        return round_key(self.round_id, name)

    def fence(self) -> None:
        """Raise :class:`RoundOver` unless this rank's round still stands: called before every checkpoint file this
        rank writes (``CheckpointManager.fence``). A rank stopped (SIGSTOP, a paused VM, a stalled node) past rank
        0's peer timeout wakes up with rows the others have trained again since; it must not write them over theirs.
        Its round is over when rank 0 declared it dead (``dead/<rank>``) or the round's store is gone (the rank-0
        agent closes it when it re-forms the group). One store round trip per file written. A process that finds
        itself stalled past the peer timeout (``Heartbeat.stalled``) is over too, without asking anyone: a rank 0 that
        thaws finds no ``dead/0`` in its own store, yet its peers left the round (they watch it: ``Liveness``)."""
        stalled = self.heartbeat.stalled() if self.heartbeat is not None else 0.0
        if stalled:
            raise RoundOver(f"rank {self.rank}: round {self.round_id} of the group is over (this process went "
                            f"{stalled:.0f} s without a heartbeat, past the peer timeout: the others went on without "
                            "it); writing nothing more")
        with self._fence_lock:
            try:
                key = self.key(f"dead/{self.rank}")
                # a declaration counts only when rank 0 made it (its MAC): any client of the store can set the key
                declared = self._fence_store.check([key]) and auth.verify(
                    self._fence_store.get(key).decode(errors="replace"), "dead", self.round_id, str(self.rank))
            except Exception as err:  # the store is gone with its round
                raise RoundOver(f"rank {self.rank}: round {self.round_id} of the group is over (its store is gone: "
                                f"{err}); writing nothing more, torchrun restarts this worker into the next "
                                "round") from err
        if declared:
            raise RoundOver(f"rank {self.rank}: round {self.round_id} of the group is over (rank 0 declared this "
                            "rank dead); writing nothing more, torchrun restarts this worker into the next round")

    def catch_sigterm(self) -> None:
        """Turn the torchrun agent's SIGTERM into the round's end instead of the process's: the agent stops every
        worker this way when a node waits to join (a replaced or added pod), with a SIGKILL 30 s later. Stopped at
        once, each rank lost its bucket in flight and every bucket it had done whose partitions it had not yet
        written; asked to end the round, it finishes its bucket and gives back what it holds (the lock server's
        ``ending`` reply, ``LockServerScheduler``), then exits non-zero so that torchrun starts it into the next
        round. The handler only notes it (no I/O or lock in a signal handler); the trainer acts at its next bucket
        boundary or barrier. Main thread only (Python's rule for handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def noted(signum: int, frame: Any) -> None:
            self._terminated = f"this rank (rank {self.rank}) received SIGTERM"

        signal.signal(signal.SIGTERM, noted)

    def lost_ranks(self) -> frozenset[int]:
        """The peers rank 0 declared dead in this round (empty on other ranks: only rank 0 watches)."""
        return self.heartbeat.dead_ranks() if self.heartbeat is not None else frozenset()

    def ending(self) -> Optional[str]:
        """Why this round ends, as this process knows it (a SIGTERM received, a peer declared dead); None while it
        stands. The lock server on rank 0 then hands out no more buckets (``LockServer``)."""
        if self._terminated is not None:
            return self._terminated
        if self.heartbeat is not None and self.heartbeat.dead_rank is not None:
            return (f"rank {self.heartbeat.dead_rank} stopped responding for {self.heartbeat.silent_for:.0f} s")
        return None

    def check_peers(self) -> None:
        """Raise :class:`RoundEnding` when this round ends (a peer stopped, a SIGTERM): torchrun then restarts the
        group and training resumes from progress. Called where this rank holds nothing unsaved (barriers)."""
        why = self.ending()
        if why is not None:
            raise RoundEnding(f"{why}; exiting so that torchrun re-forms the group")


def round_ended(err: BaseException) -> bool:
    """Whether ``err`` is, or was caused by, this rank's round ending from outside (:class:`RoundEnding`,
    :class:`RoundOver`, possibly wrapped by a writer that failed on the fence): the trainer then exits with the
    failure budget's code (job/train/elastic/budget.py), not as a crash."""
    seen: set[int] = set()
    current: Optional[BaseException] = err
    while current is not None and id(current) not in seen:
        if isinstance(current, (RoundEnding, RoundOver, RoundGone)):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


class RoundOver(RuntimeError):
    """This rank's round of the group ended without it (see ``DistributedContext.fence``)."""


class RoundEnding(RuntimeError):
    """This round of the group ends (a peer lost, a SIGTERM) and this rank has given back what it held: it exits
    non-zero so that torchrun starts it into the next round (never counted as success)."""


def init_distributed(digest: str = "", clock: Optional[StartupClock] = None) -> Optional[DistributedContext]:
    """Join the torchrun group when launched by torchrun (or with WORLD_SIZE > 1), and agree on its round.
    ``digest``: the training config's (``config_digest``; part of the run identity, ``run_identity``); ``clock``:
    the trainer's start-up clock, which gets the rendezvous, the round and the transport as phases."""
    mark = clock.mark if clock is not None else (lambda phase: None)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # Under torchrun even a group of one uses the lock server: an elastic job that shrinks to one node
    # must resume its pass from the persisted progress, and grow again later.
    launched_by_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if world_size <= 1 and not launched_by_torchrun:
        return None
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and os.environ.get("BIGGRAPH_BACKEND") == "nccl" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
    mark("rendezvous")
    store = distributed_c10d._get_default_store()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    interval, dead_after = peer_timing(os.environ)
    drain_timeout = drain_timing(os.environ)
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    round_id, run_id = agree_round(rank, run_identity(os.environ, digest))
    mark("round")
    liveness = Liveness(rank, world_size, round_id, ping_interval_s=interval, silent_after_s=dead_after)
    if rank == 0:  # before the collective below: every peer reads the listener's address once through it
        liveness.listen(store, os.environ.get("MASTER_ADDR") or socket.gethostname())
    # collective: every rank, right after the round. A transfer's timeout follows the dead-peer timeout, with a floor
    # for large payloads on a slow network (the lock server applies it itself and never waits on one peer:
    # job/train/distributed/transfers.py; a trainer waits on the server that long at most)
    transport = TensorTransport.for_group(rank, timeout_s=max(dead_after, MIN_TRANSFER_TIMEOUT_S))
    mark("transport")
    # the pid: which process is rank 0 (bench/chaos_events.py freezes it; an operator finds it the same way)
    logger.info("rank %d of %d joined round %s of run %s (pid %d, this agent's restart count: %d)", rank, world_size,
                round_id, run_id, os.getpid(), restart_count)
    heartbeat = Heartbeat(store, rank, world_size, interval=interval, dead_after=dead_after, round_id=round_id)
    # a peer dials rank 0 where it reaches rank 0's store: the store's own host (MASTER_ADDR under torchrun)
    liveness.start(store, heartbeat.lost, hosts=(store_host(store), os.environ.get("MASTER_ADDR")),
                   on_rank0_lost=leave_without_rank0)
    context = DistributedContext(
        rank=rank, world_size=world_size, store=store, restart_count=restart_count, heartbeat=heartbeat,
        liveness=liveness, round_id=round_id, run_id=run_id, transport=transport, drain_timeout_s=drain_timeout,
    )
    context.catch_sigterm()
    return context


def leave_without_rank0(why: str) -> None:
    """A peer whose rank 0 is lost (``Liveness``: silent for the peer timeout, or gone): leave the round at once with
    the failure budget's round-ended code, so that torchrun re-forms the group without it. Nothing can be given back
    (rank 0's server is what would take it) and the main thread may be blocked on rank 0's frozen store, so the
    process ends from here; what it held unsaved is redone, as after a kill, and a file it was writing is either
    fenced (``fence``) or staged under a name no record names (removed by the next round)."""
    from job.train.elastic.budget import round_ended_exit_code

    code = round_ended_exit_code()
    logger.error("%s: exiting with code %d", why, code)
    for handler in logging.getLogger().handlers + logging.getLogger("biggraph").handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(code)


def config_digest(config_json: str) -> str:
    """A short digest of the training config's JSON (without credentials): part of the run identity."""
    return hashlib.sha256(config_json.encode()).hexdigest()[:12]


def run_identity(env: Any, digest: str = "") -> str:
    """What a restart of the same job keeps and a later, different job does not: ``BIGGRAPH_RUN_ID`` if set, else
    torchrun's rendezvous id (``--rdzv-id``: the same for every agent of a job and across its restarts and replaced
    pods; a random one per ``torchrun --standalone`` launch), with a digest of the training config, so that a job
    trained otherwise under the same name does not take up another's interrupted pass."""
    name = env.get("BIGGRAPH_RUN_ID") or env.get("TORCHELASTIC_RUN_ID") or "none"
    return f"{name}/{digest}" if digest else name


def agree_round(rank: int, run_id: str) -> tuple[str, str]:
    """(round id, run id) of the group just formed, the same on every rank: rank 0 draws the round id (a nonce, so
    no two rounds share one, whatever each agent counts) and sends both over the process group (a collective, so
    every rank of this group and only those take part). On gloo itself, or a gloo group beside NCCL (an object
    collective over NCCL would need each rank's card chosen first)."""
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    values: list[Optional[str]] = [secrets.token_hex(8), run_id] if rank == 0 else [None, None]
    dist.broadcast_object_list(values, src=0, group=group)
    round_id, agreed_run = values
    assert round_id is not None and agreed_run is not None
    return round_id, agreed_run


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


def drain_timing(env: Any) -> float:
    """Seconds rank 0 waits, once a round ends, for the live ranks to give back (BIGGRAPH_DRAIN_TIMEOUT; 0: none)."""
    text = env.get("BIGGRAPH_DRAIN_TIMEOUT", "")
    try:
        value = float(text) if text.strip() else DEFAULT_DRAIN_TIMEOUT_S
    except ValueError:
        raise UserError(f"BIGGRAPH_DRAIN_TIMEOUT={text!r}: expected a number of seconds") from None
    if value < 0:
        raise UserError(f"BIGGRAPH_DRAIN_TIMEOUT={text!r}: must be 0 seconds or more")
    return value


def wait_all(context: DistributedContext, name: str, timeout_s: float = 1800.0) -> None:
    """A store-based barrier of this round (each name used once per round)."""
    key = context.key(f"barrier/{name}")
    context.store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while int(context.store.add(key, 0)) < context.world_size:
        context.check_peers()
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: not every rank arrived in {timeout_s:.0f} s")
        time.sleep(0.05)


def leave(context: DistributedContext, timeout_s: float = 60.0) -> None:
    """Leave in order: rank 0 hosts the store, so it goes last (others would see a dead store otherwise). A peer's
    liveness connection says goodbye first and rank 0 stops watching: leaving is not dying."""
    if context.liveness is not None:
        context.liveness.close()
    key = context.key("left")
    try:
        context.store.add(key, 1)
        if context.rank == 0:
            deadline = time.monotonic() + timeout_s
            while int(context.store.add(key, 0)) < context.world_size and time.monotonic() < deadline:
                time.sleep(0.05)
    except Exception:  # a peer or the store is already gone; nothing more to coordinate
        pass
    if context.heartbeat is not None:
        context.heartbeat.stop()
