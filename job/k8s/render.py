"""The manifests of one job: ``charts/biggraph`` through ``helm template``, the one source of the manifests.

They follow the cluster's Kubernetes minor through ``helm template --kube-version`` (the chart's
``.Capabilities`` checks). There is no second rendering in Python: ``biggraph submit`` needs a helm binary
(on PATH or ``--helm``). ``k8s/base`` (for ``kubectl apply -k`` without helm or biggraph) is the chart
rendered for the oldest supported minor, and tests/test_chart.py holds it to that.
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

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
# an installed wheel's copy of charts/biggraph (setup.py puts it there; a checkout has none)
PACKAGED = Path(__file__).resolve().parent / "_bundled"
# the oldest Kubernetes minor the chart supports (charts/biggraph/Chart.yaml kubeVersion): podFailurePolicy GA
MIN_KUBE_MINOR = 31

KubeVersion = tuple[int, int]


@dataclass(frozen=True)
class RenderOptions:
    """What a submission changes in the chart's defaults (None: the chart's value).

    ``values`` (Helm values files) and ``set`` (``KEY=VALUE`` items) are passed to helm; ``replicas``,
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
    # a staged submission (job.k8s.stages): the chart's stage, and the Job's own name within the release (the
    # objects of every stage carry the release's label, so `cancel RELEASE` deletes them all)
    stage: str | None = None
    job_name: str | None = None


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


def find_helm(helm: str | None = None) -> str:
    """The helm binary to render with: ``helm`` if given (it must be executable), else the one on PATH."""
    if helm:
        if not (os.path.isfile(helm) and os.access(helm, os.X_OK)):
            raise UserError(f"--helm {helm}: not an executable file")
        return helm
    found = shutil.which("helm")
    if found is None:
        raise UserError("submit renders charts/biggraph with helm, and there is no helm on PATH: install helm "
                        "(https://helm.sh/docs/intro/install/) or pass --helm PATH")
    return found


def shipped(relative: str, marker: str) -> Path:
    """``charts/biggraph`` (holding ``marker``): the installed package's copy, else the checkout's (which the error
    names when neither has it)."""
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
    values: dict[str, Any] = {"fullnameOverride": options.job_name or name, "config": config}
    if options.stage:
        values["stage"] = options.stage
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
