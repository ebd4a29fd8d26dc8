"""Partitions pod to pod (issue 45, first step; config key ``partition_handoff``, off by default).

Without it every partition that changes hands in a torchrun group goes through checkpoint storage twice: the rank
letting it go uploads it (its write group, job/checkpoint/write_groups.py) and the next rank to train it downloads
it. With it, the rank letting a partition go keeps the rows it has just published in memory (``keep``: at most
``limit`` partitions, the oldest dropped first) and says so when it releases the lock (``Release.kept``, with a
digest of the rows). The lock server remembers it as the partition's holder (job/train/distributed/holders.py) and
names it in the grant of the next bucket that needs the partition; that rank then takes the rows from its own memory
(the holder is itself) or from the holder over one TCP connection (``take``), and reads the file only when that
fails (the holder is gone, has dropped the rows, or sends rows that fail the digest). The upload stays where it was:
the storage record is what a restart resumes from, so every invariant of write groups holds unchanged, and what is
read over the network is byte for byte what the file holds (the digest the server hands out covers the rows, the
Adagrad sums, their shapes and the step).

The wire, per partition: the holder listens on an ephemeral port (published under the round's store key
``handoff/<rank>`` as ``host:port``, the host being the address it reaches rank 0's store from); it sends a nonce,
the asking rank answers with one JSON line naming the partition and the digest, MAC'd under the group's secret over
the round, its rank, the partition, the digest and that nonce (job/train/distributed/auth.py: nobody outside the
group reads embeddings off the port, and no request is replayed); the holder answers with a JSON header and the raw
float32 rows, then the sums, only if it keeps exactly those rows. The digest is an HMAC-SHA256 under the same secret,
so rows altered on the way fail it too. A one-process run has no lock server and never gets here.
"""

from __future__ import annotations

import datetime
import json
import logging
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from job.train.distributed import auth
from job.train.distributed.holders import Holder, Kept
from job.train.distributed.liveness import server_socket, store_host
from job.train.distributed.pinned import PinnedRows
from job.train.residency.budget import handoff_kept_partitions
from job.types import PartitionKey

if TYPE_CHECKING:
    from job.checkpoint.write_groups import WriteGroup

logger = logging.getLogger("biggraph")

CONNECT_TIMEOUT_S = 10.0
# per socket operation (each recv returns as bytes arrive, so a live peer never comes close): a frozen holder costs the
# asker this, then it reads the file; well under the drain deadline (25 s), so a round that ends meanwhile is not held
TRANSFER_TIMEOUT_S = 15.0
MAX_LINE = 4096
HELLO = "biggraph-handoff"


@dataclass
class Rows:
    """A partition's rows, Adagrad sums and step; ``received``: bytes that came over the network (0: own memory)."""

    weight: torch.Tensor
    optim_sum: torch.Tensor
    step: int
    received: int = 0


@dataclass
class HandoffStats:
    """What this rank's partitions did through memory instead of storage (summed over the group per pass)."""

    handed_in: int = 0  # partitions received from another rank
    bytes_in: int = 0
    kept_hits: int = 0  # partitions taken back from this rank's own memory
    handed_out: int = 0  # partitions sent to another rank
    bytes_out: int = 0
    misses: int = 0  # a grant named a holder, but the rows came from storage (holder gone, rows dropped or refused)
    # CPU seconds of the hand-offs on every thread of this rank (``time.thread_time``): sending, receiving, the
    # digests of kept and received rows. What pod-to-pod transfers cost a pod's CPUs (bench/scale_bench.py)
    cpu_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def as_record(self) -> dict[str, float]:
        with self._lock:
            return {"handoff_partitions_in": self.handed_in, "handoff_bytes_in": self.bytes_in,
                    "handoff_kept_hits": self.kept_hits, "handoff_partitions_out": self.handed_out,
                    "handoff_bytes_out": self.bytes_out, "handoff_misses": self.misses,
                    "handoff_cpu_s": round(self.cpu_s, 3)}


