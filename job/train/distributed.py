"""Distributed training under torchrun: the bucket lock server on rank 0, and shared-parameter sync.

(Joining the group, the heartbeat and the store barriers are in job/train/group.py; the scheduler the
training loop sees is ``LockServerScheduler`` in job/train/schedule.py.)

Everything travels through the rendezvous TCPStore that ``init_process_group`` already
connected every rank to (``queue_push``/``queue_pop`` give a request queue without any
socket code of ours), so only members of the job's rendezvous can talk to the server.

- ``LockState`` (job/train/lock_state.py) is the pure scheduling logic: which bucket a trainer gets,
  which partitions are locked, which are written into the next version, and the early reservation
  of a trainer's next bucket with ``prefetch_partitions``.
- ``LockServer`` runs it in a thread on rank 0, answers every request (errors included: ``LockServerError`` on
  the client) and persists each change into checkpoint storage before answering (job/train/progress.py: a
  snapshot per pass plus one small record per change, bound to its run); after a lost pod torchrun restarts
  the group, the new rank 0 replays them and the pass goes on, redoing only the buckets in flight.
- Shared parameters (relation operators, global embeddings, unpartitioned entity tables)
  are kept by the server as one flat vector; trainers push the change they made since
  their last sync and pull the sum at every bucket boundary (staleness: one bucket).
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

from job.train.buckets import Bucket
from job.train.lock_state import LockState, PartKey

logger = logging.getLogger("biggraph")

# the server on rank 0 ----------------------------------------------------------------------------


# the store queues live under a prefix of the group's round (``DistributedContext.key("lock")``), so that a request
# of an earlier round, or a server of one, never meets this round's
DEFAULT_PREFIX = "biggraph/lock"


def _request_queue(prefix: str) -> str:
    return f"{prefix}/requests"


def _response_queue(prefix: str, rank: int, channel: str = "") -> str:
    return f"{prefix}/response/{rank}{channel}"


class LockServerError(RuntimeError):
    """The lock server answered a request with an error (its message names the server's error), or did not answer."""


class LockServer:
    """Serves ``LockState`` and the shared-parameter vector to every rank over the store's queues.

    The protocol: a request is ``{"op", "rank", "channel", ...}`` (+ a binary payload for ``sync``); every request
    whose rank and channel can be read gets exactly one reply, ``{"ok": true, ...}`` or ``{"ok": false, "error":
    "<the server's error>"}`` (an unknown op, a malformed field, a ``sync`` of the wrong shape, a failed progress
    write), so a client raises at once (``LockServerError``) instead of waiting out its timeout. ``next`` and
    ``release`` persist their changes (``progress.append``, job/train/progress.py) before the reply.

    Shared parameters: a ``next`` carries the trainer's change since its last sync (the payload) for the bucket
    it finishes; the server adds it to the vector it serves (``shared``) and answers with the sum. What it
    persists (``stored``) holds the change of a bucket only once the bucket is done *and* its partitions are
    written: until then a restart redoes the bucket (``LockState.forget_rank_locks``), so its change waits in
    ``pending`` and enters ``stored`` with the record that saves the bucket. A restart thus resumes with every
    saved bucket's shared update once and without any bucket it redoes. After a
    failed progress write the server answers every request with that error: the group restarts from what is
    stored, never from a state ahead of it."""

    def __init__(self, store: Any, state: LockState, progress: Any, shared: np.ndarray, seed: int,
                 prefix: str = DEFAULT_PREFIX) -> None:
        """``progress``: where the changes go (a ``ProgressLog``, or anything with ``append(records)``)."""
        self.requests = _request_queue(prefix)
        self.prefix = prefix
        self.store = store.clone()
        # a long blocking pop; stop() wakes it with a message of its own
        self.store.set_timeout(datetime.timedelta(hours=24))
        self._stopper = store.clone()
        self.state = state
        self.progress = progress
        self.shared = shared.astype(np.float32, copy=True)
        self.stored = self.shared.copy()  # the updates of the buckets done and saved: what a restart resumes
        self.pending: dict[Bucket, np.ndarray] = {}  # the update of each bucket done but not yet saved
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.failed: Optional[str] = None  # a progress write failed: every request is refused with this
        self.server_id = secrets.token_hex(4)  # the servers of a round's passes share its queue: stop only this one
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="biggraph-lock-server", daemon=True)
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
                request, payload = _unpack(raw)
                if request.get("op") == "stop":
                    if request.get("server") == self.server_id:
                        return
                    continue  # an earlier server's, which ended between two requests and never read it
                reply_to = _response_queue(self.prefix, int(request["rank"]), str(request.get("channel", "")))
            except Exception as err:  # noqa: BLE001 - nobody to answer: log it and serve on
                logger.error("lock server: unreadable request, no rank to answer (%s: %s)", type(err).__name__, err)
                continue
            try:
                reply, body = self._handle(request, payload)
            except Exception as err:  # noqa: BLE001 - answered: the client raises with this message
                logger.warning("lock server: %s request of rank %s refused: %s: %s", request.get("op"),
                               request.get("rank"), type(err).__name__, err)
                reply, body = {"ok": False, "error": f"{type(err).__name__}: {err}"}, b""
            try:
                self.store.queue_push(reply_to, _pack(reply, body))
            except Exception:
                if not self._stop.is_set():
                    logger.warning("lock server: could not answer rank %s", request.get("rank"))
                return

    def _handle(self, request: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        rank = int(request["rank"])
        op = request.get("op")
        reply: dict[str, Any] = {"ok": True}
        body = b""
        with self.lock:
            if self.failed is not None:
                raise LockServerError(f"the progress could not be saved earlier ({self.failed}); the group must "
                                      "restart from what is stored")
            if op == "next":
                finished = Bucket(*request["finished"]) if request.get("finished") else None
                held = {(k[0], int(k[1])) for k in request.get("held", [])}
                delta = self._delta(payload) if payload else None
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
                if delta is not None:
                    body = self.shared.tobytes()
            elif op == "reserve":
                # not persisted: a reservation is never started work, so a restart has nothing of it to redo
                leaving = frozenset((k[0], int(k[1])) for k in request.get("leaving", []))
                bucket = self.state.reserve(rank, self.rng, leaving)
                reply.update(bucket=list(bucket) if bucket else None, dirty=[list(k) for k in self.state.dirty])
            elif op == "release":
                self.state.release(rank, request["keys"], written=request.get("written", True))
                unsaved = self._unsaved()
                saved = [b for b in self.pending if b not in unsaved]
                for b in saved:
                    self.stored += self.pending.pop(b)
                self._persist(with_shared=bool(saved))
            elif op == "sync":
                # outside a bucket (the pass's start and end): a change here is not tied to any bucket's progress
                self.shared += self._delta(payload)
                body = self.shared.tobytes()
            elif op == "status":
                reply["state"] = self.state.to_json()
            else:
                raise ValueError(f"unknown request {op!r}")
        return reply, body

    def _unsaved(self) -> set[Bucket]:
        return {b for pending in self.state.unsaved.values() for b in pending}

    def _delta(self, payload: bytes) -> np.ndarray:
        if len(payload) % 4:
            raise ValueError(f"a shared-parameter change of {len(payload)} bytes is not float32 values")
        delta = np.frombuffer(payload, dtype=np.float32)
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

    def take_records(self) -> list[dict]:
        with self.lock:
            records, self.state.records = self.state.records, []
            return records

    def stop(self) -> None:
        self._stop.set()
        self._stopper.queue_push(self.requests, _pack({"op": "stop", "server": self.server_id}))
        self.thread.join(timeout=5)


def _pack(header: dict[str, Any], body: bytes = b"") -> bytes:
    encoded = json.dumps(header).encode()
    return len(encoded).to_bytes(4, "little") + encoded + body


def _unpack(raw: bytes) -> tuple[dict[str, Any], bytes]:
    header_len = int.from_bytes(raw[:4], "little")
    header = json.loads(raw[4:4 + header_len])
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, raw[4 + header_len:]


class LockClient:
    """One rank's connection to the lock server. ``channel``: a second client of the same rank (used from another
    thread: the background writer releasing what it stored) gets its replies on its own queue."""

    def __init__(self, store: Any, rank: int, timeout_s: float = 600.0, channel: str = "",
                 prefix: str = DEFAULT_PREFIX) -> None:
        self.requests = _request_queue(prefix)
        self.responses = _response_queue(prefix, rank, channel)
        self.store = store.clone()
        self.timeout_s = timeout_s
        self.store.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.rank = rank
        self.channel = channel

    def _call(self, request: dict[str, Any], payload: bytes = b"") -> tuple[dict[str, Any], bytes]:
        request = dict(request, rank=self.rank, channel=self.channel)
        asked = time.monotonic()
        try:
            self.store.queue_push(self.requests, _pack(request, payload))
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
        reply, body = _unpack(raw)
        if not reply.get("ok", False):
            raise LockServerError(f"lock server (rank 0) refused {request['op']!r}: {reply.get('error')}")
        return reply, body

    def next_bucket(self, held: set, finished: Optional[Bucket], record: Optional[dict]) -> tuple[str, Optional[Bucket], set]:
        kind, bucket, dirty, _ = self.finish_and_next(held, finished, record)
        return kind, bucket, dirty

    def finish_and_next(self, held: set, finished: Optional[Bucket], record: Optional[dict],
                        delta: Optional[np.ndarray] = None) -> tuple[str, Optional[Bucket], set, Optional[np.ndarray]]:
        """Finish ``finished`` (its stats ``record``, and ``delta``: the shared-parameter change it made) and ask for
        the next bucket: (kind, bucket, partitions written this pass, the shared parameters' sum if ``delta``)."""
        payload = delta.astype(np.float32).tobytes() if delta is not None else b""
        reply, body = self._call({"op": "next", "held": [list(k) for k in held],
                                  "finished": list(finished) if finished else None, "record": record}, payload)
        bucket = Bucket(*reply["bucket"]) if reply.get("bucket") else None
        shared = np.frombuffer(body, dtype=np.float32).copy() if delta is not None else None
        return reply["kind"], bucket, {(k[0], int(k[1])) for k in reply.get("dirty", [])}, shared

    def reserve(self, leaving: Sequence[PartKey] = ()) -> tuple[Optional[Bucket], set]:
        """This rank's next bucket, granted while the current one trains (None: not now), and the partitions
        written this pass so far (where to read the reserved bucket's partitions from). ``leaving``: partitions
        being written back in the background (see ``LockState.reserve``)."""
        reply, _ = self._call({"op": "reserve", "leaving": [list(k) for k in leaving]})
        bucket = Bucket(*reply["bucket"]) if reply.get("bucket") else None
        return bucket, {(k[0], int(k[1])) for k in reply.get("dirty", [])}

    def release(self, keys: list, written: bool = True) -> None:
        self._call({"op": "release", "keys": [list(k) for k in keys], "written": written})

    def sync(self, delta: np.ndarray) -> np.ndarray:
        _, body = self._call({"op": "sync"}, delta.astype(np.float32).tobytes())
        return np.frombuffer(body, dtype=np.float32).copy()

    def status(self) -> dict[str, Any]:
        reply, _ = self._call({"op": "status"})
        return reply["state"]


# shared parameters ------------------------------------------------------------------------------


class SharedParameters:
    """The tensors every trainer updates (a flat view for the server's push/pull)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.synced = self.flatten()

    def flatten(self) -> np.ndarray:
        if not self.tensors:
            return np.zeros(0, dtype=np.float32)
        return torch.cat([t.detach().reshape(-1).float().cpu() for t in self.tensors]).numpy().copy()

    def assign(self, flat: np.ndarray) -> None:
        offset = 0
        with torch.no_grad():
            for tensor in self.tensors:
                n = tensor.numel()
                tensor.copy_(torch.from_numpy(flat[offset:offset + n]).view_as(tensor))
                offset += n
        self.synced = flat.copy()

    def sync(self, client: LockClient) -> None:
        current = self.flatten()
        self.assign(client.sync(current - self.synced))
