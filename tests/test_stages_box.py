"""The whole path in the cluster in a box (tests/cluster_box.py): UMLS as a raw TSV on a moto S3, then the Jobs that
``biggraph submit --stages import,train,eval,archive`` renders, run one after another as Kubernetes would run them
(import on 2 pods, training on 2 torchrun pods, eval and archive on one pod each), and at the end ``biggraph query``
of the archive on S3 answers a nearest-neighbour query.

On the way one pod is lost in each parallel stage (the box SIGKILLs every process of it; the Job controller starts a
fresh pod at its index), at the moments held by tests/box_hooks: an import pod with its bucket file written but not
committed, a training pod right after training a bucket. Each costs only its own work: the import's replacement pod
reads no shard and builds no dictionary again, and the import's files are byte for byte those of an undisturbed
(one-process) import of the same TSV; training re-forms its group, trains every bucket of every epoch once and
commits its last version. Needs root and iproute2 (skipped otherwise)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_box import ClusterBox, RenderedJob, available, free_subnet
from conftest import TEST_AWS_ENV
from helpers_distributed import buckets_per_epoch
from test_k8s_cli import use_helm

import storage_adapters as storage
from job.cli import main
from job.k8s.committed import committed_output
from storage_adapters import StorageSettings, using

STAGES = ("import", "train", "eval", "archive")
IMPORT_ARGS = ["-l", "0", "--rel-col", "1", "-r", "2"]
HOOKS = Path(__file__).parent / "box_hooks"
LOST = 1  # the index of the pod lost in the import and in training
EPOCHS = 2
PARTITIONS = 2


def _files(prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix`` (relative name -> bytes)."""
    fs, path = storage.get_filesystem(prefix)
    return {name[len(path):].lstrip("/"): fs.cat_file(name) for name in fs.find(path)}


def _lose_a_pod(box: ClusterBox, hold: Path, timeout_s: float = 300.0) -> None:
    """Once the held pod is at its hold point, SIGKILL all of it, then let its replacement run on."""
    deadline = time.monotonic() + timeout_s
    while not Path(f"{hold}.held").exists():
        assert box.failed_reason is None and not box.complete, f"the pod was never held\n{box.tail()}"
        assert time.monotonic() < deadline, f"the pod was not held in {timeout_s:.0f} s\n{box.tail()}"
        time.sleep(0.05)
    box.kill(LOST)
    hold.unlink()


def _check_import(box: ClusterBox, config: dict[str, Any], tmp_path: Path) -> None:
    """The lost import pod cost only its own unit; the output equals an undisturbed one-process import's."""
    first, second = (box.root / "logs" / f"{box.hostname(LOST)}-{n}.log" for n in (0, 1))
    lost_log, replacement_log = first.read_text(), second.read_text()
    assert "import: dictionary of" in lost_log, lost_log[-2000:]
    assert "import: group" not in replacement_log and "import: dictionary of" not in replacement_log, replacement_log
    assert "phase 3 (buckets)" in replacement_log, replacement_log
    reference = {**config, "entity_path": "s3://umls/ref/entities", "edge_paths": ["s3://umls/ref/edges"]}
    path = tmp_path / "reference.yaml"
    path.write_text(yaml.safe_dump(reference))
    assert main(["import", str(path), "s3://umls/raw/train.tsv", *IMPORT_ARGS]) == 0
    marker = ".biggraph-import.json"
    for ours, theirs in ((config["entity_path"], reference["entity_path"]),
                         (config["edge_paths"][0], reference["edge_paths"][0])):
        got, expected = _files(ours), _files(theirs)
        assert got and sorted(got) == sorted(expected)
        assert [n for n in got if got[n] != expected[n] and n != marker] == []
        if marker in got:  # its fingerprint names the output paths; what was imported is the same
            assert json.loads(got[marker])["summary"] == json.loads(expected[marker])["summary"]


