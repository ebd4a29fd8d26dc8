"""Every write into a checkpoint directory is fenced (issue 44): the lock server's progress log, the staged-to-final
moves of write groups and the roll-forward of a restart check the round and the owner first.

Real parts: the progress log and the checkpoint files on the local filesystem, the owner record's conditional
writes (job/checkpoint/owner.py), a real TCPStore for the round's ``dead/<rank>`` key."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import pytest
from helpers_distributed import partition_keys

from job.checkpoint.group_progress import PROGRESS_FILE, ProgressLog, StaleProgressWriter, read_progress
from job.checkpoint.manager import CheckpointManager
from job.checkpoint.owner import OWNER_FILE, Ownership, OwnershipLost
from job.checkpoint.write_groups import publish, roll_forward
from job.formats.checkpoint import CheckpointStorage, SumRegistry
from job.train.distributed.lock_state import LockState


def _state() -> dict:
    return LockState(2, 2, partition_keys(2)).to_json()


def test_a_stale_progress_log_cannot_overwrite_the_live_one(tmp_path: Path) -> None:
    """Two logs of the same run and version on one directory, compacting after every record: the stale one (a rank 0
    that thawed after the group re-formed under another) cannot replace the live one's snapshot or drop its records."""
    checkpoint = str(tmp_path)
    stale = ProgressLog(checkpoint, "run", 1, compact_every=1)
    stale.start(_state())
    live = ProgressLog(checkpoint, "run", 1, compact_every=1)
    live.start(_state())
    live.append([{"e": "start", "rank": 1, "bucket": [1, 1]}])
    snapshot_before = (tmp_path / PROGRESS_FILE).read_text()

    stale_state = LockState(2, 2, partition_keys(2))
    stale_state.apply({"e": "start", "rank": 0, "bucket": [0, 0]})
    due = stale.append([{"e": "start", "rank": 0, "bucket": [0, 0]}])
    assert due  # compact_every=1: the stale writer now compacts, which would rewrite the snapshot
    with pytest.raises(StaleProgressWriter, match="another round's rank 0"):
        stale.compact()  # the compaction mid-pass (segments)
    with pytest.raises(StaleProgressWriter, match="another round's rank 0"):
        stale.start(stale_state.to_json())  # a new base mid-pass
    assert (tmp_path / PROGRESS_FILE).read_text() == snapshot_before
    progress = read_progress(checkpoint, 0, "run")
    assert progress is not None and progress.records == [{"e": "start", "rank": 1, "bucket": [1, 1]}]
    # the live one goes on compacting over its own snapshot
    assert live.append([{"e": "finish", "rank": 1, "bucket": [1, 1]}])
    live.start(_state())
    assert json.loads((tmp_path / PROGRESS_FILE).read_text())["log"] == live.log_id


def test_a_progress_log_writes_nothing_once_its_round_is_over(tmp_path: Path) -> None:
    """The round's fence runs before every write of the log: once rank 0 is declared dead (``dead/0``), or finds its
    own process stalled past the peer timeout, it writes no record and no snapshot."""
    from torch.distributed import TCPStore

    from job.train.distributed import auth
    from job.train.distributed.group import DistributedContext, RoundOver

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
    ctx = DistributedContext(rank=0, world_size=2, store=store, restart_count=0, round_id="r1")
    log = ProgressLog(str(tmp_path), "run", 1, fence=ctx.fence)
    log.start(_state())
    store.set(ctx.key("dead/0"), auth.mac("dead", "r1", "0"))  # declared (under the group's secret)
    names = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    snapshot = (tmp_path / PROGRESS_FILE).read_text()
    with pytest.raises(RoundOver):
        log.append([{"e": "start", "rank": 0, "bucket": [0, 0]}])
    with pytest.raises(RoundOver):
        log.start(_state())
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == names
    assert (tmp_path / PROGRESS_FILE).read_text() == snapshot


def _stale_owner_taken_over(tmp_path: Path) -> Ownership:
    """An owner (a run that stalled, not died) whose directory another run then took over with ``--take-over``."""
    now = [time.time()]
    first = Ownership(str(tmp_path), run_id="torchrun:old", heartbeat_seconds=0, clock=lambda: now[0])
    first.acquire()
    record = json.loads((tmp_path / OWNER_FILE).read_text())
    record["machine"] = "elsewhere"  # no PID check possible: judged by its heartbeat's age only
    (tmp_path / OWNER_FILE).write_text(json.dumps(record))
    first = Ownership(str(tmp_path), run_id="torchrun:old", heartbeat_seconds=0, clock=lambda: now[0])
    first.acquire()
    now[0] += 3600
    Ownership(str(tmp_path), run_id="local:new", take_over=True, heartbeat_seconds=0, clock=lambda: now[0]).acquire()
    return first


