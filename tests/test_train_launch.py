"""Launching training on GPUs: a missing GPU is a clean error, one process per GPU only when asked and
present, and the partition advice for several GPU processes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from job.config import parse_config

sys.path.insert(0, str(Path(__file__).parent))
from helpers_graphs import write_cycle_graph  # noqa: E402


def test_asking_for_a_missing_gpu_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error case cannot happen")
    from job.cli import main

    raw = write_cycle_graph(tmp_path, num_gpus=1, device="auto")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    code = main(["train", str(path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "CUDA is not available" in err and "num_gpus=1" in err


def test_train_starts_one_process_per_gpu_only_when_asked_and_present() -> None:
    from job.train.elastic.launch import gpu_processes

    assert gpu_processes(4, "auto", 8, False) == 4
    assert gpu_processes(8, "auto", 2, False) == 2  # no more processes than cards
    assert gpu_processes(4, "auto", 0, False) == 1  # no card: the trainer's clean "CUDA is not available" error
    assert gpu_processes(4, "auto", 4, True) == 1  # under torchrun the launcher chose the processes
    assert gpu_processes(4, "cpu", 4, False) == 1
    assert gpu_processes(1, "cuda", 4, False) == 1


def test_gpu_processes_need_two_partitions_each() -> None:
    from job.train.elastic.launch import partition_advice

    raw = {"entities": {"node": {"num_partitions": 4}}, "relations": [{"name": "r", "lhs": "node", "rhs": "node"}],
           "dimension": 4, "entity_path": "x", "edge_paths": ["x"], "checkpoint_path": "x"}
    assert partition_advice(parse_config(raw), 2) == ""
    assert "num_partitions >= 6" in partition_advice(parse_config(raw), 3)
    raw["entities"]["node"]["num_partitions"] = 1
    assert "some GPUs will wait" in partition_advice(parse_config(raw), 2)
