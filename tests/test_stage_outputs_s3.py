"""The one-pod stages on S3 (a real moto server): the commands the chart renders for eval, export and archive, run
as the pods run them, read a checkpoint on S3 and leave their output on S3; the submitter's check then finds each
output committed (a resubmit skips the stage)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers_graphs import write_cycle_files
from test_chart import render

import storage_adapters as storage
from job.cli import main
from job.config import parse_config
from job.formats.checkpoint import CheckpointStorage
from job.k8s.committed import POD_CONFIG, committed_output, pod_command
from job.model.scoring import Model


def write_s3_checkpoint(root: str, endpoint: str) -> dict:
    """A cycle graph (2 partitions) and one committed checkpoint version of random tables, all under ``root``."""
    raw = {
        "entities": {"node": {"num_partitions": 2}},
        "relations": [{"name": f"r{r}", "lhs": "node", "rhs": "node", "operator": "translation"} for r in range(2)],
        "dimension": 8, "entity_path": f"{root}/entities", "edge_paths": [f"{root}/edges"],
        "checkpoint_path": f"{root}/checkpoints", "memory_budget": "64MiB", "workers": 1,
        "storage_options": {"endpoint_url": endpoint},
    }
    write_cycle_files(raw["entity_path"], raw["edge_paths"][0], 40, 2, 2)
    config = parse_config(raw)
    counts = [int(storage.read_text(f"{root}/entities/entity_count_node_{p}.txt")) for p in range(2)]
    rng = np.random.default_rng(0)
    checkpoint = CheckpointStorage(config.checkpoint_path)
    checkpoint.prepare()
    checkpoint.save_config(config.to_json())
    for part, count in enumerate(counts):
        checkpoint.save_entity_partition(1, "node", part, rng.normal(size=(count, 8)).astype(np.float32))
    state = {name: (private, rng.normal(size=tuple(tensor.shape)).astype(np.float32))
             for name, (private, tensor) in Model(config, 0).public_state_dict().items()}
    checkpoint.save_model(1, state, None, {"config/json": config.to_json()})
    checkpoint.save_version(1)
    return raw


@pytest.mark.slow
def test_eval_export_archive_stages_read_and_write_s3(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    raw = write_s3_checkpoint(f"{s3_bucket}/g", s3_endpoint)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    out = f"{s3_bucket}/run"
    values = {"config": raw, "eval": {"out": f"{out}/eval.json", "candidates": "all"},
              "export": {"out": f"{out}/export", "format": "tsv"}, "archive": {"out": f"{out}/model.zip", "dtype": "fp16"}}
    for stage in ("eval", "export", "archive"):
        job = next(d for d in render(tmp_path, extra={**values, "stage": stage}) if d["kind"] == "Job")
        assert committed_output(stage, job, str(config_path)) is None
        argv = [str(config_path) if a == POD_CONFIG else a for a in pod_command(job)]
        assert main(argv) == 0, stage
        assert committed_output(stage, job, str(config_path))  # a resubmit now skips it
    metrics = json.loads(storage.read_text(f"{out}/eval.json"))
    assert metrics["count"] == 80 and 0 < metrics["mrr"] <= 1
    rows = storage.read_text(f"{out}/export/entity_embeddings.tsv").splitlines()
    assert len(rows) == 40 and len(rows[0].split("\t")) == 9
    assert json.loads(storage.read_text(f"{out}/export/manifest.json"))["checkpoint_version"] == 1
    from job.archive import list_tags

    assert list_tags(f"{out}/model.zip") == ["v1-fp16"]
