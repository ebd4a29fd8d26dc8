"""biggraph submit/status/logs/cancel against kmock (an HTTP-level fake of the Kubernetes API server)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from job.cli import main
from job.config import load_config
from job.errors import UserError
from job.formats.checkpoint import CheckpointStorage
from job.k8s.cluster import ClusterAccess
from job.k8s.jobs import SubmitOptions, submit
from job.k8s.preflight import check_storage
from job.k8s.render import RenderOptions

kmock = pytest.importorskip("kmock", reason="pip install kmock (the fake API server these tests use)")
kubernetes = pytest.importorskip("kubernetes")

NS = "team-a"
# what the fake API server serves (and tells in its discovery): the kinds the chart renders, and pods
RESOURCES = {"v1/pods": "Pod", "v1/configmaps": "ConfigMap", "v1/services": "Service",
             "v1/serviceaccounts": "ServiceAccount", "v1/persistentvolumeclaims": "PersistentVolumeClaim",
             "batch/v1/jobs": "Job", "networking.k8s.io/v1/networkpolicies": "NetworkPolicy", "v1/secrets": "Secret"}


def _patch_watch_query() -> None:
    """kmock treats only ?watch=true (lowercase) as a watch; kubernetes-client <37 sends watch=True."""
    from kmock._internal import parsing

    if getattr(parsing.guess_k8s, "_biggraph_shim", False):
        return
    original = parsing.guess_k8s

    def guess_k8s(k8s: Any, method: Any, query: dict[str, str]) -> Any:
        if "watch" in query:
            query = {**query, "watch": query["watch"].lower()}
        return original(k8s, method, query)

    guess_k8s._biggraph_shim = True  # type: ignore[attr-defined]
    parsing.guess_k8s = guess_k8s


def version_info(minor: str) -> dict[str, str]:
    """The API server's /version answer (managed clusters report minors such as "34+")."""
    return {"major": "1", "minor": minor, "gitVersion": f"v1.{minor.rstrip('+')}.2", "gitCommit": "0" * 40,
            "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.25",
            "compiler": "gc", "platform": "linux/amd64"}


class FakeCluster:
    def __init__(self, emulator: Any, url: str, kubeconfig: Path, state: dict[str, Any]) -> None:
        self.emulator = emulator
        self.url = url
        self.kubeconfig = kubeconfig
        self.state = state
        configuration = kubernetes.client.Configuration()
        configuration.host = url
        api = kubernetes.client.ApiClient(configuration)
        self.core = kubernetes.client.CoreV1Api(api)
        self.batch = kubernetes.client.BatchV1Api(api)
        self.networking = kubernetes.client.NetworkingV1Api(api)

    def set_kube_minor(self, minor: str | None) -> None:
        """What /version answers from now on; None: no minor (a server build that does not say)."""
        self.state["minor"] = minor

    def cli(self, *args: str) -> list[str]:
        return [*args, "--kubeconfig", str(self.kubeconfig)]

    def names(self, kind: str) -> set[str]:
        lister = {"Job": self.batch.list_namespaced_job, "ConfigMap": self.core.list_namespaced_config_map,
                  "Service": self.core.list_namespaced_service, "Pod": self.core.list_namespaced_pod,
                  "NetworkPolicy": self.networking.list_namespaced_network_policy}[kind]
        return {item.metadata.name for item in lister(NS).items}

    def add_pod(self, job: str, index: int, phase: str = "Running", log: str = "") -> None:
        name = f"{job}-{index}-abcde"
        self.core.create_namespaced_pod(NS, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"job-name": job, "batch.kubernetes.io/job-name": job},
                         "annotations": {"batch.kubernetes.io/job-completion-index": str(index)}},
            "spec": {"containers": [{"name": "trainer", "image": "x"}], "nodeName": f"node-{index}"},
            "status": {"phase": phase, "containerStatuses": [
                {"name": "trainer", "ready": True, "restartCount": index, "image": "x", "imageID": "",
                 "state": {"running": {}}}]},
        })
        if log:
            self.emulator[kmock.path(re.compile(rf".*/pods/{name}/log$"))] << log.encode()


def write_kubeconfig(path: Path, server: str, namespace: str = NS) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "me", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "me", "namespace": namespace}}],
    }))
    return path


