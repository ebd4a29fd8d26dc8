"""The checkpoint manager and the owner record: one writer at a time, complete and durable commits.

Real files and real processes' PIDs throughout; the owner record's clock is the only thing a test moves (a
heartbeat "an hour old" without waiting an hour).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import storage_adapters as storage
from job.checkpoint import CheckpointManager, ModelState, OwnerBusyError, Ownership, OwnershipLost
from job.checkpoint.owner import OWNER_FILE, OwnerRecord, claim, machine_id, unclaim
from job.errors import CheckpointError, UserError
from job.formats.checkpoint import CheckpointStorage

KEYS = [("node", 0), ("node", 1)]


def owner_of(directory: Path) -> dict:
    return json.loads((directory / OWNER_FILE).read_text())


def test_a_second_run_is_refused_naming_the_first(tmp_path: Path) -> None:
    first = Ownership(str(tmp_path), run_id="local:first", heartbeat_seconds=0)
    first.acquire()
    second = Ownership(str(tmp_path), run_id="local:second", heartbeat_seconds=0)
    with pytest.raises(OwnerBusyError) as err:
        second.acquire()
    message = str(err.value)
    assert "local:first" in message and f"pid {os.getpid()}" in message and "heartbeat" in message
    assert issubclass(OwnerBusyError, UserError)  # one line, exit 2 at the command line
    assert owner_of(tmp_path)["run_id"] == "local:first"
    first.check()  # still the owner


def test_the_same_run_takes_its_directory_again(tmp_path: Path) -> None:
    """A restarted torchrun group (a replaced pod's agent included) carries the same run id."""
    Ownership(str(tmp_path), run_id="torchrun:job-a", heartbeat_seconds=0).acquire()
    again = Ownership(str(tmp_path), run_id="torchrun:job-a", heartbeat_seconds=0)
    again.acquire()
    again.check()


def test_a_stale_owner_is_taken_over_only_when_asked_and_then_cannot_commit(tmp_path: Path) -> None:
    now = [time.time()]
    first = Ownership(str(tmp_path), run_id="torchrun:old", heartbeat_seconds=0, clock=lambda: now[0])
    first.acquire()
    # written by "another machine": no PID check possible
    record = owner_of(tmp_path)
    record["machine"] = "elsewhere"
    (tmp_path / OWNER_FILE).write_text(json.dumps(record))
    first = Ownership(str(tmp_path), run_id="torchrun:old", heartbeat_seconds=0, clock=lambda: now[0])
    first.acquire()
    now[0] += 3600  # an hour without a heartbeat
    fresh_clock = lambda: now[0]  # noqa: E731
    blocked = Ownership(str(tmp_path), run_id="local:new", heartbeat_seconds=0, clock=fresh_clock)
    with pytest.raises(OwnerBusyError, match="--take-over"):
        blocked.acquire()
    taker = Ownership(str(tmp_path), run_id="local:new", take_over=True, heartbeat_seconds=0, clock=fresh_clock)
    taker.acquire()
    assert owner_of(tmp_path)["run_id"] == "local:new"
    with pytest.raises(OwnershipLost, match="local:new"):
        first.check()  # the old run, resumed, must not commit


def test_a_fresh_owner_is_never_taken_over(tmp_path: Path) -> None:
    Ownership(str(tmp_path), run_id="local:a", heartbeat_seconds=0).acquire()
    with pytest.raises(OwnerBusyError, match="heartbeat 0 s ago"):
        Ownership(str(tmp_path), run_id="local:b", take_over=True, heartbeat_seconds=0).acquire()


def test_the_record_of_a_dead_process_on_this_machine_is_taken_at_once(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    record = OwnerRecord("local:killed", "this-host", dead_pid, machine_id(), time.time(), time.time())
    (tmp_path / OWNER_FILE).write_bytes(record.to_bytes())
    Ownership(str(tmp_path), run_id="local:next", heartbeat_seconds=0).acquire()
    assert owner_of(tmp_path)["run_id"] == "local:next"


def test_a_live_process_on_this_machine_is_not_taken_over(tmp_path: Path) -> None:
    record = OwnerRecord("local:alive", "this-host", os.getppid(), machine_id(), time.time(), time.time())
    (tmp_path / OWNER_FILE).write_bytes(record.to_bytes())
    with pytest.raises(OwnerBusyError, match="local:alive"):
        Ownership(str(tmp_path), run_id="local:next", heartbeat_seconds=0).acquire()


def test_a_damaged_owner_record_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / OWNER_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{OWNER_FILE}: not an owner record"):
        Ownership(str(tmp_path), run_id="local:x", heartbeat_seconds=0).acquire()


def test_release_removes_only_its_own_record(tmp_path: Path) -> None:
    first = Ownership(str(tmp_path), run_id="local:a", heartbeat_seconds=0)
    first.acquire()
    first.release()
    assert not (tmp_path / OWNER_FILE).exists()
    now = [time.time()]
    old = Ownership(str(tmp_path), run_id="local:old", heartbeat_seconds=0, clock=lambda: now[0])
    old.acquire()
    record = owner_of(tmp_path)
    record["machine"] = "elsewhere"
    (tmp_path / OWNER_FILE).write_text(json.dumps(record))  # old's record now differs from what it wrote
    old.release()
    assert owner_of(tmp_path)["run_id"] == "local:old"  # not removed: it was no longer the one old wrote


def test_the_heartbeat_thread_keeps_the_record_fresh(tmp_path: Path) -> None:
    owner = Ownership(str(tmp_path), run_id="local:beat", heartbeat_seconds=0.05)
    owner.acquire()
    first = owner_of(tmp_path)["heartbeat"]
    deadline = time.monotonic() + 30
    while owner_of(tmp_path)["heartbeat"] == first and time.monotonic() < deadline:
        time.sleep(0.02)
    assert owner_of(tmp_path)["heartbeat"] > first
    owner.release()


def test_nested_claims_share_one_ownership(tmp_path: Path) -> None:
    """A grow and the training it runs in the same process are one writer."""
    outer = claim(str(tmp_path))
    inner = claim(str(tmp_path))
    assert inner is outer
    unclaim(inner)
    assert (tmp_path / OWNER_FILE).exists()
    unclaim(outer)
    assert not (tmp_path / OWNER_FILE).exists()


# the manager ----------------------------------------------------------------------------------------------------


def _write_version(manager: CheckpointManager, version: int, keys: list[tuple[str, int]] = KEYS) -> None:
    for entity_type, part in keys:
        manager.storage.save_entity_partition(version, entity_type, part, np.full((3, 2), version, np.float32))
    manager.write_model(version, ModelState({"relations/0/operator/rhs/translation":
                                             ("relations.0.rhs", np.zeros(2, np.float32))}, None))


def test_commit_writes_the_marker_last_and_drops_the_previous_version(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path), KEYS)
    assert manager.open() == 0
    manager.add_metadata_provider(lambda: {"iteration/epoch_idx": 0})
    _write_version(manager, 1)
    manager.commit(1, [{"pass": 1}])
    _write_version(manager, 2)
    manager.commit(2, [{"pass": 2}])
    names = set(os.listdir(tmp_path))
    assert "model.v2.h5" in names and "model.v1.h5" not in names and "checksums.v2.json" in names
    assert (tmp_path / "checkpoint_version.txt").read_text().strip() == "2"
    _, _, metadata = CheckpointStorage(str(tmp_path)).load_model(2)
    assert metadata["iteration/epoch_idx"] == 0
    manager.close()
    assert not (tmp_path / OWNER_FILE).exists()


def test_a_passing_input_check_is_kept_with_the_next_commit_only(tmp_path: Path) -> None:
    """``record_input_check`` writes nothing until a version commits (a run refused before its first commit leaves
    the directory as it found it), then ``input_check.json`` beside the versions, read back by the next writer."""
    manager = CheckpointManager(str(tmp_path), KEYS)
    manager.open()
    record = {"format": 1, "config": "c", "input": "i", "facts": {}}
    manager.record_input_check(record)
    _write_version(manager, 1, keys=[("node", 0)])
    with pytest.raises(CheckpointError):
        manager.commit(1)  # incomplete: nothing committed, nothing kept
    assert not (tmp_path / "input_check.json").exists() and manager.input_check() is None
    _write_version(manager, 1)
    manager.commit(1)
    manager.close()
    again = CheckpointManager(str(tmp_path), KEYS)
    again.open()
    assert again.input_check() == record
    again.close()


def test_an_incomplete_version_is_never_committed(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path), KEYS)
    manager.open()
    _write_version(manager, 1)
    manager.commit(1)
    _write_version(manager, 2, keys=[("node", 0)])  # partition 1 of version 2 never written
    with pytest.raises(CheckpointError, match=r"version 2 is incomplete .*embeddings_node_1\.v2\.h5"):
        manager.commit(2)
    assert (tmp_path / "checkpoint_version.txt").read_text().strip() == "1"
    assert CheckpointStorage(str(tmp_path)).load_entity_partition(1, "node", 1)[0][0, 0] == 1
    manager.close()


