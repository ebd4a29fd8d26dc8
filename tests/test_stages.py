"""``biggraph submit --stages``: one Job per stage, in order, against kmock (the fake Kubernetes API server of
tests/test_k8s_cli.py) with the real helm; outputs on fsspec's in-process memory:// store, which both this
process (the submitter's checks) and the test read.

The fake server runs no controllers: ``Controller`` plays the Job controller, finishing each Job it sees after a
few looks (or failing the one of a chosen stage, with the failure condition and pod exit code Kubernetes records).
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_k8s_cli import NS, FakeCluster, cluster, helm_on_path, kmock, write_user_config  # noqa: F401 (fixtures)

import storage_adapters as storage
from job.cli import main
from job.config import load_config
from job.data.export.writers import MANIFEST
from job.data.importing import import_edges
from job.data.importing.options import ImportOptions

COLUMNS = "{-l,0,--rel-col,1,-r,2}"


class Controller:
    """Finishes every Job of the namespace after ``looks`` polls (``fail``: the stage whose Job fails instead), and
    records, as each Job appears, whether every Job before it had already completed."""

    def __init__(self, fake: FakeCluster, fail: str | None = None, looks: int = 3) -> None:
        self.fake, self.fail, self.looks = fake, fail, looks
        self.pending: dict[str, int] = {}  # unfinished Jobs: how many times seen
        self.order: list[str] = []
        self.earlier_done: list[bool] = []
        self.error: Exception | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Controller:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(5)
        assert self.error is None, f"the stand-in Job controller failed: {self.error!r}"

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as err:  # reported by __exit__: a controller that died would hang the submitter
            self.error = err
            raise

    def _loop(self) -> None:
        while not self.stop.is_set():
            for job in self.fake.batch.list_namespaced_job(NS).items:
                name = job.metadata.name
                if job.status and job.status.conditions:
                    continue  # finished (by this controller, or before it started)
                if name not in self.pending:
                    self.order.append(name)
                    self.earlier_done.append(not self.pending)  # no other Job was still running
                    self.pending[name] = 0
                self.pending[name] += 1
                if self.pending[name] >= self.looks:
                    self._finish(name, failed=name.endswith(f"-{self.fail}"))
                    del self.pending[name]
            time.sleep(0.05)

    def _finish(self, name: str, failed: bool) -> None:
        if failed:
            self.fake.core.create_namespaced_pod(NS, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"{name}-0-xyz12", "labels": {"job-name": name},
                             "annotations": {"batch.kubernetes.io/job-completion-index": "0"}},
                "spec": {"containers": [{"name": "trainer", "image": "x"}]},
                "status": {"phase": "Failed", "containerStatuses": [
                    {"name": "trainer", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
                     "state": {"terminated": {"exitCode": 2, "reason": "Error"}}}]}})
            condition = {"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
                         "message": f"Container trainer for pod {NS}/{name}-0-xyz12 failed with exit code 2 "
                                    "matching FailJob rule at index 0"}
            self.fake.batch.patch_namespaced_job_status(name, NS, {"status": {"failed": 1, "conditions": [condition]}})
        else:
            self.fake.batch.patch_namespaced_job_status(name, NS, {"status": {"succeeded": 1, "conditions": [
                {"type": "Complete", "status": "True"}]}})


@pytest.fixture()
def staged(tmp_path: Path) -> tuple[Path, str]:
    """A config on memory://, its raw TSV there too, and the root of the outputs."""
    root = f"memory://{tmp_path.name}"
    path, _ = write_user_config(tmp_path, root)
    storage.write_text(f"{root}/raw/edges.tsv", "".join(f"n{i}\tr0\tn{(i * 7 + 1) % 40}\n" for i in range(200)))
    return path, root


def stage_values(root: str) -> list[str]:
    return ["--set", f"importer.files={{{root}/raw/edges.tsv}}", "--set", f"importer.args={COLUMNS}",
            "--set", f"eval.out={root}/out/eval.json", "--set", f"export.out={root}/out/export",
            "--set", f"archive.out={root}/out/model.zip", "--set", "archive.tag=first"]


def submit_stages(fake: FakeCluster, path: Path, root: str, stages: str, *extra: str) -> int:
    return main(fake.cli("submit", str(path), "--name", "pipe", "--stages", stages, "--poll-seconds", "0.05",
                         *stage_values(root), *extra))


