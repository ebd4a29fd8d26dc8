"""The chart's import stage: an Indexed Job whose pods run ``biggraph import ... --pods N`` (helm renders for real).

The slow test runs the rendered command itself as the pods would (JOB_COMPLETION_INDEX = 0..N-1, no --pod-index),
and checks the output is the single-process import's, byte for byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_chart import CHART, render, run_helm, trainer, validate
from test_import_pods import OPTIONS, digests, write_config, write_inputs

from job.config import load_config
from job.data.importing import import_edges

REPO = Path(__file__).resolve().parent.parent
CPU_VALUES = CHART / "ci" / "cpu-values.yaml"
COLUMNS = ["-l", "0", "--rel-col", "1", "-r", "2", "--entity-min-count", "2", "--shard-size", str(OPTIONS.shard_size / 2**20)]


def import_values(out: str, files: list[str], replicas: int = 3) -> dict:
    config = json.loads(Path(write_config(Path(out).parent / "values-config.json", out)).read_text())
    return {"stage": "import", "replicas": replicas, "config": config, "importer": {"files": files, "args": COLUMNS}}


def test_import_stage_renders_an_indexed_job_of_import_pods(tmp_path: Path) -> None:
    files = ["s3://raw/a.tsv", "s3://raw/b.tsv"]
    docs = render(tmp_path, extra=import_values(str(tmp_path / "out"), files))
    job = next(d for d in docs if d["kind"] == "Job")
    validate(job)
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 3
    args = trainer(job)["args"]
    assert args == ["biggraph", "import", "/etc/biggraph/config.yaml", *files, *COLUMNS, "--pods", "3"]
    # a bad input (exit 2) fails the Job at once instead of being retried on every index
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "FailJob" and rules[0]["onExitCodes"]["values"] == [2]
    training = trainer(next(d for d in render(tmp_path, values=[CPU_VALUES]) if d["kind"] == "Job"))["args"]
    assert "train" in training and "import" not in training  # the default stage is unchanged


def test_import_stage_without_files_is_refused(tmp_path: Path) -> None:
    done = run_helm(tmp_path, "template", "rel", str(CHART), "-f", str(CPU_VALUES), "--set", "stage=import")
    assert done.returncode != 0 and "stage: import needs importer.files" in done.stderr
    done = run_helm(tmp_path, "template", "rel", str(CHART), "-f", str(CPU_VALUES), "--set", "stage=export")
    assert done.returncode != 0 and "stage" in done.stderr


@pytest.mark.slow
def test_the_rendered_import_command_run_as_the_job_pods(tmp_path: Path) -> None:
    files = write_inputs(tmp_path / "in")
    expected_config = write_config(tmp_path / "one.json", str(tmp_path / "one"))
    import_edges(load_config(expected_config), files, OPTIONS)
    values = import_values(str(tmp_path / "pods"), files, replicas=2)
    job = next(d for d in render(tmp_path, extra=values) if d["kind"] == "Job")
    args = trainer(job)["args"]
    config = tmp_path / "pods.json"
    config.write_text(json.dumps(values["config"]))
    command = [sys.executable, "-m", "job", *[str(config) if a == "/etc/biggraph/config.yaml" else a for a in args[1:]]]
    pods = [subprocess.Popen(command, cwd=REPO, env={**os.environ, "JOB_COMPLETION_INDEX": str(i)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [pod.communicate(timeout=300)[0] for pod in pods]
    assert [pod.returncode for pod in pods] == [0, 0], outputs
    assert "pod 1 of 2 done" in outputs[1] and "imported" in outputs[0]
    assert digests(str(tmp_path / "pods")) == digests(str(tmp_path / "one"))


def test_biggraph_submit_renders_the_import_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml
    from test_chart import helm_binary

    from job.cli import main

    config = tmp_path / "s3.json"
    config.write_text(json.dumps({
        "entities": {"all": {"num_partitions": 4}},
        "relations": [{"name": "r", "lhs": "all", "rhs": "all", "operator": "translation"}],
        "dynamic_relations": True, "global_emb": False, "dimension": 16,
        "entity_path": "s3://my-bucket/g/entities", "edge_paths": ["s3://my-bucket/g/edges"],
        "checkpoint_path": "s3://my-bucket/g/model",
    }))
    code = main(["submit", str(config), "--helm", helm_binary(), "--chart", str(CHART), "--dry-run", "--kube-version",
                 "1.35", "--replicas", "3", "--name", "imp", "--set", "stage=import",
                 "--set", "importer.files={s3://my-bucket/raw/a.tsv}", "--set", "importer.args={-l,0,--rel-col,1,-r,2}"])
    assert code == 0
    job = next(d for d in yaml.safe_load_all(capsys.readouterr().out) if d and d["kind"] == "Job")
    assert trainer(job)["args"] == ["biggraph", "import", "/etc/biggraph/config.yaml", "s3://my-bucket/raw/a.tsv",
                                    "-l", "0", "--rel-col", "1", "-r", "2", "--pods", "3"]