def test_commit_makes_the_files_durable_before_the_marker_and_the_marker_after(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    real_sync, real_save = storage.sync_directory, CheckpointStorage.save_version
    monkeypatch.setattr(storage, "sync_directory", lambda url: (events.append("sync"), real_sync(url))[1])
    monkeypatch.setattr(CheckpointStorage, "save_version",
                        lambda self, version: (events.append("marker"), real_save(self, version))[1])
    manager = CheckpointManager(str(tmp_path), KEYS)
    manager.open()
    _write_version(manager, 1)
    manager.commit(1)
    assert events == ["sync", "marker", "sync"]
    manager.close()


def test_a_run_that_lost_its_directory_does_not_commit(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path), KEYS)
    manager.open()
    _write_version(manager, 1)
    manager.commit(1)
    record = owner_of(tmp_path)
    record.update(run_id="local:intruder", machine="elsewhere")
    (tmp_path / OWNER_FILE).write_text(json.dumps(record))  # taken over (--take-over elsewhere)
    _write_version(manager, 2)
    with pytest.raises(OwnershipLost, match="local:intruder"):
        manager.commit(2)
    assert (tmp_path / "checkpoint_version.txt").read_text().strip() == "1"
    manager.close()
    assert owner_of(tmp_path)["run_id"] == "local:intruder"  # the new owner's record stays


