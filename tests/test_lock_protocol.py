"""The lock server as a service: every request answered (errors included), a ``sync`` of the wrong shape refused,
progress persisted as a snapshot plus one record per change and replayed after a restart, a progress file
bound to its run (a stale or foreign one refused and cleaned, never resumed), and the shared parameters carried
point-to-point over gloo, never through the store.

Real TCPStore, real gloo transports (one per rank, the ranks being threads of this process: rank 0's trainer hands
its vectors to its server in memory, the others' go through gloo's sockets) and server threads; no torchrun
(tests/test_elastic_rounds.py has the real-process tests, and the end of this file a group of real processes)."""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import pytest
import torch
from helpers_distributed import partition_keys, transports, wait_until
from torch.distributed import TCPStore

import storage_adapters as storage
from job.checkpoint.group_progress import (
    PROGRESS_FILE,
    PROGRESS_LOG,
    ProgressLog,
    current_state,
    read_progress,
    remove_progress,
)
from job.checkpoint.write_groups import STAGED_PREFIX, WriteGroup, publish, roll_forward, staged_name
from job.config import parse_config
from job.formats.checkpoint import CheckpointStorage, SharedSumRegistry
from job.formats.checksums import checksum_file
from job.train.distributed.handoff import PartitionHandoff
from job.train.distributed.lock_client import LockClient
from job.train.distributed.lock_server import LockServer
from job.train.distributed.lock_state import LockState
from job.train.distributed.protocol import LockServerError, seal
from job.train.distributed.shard_client import ShardClient
from job.train.distributed.shard_routing import ShardedRows
from job.train.distributed.shard_service import ShardService, ShardSlice
from job.train.distributed.shared_rows import RowLayout
from job.train.distributed.transport import TensorTransport
from job.train.residency.partitions import PartitionStore

PREFIX = "biggraph/test-round/lock"


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


@pytest.fixture
def ranks(store: TCPStore) -> list[TensorTransport]:
    """Ranks 0 (the server's) and 1 of a real gloo transport."""
    return transports(store, 2)


@pytest.fixture
def served(store: TCPStore, ranks: list[TensorTransport]) -> Iterator[tuple[LockServer, LockClient]]:
    state = LockState(4, 4, partition_keys(4), world_size=2)
    server = LockServer(store, state, SimpleNamespace(append=lambda records: None), np.zeros(3, np.float32), 0,
                        ranks[0], prefix=PREFIX)
    # a bounded wait, far above any answer: a request left unanswered fails the test with "no answer", not a hang
    client = LockClient(store, 1, timeout_s=60, prefix=PREFIX, transport=ranks[1])
    try:
        yield server, client
    finally:
        server.stop()


def persisted(state: LockState) -> dict[str, Any]:
    """What a restart keeps of a state (reservations are forgotten by a restart, so not compared)."""
    data = state.to_json()
    data.pop("reserved")
    return data


# every request answered ----------------------------------------------------------------------------------------


def test_an_unknown_request_is_answered_with_an_error_naming_it(served: tuple[LockServer, LockClient]) -> None:
    _, client = served
    with pytest.raises(LockServerError, match="refused 'shuffle'.*unknown request 'shuffle'"):
        client._call({"op": "shuffle"})
    kind, bucket, _ = client.next_bucket(set(), None, None)  # and it serves on
    assert kind == "bucket" and bucket is not None


def test_once_the_round_ends_a_bucket_is_finished_but_none_handed_out_and_a_lost_rank_is_refused(
        store: TCPStore, ranks: list[TensorTransport]) -> None:
    """Rank 0's server learns the round's end from its own process (a peer declared dead, a SIGTERM:
    ``DistributedContext.ending``): ``next`` then records the finished bucket and answers ``ending`` (the rank gives
    back and exits), ``reserve`` grants nothing, a rank declared dead is refused (it is fenced: nothing it wrote is
    recorded), and ``settled`` says when every live rank has given back."""
    state = LockState(4, 4, partition_keys(4), world_size=3)
    why: list[str] = []
    lost: set[int] = set()
    server = LockServer(store, state, SimpleNamespace(append=lambda records, shared=None: None),
                        np.zeros(3, np.float32), 0, ranks[0], prefix=PREFIX,
                        ending=lambda: why[0] if why else None, lost=lambda: frozenset(lost))
    clients = {rank: LockClient(store, rank, timeout_s=60, prefix=PREFIX) for rank in (1, 2)}
    try:
        kind, bucket, _ = clients[1].next_bucket(set(), None, None)
        kind2, other, _ = clients[2].next_bucket(set(), None, None)
        assert kind == kind2 == "bucket" and bucket is not None and other is not None
        assert not server.settled()
        why.append("rank 2 stopped responding for 6 s")
        lost.add(2)
        assert clients[1].reserve() == (None, set())
        kind, nothing, _ = clients[1].next_bucket(set(), bucket, None)
        assert (kind, nothing) == ("ending", None) and clients[1].last_why == why[0]
        assert bucket in server.state.done
        with pytest.raises(LockServerError, match="declared dead"):
            clients[2].written(sorted(partition_keys(4)[other]), [])
        assert not server.settled()  # rank 1 still holds its bucket's partitions unwritten
        keys = sorted(partition_keys(4)[bucket])
        clients[1].written(keys, [])
        clients[1].release(keys, written=False)
        assert server.settled()  # rank 2 is lost, rank 0 holds nothing
    finally:
        server.stop()


def test_a_rank_that_leaves_ends_the_round_for_every_rank(store: TCPStore, ranks: list[TensorTransport]) -> None:
    """A rank that received SIGTERM says so with its ``next``: no rank gets another bucket."""
    state = LockState(4, 4, partition_keys(4), world_size=3)
    server = LockServer(store, state, SimpleNamespace(append=lambda records, shared=None: None),
                        np.zeros(3, np.float32), 0, ranks[0], prefix=PREFIX)
    clients = {rank: LockClient(store, rank, timeout_s=60, prefix=PREFIX) for rank in (1, 2)}
    try:
        _, bucket, _ = clients[1].next_bucket(set(), None, None)
        kind, _, _, _ = clients[2].finish_and_next(set(), None, None, leaving="rank 2 received SIGTERM")
        assert kind == "ending" and "rank 2" in (clients[2].last_why or "")
        kind, _, _ = clients[1].next_bucket(set(), bucket, None)
        assert kind == "ending" and bucket in server.state.done
    finally:
        server.stop()


def test_a_malformed_request_is_answered_with_the_servers_error(served: tuple[LockServer, LockClient]) -> None:
    _, client = served
    with pytest.raises(LockServerError, match="refused 'release'.*KeyError"):
        client._call({"op": "release"})  # no "keys"
    with pytest.raises(LockServerError, match="refused 'next'"):
        client._call({"op": "next", "finished": [1, 2, 3]})  # a bucket has two partitions


