"""Kubernetes subcommands: ``submit``, ``status``, ``logs``, ``cancel`` (and ``preflight``, run inside pods).

``biggraph submit CONFIG`` renders ``charts/biggraph`` with the real ``helm`` binary when one is on
PATH (or given with ``--helm``), else the plain manifests of ``k8s/base`` with Python, puts the
training config in the ConfigMap, and creates the objects through the ``kubernetes`` client. The
chart writes the names of its ConfigMap and Service into annotations of the Job, which is how
``status`` finds the config (to read progress from ``checkpoint_path``) and ``cancel`` what to
delete. Every failure a user can fix (no cluster, 403, an unknown job) is a one-line ``UserError``.

Both renderings follow the cluster's Kubernetes minor (``--kube-version``, else the server's
``/version``): the chart through ``helm template --kube-version`` (its ``.Capabilities`` checks), the
plain manifests by adding in Python what the chart adds on newer minors (``k8s/base`` is the chart
rendered for the oldest supported one, 1.31).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import storage_adapters as storage
from job.config import ConfigSchema
from job.errors import UserError
from job.session import storage_scoped

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_MAP_ANNOTATION = "biggraph.io/config-map"
SERVICE_ANNOTATION = "biggraph.io/service"
NETWORK_POLICY_ANNOTATION = "biggraph.io/network-policy"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
BASE_NAME = "biggraph-job"  # the name used throughout k8s/base
# the NetworkPolicy before the Job, so that no pod runs unprotected
CREATE_ORDER = ("ServiceAccount", "PersistentVolumeClaim", "ConfigMap", "Service", "NetworkPolicy", "Job")
# Kubernetes minors (charts/biggraph/Chart.yaml kubeVersion and the capability checks in its job.yaml)
MIN_KUBE_MINOR = 31  # podFailurePolicy GA
PER_INDEX_MINOR = 33  # backoffLimitPerIndex GA
POD_REPLACEMENT_MINOR = 34  # podReplacementPolicy GA
BACKOFF_LIMIT_PER_INDEX = 3  # the chart's default backoffLimitPerIndex
LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def register(subparsers: Any) -> None:
    submit = subparsers.add_parser("submit", help="train on Kubernetes: render the Helm chart and create the Job")
    submit.add_argument("config", help="training config (.py, .yaml or .json); it becomes the Job's ConfigMap")
    submit.add_argument("--name", help="job name (default: biggraph-<config name>-<random>)")
    submit.add_argument("--replicas", type=int, help="pods (torchrun nodes)")
    submit.add_argument("--image", help="trainer image, REPO[:TAG]")
    submit.add_argument("--queue", help="Kueue LocalQueue: the Job is created suspended and starts once Kueue admits it")
    submit.add_argument("--kube-version", metavar="X.Y",
                        help="render for this Kubernetes version (default: the cluster's; with --dry-run and no "
                             "cluster: helm's default, or k8s/base as it is)")
    submit.add_argument("-f", "--values", action="append", default=[], metavar="FILE", help="Helm values file (repeatable)")
    submit.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="Helm value (repeatable)")
    submit.add_argument("--dry-run", action="store_true", help="print the manifests instead of creating them")
    submit.add_argument("--helm", help="helm binary (default: `helm` on PATH; without one, k8s/base is rendered)")
    submit.add_argument("--no-helm", action="store_true", help="render k8s/base with Python even if helm is available")
    submit.add_argument("--chart", help="chart directory (default: $BIGGRAPH_CHART or charts/biggraph)")
    _cluster_arguments(submit)
    submit.set_defaults(func=_submit)

    status = subparsers.add_parser("status", help="a Kubernetes job's state, its pods and its training progress")
    status.add_argument("job", help="job name")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    _cluster_arguments(status)
    status.set_defaults(func=_status)

    logs = subparsers.add_parser("logs", help="the logs of a Kubernetes job's pods")
    logs.add_argument("job", help="job name")
    logs.add_argument("--index", type=int, help="only the pod of this completion index (--follow: default 0)")
    logs.add_argument("--follow", action="store_true", help="stream the log until the pod ends")
    logs.add_argument("--tail", type=int, help="only the last N lines")
    _cluster_arguments(logs)
    logs.set_defaults(func=_logs)

    cancel = subparsers.add_parser("cancel", help="delete a Kubernetes job, its pods, ConfigMap, Service and NetworkPolicy")
    cancel.add_argument("job", help="job name")
    _cluster_arguments(cancel)
    cancel.set_defaults(func=_cancel)

    preflight = subparsers.add_parser("preflight", help="check a config (and its storage) before training; used in pods")
    preflight.add_argument("config", help="training config")
    preflight.add_argument("--check-storage", action="store_true", help="entity_path, edge_paths and checkpoint_path exist")
    preflight.add_argument("--check-write", action="store_true", help="write and remove a probe under checkpoint_path")
    preflight.set_defaults(func=_preflight)


def _cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--namespace", help="namespace (default: the kubeconfig context's, else 'default')")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, or in-cluster)")
    parser.add_argument("--context", help="kubeconfig context")


# cluster access ---------------------------------------------------------------------------------


class Cluster:
    """The API clients and namespace of one command; errors become one-line UserErrors."""

    def __init__(self, args: argparse.Namespace) -> None:
        try:
            from kubernetes import client, config
        except ImportError:
            raise UserError("the kubernetes package is missing: pip install 'biggraph[k8s]'") from None
        configuration = client.Configuration()
        namespace = None
        try:
            if args.kubeconfig or not os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_kube_config(config_file=args.kubeconfig, context=args.context,
                                        client_configuration=configuration)
                _, active = config.list_kube_config_contexts(config_file=args.kubeconfig)
                if args.context:
                    active = next((c for c in _ if c["name"] == args.context), active)
                namespace = (active or {}).get("context", {}).get("namespace")
            else:
                config.load_incluster_config(client_configuration=configuration)
                with contextlib.suppress(OSError):
                    namespace = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read_text().strip()
        except (config.ConfigException, OSError, TypeError, ValueError) as err:
            where = args.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
            raise UserError(f"no Kubernetes cluster configured ({where}): {str(err).splitlines()[0]}") from None
        configuration.retries = 0  # no cluster: fail now, not after urllib3's retries
        self.host = configuration.host
        self.namespace = args.namespace or namespace or "default"
        api = client.ApiClient(configuration)
        self.core = client.CoreV1Api(api)
        self.batch = client.BatchV1Api(api)
        self.networking = client.NetworkingV1Api(api)
        self.version = client.VersionApi(api)

    def kube_version(self) -> tuple[int, int] | None:
        """The API server's (major, minor), or None when it does not say (a best effort: rendering goes on)."""
        try:
            info = self.version.get_code(_request_timeout=10)
            return int(re.sub(r"\D", "", info.major)), int(re.sub(r"\D", "", info.minor))  # GKE/EKS say "34+"
        except Exception:  # any failure: render without a version rather than refuse to submit
            return None

    @contextlib.contextmanager
    def errors(self, what: str, not_found: str | None = None) -> Iterator[None]:
        """Turn API and connection failures into a UserError naming ``what`` was being done."""
        import urllib3
        from kubernetes.client.exceptions import ApiException

        try:
            yield
        except ApiException as err:
            message = _api_message(err)
            if err.status == 404 and not_found:
                raise UserError(not_found) from None
            if err.status in (401, 403):
                kind = "unauthorized" if err.status == 401 else "forbidden"
                raise UserError(f"{what}: {kind} (HTTP {err.status}): {message}") from None
            raise UserError(f"{what}: Kubernetes API error {err.status}: {message}") from None
        except (urllib3.exceptions.HTTPError, OSError) as err:
            reason = getattr(err, "reason", None) or err
            raise UserError(f"{what}: cannot reach the Kubernetes API at {self.host}: {reason}") from None

    def read_job(self, name: str) -> Any:
        with self.errors(f"reading job {name}", f"job {name} not found in namespace {self.namespace}"):
            return self.batch.read_namespaced_job(name, self.namespace, _request_timeout=30)

    def job_pods(self, name: str) -> list[Any]:
        with self.errors(f"listing the pods of job {name}"):
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"job-name={name}",
                                                 _request_timeout=30).items
        # the selector again on our side (fake API servers may ignore it)
        pods = [p for p in pods if (p.metadata.labels or {}).get("job-name") == name
                or (p.metadata.labels or {}).get("batch.kubernetes.io/job-name") == name]
        return sorted(pods, key=lambda p: (_pod_index(p), str(p.metadata.creation_timestamp or ""), p.metadata.name))


