"""The tensor transport of the shared parameters: point-to-point float32 vectors between a trainer and the lock
server's rank, over a gloo process group of their own, each transfer tagged with the request it belongs to.

Why point-to-point with the server rank and not a collective: trainers reach their bucket boundaries at different
times (as PBG's parameter server allows), so no moment exists where every rank could meet. Why a process group of
its own (``dist.new_group(backend="gloo")``, formed by every rank once the group is up, ``for_group``): the lock
server's thread sends and receives on rank 0 while the training thread may run collectives on the default group;
on separate groups their messages never interleave. Why gloo even on GPU pods: the shared vector lives on the CPU
(the server keeps it in host memory, and trainers flatten into a host buffer), and NCCL moves device memory only
and cannot connect two ranks on one GPU, as the local tests and a small pod may run them.

What stays in the lock server's protocol (job/train/distributed.py, through the store): the control messages,
which bucket, how many values follow (``values``) and the request's ``tag``. Only the payload moves here, matched
by (peer, tag) so that a payload can never be taken for another request's: the client posts its ``send`` under a
fresh tag (``next_tag``) before it pushes the request naming that tag, the server ``recv``s it after reading the
request, and answers with the sum under the same tag.

A send completes when the peer has taken the payload (gloo's rendezvous of an unbound buffer), so a sender may
reuse its buffer after ``Transfer.wait``. The server's own rank has no gloo pair with itself: there (rank 0's
trainer and its lock server, two threads of one process) a transfer is a hand-over in memory with the same
semantics. Every wait is bounded (``timeout``): a dead peer fails the transfer (at once when the peer's socket
closes, at the latest after the timeout) instead of holding the server forever. A failed transfer ends the pair
with that peer (gloo closes it after a timeout), so that rank cannot sync again in this round: its next request
fails and it leaves. The round is over anyway (the heartbeat names a dead rank, torchrun re-forms the group, and
every worker process, with its transport, starts again: the group is rebuilt with the round).
"""

from __future__ import annotations

import datetime
import itertools
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist

# a transfer of the whole shared vector (unpartitioned tables: up to GBs) finishes well within this; a peer that
# does not take or send its payload in this time is gone (its round is over)
TRANSFER_TIMEOUT_S = 300.0
_TAGS = 2**31  # gloo's tags are non-negative 32-bit integers


class TransferError(RuntimeError):
    """A payload did not arrive or was not taken (the peer died, or did not answer within the timeout)."""


class Transfer:
    """A posted send: ``wait`` returns once the peer has taken the payload (the buffer may then be reused)."""

    def __init__(self, work: Any = None, taken: Optional[threading.Event] = None, timeout_s: float = 0.0,
                 what: str = "") -> None:
        self._work = work
        self._taken = taken
        self._timeout_s = timeout_s
        self._what = what

    def wait(self) -> None:
        try:
            if self._work is not None:
                self._work.wait(datetime.timedelta(seconds=self._timeout_s))
        except Exception as err:
            raise TransferError(f"{self._what}: not taken ({err})") from err
        if self._taken is not None and not self._taken.wait(self._timeout_s):
            raise TransferError(f"{self._what}: not taken in {self._timeout_s:.0f} s")


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

    @classmethod
    def for_group(cls, rank: int, timeout_s: float = TRANSFER_TIMEOUT_S) -> TensorTransport:
        """A gloo group of every rank of the default group, formed now: every rank must call this, in the same
        order relative to its other group creations (right after the group forms: ``init_distributed``)."""
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return cls(group, rank, timeout_s)

    @classmethod
    def over_store(cls, store: Any, rank: int, world_size: int, timeout_s: float = TRANSFER_TIMEOUT_S) -> TensorTransport:
        """A gloo group of ``world_size`` ranks meeting through ``store`` (a prefixed store of its own), without a
        default process group: for ranks formed by hand (tests, tools). Every rank must call it."""
        group = dist.ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=timeout_s))
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
            return Transfer(taken=taken, timeout_s=self.timeout_s, what=what)
        try:
            work = self._group.send([tensor], peer, tag)
        except Exception as err:
            raise TransferError(f"{what}: not sent ({err})") from err
        return Transfer(work=work, timeout_s=self.timeout_s, what=what)

    def recv(self, into: torch.Tensor, peer: int, tag: int) -> None:
        """Receive ``peer``'s payload of ``tag`` into ``into`` (its size is the payload's, as the request said)."""
        what = f"rank {self.rank}: the shared-parameter payload {tag} from rank {peer}"
        if into.numel() == 0:
            return
        if peer == self.rank:
            with self._local_ready:
                if not self._local_ready.wait_for(lambda: tag in self._local, self.timeout_s):
                    raise TransferError(f"{what}: not sent in {self.timeout_s:.0f} s")
                tensor, taken = self._local.pop(tag)
            if tensor.numel() != into.numel():
                taken.set()
                raise TransferError(f"{what}: {tensor.numel()} values, {into.numel()} expected")
            into.copy_(tensor)
            taken.set()
            return
        try:
            self._group.recv([into], peer, tag).wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as err:
            raise TransferError(f"{what}: not received ({err})") from err