def test_stages_run_in_order_each_after_the_one_before_completed(cluster: FakeCluster, staged: Any,  # noqa: F811
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path, root = staged
    with Controller(cluster) as controller:
        code = submit_stages(cluster, path, root, "import,train,eval,export,archive", "--replicas", "2",
                             "--queue", "team-a-q")
    assert code == 0
    assert controller.order == ["pipe-import", "pipe-train", "pipe-eval", "pipe-export", "pipe-archive"]
    assert all(controller.earlier_done)  # no stage's Job existed before the one before it had completed
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "stage import: submitted job pipe-import (2 pod(s)) to namespace team-a"
    assert out[-1] == "stage archive: complete" and len(out) == 10
    jobs = {job.metadata.name: job for job in cluster.batch.list_namespaced_job(NS).items}
    for stage, pods in (("import", 2), ("train", 2), ("eval", 1), ("export", 1), ("archive", 1)):
        job = jobs[f"pipe-{stage}"]
        assert job.spec.parallelism == pods
        # Kueue admits each stage: every Job is queued and created suspended
        assert job.metadata.labels["kueue.x-k8s.io/queue-name"] == "team-a-q" and job.spec.suspend is True
        assert job.metadata.labels["app.kubernetes.io/instance"] == "pipe"  # one release: `cancel pipe` takes all
    args = jobs["pipe-eval"].spec.template.spec.containers[0].args
    assert args == ["biggraph", "eval", "/etc/biggraph/config.yaml", "--json", "--out", f"{root}/out/eval.json"]
    assert main(cluster.cli("status", "pipe", "--json")) == 0  # all complete: the last stage
    report = json.loads(capsys.readouterr().out)
    assert report["stage"] == "archive" and report["job"] == "pipe-archive" and report["state"] == "Complete"
    assert main(cluster.cli("cancel", "pipe")) == 0
    assert cluster.names("Job") == set() and cluster.names("ConfigMap") == set()


def test_a_failed_stage_stops_the_rest_with_one_line(cluster: FakeCluster, staged: Any,  # noqa: F811
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path, root = staged
    with Controller(cluster, fail="train") as controller:
        code = submit_stages(cluster, path, root, "train,eval,archive")
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert err == ("biggraph submit: error: stage train failed (job pipe-train): PodFailurePolicy: Container trainer "
                   f"for pod {NS}/pipe-train-0-xyz12 failed with exit code 2 matching FailJob rule at index 0; pod "
                   "pipe-train-0-xyz12: exit 2 (Error); not run: eval, archive")
    assert controller.order == ["pipe-train"] and cluster.names("Job") == {"pipe-train"}
    # status and logs follow the stage that stopped the run
    assert main(cluster.cli("status", "pipe")) == 0
    assert capsys.readouterr().out.startswith("job pipe stage train (job pipe-train) (team-a): Failed")
    cluster.emulator[kmock.path(re.compile(r".*/pods/pipe-train-0-xyz12/log$"))] << b"bad edge file\n"
    assert main(cluster.cli("logs", "pipe")) == 0
    assert capsys.readouterr().out == "bad edge file\n"
    # a resubmit under the same name runs the failed stage again (its old Job replaced), then the rest
    with Controller(cluster) as controller:
        assert submit_stages(cluster, path, root, "train,eval,archive") == 0
    out = capsys.readouterr().out
    assert "stage train: deleted job pipe-train of an earlier submission (failed) to run the stage again" in out
    assert controller.order == ["pipe-train", "pipe-eval", "pipe-archive"] and all(controller.earlier_done)


def test_a_resubmit_skips_the_stages_whose_output_is_committed(cluster: FakeCluster, staged: Any,  # noqa: F811
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    path, root = staged
    # what the import pods and the eval and export pods would have left: the real import of the same request
    # (the marker of its fingerprint), the metrics JSON and the export's manifest (written last)
    import_edges(load_config(str(path)), [f"{root}/raw/edges.tsv"], ImportOptions(lhs_col=0, rel_col=1, rhs_col=2))
    storage.write_text(f"{root}/out/eval.json", json.dumps({"mrr": 0.5}))
    storage.write_text(f"{root}/out/export/{MANIFEST}", "{}")
    with Controller(cluster) as controller:
        assert submit_stages(cluster, path, root, "import,eval,export") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("stage import: skipped, its output is committed (") and ".biggraph-import.json" in out[0]
    assert out[1:] == [f"stage eval: skipped, its output is committed ({root}/out/eval.json exists)",
                       f"stage export: skipped, its output is committed ({root}/out/export/{MANIFEST} exists)"]
    assert controller.order == [] and cluster.names("Job") == set()
    # another import request (other columns) is not the committed one: that stage runs, the others stay skipped
    storage.remove(f"{root}/out/eval.json")
    with Controller(cluster) as controller:
        assert submit_stages(cluster, path, root, "import,eval,export", "--set", "importer.args={-l,2,-r,0}") == 0
    assert controller.order == ["pipe-import", "pipe-eval"]
    assert "stage export: skipped" in capsys.readouterr().out


def test_stage_lists_are_checked_before_anything_is_created(cluster: FakeCluster, staged: Any,  # noqa: F811
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path, root = staged
    for stages, message in (("train,import", "each stage once, in the order import,train,eval,export,archive"),
                            ("train,serve", "unknown stage serve")):
        assert submit_stages(cluster, path, root, stages) == 2
        assert message in capsys.readouterr().err
    assert submit_stages(cluster, path, root, "train", "--set", "stage=eval") == 2
    assert "leave stage and fullnameOverride out of --set" in capsys.readouterr().err
    assert main(cluster.cli("submit", str(path), "--name", "x" * 50, "--stages", "train")) == 2
    assert "at most 48 characters" in capsys.readouterr().err
    assert submit_stages(cluster, path, root, "train", "--set", "persistence.enabled=true") == 2
    assert "--stages with persistence.enabled needs persistence.existingClaim" in capsys.readouterr().err
    assert cluster.names("Job") == set()


def test_dry_run_of_stages_prints_every_stage(staged: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path, root = staged
    assert main(["submit", str(path), "--name", "pipe", "--stages", "import,train,archive", "--dry-run",
                 *stage_values(root)]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    jobs = [d for d in docs if d["kind"] == "Job"]
    assert [j["metadata"]["name"] for j in jobs] == ["pipe-import", "pipe-train", "pipe-archive"]
    secrets = [d for d in docs if d["kind"] == "Secret"]  # the group secret helm generated is not printed
    assert secrets and all(s["data"] == {"secret": "<redacted>"} for s in secrets)
