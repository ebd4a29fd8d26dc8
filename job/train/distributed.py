"""Distributed training under torchrun: the bucket lock server on rank 0, and shared-parameter sync.

(Joining the group, the heartbeat and the store barriers are in job/train/group.py; the scheduler the
training loop sees is ``LockServerScheduler`` in job/train/schedule.py.)

The requests and replies travel through the rendezvous TCPStore that ``init_process_group`` already
connected every rank to (``queue_push``/``queue_pop`` give a request queue without any
socket code of ours), so only members of the job's rendezvous can talk to the server. The shared
parameters' payload does not: it goes point-to-point between the trainer and rank 0 over a gloo group
of its own (``TensorTransport``, job/train/transport.py), tagged with its request.

- ``LockState`` (job/train/lock_state.py) is the pure scheduling logic: which bucket a trainer gets,
  which partitions are locked, which are written into the next version, and the early reservation
  of a trainer's next bucket with ``prefetch_partitions``.
- ``LockServer`` runs it in a thread on rank 0, answers every request (errors included: ``LockServerError`` on
  the client) and persists each change into checkpoint storage before answering (job/train/progress.py: a
  snapshot per pass plus one small record per change, bound to its run); after a lost pod torchrun restarts
  the group, the new rank 0 replays them and the pass goes on, redoing only the buckets in flight.
- Shared parameters (relation operators, global embeddings, unpartitioned entity tables)
  are kept by the server as one flat vector; trainers push the change they made since
  their last sync and pull the sum at every bucket boundary (staleness: one bucket). A request
  carrying a change says so in its header (``values``: how many, ``tag``: its transfer); the
  change itself and the sum answered travel over the transport, never through the store.
"""

from __future__ import annotations

import datetime
import json
import logging
import random
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch

import storage_adapters as storage
from job.train.buckets import Bucket
from job.train.buffer import per_coordinate
from job.train.lock_state import LockState, PartKey
from job.train.transport import TensorTransport, TransferError

logger = logging.getLogger("biggraph")

# the server on rank 0 ----------------------------------------------------------------------------


# the store queues live under a prefix of the group's round (``DistributedContext.key("lock")``), so that a request
# of an earlier round, or a server of one, never meets this round's
DEFAULT_PREFIX = "biggraph/lock"
SERVER_RANK = 0  # the rank whose process runs the lock server
# the shared vector's copies, for memory_budget (``sync_memory_bytes``): a trainer's synced values and transfer
# buffer (``SharedParameters``); the server's served and stored vectors and its receive buffer (``LockServer``)
CLIENT_VECTORS = 2
SERVER_VECTORS = 3


def _request_queue(prefix: str) -> str:
    return f"{prefix}/requests"


def _response_queue(prefix: str, rank: int, channel: str = "") -> str:
    return f"{prefix}/response/{rank}{channel}"


class LockServerError(RuntimeError):
    """The lock server answered a request with an error (its message names the server's error), or did not answer."""


