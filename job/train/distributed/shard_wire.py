"""The wire of the shared-vector shards (``shared_shards``, issue #45; job/train/distributed/shard_service.py serves
it, shard_client.py asks): one TCP connection per asker and shard, a header line then raw rows and values.

Why a wire of its own rather than the lock server's queue and tensor transport: the point of the shards is that
their bytes do not pass through rank 0, whose store carries the lock protocol and whose link carried every
bucket's sparse change in and pulled rows out (bench/RESULTS.md). The handoff listener's shape
(job/train/distributed/handoff.py) fits: the shard sends a nonce when the connection opens; each message is one line,
``<mac> <header JSON>``, then ``rows`` int64 values and ``values`` float32 values, raw. The MAC (HMAC-SHA256 under
the group's secret, job/train/distributed/auth.py) covers the round, the connection's nonce, the message's number on
it (``seq``: 1, 2, ... in each direction's turn: a request and its reply share one), the header and every byte of
the payload: nobody outside the group reads or writes rows, alters them on the way, or replays a message, even on
another connection (another nonce). Sizes are bounded (``limit``) before anything past the header is read, so a
header cannot make the receiver allocate more than a slice's worth.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any

import numpy as np

from job.train.distributed import auth
from job.train.distributed.handoff import SocketReader

HELLO = "biggraph-shard"
CONNECT_TIMEOUT_S = 10.0
# per socket operation (each recv returns as bytes arrive): a frozen shard costs its asker this, then the asker fails
# its bucket (the round ends through the heartbeat, as for a frozen rank 0); well under the drain deadline (25 s), as
# the hand-off's (handoff.py)
TRANSFER_TIMEOUT_S = 15.0


class ShardWireError(RuntimeError):
    """A message that is not the group's (its MAC fails), out of order, too large, or cut off."""


@dataclass
class Message:
    """One message: its ``header`` (``op``, ``rank``, ``pass``, ``bucket``, ``ok``/``error``), its ``rows`` (int64: relation
    ids, or a save's buckets as pairs) and ``values`` (float32: each row's values in ``RowLayout`` payload order)."""

    header: dict[str, Any]
    rows: np.ndarray
    values: np.ndarray


def _bytes(array: np.ndarray, dtype: type) -> memoryview:
    return np.ascontiguousarray(array, dtype=dtype).data.cast("B")


def send(sock: socket.socket, *, kind: str, round_id: str, nonce: str, seq: int, header: dict[str, Any],
         rows: np.ndarray, values: np.ndarray) -> int:
    """Send one message (``kind``: "shard-ask" or "shard-reply", so that no reply passes for a request); returns its
    payload bytes."""
    raw_rows, raw_values = _bytes(rows, np.int64), _bytes(values, np.float32)
    text = json.dumps(dict(header, seq=seq, rows=int(raw_rows.nbytes // 8), values=int(raw_values.nbytes // 4)),
                      sort_keys=True, separators=(",", ":"))
    mac = auth.mac(kind, round_id, nonce, str(seq), text, raw_rows, raw_values)
    sock.sendall(f"{mac} {text}\n".encode())
    if raw_rows.nbytes:
        sock.sendall(raw_rows)
    if raw_values.nbytes:
        sock.sendall(raw_values)
    return int(raw_rows.nbytes + raw_values.nbytes)


def receive(reader: SocketReader, *, kind: str, round_id: str, nonce: str, seq: int, limit: int) -> Message:
    """The next message (``limit``: the most rows plus values it may carry); ``ShardWireError`` if its MAC fails, its
    number is not ``seq`` or it is larger than ``limit``."""
    mac, _, text = reader.line().partition(" ")
    try:
        header = json.loads(text)
        count_rows, count_values = int(header["rows"]), int(header["values"])
        number = int(header["seq"])
    except (ValueError, KeyError, TypeError) as err:
        raise ShardWireError(f"an unreadable header ({err})") from None
    if count_rows < 0 or count_values < 0 or count_rows + count_values > limit:
        raise ShardWireError(f"a message of {count_rows} rows and {count_values} values (at most {limit} in all)")
    rows = np.empty(count_rows, np.int64)
    values = np.empty(count_values, np.float32)
    reader.into(rows.data.cast("B"))
    reader.into(values.data.cast("B"))
    if not auth.verify(mac, kind, round_id, nonce, str(number), text, rows.data.cast("B"), values.data.cast("B")):
        raise ShardWireError(f"a message claiming rank {header.get('rank')} whose MAC fails (not of this group's "
                             "round, or altered on the way)")
    if number != seq:
        raise ShardWireError(f"message number {number} where {seq} was due (a replay?)")
    return Message(header, rows, values)


def hello(sock: socket.socket, nonce: str) -> None:
    sock.sendall(f"{HELLO} {nonce}\n".encode())


def read_hello(reader: SocketReader, where: str) -> str:
    """The nonce a shard opens its connection with."""
    word, _, nonce = reader.line().partition(" ")
    if word != HELLO or not nonce:
        raise ShardWireError(f"{where} is not a shard listener")
    return nonce
