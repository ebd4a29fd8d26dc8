"""``biggraph submit`` refuses, at once and in one line, a config whose local paths the job's pods cannot reach.

The demo's config (``biggraph demo`` writes local paths) rendered as is gives pods that look for the submitting
machine's directories and fail in preflight minutes later. A local path passes only when the rendered Job mounts a
data volume there (the chart's ``persistence``); object storage URLs pass as before.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_chart import helm_binary, helm_env

from job.cli import main
from job.demo import demo_config
from job.k8s.reach import data_mounts, unreachable
from job.k8s.render import RenderOptions, find_chart, render_with_helm

PVC = ["--set", "persistence.enabled=true", "--set", "persistence.existingClaim=graphs"]


def submit(tmp_path: Path, config: dict[str, Any], *flags: str) -> tuple[int, str, str]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["submit", str(path), "--dry-run", "--name", "emb", "--kubeconfig", str(tmp_path / "none"), *flags])
    return code, out.getvalue(), err.getvalue()


def with_helm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    helm = helm_binary()
    for key, value in helm_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    return ["--helm", helm]


@pytest.fixture()
def helm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``--helm PATH`` for submit (which renders the chart with it), skipping the test without a helm binary."""
    return with_helm(tmp_path, monkeypatch)


def test_the_demo_config_is_refused_at_once_naming_each_local_key_and_the_values_that_mount_one(
        tmp_path: Path, helm: list[str]) -> None:
    config = demo_config(str(tmp_path / "demo-output"))
    code, out, err = submit(tmp_path, config, *helm)
    assert code == 2 and out == ""
    [line] = err.strip().splitlines()
    for key in ("entity_path", "edge_paths[0]", "checkpoint_path"):
        value = config[key.replace("[0]", "")]
        assert f"{key} {value[0] if isinstance(value, list) else value}" in line
    assert "the Job mounts no data volume" in line and "s3://" in line
    assert "--set persistence.enabled=true --set persistence.existingClaim=CLAIM --set persistence.mountPath=/data" in line
    assert f"entity_path: /data{tmp_path}/demo-output/data" in line  # where the copy would go


def test_a_relative_path_is_refused_even_under_a_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    helm = with_helm(tmp_path, monkeypatch)
    config = demo_config("demo-output")  # relative, as a hand-written config may have it
    code, _, err = submit(tmp_path, config, *helm, *PVC)
    assert code == 2
    assert "entity_path demo-output/data," in err and "outside the Job's data volumes (mounted at /data" in err
    assert "e.g. entity_path: /data/demo-output/data" in err and "--set persistence" not in err


def test_paths_on_the_mounted_claim_are_accepted_and_others_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    helm = with_helm(tmp_path, monkeypatch)
    config = demo_config("/data/demo-output")
    code, out, err = submit(tmp_path, config, *helm, *PVC)
    assert code == 0, err
    job = next(o for o in yaml.safe_load_all(out) if o and o["kind"] == "Job")
    assert job["spec"]["template"]["spec"]["volumes"][-1]["persistentVolumeClaim"]["claimName"] == "graphs"
    # a values file mounting the claim elsewhere: the same paths are now outside it
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"persistence": {"enabled": True, "existingClaim": "graphs", "mountPath": "/mnt/g"}}))
    code, _, err = submit(tmp_path, config, *helm, "-f", str(values))
    assert code == 2 and "mounted at /mnt/g" in err and "entity_path /data/demo-output/data," in err
    # prefix confusion: /data2 is not under /data; nor is the pod's scratch /tmp a data volume
    code, _, err = submit(tmp_path, {**config, "checkpoint_path": "/data2/ck", "tensorboard_dir": "/tmp/tb"}, *helm, *PVC)
    assert code == 2 and "reach checkpoint_path /data2/ck, tensorboard_dir /tmp/tb:" in err
    assert "entity_path" not in err.split(":")[1]


def test_object_storage_passes_and_only_the_local_keys_are_named(tmp_path: Path, helm: list[str]) -> None:
    config = {**demo_config("/ignored"), "entity_path": "s3://bucket/data", "edge_paths": ["s3://bucket/data/train"],
              "checkpoint_path": "s3://bucket/ck"}
    code, out, _ = submit(tmp_path, config, *helm)
    assert code == 0 and "kind: Job" in out
    code, _, err = submit(tmp_path, {**config, "edge_paths": ["s3://bucket/e", "file:///home/me/e"],
                                     "init_path": "old-model"}, *helm)
    assert code == 2 and "reach edge_paths[1] file:///home/me/e, init_path old-model: local paths" in err


def test_mounts_are_read_from_the_rendered_job(helm: list[str]) -> None:
    config = {**demo_config("/ignored"), "entity_path": "s3://b/e", "edge_paths": ["s3://b/p"], "checkpoint_path": "s3://b/c"}
    objects = render_with_helm(helm[1], find_chart(), "emb", "default", config, RenderOptions())
    assert data_mounts(objects) == []  # /etc/biggraph (ConfigMap), /tmp and /dev/shm (emptyDir) hold no data
    job = next(o for o in objects if o["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    pod["volumes"].append({"name": "nfs", "nfs": {"server": "filer", "path": "/export"}})
    pod["containers"][0]["volumeMounts"].append({"name": "nfs", "mountPath": "/shared/"})
    assert data_mounts(objects) == ["/shared"]

    class Config:
        entity_path, edge_paths, checkpoint_path = "/shared/e", ["/shared/../etc/e", "/shared"], "/sharedx/ck"
        init_path, tensorboard_dir = None, "s3://b/tb"

    assert unreachable(Config(), objects) == [("edge_paths[0]", "/shared/../etc/e"), ("checkpoint_path", "/sharedx/ck")]


def test_refused_before_the_cluster_is_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str], helm: list[str]) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(demo_config(str(tmp_path / "demo-output"))))
    assert main(["submit", str(path), *helm, "--kubeconfig", str(tmp_path / "missing")]) == 2  # no dry run
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "the pods cannot reach entity_path" in line and "kubeconfig" not in line