class LockServer:
    """Serves ``LockState`` and the shared-parameter vector to every rank: requests over the store's queues, the
    shared parameters over ``transport`` (job/train/transport.py).

    The protocol: a request is ``{"op", "rank", "channel", ...}``; one that carries a shared-parameter change
    (``next`` finishing a bucket, ``sync``) names it with ``{"values": <how many>, "tag": <its transfer>}``, and the
    client has posted the payload under that tag before pushing the request. The server receives an announced
    payload before anything else, whatever it then decides (so that no sender is left waiting: a client whose
    payload nobody takes would time out and lose its pair with rank 0), then answers: every request whose rank and
    channel can be read gets exactly one reply, ``{"ok": true, ...}`` or ``{"ok": false, "error": "<the server's
    error>"}`` (an unknown op, a malformed field, a change of the wrong shape, a failed progress write, a payload
    that did not arrive), so a client raises at once (``LockServerError``) instead of waiting out its timeout. An
    ``ok`` reply to a request that carried a change is followed by the sum, sent under the request's tag. ``next``,
    ``written`` (a write group's one record) and ``release`` persist their changes (``progress.append``,
    job/train/progress.py) before the reply.

    Shared parameters: a ``next`` carries the trainer's change since its last sync for the bucket it finishes; the
    server adds it to the vector it serves (``shared``) and answers with the sum. What it persists (``stored``)
    holds the change of a bucket only once the bucket is done *and* its partitions are written: until then a
    restart redoes the bucket (``LockState.forget_rank_locks``), so its change waits in ``pending`` and enters
    ``stored`` with the record that saves the bucket. A restart thus resumes with every saved bucket's shared
    update once and without any bucket it redoes. After a failed progress write the server answers every request
    with that error: the group restarts from what is stored, never from a state ahead of it.

    Memory: ``shared``, ``stored`` and one receive buffer (``SERVER_VECTORS``; the sum is sent from ``shared``
    itself: the server thread, the only one changing it, waits for each send), plus one vector per bucket done but
    not yet saved (``pending``)."""

    def __init__(self, store: Any, state: LockState, progress: Any, shared: np.ndarray, seed: int,
                 transport: TensorTransport, prefix: str = DEFAULT_PREFIX) -> None:
        """``progress``: where the changes go (a ``ProgressLog``, or anything with ``append(records)``);
        ``transport``: this process's end of the shared-parameter transport (the server's rank's)."""
        self.requests = _request_queue(prefix)
        self.prefix = prefix
        self.store = store.clone()
        # a long blocking pop; stop() wakes it with a message of its own
        self.store.set_timeout(datetime.timedelta(hours=24))
        self._stopper = store.clone()
        self.transport = transport
        self.state = state
        self.progress = progress
        self.shared = shared.astype(np.float32, copy=True)
        self.stored = self.shared.copy()  # the updates of the buckets done and saved: what a restart resumes
        self._incoming = torch.empty(self.shared.size, dtype=torch.float32)  # every change is received here
        self.pending: dict[Bucket, np.ndarray] = {}  # the update of each bucket done but not yet saved
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.failed: Optional[str] = None  # a progress write failed: every request is refused with this
        self.server_id = secrets.token_hex(4)  # the servers of a round's passes share its queue: stop only this one
        self._stop = threading.Event()
        # with the caller's storage settings: the progress goes to checkpoint storage (an endpoint of its own, say)
        self.thread = threading.Thread(target=storage.carry(self._serve), name="biggraph-lock-server", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                raw = self.store.queue_pop(self.requests, block=True)
            except Exception:  # the store went away (job ending): nothing left to serve
                if not self._stop.is_set():
                    logger.warning("lock server: request queue closed")
                return
            try:
                request = _unpack(raw)
                if request.get("op") == "stop":
                    if request.get("server") == self.server_id:
                        return
                    continue  # an earlier server's, which ended between two requests and never read it
                rank = int(request["rank"])
                reply_to = _response_queue(self.prefix, rank, str(request.get("channel", "")))
            except Exception as err:  # noqa: BLE001 - nobody to answer: log it and serve on
                logger.error("lock server: unreadable request, no rank to answer (%s: %s)", type(err).__name__, err)
                continue
            answer: Optional[torch.Tensor] = None
            try:
                change = self._receive(request, rank)
                reply, answer = self._handle(request, change)
            except Exception as err:  # noqa: BLE001 - answered: the client raises with this message
                logger.warning("lock server: %s request of rank %s refused: %s: %s", request.get("op"),
                               request.get("rank"), type(err).__name__, err)
                reply, answer = {"ok": False, "error": f"{type(err).__name__}: {err}"}, None
            try:
                self.store.queue_push(reply_to, _pack(reply))
            except Exception:
                if not self._stop.is_set():
                    logger.warning("lock server: could not answer rank %s", request.get("rank"))
                return
            if answer is not None:
                try:
                    self.transport.send(answer, rank, int(request["tag"])).wait()
                except TransferError as err:  # the rank died after asking: its round is over, serve the others
                    logger.warning("lock server: the shared parameters did not reach rank %d: %s", rank, err)

    def _receive(self, request: dict[str, Any], rank: int) -> Optional[np.ndarray]:
        """The change a request announces (``values``, ``tag``), received before it is judged: into the receive
        buffer when it has the shared vector's size, else into one of its own (taken only to be refused)."""
        if request.get("values") is None:
            return None
        values, tag = int(request["values"]), int(request["tag"])
        into = self._incoming if values == self.shared.size else torch.empty(max(values, 0), dtype=torch.float32)
        self.transport.recv(into, rank, tag)
        return into.numpy()

    def _handle(self, request: dict[str, Any], change: Optional[np.ndarray]) -> tuple[dict[str, Any],
                                                                                  Optional[torch.Tensor]]:
        """The reply to ``request``, and the vector to send after it (the sum, for a request with a change)."""
        rank = int(request["rank"])
        op = request.get("op")
        reply: dict[str, Any] = {"ok": True}
        with self.lock:
            if self.failed is not None:
                raise LockServerError(f"the progress could not be saved earlier ({self.failed}); the group must "
                                      "restart from what is stored")
            if change is not None and op not in ("next", "sync"):
                raise ValueError(f"a {op!r} request carries no shared-parameter change")
            if op == "next":
                finished = Bucket(*request["finished"]) if request.get("finished") else None
                held = {(k[0], int(k[1])) for k in request.get("held", [])}
                delta = self._delta(change) if change is not None else None
                if delta is not None:
                    self.shared += delta
                if request.get("record"):
                    self.state.add_record(request["record"])
                was_done = finished is not None and finished in self.state.done
                kind, bucket = self.state.next_bucket(rank, held, finished, self.rng)
                stored = False
                if delta is not None and finished is not None and not was_done and finished in self.state.done:
                    if finished in self._unsaved():
                        self.pending[finished] = delta.copy()
                    else:  # no partition of its own to write: saved already
                        self.stored += delta
                        stored = True
                self._persist(with_shared=stored)
                reply.update(kind=kind, bucket=list(bucket) if bucket else None,
                             dirty=[list(k) for k in self.state.dirty])
            elif op == "reserve":
                # not persisted: a reservation is never started work, so a restart has nothing of it to redo
                leaving = frozenset((k[0], int(k[1])) for k in request.get("leaving", []))
                bucket = self.state.reserve(rank, self.rng, leaving)
                reply.update(bucket=list(bucket) if bucket else None, dirty=[list(k) for k in self.state.dirty])
            elif op == "written":
                # a write group (job/train/write_groups.py): one record makes all its files current and saves its
                # buckets, shared updates included; the locks stay until the rank has published the files
                self.state.record_written(rank, request["keys"], request.get("staged", []))
                self._persist(with_shared=self._save_pending())
            elif op == "release":
                self.state.release(rank, request["keys"], written=request.get("written", True))
                self._persist(with_shared=self._save_pending())
            elif op == "sync":
                # outside a bucket (the pass's start and end): a change here is not tied to any bucket's progress
                if change is None:
                    raise ValueError("a sync without a shared-parameter change")
                self.shared += self._delta(change)
            elif op == "status":
                reply["state"] = self.state.to_json()
            else:
                raise ValueError(f"unknown request {op!r}")
        # sent from the vector itself: only this thread changes it, and it waits for the send
        return reply, (torch.from_numpy(self.shared) if change is not None else None)

    def _save_pending(self) -> bool:
        """Move the shared updates of the buckets saved now (done, and no partition unwritten) into ``stored``;
        whether there were any."""
        unsaved = self._unsaved()
        saved = [b for b in self.pending if b not in unsaved]
        for b in saved:
            self.stored += self.pending.pop(b)
        return bool(saved)

    def _unsaved(self) -> set[Bucket]:
        return {b for pending in self.state.unsaved.values() for b in pending}

    def _delta(self, delta: np.ndarray) -> np.ndarray:
        if delta.shape != self.shared.shape:
            raise ValueError(f"a shared-parameter change of {delta.size} values, but the shared parameters have "
                             f"{self.shared.size} (trainers built with different models?)")
        return delta

    def _persist(self, with_shared: bool = False) -> None:
        records = self.state.drain_journal()
        try:
            if with_shared:
                self.progress.append(records, shared=self.stored)
            else:
                self.progress.append(records)
        except Exception as err:
            self.failed = f"{type(err).__name__}: {err}"
            raise

    def values(self) -> torch.Tensor:
        """The shared parameters as served now (a view: read it once the pass's syncs are over)."""
        return torch.from_numpy(self.shared)

    def take_records(self) -> list[dict]:
        with self.lock:
            records, self.state.records = self.state.records, []
            return records

    def stop(self) -> None:
        self._stop.set()
        self._stopper.queue_push(self.requests, _pack({"op": "stop", "server": self.server_id}))
        self.thread.join(timeout=5)


def _pack(header: dict[str, Any]) -> bytes:
    return json.dumps(header).encode()


def _unpack(raw: bytes) -> dict[str, Any]:
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("the message is not a JSON object")
    return header


class LockClient:
    """One rank's connection to the lock server. ``channel``: a second client of the same rank (used from another
    thread: the background writer releasing what it stored) gets its replies on its own queue. ``transport``: this
    process's end of the shared-parameter transport (job/train/transport.py), for the client that carries the
    shared parameters' changes (``finish_and_next`` with a change, ``sync``); None for one that never does."""

    def __init__(self, store: Any, rank: int, timeout_s: float = 600.0, channel: str = "",
                 prefix: str = DEFAULT_PREFIX, transport: Optional[TensorTransport] = None) -> None:
        self.requests = _request_queue(prefix)
        self.responses = _response_queue(prefix, rank, channel)
        self.store = store.clone()
        self.timeout_s = timeout_s
        self.store.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.rank = rank
        self.channel = channel
        self.transport = transport

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
            self.store.queue_push(self.requests, _pack(request))
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
        reply = _unpack(raw)
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
                        change: Optional[torch.Tensor] = None) -> tuple[str, Optional[Bucket], set,
                                                                        Optional[torch.Tensor]]:
        """Finish ``finished`` (its stats ``record``, and ``change``: the shared-parameter change it made, a
        contiguous float32 CPU vector) and ask for the next bucket: (kind, bucket, partitions written this pass,
        the shared parameters' sum if ``change``: received into ``change`` itself)."""
        reply = self._call({"op": "next", "held": [list(k) for k in held],
                            "finished": list(finished) if finished else None, "record": record}, change)
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


# shared parameters ------------------------------------------------------------------------------


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
