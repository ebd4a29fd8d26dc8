"""The tensor transport of the shared parameters: point-to-point float32 vectors between a trainer and the lock
server's rank, over a gloo process group of their own, each transfer tagged with the request it belongs to.

Why point-to-point with the server rank and not a collective: trainers reach their bucket boundaries at different
times (as PBG's parameter server allows), so no moment exists where every rank could meet. Why a process group of
its own (``dist.new_group(backend="gloo")``, formed by every rank once the group is up, ``for_group``): the lock
server's thread sends and receives on rank 0 while the training thread may run collectives on the default group;
on separate groups their messages never interleave. Why gloo even on GPU pods: the shared vector lives on the CPU
(the server keeps it in host memory, and trainers flatten into a host buffer), and NCCL moves device memory only
and cannot connect two ranks on one GPU, as the local tests and a small pod may run them.

What stays in the lock server's protocol (job/train/distributed/lock_server.py, through the store): the control messages,
which bucket, how many values follow (``values``) and the request's ``tag``. Only the payload moves here, matched
by (peer, tag) so that a payload can never be taken for another request's: the client posts its ``send`` under a
fresh tag (``next_tag``) before it pushes the request naming that tag, the server ``recv``s it after reading the
request, and answers with the sum under the same tag.

A send completes when the peer has taken the payload (gloo's rendezvous of an unbound buffer), so a sender may
reuse its buffer after ``Transfer.wait``. The server's own rank has no gloo pair with itself: there (rank 0's
trainer and its lock server, two threads of one process) a transfer is a hand-over in memory with the same
semantics.

Timeouts. A trainer's waits are bounded by ``timeout``: a dead server fails them (at once when its socket closes,
at the latest after the timeout). gloo answers a wait that times out by closing *every* pair of the process's
group, not only the late peer's (measured: after a send to rank 1 timed out, a send to rank 2 failed with
"Application timeout caused pair closure"), which is harmless on a trainer (its round is over) but would cut the
lock server off from every rank because of one frozen peer. So the server never lets gloo time out: it posts its
receives (``recv_async``) and sends and waits on them off its serving thread with ``wait(UNBOUNDED)``, applying the
timeout itself (job/train/distributed/transfers.py): a peer past it is treated as gone, its buffer kept until gloo is
done with it (the peer thaws and takes it, or its socket closes). The round is over anyway: the heartbeat names
the late rank, torchrun re-forms the group, and every worker process, with its transport, starts again.
"""

from __future__ import annotations

import datetime
import itertools
import threading
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

# a transfer of the whole shared vector (unpartitioned tables: up to GBs) finishes well within this; a peer that
# does not take or send its payload in this time is gone (its round is over)
TRANSFER_TIMEOUT_S = 300.0
_TAGS = 2**31  # gloo's tags are non-negative 32-bit integers
# what ``wait_unbounded`` gives gloo as its timeout: never reached (the lock server applies its own)
_FOREVER_S = 10 * 365 * 86400.0


class TransferError(RuntimeError):
    """A payload did not arrive or was not taken (the peer died, or did not answer within the timeout)."""


class Transfer:
    """A posted send or receive: ``wait`` returns once the payload was taken (a send: the buffer may then be reused)
    or has arrived (a receive), and raises ``TransferError`` when it failed or timed out."""

    def __init__(self, work: Any = None, finish: Optional[Callable[[float], None]] = None, timeout_s: float = 0.0,
                 what: str = "", failed: str = "failed") -> None:
        """``work``: gloo's; ``finish``: a hand-over in memory, completed by calling it with the time it may wait;
        ``what`` and ``failed``: the error's words (``"<what>: <failed> (<gloo's error>)"``)."""
        self._work = work
        self._finish = finish
        self.timeout_s = timeout_s
        self.what = what
        self._failed = failed

    def wait(self) -> None:
        """Wait at most the transport's timeout (a trainer's wait on the server)."""
        self._wait(self.timeout_s)

    def wait_unbounded(self) -> None:
        """Wait without gloo's timeout, whose expiry would close every pair of the group (the module docstring):
        the lock server's waits, from a thread of their own, the server applying the timeout itself."""
        self._wait(_FOREVER_S)

    def _wait(self, limit_s: float) -> None:
        try:
            if self._work is not None:
                self._work.wait(datetime.timedelta(seconds=limit_s))
        except Exception as err:
            raise TransferError(f"{self.what}: {self._failed} ({err})") from err
        if self._finish is not None:
            self._finish(limit_s)