@pytest.fixture(autouse=True)
def helm_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The real helm binary on PATH (submit renders the chart with it), its home directories under ``tmp_path``;
    the test is skipped without it."""
    helm = use_helm(tmp_path, monkeypatch)
    monkeypatch.setenv("PATH", f"{Path(helm).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return helm


@pytest.fixture()
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCluster]:
    _patch_watch_query()
    for name in ("aiohttp.access", "aiohttp.server", "aiohttp.web"):  # the fake server's request log
        monkeypatch.setattr(logging.getLogger(name), "disabled", True)
    ready = threading.Event()
    state: dict[str, Any] = {"minor": "31"}  # the oldest supported minor

    def serve() -> None:
        async def run() -> None:
            async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
                state["emulator"], state["url"] = emulator, str(server.url).rstrip("/")
                for resource, kind in RESOURCES.items():  # listable while still empty, as on a real server, and
                    emulator.resources[resource] = {  # in the discovery the dynamic client reads
                        "kind": kind, "namespaced": True, "verbs": ["create", "delete", "get", "list", "patch"]}

                def version() -> Any:  # None: a /version without a minor (a build that does not say)
                    return version_info(state.get("minor") or "")

                emulator[kmock.path(re.compile(r"^/version/?$"))] << version
                emulator[kmock.path(re.compile(r".*/namespaces/forbidden-ns/.*"))] << 403 << {
                    "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
                    "message": 'jobs.batch is forbidden: User "me" cannot create resource "jobs"'}
                ready.set()
                while not state.get("stop"):
                    await asyncio.sleep(0.02)

        asyncio.run(run())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(15), "kmock did not start"
    try:
        yield FakeCluster(state["emulator"], state["url"], write_kubeconfig(tmp_path / "kubeconfig", state["url"]),
                          state)
    finally:
        state["stop"] = True
        thread.join(5)


def write_user_config(tmp_path: Path, root: str) -> tuple[Path, dict[str, Any]]:
    raw = {
        "entities": {"node": {"num_partitions": 2}},
        "relations": [{"name": "r0", "lhs": "node", "rhs": "node", "operator": "translation"}],
        "dimension": 8, "num_epochs": 3,
        "entity_path": f"{root}/graph/entities", "edge_paths": [f"{root}/graph/edges"],
        "checkpoint_path": f"{root}/graph/checkpoints",
    }
    path = tmp_path / "mygraph.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, raw


@pytest.fixture()
def user_config(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A config the pods can reach: object storage (fsspec's in-process memory:// stands in for s3://, so that
    ``status`` reads the progress this process writes there)."""
    return write_user_config(tmp_path, f"memory://{tmp_path.name}")