def _raw(tensor: torch.Tensor) -> memoryview:
    return tensor.detach().contiguous().numpy().data.cast("B")


def rows_digest(round_id: str, key: PartitionKey, weight: torch.Tensor, optim_sum: torch.Tensor, step: int) -> str:
    """The HMAC of a partition's rows as published: what the server hands out and the receiver checks."""
    return auth.mac("handoff-rows", round_id, key[0], str(key[1]), str(step), str(tuple(weight.shape)),
                    str(tuple(optim_sum.shape)), _raw(weight), _raw(optim_sum))


class HandoffLost(RuntimeError):
    """Writes behind: the only copy of a partition's latest rows could not be taken (its holder gone, the rows
    refused); reading the file instead would lose buckets, so the trainer fails and the round ends."""


class PartitionHandoff(PinnedRows):
    """One rank's end: the rows it keeps and serves (``keep``, the listener) and the rows it takes (``hint`` from
    each grant, ``take`` from ``PartitionStore._read``). Thread-safe: the I/O thread keeps and takes, the main
    thread hints, the listener's threads serve."""

    def __init__(self, *, rank: int, round_id: str, store: Any, key: Callable[[str], str], limit: int) -> None:
        self.rank = rank
        self.round_id = round_id
        self.limit = max(0, limit)  # 0: a budget with no room to keep any (this rank still takes from the others)
        self.stats = HandoffStats()
        self._store = store.clone()  # one client of its own, used under ``_lock`` (the store's clients are not shared)
        self._store.set_timeout(datetime.timedelta(seconds=CONNECT_TIMEOUT_S * 6))
        self._key = key
        self._lock = threading.Lock()
        self._kept: OrderedDict[PartitionKey, tuple[Rows, str]] = OrderedDict()
        self._hints: dict[PartitionKey, tuple[int, str]] = {}
        self._addresses: dict[int, tuple[str, int]] = {}
        self._listener: Optional[socket.socket] = None
        self._closed = False
        # writes behind (job/train/distributed/cuts.py): the rows kept since the last cut are the only copy of what
        # was trained since, so they are never dropped (``pinned``) until the cut has stored them (``unpin``), and a
        # hand-off that fails ends the round (``HandoffLost``) instead of reading the older file
        self.strict = False
        self._pinned: set[PartitionKey] = set()
        # the digest of rows kept when a cut stored them (once dropped, an asker reads the next version's file), and
        # when an earlier pass's cut did (``_committed``: the committed version's files; ``new_pass``)
        self._stored, self._committed = dict[PartitionKey, str](), dict[PartitionKey, str]()
        # a cut taken in the background (job/train/distributed/cut_behind.py) unpins only rows unchanged since this
        # rank's turn: each ``keep`` of a key counts (``_kept_count``), and rows this rank took back to train are marked
        self._kept_count: dict[PartitionKey, int] = {}
        self._retaken: set[PartitionKey] = set()
        self._told_stored: set[PartitionKey] = set()  # holders that answered "stored": the file of the next version

    @classmethod
    def of_group(cls, ctx: Any, config: Any, capacity: Optional[int]) -> PartitionHandoff:
        """This rank's end in the group of ``ctx`` (a ``DistributedContext``), listening: it keeps up to two buckets'
        partitions, fewer where its ``memory_budget`` leaves less room in its buffer of ``capacity`` partitions
        (``handoff_kept_partitions``, job/train/residency/budget.py)."""
        limit = handoff_kept_partitions(config, capacity)
        if limit < handoff_kept_partitions(config, None):
            logger.info("rank %d: partition hand-off: memory_budget leaves room to keep %d partition(s) after they "
                        "leave, of %d%s", ctx.rank, limit, handoff_kept_partitions(config, None),
                        " (it still takes partitions from the other pods)" if limit == 0 else "")
        handoff = cls(rank=ctx.rank, round_id=ctx.round_id, store=ctx.store, key=ctx.key, limit=limit)
        handoff.start()
        return handoff

    # serving --------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Listen and publish this rank's address under the round's key (before the pass's first barrier)."""
        self._listener = server_socket()
        port = self._listener.getsockname()[1]
        with self._lock:
            self._store.set(self._key(f"handoff/{self.rank}"), f"{own_host(self._store)}:{port}")
        threading.Thread(target=self._accept, name="biggraph-handoff", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
        self.forget()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="biggraph-handoff-send", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        cpu_started = time.thread_time()
        try:
            self._send(conn)
        finally:
            self.stats.add(cpu_s=time.thread_time() - cpu_started)

    def _send(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(TRANSFER_TIMEOUT_S)
                nonce = secrets.token_hex(16)
                conn.sendall(f"{HELLO} {nonce}\n".encode())
                reader = SocketReader(conn)
                ask = json.loads(reader.line())
                asker, entity_type, part, digest = int(ask["rank"]), str(ask["type"]), int(ask["part"]), str(ask["digest"])
                if not auth.verify(ask.get("mac"), "handoff-ask", self.round_id, str(asker), entity_type, str(part),
                                   digest, nonce):
                    logger.warning("rank %d: a partition hand-off request whose MAC fails was refused (from %s)",
                                   self.rank, conn.getpeername())
                    return
                rows = self._served((entity_type, part), digest)
                if rows is None:
                    why = ("stored" if self._stored.get((entity_type, part)) == digest else
                           "committed" if self._committed.get((entity_type, part)) == digest else "not kept")
                    conn.sendall(json.dumps({"ok": False, "why": why}).encode() + b"\n")
                    return
                header = {"ok": True, "weight": list(rows.weight.shape), "sums": list(rows.optim_sum.shape),
                          "step": rows.step}
                conn.sendall(json.dumps(header).encode() + b"\n")
                conn.sendall(_raw(rows.weight))
                conn.sendall(_raw(rows.optim_sum))
                self.stats.add(handed_out=1, bytes_out=rows.weight.nbytes + rows.optim_sum.nbytes)
            except (OSError, ValueError, KeyError, TypeError) as err:
                logger.warning("rank %d: a partition hand-off was cut (%s); the asker reads the file", self.rank, err)

    def _served(self, key: PartitionKey, digest: str) -> Optional[Rows]:
        with self._lock:
            kept = self._kept.get(key)
        return kept[0] if kept is not None and kept[1] == digest else None

    # keeping --------------------------------------------------------------------------------------------------
    def keep(self, key: PartitionKey, weight: torch.Tensor, optim_sum: torch.Tensor, step: int) -> str:
        """Keep the rows of ``key`` just published (host copies of device tables; a CPU table is kept as it is:
        nothing trains it once it left) and return their digest; this rank's own next read of ``key`` takes them
        unless a grant says otherwise first."""
        cpu_started = time.thread_time()
        rows = Rows(weight.detach().cpu(), optim_sum.detach().cpu(), int(step))
        digest = rows_digest(self.round_id, key, rows.weight, rows.optim_sum, rows.step)
        self.stats.add(cpu_s=time.thread_time() - cpu_started)
        with self._lock:
            self._kept[key] = (rows, digest)
            self._kept.move_to_end(key)
            if self.strict:
                self._pinned.add(key)
            self._kept_count[key] = self._kept_count.get(key, 0) + 1
            self._retaken.discard(key)
            self._stored.pop(key, None)
            self._trim()
            self._hints[key] = (self.rank, digest)
        return digest

    def kept_rows(self, key: PartitionKey) -> Optional[Rows]:
        """The rows this rank keeps of ``key`` (a cut stages them: job/train/distributed/cuts.py), or None."""
        with self._lock:
            kept = self._kept.get(key)
        return kept[0] if kept is not None else None

    def keep_group(self, group: WriteGroup, steps: Mapping[PartitionKey, int]) -> list[Kept]:
        """``keep`` the partitions leaving in ``group`` (just published); what the release that frees them names.
        Nothing with no room to keep any (``limit`` 0) unless writes behind pin them (``strict``): a holder named
        for rows it dropped at once would only send its askers to the file after a round trip."""
        kept: list[Kept] = []
        if self.limit == 0 and not self.strict:
            return kept
        for key in group.leaving:
            table = group.tables[key]
            if table.optim_sum is not None:
                kept.append((key[0], key[1], self.keep(key, table.weight, table.optim_sum, steps.get(key, 0))))
        return kept

    def hint(self, keys: Iterable[PartitionKey], holders: Iterable[Holder]) -> None:
        """A grant: for each of ``keys`` (the granted bucket's partitions this rank will read), where its current rows
        are kept (``holders``), or nowhere: every earlier word about those partitions is stale."""
        named = {(h[0], int(h[1])): (int(h[2]), str(h[3])) for h in holders}
        with self._lock:
            for key in keys:
                if key in named:
                    self._hints[key] = named[key]
                else:
                    self._hints.pop(key, None)

    def new_pass(self, behind: bool = False) -> None:
        """A pass starts: the rows kept stay (the last commit holds them; its holders pass to the next pass's server),
        hints go, counts restart. ``behind``: the commit's cut stored every row kept (unpinned). Rows a cut stored are in
        the committed files now: once dropped, an asker is sent there ("committed", not to the new pass's names)."""
        if behind:
            self.unpin()
        with self._lock:
            self._hints.clear()
            self._committed.update(self._stored)
            self._stored.clear()
            self._told_stored.clear()
            self.stats = HandoffStats()

    def forget(self) -> None:  # a pass starts whose server knows no holder: nothing kept, no hint, counts from zero
        with self._lock:
            self._kept.clear()
            self._pinned.clear()
            self._stored.clear()
            self._committed.clear()
            self._retaken.clear()
            self._told_stored.clear()
            self._hints.clear()
            self.stats = HandoffStats()

    def kept_bytes(self) -> int:
        with self._lock:
            return sum(rows.weight.nbytes + rows.optim_sum.nbytes for rows, _ in self._kept.values())

    # taking ---------------------------------------------------------------------------------------------------
    def take(self, key: PartitionKey, shape: tuple[int, int], per_coordinate: bool, shared: bool) -> Optional[Rows]:
        """The current rows of ``key`` from memory, if the last grant named a holder: this rank's own (taken out: it
        trains them now) or another's over TCP (``shape``: rows x dim; ``per_coordinate``: the sums' form;
        ``shared``: into shared memory, for Hogwild workers). None: read the file."""
        with self._lock:
            hint = self._hints.pop(key, None)
            if hint is None:
                return None
            holder, digest = hint
            if holder == self.rank:
                kept = self._kept.get(key)
                if kept is not None and kept[1] == digest:
                    if not self.strict:  # (written behind they stay until a cut: a read ahead may be dropped unused)
                        del self._kept[key]
                    else:  # trained in place once its bucket starts: no longer the rows a cut may have staged
                        self._retaken.add(key)
                    self.stats.kept_hits += 1
                    return kept[0]
        if holder == self.rank:
            self.stats.add(misses=1)
            if self.strict and digest not in (self._stored.get(key), self._committed.get(key)):
                raise HandoffLost(f"rank {self.rank}: the rows of {key[0]} partition {key[1]} it was to keep are "
                                  "gone; the file is older than they were: the round restarts from the last cut")
            return None
        sums_shape = shape if per_coordinate else (shape[0],)
        cpu_started = time.thread_time()
        failed = False
        try:
            rows = self._fetch(holder, key, digest, shape, sums_shape, shared)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as err:
            logger.warning("rank %d: %s partition %d from rank %d failed (%s)%s", self.rank, key[0], key[1], holder,
                           err, "" if self.strict else "; reading the file")
            rows, failed = None, True
        self.stats.add(cpu_s=time.thread_time() - cpu_started)
        if failed and self.strict:
            self.stats.add(misses=1)
            raise HandoffLost(f"rank {self.rank}: {key[0]} partition {key[1]} did not come from rank {holder}, the "
                              "only holder of its latest rows (writes behind): the round restarts from the last cut")
        if rows is None:
            self.stats.add(misses=1)
        else:
            self.stats.add(handed_in=1, bytes_in=rows.received)
        return rows

    def _fetch(self, holder: int, key: PartitionKey, digest: str, shape: tuple[int, int],
               sums_shape: tuple[int, ...], shared: bool) -> Optional[Rows]:
        host, port = self._address(holder)
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as sock:
            sock.settimeout(TRANSFER_TIMEOUT_S)
            reader = SocketReader(sock)
            hello, _, nonce = reader.line().partition(" ")
            if hello != HELLO or not nonce:
                raise ValueError(f"{host}:{port} is not a hand-off listener")
            ask = {"rank": self.rank, "type": key[0], "part": key[1], "digest": digest,
                   "mac": auth.mac("handoff-ask", self.round_id, str(self.rank), key[0], str(key[1]), digest, nonce)}
            sock.sendall(json.dumps(ask).encode() + b"\n")
            header = json.loads(reader.line())
            if not header.get("ok"):
                why = header.get("why")
                if self.strict and why not in ("stored", "committed"):  # the only copy of rows newer than the file
                    raise ValueError(f"rank {holder} no longer keeps the rows ({why})")
                if self.strict and why == "stored":  # this pass's cut holds them, moved to the next version's names
                    with self._lock:
                        self._told_stored.add(key)
                logger.info("rank %d: rank %d no longer keeps %s partition %d (%s); reading the file", self.rank,
                            holder, key[0], key[1], header.get("why"))
                return None
            if tuple(header["weight"]) != shape or tuple(header["sums"]) != sums_shape:
                raise ValueError(f"rank {holder} sent shapes {header['weight']} and {header['sums']}, expected "
                                 f"{list(shape)} and {list(sums_shape)}")
            weight = torch.empty(shape, dtype=torch.float32)
            optim_sum = torch.empty(sums_shape, dtype=torch.float32)
            if shared:  # before any page is touched (PartitionStore._read's reason)
                weight.share_memory_()
                optim_sum.share_memory_()
            reader.into(_raw_out(weight))
            reader.into(_raw_out(optim_sum))
        rows = Rows(weight, optim_sum, int(header["step"]), received=weight.nbytes + optim_sum.nbytes)
        if rows_digest(self.round_id, key, weight, optim_sum, rows.step) != digest:
            raise ValueError(f"the rows rank {holder} sent fail their digest")
        return rows

    def _address(self, rank: int) -> tuple[str, int]:
        with self._lock:
            address = self._addresses.get(rank)
            if address is None:
                host, _, port = self._store.get(self._key(f"handoff/{rank}")).decode().rpartition(":")
                address = self._addresses[rank] = (host.strip("[]"), int(port))
            return address


def _raw_out(tensor: torch.Tensor) -> memoryview:
    return tensor.numpy().data.cast("B")


class SocketReader:
    """Lines, then raw bytes, off a socket (what follows a line may arrive with it)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def line(self) -> str:
        while b"\n" not in self.buffer:
            if len(self.buffer) > MAX_LINE:
                raise ValueError("a line longer than the protocol allows")
            data = self.sock.recv(MAX_LINE)
            if not data:
                raise ConnectionError("the connection closed mid-line")
            self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode()

    def into(self, out: memoryview) -> None:
        start = min(len(self.buffer), len(out))
        out[:start] = self.buffer[:start]
        self.buffer = self.buffer[start:]
        while start < len(out):
            got = self.sock.recv_into(out[start:])
            if not got:
                raise ConnectionError(f"the connection closed after {start} of {len(out)} bytes")
            start += got


def own_host(store: Any) -> str:
    """The address this rank is reached at: the one it reaches rank 0's store from (a pod's own IP); the host name
    where that cannot be told."""
    target = store_host(store)
    if target:
        try:
            family = socket.getaddrinfo(target, 1, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family[0], socket.SOCK_DGRAM) as probe:
                probe.connect(family[4])  # no packet is sent: this only picks the route
                return str(probe.getsockname()[0])
        except OSError:
            pass
    return socket.gethostname()
