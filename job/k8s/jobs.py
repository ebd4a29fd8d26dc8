"""Submit, inspect, read the logs of and cancel a training job on Kubernetes; the results as data.

The command line (:mod:`job.cli.k8s`) prints what these return; a notebook or another tool can
call them the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from job.config import apply_overrides, load_raw_config, parse_config
from job.errors import UserError
from job.k8s.cluster import Cluster, ClusterAccess, pod_index
from job.k8s.names import CONFIG_MAP_ANNOTATION, QUEUE_LABEL
from job.k8s.progress import training_progress
from job.k8s.reach import check_reachable
from job.k8s.render import (
    KubeVersion,
    RenderOptions,
    check_kube_version,
    find_chart,
    find_helm,
    parse_kube_version,
    render_with_helm,
)
from job.k8s.sizing import check_fits, config_needs, job_sizes, job_trains_in_a_group, sized_volumes

# the NetworkPolicy and the group's Secret before the Job, so that no pod runs unprotected or unauthenticated
CREATE_ORDER = ("ServiceAccount", "PersistentVolumeClaim", "ConfigMap", "Service", "NetworkPolicy", "Secret", "Job")
LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
JOB_NAME = re.compile(r"[a-z]([-a-z0-9]{0,54}[a-z0-9])?")


@dataclass(frozen=True)
class SubmitOptions:
    """How to submit: the chart's values to change, and which helm renders it for which Kubernetes version."""

    render: RenderOptions = field(default_factory=RenderOptions)
    name: str | None = None  # default: biggraph-<config name>-<random>
    kube_version: str | None = None  # "X.Y"; default: the cluster's (with dry_run: none)
    dry_run: bool = False  # render only; no cluster needed
    helm: str | None = None  # default: `helm` on PATH (submit needs one)
    chart: str | None = None  # default: $BIGGRAPH_CHART, else the installed package's charts/biggraph


@dataclass
class Submission:
    """What ``submit`` rendered and (unless a dry run) created, in creation order."""

    name: str
    namespace: str
    objects: list[dict[str, Any]]
    created: bool
    checkpoint_path: str | None

    @property
    def job(self) -> dict[str, Any]:
        return next(o for o in self.objects if o["kind"] == "Job")


def job_name(requested: str | None, config_path: str, *, room: int = 0) -> str:
    """``requested`` (checked: the chart derives ≤63-character names from it), else one from the config's name;
    ``room`` characters are left for a suffix (a stage's Job: ``NAME-archive``)."""
    most = 56 - room
    if requested:
        if not JOB_NAME.fullmatch(requested) or len(requested) > most:
            raise UserError(f"--name '{requested}': must be lowercase letters, digits and '-', start with a letter, "
                            f"at most {most} characters")
        return requested
    stem = re.sub(r"[^a-z0-9]+", "-", Path(config_path).stem.lower()).strip("-") or "train"
    return f"biggraph-{stem}"[:most - 7].rstrip("-") + "-" + secrets.token_hex(3)


def plain_config(path: str) -> dict[str, Any]:
    """The user's config as a plain dict (what the ConfigMap holds), validated first."""
    raw = load_raw_config(path)
    parse_config(raw)  # ConfigError (exit 2) now rather than in the pods
    return apply_overrides(raw, [])


def _check_render_options(options: RenderOptions) -> None:
    if options.replicas is not None and options.replicas < 1:
        raise UserError(f"--replicas {options.replicas}: must be at least 1")
    if options.queue is not None and not LABEL_VALUE.fullmatch(options.queue):
        raise UserError(f"--queue '{options.queue}': a LocalQueue name (letters, digits, '-', '_', '.'; at most 63)")