class TensorTransport:
    """One process's end of the shared-parameter transport (see the module docstring): ``send``/``recv`` of
    contiguous float32 CPU tensors to and from a rank of ``group``, under a tag of ``next_tag``."""

    def __init__(self, group: Any, rank: int, timeout_s: float = TRANSFER_TIMEOUT_S) -> None:
        """``group``: a gloo process group whose ranks are the job's ranks (its ``send``/``recv`` are used)."""
        self._group = group
        self.rank = rank
        self.timeout_s = timeout_s
        self._tags = itertools.count()
        self._tag_lock = threading.Lock()
        self._local: dict[int, tuple[torch.Tensor, threading.Event]] = {}  # hand-overs within this process
        self._local_ready = threading.Condition()
        # payload bytes posted to and from other ranks (this pod's link; the in-memory hand-overs are not counted):
        # bench/scale_bench.py reports rank 0's against the shards' (``shared_shards``)
        self.bytes_sent = 0
        self.bytes_received = 0

    @classmethod
    def for_group(cls, rank: int, timeout_s: float = TRANSFER_TIMEOUT_S) -> TensorTransport:
        """A gloo group of every rank of the default group, formed now: every rank must call this, in the same
        order relative to its other group creations (right after the group forms: ``init_distributed``)."""
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return cls(group, rank, timeout_s)

    @classmethod
    def over_store(cls, store: Any, rank: int, world_size: int, timeout_s: float = TRANSFER_TIMEOUT_S,
                   group_timeout_s: Optional[float] = None) -> TensorTransport:
        """A gloo group of ``world_size`` ranks meeting through ``store`` (a prefixed store of its own), without a
        default process group: for ranks formed by hand (tests, tools). Every rank must call it.

        ``group_timeout_s`` (at least ``timeout_s``): gloo's own, which bounds forming the group too. A tool that
        wants a short transfer deadline (the lock server's, ``timeout_s``) on a loaded machine gives the mesh
        longer to form than that."""
        group_timeout = max(timeout_s, group_timeout_s or timeout_s)
        group = dist.ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=group_timeout))
        return cls(group, rank, timeout_s)

    def next_tag(self) -> int:
        """A tag no other transfer of this process uses (the server answers under the request's tag)."""
        with self._tag_lock:
            return next(self._tags) % _TAGS

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> Transfer:
        """Post ``tensor`` to ``peer`` under ``tag``; leave it untouched until the returned ``Transfer`` is waited."""
        what = f"rank {self.rank}: the shared-parameter payload {tag} to rank {peer}"
        if tensor.numel() == 0:  # nothing to carry (a model without shared parameters)
            return Transfer()
        if peer == self.rank:
            taken = threading.Event()
            with self._local_ready:
                self._local[tag] = (tensor, taken)
                self._local_ready.notify_all()

            def handed_over(limit_s: float) -> None:
                if not taken.wait(limit_s):
                    raise TransferError(f"{what}: not taken in {limit_s:.0f} s")

            return Transfer(finish=handed_over, timeout_s=self.timeout_s, what=what)
        self.bytes_sent += tensor.numel() * tensor.element_size()  # (a count, not exact under threads: a figure)
        try:
            work = self._group.send([tensor], peer, tag)
        except Exception as err:
            raise TransferError(f"{what}: not sent ({err})") from err
        return Transfer(work=work, timeout_s=self.timeout_s, what=what, failed="not taken")

    def recv(self, into: torch.Tensor, peer: int, tag: int) -> None:
        """Receive ``peer``'s payload of ``tag`` into ``into`` (its size is the payload's, as the request said)."""
        self.recv_async(into, peer, tag).wait()

    def recv_async(self, into: torch.Tensor, peer: int, tag: int) -> Transfer:
        """Post the receive of ``peer``'s payload of ``tag`` into ``into``; it has arrived once the returned
        ``Transfer`` is waited (the lock server's receives: waited off its serving thread)."""
        what = f"rank {self.rank}: the shared-parameter payload {tag} from rank {peer}"
        if into.numel() == 0:
            return Transfer()
        if peer == self.rank:
            return Transfer(finish=lambda limit_s: self._take_local(into, tag, what, limit_s), timeout_s=self.timeout_s,
                            what=what)
        self.bytes_received += into.numel() * into.element_size()
        try:
            work = self._group.recv([into], peer, tag)
        except Exception as err:
            raise TransferError(f"{what}: not received ({err})") from err
        return Transfer(work=work, timeout_s=self.timeout_s, what=what, failed="not received")

    def _take_local(self, into: torch.Tensor, tag: int, what: str, limit_s: float) -> None:
        """The hand-over in memory from this process's other end (rank 0's trainer to its server, or back)."""
        with self._local_ready:
            if not self._local_ready.wait_for(lambda: tag in self._local, limit_s):
                raise TransferError(f"{what}: not sent in {limit_s:.0f} s")
            tensor, taken = self._local.pop(tag)
        if tensor.numel() != into.numel():
            taken.set()
            raise TransferError(f"{what}: {tensor.numel()} values, {into.numel()} expected")
        into.copy_(tensor)
        taken.set()