def test_a_request_without_a_rank_is_logged_and_the_server_serves_on(store: TCPStore,
                                                                    served: tuple[LockServer, LockClient],
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    _, client = served
    store.queue_push(f"{PREFIX}/requests", seal({"op": "next"}, PREFIX))  # authentic, but nobody to answer
    store.queue_push(f"{PREFIX}/requests", b"\x05\x00\x00\x00{oops")  # not JSON
    # a push is not acknowledged: a question on the same connection makes sure both are queued before the client's
    store.queue_len(f"{PREFIX}/requests")
    kind, _, _ = client.next_bucket(set(), None, None)
    assert kind == "bucket"
    assert caplog.text.count("dropped unanswered (unreadable") == 2


def test_a_stop_left_by_an_earlier_server_of_the_round_is_not_answered_nor_stops_this_one(
        store: TCPStore, served: tuple[LockServer, LockClient], caplog: pytest.LogCaptureFixture) -> None:
    """A round's passes each start a server on the round's queue; one that ended between two requests never read
    its stop message, which the next one finds first."""
    server, client = served
    store.queue_push(f"{PREFIX}/requests", seal({"op": "stop", "rank": -1, "server": "an-earlier-one"}, PREFIX))
    kind, _, _ = client.next_bucket(set(), None, None)
    assert kind == "bucket" and server.thread.is_alive()
    assert "refused" not in caplog.text and "dropped" not in caplog.text


def test_a_sync_of_the_wrong_shape_is_refused_and_changes_nothing(served: tuple[LockServer, LockClient]) -> None:
    server, client = served
    with pytest.raises(LockServerError, match="refused 'sync'.*change of 5 values.*have 3"):
        client.sync(torch.ones(5))
    assert server.shared.tolist() == [0.0, 0.0, 0.0]
    # the refused payload was taken all the same: the next one travels on the same pair
    assert client.sync(torch.tensor([1.0, 2.0, 3.0])).tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(LockServerError, match="refused 'release'.*carries no shared-parameter change"):
        client._call({"op": "release", "keys": []}, torch.ones(3))
    assert client.sync(torch.zeros(3)).tolist() == [1.0, 2.0, 3.0]


def test_a_failed_progress_write_is_answered_and_every_later_request_refused(store: TCPStore,
                                                                             ranks: list[TensorTransport]) -> None:
    """A grant is answered before its record is stored (commits.py, ``replies_early``); the first request whose
    reply waits for its record is refused with the write's error, and every request after it."""
    def fail(records: list) -> None:
        raise OSError("disk full")

    server = LockServer(store, LockState(4, 4, partition_keys(4)), SimpleNamespace(append=fail),
                        np.zeros(1, np.float32), 0, ranks[0], prefix=PREFIX)
    client = LockClient(store, 1, timeout_s=60, prefix=PREFIX, transport=ranks[1])
    try:
        kind, bucket, _ = client.next_bucket(set(), None, None)  # a grant leaves before its record is stored
        assert kind == "bucket" and bucket is not None
        with pytest.raises(LockServerError, match="OSError: disk full"):  # a reply that waits for its record
            client.release(sorted(partition_keys(4)[bucket]))
        with pytest.raises(LockServerError, match="could not be saved earlier.*disk full"):
            client.status()
        with pytest.raises(LockServerError, match="could not be saved earlier.*disk full"):
            client.sync(torch.ones(1))  # its payload taken, the refusal answered
    finally:
        server.stop()


def test_a_client_whose_server_is_gone_raises_naming_it(store: TCPStore) -> None:
    client = LockClient(store, 0, timeout_s=1, prefix=PREFIX)  # no server on this prefix
    with pytest.raises(LockServerError, match="no answer to 'next'"):
        client.next_bucket(set(), None, None)


def test_a_client_whose_store_host_is_gone_says_so_at_once_not_after_the_timeout() -> None:
    """What a rank frozen (SIGSTOP) past the peer timeout meets once thawed: the others re-formed the group, the
    store of its round is gone. It is told so at once, not as a wait of the whole timeout that never happened."""
    import subprocess
    import sys

    host = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from datetime import timedelta; from torch.distributed import TCPStore; "
        "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)); "
        "print(s.port, flush=True); time.sleep(120)")], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        remote = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        client = LockClient(remote, 1, timeout_s=600, prefix=PREFIX)
        host.kill()
        host.wait()
        with pytest.raises(LockServerError, match=r"lost the store while asking 'next' after \d+\.\d s .*the group "
                                                  "this rank belonged to is gone"):
            client.next_bucket(set(), None, None)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()


# progress: a snapshot, then a record per change -------------------------------------------------------------------


def run_pass_steps(state: LockState, rng: random.Random, steps: int) -> None:
    """Ranks asking for buckets, finishing them, reserving and releasing, in a random order."""
    held: dict[int, set] = {r: set() for r in range(state.world_size)}
    current: dict[int, Any] = {r: None for r in range(state.world_size)}
    for _ in range(steps):
        rank = rng.randrange(state.world_size)
        if current[rank] is not None and rng.random() < 0.3:
            state.reserve(rank, rng)
            continue
        if current[rank] is not None:
            state.add_record({"bucket": list(current[rank]), "rank": rank})
        kind, bucket = state.next_bucket(rank, held[rank], current[rank], rng)
        current[rank] = bucket
        if kind != "bucket":
            state.release(rank, sorted(held[rank]))
            held[rank] = set()
            continue
        keep = set(state.bucket_keys[bucket])
        if state.reserved.get(rank) is not None:
            keep |= state.bucket_keys[state.reserved[rank]]
        state.release(rank, sorted(held[rank] - keep), written=rng.random() < 0.9)
        held[rank] = set(state.bucket_keys[bucket])


@pytest.mark.parametrize("seed", range(5))
def test_the_snapshot_with_its_records_replayed_is_the_servers_state(seed: int) -> None:
    rng = random.Random(seed)
    live = LockState(4, 4, partition_keys(4), world_size=3)
    run_pass_steps(live, rng, 7)
    live.drain_journal()
    snapshot = json.loads(json.dumps(live.to_json()))
    run_pass_steps(live, rng, 25)
    records = json.loads(json.dumps(live.drain_journal()))
    replayed = LockState(4, 4, partition_keys(4), world_size=3)
    replayed.restore(snapshot)
    for record in records:
        replayed.apply(record)
    assert persisted(replayed) == persisted(live)
    # and a restart from either forgets the same locks and redoes the same buckets
    live.forget_rank_locks()
    replayed.forget_rank_locks()
    assert replayed.to_json() == live.to_json()


def test_each_request_appends_one_small_record_and_the_snapshot_is_written_once(tmp_path: Path,
                                                                               store: TCPStore,
                                                                               ranks: list[TensorTransport]) -> None:
    checkpoint = str(tmp_path)
    state = LockState(4, 4, partition_keys(4), world_size=1, version=3)
    log = ProgressLog(checkpoint, "job-a/cfg", 3)
    log.start(state.to_json())
    snapshot = (tmp_path / PROGRESS_FILE).read_bytes()
    server = LockServer(store, state, log, np.zeros(1, np.float32), 0, ranks[0], prefix=PREFIX)
    client = LockClient(store, 0, timeout_s=60, prefix=PREFIX)
    try:
        finished = None
        for _ in range(16):
            kind, finished, _ = client.next_bucket(set(), finished, {"n": 1} if finished else None)
            assert kind == "bucket" and finished is not None
            # a grant is answered before its record is stored, and records queued together are written as one:
            # each stored alone here, as a group whose requests do not overlap writes them
            assert wait_until(server.stored)
            client.release(sorted(state.bucket_keys[finished]))
        client.next_bucket(set(), finished, {"n": 1})
        assert (tmp_path / PROGRESS_FILE).read_bytes() == snapshot  # never rewritten under the lock
        records = sorted(p for p in (tmp_path / PROGRESS_LOG).iterdir() if not p.name.endswith("-base.json"))
        assert len(records) == 33  # one per next and per release
        assert max(r.stat().st_size for r in records) < 1000  # each holds its own change, not the state so far
        resumed = read_progress(checkpoint, 2, "job-a/cfg")
        assert resumed is not None and resumed.version == 3
        again = LockState(4, 4, partition_keys(4), world_size=1, version=3)
        again.restore(resumed.state)
        for record in resumed.records:
            again.apply(record)
        assert persisted(again) == persisted(state)
        assert len(again.done) == 16 and len(again.records) == 16
        assert current_state(checkpoint)["done"] == state.to_json()["done"]  # what benches and tools watch
    finally:
        server.stop()


@pytest.mark.parametrize("cut", [None, "before the snapshot", "after the snapshot"])
def test_a_compaction_mid_pass_bounds_the_records_a_restart_reads_and_keeps_its_state(
        tmp_path: Path, store: TCPStore, ranks: list[TensorTransport], monkeypatch: pytest.MonkeyPatch,
        cut: Any) -> None:
    """Every ``compact_every`` records the server writes them again as one segment: a restart then reads fewer
    records than that (and the segments), and replays to the same state. A compaction cut before its snapshot is
    rewritten leaves the last snapshot and its records; one cut after it (before the old records are dropped) the
    new one: either replays to the state of the last request whose records were written: the state the last
    answered request left, or the one the last grant left if the write that failed was its own (a grant is answered
    before its record is stored, commits.py: ``replies_early``; the release after it is then refused)."""
    checkpoint = str(tmp_path)
    state = LockState(4, 4, partition_keys(4), world_size=1, version=3)
    log = ProgressLog(checkpoint, "job-a/cfg", 3, compact_every=5)
    log.start(state.to_json())
    server = LockServer(store, state, log, np.zeros(1, np.float32), 0, ranks[0], prefix=PREFIX)
    client = LockClient(store, 0, timeout_s=60, prefix=PREFIX)
    real_write, real_remove = storage.write_text, storage.remove_many

    def write_text(url: str, text: str) -> None:
        if cut == "before the snapshot" and url.endswith(PROGRESS_FILE) and len(state.done) >= 9:
            raise OSError("cut before the snapshot")
        real_write(url, text)

    def remove_many(urls: Any) -> None:
        if cut == "after the snapshot" and len(state.done) >= 9 and any(u.endswith(".json") for u in urls):
            raise OSError("cut after the snapshot")
        real_remove(urls)

    monkeypatch.setattr(storage, "write_text", write_text)
    monkeypatch.setattr(storage, "remove_many", remove_many)
    try:
        finished = None
        granted = None  # the state the last grant left
        with pytest.raises(LockServerError) if cut else contextlib.nullcontext():
            for _ in range(16):
                kind, finished, _ = client.next_bucket(set(), finished, {"n": 1} if finished else None)
                granted = persisted(state)
                assert kind == "bucket" and finished is not None
                client.release(sorted(state.bucket_keys[finished]))
            client.next_bucket(set(), finished, {"n": 1})
        if cut is None:
            assert len(state.done) == 16
        names = sorted(p.name for p in (tmp_path / PROGRESS_LOG).iterdir() if p.name.endswith(".json"))
        records = [n for n in names if "-seg-" not in n and not n.endswith("-base.json")]
        resumed = read_progress(checkpoint, 2, "job-a/cfg")
        assert resumed is not None
        if cut is None:  # 33 records written in all, at most 4 since the last compaction
            assert len(records) < 5
            # each segment holds the records since the one before, never the state so far: together with the
            # records after them they are every change once (a pass writes O(buckets) bytes of progress)
            segments = [json.loads((tmp_path / PROGRESS_LOG / n).read_text()) for n in names if "-seg-" in n]
            # one every 5 record objects (a grant's and the next request's records may share one: commits.py)
            assert len(segments) == server.stats()["appends"] // 5 >= 5
            kept = [r for part in segments for r in part] + [
                r for n in records for r in json.loads((tmp_path / PROGRESS_LOG / n).read_text())]
            assert [r for r in kept if r["e"] != "shared"] == resumed.records
        again = LockState(4, 4, partition_keys(4), world_size=1, version=3)
        again.restore(resumed.state)
        for record in resumed.records:
            again.apply(record)
        assert persisted(again) == persisted(state) or (cut and persisted(again) == granted)
    finally:
        server.stop()