def _api_message(err: Any) -> str:
    with contextlib.suppress(Exception):
        return json.loads(err.body)["message"]
    return str(err.reason or err.body or "").strip() or "no details"


def _pod_index(pod: Any) -> int:
    meta = pod.metadata
    value = (meta.annotations or {}).get(INDEX_ANNOTATION) or (meta.labels or {}).get(INDEX_ANNOTATION)
    with contextlib.suppress(TypeError, ValueError):
        return int(value)
    return -1


# submit -----------------------------------------------------------------------------------------


def _job_name(args: argparse.Namespace) -> str:
    if args.name:
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,54}[a-z0-9])?", args.name):
            raise UserError(f"--name '{args.name}': must be lowercase letters, digits and '-', start with a letter, "
                            "at most 56 characters")
        return args.name
    stem = re.sub(r"[^a-z0-9]+", "-", Path(args.config).stem.lower()).strip("-") or "train"
    return f"biggraph-{stem}"[:49].rstrip("-") + "-" + secrets.token_hex(3)


def _plain_config(path: str) -> dict[str, Any]:
    """The user's config as a plain dict (what the ConfigMap holds), validated first."""
    from job.config import apply_overrides, load_raw_config, parse_config

    raw = load_raw_config(path)
    parse_config(raw)  # ConfigError (exit 2) now rather than in the pods
    return apply_overrides(raw, [])


