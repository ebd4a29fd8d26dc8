"""The whole path in the cluster in a box (tests/cluster_box.py): UMLS as a raw TSV on a moto S3, then the Jobs that
``biggraph submit --stages import,train,eval,archive`` renders, run one after another as Kubernetes would run them
(import on 2 pods, training on 2 torchrun pods, eval and archive on one pod each), and at the end ``biggraph query``
of the archive on S3 answers a nearest-neighbour query. Needs root and iproute2 (skipped otherwise)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from cluster_box import ClusterBox, RenderedJob, available, free_subnet
from conftest import TEST_AWS_ENV
from test_k8s_cli import use_helm

import storage_adapters as storage
from job.cli import main
from job.k8s.committed import committed_output
from storage_adapters import StorageSettings, using

STAGES = ("import", "train", "eval", "archive")


@pytest.mark.slow
@pytest.mark.skipif(available() is not None, reason=str(available()))
def test_raw_tsv_on_s3_to_a_queried_archive_through_the_rendered_stages(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from moto.server import ThreadedMotoServer

    from job.data.datasets import dataset_dir

    for key, value in TEST_AWS_ENV.items():
        monkeypatch.setenv(key, value)
    subnet = free_subnet()
    server = ThreadedMotoServer(ip_address="0.0.0.0", port=0, verbose=False)  # the pods dial the bridge's .1
    server.start()
    boxes: list[ClusterBox] = []  # not closed yet
    done: list[ClusterBox] = []
    try:
        port = server.get_host_and_port()[1]
        endpoint = f"http://{subnet}.1:{port}"  # the pods': the host on the box's bridge, while a box stands
        options = {"endpoint_url": f"http://127.0.0.1:{port}"}  # this process's
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir("umls")
        with using(StorageSettings(options=options)):
            with open(os.path.join(dataset_dir("umls"), "train.txt"), "rb") as raw:
                storage.write_bytes("s3://umls/raw/train.tsv", raw.read())
        config = {
            "entities": {"all": {"num_partitions": 2}},
            "relations": [{"name": "all_edges", "lhs": "all", "rhs": "all", "operator": "complex_diagonal"}],
            "dynamic_relations": True, "dimension": 16, "global_emb": False, "comparator": "dot", "num_epochs": 2,
            "batch_size": 500, "workers": 1, "eval_fraction": 0.0, "storage_options": {"endpoint_url": endpoint},
            "entity_path": "s3://umls/g/entities", "edge_paths": ["s3://umls/g/edges"],
            "checkpoint_path": "s3://umls/g/checkpoints",
        }
        path = tmp_path / "umls.yaml"
        path.write_text(yaml.safe_dump(config))
        here = tmp_path / "umls-here.yaml"  # the same config as this process reaches the store
        here.write_text(yaml.safe_dump({**config, "storage_options": options}))
        assert main(["submit", str(path), "--name", "umls", "--stages", ",".join(STAGES), "--dry-run",
                     "--helm", use_helm(tmp_path, monkeypatch),
                     "--replicas", "2", "--set", "s3.existingSecret=s3", "--set", f"s3.endpointUrl={endpoint}",
                     "--set", "importer.files={s3://umls/raw/train.tsv}",
                     "--set", "importer.args={-l,0,--rel-col,1,-r,2}",
                     "--set", "eval.out=s3://umls/run/eval.json", "--set", "archive.out=s3://umls/run/model.zip",
                     "--set", "torchrun.rdzvConf.join_timeout=120"]) == 0
        docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
        secrets = {"s3": {k: TEST_AWS_ENV[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}}
        for stage in STAGES:
            stage_docs = [d for d in docs if d["metadata"]["name"].startswith(f"umls-{stage}")]
            job = next(d for d in stage_docs if d["kind"] == "Job")
            with using(StorageSettings(options=options)):
                assert committed_output(stage, job, str(here)) is None, stage
            box = ClusterBox(RenderedJob.from_docs(stage_docs), tmp_path / stage, max_replicas=2, subnet=subnet,
                             secrets=secrets, extra_env={"BIGGRAPH_NATIVE_CACHE": str(tmp_path / "native")})
            boxes.append(box)
            box.start()
            box.wait(600)
            box.close()  # the next stage's pods take the same subnet
            boxes.remove(box)
            done.append(box)
            with using(StorageSettings(options=options)):  # what a resubmit would skip now
                assert committed_output(stage, job, str(here)), stage
        assert [box.job.replicas for box in done] == [2, 2, 1, 1]
        with using(StorageSettings(options=options)):
            metrics = json.loads(storage.read_text("s3://umls/run/eval.json"))
            name = json.loads(storage.read_text("s3://umls/g/entities/entity_names_all_0.json"))[0]
        assert metrics["count"] > 0 and 0 < metrics["mrr"] <= 1
        assert main(["query", "s3://umls/run/model.zip", "--nearest", name, "-k", "5", "--json",
                     "--storage-option", f"endpoint_url={options['endpoint_url']}"]) == 0
        answer = json.loads(capsys.readouterr().out)
        assert len(answer["neighbours"]) == 5
    finally:
        for box in boxes:
            box.close()
        server.stop()
