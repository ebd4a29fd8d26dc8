"""Crash consistency: SIGKILL training at many moments (some inside a checkpoint write), resume, finish.

After every kill the checkpoint directory must load: the version named by
checkpoint_version.txt has all its files, readable, and the next run goes on from it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_graphs import write_cycle_graph

from job.config import parse_config
from job.formats.checkpoint import CheckpointStorage

EPOCHS = 12


def check_loadable(raw: dict) -> int:
    """The committed version of the run configured by ``raw`` loads whole: every partition and the model."""
    config = parse_config(raw)
    storage = CheckpointStorage(config.checkpoint_path)
    version = storage.load_version()
    if version == 0:
        return 0
    for part in range(config.entities["node"].num_partitions):
        embeddings, state = storage.load_entity_partition(version, "node", part)
        count = int((Path(config.entity_path) / f"entity_count_node_{part}.txt").read_text())
        assert embeddings.shape == (count, config.dimension)
        assert state is not None and "sum" in state["state"][0]
    params, _, metadata = storage.load_model(version)
    assert metadata["iteration/epoch_idx"] == version - 1
    assert "relations/0/operator/rhs/translation" in params
    return version


def start(config_path: Path, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "job", "train", str(config_path)], stdout=log.open("a"),
                            stderr=subprocess.STDOUT, start_new_session=True, env=env)


def kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and any worker it started
    proc.wait()


def wait_for_write(checkpoint: Path, proc: subprocess.Popen, timeout: float = 60.0) -> bool:
    """Poll until a checkpoint file is being written (its temporary name exists)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if any(name.startswith(".tmp-") for name in os.listdir(checkpoint)):
                return True
        except FileNotFoundError:
            pass
        time.sleep(0.0005)
    return False


@pytest.mark.slow
def test_sigkill_at_many_moments_never_loses_a_committed_checkpoint(tmp_path: Path) -> None:
    raw = write_cycle_graph(tmp_path, num_entities=60_000, num_partitions=2, num_epochs=EPOCHS, dimension=48,
                            batch_size=1000, num_batch_negs=50, num_uniform_negs=50, seed=11)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(raw))
    checkpoint = Path(raw["checkpoint_path"])
    log = tmp_path / "train.log"
    rng = random.Random(5)
    kills = 0
    kills_mid_write = 0
    last_version = 0
    for attempt in range(10):
        proc = start(config_path, log)
        if attempt % 2 == 0:
            hit = wait_for_write(checkpoint, proc)
        else:
            time.sleep(rng.uniform(0.5, 4.0))
            hit = False
        if proc.poll() is not None:
            break  # finished before we could kill it
        kill(proc)
        kills += 1
        kills_mid_write += hit
        version = check_loadable(json.loads(config_path.read_text()))
        assert version >= last_version, "a committed checkpoint was lost"
        last_version = version
        if version == EPOCHS:
            break
    final = start(config_path, log)
    assert final.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert check_loadable(json.loads(config_path.read_text())) == EPOCHS
    assert kills >= 5
    assert kills_mid_write >= 2
    leftovers = [n for n in os.listdir(checkpoint) if n.startswith(".tmp-") or ".v" in n and f".v{EPOCHS}." not in n]
    assert leftovers == []
    summaries = [r for r in CheckpointStorage(str(checkpoint)).load_stats() if r.get("pass_summary")]
    assert sorted({r["index"] for r in summaries}) == list(range(EPOCHS))
    (tmp_path / "kills.json").write_text(json.dumps({"kills": kills, "mid_write": kills_mid_write}))
