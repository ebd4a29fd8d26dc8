"""The manifests of one job: ``charts/biggraph`` through ``helm template``, or ``k8s/base`` with Python.

Both follow the cluster's Kubernetes minor: the chart through ``helm template --kube-version`` (its
``.Capabilities`` checks), the plain manifests by adding in Python what the chart adds on newer
minors (``k8s/base`` is the chart rendered for the oldest supported one; tests/test_chart.py
compares the two on every minor).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from job.errors import UserError
from job.k8s.names import QUEUE_LABEL

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
# an installed wheel's copy of charts/biggraph and k8s/base (setup.py puts them there; a checkout has none)
PACKAGED = Path(__file__).resolve().parent / "_bundled"
BASE_NAME = "biggraph-job"  # the name used throughout k8s/base
# Kubernetes minors (charts/biggraph/Chart.yaml kubeVersion and the capability checks in its job.yaml)
MIN_KUBE_MINOR = 31  # podFailurePolicy GA
PER_INDEX_MINOR = 33  # backoffLimitPerIndex GA
POD_REPLACEMENT_MINOR = 34  # podReplacementPolicy GA
BACKOFF_LIMIT_PER_INDEX = 3  # the chart's default backoffLimitPerIndex

KubeVersion = tuple[int, int]


@dataclass(frozen=True)
class RenderOptions:
    """What a submission changes in the chart's defaults (None: the chart's value).

    ``values`` (Helm values files) and ``set`` (``KEY=VALUE`` items) need helm; ``replicas``,
    ``image`` and ``queue`` win over the files, and ``set`` over everything, as with helm itself.
    """

    replicas: int | None = None
    image: str | None = None  # REPO[:TAG]
    queue: str | None = None  # a Kueue LocalQueue: the Job starts suspended
    values: tuple[str, ...] = ()
    set: tuple[str, ...] = ()
    # /dev/shm and /tmp sizes (Kubernetes quantities) sized from the config (job/k8s/sizing.py); the values files
    # and --set win over them; None: the chart's defaults, which follow the config's memory_budget
    shm: str | None = None
    tmp: str | None = None


def parse_kube_version(text: str) -> KubeVersion:
    """``1.34``, ``v1.34.2`` or ``1.34.2-eks-1`` as (1, 34)."""
    match = re.fullmatch(r"v?(\d+)\.(\d+)(\.\d+)?([-+].*)?", text.strip())
    if not match:
        raise UserError(f"--kube-version {text}: expected MAJOR.MINOR, e.g. 1.34")
    return int(match.group(1)), int(match.group(2))


def check_kube_version(version: KubeVersion | None) -> None:
    """Refuse minors older than the chart supports (None, an unknown version, passes)."""
    if version is not None and version < (1, MIN_KUBE_MINOR):
        raise UserError(f"Kubernetes {version[0]}.{version[1]} is not supported: biggraph needs 1.{MIN_KUBE_MINOR} "
                        "or newer (Job podFailurePolicy)")


def find_helm(helm: str | None = None, *, no_helm: bool = False) -> str | None:
    """The helm binary to render with: ``helm`` if given (it must be executable), else the one on PATH."""
    if no_helm:
        return None
    if helm:
        if not (os.path.isfile(helm) and os.access(helm, os.X_OK)):
            raise UserError(f"--helm {helm}: not an executable file")
        return helm
    return shutil.which("helm")


def shipped(relative: str, marker: str) -> Path:
    """``charts/biggraph`` or ``k8s/base`` (holding ``marker``): the installed package's copy, else the checkout's
    (which the error names when neither has it)."""
    for root in (PACKAGED, REPO_ROOT):
        if (root / relative / marker).is_file():
            return root / relative
    return REPO_ROOT / relative


def find_chart(chart: str | None = None) -> Path:
    """The chart directory: ``chart``, else $BIGGRAPH_CHART, else the installed package's (or checkout's) chart."""
    for candidate in (chart, os.environ.get("BIGGRAPH_CHART"), shipped("charts/biggraph", "Chart.yaml")):
        if candidate and (Path(candidate) / "Chart.yaml").is_file():
            return Path(candidate)
    raise UserError("the biggraph Helm chart was not found: pass --chart DIR or set BIGGRAPH_CHART")


def split_image(image: str) -> tuple[str, str]:
    """``reg.io:5000/bg:v2`` -> ("reg.io:5000/bg", "v2"); no tag -> (image, "")."""
    repository, _, tag = image.rpartition(":")
    if not repository or "/" in tag:
        return image, ""
    return repository, tag


def render_with_helm(helm: str, chart: Path, name: str, namespace: str, config: dict[str, Any],
                     options: RenderOptions, kube_version: KubeVersion | None = None) -> list[dict[str, Any]]:
    """``helm template`` of the chart as release ``name``, with ``config`` as the job's training config."""
    values: dict[str, Any] = {"fullnameOverride": name, "config": config}
    if options.replicas is not None:
        values["replicas"] = options.replicas
    if options.image:
        repository, tag = split_image(options.image)
        values["image"] = {"repository": repository, "tag": tag}
    if options.queue:
        values["kueue"] = {"queueName": options.queue}
    sized: dict[str, Any] = {key: {"sizeLimit": size} for key, size in (("shm", options.shm), ("tmp", options.tmp))
                             if size}
    with tempfile.TemporaryDirectory(prefix="biggraph-submit-") as tmp:
        generated = Path(tmp) / "submit-values.yaml"
        generated.write_text(yaml.safe_dump(values, sort_keys=False))
        command = [helm, "template", name, str(chart), "--namespace", namespace, "--skip-tests"]
        if kube_version is not None:  # the chart's capability checks see the cluster's version
            command += ["--kube-version", f"{kube_version[0]}.{kube_version[1]}.0"]
        if sized:  # the volume sizes the config needs: before the user's files, which win
            sizes = Path(tmp) / "sized-values.yaml"
            sizes.write_text(yaml.safe_dump(sized, sort_keys=False))
            command += ["--values", str(sizes)]
        for file in options.values:
            command += ["--values", file]
        command += ["--values", str(generated)]  # the CLI's own flags win over the files ...
        for item in options.set:
            command += ["--set", item]  # ... and --set over both, as with helm itself
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise UserError(f"running {helm}: {err}") from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise UserError(f"helm template failed: {lines[-1] if lines else 'exit code ' + str(done.returncode)}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def render_plain(name: str, config: dict[str, Any], options: RenderOptions,
                 kube_version: KubeVersion | None = None) -> list[dict[str, Any]]:
    """``k8s/base`` with its fixed name replaced, replicas, image, queue and config filled in, and the Job
    fields the chart adds on newer Kubernetes minors (tests/test_chart.py compares the two on every minor)."""
    if options.values or options.set:
        raise UserError("--values/--set need helm: install helm or pass --helm PATH")
    objects = _load_base(name)
    for obj in objects:
        obj["metadata"].setdefault("labels", {})["app.kubernetes.io/instance"] = name
        if obj["kind"] == "ConfigMap":
            obj["data"]["config.yaml"] = yaml.safe_dump(config, sort_keys=False)
        if obj["kind"] == "Job":
            _fill_job(obj, name, options)
            _size_volumes(obj, config, options)
            _newer_job_fields(obj["spec"], kube_version)
        if obj["kind"] == "Service":
            obj["spec"]["selector"]["app.kubernetes.io/instance"] = name
    return objects


