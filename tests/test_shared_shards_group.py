"""Shards of the shared vector in a real group (``shared_shards``, issue #45): torchrun agents on loopback, UMLS in 4
partitions with dynamic relations, partitions written behind. The shard service's own rules are in
tests/test_shared_shards.py; each bucket's update counted once across kills at the shards' new points is in
tests/test_lock_protocol.py (``kill_at_every_step`` with ``shards``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers_distributed import Agents, assert_each_bucket_once_per_epoch, bucket_records, write_run_config
from test_distributed_prefetch import check_checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("pods", [2, 3])
def test_ranks_serving_their_relation_rows_train_each_bucket_once_and_persist_what_the_group_served(
        umls_p4: dict, tmp_path: Path, pods: int) -> None:
    """2 or 3 agents, each rank serving the relation rows r with r mod M == its rank (rank 0 in its lock server, the
    others in their shards), writes behind with a cut in the background every 5 buckets and the commit's: every
    bucket once per epoch, the version whole, bytes moved through the shards, and at each pass's end the vector rank
    0 persisted (its own rows, and the shards' rows it wrote in with each record) equal to what the group served, up
    to float rounding (without the shards' saves, their rows there were still the pass's starting values: 27-72
    apart). Why not equal to a run without shards: two asynchronous runs never train alike, shards or not."""
    epochs = 2
    path = write_run_config(umls_p4, f"shards{pods}", num_epochs=epochs, partition_handoff=True, write_behind_buckets=5,
                            shared_shards=True)
    agents = Agents(path, str(pods), tmp_path)
    names = ["a", "b", "c"][:pods]
    codes = agents.run(names, timeout=300)
    assert codes == dict.fromkeys(names, 0), agents.tail()
    checkpoint_path = json.loads(path.read_text())["checkpoint_path"]
    assert_each_bucket_once_per_epoch(bucket_records(checkpoint_path), epochs)
    check_checkpoint(checkpoint_path, epochs)
    text = agents.text()
    moved = [int(n) for n in re.findall(r'"shard_bytes": (\d+)', text)]
    assert len(moved) == pods * epochs and all(n > 0 for n in moved), moved
    gaps = [float(g) for g in re.findall(r"differs from the served one by at most (\S+) at the pass's end", text)]
    assert len(gaps) == epochs and max(gaps) < 1e-4, gaps