def submit(config_path: str, options: SubmitOptions, access: ClusterAccess) -> Submission:
    """Render the job for ``config_path`` and create its objects (all or none), unless ``options.dry_run``
    (``prepare`` then ``create``).

    The steps, in order: the config is parsed (``biggraph train``'s checks); the pod volumes are sized from what
    the trainer will hold (``job.k8s.sizing``); ``helm template`` renders the chart (``job.k8s.render``: the
    values files, ``--set`` and the CLI's flags as helm values; the chart's values.schema.json checks them); what
    the pods can reach is checked; then, unless a dry run, the chart is rendered again for the cluster's
    namespace and Kubernetes minor, and ``_create_all`` creates the objects through the dynamic client in
    ``CREATE_ORDER``, deleting what it created if any creation fails. A change to what a job is made of belongs
    in the chart (and its values), not here.

    Everything a user can fix (a bad config, flag or name, a local path no volume of the Job mounts, no helm, no
    cluster, an existing job) is a ``UserError`` raised before or instead of a half-created job.
    """
    prepared = prepare(config_path, options, access)
    if prepared.cluster is not None:
        create(prepared)
    return prepared.submission


@dataclass
class Prepared:
    """A rendered and checked submission, and the cluster to create it in (None: a dry run)."""

    submission: Submission
    cluster: Cluster | None


def create(prepared: Prepared) -> None:
    """Create a prepared submission's objects in order (all or none)."""
    assert prepared.cluster is not None
    _create_all(prepared.cluster, prepared.submission.name, prepared.submission.objects)
    prepared.submission.created = True


def prepare(config_path: str, options: SubmitOptions, access: ClusterAccess) -> Prepared:
    """``submit``'s steps up to the creation: everything checked, the objects rendered for the cluster."""
    _check_render_options(options.render)
    kube_version = parse_kube_version(options.kube_version) if options.kube_version else None
    config = plain_config(config_path)
    # what the trainer will hold (from the entity counts, when entity_path is readable from here): the volumes
    # are sized for it unless the values say otherwise, and a pod that cannot hold it is refused below
    needs = config_needs(parse_config(config), "submit")
    shm, tmp = sized_volumes(needs)
    options = dataclasses.replace(options, render=dataclasses.replace(
        options.render, shm=options.render.shm or shm, tmp=options.render.tmp or tmp))
    name = job_name(options.name, config_path)
    helm = find_helm(options.helm)
    check_kube_version(kube_version)
    namespace = access.namespace or "default"
    objects = _render(helm, options, name, namespace, config, kube_version)
    # what the pods can reach is part of the config's checks: before the cluster is asked anything
    check_reachable(parse_config(config), objects)
    cluster = None if options.dry_run else Cluster(access)
    if cluster is not None:  # rendered again for the cluster's namespace and Kubernetes version
        namespace = cluster.namespace
        kube_version = kube_version or cluster.kube_version()
        check_kube_version(kube_version)
        objects = _render(helm, options, name, namespace, config, kube_version)
    objects.sort(key=lambda o: CREATE_ORDER.index(o["kind"]) if o["kind"] in CREATE_ORDER else len(CREATE_ORDER))
    rendered_job = next(o for o in objects if o["kind"] == "Job")
    if job_trains_in_a_group(rendered_job):  # a budget that holds a bucket alone may not hold it beside the sync
        config_needs(parse_config(config), "submit", group=True)
    check_fits(needs, job_sizes(rendered_job), "submit")
    if cluster is None:
        for obj in objects:
            obj.setdefault("metadata", {})["namespace"] = namespace
            if obj["kind"] == "Secret":
                redact_secret(obj)
    return Prepared(Submission(name=name, namespace=namespace, objects=objects, created=False,
                               checkpoint_path=config.get("checkpoint_path")), cluster)


REDACTED = "<redacted>"
REDACTED_NOTE = "biggraph.io/redacted"


