"""Two real ``biggraph train`` processes on one checkpoint_path, locally and on S3 (moto): the second is refused at
once with one line naming the first, the first commits intact; a run that was frozen and taken over (``--take-over``)
stops without committing over its successor.

The first trainer is frozen (SIGSTOP) right after its first commit, so the second meets it mid-run however fast or
slow this machine is (no timing thresholds): its heartbeat is seconds old, far from stale.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_graphs import write_cycle_graph

import storage_adapters as storage
from job.checkpoint.owner import OWNER_FILE, OwnerRecord
from job.formats.checkpoint import CheckpointStorage

pytestmark = pytest.mark.slow
EPOCHS = 8


def _config(tmp_path: Path, checkpoint_path: str | None, extra: dict | None = None) -> Path:
    raw = write_cycle_graph(tmp_path, num_entities=2000, num_partitions=2, num_epochs=EPOCHS, dimension=16,
                            batch_size=100, seed=4)
    if checkpoint_path is not None:
        raw["checkpoint_path"] = checkpoint_path
    raw.update(extra or {})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


def _train(config: Path, *extra: str, heartbeat: float | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    if heartbeat is not None:
        env["BIGGRAPH_OWNER_HEARTBEAT_S"] = str(heartbeat)
    return subprocess.Popen([sys.executable, "-m", "job", "train", str(config), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)


def _wait_for_version(checkpoint: CheckpointStorage, proc: subprocess.Popen, version: int = 1) -> None:
    deadline = time.monotonic() + 300
    while checkpoint.load_version() < version:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no commit within 300 s"
        time.sleep(0.05)


def _two_writers(config: Path, checkpoint_url: str) -> None:
    checkpoint = CheckpointStorage(checkpoint_url)
    first = _train(config)
    try:
        _wait_for_version(checkpoint, first)
        os.killpg(first.pid, signal.SIGSTOP)  # mid-run, between two commits
        frozen_at = checkpoint.load_version()
        second = _train(config)
        output, _ = second.communicate(timeout=300)
        assert second.returncode == 2, output[-3000:]
        errors = [line for line in output.splitlines() if "in use by" in line]
        assert len(errors) == 1, output[-3000:]
        assert f"pid {first.pid}" in errors[0] and "Traceback" not in output
        assert checkpoint.load_version() == frozen_at  # the refused run changed nothing
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    output, _ = first.communicate(timeout=600)
    assert first.returncode == 0, output[-3000:]
    assert checkpoint.load_version() == EPOCHS
    for part in range(2):  # the first run's final version is whole: every file verifies against its manifest
        checkpoint.load_entity_partition(EPOCHS, "node", part)
    checkpoint.load_model(EPOCHS)
    assert not storage.exists(storage.join(checkpoint_url, OWNER_FILE))  # released at the end


def test_a_second_local_job_is_refused_and_the_first_commits_intact(tmp_path: Path) -> None:
    config = _config(tmp_path, None)
    _two_writers(config, json.loads(config.read_text())["checkpoint_path"])


def test_a_second_s3_job_is_refused_and_the_first_commits_intact(tmp_path: Path, s3_endpoint: str,
                                                                 s3_bucket: str) -> None:
    url = f"{s3_bucket}/run/checkpoints"
    config = _config(tmp_path, url, {"storage_options": {"endpoint_url": s3_endpoint}})
    _two_writers(config, url)


def test_a_frozen_run_taken_over_stops_without_committing(tmp_path: Path) -> None:
    config = _config(tmp_path, None)
    url = json.loads(config.read_text())["checkpoint_path"]
    checkpoint = CheckpointStorage(url)
    first = _train(config, heartbeat=0.5)  # frozen for more than two beats below: it checks before writing again
    try:
        _wait_for_version(checkpoint, first)
        os.killpg(first.pid, signal.SIGSTOP)
        # its heartbeat an hour old, as after an hour frozen on a node that then came back
        owner = Path(url) / OWNER_FILE
        record = json.loads(owner.read_text())
        record.update(heartbeat=record["heartbeat"] - 3600, machine="another-node")
        owner.write_bytes(OwnerRecord(**record).to_bytes())
        time.sleep(1.5)  # frozen for three of its beats at least (not a threshold on anything measured)
        refused = _train(config)
        output, _ = refused.communicate(timeout=300)
        assert refused.returncode == 2 and "--take-over" in output, output[-3000:]
        taker = _train(config, "--take-over")
        output, _ = taker.communicate(timeout=600)
        assert taker.returncode == 0, output[-3000:]
        assert "taking over the checkpoint" in output
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    output, _ = first.communicate(timeout=600)
    assert first.returncode == 2, output[-3000:]
    assert "no longer owns the checkpoint directory" in output and "Traceback" not in output
    assert checkpoint.load_version() == EPOCHS  # the successor's result, not overwritten
    for part in range(2):
        checkpoint.load_entity_partition(EPOCHS, "node", part)
    # the resumed run wrote nothing more: no file of another version beside the successor's
    stray = [n for n in os.listdir(url) if ".v" in n and f".v{EPOCHS}." not in n]
    assert stray == []