def _check_training(box: ClusterBox, checkpoint: str) -> None:
    """The lost training pod was replaced; every bucket of every epoch trained once; the last version committed."""
    from job.formats.checkpoint import CheckpointStorage
    from job.train.schedule.orders import all_buckets

    assert (box.root / "logs" / f"{box.hostname(LOST)}-1.log").exists(), "no replacement pod started"
    assert [e.kind for e in box.events if e.index == LOST][:3] == ["start", "kill", "exit"]
    stored = CheckpointStorage(checkpoint)
    assert stored.load_version() == EPOCHS
    per_epoch = buckets_per_epoch(stored.load_stats())
    assert sorted(per_epoch) == list(range(EPOCHS))
    for epoch, buckets in per_epoch.items():
        assert sorted(buckets) == sorted(all_buckets(PARTITIONS, PARTITIONS)), epoch


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
            "entities": {"all": {"num_partitions": PARTITIONS}},
            "relations": [{"name": "all_edges", "lhs": "all", "rhs": "all", "operator": "complex_diagonal"}],
            "dynamic_relations": True, "dimension": 16, "global_emb": False, "comparator": "dot",
            "num_epochs": EPOCHS, "batch_size": 500, "workers": 1, "eval_fraction": 0.0,
            "storage_options": {"endpoint_url": endpoint},
            "entity_path": "s3://umls/g/entities", "edge_paths": ["s3://umls/g/edges"],
            "checkpoint_path": "s3://umls/g/checkpoints",
        }
        path = tmp_path / "umls.yaml"
        path.write_text(yaml.safe_dump(config))
        here_config = {**config, "storage_options": options}  # the same config as this process reaches the store
        here = tmp_path / "umls-here.yaml"
        here.write_text(yaml.safe_dump(here_config))
        assert main(["submit", str(path), "--name", "umls", "--stages", ",".join(STAGES), "--dry-run",
                     "--helm", use_helm(tmp_path, monkeypatch),
                     "--replicas", "2", "--set", "s3.existingSecret=s3", "--set", f"s3.endpointUrl={endpoint}",
                     "--set", "importer.files={s3://umls/raw/train.tsv}",
                     "--set", "importer.args={" + ",".join(IMPORT_ARGS) + "}",
                     "--set", "eval.out=s3://umls/run/eval.json", "--set", "archive.out=s3://umls/run/model.zip",
                     "--set", "torchrun.rdzvConf.join_timeout=120"]) == 0
        docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
        secrets = {"s3": {k: TEST_AWS_ENV[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}}
        for stage in STAGES:
            stage_docs = [d for d in docs if d["metadata"]["name"].startswith(f"umls-{stage}")]
            job = next(d for d in stage_docs if d["kind"] == "Job")
            with using(StorageSettings(options=options)):
                assert committed_output(stage, job, str(here)) is None, stage
            hold = tmp_path / f"hold-{stage}"
            env = {"BIGGRAPH_NATIVE_CACHE": str(tmp_path / "native"), "PYTHONPATH": f"{HOOKS}:{HOOKS.parent.parent}"}
            if stage in ("import", "train"):
                hold.touch()
                env.update({"BIGGRAPH_BOX_HOLD_FILE": str(hold), "BIGGRAPH_BOX_HOLD_INDEX": str(LOST),
                            "BIGGRAPH_BOX_HOLD_AT": stage, "BIGGRAPH_BOX_HOLD_FIRST": "1"})
            box = ClusterBox(RenderedJob.from_docs(stage_docs), tmp_path / stage, max_replicas=2, subnet=subnet,
                             secrets=secrets, extra_env=env)
            boxes.append(box)
            box.start()
            if stage in ("import", "train"):
                _lose_a_pod(box, hold)
            box.wait(600)
            box.close()  # the next stage's pods take the same subnet
            boxes.remove(box)
            done.append(box)
            with capsys.disabled():  # what each stage's events were (with -s)
                print(f"{stage}: {[(round(e.at - box.events[0].at, 1), e.kind, e.index) for e in box.events]}")
            with using(StorageSettings(options=options)):  # what a resubmit would skip now
                assert committed_output(stage, job, str(here)), stage
                if stage == "import":
                    _check_import(box, here_config, tmp_path)
                    capsys.readouterr()  # the reference import's report
                elif stage == "train":
                    _check_training(box, config["checkpoint_path"])
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
