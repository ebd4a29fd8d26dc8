"""The benchmark-only compute simulation of job/train/bucket_run.py (``SIMULATED_COMPUTE_ENV``, used by
bench/scale_bench.py): a bucket waits instead of training, and the run around it stays a consistent run."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from job.config import parse_config
from job.errors import UserError
from job.formats.checkpoint import CheckpointStorage
from job.train import train
from job.train.batch.step import BucketAbandoned
from job.train.bucket_run import SIMULATED_COMPUTE_ENV, simulate_compute, simulated_edges_per_s

sys.path.insert(0, str(Path(__file__).parent))
from helpers_graphs import write_cycle_graph  # noqa: E402

RATE = 2000.0  # edges per second: ~20 ms for a bucket of the cycle graph below


def _tables(checkpoint: CheckpointStorage, version: int, partitions: int) -> list[np.ndarray]:
    out = [checkpoint.load_entity_partition(version, "node", p)[0] for p in range(partitions)]
    params, _, _ = checkpoint.load_model(version)
    return out + [params[name] for name in sorted(params)]


def test_a_simulated_bucket_waits_instead_of_training_and_the_run_commits(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(SIMULATED_COMPUTE_ENV, str(RATE))
    raw = write_cycle_graph(tmp_path, num_entities=80, num_partitions=2, num_epochs=1, bucket_order="affinity")
    train(parse_config(raw))
    checkpoint = CheckpointStorage(raw["checkpoint_path"])
    assert checkpoint.load_version() == 1
    first = _tables(checkpoint, 1, 2)

    raw["num_epochs"] = 2  # resumes: one more epoch on top of version 1
    train(parse_config(raw))
    assert checkpoint.load_version() == 2
    # no arithmetic ran: every row, Adagrad sum and relation parameter is the committed one, byte for byte
    for before, after in zip(first, _tables(checkpoint, 2, 2)):
        np.testing.assert_array_equal(before, after)

    records = checkpoint.load_stats()
    buckets = [r for r in records if "lhs_partition" in r]
    summaries = [r for r in records if r.get("pass_summary")]
    assert len(buckets) == 8 and len(summaries) == 2
    for record in buckets:
        count = record["stats"]["count"]
        assert count > 0 and record["stats"]["metrics"]["loss"] == 0.0
        assert record["time"] >= count / RATE  # it waited its edges at the given rate (a sleep's lower bound)
    for summary in summaries:  # every edge of the graph counted once per pass
        assert summary["stats"]["count"] == sum(r["stats"]["count"] for r in buckets) // 2 == 160
        assert summary["bytes_written"] > 0  # the partitions were still held and written as in training


def test_the_simulation_is_off_unless_set_and_refuses_a_bad_rate(monkeypatch) -> None:
    monkeypatch.delenv(SIMULATED_COMPUTE_ENV, raising=False)
    assert simulated_edges_per_s() is None
    monkeypatch.setenv(SIMULATED_COMPUTE_ENV, "1.8e6")
    assert simulated_edges_per_s() == 1.8e6
    for bad in ("fast", "0", "-5", "inf", "nan"):
        monkeypatch.setenv(SIMULATED_COMPUTE_ENV, bad)
        with pytest.raises(UserError, match=SIMULATED_COMPUTE_ENV):
            simulated_edges_per_s()


def test_a_simulated_bucket_is_given_up_when_its_round_ends() -> None:
    with pytest.raises(BucketAbandoned):
        simulate_compute(1_000_000, 10.0, stop=lambda: True)  # 28 hours unless the stop is polled
    assert simulate_compute(5, 1e9).count == 5