@pytest.fixture()
def local_config(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A config of local paths (what ``biggraph demo`` leaves): the pods reach them only on a mounted volume."""
    return write_user_config(tmp_path, str(tmp_path))


def created_job(cluster: FakeCluster, name: str) -> Any:
    return cluster.batch.read_namespaced_job(name, NS)


# submit ----------------------------------------------------------------------------------------------


def check_submitted(cluster: FakeCluster, name: str, raw: dict[str, Any], replicas: int, image: str) -> None:
    job = created_job(cluster, name)
    assert job.spec.completion_mode == "Indexed"
    assert job.spec.completions == job.spec.parallelism == replicas
    container = job.spec.template.spec.containers[0]
    assert container.image == image
    assert f"--nnodes={replicas}:{replicas}" in container.args
    assert f"--rdzv-endpoint={name}-0.{name}:29400" in container.args and f"--rdzv-id={name}" in container.args
    config_map = cluster.core.read_namespaced_config_map(job.metadata.annotations["biggraph.io/config-map"], NS)
    assert yaml.safe_load(config_map.data["config.yaml"]) == raw
    service = cluster.core.read_namespaced_service(job.metadata.annotations["biggraph.io/service"], NS)
    assert service.spec.cluster_ip == "None" and job.spec.template.spec.subdomain == service.metadata.name
    # the NetworkPolicy guarding the rendezvous: it selects the Job's pods and admits those same pods
    policy = cluster.networking.read_namespaced_network_policy(job.metadata.annotations["biggraph.io/network-policy"],
                                                               NS)
    pod_labels = job.spec.template.metadata.labels
    assert policy.spec.pod_selector.match_labels.items() <= pod_labels.items()
    assert policy.spec.policy_types == ["Ingress"]
    [rule] = policy.spec.ingress
    assert rule.ports is None and rule._from[0].pod_selector.match_labels.items() <= pod_labels.items()
    assert rule._from[0].pod_selector.match_labels["app.kubernetes.io/instance"] == name


def use_helm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The real helm binary (skipping the test without it), with its home directories under ``tmp_path``."""
    try:
        from test_chart import helm_binary, helm_env
    except ImportError:  # tests/ is a package
        from tests.test_chart import helm_binary, helm_env

    helm = helm_binary()  # before the environment changes: it may run tests/k8s_tools.sh
    for key, value in helm_env(tmp_path).items():
        if key.startswith("HELM_"):
            monkeypatch.setenv(key, value)
    return helm


@pytest.mark.slow
def test_submit_with_helm_creates_job_configmap_and_service(cluster: FakeCluster, user_config: Any, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    helm = use_helm(tmp_path, monkeypatch)
    path, raw = user_config
    values = tmp_path / "more-values.yaml"
    values.write_text(yaml.safe_dump({"backoffLimit": 7, "backoffLimitPerIndex": 5, "replicas": 5}))
    code = main(cluster.cli("submit", str(path), "--name", "emb1", "--replicas", "3", "--image", "reg.io:5000/bg:v2",
                            "--helm", helm, "-f", str(values), "--set", "torchrun.maxRestarts=9"))
    assert code == 0
    assert "submitted job emb1 to namespace team-a: 3 pod(s)" in capsys.readouterr().out
    check_submitted(cluster, "emb1", raw, replicas=3, image="reg.io:5000/bg:v2")  # --replicas beats the values file
    job = created_job(cluster, "emb1")
    assert job.spec.backoff_limit == 7 and "--max-restarts=9" in job.spec.template.spec.containers[0].args
    assert job.spec.backoff_limit_per_index is None  # the cluster says 1.31: no per-index retries yet
    assert cluster.names("Pod") == set()  # the helm test pod is not submitted
    # a 1.33 cluster (as GKE/EKS say it: "33+"): helm renders for it, and --queue goes through Kueue
    cluster.set_kube_minor("33+")
    assert main(cluster.cli("submit", str(path), "--name", "emb1q", "--replicas", "2", "--queue", "team-a-q",
                            "--helm", helm, "-f", str(values))) == 0
    assert "queued in Kueue LocalQueue team-a-q" in capsys.readouterr().out
    check_submitted(cluster, "emb1q", raw, replicas=2, image="ghcr.io/biggraph/biggraph:0.1.0-cpu")
    job = created_job(cluster, "emb1q")
    assert job.spec.backoff_limit_per_index == 5 and job.spec.max_failed_indexes == 0
    assert job.spec.backoff_limit is None and job.spec.pod_replacement_policy is None  # the latter from 1.34
    assert job.metadata.labels["kueue.x-k8s.io/queue-name"] == "team-a-q" and job.spec.suspend is True


def test_submit_creates_the_release_and_refuses_a_name_clash(cluster: FakeCluster, user_config: Any,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    path, raw = user_config
    assert main(cluster.cli("submit", str(path), "--name", "emb2", "--replicas", "2")) == 0
    check_submitted(cluster, "emb2", raw, replicas=2, image="ghcr.io/biggraph/biggraph:0.1.0-cpu")
    assert cluster.names("ConfigMap") == {"emb2-config"} and cluster.names("Service") == {"emb2"}
    assert cluster.names("NetworkPolicy") == {"emb2"}
    job = created_job(cluster, "emb2")
    assert job.spec.backoff_limit == 3 and job.spec.backoff_limit_per_index is None  # 1.31: no per-index retries
    assert not job.spec.suspend and "kueue.x-k8s.io/queue-name" not in job.metadata.labels
    # the same name again: a clear conflict, and nothing half-created left behind by the failed attempt
    assert main(cluster.cli("submit", str(path), "--name", "emb2")) == 2
    err = capsys.readouterr().err
    assert "already exists in namespace team-a" in err and len(err.strip().splitlines()) == 1
    assert cluster.names("Job") == {"emb2"}


def test_submit_default_name_and_dry_run_need_no_cluster(user_config: Any, capsys: pytest.CaptureFixture[str],
                                                         tmp_path: Path) -> None:
    path, raw = user_config
    code = main(["submit", str(path), "--dry-run", "--kubeconfig", str(tmp_path / "missing")])
    assert code == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "NetworkPolicy", "Secret", "Job"]  # the policy before the pods
    name = docs[4]["metadata"]["name"]
    assert re.fullmatch(r"biggraph-mygraph-[0-9a-f]{6}", name)
    assert yaml.safe_load(docs[0]["data"]["config.yaml"]) == raw
    assert all(d["metadata"]["namespace"] == "default" for d in docs)


def test_dry_run_prints_no_group_secret_and_the_submit_creates_a_fresh_one(
        cluster: FakeCluster, user_config: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = user_config
    assert main(cluster.cli("submit", str(path), "--dry-run", "--name", "sec1")) == 0
    out = capsys.readouterr().out
    [secret] = [d for d in yaml.safe_load_all(out) if d["kind"] == "Secret"]
    assert secret["data"] == {"secret": "<redacted>"}
    assert "creates this Secret with a new random value" in secret["metadata"]["annotations"]["biggraph.io/redacted"]
    # what the cluster gets is a real secret, and neither it nor its base64 was in what the dry run printed
    assert main(cluster.cli("submit", str(path), "--name", "sec1")) == 0
    created = cluster.core.read_namespaced_secret("sec1-group", NS)
    encoded = created.data["secret"]
    value = base64.b64decode(encoded).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", value)
    assert encoded not in out and value not in out
    assert "biggraph.io/redacted" not in (created.metadata.annotations or {})


@pytest.mark.parametrize(("minor", "per_index", "replacement"), [("32", None, None), ("33", 3, None),
                                                                  ("34+", 3, "Failed"), ("37", 3, "Failed")])
def test_submit_follows_the_cluster_version(cluster: FakeCluster, user_config: Any, minor: str,
                                                         per_index: int | None, replacement: str | None) -> None:
    path, raw = user_config
    cluster.set_kube_minor(minor)
    assert main(cluster.cli("submit", str(path), "--name", "emb8", "--replicas", "3")) == 0
    check_submitted(cluster, "emb8", raw, replicas=3, image="ghcr.io/biggraph/biggraph:0.1.0-cpu")
    spec = created_job(cluster, "emb8").spec
    assert spec.backoff_limit_per_index == per_index and spec.pod_replacement_policy == replacement
    assert spec.backoff_limit == (None if per_index else 3)  # per index: no job-wide budget one incident uses up
    assert spec.max_failed_indexes == (0 if per_index else None)


def test_submit_version_unknown_old_or_given(cluster: FakeCluster, user_config: Any, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = user_config
    cluster.set_kube_minor(None)  # /version without a minor: helm's default version
    assert main(cluster.cli("submit", str(path), "--name", "emb9")) == 0
    assert created_job(cluster, "emb9").spec.completions == 1
    assert main(cluster.cli("submit", str(path), "--name", "emb10", "--kube-version", "v1.35.1")) == 0
    assert created_job(cluster, "emb10").spec.pod_replacement_policy == "Failed"  # --kube-version wins
    cluster.set_kube_minor("30")
    capsys.readouterr()
    assert main(cluster.cli("submit", str(path), "--name", "emb11")) == 2
    err = capsys.readouterr().err.strip()
    assert err == "biggraph submit: error: Kubernetes 1.30 is not supported: biggraph needs 1.31 or newer (Job podFailurePolicy)"
    assert "emb11" not in cluster.names("Job") and "emb11" not in cluster.names("NetworkPolicy")
    assert main(["submit", str(path), "--dry-run", "--kube-version", "1.x"]) == 2
    assert "--kube-version 1.x: expected MAJOR.MINOR" in capsys.readouterr().err


def test_submit_to_a_kueue_queue_waits_suspended(cluster: FakeCluster, user_config: Any,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = user_config
    assert main(cluster.cli("submit", str(path), "--name", "emb12", "--replicas", "2",
                            "--queue", "team-a-q")) == 0
    assert "queued in Kueue LocalQueue team-a-q: the pods start once it is admitted" in capsys.readouterr().out
    job = created_job(cluster, "emb12")
    assert job.metadata.labels["kueue.x-k8s.io/queue-name"] == "team-a-q" and job.spec.suspend is True
    cluster.batch.patch_namespaced_job_status("emb12", NS, {"status": {"conditions": [
        {"type": "Suspended", "status": "True", "reason": "JobSuspended"}]}})
    assert main(cluster.cli("status", "emb12", "--json")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["state"] == "Queued" and report["queue"] == "team-a-q"
    assert main(cluster.cli("status", "emb12")) == 0
    assert "emb12 (team-a): Queued; 2 replica(s)" in capsys.readouterr().out
    # Kueue admits it: resumed, the controller starts the pods
    cluster.batch.patch_namespaced_job("emb12", NS, {"spec": {"suspend": False}})
    cluster.batch.patch_namespaced_job_status("emb12", NS, {"status": {"active": 2, "conditions": [
        {"type": "Suspended", "status": "False", "reason": "JobResumed"}]}})
    assert main(cluster.cli("status", "emb12", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "Running"
    # a suspended Job without a queue was stopped by someone, not queued
    assert main(cluster.cli("submit", str(path), "--name", "emb13")) == 0
    cluster.batch.patch_namespaced_job("emb13", NS, {"spec": {"suspend": True}})
    capsys.readouterr()
    assert main(cluster.cli("status", "emb13", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "Suspended"
    assert main(cluster.cli("submit", str(path), "--name", "emb14", "--queue", "team a")) == 2
    assert "--queue 'team a'" in capsys.readouterr().err and "emb14" not in cluster.names("Job")


def test_submit_of_local_paths_is_refused_before_anything_is_created(cluster: FakeCluster, local_config: Any,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path, raw = local_config  # tests/test_submit_reach.py: the rule, with and without a mounted claim
    assert main(cluster.cli("submit", str(path), "--name", "emb20")) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert f"the pods cannot reach entity_path {raw['entity_path']}, " in line
    assert cluster.names("Job") == set() and cluster.names("ConfigMap") == set()


def test_submit_without_helm_is_one_line_naming_the_fix(user_config: Any, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """There is no second rendering in Python any more: the chart is the one source of the manifests."""
    path, _ = user_config
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert main(["submit", str(path), "--dry-run", "--kubeconfig", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("biggraph submit: error: submit renders charts/biggraph with helm, and there is no helm on PATH: "
                   "install helm (https://helm.sh/docs/intro/install/) or pass --helm PATH")
    with pytest.raises(SystemExit, match="2"):  # the flag is gone: argparse's usage error
        main(["submit", str(path), "--no-helm", "--dry-run"])


def test_submit_rejects_a_bad_config_before_touching_the_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"entities": {"n": {"num_partitions": 1}}, "relations": [], "dimensoin": 3}))
    assert main(["submit", str(bad), "--kubeconfig", str(tmp_path / "missing")]) == 2
    assert "dimensoin" in capsys.readouterr().err


# status / logs / cancel ------------------------------------------------------------------------------


def test_status_reports_pods_and_progress_from_the_checkpoint(cluster: FakeCluster, user_config: Any,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    path, raw = user_config
    assert main(cluster.cli("submit", str(path), "--name", "emb3", "--replicas", "2")) == 0
    cluster.add_pod("emb3", 1)
    cluster.add_pod("emb3", 0)
    cluster.add_pod("other-job", 0)
    cluster.batch.patch_namespaced_job_status("emb3", NS, {"status": {"active": 2}})
    checkpoint = CheckpointStorage(raw["checkpoint_path"])
    checkpoint.prepare()
    checkpoint.append_stats([
        {"epoch_idx": 0, "edge_path_idx": 0, "edge_chunk_idx": 0, "lhs_partition": 0, "rhs_partition": 1, "rank": 0,
         "index": 0, "edges_per_sec": 120.0, "stats": {"count": 10, "metrics": {"loss": 2.0}}},
        {"epoch_idx": 0, "edge_path_idx": 0, "edge_chunk_idx": 0, "index": 0, "pass_summary": True,
         "stats": {"count": 20, "metrics": {"loss": 1.5}}},
        {"epoch_idx": 1, "edge_path_idx": 0, "edge_chunk_idx": 0, "lhs_partition": 1, "rhs_partition": 0, "rank": 1,
         "index": 5, "edges_per_sec": 80.0, "stats": {"count": 10, "metrics": {"loss": 1.0}}},
    ])
    checkpoint.save_version(1)
    capsys.readouterr()
    assert main(cluster.cli("status", "emb3", "--json")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["state"] == "Running" and report["replicas"] == 2 and report["active"] == 2
    assert [(p["index"], p["name"], p["phase"], p["restarts"]) for p in report["pods"]] == [
        (0, "emb3-0-abcde", "Running", 0), (1, "emb3-1-abcde", "Running", 1)]
    progress = report["progress"]
    assert progress["available"] and progress["version"] == 1 and progress["num_epochs"] == 3
    assert progress["workers"]["0"]["bucket"] == [0, 1] and progress["workers"]["0"]["epoch"] == 1
    assert progress["workers"]["1"]["bucket"] == [1, 0] and progress["workers"]["1"]["epoch"] == 2
    assert progress["last_pass"] == {"epoch": 1, "loss": 1.5}
    assert main(cluster.cli("status", "emb3")) == 0
    text = capsys.readouterr().out
    assert "job emb3 (team-a): Running; 2 replica(s)" in text
    assert "worker 1: epoch 2/3, bucket (1, 0)" in text and "checkpoint version 1" in text
    cluster.batch.patch_namespaced_job_status("emb3", NS, {"status": {"active": 0, "succeeded": 2, "conditions": [
        {"type": "Complete", "status": "True"}]}})
    assert main(cluster.cli("status", "emb3", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "Complete"


def test_status_without_reachable_checkpoint_still_reports_the_job(cluster: FakeCluster, user_config: Any, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path, raw = user_config
    path.write_text(yaml.safe_dump({**raw, "checkpoint_path": "nosuchscheme://bucket/ck"}))
    assert main(cluster.cli("submit", str(path), "--name", "emb4")) == 0
    capsys.readouterr()
    assert main(cluster.cli("status", "emb4")) == 0
    out = capsys.readouterr().out
    assert "Pending" in out and "progress: unavailable" in out and "nosuchscheme" in out


def test_logs_of_one_index_and_of_all(cluster: FakeCluster, user_config: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = user_config
    assert main(cluster.cli("submit", str(path), "--name", "emb5", "--replicas", "2")) == 0
    cluster.add_pod("emb5", 0, log="rank 0 says hi\n")
    cluster.add_pod("emb5", 1, log="rank 1 says hi\n")
    capsys.readouterr()
    assert main(cluster.cli("logs", "emb5")) == 0
    assert capsys.readouterr().out == "[0] rank 0 says hi\n[1] rank 1 says hi\n"
    assert main(cluster.cli("logs", "emb5", "--index", "1")) == 0
    assert capsys.readouterr().out == "rank 1 says hi\n"
    assert main(cluster.cli("logs", "emb5", "--follow")) == 0  # index 0 by default
    assert capsys.readouterr().out == "rank 0 says hi\n"
    assert main(cluster.cli("logs", "emb5", "--index", "7")) == 2
    assert "no pods with index 7" in capsys.readouterr().err


def test_cancel_deletes_the_release_by_its_label(cluster: FakeCluster, user_config: Any,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Every object the chart labelled with the release goes (the fake server ignores label selectors: the
    client's own filter keeps the other job's objects), the claim stays."""
    path, _ = user_config
    assert main(cluster.cli("submit", str(path), "--name", "emb6", "--set", "serviceAccount.create=true",
                            "--set", "persistence.enabled=true")) == 0
    assert main(cluster.cli("submit", str(path), "--name", "keep")) == 0
    capsys.readouterr()
    assert main(cluster.cli("cancel", "emb6")) == 0
    assert ("deleted Job emb6, ConfigMap emb6-config, Service emb6, NetworkPolicy emb6, ServiceAccount emb6, "
            "Secret emb6-group in namespace team-a") in capsys.readouterr().out
    assert cluster.names("Job") == {"keep"} and cluster.names("ConfigMap") == {"keep-config"}
    assert cluster.names("Service") == {"keep"} and cluster.names("NetworkPolicy") == {"keep"}
    assert {c.metadata.name for c in cluster.core.list_namespaced_persistent_volume_claim(NS).items} == {"emb6-data"}
    deletes = [r for r in cluster.emulator._requests if r.method == "DELETE" and str(r.url.path).endswith("/jobs/emb6")]
    policy = deletes[0].params.get("propagationPolicy") or (deletes[0].data or {}).get("propagationPolicy")
    assert policy == "Background"  # the pods go too
    assert main(cluster.cli("cancel", "emb6")) == 2
    assert capsys.readouterr().err.strip() == "biggraph cancel: error: job emb6 not found in namespace team-a"


# errors ----------------------------------------------------------------------------------------------


def test_forbidden_is_one_line_and_exit_2(cluster: FakeCluster, user_config: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = user_config
    assert main(cluster.cli("submit", str(path), "--name", "emb7", "-n", "forbidden-ns")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("biggraph submit: error: creating ConfigMap emb7-config in namespace forbidden-ns: "
                          "forbidden (HTTP 403)")
    assert 'User "me" cannot create' in err and "\n" not in err
    assert main(cluster.cli("status", "x", "-n", "forbidden-ns")) == 2
    assert "forbidden (HTTP 403)" in capsys.readouterr().err


def test_no_cluster_reachable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: nothing listens there
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
    assert main(["status", "emb", "--kubeconfig", str(kubeconfig)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"biggraph status: error: reading job emb: cannot reach the Kubernetes API at http://127.0.0.1:{port}")
    assert "\n" not in err


def test_no_kubeconfig(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["cancel", "emb", "--kubeconfig", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("biggraph cancel: error: no Kubernetes cluster configured") and "\n" not in err


# the library under the commands ----------------------------------------------------------------------


def test_library_submit_dry_run_returns_the_manifests_without_printing(user_config: Any, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    path, raw = user_config
    options = SubmitOptions(render=RenderOptions(replicas=2, queue="q1"), name="lib1", dry_run=True)
    submission = submit(str(path), options, ClusterAccess(namespace="ns1", kubeconfig=str(tmp_path / "missing")))
    assert not submission.created and submission.name == "lib1" and submission.namespace == "ns1"
    assert [o["kind"] for o in submission.objects] == ["ConfigMap", "Service", "NetworkPolicy", "Secret", "Job"]
    assert submission.job["spec"]["parallelism"] == 2 and submission.job["spec"]["suspend"] is True
    assert all(o["metadata"]["namespace"] == "ns1" for o in submission.objects)
    assert submission.checkpoint_path == raw["checkpoint_path"]
    assert capsys.readouterr().out == ""


def test_check_storage_reports_each_check_that_passed(local_config: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path, raw = local_config
    for url in (raw["entity_path"], *raw["edge_paths"]):
        Path(url).mkdir(parents=True)
    config = load_config(str(path), [])
    lines: list[str] = []
    check_storage(config, write=True, report=lines.append)
    assert lines == ["preflight: entity_path and 1 edge path(s) reachable",
                     f"preflight: checkpoint_path {raw['checkpoint_path']} writable"]
    assert not list(Path(raw["checkpoint_path"]).iterdir())  # the probe is gone
    lines.clear()
    check_storage(config, write=False, report=lines.append)
    assert lines[-1] == f"preflight: checkpoint_path {raw['checkpoint_path']} reachable"
    Path(raw["edge_paths"][0]).rmdir()
    lines.clear()
    with pytest.raises(UserError, match="not found: .*edges"):
        check_storage(config, write=True, report=lines.append)
    assert lines == []
    assert capsys.readouterr().out == ""  # the library reports through `report` only


# pods sized by what the trainer uses ----------------------------------------------------------------


def write_counts(raw: dict[str, Any], per_partition: int) -> None:
    from job.formats.entities import write_entity_count

    for part in range(2):
        write_entity_count(raw["entity_path"], "node", part, per_partition)


def dry_run_job(path: Path, tmp_path: Path, *extra: str) -> dict[str, Any]:
    options = SubmitOptions(render=RenderOptions(), name="sized", dry_run=True)
    return submit(str(path), options, ClusterAccess(kubeconfig=str(tmp_path / "missing"))).job


def test_submit_sizes_shm_and_tmp_from_the_entity_counts(user_config: Any, tmp_path: Path) -> None:
    """2 partitions of 2M rows of dimension 8: a partition and its Adagrad sums are 72 MB; the default buffer holds a
    bucket's 2 plus one in flight (206Mi) in /dev/shm, with 512Mi headroom; /tmp: the checkpoint is on an object
    store (memory:// standing in for s3://), so two whole reads and two pending uploads of a 72 MB file are staged
    there (275Mi) besides 512Mi."""
    path, raw = user_config
    write_counts(raw, 2_000_000)
    job = dry_run_job(path, tmp_path)
    volumes = {v["name"]: v["emptyDir"] for v in job["spec"]["template"]["spec"]["volumes"] if "emptyDir" in v}
    assert volumes["dshm"] == {"medium": "Memory", "sizeLimit": "718Mi"}  # 3 x 72 MB + 512Mi
    assert volumes["tmp"] == {"sizeLimit": "787Mi"}
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["BIGGRAPH_SHM_LIMIT"] == "718Mi" and env["BIGGRAPH_TMP_LIMIT"] == "787Mi"
    # no counts readable from here: the chart's defaults, which follow memory_budget
    import storage_adapters as storage

    storage.remove(raw["entity_path"])  # the counts gone (a local entity_path or an object store alike)
    raw["memory_budget"] = "3GiB"
    path.write_text(yaml.safe_dump(raw))
    volumes = {v["name"]: v["emptyDir"] for v in dry_run_job(path, tmp_path)["spec"]["template"]["spec"]["volumes"]
               if "emptyDir" in v}
    assert volumes["dshm"]["sizeLimit"] == "3Gi" and volumes["tmp"]["sizeLimit"] == "5Gi"


def test_submit_refuses_a_pod_that_cannot_hold_the_partitions(user_config: Any, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """50M rows a partition: 3 x 1.8 GB in /dev/shm cannot fit the chart's default 4Gi memory limit."""
    path, raw = user_config
    write_counts(raw, 50_000_000)
    assert main(["submit", str(path), "--dry-run", "--name", "big", "--kubeconfig",
                 str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "resources.limits.memory 4Gi cannot hold the 5150Mi of tables the trainer keeps in /dev/shm" in err
    assert "raise resources.limits.memory to at least 5342Mi, or set memory_budget" in err
    # a budget that holds no bucket names memory_budget and what it needs
    raw["memory_budget"] = "2GiB"
    path.write_text(yaml.safe_dump(raw))
    assert main(["submit", str(path), "--dry-run", "--name", "big", "--kubeconfig",
                 str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert "config key 'memory_budget': 2GiB holds 0 partition(s)" in err and "raise it to at least" in err


def test_submit_refuses_a_group_whose_budget_cannot_also_hold_the_shared_parameters_sync(
        user_config: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An unpartitioned type of 20M rows (720 MB with its sums): one pod's 2GiB budget holds it, a bucket and a
    partition in flight; pods of a group also keep the vectors that sync it with the lock server's rank (5 copies
    of it and its sums on the server's pod), which that budget cannot hold beside them."""
    from job.formats.entities import write_entity_count

    path, raw = user_config
    raw["entities"]["tag"] = {"num_partitions": 1}
    raw["relations"].append({"name": "r1", "lhs": "node", "rhs": "tag", "operator": "translation"})
    raw["memory_budget"] = "2GiB"
    path.write_text(yaml.safe_dump(raw))
    write_counts(raw, 2_000_000)
    write_entity_count(raw["entity_path"], "tag", 0, 20_000_000)
    args = ["submit", str(path), "--dry-run", "--name", "grouped", "--kubeconfig", str(tmp_path / "missing")]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args + ["--replicas", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "config key 'memory_budget': 2GiB holds 0 partition(s)" in err
    assert "unpartitioned types, the shared parameters' sync with the group, and a partition in flight" in err
    assert "raise it to at least" in err


def test_submit_with_helm_refuses_values_below_what_the_config_needs(user_config: Any, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    helm = use_helm(tmp_path, monkeypatch)
    path, raw = user_config
    write_counts(raw, 2_000_000)
    base = ["submit", str(path), "--helm", helm, "--dry-run", "--name", "sized", "--kubeconfig", str(tmp_path / "x")]
    assert main([*base, "--set", "shm.sizeLimit=2Gi"]) == 0  # explicit values win when they hold enough
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    dshm = next(v for d in docs if d["kind"] == "Job" for v in d["spec"]["template"]["spec"]["volumes"]
                if v["name"] == "dshm")
    assert dshm["emptyDir"]["sizeLimit"] == "2Gi"
    assert main([*base, "--set", "shm.sizeLimit=128Mi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "shm.sizeLimit 128Mi is below the 206Mi the trainer keeps in /dev/shm" in err
    assert "set shm.sizeLimit to at least 206Mi" in err
    raw["checkpoint_path"] = "s3://bucket/ckpt"  # checkpoint files are staged whole in /tmp
    path.write_text(yaml.safe_dump(raw))
    assert main([*base, "--set", "tmp.sizeLimit=256Mi"]) == 2
    err = capsys.readouterr().err
    assert "tmp.sizeLimit 256Mi is below the 787Mi the trainer stages in /tmp (checkpoint files read and uploaded)" in err
    assert "set tmp.sizeLimit to at least 787Mi" in err  # (2 read + 2 uploaded) x 72 MB + 512Mi


def test_preflight_refuses_a_pod_that_cannot_hold_the_config(user_config: Any, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path, raw = user_config
    write_counts(raw, 2_000_000)
    monkeypatch.setenv("BIGGRAPH_MEMORY_LIMIT", str(4 * 2**30))  # as the resourceFieldRef gives it: bytes
    monkeypatch.setenv("BIGGRAPH_SHM_LIMIT", "718Mi")
    monkeypatch.setenv("BIGGRAPH_TMP_LIMIT", "6Gi")
    assert main(["preflight", str(path)]) == 0
    # /tmp: 512Mi plus the checkpoint files staged for an object store (memory:// here)
    assert "preflight: pod sizes ok: /dev/shm 206Mi of 718Mi, /tmp 787Mi of 6Gi" in capsys.readouterr().out
    monkeypatch.setenv("BIGGRAPH_SHM_LIMIT", "64Mi")
    assert main(["preflight", str(path)]) == 2
    assert "preflight: shm.sizeLimit 64Mi is below the 206Mi" in capsys.readouterr().err
    raw["memory_budget"] = "5GiB"
    path.write_text(yaml.safe_dump(raw))
    assert main(["preflight", str(path)]) == 2
    err = capsys.readouterr().err
    assert "preflight: resources.limits.memory 4Gi is below the config's memory_budget 5Gi: raise " \
           "resources.limits.memory to at least 5Gi or lower memory_budget" in err
