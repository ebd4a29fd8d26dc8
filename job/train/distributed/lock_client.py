"""A trainer's side of the lock server's protocol (job/train/distributed/lock_server.py has the server and the protocol's
description): the requests' queues and messages, ``LockClient``, and ``SharedParameters`` (the tensors every trainer
updates, flattened for the push/pull), with the memory their sync costs (``sync_memory_bytes``, for
``memory_budget``).

Kept apart from the server so that each stays one concern: the client never waits on anything but its own
request, the server never waits on any one client (job/train/distributed/transfers.py).
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch

from job.train.distributed.lock_state import PartKey
from job.train.distributed.transfers import TRANSFER_SLOTS
from job.train.distributed.transport import TensorTransport, TransferError
from job.train.residency.buffer import per_coordinate
from job.train.schedule.orders import Bucket

# the store queues live under a prefix of the group's round (``DistributedContext.key("lock")``), so that a request
# of an earlier round, or a server of one, never meets this round's
DEFAULT_PREFIX = "biggraph/lock"
SERVER_RANK = 0  # the rank whose process runs the lock server
# the shared vector's copies, for memory_budget (``sync_memory_bytes``): a trainer's synced values and transfer
# buffer (``SharedParameters``); the server's served and stored vectors and its transfer slots (``LockServer``,
# job/train/distributed/transfers.py)
CLIENT_VECTORS = 2
SERVER_VECTORS = 2 + TRANSFER_SLOTS


def request_queue(prefix: str) -> str:
    return f"{prefix}/requests"


def response_queue(prefix: str, rank: int, channel: str = "") -> str:
    return f"{prefix}/response/{rank}{channel}"


class LockServerError(RuntimeError):
    """The lock server answered a request with an error (its message names the server's error), or did not answer."""



def pack(header: dict[str, Any]) -> bytes:
    return json.dumps(header).encode()


def unpack(raw: bytes) -> dict[str, Any]:
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("the message is not a JSON object")
    return header


class LockClient:
    """One rank's connection to the lock server. ``channel``: a second client of the same rank (used from another
    thread: the background writer releasing what it stored) gets its replies on its own queue. ``transport``: this
    process's end of the shared-parameter transport (job/train/distributed/transport.py), for the client that carries the
    shared parameters' changes (``finish_and_next`` with a change, ``sync``); None for one that never does."""

    def __init__(self, store: Any, rank: int, timeout_s: float = 600.0, channel: str = "",
                 prefix: str = DEFAULT_PREFIX, transport: Optional[TensorTransport] = None) -> None:
        self.requests = request_queue(prefix)
        self.responses = response_queue(prefix, rank, channel)
        self.store = store.clone()
        self.timeout_s = timeout_s
        self.store.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.rank = rank
        self.channel = channel
        self.transport = transport
        self.last_why: Optional[str] = None  # why the round ends, from the last ``ending`` reply

    def _call(self, request: dict[str, Any], change: Optional[torch.Tensor] = None) -> dict[str, Any]:
        """Ask; with ``change`` (a contiguous float32 CPU vector), send it along and receive the sum into it."""
        request = dict(request, rank=self.rank, channel=self.channel)
        transfer = None
        if change is not None:
            if self.transport is None:
                raise ValueError(f"lock client of rank {self.rank}{self.channel}: no transport for shared parameters")
            request.update(values=change.numel(), tag=self.transport.next_tag())
            # posted before the request names it: the server receives it as soon as it reads the request
            transfer = self.transport.send(change, SERVER_RANK, request["tag"])
        asked = time.monotonic()
        try:
            self.store.queue_push(self.requests, pack(request))
            raw = self.store.queue_pop(self.responses, block=True)
        except Exception as err:
            waited = time.monotonic() - asked
            if waited < self.timeout_s - 1.0:  # not the timeout: the store itself went away (its host is gone)
                raise LockServerError(
                    f"lock server (rank 0): lost the store while asking {request['op']!r} after {waited:.1f} s "
                    f"({err}); the group this rank belonged to is gone (rank 0 died, or this rank was stopped and "
                    "the others re-formed the group without it)") from err
            raise LockServerError(
                f"lock server (rank 0): no answer to {request['op']!r} in {self.timeout_s:.0f} s ({err}); rank 0 is "
                "gone or the group is being re-formed") from err
        reply = unpack(raw)
        if not reply.get("ok", False):
            raise LockServerError(f"lock server (rank 0) refused {request['op']!r}: {reply.get('error')}")
        if change is not None and transfer is not None:
            try:
                transfer.wait()  # taken before the reply was sent: the buffer is free for the sum
                assert self.transport is not None
                self.transport.recv(change, SERVER_RANK, request["tag"])
            except TransferError as err:
                raise LockServerError(f"lock server (rank 0): the shared parameters of {request['op']!r} did not "
                                      f"travel: {err}") from err
        return reply

    def next_bucket(self, held: set, finished: Optional[Bucket], record: Optional[dict]) -> tuple[str, Optional[Bucket], set]:
        kind, bucket, dirty, _ = self.finish_and_next(held, finished, record)
        return kind, bucket, dirty

    def finish_and_next(self, held: set, finished: Optional[Bucket], record: Optional[dict],
                        change: Optional[torch.Tensor] = None,
                        leaving: Optional[str] = None,
                        gave_up: bool = False) -> tuple[str, Optional[Bucket], set, Optional[torch.Tensor]]:
        """Finish ``finished`` (its stats ``record``, and ``change``: the shared-parameter change it made, a
        contiguous float32 CPU vector) and ask for the next bucket: (kind, bucket, partitions written this pass,
        the shared parameters' sum if ``change``: received into ``change`` itself). ``leaving``: why this rank
        leaves (its SIGTERM): the round ends, kind is then ``ending`` (give back what it holds, then exit).
        ``gave_up``: this rank gave its bucket in flight up and leaves without writing what it holds (its done
        buckets whose rows were still only in memory are redone): the server does not wait for it."""
        request: dict[str, Any] = {"op": "next", "held": [list(k) for k in held],
                                   "finished": list(finished) if finished else None, "record": record}
        if leaving:
            request["leaving"] = leaving
        if gave_up:
            request["gave_up"] = True
        reply = self._call(request, change)
        self.last_why = reply.get("why")
        bucket = Bucket(*reply["bucket"]) if reply.get("bucket") else None
        return reply["kind"], bucket, {(k[0], int(k[1])) for k in reply.get("dirty", [])}, change

    def reserve(self, leaving: Sequence[PartKey] = ()) -> tuple[Optional[Bucket], set]:
        """This rank's next bucket, granted while the current one trains (None: not now), and the partitions
        written this pass so far (where to read the reserved bucket's partitions from). ``leaving``: partitions
        being written back in the background (see ``LockState.reserve``)."""
        reply = self._call({"op": "reserve", "leaving": [list(k) for k in leaving]})
        bucket = Bucket(*reply["bucket"]) if reply.get("bucket") else None
        return bucket, {(k[0], int(k[1])) for k in reply.get("dirty", [])}

    def release(self, keys: list, written: bool = True) -> None:
        """Give up the locks of ``keys`` (``written``: and record them as written, as one change)."""
        self._call({"op": "release", "keys": [list(k) for k in keys], "written": written})

    def written(self, keys: Sequence[PartKey], staged: Sequence[Sequence[Any]]) -> None:
        """Have the server record a write group (``keys``, their staged files ``[type, partition, name]``) as one
        change; the locks stay with this rank (``release`` after the files are published)."""
        self._call({"op": "written", "keys": [list(k) for k in keys], "staged": [list(s) for s in staged]})

    def sync(self, change: torch.Tensor) -> torch.Tensor:
        """Outside a bucket (a pass's start and end): push ``change``, receive the sum into it and return it."""
        self._call({"op": "sync"}, change)
        return change

    def status(self) -> dict[str, Any]:
        return self._call({"op": "status"})["state"]




class SharedParameters:
    """The tensors every trainer updates, flattened for the server's push/pull.

    Memory (``CLIENT_VECTORS``): the values as last synced (``synced``, what the next change is measured from) and
    one transfer buffer, which holds the change on its way out and the sum on its way back (the transport sends
    from it and receives into it), so a sync allocates nothing of the vector's size."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.synced = torch.from_numpy(self.flatten())
        self.buffer = torch.empty_like(self.synced)

    def flatten(self) -> np.ndarray:
        """The values now, as a new vector (the server's starting vector)."""
        if not self.tensors:
            return np.zeros(0, dtype=np.float32)
        return torch.cat([t.detach().reshape(-1).float().cpu() for t in self.tensors]).numpy().copy()

    def change(self) -> torch.Tensor:
        """The change since the last sync, in the transfer buffer (valid until the next ``change``/``assign``)."""
        if self.tensors:
            torch.cat([t.detach().reshape(-1).float().cpu() for t in self.tensors], out=self.buffer)
        return self.buffer.sub_(self.synced)

    def no_change(self) -> torch.Tensor:
        """A zero change in the transfer buffer: to take the group's values without giving any."""
        return self.buffer.zero_()

    def assign(self, flat: torch.Tensor) -> None:
        """Take ``flat`` (the group's sum) as the values and as the point the next change is measured from."""
        offset = 0
        with torch.no_grad():
            for tensor in self.tensors:
                n = tensor.numel()
                tensor.copy_(flat[offset:offset + n].view_as(tensor))
                offset += n
        self.synced.copy_(flat)

    def sync(self, client: LockClient) -> None:
        """Outside a bucket: push the change, take the sum."""
        self.assign(client.sync(self.change()))


def shared_state(parameters: list[torch.Tensor], parameter_sums: list[torch.Tensor],
                 tables: Sequence[Any]) -> list[torch.Tensor]:
    """What every trainer shares: the model's parameters (relation operators, global embeddings) with their dense
    Adagrad sums, and each unpartitioned table's rows with its row-wise Adagrad sums.

    Why the sums too: Adagrad's sums add up as the parameters' changes do (each step adds its squared gradient), so
    the server sums them like any change, and every trainer then steps with the group's sums, as Hogwild workers
    of one process share theirs. Kept per trainer instead, each would step as if it alone trained the relations
    (larger steps than one process takes), and a restart would resume them from the committed version, dropping
    the sums of every bucket saved since; in the vector, the persisted progress carries them (the invariant of
    docs/ARCHITECTURE.md, "Shared parameters across a restart")."""
    tensors = list(parameters) + list(parameter_sums)
    for table in tables:
        tensors.append(table.weight)
        if table.optim_sum is not None:
            tensors.append(table.optim_sum)
    return tensors


def shared_values(parameters: int, config: Any, counts: dict[str, list[int]]) -> int:
    """How many values ``shared_state`` holds: the model's ``parameters`` and their dense Adagrad sums, each
    unpartitioned table's rows and their row sums (from the config and the entity counts, before anything is
    loaded: what ``memory_budget`` and a pod's sizing count)."""
    # the sums: (rows,) row-wise, (rows, dim) per coordinate (``entity_optimizer: adagrad``)
    return 2 * parameters + sum(
        counts[t][0] * config.entity_dimension(t) * (2 if per_coordinate(config, t) else 1) + (
            0 if per_coordinate(config, t) else counts[t][0])
        for t, e in config.entities.items() if e.num_partitions == 1)


def sync_memory_bytes(values: int, serves: bool) -> int:
    """The shared parameters' sync memory of one trainer process (what ``memory_budget`` counts for it): its
    ``CLIENT_VECTORS``, and on the server's rank the server's ``SERVER_VECTORS`` too (the vectors of buckets done
    but not yet saved, ``LockServer.pending``, come on top: a few per trainer, while their partitions are held)."""
    return 4 * values * (CLIENT_VECTORS + (SERVER_VECTORS if serves else 0))