def test_records_are_replayed_only_while_their_numbers_follow_each_other(tmp_path: Path) -> None:
    checkpoint = str(tmp_path)
    state = LockState(2, 2, partition_keys(2))
    log = ProgressLog(checkpoint, "run", 1)
    log.start(state.to_json())
    for bucket in ([0, 0], [0, 1], [1, 1]):
        log.append([{"e": "start", "rank": 0, "bucket": bucket}])
    (tmp_path / PROGRESS_LOG / f"{log.log_id}-00000001.json").unlink()
    progress = read_progress(checkpoint, 0, "run")
    assert progress is not None and progress.records == [{"e": "start", "rank": 0, "bucket": [0, 0]}]


def test_a_new_snapshot_drops_the_records_of_the_last(tmp_path: Path) -> None:
    """A resumed pass writes the compaction of what it resumed under a new log id; the old records go."""
    checkpoint = str(tmp_path)
    first = ProgressLog(checkpoint, "run", 1)
    first.start(LockState(2, 2, partition_keys(2)).to_json())
    first.append([{"e": "start", "rank": 0, "bucket": [0, 0]}])
    second = ProgressLog(checkpoint, "run", 1)
    second.start(LockState(2, 2, partition_keys(2)).to_json())
    assert [p.name for p in (tmp_path / PROGRESS_LOG).iterdir()] == [f"{second.log_id}-base.json"]
    progress = read_progress(checkpoint, 0, "run")
    assert progress is not None and progress.records == []
    remove_progress(checkpoint)
    assert not (tmp_path / PROGRESS_FILE).exists() and not (tmp_path / PROGRESS_LOG).exists()


# bound to its run --------------------------------------------------------------------------------------------------


def write_progress(checkpoint: Path, run: str, version: int) -> None:
    state = LockState(4, 4, partition_keys(4), version=version)
    log = ProgressLog(str(checkpoint), run, version)
    log.start(state.to_json())
    log.append([{"e": "start", "rank": 0, "bucket": [0, 0]}, {"e": "finish", "rank": 0, "bucket": [0, 0],
                                                           "keys": []}])


def test_only_the_run_that_wrote_the_progress_resumes_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_progress(tmp_path, "job-a/cfg1", 4)
    resumed = read_progress(str(tmp_path), 3, "job-a/cfg1")  # the same job restarted: resumes
    assert resumed is not None and len(resumed.records) == 2
    assert read_progress(str(tmp_path), 3, "job-b/cfg1") is None  # another job
    assert read_progress(str(tmp_path), 3, "job-a/cfg2") is None  # the same name, another config
    assert read_progress(str(tmp_path), 4, "job-a/cfg1") is None  # a stale one: its version is committed
    assert "written by run 'job-a/cfg1', not this run ('job-b/cfg1')" in caplog.text
    assert "for version 4, not 5" in caplog.text


def test_a_progress_file_of_the_old_format_is_refused(tmp_path: Path) -> None:
    (tmp_path / PROGRESS_FILE).write_text(json.dumps(dict(LockState(4, 4, partition_keys(4), version=1).to_json())))
    assert read_progress(str(tmp_path), 0, "none") is None


def open_with(checkpoint: Path, run: str | None) -> Any:
    """What a trainer's start does, as rank 0 of a one-rank group of ``run`` (None: a single-process run): the
    checkpoint manager opens the directory, asking which progress this run resumes."""
    from job.checkpoint import CheckpointManager
    from job.train.distributed.group import DistributedContext
    from job.train.resume import GroupBarrier

    ctx = None
    if run is not None:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
        ctx = DistributedContext(rank=0, world_size=1, store=store, restart_count=0, round_id="r", run_id=run)
    manager = CheckpointManager(str(checkpoint), [("node", p) for p in range(4)])
    try:
        version = manager.open(GroupBarrier(ctx) if ctx is not None else None)
    finally:
        manager.close()
    return version, manager.resumed