def _find_helm(args: argparse.Namespace) -> str | None:
    if args.no_helm:
        return None
    if args.helm:
        if not (os.path.isfile(args.helm) and os.access(args.helm, os.X_OK)):
            raise UserError(f"--helm {args.helm}: not an executable file")
        return args.helm
    return shutil.which("helm")


def _find_chart(args: argparse.Namespace) -> Path:
    for candidate in (args.chart, os.environ.get("BIGGRAPH_CHART"), REPO_ROOT / "charts" / "biggraph"):
        if candidate and (Path(candidate) / "Chart.yaml").is_file():
            return Path(candidate)
    raise UserError("the biggraph Helm chart was not found: pass --chart DIR or set BIGGRAPH_CHART")


def parse_kube_version(text: str) -> tuple[int, int]:
    """``1.34``, ``v1.34.2`` or ``1.34.2-eks-1`` as (1, 34)."""
    match = re.fullmatch(r"v?(\d+)\.(\d+)(\.\d+)?([-+].*)?", text.strip())
    if not match:
        raise UserError(f"--kube-version {text}: expected MAJOR.MINOR, e.g. 1.34")
    return int(match.group(1)), int(match.group(2))


def _check_kube_version(version: tuple[int, int] | None) -> None:
    if version is not None and version < (1, MIN_KUBE_MINOR):
        raise UserError(f"Kubernetes {version[0]}.{version[1]} is not supported: biggraph needs 1.{MIN_KUBE_MINOR} "
                        "or newer (Job podFailurePolicy)")


def _split_image(image: str) -> tuple[str, str]:
    repository, _, tag = image.rpartition(":")
    if not repository or "/" in tag:
        return image, ""
    return repository, tag


