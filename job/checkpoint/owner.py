"""One writer at a time: the owner record of a checkpoint directory.

Two jobs that write one ``checkpoint_path`` (a resubmitted job beside the one still running, a local run beside a
cluster job) destroy each other's work: each one's start-up deletes what it takes for the other's uncommitted
files, and their commits interleave. So a writer first takes ``owner.json`` in the directory (run id, host, process,
since when, heartbeat), keeps its heartbeat fresh from a thread, and checks it is still the owner right before
every commit marker: the check *is* a conditional rewrite of the record (S3 ``If-Match`` on its ETag, a compare
under ``flock`` locally; :mod:`storage_adapters.conditional`), so a writer that lost the directory cannot commit.

Who is "the same writer": a torchrun group is one writer (every restart of it, a replaced or added pod included,
carries the same run id, the group's ``run_identity`` of job/train/distributed/group.py: ``BIGGRAPH_RUN_ID`` if set, which the
chart sets to the Job's uid, else torchrun's ``--rdzv-id``, with a digest of the training config); a process outside
torchrun is its own run. A record left by a process that is provably gone (same
machine, same PID namespace, PID no longer alive) is taken over at once; one whose heartbeat stopped elsewhere is
taken over only when asked (``--take-over``), because a stopped heartbeat may also be a paused or partitioned
writer; a fresh one is never taken over.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Optional

import storage_adapters as storage
from job.errors import CheckpointError
from storage_adapters.staging import process_exists

logger = logging.getLogger("biggraph")

OWNER_FILE = "owner.json"
HEARTBEAT_SECONDS = 15.0  # BIGGRAPH_OWNER_HEARTBEAT_S changes it (the stale age follows: 8 beats)
# a heartbeat older than this is stale: several missed beats, long enough for an object store's slow moments
STALE_AFTER_SECONDS = 120.0


class OwnerBusyError(CheckpointError):
    """Another run owns the checkpoint directory (its heartbeat is fresh, or stale without ``--take-over``)."""


class OwnershipLost(CheckpointError):
    """This run's owner record was taken over by another run: it must stop without committing."""


