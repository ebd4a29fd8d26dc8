"""Partitions written behind the training (``write_behind_buckets``, job/train/distributed/cuts.py): released to their
next holder unwritten, stored only at cuts of the whole group. The kill-at-every-step exactly-once test of write
groups (tests/test_lock_protocol.py, ``kill_at_every_step``) with cuts every few buckets and only at the commit, and
the server's refusals: a per-rank write group, a release that would lose unwritten rows, a staged report from a
fenced rank or naming the wrong partitions; a hand-off that fails ends the round instead of reading the stale file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_lock_protocol import kill_at_every_step, ranks, serve, store  # noqa: F401 - fixtures
from torch.distributed import TCPStore

from job.train.distributed.handoff import HandoffLost, PartitionHandoff
from job.train.distributed.lock_client import LockClient
from job.train.distributed.protocol import LockServerError
from job.train.distributed.transport import TensorTransport
from job.types import Bucket


@pytest.mark.slow  # ~as long as the write-group test (a point of death per request, staged file and move)
@pytest.mark.parametrize("every", [3, -1])
def test_with_writes_behind_each_buckets_update_reaches_the_pass_exactly_once(
        tmp_path: Path, store: TCPStore, ranks: list[TensorTransport], every: int) -> None:  # noqa: F811
    """Partitions handed on unwritten, stored at a cut every 3 buckets done (``every`` 3) or only at the pass's end
    (-1): killed after every request, staged file and move, each bucket's update reaches the committed rows of each of
    its partitions once and its shared update the vector once, and no staged file is left."""
    points = kill_at_every_step(lambda crash_after: str(tmp_path / str(crash_after) / "checkpoint"), store, ranks,
                                handoff=True, behind=every)
    assert points > 30
