"""The lock server's progress on storage: what a restarted group resumes an interrupted pass from.

Two parts, beside the checkpoint (any storage URL; an object store has no append, so a record is an object):

- ``distributed_progress.json``, the *snapshot*: ``{"format": 3, "run": <run id>, "version": <version the pass
  commits>, "log": <log id>, "segments": n, "records_from": k, "shared": <vector>}``, a few hundred bytes;
- ``distributed_progress.log/<log id>-base.json``: the state the log starts from (``LockState.to_json()``, and
  the staged files recorded before it), written when the lock server starts a pass (a fresh one, or one resumed
  after a restart: then it is the compaction of what was resumed);
- ``distributed_progress.log/<log id>-<seq>.json``, the *records*: one object per write of the server's committer
  (the changes of the requests that arrived together, ``LockState.drain_journal``), written before any of them is
  answered, each a few hundred bytes per request whatever the pass's size;
- ``distributed_progress.log/<log id>-seg-<n>.json``, the *segments*: every ``COMPACT_EVERY`` records the log
  writes them again as one segment and drops them (``compact``), so that a restart reads at most that many records
  plus one object per segment, read together. A segment holds only the records since the previous one, never the
  state so far: a pass writes O(buckets) bytes of progress, not O(buckets²) as when every compaction rewrote the
  whole state (its stats lines and staged names) again;
- ``distributed_progress.log/<log id>-base.f32`` and ``<log id>-<seq>.f32``: the shared parameters (the server's
  flat float32 vector: relation operators, global embeddings, unpartitioned tables) as the base had them and
  as a record left them. A trainer sends its change with the ``next`` that finishes its bucket, and the server
  adds it, marks the bucket done and writes the vector, then the record naming it (``{"e": "shared"}``), before
  it answers: a restart resumes with every done bucket's shared update and none of a bucket not done (no update
  lost, none counted twice). Once per write that saved a bucket (the requests of one write share it), and
  usually only its blocks that changed since the last write (``<log id>-<seq>.b32``, ``{"e": "shared_blocks"}``:
  their values, not differences, so replaying them is exact), which for a bucket's few relations is KBs where the
  whole vector is 11.86 MB for Freebase86m; the whole vector when most of it changed, and at each compaction (then
  the earlier vector files are dropped), so a restart reads one vector and at most ``COMPACT_EVERY`` block files.

Reading (``read_progress``) takes the snapshot's base, its segments and the records from ``records_from`` on, in
order (only those of its log id, only while their numbers follow each other). The commit drops both
(``remove_progress``: the snapshot first, so a kill in between leaves only records no snapshot names).

**Bound to its run.** A snapshot is taken up only by the run that wrote it (``run``: torchrun's rendezvous id or
``BIGGRAPH_RUN_ID``, and the training config's digest, as ``job.train.distributed.group.run_identity`` makes it), for the pass
after the committed version (``version``). A restart of the same torchrun job (a lost pod, a replaced pod, a scale
change, all the agents restarted with the same arguments) resumes; a different job, a changed config, a
single-process run or a stale file of an earlier pass refuses it, and rank 0 removes it together with the
uncommitted files of that pass (job/train/resume.py), so that it can never be resumed against files it does not
describe.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

import storage_adapters as storage

logger = logging.getLogger("biggraph")

# records after which the lock server writes a new snapshot mid-pass (``ProgressLog.append`` says when): a restarted
# group's rank 0 reads the snapshot and the records after it, one object each, before it serves; a pass at P=16 with
# 4 trainers leaves ~600 records, which on S3 (moto, loaded) took 10 s of a recovery (bench/RESULTS.md, "Chaos
# re-measured"). Every 64 records it is one snapshot (the state, a few tens of KB, and the shared vector) more.
COMPACT_EVERY = 64
# the records that name staged files (a restart moves them: job/checkpoint/write_groups.py): a rank's write group,
# and a cut of the whole group (``write_behind_buckets``, job/train/distributed/cuts.py)
STAGING_RECORDS = ("written", "cut")
PROGRESS_FILE = "distributed_progress.json"
PROGRESS_LOG = "distributed_progress.log"
FORMAT = 3


@dataclass
class VectorBlocks:
    """Blocks of ``block`` values of the shared vector, with their values as they are now (not differences: applying
    them is exact), and the values after its last whole block (``tail``)."""

    index: np.ndarray  # int64 block numbers
    values: np.ndarray  # float32, (len(index), block)
    tail: np.ndarray  # float32
    block: int

    def encode(self) -> bytes:
        header = np.array([self.index.size, self.block, self.tail.size], dtype=np.int64)
        return b"".join([header.tobytes(), self.index.astype(np.int64).tobytes(),
                         np.ascontiguousarray(self.values, np.float32).tobytes(), self.tail.astype(np.float32).tobytes()])

    @classmethod
    def decode(cls, raw: bytes, name: str) -> VectorBlocks:
        """``ValueError`` naming ``name`` when its sizes do not add up (a torn or foreign file)."""
        if len(raw) < 24:
            raise ValueError(f"{name}: {len(raw)} bytes, shorter than its header")
        count, block, tail = (int(v) for v in np.frombuffer(raw[:24], dtype=np.int64))
        if min(count, block, tail) < 0 or len(raw) != 24 + 8 * count + 4 * count * block + 4 * tail:
            raise ValueError(f"{name}: {len(raw)} bytes do not hold {count} blocks of {block} values and {tail} more")
        index = np.frombuffer(raw, dtype=np.int64, count=count, offset=24)
        values = np.frombuffer(raw, dtype=np.float32, count=count * block, offset=24 + 8 * count)
        rest = np.frombuffer(raw, dtype=np.float32, count=tail, offset=24 + 8 * count + 4 * count * block)
        return cls(index, values.reshape(count, block), rest, block)

    def apply(self, vector: np.ndarray) -> None:
        """Set these blocks of ``vector`` (``ValueError`` if they do not fit it)."""
        whole = vector.size - self.tail.size
        if whole < 0 or (self.block and whole % self.block) or (self.index.size and (
                self.index.max() >= whole // max(self.block, 1) or self.index.min() < 0)):
            raise ValueError(f"blocks of {self.block} values and {self.tail.size} more do not fit a vector of "
                             f"{vector.size}")
        if self.index.size:
            vector[:whole].reshape(-1, self.block)[self.index] = self.values
        vector[whole:] = self.tail


def progress_url(checkpoint_path: str) -> str:
    return storage.join(checkpoint_path, PROGRESS_FILE)


def log_url(checkpoint_path: str) -> str:
    return storage.join(checkpoint_path, PROGRESS_LOG)


@dataclass
class Progress:
    """A pass's persisted progress: the snapshot's state with its records replayed onto it by the reader."""

    run: str
    version: int
    state: dict[str, Any]  # LockState.to_json() of the snapshot
    records: list[dict[str, Any]]  # the changes after it, in order (LockState.apply)
    shared: Optional[np.ndarray] = None  # the shared parameters as the last record left them (None: not stored)
    staged_before: list[list[Any]] = field(default_factory=list)  # recorded before the snapshot (see ``staged``)

    def staged(self) -> list[list[Any]]:
        """Every staged file a persisted ``written`` or ``cut`` record named this pass, ``[type, partition, name]`` in record
        order: what a restart publishes if it is still there (``roll_forward``). A base written mid-pass keeps those of
        the records before it (a file recorded just before it may not be moved yet)."""
        return [*self.staged_before,
                *(list(entry) for record in self.records if record.get("e") in STAGING_RECORDS
                  for entry in record.get("staged", []))]


class StaleProgressWriter(RuntimeError):
    """This writer's snapshot is no longer the directory's: another writer (a newer round's rank 0) started one."""


class ProgressLog:
    """The lock server's writer: ``start`` a pass (the snapshot), ``append`` each request's changes.

    Fenced twice (issue 44): ``fence`` (the round's check, ``DistributedContext.fence``: raises once this rank's round
    is over or this process was stalled past the peer timeout) runs before every write; and a compaction, the one
    write that replaces the directory's snapshot mid-pass and drops every other log's records, first reads the
    snapshot back and refuses (:class:`StaleProgressWriter`) unless it is still this writer's own. A rank 0 that
    thaws after the group re-formed under another could otherwise rewrite ``distributed_progress.json`` with its
    stale state, of the same run and version, which a restart would accept. The read-then-write leaves a window of
    one request between the check and the write; the round fence closes most of it (a stalled writer fails it)."""

    def __init__(self, checkpoint_path: str, run: str, version: int, compact_every: int = COMPACT_EVERY,
                 fence: Optional[Callable[[], None]] = None) -> None:
        self.checkpoint_path = checkpoint_path
        self.run = run
        self.version = version
        self.compact_every = compact_every  # 0: never mid-pass
        self.fence: Callable[[], None] = fence or (lambda: None)
        self.log_id = ""
        self.seq = 0
        self.segments = 0  # segments written under this log id
        self.records_from = 0  # the first record not in a segment
        self._since: list[dict[str, Any]] = []  # the records from ``records_from`` on: the next segment's contents
        self.shared_name = ""  # the whole vector the last record names
        self.vector_files: list[str] = []  # the whole vector and the block files after it: what a restart reads
        # the staged files this log's ``written`` records named: a base written mid-pass carries them, since the
        # rank publishes a group's files only after its record (job/checkpoint/write_groups.py) and a restart must
        # still know them (files no record names are removed, never published)
        self.staged: list[list[Any]] = []

    def _url(self, name: str) -> str:
        return storage.join(log_url(self.checkpoint_path), name)

    def _pointer(self) -> dict[str, Any]:
        return {"format": FORMAT, "run": self.run, "version": self.version, "log": self.log_id,
                "segments": self.segments, "records_from": self.records_from, "shared": self.shared_name}

    def start(self, state: dict[str, Any], shared: Optional[np.ndarray] = None) -> None:
        """Write the base (the state, and the shared vector it starts from) and the snapshot naming it under a new
        log id, then drop the files of earlier log ids (no longer read). ``state`` and ``shared`` must be what the
        directory's snapshot replays to when one of this writer's is there (only its own is replaced). A kill before
        the snapshot is written leaves the old snapshot with its files whole; one after it, files no snapshot names
        (dropped by the next ``start``)."""
        self.fence()
        if self.log_id:  # a new base mid-pass: only over this writer's own snapshot
            self._check_own_snapshot()
        self.log_id = secrets.token_hex(6)
        self.seq = self.segments = self.records_from = 0
        self._since = []
        self.shared_name = ""
        self.vector_files = []
        if shared is not None:
            self.shared_name = f"{self.log_id}-base.f32"
            self.vector_files = [self.shared_name]
            storage.write_bytes(self._url(self.shared_name), np.ascontiguousarray(shared, np.float32).tobytes())
        storage.write_text(self._url(f"{self.log_id}-base.json"), json.dumps({"state": state, "staged": self.staged}))
        storage.write_text(progress_url(self.checkpoint_path), json.dumps(self._pointer()))
        storage.remove_many([self._url(name) for name in storage.listdir(log_url(self.checkpoint_path))
                             if not name.startswith(f"{self.log_id}-")])

    def append(self, records: list[dict[str, Any]], shared: Optional[np.ndarray] = None,
               blocks: Optional[VectorBlocks] = None) -> bool:
        """One object holding ``records`` (those of every request the server's committer writes together); with
        ``shared`` (the whole vector) or ``blocks`` (its blocks changed since the last vector file, a vector file
        already written), that file first, then the record naming it. Returns whether the log is due for compaction:
        ``compact_every`` records since the last segment, after which the writer calls ``compact``, so that a
        restart reads at most that many records."""
        if not records and shared is None and blocks is None:
            return False
        if not self.log_id:
            raise RuntimeError("progress records appended before the pass's snapshot")
        if blocks is not None and not self.vector_files:
            raise RuntimeError("changed blocks of the shared vector appended before any whole vector")
        self.fence()
        name = f"{self.log_id}-{self.seq:08d}"
        previous = self.vector_files
        self.staged.extend(list(entry) for record in records if record.get("e") in STAGING_RECORDS
                           for entry in record.get("staged", []))
        if shared is not None:
            storage.write_bytes(self._url(f"{name}.f32"), np.ascontiguousarray(shared, np.float32).tobytes())
            records = [*records, {"e": "shared", "file": f"{name}.f32"}]
        elif blocks is not None:
            storage.write_bytes(self._url(f"{name}.b32"), blocks.encode())
            records = [*records, {"e": "shared_blocks", "file": f"{name}.b32"}]
        storage.write_text(self._url(f"{name}.json"), json.dumps(records))
        self.seq += 1
        self._since.extend(records)
        if shared is not None:
            self.shared_name = f"{name}.f32"
            self.vector_files = [self.shared_name]
            if previous:  # no record names them any more (one request: no directory check)
                storage.remove_many([self._url(old) for old in previous])
        elif blocks is not None:
            self.vector_files = [*previous, f"{name}.b32"]
        return 0 < self.compact_every <= self.seq - self.records_from

    def compact(self, shared: Optional[np.ndarray] = None) -> None:
        """The records since the last segment become one segment, the snapshot names it, then they are dropped: the
        bytes written are those records again, whatever the pass's size (O(buckets) per pass). With ``shared`` (the
        vector the records leave), when block files follow the last whole vector, the segment names it whole
        instead, and they are dropped too. Only over this writer's own snapshot (``StaleProgressWriter``
        otherwise). A kill before the snapshot is rewritten leaves the old one, whose records and files are all
        still there; one after it, records and files it no longer reads."""
        self.fence()
        self._check_own_snapshot()
        dropped = [self._url(f"{self.log_id}-{n:08d}.json") for n in range(self.records_from, self.seq)]
        if shared is not None and len(self.vector_files) > 1:
            whole = f"{self.log_id}-seg-{self.segments:08d}.f32"
            storage.write_bytes(self._url(whole), np.ascontiguousarray(shared, np.float32).tobytes())
            self._since.append({"e": "shared", "file": whole})
            dropped += [self._url(old) for old in self.vector_files]
            self.shared_name, self.vector_files = whole, [whole]
        storage.write_text(self._url(f"{self.log_id}-seg-{self.segments:08d}.json"), json.dumps(self._since))
        self.segments += 1
        self.records_from = self.seq
        self._since = []
        storage.write_text(progress_url(self.checkpoint_path), json.dumps(self._pointer()))
        storage.remove_many(dropped)

    def _check_own_snapshot(self) -> None:
        try:
            found = json.loads(storage.read_text(progress_url(self.checkpoint_path)))
        except (FileNotFoundError, json.JSONDecodeError):
            found = None
        owner = found.get("log") if isinstance(found, dict) else None
        if owner != self.log_id:
            raise StaleProgressWriter(
                f"{progress_url(self.checkpoint_path)}: the snapshot is {'log ' + str(owner) if owner else 'gone'}, not "
                f"this writer's log {self.log_id} (another round's rank 0 took the pass over): writing nothing more")


def load_snapshot(checkpoint_path: str) -> Optional[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """The snapshot as stored (its base's ``state`` and ``staged`` taken into it) and its records in order, the
    segments' then those after them, whoever wrote them (the ``shared`` records, which name the vector, moved into
    the snapshot's ``shared``); None if there is none."""
    try:
        snapshot = json.loads(storage.read_text(progress_url(checkpoint_path)))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if not isinstance(snapshot, dict):
        return None
    log_id = str(snapshot.get("log", ""))
    try:
        segments = max(0, int(snapshot.get("segments", 0)))
        first = max(0, int(snapshot.get("records_from", 0)))
    except (TypeError, ValueError):
        return None
    numbered = []
    for name in storage.listdir(log_url(checkpoint_path)):
        stem = name[:-len(".json")] if name.endswith(".json") else ""
        prefix, _, digits = stem.rpartition("-")
        if log_id and prefix == log_id and digits.isdigit() and int(digits) >= first:
            numbered.append((int(digits), name))
    in_order = []
    for expected, (number, name) in enumerate(sorted(numbered), start=first):
        if number != expected:  # a record lost before the next was written cannot be: stop where they break off
            logger.warning("progress records of %s break off after %d", checkpoint_path, expected)
            break
        in_order.append(name)
    fixed = [f"{log_id}-base.json", *(f"{log_id}-seg-{n:08d}.json" for n in range(segments))]
    # read together (a pass's records are hundreds of small objects), replayed in order
    contents = storage.read_many([storage.join(log_url(checkpoint_path), name) for name in fixed + in_order])
    try:
        base = json.loads(_text(fixed[0], contents[0]))
        parts = [json.loads(_text(name, content)) for name, content in zip(fixed[1:], contents[1:len(fixed)])]
    except (FileNotFoundError, UnicodeDecodeError, json.JSONDecodeError) as err:
        logger.warning("progress of %s unreadable (%s): not resumed", checkpoint_path, err)
        return None
    snapshot["state"] = base.get("state", {}) if isinstance(base, dict) else {}
    snapshot["staged"] = base.get("staged", []) if isinstance(base, dict) else []
    for name, content in zip(in_order, contents[len(fixed):]):
        try:
            parts.append(json.loads(_text(name, content)))
        except (FileNotFoundError, UnicodeDecodeError, json.JSONDecodeError):
            logger.warning("progress record %s unreadable; the records after it are not replayed", name)
            break
    records: list[dict[str, Any]] = []
    blocks: list[str] = []  # the block files after the last whole vector, in order
    for changes in parts:
        for change in changes:
            if change.get("e") == "shared":
                snapshot["shared"], blocks = change["file"], []
            elif change.get("e") == "shared_blocks":
                blocks.append(str(change["file"]))
            else:
                records.append(change)
    snapshot["shared_blocks"] = blocks
    return snapshot, records


def _text(name: str, content: Optional[bytes]) -> str:
    if content is None:
        raise FileNotFoundError(name)
    return content.decode("utf-8")


def read_progress(checkpoint_path: str, version: int, run: str) -> Optional[Progress]:
    """The progress of the pass after the committed ``version`` if this run wrote it; None otherwise (no progress,
    or one this run must not resume: logged, and removed by the caller with the pass's uncommitted files)."""
    loaded = load_snapshot(checkpoint_path)
    if loaded is None:
        return None
    snapshot, records = loaded
    reason = ""
    if snapshot.get("format") != FORMAT:
        reason = "written by another biggraph version"
    elif snapshot.get("run") != run:
        reason = f"written by run {snapshot.get('run')!r}, not this run ({run!r})"
    elif snapshot.get("version") != version + 1:
        reason = f"for version {snapshot.get('version')}, not {version + 1} (the pass after the committed version)"
    shared = None
    if not reason and snapshot.get("shared"):
        try:
            raw = storage.read_bytes(storage.join(log_url(checkpoint_path), str(snapshot["shared"])))
            shared = np.frombuffer(raw, dtype=np.float32).copy()
            names = list(snapshot.get("shared_blocks", []))
            for name, content in zip(names, storage.read_many([storage.join(log_url(checkpoint_path), n)
                                                               for n in names])):
                if content is None:
                    raise FileNotFoundError(name)
                VectorBlocks.decode(content, name).apply(shared)
        except FileNotFoundError as err:
            reason = f"its shared parameters ({snapshot['shared']}, then {err}) are missing"
        except ValueError as err:
            reason = f"its shared parameters are unreadable ({err})"
    if reason:
        logger.warning("%s: not resumed (%s); the pass starts over from version %d", progress_url(checkpoint_path),
                       reason, version)
        return None
    staged_before = snapshot.get("staged", [])
    if not isinstance(staged_before, list):
        staged_before = []
    return Progress(run=run, version=version + 1, state=dict(snapshot["state"]), records=records, shared=shared,
                    staged_before=[list(entry) for entry in staged_before])


def resumable(progress: Optional[Progress], version: int, shared_shape: tuple[int, ...]) -> Optional[Progress]:
    """``progress`` if the pass committing ``version`` resumes it: None when there is none, when it is of another
    pass, or when its shared-parameter vector has another shape than the model's (logged, naming both shapes). Its
    "done" buckets' shared updates live only in that vector: resuming them with the model's vector instead would
    lose those updates (issue 44), so the whole pass is trained again."""
    if progress is None or progress.version != version:
        return None
    if progress.shared is not None and tuple(progress.shared.shape) != tuple(shared_shape):
        logger.warning("the interrupted pass's progress is refused: its shared-parameter vector has shape %s, the "
                       "model's %s; training the pass to version %d from its start", tuple(progress.shared.shape),
                       tuple(shared_shape), version)
        return None
    return progress


def current_state(checkpoint_path: str) -> Optional[dict[str, Any]]:
    """The progress as it stands (snapshot and records replayed), whoever wrote it: for tools and benches that
    watch a run (``LockState.to_json()`` shape plus ``version``)."""
    from job.train.distributed.lock_state import LockState

    loaded = load_snapshot(checkpoint_path)
    if loaded is None:
        return None
    snapshot, records = loaded
    state = LockState(0, 0, {})
    state.restore(snapshot.get("state", {}))
    for record in records:
        state.apply(record)
    return dict(state.to_json(), version=snapshot.get("version"), run=snapshot.get("run"))


def remove_progress(checkpoint_path: str) -> None:
    """Drop the progress: the snapshot first (records without it are never read), then the records."""
    storage.remove(progress_url(checkpoint_path))
    storage.remove(log_url(checkpoint_path))
