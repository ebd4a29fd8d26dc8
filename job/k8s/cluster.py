"""Access to one Kubernetes cluster: the API clients and namespace of a command, with one-line errors.

The ``kubernetes`` package is an optional dependency (``biggraph[k8s]``), so it is imported only
when a command talks to a cluster; ``--dry-run`` renders without it. What the chart renders is created and
deleted through the official client's ``kubernetes.dynamic`` client: any kind the chart holds, found by its
``apiVersion``/``kind`` through the server's discovery, with no table of typed APIs to keep in step with the
chart. Status and logs read Jobs and Pods through the typed APIs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from job.errors import UserError
from job.k8s.names import INDEX_ANNOTATION

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# the label the chart puts on every object of a release (its value: the release, i.e. the job's name)
INSTANCE_LABEL = "app.kubernetes.io/instance"
# what `cancel` deletes by that label, the Job first (its pods go with it, in the background). Not the chart's
# PersistentVolumeClaim: it may hold the data or the checkpoints (delete it with kubectl when done).
RELEASE_KINDS = (("batch/v1", "Job"), ("v1", "ConfigMap"), ("v1", "Service"), ("networking.k8s.io/v1", "NetworkPolicy"),
                 ("v1", "ServiceAccount"), ("v1", "Secret"))


@dataclass(frozen=True)
class ClusterAccess:
    """Which cluster and namespace: ``kubeconfig``/``context`` as kubectl takes them.

    ``namespace`` None means the kubeconfig context's, else 'default'; ``kubeconfig`` None means
    $KUBECONFIG or ~/.kube/config, or the in-cluster service account inside a pod.
    """

    namespace: str | None = None
    kubeconfig: str | None = None
    context: str | None = None


class Cluster:
    """The API clients and namespace of one command; errors become one-line UserErrors."""

    def __init__(self, access: ClusterAccess) -> None:
        try:  # optional dependency: only commands that reach a cluster need it
            from kubernetes import client
        except ImportError:
            raise UserError("the kubernetes package is missing: pip install 'biggraph[k8s]'") from None
        configuration = client.Configuration()
        namespace = _load_configuration(access, configuration)
        configuration.retries = 0  # no cluster: fail now, not after urllib3's retries
        self.host = configuration.host
        self.namespace = access.namespace or namespace or "default"
        self.api = client.ApiClient(configuration)
        self.core = client.CoreV1Api(self.api)
        self.batch = client.BatchV1Api(self.api)
        self.version = client.VersionApi(self.api)
        self._dynamic: Any = None

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
        import urllib3  # comes with kubernetes (optional)
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

    def find_job(self, name: str) -> Any | None:
        """The Job ``name``, or None when there is none."""
        from kubernetes.client.exceptions import ApiException  # optional dependency

        with self.errors(f"reading job {name}"):
            try:
                return self.batch.read_namespaced_job(name, self.namespace, _request_timeout=30)
            except ApiException as err:
                if err.status == 404:
                    return None
                raise

    def job_pods(self, name: str) -> list[Any]:
        """The job's pods by completion index, then age (so the last of an index is its newest attempt)."""
        with self.errors(f"listing the pods of job {name}"):
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"job-name={name}",
                                                 _request_timeout=30).items
        # the selector again on our side (fake API servers may ignore it)
        pods = [p for p in pods if (p.metadata.labels or {}).get("job-name") == name
                or (p.metadata.labels or {}).get("batch.kubernetes.io/job-name") == name]
        return sorted(pods, key=lambda p: (pod_index(p), str(p.metadata.creation_timestamp or ""), p.metadata.name))

    def _resource(self, api_version: str, kind: str) -> Any:
        """The dynamic client's resource of ``kind`` (discovery is asked once per command, on first use)."""
        from kubernetes.dynamic import DynamicClient  # optional dependency
        from kubernetes.dynamic.exceptions import ResourceNotFoundError

        if self._dynamic is None:
            with self.errors("asking the Kubernetes API which kinds it serves"):
                self._dynamic = DynamicClient(self.api)
        try:
            return self._dynamic.resources.get(api_version=api_version, kind=kind)
        except ResourceNotFoundError:
            raise UserError(f"the Kubernetes API at {self.host} does not serve {kind} ({api_version})") from None

    def create(self, obj: dict[str, Any]) -> None:
        """Create one rendered object in this namespace (API errors are the caller's to translate)."""
        obj.setdefault("metadata", {})["namespace"] = self.namespace
        self._resource(obj["apiVersion"], obj["kind"]).create(body=obj, namespace=self.namespace, _request_timeout=30)

    def delete(self, api_version: str, kind: str, name: str) -> bool:
        """Delete one object (its pods in the background); False if it was already gone."""
        from kubernetes.dynamic.exceptions import NotFoundError  # optional dependency

        resource = self._resource(api_version, kind)
        with self.errors(f"deleting {kind} {name}"):
            try:
                resource.delete(name=name, namespace=self.namespace, body={"propagationPolicy": "Background"},
                                _request_timeout=30)
            except NotFoundError:
                return False
        return True

    def release_objects(self, release: str, api_version: str, kind: str) -> list[str]:
        """The names of the ``kind`` objects labelled as the chart's release ``release``.

        The list is read raw (plain JSON, not the client's objects) and the selector applied again on our side, so
        that a server that ignores it (a fake) can never make ``cancel`` delete another job's objects.
        """
        resource = self._resource(api_version, kind)
        with self.errors(f"listing the {kind} objects of {release}"):
            response = resource.get(namespace=self.namespace, label_selector=f"{INSTANCE_LABEL}={release}",
                                    serialize=False, _request_timeout=30)
        items = json.loads(response.data).get("items") or []
        return sorted(item["metadata"]["name"] for item in items
                      if (item["metadata"].get("labels") or {}).get(INSTANCE_LABEL) == release)

    def delete_release(self, release: str) -> list[str]:
        """Delete every object of the chart's release ``release`` (``RELEASE_KINDS``, by its instance label), the
        Job first; what was deleted, as "Kind name"."""
        removed = []
        for api_version, kind in RELEASE_KINDS:
            for name in self.release_objects(release, api_version, kind):
                if self.delete(api_version, kind, name):
                    removed.append(f"{kind} {name}")
        return removed


