"""A rank's shard of the shared vector (``shared_shards``, issue #45): the relation rows it serves, as PBG's parameter
servers each serve a slice of every shared parameter, so that rank 0 serves the schedule and not the bytes.

Why: with writes behind (``write_behind_buckets``) rank 0's link carried every bucket's sparse change in and the
rows each bucket pulled out; at 32 H100 pods on 10 Gb/s that link bounded a Freebase86m epoch (bench/RESULTS.md,
"The paper model of a Freebase86m epoch with the lock server's costs after the batched serving thread"). Sharded,
relation row r belongs to rank r mod M (M: the round's world size); rank 0 keeps the vector's whole part (every value
that is not a relation row) and its own rows in its lock server as before, and every other rank serves its rows here.

What a shard holds (``ShardSlice``, one ``SharedVector`` over its rows with a layout of its own, one segment of a
row's values): ``served`` (every push added at once), per bucket the pending update (pushed before the ``next`` that
finishes the bucket, so rank 0 never counts a bucket done whose update a shard lacks; bounded like rank 0's:
``SharedVector.pending``), and ``stored`` (the updates of the buckets rank 0's records saved). Persistence stays rank
0's: when its committer writes a record that saves buckets, it asks each shard to ``save`` exactly them (their pending
updates into ``stored``) and to return the stored values of the rows that changed since its last save, and writes
them into its own stored vector before the record: one persisted vector, every restart path as before
(docs/design/distributed.md, "Shared parameters across a restart"). A shard starts each pass from rank 0's served
vector (``load``: a pull of its rows when the pass starts), so a round after a restart starts every shard from the
persisted vector.

Refused (``ShardRefusal``, answered with the error naming the shard's rank and the bucket): rows this rank does not
own, rows not ascending, a payload whose size is not the rows', a push for a bucket already pending, another pass's
message, a save asked by any rank but 0. A message whose MAC fails (job/train/distributed/shard_wire.py) is answered
with that error and its connection closed.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from job.train.distributed import shard_wire
from job.train.distributed.handoff import SocketReader, own_host
from job.train.distributed.liveness import server_socket
from job.train.distributed.shared_rows import RowLayout
from job.train.distributed.shared_vector import SharedVector
from job.types import Bucket

logger = logging.getLogger("biggraph")


class ShardRefusal(ValueError):
    """A shard would not do what was asked (its message names the shard's rank, the asker and the bucket)."""


def owned_rows(rank: int, world_size: int, rows: int) -> np.ndarray:
    """The relation rows rank ``rank`` of ``world_size`` serves (r mod M == rank), ascending."""
    return np.arange(rank, rows, world_size, dtype=np.int64)


def set_rows(layout: RowLayout, vector: np.ndarray, rows: np.ndarray, by_row: np.ndarray) -> None:
    """Write relation ``rows``' values (``by_row``: each row's values of every segment in turn, as a sparse payload
    holds them after its whole part) into ``vector``."""
    values = by_row.reshape(rows.size, layout.row_values)
    column = 0
    for offset, width in layout.segments:
        vector[offset:offset + layout.rows * width].reshape(layout.rows, width)[rows] = values[:, column:column + width]
        column += width


@dataclass
class ShardStats:
    """What a shard served (its pass line; bench/scale_bench.py sums the bytes)."""

    pushes: int = 0
    pulls: int = 0
    saves: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


class ShardSlice:
    """The rows of one rank's shard and what it does with them (the service's logic, without its sockets)."""

    def __init__(self, *, rank: int, world_size: int, layout: RowLayout) -> None:
        if layout.rows == 0:
            raise ValueError("shared_shards: the shared parameters have no relation rows to shard")
        self.rank, self.world_size, self.layout = rank, world_size, layout
        self.width = layout.row_values
        self.owned = owned_rows(rank, world_size, layout.rows)
        size = self.owned.size * self.width
        # the slice's own layout: one segment holding each owned row's values, nothing whole (a push's payload minus
        # the whole part is exactly its payload); an empty slice (more ranks than relations) gets a dense one
        self.local = RowLayout.of(size, int(self.owned.size), [(0, self.width)]) if self.owned.size \
            else RowLayout.dense(0)
        self.pass_tag: Optional[str] = None
        self.vector = SharedVector(np.zeros(size, np.float32), layout=self.local)
        self.lock = threading.Lock()
        self.stats = ShardStats()

    def load(self, pass_tag: str, values: np.ndarray) -> None:
        """A pass starts: serve and store ``values`` (the owned rows' values as rank 0 serves them now)."""
        if values.size != self.vector.size:
            raise ShardRefusal(f"shard of rank {self.rank}: {values.size} values loaded for {self.owned.size} rows "
                               f"of {self.width} values")
        with self.lock:
            self.vector = SharedVector(values, layout=self.local)
            self.pass_tag = pass_tag

    def _local(self, asker: int, what: str, pass_tag: Any, rows: np.ndarray, values: Optional[int]) -> np.ndarray:
        """``rows`` as local indices, checked (see the module docstring); ``values``: the payload's size, if any."""
        where = f"shard of rank {self.rank}: a {what} from rank {asker}"
        if self.pass_tag is None or pass_tag != self.pass_tag:
            raise ShardRefusal(f"{where} for pass {pass_tag!r}, but this shard serves pass {self.pass_tag!r}")
        try:
            rows = self.layout.check(rows)
        except ValueError as err:
            raise ShardRefusal(f"{where}: {err}") from None
        foreign = rows[rows % self.world_size != self.rank]
        if foreign.size:
            raise ShardRefusal(f"{where} names rows it does not serve ({foreign[:3].tolist()}...: rank {self.rank} of "
                               f"{self.world_size} serves rows r with r mod {self.world_size} == {self.rank})")
        if values is not None and values != rows.size * self.width:
            raise ShardRefusal(f"{where}: {values} values for {rows.size} rows (they hold {rows.size * self.width})")
        return rows // self.world_size

    def push(self, asker: int, pass_tag: Any, bucket: Optional[Bucket], rows: np.ndarray, values: np.ndarray) -> None:
        """Serve ``values`` (each row's, for ``rows``) from now on; with ``bucket``, pending under it until a save."""
        what = f"push for bucket {bucket}" if bucket is not None else "push outside a bucket"
        local = self._local(asker, what, pass_tag, rows, values.size)
        with self.lock, self.vector.lock:
            if bucket is not None and bucket in self.vector.pending:
                raise ShardRefusal(f"shard of rank {self.rank}: a {what} from rank {asker}, but that bucket's update "
                                   "is pending here already")
            if local.size:
                self.vector.add(values, local)
            if bucket is not None:
                self.vector.finish(bucket, values, saved=False, rows=local)
            self.stats.pushes += 1

    def pull(self, asker: int, pass_tag: Any, rows: np.ndarray) -> np.ndarray:
        """The served values of ``rows``."""
        local = self._local(asker, "pull", pass_tag, rows, None)
        out = np.empty(local.size * self.width, np.float32)
        with self.lock:
            if local.size:
                self.vector.gather(local, out)
            self.stats.pulls += 1
        return out

    def save(self, asker: int, pass_tag: Any, buckets: Sequence[Bucket]) -> tuple[np.ndarray, np.ndarray]:
        """Move the pending updates of ``buckets`` (a record of rank 0 saves them) into ``stored``; the rows whose stored
        values changed since the last save (global ids, ascending) and those values."""
        if asker != 0:
            raise ShardRefusal(f"shard of rank {self.rank}: a save from rank {asker}; only rank 0's records save")
        if self.pass_tag is None or pass_tag != self.pass_tag:
            raise ShardRefusal(f"shard of rank {self.rank}: a save for pass {pass_tag!r}, but this shard serves pass "
                               f"{self.pass_tag!r}")
        named = set(buckets)
        with self.lock, self.vector.lock:
            vector = self.vector
            vector.save(frozenset(b for b in vector.pending if b not in named))
            if not self.owned.size:
                return np.zeros(0, np.int64), np.zeros(0, np.float32)
            changed = self.local.differing(vector.stored, vector.persisted)
            values = vector.stored.reshape(-1, self.width)[changed].reshape(-1)
            np.copyto(vector.persisted, vector.stored)
            self.stats.saves += 1
        return self.owned[changed], values


class ShardService:
    """One rank's shard on the network: a listener (its address under the round's store key ``shards/<rank>``) and a
    thread per connection, answering ``push``, ``pull`` and ``save`` (job/train/distributed/shard_wire.py)."""

    def __init__(self, shard: ShardSlice, *, round_id: str, store: Any, key: Callable[[str], str]) -> None:
        self.shard = shard
        self.round_id = round_id
        self._store = store.clone()
        self._store.set_timeout(datetime.timedelta(seconds=60))
        self._key = key
        self._listener: Optional[socket.socket] = None
        self._closed = False
        # the most rows plus values one message may carry: a pull or push of every row, or a save of many buckets
        self._limit = shard.layout.rows * (1 + shard.width) + (1 << 22)

    def start(self) -> None:
        """Listen, and publish this rank's address (before the pass's first barrier)."""
        self._listener = server_socket()
        port = self._listener.getsockname()[1]
        self._store.set(self._key(f"shards/{self.shard.rank}"), f"{own_host(self._store)}:{port}")
        threading.Thread(target=self._accept, name="biggraph-shard", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="biggraph-shard-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """One asker's connection: its messages in turn until it closes (or sends one that is not the group's)."""
        nonce = secrets.token_hex(16)
        seq = 0
        with conn:
            try:
                shard_wire.hello(conn, nonce)
                reader = SocketReader(conn)
                while not self._closed:
                    seq += 1
                    try:
                        message = shard_wire.receive(reader, kind="shard-ask", round_id=self.round_id, nonce=nonce,
                                                     seq=seq, limit=self._limit)
                    except shard_wire.ShardWireError as err:
                        logger.warning("rank %d: shard request refused: %s", self.shard.rank, err)
                        shard_wire.send(conn, kind="shard-reply", round_id=self.round_id, nonce=nonce, seq=seq,
                                        header={"ok": False, "error": f"shard of rank {self.shard.rank}: {err}"},
                                        rows=np.zeros(0, np.int64), values=np.zeros(0, np.float32))
                        return
                    self.shard.stats.bytes_in += 8 * message.rows.size + 4 * message.values.size
                    header, rows, values = self._answer(message)
                    self.shard.stats.bytes_out += shard_wire.send(
                        conn, kind="shard-reply", round_id=self.round_id, nonce=nonce, seq=seq, header=header,
                        rows=rows, values=values)
            except (OSError, ValueError) as err:  # the asker went away (its round ended, or it died)
                if not self._closed:
                    logger.debug("rank %d: a shard connection ended (%s)", self.shard.rank, err)

    def _answer(self, message: shard_wire.Message) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
        empty_rows, empty_values = np.zeros(0, np.int64), np.zeros(0, np.float32)
        try:
            ask = shard_wire.Ask.of(message.header)
            if ask.what == "push":
                self.shard.push(ask.rank, ask.pass_tag, ask.bucket, message.rows, message.values)
                return {"ok": True}, empty_rows, empty_values
            if ask.what == "pull":
                return {"ok": True}, empty_rows, self.shard.pull(ask.rank, ask.pass_tag, message.rows)
            pairs = message.rows.reshape(-1, 2)  # "save"
            rows, values = self.shard.save(ask.rank, ask.pass_tag, [Bucket(int(a), int(b)) for a, b in pairs])
            return {"ok": True}, rows, values
        except (ShardRefusal, shard_wire.ShardWireError, KeyError, TypeError, ValueError) as err:
            logger.warning("rank %d: shard request refused: %s", self.shard.rank, err)
            return {"ok": False, "error": str(err)}, empty_rows, empty_values