def test_open_refuses_a_busy_directory_before_touching_anything(tmp_path: Path) -> None:
    writer = CheckpointManager(str(tmp_path), KEYS)
    writer.open()
    _write_version(writer, 1)
    writer.commit(1)
    _write_version(writer, 2)  # the running job's next version, not yet committed
    writer.close()
    # that job runs on another machine, its heartbeat fresh
    record = OwnerRecord("torchrun:cluster-job", "pod-0", 7, "elsewhere", time.time() - 60, time.time())
    (tmp_path / OWNER_FILE).write_bytes(record.to_bytes())
    second = CheckpointManager(str(tmp_path), KEYS)
    with pytest.raises(OwnerBusyError, match="torchrun:cluster-job on host pod-0"):
        second.open()
    assert (tmp_path / "model.v2.h5").exists()  # the running job's uncommitted files are left alone
    assert owner_of(tmp_path)["run_id"] == "torchrun:cluster-job"


# the best version (validation_edge_paths) -------------------------------------------------------------------------


def _versions_in(directory: Path) -> set[int]:
    return {int(p.name[len("model.v"):-len(".h5")]) for p in directory.glob("model.v*.h5")}


def test_the_best_version_survives_later_commits_until_a_better_one_replaces_it(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path), KEYS)
    manager.open()
    _write_version(manager, 1)
    manager.commit(1)
    manager.keep_best(1)
    for version in (2, 3):
        _write_version(manager, version)
        manager.commit(version)
    # retention dropped 2 (not the best) but kept 1 beside the latest
    assert _versions_in(tmp_path) == {1, 3}
    assert not (tmp_path / "checksums.v2.json").exists() and (tmp_path / "checksums.v1.json").exists()
    assert (tmp_path / "best_version.txt").read_text().strip() == "1"
    # readers find it by number and by name, its files verified against its own manifest
    assert CheckpointManager.version_named(str(tmp_path), "best") == 1
    committed = CheckpointManager.reader(str(tmp_path), 1)
    assert committed.version == 1 and committed.latest == 3
    assert committed.checkpoint.load_entity_partition(1, "node", 1)[0][0, 0] == 1
    manager.keep_best(3)  # a better one: the old best goes
    assert _versions_in(tmp_path) == {3}
    _write_version(manager, 4)
    manager.commit(4)  # 3, the best, stays beside 4
    assert _versions_in(tmp_path) == {3, 4}
    with pytest.raises(CheckpointError, match="only the committed version"):
        manager.keep_best(3)
    manager.close()


def test_open_keeps_the_best_version_and_drops_what_a_kill_left(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path), KEYS)
    manager.open()
    for version in (1, 2, 3):
        _write_version(manager, version)
        manager.commit(version, drop_previous=False)  # a kill after each commit: older versions left behind
    (tmp_path / "best_version.txt").write_text("2\n")
    manager.close()
    again = CheckpointManager(str(tmp_path), KEYS)
    assert again.open() == 3
    assert _versions_in(tmp_path) == {2, 3} and again.best == 2
    again.close()
    # a pointer naming a version that is not there (copied from elsewhere, or past the marker) is removed
    (tmp_path / "best_version.txt").write_text("7\n")
    third = CheckpointManager(str(tmp_path), KEYS)
    third.open()
    assert not (tmp_path / "best_version.txt").exists() and third.best is None
    assert _versions_in(tmp_path) == {3}
    with pytest.raises(CheckpointError, match="no best version recorded"):
        CheckpointManager.version_named(str(tmp_path), "best")
    third.close()