def test_a_taken_over_run_moves_no_staged_file_over_the_new_owners(tmp_path: Path) -> None:
    """The take-over scenario: the old run, resumed, publishes a write group it staged before it stalled: refused
    before any move, so the new owner's partition file stays."""
    old = _stale_owner_taken_over(tmp_path)
    checkpoint = CheckpointStorage(str(tmp_path), guard=old.check)
    key = ("node", 0)
    target = Path(checkpoint.partition_file(1, *key))
    target.write_bytes(b"the new owner's rows")
    staged = tmp_path / "staged-old"
    staged.write_bytes(b"the old run's rows")
    with pytest.raises(OwnershipLost):
        publish(checkpoint, 1, key, "staged-old")
    assert target.read_bytes() == b"the new owner's rows" and staged.exists()
    with pytest.raises(OwnershipLost):
        roll_forward(str(tmp_path), 1, [["node", 0, "staged-old"]], guard=old.check)
    assert target.read_bytes() == b"the new owner's rows"


class _Group:
    """A torchrun group as the checkpoint manager sees it (its barriers are the test's order of calls)."""

    def __init__(self, rank: int, run_id: str) -> None:
        self.rank, self.run_id = rank, run_id

    def barrier(self, name: str) -> None:
        pass

    def shared_sums(self) -> SumRegistry:
        return SumRegistry()


def test_a_rank_other_than_0_writes_nothing_once_another_run_took_the_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 of a group holds no owner record (rank 0 does), yet it writes into the directory: it checks the record
    before each write (``OwnerWatch``), so once another run took the directory over (``--take-over`` of this one,
    stalled) its staged moves and roll-forward are refused, as rank 0's are."""
    monkeypatch.setenv("BIGGRAPH_OWNER_HEARTBEAT_S", "0")  # the record is read before every write
    key = ("node", 0)
    rank0 = CheckpointManager(str(tmp_path), [key])
    rank0.open(_Group(0, "torchrun:run"))
    peer = CheckpointManager(str(tmp_path), [key])
    peer.open(_Group(1, "torchrun:run"))
    target = Path(peer.storage.partition_file(1, *key))
    (tmp_path / "staged-1").write_bytes(b"rank 1's rows")
    publish(peer.storage, 1, key, "staged-1")  # its own run's directory: moved
    assert target.read_bytes() == b"rank 1's rows"

    later = time.time() + 3600  # this run's heartbeat is an hour old: stalled, taken over
    Ownership(str(tmp_path), run_id="local:new", take_over=True, heartbeat_seconds=0, clock=lambda: later).acquire()
    target.write_bytes(b"the new owner's rows")
    (tmp_path / "staged-2").write_bytes(b"rank 1's stale rows")
    with pytest.raises(OwnershipLost, match="taken over by run local:new"):
        publish(peer.storage, 1, key, "staged-2")
    with pytest.raises(OwnershipLost):
        roll_forward(str(tmp_path), 1, [["node", 0, "staged-2"]], guard=peer.storage.guard)
    assert target.read_bytes() == b"the new owner's rows" and (tmp_path / "staged-2").exists()
    peer.close()  # gives nothing up: the record is rank 0's (and now the new run's)
    assert json.loads((tmp_path / OWNER_FILE).read_text())["run_id"] == "local:new"


STALL_SCRIPT = """
import datetime, sys, time
from torch.distributed import TCPStore
from job.train.distributed.group import DistributedContext, Heartbeat, RoundOver
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
beat = Heartbeat(store, 0, 1, interval=0.1, dead_after=1.0, round_id="r1")
ctx = DistributedContext(rank=0, world_size=1, store=store, restart_count=0, round_id="r1", heartbeat=beat)
ctx.fence()
print("fenced nothing", flush=True)
while True:
    try:
        ctx.fence()
    except RoundOver as err:
        print(err, flush=True)
        break
    time.sleep(0.01)
"""


def test_a_rank_0_that_thaws_after_the_peer_timeout_fences_itself() -> None:
    """Nobody can write ``dead/0`` into a frozen rank 0's store (it lives in that process), so a rank 0 stopped past
    the peer timeout (its peers left the round: they watch it) finds out by itself: its next write is refused."""
    import os
    import signal
    import subprocess
    import sys

    from helpers_distributed import wait_until

    proc = subprocess.Popen([sys.executable, "-c", STALL_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "fenced nothing"
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        assert wait_until(lambda: time.monotonic() - stopped > 3.0, seconds=10.0)  # past the 1 s peer timeout
        os.kill(proc.pid, signal.SIGCONT)
        line = proc.stdout.readline()
        assert "without a heartbeat, past the peer timeout" in line, line
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_a_progress_whose_shared_vector_has_another_shape_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    """Its done buckets' shared updates live only in its vector: resumed with the model's instead, they would be lost
    (issue 44). The whole pass is trained again, and the log names both shapes."""
    import logging

    import numpy as np

    from job.checkpoint.group_progress import Progress, resumable

    progress = Progress(run="run", version=3, state={}, records=[], shared=np.zeros(7, np.float32))
    assert resumable(progress, 3, (7,)) is progress
    assert resumable(progress, 2, (7,)) is None  # another pass's
    with caplog.at_level(logging.WARNING, logger="biggraph"):
        assert resumable(progress, 3, (9,)) is None
    assert "has shape (7,), the model's (9,)" in caplog.text
    assert resumable(Progress(run="run", version=3, state={}, records=[]), 3, (9,)) is not None  # no vector stored
