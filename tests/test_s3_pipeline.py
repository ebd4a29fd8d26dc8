"""Every command on S3 with the endpoint given only by the config's ``storage_options`` (or ``--storage-option``).

Before storage settings travelled with the config, commands read a process-wide setting that only some of them
set: `biggraph import` answered "the bucket does not exist" for a MinIO/Ceph endpoint that `train` found. Here no
ambient endpoint exists (the test's scope has no options; AWS_ENDPOINT_URL* are unset by the moto fixture and the
S3 default would be AWS itself), so each command must take it from what it is given.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from storage_scope import use_storage

import storage_adapters as storage
from job.archive import list_tags
from job.cli import main

pytestmark = pytest.mark.slow


@pytest.fixture
def bucket(moto_endpoint: str) -> str:
    import s3fs

    name = f"pipe-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(endpoint_url=moto_endpoint, skip_instance_cache=True).mkdir(name)
    use_storage({})  # nothing ambient: each command must use the options it is given
    return name


def _config(tmp_path: Path, bucket: str, endpoint: str) -> Path:
    base = f"s3://{bucket}/graph"
    config = {
        "entity_path": f"{base}/entities", "edge_paths": [f"{base}/edges"], "checkpoint_path": f"{base}/ckpt",
        "entities": {"node": {"num_partitions": 2}},
        "relations": [{"name": "r", "lhs": "node", "rhs": "node", "operator": "translation"}],
        "dynamic_relations": True, "global_emb": False, "dimension": 8, "num_epochs": 2, "workers": 1,
        "eval_fraction": 0.0, "edge_read_mode": "stream",
        "storage_options": {"endpoint_url": endpoint},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _upload_edges(bucket: str, endpoint: str) -> str:
    import s3fs

    lines = [f"n{i}\tr{i % 3}\tn{(i * 7 + 1) % 60}" for i in range(600)]
    url = f"s3://{bucket}/raw/edges.tsv"
    s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True).pipe(url[5:], ("\n".join(lines) + "\n").encode())
    return url


def _ok(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, f"{argv[0]}: exit {code}: {captured.err[-2000:]}"
    return captured.out


def test_every_command_on_s3_with_the_endpoint_only_in_storage_options(
        bucket: str, moto_endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = str(_config(tmp_path, bucket, moto_endpoint))
    edges = _upload_edges(bucket, moto_endpoint)
    _ok(["import", cfg, edges, "--lhs-col", "0", "--rel-col", "1", "--rhs-col", "2"], capsys)
    assert "ok:" in _ok(["validate", cfg], capsys)
    _ok(["train", cfg], capsys)
    metrics = json.loads(_ok(["eval", cfg, "--candidates", "all", "--json"], capsys))
    assert metrics["count"] == 600 and 0 < metrics["mrr"] <= 1
    _ok(["export", cfg, "--out", f"s3://{bucket}/export", "--format", "npy"], capsys)
    _ok(["archive", cfg, "--out", f"s3://{bucket}/model.zip"], capsys)
    report = tmp_path / "report.html"
    _ok(["report", f"s3://{bucket}/graph/ckpt", "--config", cfg, "--out", str(report)], capsys)
    assert "<html" in report.read_text()[:200].lower()
    with storage.using(storage.StorageSettings(options={"endpoint_url": moto_endpoint})):
        assert list_tags(f"s3://{bucket}/model.zip")  # a readable model archive
    # convert-legacy: legacy counts written locally, converted onto S3 with --storage-option
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    torch.save(7, legacy / "entity_count_node_0.pt")
    _ok(["convert-legacy", "--entity-path", str(legacy), "--out", f"s3://{bucket}/converted",
         "--storage-option", f"endpoint_url={moto_endpoint}"], capsys)
    with storage.using(storage.StorageSettings(options={"endpoint_url": moto_endpoint})):
        assert storage.read_text(f"s3://{bucket}/converted/entity_count_node_0.txt").strip() == "7"


def test_a_missing_bucket_is_called_a_bucket(moto_endpoint: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    use_storage({})
    cfg = str(_config(tmp_path, "no-such-bucket-anywhere", moto_endpoint))
    for command in (["validate", cfg], ["train", cfg]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "the bucket 'no-such-bucket-anywhere' does not exist" in err and "directory not found" not in err, err
        assert "Traceback" not in err

