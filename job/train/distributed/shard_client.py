"""Asking the shards of the shared vector (``shared_shards``, issue #45; job/train/distributed/shard_service.py): a
trainer's pushes and pulls of the rows other ranks serve, and rank 0's committer's saves.

Each asker keeps one connection per shard (opened at its first message; job/train/distributed/shard_wire.py) and
asks every shard concerned at once: it sends every request, then reads every reply, so that a bucket's pushes to M-1
shards cost about one round trip, not M-1. A shard that does not answer, refuses, or sends a message that is not the
group's fails the whole call with ``ShardError`` naming the shard's rank, the operation and the bucket: a trainer
then fails its bucket as when rank 0 is gone (the round ends through the heartbeat), and rank 0's committer fails
its commit as after a failed write.
"""

from __future__ import annotations

import datetime
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from job.train.distributed import shard_wire
from job.train.distributed.handoff import SocketReader
from job.train.distributed.protocol import LockServerError
from job.types import Bucket


class ShardError(LockServerError):
    """A shard did not do what was asked: gone, frozen past the timeout, refused, or not the group's."""


@dataclass
class _Connection:
    sock: socket.socket
    reader: SocketReader
    nonce: str
    seq: int = 0


@dataclass
class ShardTraffic:
    """The bytes this asker's shard messages moved (their payloads), both ways."""

    sent: int = 0
    received: int = 0


class ShardClient:
    """One asker's connections to the shards of its round (thread-confined: one client per thread that asks)."""

    def __init__(self, *, rank: int, world_size: int, round_id: str, store: Any, key: Callable[[str], str],
                 limit: int, timeout_s: float = shard_wire.TRANSFER_TIMEOUT_S) -> None:
        self.rank, self.world_size, self.round_id = rank, world_size, round_id
        self._store = store.clone()
        self._store.set_timeout(datetime.timedelta(seconds=60))
        self._key = key
        self._limit = limit  # the most rows plus values a reply may carry
        self.timeout_s = timeout_s
        self._connections: dict[int, _Connection] = {}
        self.traffic = ShardTraffic()
        self._lock = threading.Lock()  # (a guard: a client is used by one thread at a time)

    def close(self) -> None:
        for connection in self._connections.values():
            try:
                connection.sock.close()
            except OSError:
                pass
        self._connections.clear()

    def _connect(self, shard: int) -> _Connection:
        connection = self._connections.get(shard)
        if connection is None:
            host, _, port = self._store.get(self._key(f"shards/{shard}")).decode().rpartition(":")
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=shard_wire.CONNECT_TIMEOUT_S)
            sock.settimeout(self.timeout_s)
            reader = SocketReader(sock)
            connection = _Connection(sock, reader, shard_wire.read_hello(reader, f"{host}:{port}"))
            self._connections[shard] = connection
        return connection

    def exchange(self, op: str, pass_tag: str, requests: Mapping[int, tuple[np.ndarray, np.ndarray]],
                 bucket: Optional[Bucket] = None) -> dict[int, shard_wire.Message]:
        """Send ``op`` with each shard's (rows, values) of ``requests``, then take every reply (see the module
        docstring); ``ShardError`` if any shard fails it."""
        header: dict[str, Any] = {"op": op, "rank": self.rank, "pass": pass_tag,
                                  "bucket": [int(bucket[0]), int(bucket[1])] if bucket is not None else None}
        what = f"{op}" + (f" for bucket {bucket}" if bucket is not None else "")
        with self._lock:
            asked = []
            for shard, (rows, values) in requests.items():
                try:
                    connection = self._connect(shard)
                    connection.seq += 1
                    self.traffic.sent += shard_wire.send(
                        connection.sock, kind="shard-ask", round_id=self.round_id, nonce=connection.nonce,
                        seq=connection.seq, header=header, rows=rows, values=values)
                except (OSError, ValueError, shard_wire.ShardWireError) as err:
                    self._drop(shard)
                    raise ShardError(f"rank {self.rank}: the shard of rank {shard} did not take a {what} ({err}): "
                                     "it is gone or frozen") from err
                asked.append(shard)
            replies = {}
            for shard in asked:
                connection = self._connections[shard]
                try:
                    reply = shard_wire.receive(connection.reader, kind="shard-reply", round_id=self.round_id,
                                               nonce=connection.nonce, seq=connection.seq, limit=self._limit)
                except (OSError, ValueError, shard_wire.ShardWireError) as err:
                    self._drop(shard)
                    raise ShardError(f"rank {self.rank}: the shard of rank {shard} did not answer a {what} ({err}): it "
                                     "is gone or frozen") from err
                self.traffic.received += 8 * reply.rows.size + 4 * reply.values.size
                if not reply.header.get("ok"):
                    raise ShardError(f"rank {self.rank}: {what} refused: {reply.header.get('error')}")
                replies[shard] = reply
            return replies

    def _drop(self, shard: int) -> None:
        connection = self._connections.pop(shard, None)
        if connection is not None:
            try:
                connection.sock.close()
            except OSError:
                pass

    def save(self, pass_tag: str, buckets: Sequence[Bucket]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Rank 0's committer: every shard saves ``buckets``; each one's changed stored rows and their values."""
        pairs = np.asarray([[b[0], b[1]] for b in buckets], np.int64).reshape(-1)
        none = np.zeros(0, np.float32)
        replies = self.exchange("save", pass_tag, {shard: (pairs, none) for shard in range(1, self.world_size)})
        return [(reply.rows, reply.values) for reply in replies.values()]