def _load_base(name: str) -> list[dict[str, Any]]:
    """The objects of k8s/base (its kustomization's resources) with ``BASE_NAME`` renamed to ``name``."""
    base = shipped("k8s/base", "kustomization.yaml")
    kustomization = base / "kustomization.yaml"
    if not kustomization.is_file():
        raise UserError(f"{base}: the plain manifests were not found (and no helm binary): pass --helm PATH")
    objects: list[dict[str, Any]] = []
    for resource in yaml.safe_load(kustomization.read_text())["resources"]:
        text = (base / resource).read_text()
        objects += [doc for doc in yaml.safe_load_all(re.sub(rf"\b{BASE_NAME}\b", name, text)) if doc]
    return objects


def _fill_job(job: dict[str, Any], name: str, options: RenderOptions) -> None:
    """What the chart's values set in its Job: the instance label, replicas (and torchrun's nnodes), image, queue."""
    spec = job["spec"]
    pod = spec["template"]
    pod["metadata"]["labels"]["app.kubernetes.io/instance"] = name
    container = pod["spec"]["containers"][0]
    replicas = options.replicas
    if replicas is not None:
        spec["completions"] = spec["parallelism"] = replicas
        container["args"] = [f"--nnodes={replicas}:{replicas}" if a.startswith("--nnodes=") else a
                             for a in container["args"]]
    if options.image:
        repository, tag = split_image(options.image)
        container["image"] = f"{repository}:{tag}" if tag else repository
    if options.queue:
        job["metadata"]["labels"][QUEUE_LABEL] = options.queue
        spec["suspend"] = True  # Kueue resumes it on admission


def _size_volumes(job: dict[str, Any], config: dict[str, Any], options: RenderOptions) -> None:
    """/dev/shm and /tmp as the chart sizes them: ``options.shm``/``tmp``, else from the config's memory_budget (else
    the memory limit), with the environment that tells the pod's preflight (charts/biggraph/templates/_helpers.tpl)."""
    from job.k8s.sizing import default_volume_sizes, parse_quantity

    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    limit = parse_quantity(((container.get("resources") or {}).get("limits") or {}).get("memory"))
    shm, tmp = default_volume_sizes(config.get("memory_budget"), limit)
    sizes = {"dshm": options.shm or shm, "tmp": options.tmp or tmp}
    for volume in pod["volumes"]:
        if volume["name"] in sizes:
            if sizes[volume["name"]]:
                volume["emptyDir"]["sizeLimit"] = sizes[volume["name"]]
            else:
                volume["emptyDir"].pop("sizeLimit", None)
    for env in container["env"]:
        if env["name"] == "BIGGRAPH_SHM_LIMIT":
            env["value"] = sizes["dshm"]
        elif env["name"] == "BIGGRAPH_TMP_LIMIT":
            env["value"] = sizes["tmp"]


def _newer_job_fields(spec: dict[str, Any], kube_version: KubeVersion | None) -> None:
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