def machine_id() -> str:
    """This kernel and PID namespace: two records with the same one can compare PIDs."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot}/{namespace}"


_PROCESS_RUN = f"local:{uuid.uuid4().hex[:12]}"


def default_run_id() -> str:
    """The run this process belongs to (see the module docstring); outside torchrun, one per process."""
    explicit = os.environ.get("BIGGRAPH_RUN_ID")
    if explicit:
        return explicit
    rdzv = os.environ.get("TORCHELASTIC_RUN_ID")
    if rdzv and os.environ.get("TORCHELASTIC_RESTART_COUNT") is not None:
        return f"torchrun:{rdzv}"
    return _PROCESS_RUN


@dataclass(frozen=True)
class OwnerRecord:
    run_id: str
    host: str
    pid: int
    machine: str
    started: float
    heartbeat: float

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), indent=1) + "\n").encode()

    @classmethod
    def parse(cls, url: str, data: bytes) -> OwnerRecord:
        try:
            raw = json.loads(data.decode("utf-8"))
            record = cls(run_id=str(raw["run_id"]), host=str(raw["host"]), pid=int(raw["pid"]),
                         machine=str(raw.get("machine", "")), started=float(raw["started"]),
                         heartbeat=float(raw["heartbeat"]))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{url}: not an owner record ({type(err).__name__}: {str(err)[:80]}); if no job "
                                  "writes this checkpoint, delete the file") from None
        return record

    def describe(self) -> str:
        return f"run {self.run_id} on host {self.host} (pid {self.pid}) since {_when(self.started)}"


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


class Ownership:
    """This run's claim on one checkpoint directory: :meth:`acquire`, :meth:`check` before each marker,
    :meth:`release` at the end. The heartbeat thread runs between :meth:`acquire` and :meth:`release`."""

    def __init__(self, checkpoint_url: str, run_id: Optional[str] = None, take_over: bool = False,
                 heartbeat_seconds: float = HEARTBEAT_SECONDS, stale_after: float = STALE_AFTER_SECONDS,
                 clock: Callable[[], float] = time.time) -> None:
        self.url = storage.join(checkpoint_url, OWNER_FILE)
        self.run_id = run_id or default_run_id()
        self.take_over = take_over
        self.heartbeat_seconds = heartbeat_seconds
        self.stale_after = stale_after
        self.clock = clock
        self._tag: Optional[str] = None
        self._started = clock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._failure: Optional[BaseException] = None
        self._last_beat = time.monotonic()  # of the last record this run wrote (monotonic: runs on while frozen)

    def _record(self) -> OwnerRecord:
        return OwnerRecord(self.run_id, socket.gethostname(), os.getpid(), machine_id(), self._started, self.clock())

    def read(self) -> Optional[tuple[OwnerRecord, str]]:
        try:
            data, tag = storage.read_tagged(self.url)
        except FileNotFoundError:
            return None
        return OwnerRecord.parse(self.url, data), tag

    def acquire(self) -> None:
        """Take the directory, or raise :class:`OwnerBusyError` naming the owner and how to take over."""
        for _ in range(5):  # a lost race re-reads the record and decides again
            found = self.read()
            expect = None
            if found is not None:
                current, expect = found
                self._judge(current)
            try:
                with self._lock:
                    self._tag = storage.write_if(self.url, self._record().to_bytes(), expect)
                    self._last_beat = time.monotonic()
            except storage.ConditionFailed:
                continue
            self._start_heartbeat()
            return
        raise OwnerBusyError(f"{self.url}: the owner record keeps changing under this run: another job is taking "
                             "this checkpoint directory; stop one of them")

    def _judge(self, current: OwnerRecord) -> None:
        """Return when ``current`` may be replaced by this run; raise otherwise."""
        if current.run_id == self.run_id:
            return  # this run again (a restarted torchrun group, a replaced pod)
        if current.machine and current.machine == machine_id() and not process_exists(current.pid):
            logger.warning("%s: taking over the checkpoint from %s: that process is gone", self.url,
                           current.describe())
            return
        age = self.clock() - current.heartbeat
        if age < self.stale_after:
            raise OwnerBusyError(
                f"{self.url}: checkpoint directory in use by {current.describe()}, heartbeat {age:.0f} s ago: two "
                "jobs must not write one checkpoint_path; stop that job, or give this one another checkpoint_path "
                f"(if that job is gone, run again with --take-over once its heartbeat is over {self.stale_after:.0f} s "
                "old)")
        if not self.take_over:
            raise OwnerBusyError(
                f"{self.url}: checkpoint directory owned by {current.describe()}, whose heartbeat stopped "
                f"{age:.0f} s ago (at {_when(current.heartbeat)}): if no process of that run is alive, run again with "
                "--take-over (biggraph train --take-over, or BIGGRAPH_TAKE_OVER=1)")
        logger.warning("%s: taking over the checkpoint from %s (heartbeat stopped %.0f s ago; --take-over)",
                       self.url, current.describe(), age)

    def check(self) -> None:
        """Raise :class:`OwnershipLost` unless this run still owns the directory; renews the heartbeat (the
        conditional rewrite is the check). Call right before writing a commit marker."""
        if self._failure is not None:
            raise self._failure
        self._beat()

    def guard(self) -> None:
        """Before writing any file: raise :class:`OwnershipLost` if the heartbeat found the directory taken, and
        check again first when the last heartbeat is older than two beats (a process frozen for a while, then
        resumed, must not write one file over its successor's before its heartbeat thread wakes up)."""
        if self._failure is not None:
            raise self._failure
        if self.heartbeat_seconds > 0 and time.monotonic() - self._last_beat > 2 * self.heartbeat_seconds:
            self._beat()

    def _beat(self) -> None:
        with self._lock:
            if self._tag is None:
                raise CheckpointError(f"{self.url}: not acquired")
            try:
                self._tag = storage.write_if(self.url, self._record().to_bytes(), self._tag)
                self._last_beat = time.monotonic()
            except storage.ConditionFailed:
                found = self.read()
                other = found[0].describe() if found is not None else "someone who then removed the record"
                self._failure = OwnershipLost(
                    f"{self.url}: this run ({self.run_id}) no longer owns the checkpoint directory: taken over by "
                    f"{other}; stopping without writing or committing anything more")
                raise self._failure from None

    def _start_heartbeat(self) -> None:
        if self._thread is not None or self.heartbeat_seconds <= 0:
            return
        self._stop.clear()
        carried = storage.carry(self._heartbeat_loop)  # the storage settings of the job, in the thread
        self._thread = threading.Thread(target=carried, name="biggraph-owner-heartbeat", daemon=True)
        self._thread.start()

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            try:
                self._beat()
            except OwnershipLost as err:
                logger.error("%s", err)
                return
            except Exception as err:  # a storage hiccup: the next beat (or the commit's check) tries again
                logger.warning("%s: heartbeat not written (%s)", self.url, err)

    def release(self) -> None:
        """Stop the heartbeat and remove the record if it is still this run's (a later job need not wait)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        with self._lock:
            if self._tag is None:
                return
            try:
                found = self.read()
                if found is not None and found[1] == self._tag:
                    storage.remove(self.url)
            except Exception as err:  # leaving the record only makes the next run check the PID or wait
                logger.warning("%s: owner record not removed (%s)", self.url, err)
            self._tag = None


class OwnerWatch:
    """A torchrun rank other than 0's owner check: the group is one writer and rank 0 holds its record, but every
    rank writes into the directory (its partitions, the staged moves of its write groups), so each checks before it
    writes that the record still names its run.

    Why not the record's own conditional rewrite, as rank 0: only one process can hold its tag. Reading it is the
    same judgement of who owns the directory: a run that took it over (``--take-over`` of a stalled run) wrote its
    own run id there, and from then on this rank writes nothing (:class:`OwnershipLost`), exactly as rank 0 of the
    same run. A record that is missing is not a loss: rank 0 removes it when it gives the directory up in order
    (``release``, at a round's end too, while a peer may still finish its bucket), and a stale rank of the same run
    is fenced by its round (``DistributedContext.fence``). Read at most once per ``heartbeat_seconds`` (the owner
    heartbeat's interval) from ``guard``, always from ``check``; no thread: a rank that was frozen reads it again
    before its first write, because its last read is old.
    """

    def __init__(self, checkpoint_url: str, run_id: str, heartbeat_seconds: float = HEARTBEAT_SECONDS) -> None:
        self.url = storage.join(checkpoint_url, OWNER_FILE)
        self.run_id = run_id
        self.heartbeat_seconds = heartbeat_seconds
        self._lock = threading.Lock()
        self._read_at: Optional[float] = None  # monotonic time of the last read that found this run the owner
        self._failure: Optional[OwnershipLost] = None

    def guard(self) -> None:
        """Before writing any file: raise :class:`OwnershipLost` once the record names another run (read again when
        the last read is older than ``heartbeat_seconds``)."""
        if self._failure is not None:
            raise self._failure
        read_at = self._read_at
        if read_at is None or time.monotonic() - read_at >= self.heartbeat_seconds:
            self.check()

    def check(self) -> None:
        """Read the record now; raise :class:`OwnershipLost` if it names another run."""
        with self._lock:
            if self._failure is not None:
                raise self._failure
            try:
                data = storage.read_bytes(self.url)
            except FileNotFoundError:  # given up in order by rank 0 (see the class docstring)
                self._read_at = time.monotonic()
                return
            record = OwnerRecord.parse(self.url, data)
            if record.run_id != self.run_id:
                self._failure = OwnershipLost(
                    f"{self.url}: this run ({self.run_id}) no longer owns the checkpoint directory: taken over by "
                    f"{record.describe()}; this rank writes nothing more")
                raise self._failure
            self._read_at = time.monotonic()


def watch_owner(checkpoint_url: str, run_id: str) -> OwnerWatch:
    """A rank other than 0's :class:`OwnerWatch` of ``checkpoint_url``, read once now (rank 0 has claimed it), at
    the owner heartbeat's interval (``BIGGRAPH_OWNER_HEARTBEAT_S``, as ``claim``)."""
    beat = float(os.environ.get("BIGGRAPH_OWNER_HEARTBEAT_S", HEARTBEAT_SECONDS))
    watch = OwnerWatch(checkpoint_url.rstrip("/"), run_id, heartbeat_seconds=beat)
    watch.check()
    return watch


def describe_owner(checkpoint_url: str) -> Optional[dict[str, Any]]:
    """The owner record of a checkpoint directory, for status displays (None when nobody owns it)."""
    url = storage.join(checkpoint_url, OWNER_FILE)
    try:
        data = storage.read_bytes(url)
    except FileNotFoundError:
        return None
    return asdict(OwnerRecord.parse(url, data))


_claims: dict[str, tuple[Ownership, int]] = {}
_claims_lock = threading.Lock()


def claim(checkpoint_url: str, take_over: bool = False, run_id: Optional[str] = None) -> Ownership:
    """This process's ownership of ``checkpoint_url``, acquired on the first claim and shared by nested writers (a
    grow and the training it runs); each claim is ended by :func:`unclaim`."""
    key = checkpoint_url.rstrip("/")
    with _claims_lock:
        held = _claims.get(key)
        if held is not None:
            _claims[key] = (held[0], held[1] + 1)
            return held[0]
    beat = float(os.environ.get("BIGGRAPH_OWNER_HEARTBEAT_S", HEARTBEAT_SECONDS))
    ownership = Ownership(key, run_id=run_id, take_over=take_over or os.environ.get("BIGGRAPH_TAKE_OVER") == "1",
                          heartbeat_seconds=beat, stale_after=beat * STALE_AFTER_SECONDS / HEARTBEAT_SECONDS)
    ownership.acquire()
    with _claims_lock:
        _claims[key] = (ownership, 1)
    return ownership


def unclaim(ownership: Ownership) -> None:
    key = ownership.url.rsplit("/", 1)[0]
    with _claims_lock:
        held = _claims.get(key)
        if held is None or held[0] is not ownership:
            ownership.release()
            return
        if held[1] > 1:
            _claims[key] = (ownership, held[1] - 1)
            return
        del _claims[key]
    ownership.release()
