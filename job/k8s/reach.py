"""What a job's pods can reach: every local path of the config must lie on a data volume the rendered Job mounts.

The config goes to the pods as it is. A path of the submitting machine (``biggraph demo`` leaves
``demo-output/config.yaml`` with ``demo-output/data``) means nothing there: each pod would look for it in its own
filesystem and fail in preflight minutes later. So ``submit`` checks the rendered Job before creating anything: a
local path (a plain path or ``file://``) passes only if it is absolute and lies, component by component, under the
mount of a data volume of the trainer container (a PersistentVolumeClaim, NFS, hostPath, CSI...: not the emptyDir
``/tmp`` or ``/dev/shm``, nor the config's ConfigMap). Anything else is one line naming each such key and value,
and the chart values that would mount a volume there. Object storage URLs (``s3://``...) are not checked here
(the pods' preflight checks that they exist).
"""

from __future__ import annotations

import posixpath
from typing import Any

import storage_adapters as storage
from job.errors import UserError

PATH_KEYS = ("entity_path", "edge_paths", "checkpoint_path", "init_path", "tensorboard_dir")
# volume sources that hold no user data: per-pod scratch space, or what the chart itself puts there
NOT_DATA = {"emptyDir", "configMap", "secret", "downwardAPI", "projected", "ephemeral"}


def local_paths(config: Any) -> list[tuple[str, str]]:
    """(key, value) of each path of the config (a ``ConfigSchema``) that names this machine's filesystem."""
    out = []
    for key in PATH_KEYS:
        value = getattr(config, key, None)
        values = value if isinstance(value, list) else [value]
        for index, url in enumerate(values):
            if isinstance(url, str) and url and storage.is_local(url):
                out.append((f"{key}[{index}]" if isinstance(value, list) else key, url))
    return out


def data_mounts(objects: list[dict[str, Any]]) -> list[str]:
    """The mount paths of the data volumes of the rendered Job's trainer container."""
    job = next((o for o in objects if o.get("kind") == "Job"), None)
    if job is None:
        return []
    pod = job["spec"]["template"]["spec"]
    volumes = {v.get("name"): v for v in pod.get("volumes") or []}
    containers = pod.get("containers") or [{}]
    mounts = []
    for mount in containers[0].get("volumeMounts") or []:
        sources = set(volumes.get(mount.get("name"), {})) - {"name"}
        if sources and not sources & NOT_DATA and isinstance(mount.get("mountPath"), str):
            mounts.append(posixpath.normpath(mount["mountPath"]))
    return mounts


def _under(path: str, mount: str) -> bool:
    parts, root = path.strip("/").split("/"), mount.strip("/").split("/")
    return mount == "/" or parts[: len(root)] == root


def unreachable(config: Any, objects: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(key, value) of each local path of ``config`` that no data volume of the rendered Job provides."""
    mounts = data_mounts(objects)
    out = []
    for key, url in local_paths(config):
        path = storage.local_path(url)
        if not (posixpath.isabs(path) and any(_under(posixpath.normpath(path), m) for m in mounts)):
            out.append((key, url))
    return out


def check_reachable(config: Any, objects: list[dict[str, Any]]) -> None:
    """Refuse (UserError, one line) a config whose local paths the pods of the rendered Job cannot reach."""
    missing = unreachable(config, objects)
    if not missing:
        return
    mounts = data_mounts(objects)
    named = ", ".join(f"{key} {url}" for key, url in missing)
    mount = mounts[0] if mounts else "/data"
    relative = [p for p in posixpath.normpath(storage.local_path(missing[0][1])).split("/") if p not in ("", ".", "..")]
    example = f"{missing[0][0].split('[')[0]}: {posixpath.join(mount, *relative)}"
    what = "a local path" if len(missing) == 1 else "local paths"
    if mounts:
        raise UserError(
            f"the pods cannot reach {named}: {what} of this machine, outside the Job's data volumes (mounted at "
            f"{', '.join(mounts)}; a relative path is resolved in the pod's own /tmp). Use absolute paths under the "
            f"mount, with the files copied onto its volume (e.g. {example}), or object storage URLs (s3://...)")
    values = (f"--set persistence.enabled=true --set persistence.existingClaim=CLAIM --set persistence.mountPath={mount}"
              " (or -f values.yaml, as charts/biggraph/ci/pvc-values.yaml)")
    raise UserError(
        f"the pods cannot reach {named}: {what} of this machine, and the Job mounts no data volume (a relative path "
        f"is resolved in the pod's own /tmp). Use object storage URLs (s3://...), or copy the files onto a "
        f"PersistentVolumeClaim, use absolute paths under its mount (e.g. {example}) and submit with {values}")
