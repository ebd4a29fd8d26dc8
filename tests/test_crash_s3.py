"""Crash consistency on S3: SIGKILL training with checkpoint_path on ``s3://`` (moto), resume, finish.

As tests/test_crash.py, but the checkpoint files of a version are built locally and uploaded in
background threads, and checkpoint_version.txt is written only after every upload of the version
succeeded. Kills land at random moments and, on purpose, while uploads are in flight (a
``biggraph-upload-*`` staging directory exists in the trainer's TMPDIR). After every kill the
committed version must load completely through CheckpointStorage; the resumed run must finish.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest
from helpers_graphs import write_cycle_graph
from test_crash import check_loadable, kill
from test_crash import start as start_trainer

from job.formats.checkpoint import CheckpointStorage

EPOCHS = 6
ATTEMPTS = 6


def start(config_path: Path, log: Path, tmpdir: Path) -> subprocess.Popen:
    env = dict(os.environ, TMPDIR=str(tmpdir))  # the AWS_* test values set by the moto fixture come along
    return start_trainer(config_path, log, env)


def uploads_in_flight(tmpdir: Path, before: set[str]) -> bool:
    """A staging directory of this run still exists: a checkpoint file is being built or uploaded."""
    return any(n.startswith("biggraph-upload-") and n not in before for n in os.listdir(tmpdir))


def wait_for_upload(tmpdir: Path, proc: subprocess.Popen, timeout: float = 90.0) -> bool:
    """Poll until the trainer stages a new checkpoint file for upload (a new biggraph-upload-* directory)."""
    before = set(os.listdir(tmpdir))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if uploads_in_flight(tmpdir, before):
            return True
        time.sleep(0.001)
    return False


def wait_for_version(storage: CheckpointStorage, version: int, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None and storage.load_version() < version:
        time.sleep(0.1)


@pytest.mark.slow
def test_sigkill_during_s3_uploads_never_loses_a_committed_checkpoint(tmp_path: Path, s3_endpoint: str,
                                                                      s3_bucket: str) -> None:
    # big tables, few edges: each checkpoint file takes a while to build and upload (~20 MB), epochs are short
    raw = write_cycle_graph(tmp_path, num_entities=100_000, num_partitions=2, num_relations=1, num_epochs=EPOCHS,
                            dimension=96, batch_size=1000, num_batch_negs=50, num_uniform_negs=50, seed=11)
    raw["checkpoint_path"] = f"{s3_bucket}/run/checkpoints"
    raw["storage_options"] = {"endpoint_url": s3_endpoint}
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(raw))
    log = tmp_path / "train.log"
    tmpdir = tmp_path / "trainer-tmp"
    tmpdir.mkdir()
    rng = random.Random(7)
    kills = kills_mid_upload = 0
    versions = []
    last_version = 0
    checkpoint = CheckpointStorage(raw["checkpoint_path"])
    for attempt in range(ATTEMPTS):
        before = set(os.listdir(tmpdir))  # staging directories left behind by earlier kills
        proc = start(config_path, log, tmpdir)
        if attempt % 2 == 0:
            # let it commit one more version, then kill it while a checkpoint file is being built or uploaded
            wait_for_version(checkpoint, last_version + 1, proc)
            wait_for_upload(tmpdir, proc)
            time.sleep(rng.uniform(0.0, 0.05))
        else:
            time.sleep(rng.uniform(2.0, 8.0))
        if proc.poll() is not None:
            break  # finished before we could kill it
        hit = uploads_in_flight(tmpdir, before)
        kill(proc)
        kills += 1
        kills_mid_upload += hit
        version = check_loadable(raw)
        assert version >= last_version, "a committed checkpoint was lost"
        versions.append(version)
        last_version = version
        if version == EPOCHS:
            break
    final = start(config_path, log, tmpdir)
    assert final.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert check_loadable(raw) == EPOCHS
    assert kills >= 4, versions
    assert kills_mid_upload >= 2
    assert versions[-1] > 0  # kills landed after commits too, and those commits survived
    assert checkpoint.list_versions() == {EPOCHS}  # every uncommitted or superseded version was dropped
    # each restart deleted the local staging copies its killed predecessors left behind
    assert [n for n in os.listdir(tmpdir) if n.startswith("biggraph-upload-")] == []
    import storage_adapters as storage

    leftovers = [n for n in storage.listdir(raw["checkpoint_path"]) if ".v" in n and f".v{EPOCHS}." not in n]
    assert leftovers == []
    summaries = [r for r in checkpoint.load_stats() if r.get("pass_summary")]
    assert sorted({r["index"] for r in summaries}) == list(range(EPOCHS))
    staging_left = [n for n in os.listdir(tmpdir) if n.startswith("biggraph-upload-")]
    result = {"kills": kills, "mid_upload": kills_mid_upload, "versions_after_kills": versions,
              "lost_checkpoints": 0, "local_staging_dirs_left_by_kills": len(staging_left)}
    print(json.dumps(result))
    (tmp_path / "kills.json").write_text(json.dumps(result))
