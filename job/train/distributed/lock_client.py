"""A trainer's side of the lock protocol (job/train/distributed/protocol.py defines every message; the server is in
job/train/distributed/lock_server.py): ``LockClient``, one typed method per request.

Kept apart from the server so that each stays one concern: the client never waits on anything but its own
request, the server never waits on any one client (job/train/distributed/transfers.py).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch

from job.train.distributed import protocol
from job.train.distributed.cut_wire import Cut, CutStep
from job.train.distributed.holders import Holder, Kept
from job.train.distributed.protocol import (
    DEFAULT_PREFIX,
    SERVER_RANK,
    Done,
    Envelope,
    Granted,
    LockServerError,
    Next,
    Payload,
    Pull,
    R,
    Release,
    Request,
    Reserve,
    Reserved,
    State,
    Status,
    Sync,
    Written,
    request_queue,
    response_queue,
)
from job.train.distributed.transport import TensorTransport, TransferError
from job.train.distributed.written_delta import WrittenView
from job.types import Bucket, PartitionKey

logger = logging.getLogger("biggraph")

__all__ = ["LockClient", "LockServerError"]


class LockClient:
    """One rank's connection to the lock server. ``channel``: a second client of the same rank (used from another
    thread: the background writer releasing what it stored) gets its replies on its own queue. ``transport``: this
    process's end of the shared-parameter transport (job/train/distributed/transport.py), for the client that carries
    the shared parameters' changes (``finish_and_next`` with a change, ``sync``); None for one that never does."""

    def __init__(self, store: Any, rank: int, timeout_s: float = 600.0, channel: str = "",
                 prefix: str = DEFAULT_PREFIX, transport: Optional[TensorTransport] = None) -> None:
        self.requests = request_queue(prefix)
        self.responses = response_queue(prefix, rank, channel)
        self.store = store.clone()
        self.timeout_s = timeout_s
        self.store.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.rank = rank
        self.channel = channel
        self.scope = prefix  # what the messages' MACs are bound to: the round's queues (protocol.py)
        # this client's requests, numbered (the server refuses a number it has seen: a replay); from the clock, so
        # that a later client of the same rank and channel in the round numbers past an earlier one's
        self.seq = time.time_ns()
        self._reply_scope = ""
        self.transport = transport
        self.last_why: Optional[str] = None  # why the round ends, from the last ``ending`` reply
        # where the last granted bucket's partitions are kept in memory (``next`` and ``reserve``; partition_handoff)
        self.last_holders: tuple[Holder, ...] = ()
        self._written = WrittenView()  # the partitions written this pass, each sent once (written_delta.py)

    def _ask(self, request: Request, expected: type[R], change: Optional[torch.Tensor] = None,
             back: bool = True) -> R:
        raw = self._call(request, change, back)
        return protocol.decode_reply(raw, expected, request.op, scope=self._reply_scope)

    def _call(self, request: Union[Request, dict[str, Any]], change: Optional[torch.Tensor] = None,
              back: bool = True) -> bytes:
        """Ask; with ``change`` (a contiguous float32 CPU vector), send it along and (``back``) receive the sum into
        it; the raw reply. A dict ``request`` is sent as it is (with this client's rank and channel): a message that
        does not follow the protocol, as the protocol tests send."""
        payload = None
        transfer = None
        op = request.get("op") if isinstance(request, dict) else request.op
        if change is not None:
            if self.transport is None:
                raise ValueError(f"lock client of rank {self.rank}{self.channel}: no transport for shared parameters")
            payload = Payload(change.numel(), self.transport.next_tag())
            # posted before the request names it: the server receives it as soon as it reads the request
            transfer = self.transport.send(change, SERVER_RANK, payload.tag)
        self.seq += 1
        envelope = Envelope(self.rank, self.channel, payload, self.seq)
        if isinstance(request, dict):
            message = dict(request, rank=self.rank, channel=self.channel, seq=self.seq)
            if payload is not None:
                message.update(values=payload.values, tag=payload.tag)
            raw_request = protocol.seal(message, self.scope)
        else:
            raw_request = protocol.encode_request(envelope, request, scope=self.scope)
        self._reply_scope = protocol.reply_scope(self.scope, self.rank, self.channel, self.seq)
        asked = time.monotonic()
        try:
            self.store.queue_push(self.requests, raw_request)
            raw = self._authentic_reply()
        except Exception as err:
            waited = time.monotonic() - asked
            if waited < self.timeout_s - 1.0:  # not the timeout: the store itself went away (its host is gone)
                raise protocol.RoundGone(
                    f"lock server (rank 0): lost the store while asking {op!r} after {waited:.1f} s "
                    f"({err}); the group this rank belonged to is gone (rank 0 died, or this rank was stopped and "
                    "the others re-formed the group without it)") from err
            raise protocol.RoundGone(
                f"lock server (rank 0): no answer to {op!r} in {self.timeout_s:.0f} s ({err}); rank 0 is "
                "gone or the group is being re-formed") from err
        reply = protocol.unseal(raw, self._reply_scope)
        if not reply.get("ok", False):
            raise protocol.refusal(str(op), reply.get("error"))
        if change is not None and transfer is not None and payload is not None:
            try:
                transfer.wait()  # taken before the reply was sent: the buffer is free for the sum
                assert self.transport is not None
                if back:
                    self.transport.recv(change, SERVER_RANK, payload.tag)
            except TransferError as err:
                raise LockServerError(f"lock server (rank 0): the shared parameters of {op!r} did not "
                                      f"travel: {err}") from err
        return raw

    def _authentic_reply(self) -> bytes:
        """The server's reply to the request just sent: a reply that fails its MAC (forged by a client of the store,
        or a replay of an earlier one) is logged and skipped (the store's timeout bounds the wait)."""
        while True:
            raw = self.store.queue_pop(self.responses, block=True)
            try:
                protocol.unseal(raw, self._reply_scope)
                return raw
            except protocol.ProtocolError as err:
                logger.warning("lock client of rank %d%s: a reply that is not the server's answer was ignored (%s)",
                               self.rank, self.channel, err)

    def next_bucket(self, held: set, finished: Optional[Bucket],
                    record: Optional[dict]) -> tuple[str, Optional[Bucket], set]:
        kind, bucket, dirty, _ = self.finish_and_next(held, finished, record)
        return kind, bucket, dirty

    def finish_and_next(self, held: set, finished: Optional[Bucket], record: Optional[dict],
                        change: Optional[torch.Tensor] = None,
                        leaving: Optional[str] = None, gave_up: bool = False,
                        rows: Optional[Sequence[int]] = None) -> tuple[str, Optional[Bucket], set,
                                                                       Optional[torch.Tensor]]:
        """Finish ``finished`` (its stats ``record``, and ``change``: the shared-parameter change it made, a
        contiguous float32 CPU vector) and ask for the next bucket: (kind, bucket, partitions written this pass,
        the shared parameters' sum if ``change``: received into ``change`` itself). ``leaving``: why this rank
        leaves (its SIGTERM): the round ends, kind is then ``ending`` (give back what it holds, then exit).
        ``gave_up``: this rank gave its bucket in flight up and leaves without writing what it holds (its done
        buckets whose rows were still only in memory are redone): the server does not wait for it. ``rows``: the
        change is sparse, the whole values then these relation rows' (ascending; job/train/distributed/
        shared_rows.py), and no sum comes back (None is returned in its place: ``pull`` the rows a bucket reads)."""
        request = Next(held=frozenset((k[0], int(k[1])) for k in held), finished=finished, record=record,
                       leaving=leaving, gave_up=gave_up, rows=tuple(int(r) for r in rows) if rows is not None else None,
                       written_known=self._written.known)
        reply = self._ask(request, Granted, change, back=rows is None)
        self.last_why = reply.why
        self.last_holders = reply.holders
        return reply.kind, reply.bucket, self._dirty(reply), change if rows is None else None

    def pull(self, rows: Sequence[int], into: torch.Tensor) -> torch.Tensor:
        """The current values of the whole part and of relation ``rows`` (ascending), received into ``into`` (a
        contiguous float32 CPU vector of the sparse payload's size, ``RowLayout.count``) and returned."""
        if self.transport is None:
            raise ValueError(f"lock client of rank {self.rank}{self.channel}: no transport for shared parameters")
        tag = self.transport.next_tag()
        self._ask(Pull(rows=tuple(int(r) for r in rows), tag=tag), Done)
        try:
            self.transport.recv(into, SERVER_RANK, tag)
        except TransferError as err:
            raise LockServerError(f"lock server (rank 0): the pulled rows did not travel: {err}") from err
        return into

    def reserve(self, leaving: Sequence[PartitionKey] = ()) -> tuple[Optional[Bucket], set]:
        """This rank's next bucket, granted while the current one trains (None: not now), and the partitions
        written this pass so far (where to read the reserved bucket's partitions from). ``leaving``: partitions
        being written back in the background (see ``LockState.reserve``)."""
        reply = self._ask(Reserve(leaving=tuple((k[0], int(k[1])) for k in leaving),
                                  written_known=self._written.known), Reserved)
        self.last_holders = reply.holders
        return reply.bucket, self._dirty(reply)

    def _dirty(self, reply: Union[Granted, Reserved]) -> set:
        """The partitions written this pass: the reply's delta merged into what this client holds (a server that
        sends the whole list, as older ones do: that list)."""
        if reply.written is None:
            return set(reply.dirty)
        try:
            return set(self._written.merge(reply.written))
        except protocol.ProtocolError as err:
            raise LockServerError(f"lock server (rank 0): an unreadable answer ({err})") from err

    def release(self, keys: Sequence[PartitionKey], written: bool = True,
                kept: Sequence[Kept] = ()) -> None:
        """Give up the locks of ``keys`` (``written``: and record them as written, as one change; ``kept``: those whose
        published rows this rank keeps in memory for their next holder, with their digests)."""
        self._ask(Release(keys=tuple((k[0], int(k[1])) for k in keys), written=written,
                          kept=tuple((k[0], int(k[1]), str(k[2])) for k in kept)), Done)

    def written(self, keys: Sequence[PartitionKey], staged: Sequence[Sequence[Any]]) -> None:
        """Have the server record a write group (``keys``, their staged files ``[type, partition, name]``) as one
        change; the locks stay with this rank (``release`` after the files are published). A staged entry may
        carry the file's ``size, crc32`` after its name (``WriteGroup.staged``)."""
        self._ask(Written(keys=tuple((k[0], int(k[1])) for k in keys),
                          staged=tuple((s[0], int(s[1]), *s[2:]) for s in staged)), Done)

    def cut(self, staged: Optional[Sequence[Sequence[Any]]] = None, moved: bool = False) -> CutStep:
        """This rank's turn in a cut (``write_behind_buckets``, job/train/distributed/cuts.py): ask the next step, or
        report ``staged`` files (``[type, partition, name, size, crc32]``) or that they are ``moved``."""
        return self._ask(Cut(staged=tuple((s[0], int(s[1]), *s[2:]) for s in staged) if staged is not None else None,
                             moved=moved), CutStep)

    def sync(self, change: torch.Tensor) -> torch.Tensor:
        """Outside a bucket (a pass's start and end): push ``change``, receive the sum into it and return it."""
        self._ask(Sync(), Done, change)
        return change

    def status(self) -> dict[str, Any]:
        return self._ask(Status(), State).state