def _load_configuration(access: ClusterAccess, configuration: Any) -> str | None:
    """Fill ``configuration`` from the kubeconfig (or the pod's service account); the namespace it names."""
    from kubernetes import config  # optional dependency

    namespace = None
    try:
        if access.kubeconfig or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_kube_config(config_file=access.kubeconfig, context=access.context,
                                    client_configuration=configuration)
            contexts, active = config.list_kube_config_contexts(config_file=access.kubeconfig)
            if access.context:
                active = next((c for c in contexts if c["name"] == access.context), active)
            namespace = (active or {}).get("context", {}).get("namespace")
        else:
            config.load_incluster_config(client_configuration=configuration)
            with contextlib.suppress(OSError):
                namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    except (config.ConfigException, OSError, TypeError, ValueError) as err:
        where = access.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise UserError(f"no Kubernetes cluster configured ({where}): {str(err).splitlines()[0]}") from None
    return namespace


def _api_message(err: Any) -> str:
    with contextlib.suppress(Exception):
        return json.loads(err.body)["message"]
    return str(err.reason or err.body or "").strip() or "no details"


def pod_index(pod: Any) -> int:
    """A pod's completion index (-1 when it has none)."""
    meta = pod.metadata
    value = (meta.annotations or {}).get(INDEX_ANNOTATION) or (meta.labels or {}).get(INDEX_ANNOTATION)
    if value is None:
        return -1
    with contextlib.suppress(TypeError, ValueError):
        return int(value)
    return -1