def redact_secret(secret: dict[str, Any]) -> None:
    """Replace a rendered Secret's values by a marker, in place, and say so in an annotation.

    Why: a dry run's output is printed, piped and pasted; the group secret helm generated for it must not be in
    it. The value is no loss: a real submit renders the chart again, so the Secret it creates holds a fresh random
    value, never the dry run's. The marker is not base64, so a ``kubectl apply`` of the printed Secret fails
    instead of creating a Secret whose value is known.
    """
    for key in ("data", "stringData"):
        if isinstance(secret.get(key), dict):
            secret[key] = {name: REDACTED for name in secret[key]}
    annotations = secret.setdefault("metadata", {}).setdefault("annotations", {})
    annotations[REDACTED_NOTE] = "a dry run: the values are left out; biggraph submit creates this Secret with a " \
                                 "new random value"


def _render(helm: str, options: SubmitOptions, name: str, namespace: str, config: dict[str, Any],
            kube_version: KubeVersion | None) -> list[dict[str, Any]]:
    return render_with_helm(helm, find_chart(options.chart), name, namespace, config, options.render, kube_version)


def _create_all(cluster: Cluster, name: str, objects: list[dict[str, Any]]) -> None:
    """Create ``objects`` in order; on any failure delete what this call created (by kind and name), so nothing is
    left half-submitted. Not by the release's label: after a name clash (409) that would delete the other job."""
    namespace = cluster.namespace
    created: list[dict[str, Any]] = []
    try:
        for obj in objects:
            kind, obj_name = obj["kind"], obj["metadata"]["name"]
            with cluster.errors(f"creating {kind} {obj_name} in namespace {namespace}"):
                try:
                    cluster.create(obj)
                except Exception as err:
                    if getattr(err, "status", None) == 409:
                        raise UserError(f"{kind} {obj_name} already exists in namespace {namespace} "
                                        f"(biggraph cancel {name} -n {namespace}, or pick another --name)") from None
                    raise
            created.append(obj)
    except UserError:
        for obj in reversed(created):
            with contextlib.suppress(UserError):
                cluster.delete(obj["apiVersion"], obj["kind"], obj["metadata"]["name"])
        raise


# status -----------------------------------------------------------------------------------------


def job_state(job: Any) -> str:
    """Complete, Failed, Failing, Suspended, Queued (suspended by Kueue), Running or Pending."""
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


def pod_summary(pod: Any) -> dict[str, Any]:
    """One pod as ``status`` reports it: index, phase, node, restarts and why it waits or ended."""
    statuses = (pod.status.container_statuses or []) if pod.status else []
    restarts = sum(s.restart_count or 0 for s in statuses)
    detail = ""
    for s in statuses:
        state = s.state
        if state and state.waiting and state.waiting.reason:
            detail = state.waiting.reason
        elif state and state.terminated:
            detail = f"exit {state.terminated.exit_code}" + (f" ({state.terminated.reason})" if state.terminated.reason else "")
    return {"name": pod.metadata.name, "index": pod_index(pod), "phase": (pod.status.phase if pod.status else None),
            "node": pod.spec.node_name if pod.spec else None, "restarts": restarts, "detail": detail}


def followed_job(cluster: Cluster, name: str) -> tuple[str, str | None]:
    """The Job that ``name`` means and its stage: the Job ``name`` itself, else, for a release submitted with
    ``--stages``, the Job of its stage running now (``job.k8s.stages.current_stage_job``)."""
    if cluster.find_job(name) is not None:
        return name, None
    from job.k8s.stages import current_stage_job  # stages builds on this module

    staged = current_stage_job(cluster, name)
    if staged is None:
        cluster.read_job(name)  # the one-line "not found"
    assert staged is not None
    return staged, staged[len(name) + 1:]


def job_status(name: str, access: ClusterAccess) -> dict[str, Any]:
    """The job's state, counts, pods and training progress (what ``biggraph status --json`` prints); for a staged
    release, those of the stage running now (and ``stage`` names it)."""
    cluster = Cluster(access)
    name, stage = followed_job(cluster, name)
    job = cluster.read_job(name)
    pods = [pod_summary(p) for p in cluster.job_pods(name)]
    status = job.status
    report: dict[str, Any] = {
        "job": name, "namespace": cluster.namespace, "state": job_state(job),
        "replicas": job.spec.parallelism, "active": (status.active or 0) if status else 0,
        "succeeded": (status.succeeded or 0) if status else 0, "failed": (status.failed or 0) if status else 0,
        "pods": pods,
    }
    if stage is not None:
        report["stage"] = stage
    queue = (job.metadata.labels or {}).get(QUEUE_LABEL)
    if queue:
        report["queue"] = queue
    report["progress"] = _job_progress(cluster, job, name)
    return report


