"""Every rank watches rank 0 (issue 44): a frozen rank 0 is noticed within about the peer timeout, the others leave
the round and torchrun re-forms the group without it; once thawed it writes nothing into the checkpoint.

Real parts: three agents started with the pods' launcher on a c10d rendezvous on 127.0.0.1, UMLS at P=4; rank 0's
trainer is SIGSTOPped (its agent stays alive, as when only the trainer starves), then SIGCONTed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers_distributed import Agents, bucket_records, buckets_per_epoch, write_run_config

from job.train.schedule.orders import all_buckets


def _trainer_of_rank(agents: Agents, rank: int) -> int | None:
    """The pid of the trainer process whose torchrun RANK is ``rank`` (warm spares off: trainers are the agents'
    children with torchrun's environment)."""
    for agent in agents.procs.values():
        if agent.poll() is not None:
            continue
        children = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
        for pid in children:
            with contextlib.suppress(OSError):
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if f"RANK={rank}".encode() in environ:
                    return int(pid)
    return None


@pytest.mark.slow
def test_a_frozen_rank_0_is_left_behind_and_fenced_when_it_thaws(umls_p4: dict, tmp_path: Path) -> None:
    from job.formats.checkpoint import CheckpointStorage

    epochs = 8
    path = write_run_config(umls_p4, "frozen0", num_epochs=epochs)
    checkpoint_path = json.loads(path.read_text())["checkpoint_path"]
    storage = CheckpointStorage(checkpoint_path)
    agents = Agents(path, "1:3", tmp_path, env={"BIGGRAPH_WARM_SPARES": "0"})
    frozen: int | None = None
    try:
        for name in ("a", "b", "c"):
            agents.start(name)
            time.sleep(0.3)
        deadline = time.monotonic() + 300
        while storage.load_version() < 2:
            assert time.monotonic() < deadline, "training never got going: " + agents.tail()
            time.sleep(0.1)
        frozen = _trainer_of_rank(agents, 0)
        assert frozen is not None, agents.tail()
        os.kill(frozen, signal.SIGSTOP)
        # the others notice (peer timeout: 8 s here) and leave the round; before, they sat waiting for 600 s and more
        deadline = time.monotonic() + 120  # a hang guard
        while agents.text().count("rank 0 is lost") < 2:
            assert time.monotonic() < deadline, "the peers did not notice the frozen rank 0: " + agents.tail()
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):  # thawed at once (unless its agent killed it already)
            os.kill(frozen, signal.SIGCONT)
        codes = agents.wait(["a", "b", "c"], timeout=600)
    finally:
        if frozen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGCONT)
        agents.stop()
    assert codes == {"a": 0, "b": 0, "c": 0}, agents.tail()
    assert storage.load_version() == epochs
    text = agents.text()
    assert "rank 0 is lost" in text
    per_epoch = buckets_per_epoch(bucket_records(checkpoint_path))
    assert sorted(per_epoch) == list(range(epochs))
    for epoch, buckets in per_epoch.items():
        assert set(buckets) == set(all_buckets(4, 4)), epoch