def test_a_foreign_progress_is_cleaned_with_the_uncommitted_files_and_the_owner_resumes(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    write_progress(checkpoint, "job-a/cfg", 1)
    version, progress = open_with(checkpoint, "job-a/cfg")  # a restart of the run that wrote it
    assert version == 0 and progress is not None and progress.version == 1
    assert (checkpoint / PROGRESS_FILE).exists()
    version, progress = open_with(checkpoint, "job-b/cfg")  # a later, different job
    assert progress is None
    assert not (checkpoint / PROGRESS_FILE).exists() and not (checkpoint / PROGRESS_LOG).exists()
    write_progress(checkpoint, "job-a/cfg", 1)
    _, progress = open_with(checkpoint, None)  # a single-process run takes none, and leaves none for later
    assert progress is None and not (checkpoint / PROGRESS_FILE).exists()


# shared parameters persisted with the progress -----------------------------------------------------------------------


class Trainer:
    """A rank as the lock server sees it: its bucket's shared update (1 in that bucket's slot) goes with the
    request that finishes the bucket; the partitions it no longer needs are written back and released."""

    def __init__(self, client: LockClient, nparts: int, block: int = 1, sparse: bool = False) -> None:
        """``block``: the values of each bucket's slot (its change is ``block`` ones); ``sparse``: the change carries
        the slot alone, as its relation row (job/train/distributed/shared_rows.py: a layout of one value a row)."""
        self.client = client
        self.nparts = nparts
        self.block = block
        self.sparse = sparse
        self.current: Any = None
        self.held: set = set()
        self.sums: list[torch.Tensor] = []  # the sums the server answered, in order

    def step(self, state: LockState) -> str:
        delta, rows = None, None
        if self.current is not None:
            slot = self.current.lhs * self.nparts + self.current.rhs
            if self.sparse:
                delta, rows = torch.ones(self.block), [slot]
            else:
                delta = torch.zeros(self.nparts * self.nparts * self.block)
                delta[slot * self.block:(slot + 1) * self.block] = 1.0
        kind, bucket, _, total = self.client.finish_and_next(self.held, self.current, None, delta, rows=rows)
        if total is not None:
            self.sums.append(total)
        self.current = bucket
        keep = set(state.bucket_keys[bucket]) if bucket is not None else set()
        if self.held - keep:
            self.client.release(sorted(self.held - keep))
        self.held = keep
        return kind


def serve(store: Any, checkpoint: str, progress: Any, prefix: str, transport: TensorTransport,
          sparse: bool = False, write_behind: int = 0, lost: frozenset[int] = frozenset(),
          log_of: Callable[[ProgressLog], Any] = lambda log: log, shard_save: Any = None) -> LockServer:
    """Rank 0's lock server for the pass committing version 1, resumed from ``progress`` if any (as
    ``LockServerScheduler.start_pass`` does); ``sparse``: each of the 16 values is a relation row;
    ``write_behind``: ``write_behind_buckets`` (job/train/distributed/cuts.py); ``lost``: ranks declared dead;
    ``log_of``: what the server writes its progress through (``Withholding``), given the log; ``shard_save``: the
    shards save what a record saves (``shared_shards``, job/train/distributed/commits.py)."""
    state = LockState(4, 4, partition_keys(4), world_size=2, version=1)
    shared = np.zeros(16, np.float32)
    if progress is not None:
        state.restore(progress.state)
        for record in progress.records:
            state.apply(record)
        state.forget_rank_locks()
        shared = progress.shared
    log = ProgressLog(checkpoint, "run", 1, compact_every=4)  # the kills fall on either side of compactions too
    log.start(state.to_json(), shared)
    layout = RowLayout.of(16, 16, [(0, 1)]) if sparse else None
    return LockServer(store, state, log_of(log), shared, 0, transport, prefix=prefix, layout=layout,
                      write_behind=write_behind, lost=lambda: lost, shard_save=shard_save)


class Withholding:
    """A progress log whose writes rank 0 dies before storing: once ``armed``, the first write holding a grant's
    record (``start``: a ``next`` answered before its record is stored, job/train/distributed/commits.py) and every
    write after it wait, and reach storage never: ``kill`` (the death) fails them."""

    def __init__(self, log: ProgressLog, holds: tuple[str, ...] = ("start",)) -> None:
        """``holds``: the kinds of record whose write is held (a grant's ``start``; with shards a ``cut`` too: rank 0
        dies after the shards saved what the record saves, before the record is stored)."""
        self.log = log
        self.holds = holds
        self.held: set[str] = set()  # the kinds of record of the first write held
        self.armed = False
        self.holding = threading.Event()  # a write is held: a grant's reply left before its record was stored
        self._killed = threading.Event()

    def append(self, records: list[dict[str, Any]], shared: Any = None, blocks: Any = None) -> bool:
        if self.armed and (self.holding.is_set() or any(record.get("e") in self.holds for record in records)):
            if not self.holding.is_set():
                self.held = {str(record.get("e")) for record in records}
            self.holding.set()
            if "cut" not in self.held:  # a grant answered early: rank 0 dies while its record waits
                self._killed.wait()
            raise OSError("rank 0 died before this write")  # (a cut's: its request, waiting for it, is refused)
        return self.log.append(records, shared=shared, blocks=blocks)

    def kill(self) -> None:
        self._killed.set()

    def __getattr__(self, name: str) -> Any:  # the rest of ``ProgressLog`` (compact, start, vector_files)
        return getattr(self.log, name)


def quiet(server: LockServer) -> None:
    """Wait until the records of every request decided so far are stored."""
    deadline = time.monotonic() + 60
    while not server.stored():
        assert time.monotonic() < deadline, "records decided a minute ago are still not stored"
        time.sleep(0.001)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("crash_after", [0, 1, 2, 5, 9, 14, 20, 27, 35])
def test_each_buckets_shared_update_reaches_the_pass_exactly_once_across_a_restart(tmp_path: Path, store: TCPStore,
                                                                                  ranks: list[TensorTransport],
                                                                                  crash_after: int,
                                                                                  sparse: bool) -> None:
    """Two ranks take buckets until the group dies after ``crash_after`` requests (each rank with a bucket in
    flight whose update never left it); the restarted server resumes from storage and one rank finishes the
    pass: every bucket's shared update is in the result once, none lost, none twice. ``sparse``: each change
    carries its bucket's row alone (issue #45)."""
    checkpoint = str(tmp_path)
    server = serve(store, checkpoint, None, "first/lock", ranks[0], sparse)
    trainers = [Trainer(LockClient(store, rank, timeout_s=60, prefix="first/lock", transport=ranks[rank]), 4,
                        sparse=sparse) for rank in (0, 1)]
    try:
        for step in range(crash_after):
            trainers[step % 2].step(server.state)
    finally:
        server.stop()  # the group dies: what is in memory is gone
    progress = read_progress(checkpoint, 0, "run")
    assert progress is not None and progress.shared is not None
    # the stored vector holds the buckets the restart keeps as done (done, and their partitions written), only
    resumed = LockState(4, 4, partition_keys(4))
    resumed.restore(progress.state)
    for record in progress.records:
        resumed.apply(record)
    resumed.forget_rank_locks()
    assert sorted(np.flatnonzero(progress.shared).tolist()) == sorted(b.lhs * 4 + b.rhs for b in resumed.done)
    server = serve(store, checkpoint, progress, "second/lock", ranks[0], sparse)
    survivor = Trainer(LockClient(store, 0, timeout_s=60, prefix="second/lock", transport=ranks[0]), 4, sparse=sparse)
    try:
        while survivor.step(server.state) != "done":
            pass
        assert server.state.finished()
        assert server.shared.tolist() == [1.0] * 16
    finally:
        server.stop()


# partition rows across a restart: a redone bucket starts from rows without its own updates --------------------------


class RowTrainer:
    """A rank as ``LockServerScheduler`` drives it, over a real ``PartitionStore`` (its partitions read from and
    written into real checkpoint files): training bucket (l, r) adds 1 to column ``4 * l + r`` of every row of each
    of its partitions (``("node", l)`` and ``("node", r)``), and its shared update (1 in the same slot) goes with
    the request that finishes it. At a bucket switch that lets partitions go, the rank writes them and the ones it
    keeps as one write group, as ``_switch_to`` and ``_commit_group`` do (job/checkpoint/write_groups.py): each under its
    staged name, one ``written`` request naming the group, each moved to its PBG name, then one ``release`` freeing
    the leaving ones; a partition is read from the uncommitted version when the server says it was written this
    pass (``set_written``). ``actions`` yields after every request, every file written and every file moved, so
    that the group can die between any two of them. ``behind`` (``write_behind_buckets``, with a hand-off end): the
    partitions leaving are released unwritten, their rows kept, and files are written only at cuts
    (``behind_cut``, as tests/test_write_behind.py drives it)."""

    def __init__(self, client: LockClient, partitions: PartitionStore, handoff: Optional[PartitionHandoff] = None,
                 behind: bool = False, shards: Optional[ShardedRows] = None) -> None:
        """``shards``: the bucket's slot is a relation row, pushed to the shard of its owner (acknowledged: a point
        of death) before the ``next`` that carries rank 0's part (``shared_shards``, shard_routing.py)."""
        self.client = client
        self.shards = shards
        self.pushed = False  # the last action was a push to a shard, its ``next`` not sent
        self.partitions = partitions
        self.current: Any = None
        self.handoff = handoff  # partition_handoff: leaving rows kept, granted ones taken from their holder
        partitions.peers = handoff
        self.behind = behind
        self.cut_memo: dict[str, Any] = {}  # a cut taken in the background: what this rank staged, to move later
        if behind:
            assert handoff is not None
            handoff.strict = True

    def actions(self, state: LockState) -> Iterator[None]:
        while True:
            delta, rows = None, None
            if self.current is not None and self.shards is not None:
                delta, mine = self.shards.push(self.current, torch.ones(1),
                                               np.array([self.current.lhs * 4 + self.current.rhs]))
                rows = mine.tolist()
                self.pushed = True
                yield
                self.pushed = False
            elif self.current is not None:
                delta = torch.zeros(16)
                delta[self.current.lhs * 4 + self.current.rhs] = 1.0
            held = set(self.partitions.loaded)
            kind, bucket, dirty, _ = self.client.finish_and_next(held, self.current, None, delta, rows=rows)
            self.partitions.set_written(dirty)
            if self.handoff is not None and bucket is not None:
                self.handoff.hint(state.bucket_keys[bucket] - held, self.client.last_holders)
            yield
            self.current = bucket
            keep = set(state.bucket_keys[bucket]) if bucket is not None else set()
            if self.behind:
                if kind == "cut":
                    yield from behind_cut(self.client, self.partitions, self.handoff, self.cut_memo)
                    continue
                yield from self.release_behind(keep)
                if kind == "done":
                    return
                self.train(bucket)
                continue
            group = self.partitions.take_group(keep, copy_kept=False)
            if group is not None:
                for key in group.keys:
                    self.partitions.stage(group, [key])
                    yield
                self.client.written(group.keys, group.staged(self.partitions.checkpoint))  # with sizes, CRC-32s
                yield
                for key in group.keys:
                    self.partitions.publish(group, [key])
                    yield
                kept = [(key[0], key[1], self.handoff.keep(key, group.tables[key].weight, group.tables[key].optim_sum, 0))
                        for key in group.leaving] if self.handoff is not None else []
                self.client.release(group.leaving, written=False, kept=kept)
                yield
            if kind == "done":
                return
            self.train(bucket)

    def train(self, bucket: Any) -> None:
        """The bucket's update, once, in each of its partitions."""
        if bucket is not None:
            for key in sorted({("node", bucket.lhs), ("node", bucket.rhs)}):
                self.partitions.get(key).weight[:, bucket.lhs * 4 + bucket.rhs] += 1.0

    def release_behind(self, keep: set) -> Iterator[None]:
        """Writes behind: the partitions not in ``keep`` leave unwritten, their rows kept for the next holder."""
        assert self.handoff is not None
        leaving = sorted(set(self.partitions.loaded) - keep)
        if leaving:
            tables = {key: self.partitions.loaded.pop(key) for key in leaving}
            kept = [(key[0], key[1], self.handoff.keep(key, tables[key].weight, tables[key].optim_sum, 0))
                    for key in leaving]
            self.client.release(leaving, written=False, kept=kept)
            yield


def behind_cut(client: LockClient, partitions: PartitionStore, handoff: Optional[PartitionHandoff],
               memo: Optional[dict[str, Any]] = None) -> Iterator[None]:
    """A rank's turn in a cut (job/train/distributed/cuts.py), yielding after every request, staged file and move:
    ask until told its keys, stage each (from its store if it holds the partition, else from the rows it keeps),
    report them, wait for the record, move them, report that, wait for the others. In a cut taken in the background
    (job/train/distributed/cut_behind.py) the report may be answered ``go`` (not recorded yet: the rank trains on,
    its staged group and kept rows' marks in ``memo``) and a later turn starts with its ``move``."""
    assert handoff is not None
    memo = {} if memo is None else memo
    step = client.cut()
    yield
    while step.step == "wait":
        step = client.cut()
        yield
    if step.step == "move" and memo.get("group") is not None:  # recorded since this rank staged
        group, marks = memo.pop("group"), memo.pop("marks")
    else:
        assert step.step == "stage", step
        at_turn = handoff.pinned_marks()
        marks = at_turn if step.behind else None
        tables = {}
        for key in step.keys:
            table = partitions.loaded.get(key)
            if table is None:
                rows = handoff.kept_rows(key)
                assert rows is not None, key
                table = SimpleNamespace(weight=rows.weight, optim_sum=rows.optim_sum)
            tables[key] = table
        group = WriteGroup.of(partitions.next_version, [], tables)
        for key in group.keys:
            partitions.stage(group, [key])
            yield
        partitions.checkpoint.flush()
        step = client.cut(staged=group.staged(partitions.checkpoint))
        yield
        while step.step == "wait":
            step = client.cut()
            yield
        if step.step == "go":  # a turn in a cut in the background (the group may be stopping meanwhile)
            memo["group"], memo["marks"] = group, at_turn
            return
    assert step.step == "move", step
    assert not step.keys or sorted(step.keys) == sorted(group.keys), (step.keys, group.keys)
    for key in group.keys:
        partitions.publish(group, [key])
        yield
    step = client.cut(moved=True)
    yield
    while step.step == "wait":
        step = client.cut()
        yield
    assert step.step == "go", step
    if marks is None:
        handoff.unpin()
    else:
        handoff.unpin_unchanged(marks)


def row_store(checkpoint_url: str, store: Any = None, round_id: str = "") -> PartitionStore:
    """A trainer's partition store over the checkpoint at ``checkpoint_url`` (4 partitions of 3 rows, 16 columns: one
    per bucket), committed version 0 (nothing stored: the partitions start from their seeded initialisation), its
    files' checksums shared through ``store`` with the other ranks of the round ``round_id``, as a group's are."""
    config = parse_config({"entities": {"node": {"num_partitions": 4}},
                           "relations": [{"name": "r", "lhs": "node", "rhs": "node"}], "dimension": 16,
                           "entity_path": "unused-entities", "edge_paths": ["unused-edges"],
                           "checkpoint_path": checkpoint_url, "device": "cpu", "seed": 3})
    checkpoint = CheckpointStorage(config.checkpoint_path)
    if store is not None:
        checkpoint.sums = SharedSumRegistry(store, round_id)
    return PartitionStore(config, checkpoint, 0, {"node": [3] * 4}, lambda: {}, torch.device("cpu"))


def staged_left(checkpoint_url: str) -> list[str]:
    return [name for name in storage.listdir(checkpoint_url) if name.startswith(STAGED_PREFIX)]


def handoffs(store: TCPStore, round_id: str, on: bool) -> list[Optional[PartitionHandoff]]:
    """Ranks 0 and 1's ends of partition_handoff in the round ``round_id`` (listening on 127.0.0.1), or none."""
    if not on:
        return [None, None]
    ends = [PartitionHandoff(rank=rank, round_id=round_id, store=store, key=lambda name: f"{round_id}/{name}", limit=2)
            for rank in (0, 1)]
    for end in ends:
        end.start()
    return list(ends)


def shard_round(store: TCPStore, round_id: str) -> tuple[ShardService, list[ShardedRows], Callable, list[ShardClient]]:
    """``shared_shards`` in a round of ranks 0 and 1, the 16 values of the vector 16 relation rows (``serve``'s sparse
    layout): rank 1's shard (the odd rows, starting from zeros as the server's vector does), each rank's routing,
    rank 0's committer's saver, and every client (to close with the round)."""
    layout = RowLayout.of(16, 16, [(0, 1)])
    slice_ = ShardSlice(rank=1, world_size=2, layout=layout)
    slice_.load("0", np.zeros(8, np.float32))
    service = ShardService(slice_, round_id=round_id, store=store, key=lambda name: f"{round_id}/{name}")
    service.start()
    clients = [ShardClient(rank=rank, world_size=2, round_id=round_id, store=store,
                           key=lambda name: f"{round_id}/{name}", limit=1 << 12) for rank in (0, 1, 0)]
    routing = [ShardedRows(client, layout, 2) for client in clients[:2]]
    for rows in routing:
        rows.pass_tag = "0"
    return service, routing, lambda buckets: clients[2].save("0", buckets), clients


def kill_at_every_step(checkpoint_of: Callable[[int], str], store: TCPStore, ranks: list[TensorTransport],
                       handoff: bool = False, behind: int = 0, withhold: bool = False, shards: bool = False) -> int:
    """Two ranks train buckets on partition rows kept in real files until the group dies after every number of
    actions of the protocol (requests, each partition file staged and each one moved to its PBG name), ``crash_after``
    0, 1, 2, ... until a pass completes, each in the checkpoint ``checkpoint_of(crash_after)``. The restarted group
    finishes the publication of the groups its progress recorded (``roll_forward``, as rank 0 does when it resumes
    the pass; first one file by hand, as a roll-forward killed after its first move leaves it) and one rank
    finishes the pass. Then each bucket's update must be in the rows of each of its partitions as the pass commits
    them exactly once (and in no other partition), as its shared update is in the vector, and no staged file left.
    ``handoff``: the ranks keep the rows they publish and take granted ones from their holder (partition_handoff);
    then some partitions must have changed hands through memory. ``behind``: ``write_behind_buckets`` (with
    ``handoff``): partitions released unwritten and stored only at cuts, the restart redoing every bucket since the
    last cut; with ``behind`` > 0 the cuts are taken in the background, so some points of death fall while buckets
    started after a cut began are trained and that cut is not yet over. ``withhold``: where the last action before
    the death is a grant, rank 0 dies after its reply left but before its record (and any record after it) is stored
    (``Withholding``); such points must occur. ``shards``: each bucket's update is its slot's relation row, the odd
    rows served by rank 1's shard (``shard_round``): it goes there before the ``next`` that finishes the bucket, and
    some points of death must fall between the two; with ``withhold``, where the last action is the request that
    records a cut, rank 0 dies after the shards saved and before the record is stored, and such points must occur
    (the round after the death is rank 0 alone: no shards). Returns the number of points of death."""
    expected = np.zeros((4, 16))
    for bucket, keys in partition_keys(4).items():
        for _, part in keys:
            expected[part, bucket.lhs * 4 + bucket.rhs] = 1.0
    initial = row_store(checkpoint_of(-1))
    start = np.stack([initial.get(("node", part)).weight.numpy().copy() for part in range(4)])
    crash_after, complete, moved, during_cuts, early, after_push, saved_unrecorded = 0, False, 0, 0, 0, 0, 0
    while not complete:
        checkpoint = checkpoint_of(crash_after)  # the progress beside the partition files, as in a run
        sharded = shard_round(store, f"{crash_after}/first") if shards else None
        server = serve(store, checkpoint, None, f"{crash_after}/first/lock", ranks[0], write_behind=behind,
                       log_of=lambda log: Withholding(log, ("start", "cut") if shards else ("start",)), sparse=shards,
                       shard_save=sharded[2] if sharded else None)
        withheld = server.progress
        ends = handoffs(store, f"{crash_after}/first", handoff)
        trainers = [RowTrainer(LockClient(store, rank, timeout_s=60, prefix=f"{crash_after}/first/lock",
                                          transport=ranks[rank]), row_store(checkpoint, store, f"{crash_after}/first"),
                               ends[rank], behind=bool(behind), shards=sharded[1][rank] if sharded else None)
                    for rank in (0, 1)]
        running = [trainer.actions(server.state) for trainer in trainers]
        saves_before = 0
        try:
            done = 0
            while done < crash_after and running:
                if withhold and done == crash_after - 1:  # the last action: a grant's record is never stored
                    quiet(server)
                    withheld.armed = True
                    saves_before = sharded[0].shard.stats.saves if sharded is not None else 0
                rank = done % len(running)
                try:
                    if next(running[rank], "over") == "over":
                        running.pop(rank)
                except LockServerError:
                    if "cut" not in withheld.held:
                        raise
                    break  # rank 0 died after the shards saved what the cut's record saves, before it was stored
                done += 1
                cut = server.cuts.behind if server.cuts is not None else None
                if cut is not None and set(server.state.in_flight.values()) - cut.buckets:
                    during_cuts += 1  # a bucket started after a cut taken in the background began, before it ended
            complete = not running
            after_push += any(trainer.pushed for trainer in trainers)
        finally:
            early += withheld.holding.is_set()
            saved_unrecorded += "cut" in withheld.held and sharded is not None and \
                sharded[0].shard.stats.saves > saves_before  # the shard saved what the record never stored saves
            withheld.kill()
            server.stop()  # the group dies: what is in memory is gone (rows and shared values alike)
            if sharded is not None:
                sharded[0].close()
                for client in sharded[3]:
                    client.close()
            for end in ends:
                if end is not None:
                    moved += end.stats.handed_in + end.stats.kept_hits
                    end.close()
        progress = read_progress(checkpoint, 0, "run")
        assert progress is not None
        recorded = progress.staged()
        if recorded:  # a roll-forward killed after its first move
            publish(CheckpointStorage(checkpoint), 1, (recorded[0][0], recorded[0][1]), recorded[0][2])
        roll_forward(checkpoint, progress.version, progress.staged())  # job/checkpoint/recovery.py: recover_pass
        assert not staged_left(checkpoint)
        server = serve(store, checkpoint, progress, f"{crash_after}/second/lock", ranks[0], write_behind=behind,
                       lost=frozenset({1}), sparse=shards)
        second_ends = handoffs(store, f"{crash_after}/second", bool(behind))
        survivor = RowTrainer(LockClient(store, 0, timeout_s=60, prefix=f"{crash_after}/second/lock",
                                         transport=ranks[0]), row_store(checkpoint, store, f"{crash_after}/second"),
                              second_ends[0], behind=bool(behind))
        try:
            for _ in survivor.actions(server.state):
                pass
            assert server.state.finished()
            assert server.shared.tolist() == [1.0] * 16, crash_after
            reader = row_store(checkpoint, store, f"{crash_after}/second")  # the pass's rows as its commit takes them
            reader.set_written(server.state.dirty)
            assert reader.written == {("node", part) for part in range(4)}
            rows = np.stack([reader.get(("node", part)).weight.numpy() for part in range(4)])
            assert not staged_left(checkpoint)
        finally:
            server.stop()
            for end in second_ends:
                if end is not None:
                    end.close()
        # per partition and bucket: how many times the bucket's update reached the committed rows (once, in each row)
        counts = np.rint(rows - start)
        assert (counts == expected[:, None, :]).all(), (crash_after, [
            (part, divmod(column, 4), counts[part, 0, column]) for part, column in zip(*(counts[:, 0] - expected).nonzero())])
        crash_after += 1
    assert (moved > 0) == handoff, moved
    assert (during_cuts > 0) == (behind > 0), during_cuts  # training went on through the cuts (every point of them)
    assert (early > 0) == withhold, early
    assert (after_push > 0) == shards, after_push  # killed with a bucket's update on its shard, its ``next`` unsent
    assert (saved_unrecorded > 0) == (shards and withhold), saved_unrecorded
    return crash_after


def test_each_buckets_partition_updates_reach_the_pass_exactly_once_across_a_restart(
        tmp_path: Path, store: TCPStore, ranks: list[TensorTransport]) -> None:
    """A done bucket whose partitions were only partly written back when the group died is redone from rows that do
    not hold its update yet, whatever step of the protocol the group died at (``kill_at_every_step``); where that
    step was a grant, rank 0 died after its reply left and before its record was stored (``withhold``): the grant
    is forgotten and the bucket it finished redone, nothing counted twice or lost."""
    points = kill_at_every_step(lambda crash_after: str(tmp_path / str(crash_after) / "checkpoint"), store, ranks,
                                withhold=True)
    assert points > 60  # every step of a whole pass was a point of death (45 before write groups)


@pytest.mark.slow  # as long as the test above (~60 s here): CI's fast tier has no room for both
def test_with_partitions_handed_pod_to_pod_each_buckets_update_still_reaches_the_pass_exactly_once(
        tmp_path: Path, store: TCPStore, ranks: list[TensorTransport]) -> None:
    """partition_handoff (job/train/distributed/handoff.py): the rows a rank publishes stay in its memory and the next
    holder takes them from there (over TCP, or from its own memory) instead of the file; killed after every step, the
    same exactly-once holds (a restart's new processes hold nothing: every partition is then read from storage)."""
    points = kill_at_every_step(lambda crash_after: str(tmp_path / str(crash_after) / "checkpoint"), store, ranks,
                                handoff=True)
    assert points > 60


@pytest.mark.slow  # ~60 s, as the tests above
def test_written_behind_a_grant_answered_before_its_record_is_stored_counts_nothing_twice_across_rank_0s_death(
        tmp_path: Path, store: TCPStore, ranks: list[TensorTransport]) -> None:
    """Partitions handed pod to pod unwritten and stored at a cut every 3 buckets (tests/test_write_behind.py), rank
    0 dying after a grant's reply left and before its record was stored at every point where the last step was a
    grant: each bucket's update still reaches the committed rows once and the vector once."""
    points = kill_at_every_step(lambda crash_after: str(tmp_path / str(crash_after) / "checkpoint"), store, ranks,
                                handoff=True, behind=3, withhold=True)
    assert points > 40


@pytest.mark.slow
def test_each_buckets_partition_updates_reach_the_pass_exactly_once_across_a_restart_on_s3(
        s3_bucket: str, store: TCPStore, ranks: list[TensorTransport]) -> None:
    """The same on S3 (moto): staged files uploaded, moved by a copy and a removal."""
    points = kill_at_every_step(lambda crash_after: f"{s3_bucket}/{crash_after}/checkpoint", store, ranks)
    assert points > 60


def test_the_commit_after_a_restart_reads_no_partition_back_and_a_corrupted_one_is_still_caught(
        tmp_path: Path, store: TCPStore, ranks: list[TensorTransport], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each write group's record carries its files' size and CRC-32, so the round after a restart knows every
    partition file the earlier round made current (``known_sums``) and the commit's manifest reads none of them back
    (counted through the real storage layer); a file changed after its write is still caught, by the next read
    against the manifest. Without the records' sums the same manifest reads every partition back."""
    from job.checkpoint.write_groups import known_sums
    from job.errors import InputFormatError

    checkpoint = str(tmp_path / "checkpoint")
    server = serve(store, checkpoint, None, "first/lock", ranks[0])
    trainers = [RowTrainer(LockClient(store, rank, timeout_s=60, prefix="first/lock", transport=ranks[rank]),
                           row_store(checkpoint, store, "first")) for rank in (0, 1)]
    running = [trainer.actions(server.state) for trainer in trainers]
    try:
        for step in range(40):  # the group dies part-way through the pass, groups of both ranks recorded
            next(running[step % 2])
    finally:
        server.stop()
    progress = read_progress(checkpoint, 0, "run")
    assert progress is not None and all(len(entry) == 5 for entry in progress.staged())
    roll_forward(checkpoint, progress.version, progress.staged())
    survivor = row_store(checkpoint, store, "second")
    earlier = {(str(t), int(p)) for t, p, *_ in progress.staged()}
    assert known_sums(survivor.checkpoint, 1, progress.staged()) == len(earlier) >= 2
    reads: list[str] = []
    real_read = storage.local_copy_for_reading

    def counted(url: str) -> Any:
        reads.append(url)
        return real_read(url)

    monkeypatch.setattr(storage, "local_copy_for_reading", counted)
    # the commit's manifest, as the new round's rank 0 builds it (here of the files the earlier round made current)
    survivor.checkpoint.save_version(1)
    assert reads == []
    manifest = survivor.checkpoint.manifest(1)
    assert manifest is not None and set(manifest.files) == {Path(survivor.checkpoint.partition_file(1, *key)).name
                                                           for key in earlier}
    for name, entry in manifest.files.items():  # what the records said is what the files hold
        assert checksum_file(str(Path(checkpoint) / name)) == entry
    # the same commit in a round that was not told the records' sums reads every partition back
    unknowing = CheckpointStorage(checkpoint)
    unknowing.save_version(1)
    assert len(reads) == len(earlier)
    # a partition corrupted after its write: its next read (against the manifest) refuses it
    monkeypatch.setattr(storage, "local_copy_for_reading", real_read)
    victim = Path(checkpoint) / sorted(manifest.files)[0]
    data = bytearray(victim.read_bytes())
    data[-8] ^= 0xFF
    victim.write_bytes(bytes(data))
    reader = CheckpointStorage(checkpoint)
    key = next(k for k in [("node", p) for p in range(4)] if reader.partition_file(1, *k).endswith(victim.name))
    with pytest.raises(InputFormatError, match="checksum|size"):
        reader.load_entity_partition(1, *key)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_restart_finishes_the_publication_of_recorded_groups_and_drops_unrecorded_ones(
        where: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """``roll_forward`` moves each staged file a record names that is still there (one not yet moved, one whose move
    a kill cut between its copy and its removal on S3) and none already moved, removes the staged files no record
    names (written, never made current), and does nothing more when run again (a kill during it is harmless)."""
    url = str(tmp_path / "checkpoint") if where == "local" else f"{request.getfixturevalue('s3_bucket')}/checkpoint"
    checkpoint = CheckpointStorage(url)
    names = {part: staged_name(("node", part), 1, f"t{part}") for part in range(4)}
    for part, name in names.items():
        checkpoint.save_entity_partition(1, "node", part, np.full((3, 2), float(part)), name=name)
    checkpoint.flush()
    assert publish(checkpoint, 1, ("node", 1), names[1])  # moved before the kill
    storage.copy(storage.join(url, names[2]), checkpoint.partition_file(1, "node", 2))  # copied, not removed
    recorded = [["node", p, names[p]] for p in range(3)]  # part 3: staged, never recorded
    for attempt in range(2):
        assert roll_forward(url, 1, recorded) == (2 if attempt == 0 else 0)
        assert not staged_left(url)
        for part in range(3):
            weights, _ = checkpoint.load_entity_partition(1, "node", part)
            assert (weights == float(part)).all()
        assert not checkpoint.has_entity_partition(1, "node", 3)


# the shared parameters' transport: point-to-point over gloo, never through the store --------------------------------


class RecordingStore:
    """The real TCPStore, recording the size of every value written into it (clones record into the same list)."""

    def __init__(self, store: Any, written: list[tuple[str, int]]) -> None:
        self._store = store
        self.written = written

    def clone(self) -> RecordingStore:
        return RecordingStore(self._store.clone(), self.written)

    def set_timeout(self, timeout: timedelta) -> None:
        self._store.set_timeout(timeout)

    def queue_push(self, key: str, value: bytes) -> None:
        self.written.append((key, len(value)))
        self._store.queue_push(key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return self._store.queue_pop(key, block=block)

    def set(self, key: str, value: Any) -> None:
        self.written.append((key, len(value)))
        self._store.set(key, value)


def test_the_shared_parameters_never_pass_through_the_store(tmp_path: Path, store: TCPStore,
                                                            ranks: list[TensorTransport]) -> None:
    """A pass of two ranks whose buckets each change their own block of a 64 KiB shared vector: every store value
    stays far smaller than one block (requests and replies only), each sum comes back into the buffer its change
    left from, and the pass ends with each bucket's change in the vector once."""
    written: list[tuple[str, int]] = []
    recording = RecordingStore(store, written)
    block = 1024  # values per bucket: 4 KiB, a 64 KiB vector
    state = LockState(4, 4, partition_keys(4), world_size=2, version=1)
    log = ProgressLog(str(tmp_path), "run", 1)
    log.start(state.to_json(), np.zeros(16 * block, np.float32))
    server = LockServer(recording, state, log, np.zeros(16 * block, np.float32), 0, ranks[0], prefix=PREFIX)
    trainers = [Trainer(LockClient(recording, rank, timeout_s=60, prefix=PREFIX, transport=ranks[rank]), 4, block)
                for rank in (0, 1)]
    try:
        steps = 0
        while not (state.finished() and all(t.current is None for t in trainers)):
            trainers[steps % 2].step(state)
            steps += 1
            assert steps < 200, state.to_json()
        assert server.values().tolist() == [1.0] * (16 * block)
        sums = [total.sum().item() for trainer in trainers for total in trainer.sums]
        assert sorted(sums) == [block * n for n in range(1, 17)]  # each bucket's sum seen by the rank finishing it
    finally:
        server.stop()
    assert written and max(size for _, size in written) < block, sorted(written, key=lambda w: -w[1])[:3]


def test_a_rank_that_announces_a_change_and_never_sends_it_is_refused_after_the_timeout(
        store: TCPStore, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1 announces a change and stops before sending it (as a rank stopped or killed midway would): after the
    transport's timeout its request is answered with the transfer's error, and the server serves rank 0 on
    (tests/test_lock_server_peers.py: the other ranks are served meanwhile, and a sum never taken)."""
    ranks = transports(store, 2, timeout_s=2.0)
    server = LockServer(store, LockState(4, 4, partition_keys(4), world_size=2), SimpleNamespace(append=lambda r: None),
                        np.zeros(3, np.float32), 0, ranks[0], prefix=PREFIX)
    rank0 = LockClient(store, 0, timeout_s=60, prefix=PREFIX, transport=ranks[0])
    stalled = LockClient(store, 1, timeout_s=60, prefix=PREFIX)  # reads its replies; its transfers are done by hand
    try:
        store.queue_push(f"{PREFIX}/requests", seal({"op": "sync", "rank": 1, "channel": "", "values": 3, "tag": 7,
                                                     "seq": 1}, PREFIX))
        reply = json.loads(stalled.store.queue_pop(stalled.responses, block=True))
        assert not reply["ok"] and "TransferError" in reply["error"] and "payload 7 from rank 1" in reply["error"]
        assert rank0.sync(torch.zeros(3)).tolist() == [0.0, 0.0, 0.0]
        assert "treated as gone" in caplog.text
    finally:
        server.stop()


# a group of real processes: init_distributed forms the transport, ranks finish buckets at their own pace
GROUP_SCRIPT = """
import json, sys, time
import numpy as np, torch
from job.train.distributed.lock_client import LockClient
from job.train.distributed.handoff import PartitionHandoff
from job.train.distributed.lock_server import LockServer
from job.train.distributed.shared_params import SharedParameters
from job.train.distributed.group import init_distributed, leave, wait_all
from job.train.distributed.lock_state import LockState
from job.checkpoint.group_progress import ProgressLog
from helpers_distributed import partition_keys
from test_lock_protocol import RecordingStore

ctx = init_distributed("digest")
written = []
store = RecordingStore(ctx.store, written)
block = 1024
state = LockState(4, 4, partition_keys(4), world_size=ctx.world_size, version=1)
if ctx.rank == 0:
    log = ProgressLog(sys.argv[1], ctx.run_id, 1)
    log.start(state.to_json(), np.zeros(16 * block, np.float32))
    server = LockServer(store, state, log, np.zeros(16 * block, np.float32), 0, ctx.transport, prefix=ctx.key("lock"))
wait_all(ctx, "server-up")
# this rank's copy of the shared parameters, changed by every bucket it trains (its block + 1), synced as a trainer does
weights = torch.zeros(16 * block)
shared = SharedParameters([weights])
client = LockClient(store, ctx.rank, timeout_s=60, prefix=ctx.key("lock"), transport=ctx.transport)
current, held, trained = None, set(), []
while True:
    kind, bucket, _, total = client.finish_and_next(held, current, None, shared.change() if current else None)
    if total is not None:
        shared.assign(total)
    current = bucket
    keep = set(state.bucket_keys[bucket]) if bucket is not None else set()
    if held - keep:  # written back: others may take them
        client.release(sorted(held - keep))
    held = keep
    if kind == "done":
        break
    if bucket is None:
        time.sleep(0.02)
        continue
    slot = bucket.lhs * 4 + bucket.rhs
    weights[slot * block:(slot + 1) * block] += 1.0
    trained.append(slot)
    time.sleep(0.01 * (ctx.rank + 1))  # ranks at their own pace: bucket boundaries at different times
wait_all(ctx, "pass-done")
shared.sync(client)  # the pass's end: everyone's changes
wait_all(ctx, "synced")  # every rank answered before rank 0 stops its server
result = {"rank": ctx.rank, "trained": trained, "max_store_value": max(size for _, size in written),
          "values": sorted(set(weights.tolist()))}
if ctx.rank == 0:
    result["server"] = sorted(set(server.values().tolist()))
    server.stop()
wait_all(ctx, "checked")
print(json.dumps(result))
leave(ctx)
"""


def test_a_group_of_processes_sums_every_buckets_shared_change_once_over_the_transport(tmp_path: Path) -> None:
    """Three real processes joined by ``init_distributed`` (which forms the gloo transport): each trains the buckets
    the server gives it at its own pace and adds 1 to its bucket's block of the shared vector. After the pass every
    rank holds the sum with each bucket once, and no rank ever wrote a value the size of a block into the store."""
    import os
    import subprocess
    import sys

    from helpers_distributed import free_port

    port = free_port()
    tests = str(Path(__file__).parent)
    procs = []
    for rank in range(3):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="3",
                   OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
        env.pop("BIGGRAPH_RUN_ID", None)
        procs.append(subprocess.Popen([sys.executable, "-c", GROUP_SCRIPT, str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    trained = [slot for r in results for slot in r["trained"]]
    assert sorted(trained) == list(range(16))  # every bucket once
    assert all(r["values"] == [1.0] for r in results)  # every rank: each bucket's change once, none lost
    assert results[0]["server"] == [1.0]
    assert max(r["max_store_value"] for r in results) < 1024  # requests only: a block is 4 KiB


def test_adagrad_sums_are_shared_so_every_trainer_steps_with_the_groups_sums(store: TCPStore,
                                                                              ranks: list[TensorTransport]) -> None:
    """Each rank steps a relation parameter (dense Adagrad) and a table's rows (row-wise sums) with its own
    gradient and syncs: both then hold the group's sums (each rank's squared gradients added), and rank 1's next
    step is scaled by those sums, as two Hogwild workers of one process would be, not by its own alone."""
    from job.model.scoring import Table
    from job.train.batch.optim import RelationAdagrad
    from job.train.distributed.shared_params import SharedParameters, shared_state

    def trainer(gradient: float) -> tuple[torch.Tensor, RelationAdagrad, Table, SharedParameters]:
        parameter = torch.zeros(2, requires_grad=True)
        optimizer = RelationAdagrad([parameter], lr=1.0)
        table = Table(weight=torch.zeros(3, 2), optim_sum=torch.zeros(3))
        shared = SharedParameters(shared_state([parameter], optimizer.sums, [table]))
        parameter.grad = torch.full((2,), gradient)
        optimizer.step()
        table.optim_sum.add_(gradient ** 2)
        return parameter, optimizer, table, shared

    zeros = shared_state([torch.zeros(2)], [torch.zeros(2)], [Table(torch.zeros(3, 2), torch.zeros(3))])
    start = SharedParameters(zeros).flatten()
    assert start.size == 2 + 2 + 6 + 3
    server = LockServer(store, LockState(4, 4, partition_keys(4), world_size=2), SimpleNamespace(append=lambda r: None),
                        start, 0, ranks[0], prefix=PREFIX)
    try:
        ranks_state = [trainer(gradient) for gradient in (3.0, 4.0)]
        clients = [LockClient(store, rank, timeout_s=60, prefix=PREFIX, transport=ranks[rank]) for rank in (0, 1)]
        for rank in (0, 1, 0):  # rank 0 again: to take rank 1's change
            ranks_state[rank][3].sync(clients[rank])
        for parameter, optimizer, table, _ in ranks_state:
            assert optimizer.sums[0].tolist() == [25.0, 25.0]  # 3^2 + 4^2
            assert table.optim_sum.tolist() == [25.0] * 3
            assert parameter.detach().tolist() == pytest.approx([-2.0, -2.0])  # -3/3 and -4/4, summed
        parameter, optimizer, _, _ = ranks_state[1]
        parameter.grad = torch.full((2,), 12.0)
        optimizer.step()
        assert parameter.detach().tolist() == pytest.approx([-2.0 - 12.0 / 13.0] * 2)  # sqrt(25 + 144) = 13
    finally:
        server.stop()


def test_unsaved_updates_beyond_the_memory_bound_wait_on_disk_and_are_stored_once() -> None:
    """Rank 0 keeps at most ``in_memory`` updates of buckets done but unsaved (``memory_budget`` counts them): the
    others go to temporary files, and each reaches the stored vector once, when its bucket is saved."""
    from job.train.distributed.shared_vector import SharedVector
    from job.types import Bucket

    vector = SharedVector(np.zeros(4, np.float32), in_memory=1)
    buckets = [Bucket(0, 0), Bucket(0, 1), Bucket(1, 0)]
    for i, bucket in enumerate(buckets):
        change = np.zeros(4, np.float32)
        change[i] = i + 1.0
        vector.add(change)
        assert not vector.finish(bucket, change, saved=False)
    assert vector.pending_in_memory == 1 and vector.spilled == 2
    assert vector.save({Bucket(0, 0)})  # the other two saved: one of them from its file
    assert vector.stored.tolist() == [0.0, 2.0, 3.0, 0.0]
    assert vector.save(set()) and vector.stored.tolist() == vector.served.tolist() == [1.0, 2.0, 3.0, 0.0]
    assert not vector.pending and not vector.save(set())
    # a change of a few values (a bucket's relations) is kept as those values
    sparse = SharedVector(np.zeros(64 * 9 + 3, np.float32), in_memory=1)
    change = np.zeros(64 * 9 + 3, np.float32)
    change[[5, 64 * 9 + 1]] = 2.0
    sparse.add(change)
    assert not sparse.finish(Bucket(0, 0), change, saved=False)
    # one block of 64 values and its index, and the 3 values after the last whole block
    assert sparse.pending_in_memory == 0 and sparse.held_bytes == 8 + 4 * 64 + 4 * 3 and sparse.spilled == 0
    assert sparse.save(set()) and sparse.stored.tolist() == sparse.served.tolist() and sparse.held_bytes == 0


def test_a_progress_writes_the_changed_blocks_of_the_shared_vector_and_a_restart_replays_them(tmp_path: Path) -> None:
    """After the whole vector, a write that saved buckets carries only the blocks of the stored vector that changed
    (their values, so replaying them is exact); a compaction writes it whole again and drops them; a torn block
    file refuses the progress instead of resuming a wrong vector."""
    from job.train.distributed.shared_vector import SharedVector
    from job.types import Bucket

    checkpoint = str(tmp_path)
    vector = SharedVector(np.zeros(64 * 50 + 7, np.float32))
    log = ProgressLog(checkpoint, "run", 1, compact_every=3)
    log.start(LockState(2, 2, partition_keys(2)).to_json(), vector.stored)
    rng = np.random.default_rng(0)
    for step in range(4):
        change = np.zeros(vector.size, np.float32)
        change[rng.choice(vector.size, 5, replace=False)] = rng.random(5).astype(np.float32) + 0.1
        change[-1] = step + 1.0  # the values after the last whole block too
        vector.add(change)
        assert vector.finish(Bucket(0, step % 2), change, saved=True)
        blocks = vector.changed_blocks()
        assert blocks is not None and blocks.index.size <= 5
        if log.append([{"e": "record", "record": {"n": step}}], blocks=blocks):
            log.compact(shared=vector.stored)
            assert not [p for p in (tmp_path / PROGRESS_LOG).iterdir() if p.name.endswith(".b32")]
        progress = read_progress(checkpoint, 0, "run")
        assert progress is not None and progress.shared is not None
        assert progress.shared.tobytes() == vector.stored.tobytes(), step
    torn = next(p for p in (tmp_path / PROGRESS_LOG).iterdir() if p.name.endswith(".b32"))
    torn.write_bytes(torn.read_bytes()[:-4])
    assert read_progress(checkpoint, 0, "run") is None


def test_the_writes_queued_together_carry_their_changed_blocks_as_one_the_later_values_over_the_earlier() -> None:
    """The committer's writer takes every batch queued as one progress write (commits.py): their changed blocks
    merged, each block with the values of the last batch that changed it, and the last batch's tail; applied to
    the vector, they leave what the batches one by one leave."""
    from job.checkpoint.group_progress import VectorBlocks
    from job.train.distributed.commits import Batch, Write, merged_blocks

    def write(index: list[int], value: float, tail: float) -> Write:
        return Write(Batch([]), [], blocks=VectorBlocks(np.asarray(index, np.int64), np.full((len(index), 4), value,
                                                                                              np.float32),
                                                         np.full(2, tail, np.float32), 4))

    group = [write([1, 3], 1.0, 7.0), Write(Batch([]), []), write([0, 3], 2.0, 8.0)]
    one_by_one = np.zeros(4 * 5 + 2, np.float32)
    for each in group:
        if each.blocks is not None:
            each.blocks.apply(one_by_one)
    merged = merged_blocks(group)
    assert merged is not None and merged.index.tolist() == [0, 1, 3]
    together = np.zeros(4 * 5 + 2, np.float32)
    merged.apply(together)
    assert together.tolist() == one_by_one.tolist()
    assert merged_blocks([Write(Batch([]), [])]) is None