def render_with_helm(helm: str, chart: Path, name: str, namespace: str, config: dict[str, Any],
                     args: argparse.Namespace, kube_version: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    import yaml

    values: dict[str, Any] = {"fullnameOverride": name, "config": config}
    if args.replicas is not None:
        values["replicas"] = args.replicas
    if args.image:
        repository, tag = _split_image(args.image)
        values["image"] = {"repository": repository, "tag": tag}
    if args.queue:
        values["kueue"] = {"queueName": args.queue}
    with tempfile.TemporaryDirectory(prefix="biggraph-submit-") as tmp:
        generated = Path(tmp) / "submit-values.yaml"
        generated.write_text(yaml.safe_dump(values, sort_keys=False))
        command = [helm, "template", name, str(chart), "--namespace", namespace, "--skip-tests"]
        if kube_version is not None:  # the chart's capability checks see the cluster's version
            command += ["--kube-version", f"{kube_version[0]}.{kube_version[1]}.0"]
        for file in args.values:
            command += ["--values", file]
        command += ["--values", str(generated)]  # the CLI's own flags win over the files ...
        for item in args.set:
            command += ["--set", item]  # ... and --set over both, as with helm itself
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise UserError(f"running {helm}: {err}") from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise UserError(f"helm template failed: {lines[-1] if lines else 'exit code ' + str(done.returncode)}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def render_plain(name: str, config: dict[str, Any], args: argparse.Namespace,
                 kube_version: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """``k8s/base`` with its fixed name replaced, replicas, image, queue and config filled in, and the Job
    fields the chart adds on newer Kubernetes minors (tests/test_chart.py compares the two on every minor)."""
    import yaml

    if args.values or args.set:
        raise UserError("--values/--set need helm: install helm or pass --helm PATH")
    base = REPO_ROOT / "k8s" / "base"
    kustomization = base / "kustomization.yaml"
    if not kustomization.is_file():
        raise UserError(f"{base}: the plain manifests were not found (and no helm binary): pass --helm PATH")
    objects: list[dict[str, Any]] = []
    for resource in yaml.safe_load(kustomization.read_text())["resources"]:
        text = (base / resource).read_text()
        objects += [doc for doc in yaml.safe_load_all(re.sub(rf"\b{BASE_NAME}\b", name, text)) if doc]
    replicas = args.replicas
    for obj in objects:
        labels = obj["metadata"].setdefault("labels", {})
        labels["app.kubernetes.io/instance"] = name
        if obj["kind"] == "ConfigMap":
            obj["data"]["config.yaml"] = yaml.safe_dump(config, sort_keys=False)
        if obj["kind"] == "Job":
            spec = obj["spec"]
            pod = spec["template"]
            pod["metadata"]["labels"]["app.kubernetes.io/instance"] = name
            container = pod["spec"]["containers"][0]
            if replicas is not None:
                spec["completions"] = spec["parallelism"] = replicas
                container["args"] = [f"--nnodes={replicas}:{replicas}" if a.startswith("--nnodes=") else a
                                     for a in container["args"]]
            if args.image:
                repository, tag = _split_image(args.image)
                container["image"] = f"{repository}:{tag}" if tag else repository
            if args.queue:
                labels[QUEUE_LABEL] = args.queue
                spec["suspend"] = True  # Kueue resumes it on admission
            _newer_job_fields(spec, kube_version)
        if obj["kind"] == "Service":
            obj["spec"]["selector"]["app.kubernetes.io/instance"] = name
    return objects


def _newer_job_fields(spec: dict[str, Any], kube_version: tuple[int, int] | None) -> None:
    """What charts/biggraph/templates/job.yaml adds where a minor has it GA (the plain manifests are fixed-size:
    no index may fail for good)."""
    if kube_version is None:
        return
    if kube_version >= (1, PER_INDEX_MINOR):
        spec.pop("backoffLimit", None)
        spec["backoffLimitPerIndex"] = BACKOFF_LIMIT_PER_INDEX
        spec["maxFailedIndexes"] = 0
    if kube_version >= (1, POD_REPLACEMENT_MINOR):
        spec["podReplacementPolicy"] = "Failed"


def _create(cluster: Cluster, obj: dict[str, Any]) -> None:
    kind, ns = obj["kind"], cluster.namespace
    methods = {
        "Job": cluster.batch.create_namespaced_job,
        "ConfigMap": cluster.core.create_namespaced_config_map,
        "Service": cluster.core.create_namespaced_service,
        "ServiceAccount": cluster.core.create_namespaced_service_account,
        "PersistentVolumeClaim": cluster.core.create_namespaced_persistent_volume_claim,
        "NetworkPolicy": cluster.networking.create_namespaced_network_policy,
    }
    if kind not in methods:
        raise UserError(f"submit: the chart rendered a {kind}, which submit cannot create")
    obj.setdefault("metadata", {})["namespace"] = ns
    methods[kind](ns, obj, _request_timeout=30)


def _delete(cluster: Cluster, kind: str, name: str) -> bool:
    """Delete one object; False if it was already gone."""
    from kubernetes.client.exceptions import ApiException

    ns = cluster.namespace
    methods = {
        "Job": cluster.batch.delete_namespaced_job,
        "ConfigMap": cluster.core.delete_namespaced_config_map,
        "Service": cluster.core.delete_namespaced_service,
        "ServiceAccount": cluster.core.delete_namespaced_service_account,
        "PersistentVolumeClaim": cluster.core.delete_namespaced_persistent_volume_claim,
        "NetworkPolicy": cluster.networking.delete_namespaced_network_policy,
    }
    with cluster.errors(f"deleting {kind} {name}"):
        try:
            methods[kind](name, ns, propagation_policy="Background", _request_timeout=30)
        except ApiException as err:
            if err.status == 404:
                return False
            raise
    return True


def _submit(args: argparse.Namespace) -> int:
    import yaml

    if args.replicas is not None and args.replicas < 1:
        raise UserError(f"--replicas {args.replicas}: must be at least 1")
    if args.queue is not None and not LABEL_VALUE.fullmatch(args.queue):
        raise UserError(f"--queue '{args.queue}': a LocalQueue name (letters, digits, '-', '_', '.'; at most 63)")
    kube_version = parse_kube_version(args.kube_version) if args.kube_version else None
    config = _plain_config(args.config)
    name = _job_name(args)
    helm = _find_helm(args)
    cluster = None if args.dry_run else Cluster(args)
    namespace = cluster.namespace if cluster else (args.namespace or "default")
    if kube_version is None and cluster is not None:
        kube_version = cluster.kube_version()
    _check_kube_version(kube_version)
    if helm:
        objects = render_with_helm(helm, _find_chart(args), name, namespace, config, args, kube_version)
    else:
        objects = render_plain(name, config, args, kube_version)
    objects.sort(key=lambda o: CREATE_ORDER.index(o["kind"]) if o["kind"] in CREATE_ORDER else len(CREATE_ORDER))
    if cluster is None:
        for obj in objects:
            obj.setdefault("metadata", {})["namespace"] = namespace
        sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
        return 0
    created: list[dict[str, Any]] = []
    try:
        for obj in objects:
            kind, obj_name = obj["kind"], obj["metadata"]["name"]
            with cluster.errors(f"creating {kind} {obj_name} in namespace {namespace}"):
                try:
                    _create(cluster, obj)
                except Exception as err:
                    if getattr(err, "status", None) == 409:
                        raise UserError(f"{kind} {obj_name} already exists in namespace {namespace} "
                                        f"(biggraph cancel {name} -n {namespace}, or pick another --name)") from None
                    raise
            created.append(obj)
    except UserError:
        for obj in reversed(created):  # leave nothing half-submitted behind
            with contextlib.suppress(UserError):
                _delete(cluster, obj["kind"], obj["metadata"]["name"])
        raise
    job = next(o for o in objects if o["kind"] == "Job")
    print(f"submitted job {job['metadata']['name']} to namespace {namespace}: {job['spec']['parallelism']} pod(s), "
          f"checkpoints to {config.get('checkpoint_path')}")
    queue = (job["metadata"].get("labels") or {}).get(QUEUE_LABEL)
    if queue:
        print(f"  queued in Kueue LocalQueue {queue}: the pods start once it is admitted")
    print(f"  biggraph status {name} -n {namespace}    biggraph logs {name} -n {namespace} --follow")
    return 0


# status -----------------------------------------------------------------------------------------


def _job_state(job: Any) -> str:
    status = job.status
    # a suspended Job with a Kueue queue is waiting for admission, not stopped by someone
    suspended = "Queued" if (job.metadata.labels or {}).get(QUEUE_LABEL) else "Suspended"
    for condition in (status.conditions or []) if status else []:
        if condition.status == "True" and condition.type in ("Complete", "Failed", "Suspended", "FailureTarget"):
            return {"FailureTarget": "Failing", "Suspended": suspended}.get(condition.type, condition.type)
    if job.spec and job.spec.suspend:
        return suspended
    if status and status.active:
        return "Running"
    return "Pending"


def _pod_summary(pod: Any) -> dict[str, Any]:
    statuses = (pod.status.container_statuses or []) if pod.status else []
    restarts = sum(s.restart_count or 0 for s in statuses)
    detail = ""
    for s in statuses:
        state = s.state
        if state and state.waiting and state.waiting.reason:
            detail = state.waiting.reason
        elif state and state.terminated:
            detail = f"exit {state.terminated.exit_code}" + (f" ({state.terminated.reason})" if state.terminated.reason else "")
    return {"name": pod.metadata.name, "index": _pod_index(pod), "phase": (pod.status.phase if pod.status else None),
            "node": pod.spec.node_name if pod.spec else None, "restarts": restarts, "detail": detail}


@storage_scoped
def training_progress(config: dict[str, Any]) -> dict[str, Any]:
    """Committed version and each worker's last bucket, from ``training_stats.json`` under checkpoint_path."""
    from job.formats.checkpoint import CheckpointStorage

    url = config.get("checkpoint_path")
    if not url:
        return {"available": False, "reason": "the config has no checkpoint_path"}
    try:
        checkpoint = CheckpointStorage(url)
        version = checkpoint.load_version()
        stats = checkpoint.load_stats() if storage.exists(checkpoint.stats_file()) else []
    except Exception as err:  # any backend failure: progress is a best effort
        return {"available": False, "checkpoint_path": url, "reason": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
    workers: dict[str, dict[str, Any]] = {}
    last_pass = None
    for record in stats:
        if record.get("pass_summary"):
            last_pass = record
            continue
        if "lhs_partition" not in record:
            continue
        worker = str(record.get("rank", 0))
        workers[worker] = {"epoch": record.get("epoch_idx", 0) + 1, "edge_path": record.get("edge_path_idx", 0),
                           "chunk": record.get("edge_chunk_idx", 0),
                           "bucket": [record.get("lhs_partition"), record.get("rhs_partition")],
                           "edges_per_sec": round(float(record.get("edges_per_sec") or 0.0), 1)}
    result: dict[str, Any] = {"available": True, "checkpoint_path": url, "version": version,
                              "num_epochs": config.get("num_epochs", 1), "workers": workers}
    if last_pass is not None:
        result["last_pass"] = {"epoch": last_pass.get("epoch_idx", 0) + 1,
                               "loss": (last_pass.get("stats") or {}).get("metrics", {}).get("loss")}
    return result


def _status(args: argparse.Namespace) -> int:
    import yaml

    cluster = Cluster(args)
    job = cluster.read_job(args.job)
    pods = [_pod_summary(p) for p in cluster.job_pods(args.job)]
    status = job.status
    report: dict[str, Any] = {
        "job": args.job, "namespace": cluster.namespace, "state": _job_state(job),
        "replicas": job.spec.parallelism, "active": (status.active or 0) if status else 0,
        "succeeded": (status.succeeded or 0) if status else 0, "failed": (status.failed or 0) if status else 0,
        "pods": pods,
    }
    queue = (job.metadata.labels or {}).get(QUEUE_LABEL)
    if queue:
        report["queue"] = queue
    config_map = (job.metadata.annotations or {}).get(CONFIG_MAP_ANNOTATION)
    if config_map:
        with cluster.errors(f"reading ConfigMap {config_map}", f"ConfigMap {config_map} of job {args.job} not found"):
            data = cluster.core.read_namespaced_config_map(config_map, cluster.namespace, _request_timeout=30).data or {}
        try:
            config = yaml.safe_load(data.get("config.yaml", "")) or {}
        except yaml.YAMLError as err:
            config = {}
            report["progress"] = {"available": False, "reason": f"config.yaml does not parse: {err}"}
        if "progress" not in report:
            report["progress"] = training_progress(config)
    else:
        report["progress"] = {"available": False, "reason": f"the job has no {CONFIG_MAP_ANNOTATION} annotation"}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"job {args.job} ({cluster.namespace}): {report['state']}; {report['replicas']} replica(s): "
          f"{report['active']} active, {report['succeeded']} succeeded, {report['failed']} failed"
          + (f"; Kueue LocalQueue {queue}" if queue else ""))
    for pod in pods:
        extra = f", {pod['detail']}" if pod["detail"] else ""
        print(f"  [{pod['index']}] {pod['name']}: {pod['phase']}{extra}, restarts {pod['restarts']}"
              + (f", node {pod['node']}" if pod["node"] else ""))
    progress = report["progress"]
    if not progress.get("available"):
        print(f"progress: unavailable ({progress.get('reason')})")
        return 0
    line = f"progress: checkpoint version {progress['version']} in {progress['checkpoint_path']}"
    if "last_pass" in progress:
        loss = progress["last_pass"]["loss"]
        line += f"; last pass: epoch {progress['last_pass']['epoch']}/{progress['num_epochs']}"
        line += f", loss {loss:.4f}" if isinstance(loss, (int, float)) else ""
    print(line)
    for worker, where in sorted(progress["workers"].items()):
        print(f"  worker {worker}: epoch {where['epoch']}/{progress['num_epochs']}, bucket ({where['bucket'][0]}, "
              f"{where['bucket'][1]}), {where['edges_per_sec']:.0f} edges/s")
    return 0


# logs / cancel ----------------------------------------------------------------------------------


def _logs(args: argparse.Namespace) -> int:
    cluster = Cluster(args)
    cluster.read_job(args.job)
    pods = cluster.job_pods(args.job)
    index = 0 if args.follow and args.index is None else args.index
    if index is not None:
        pods = [p for p in pods if _pod_index(p) == index]
    if not pods:
        where = f" with index {index}" if index is not None else ""
        raise UserError(f"job {args.job} has no pods{where} (yet): biggraph status {args.job}")
    if args.follow:
        pod = pods[-1]  # the newest attempt of that index
        with cluster.errors(f"following the log of pod {pod.metadata.name}"):
            response = cluster.core.read_namespaced_pod_log(pod.metadata.name, cluster.namespace, container="trainer",
                                                            follow=True, tail_lines=args.tail, _preload_content=False)
            try:
                for chunk in response.stream(4096):
                    sys.stdout.write(chunk.decode("utf-8", "replace"))
                    sys.stdout.flush()
            finally:
                response.release_conn()
        return 0
    for pod in pods:
        with cluster.errors(f"reading the log of pod {pod.metadata.name}"):
            response = cluster.core.read_namespaced_pod_log(pod.metadata.name, cluster.namespace, container="trainer",
                                                            tail_lines=args.tail, _request_timeout=60,
                                                            _preload_content=False)  # raw bytes, not guessed JSON
            text = response.data.decode("utf-8", "replace")
        prefix = f"[{_pod_index(pod)}] " if len(pods) > 1 else ""
        for line in (text or "").splitlines():
            print(f"{prefix}{line}")
    return 0


def _cancel(args: argparse.Namespace) -> int:
    cluster = Cluster(args)
    job = cluster.read_job(args.job)
    annotations = job.metadata.annotations or {}
    _delete(cluster, "Job", args.job)
    removed = [f"Job {args.job}"]
    for kind, annotation in (("ConfigMap", CONFIG_MAP_ANNOTATION), ("Service", SERVICE_ANNOTATION),
                             ("NetworkPolicy", NETWORK_POLICY_ANNOTATION)):
        name = annotations.get(annotation)
        if name and _delete(cluster, kind, name):
            removed.append(f"{kind} {name}")
    print(f"cancelled: deleted {', '.join(removed)} in namespace {cluster.namespace} (pods are deleted in the background; "
          "checkpoints are kept)")
    return 0


# preflight --------------------------------------------------------------------------------------


def _preflight(args: argparse.Namespace) -> int:
    from job.config import load_config

    config = load_config(args.config, [])
    print(f"preflight: {args.config}: config ok ({len(config.entities)} entity type(s), {len(config.relations)} "
          f"relation type(s), checkpoint_path {config.checkpoint_path})")
    if not (args.check_storage or args.check_write):
        return 0
    check_storage(config, write=args.check_write)
    return 0


@storage_scoped
def check_storage(config: ConfigSchema, *, write: bool) -> None:
    """What a pod checks before it trains: its inputs are reachable and (``write``) its checkpoint_path writable."""
    missing = [url for url in [config.entity_path, *config.edge_paths] if not storage.exists(url)]
    if missing:
        raise UserError(f"preflight: not found: {', '.join(missing)}")
    print(f"preflight: entity_path and {len(config.edge_paths)} edge path(s) reachable")
    if write:
        probe = storage.join(config.checkpoint_path, f".biggraph-preflight-{secrets.token_hex(4)}")
        try:
            storage.makedirs(config.checkpoint_path)
            storage.write_text(probe, "ok\n")
            if storage.read_text(probe) != "ok\n":
                raise UserError(f"preflight: {probe}: read back something else than was written")
        finally:
            storage.remove(probe)
        print(f"preflight: checkpoint_path {config.checkpoint_path} writable")
    elif storage.exists(config.checkpoint_path):
        print(f"preflight: checkpoint_path {config.checkpoint_path} reachable")