def _job_progress(cluster: Cluster, job: Any, name: str) -> dict[str, Any]:
    """Progress from the checkpoint of the config in the job's ConfigMap (read with its storage_options)."""
    config_map = (job.metadata.annotations or {}).get(CONFIG_MAP_ANNOTATION)
    if not config_map:
        return {"available": False, "reason": f"the job has no {CONFIG_MAP_ANNOTATION} annotation"}
    with cluster.errors(f"reading ConfigMap {config_map}", f"ConfigMap {config_map} of job {name} not found"):
        data = cluster.core.read_namespaced_config_map(config_map, cluster.namespace, _request_timeout=30).data or {}
    try:
        config = yaml.safe_load(data.get("config.yaml", "")) or {}
    except yaml.YAMLError as err:
        return {"available": False, "reason": f"config.yaml does not parse: {err}"}
    return training_progress(config)


# logs / cancel ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodLog:
    """The trainer container's log of one pod."""

    pod: str
    index: int
    text: str


def _pods_for_logs(cluster: Cluster, name: str, index: int | None) -> list[Any]:
    name, _ = followed_job(cluster, name)  # a staged release: the stage running now
    pods = cluster.job_pods(name)
    if index is not None:
        pods = [p for p in pods if pod_index(p) == index]
    if not pods:
        where = f" with index {index}" if index is not None else ""
        raise UserError(f"job {name} has no pods{where} (yet): biggraph status {name}")
    return pods


def read_logs(name: str, access: ClusterAccess, *, index: int | None = None,
              tail: int | None = None) -> list[PodLog]:
    """The logs of the job's pods (of completion ``index`` only, if given), the last ``tail`` lines of each."""
    cluster = Cluster(access)
    logs = []
    for pod in _pods_for_logs(cluster, name, index):
        with cluster.errors(f"reading the log of pod {pod.metadata.name}"):
            response = cluster.core.read_namespaced_pod_log(pod.metadata.name, cluster.namespace, container="trainer",
                                                            tail_lines=tail, _request_timeout=60,
                                                            _preload_content=False)  # raw bytes, not guessed JSON
            text = response.data.decode("utf-8", "replace")
        logs.append(PodLog(pod=pod.metadata.name, index=pod_index(pod), text=text or ""))
    return logs


def follow_log(name: str, access: ClusterAccess, *, index: int = 0, tail: int | None = None) -> Iterator[str]:
    """The log of the newest attempt of completion ``index``, as text chunks until the pod ends."""
    cluster = Cluster(access)
    pod = _pods_for_logs(cluster, name, index)[-1]
    with cluster.errors(f"following the log of pod {pod.metadata.name}"):
        response = cluster.core.read_namespaced_pod_log(pod.metadata.name, cluster.namespace, container="trainer",
                                                        follow=True, tail_lines=tail, _preload_content=False)
        try:
            for chunk in response.stream(4096):
                yield chunk.decode("utf-8", "replace")
        finally:
            response.release_conn()


def cancel_job(name: str, access: ClusterAccess) -> tuple[str, list[str]]:
    """Delete the job's release: every object the chart labelled with it (``cluster.RELEASE_KINDS``: the Job, its
    pods in the background, ConfigMap, Service, NetworkPolicy, ServiceAccount, the group's Secret), found by the
    release's label.

    Returns the namespace and what was deleted ("Job emb", ...); checkpoints (and the chart's volume claim) are kept.
    """
    cluster = Cluster(access)
    followed_job(cluster, name)  # an unknown job is a one-line error, not an empty deletion
    return cluster.namespace, cluster.delete_release(name)
