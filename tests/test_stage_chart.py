"""The chart's one-pod stages (eval, export, archive): the command each pod runs, from the values (helm renders
for real), and the values the schema or the templates refuse."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_chart import CHART, render, run_helm, trainer, validate

CPU_VALUES = CHART / "ci" / "cpu-values.yaml"
OUTPUTS = {"eval": {"out": "s3://b/run/eval.json", "candidates": "all", "filter": ["s3://b/valid", "s3://b/test"]},
           "export": {"out": "s3://b/run/export", "format": "parquet"},
           "archive": {"out": "s3://b/run/model.zip", "tag": "first", "dtype": "int8"}}


def stage_job(tmp_path: Path, stage: str, replicas: int = 4) -> dict:
    docs = render(tmp_path, values=[CPU_VALUES], extra={"stage": stage, "replicas": replicas, **OUTPUTS},
                  kube="1.35")
    return next(d for d in docs if d["kind"] == "Job")


@pytest.mark.parametrize(("stage", "args"), [
    ("eval", ["--candidates", "all", "--filter", "s3://b/valid", "--filter", "s3://b/test", "--json",
              "--out", "s3://b/run/eval.json"]),
    ("export", ["--out", "s3://b/run/export", "--format", "parquet", "--overwrite"]),
    ("archive", ["--out", "s3://b/run/model.zip", "--dtype", "int8", "--tag", "first"]),
])
def test_one_pod_stages_run_their_command(tmp_path: Path, stage: str, args: list[str]) -> None:
    job = stage_job(tmp_path, stage)
    validate(job)
    # one pod whatever replicas says (training's pod count): no rendezvous, nothing to share
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 1
    assert job["spec"]["maxFailedIndexes"] == 0
    assert trainer(job)["args"] == ["biggraph", stage, "/etc/biggraph/config.yaml", *args]
    # a bad input (exit 2) fails the stage at once, as for training
    assert job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [2]


def test_stage_defaults_leave_out_the_optional_flags(tmp_path: Path) -> None:
    docs = render(tmp_path, values=[CPU_VALUES], sets=["stage=archive", "archive.out=s3://b/m.zip"])
    job = next(d for d in docs if d["kind"] == "Job")
    assert trainer(job)["args"] == ["biggraph", "archive", "/etc/biggraph/config.yaml", "--out", "s3://b/m.zip",
                                    "--dtype", "fp32"]
    docs = render(tmp_path, values=[CPU_VALUES], sets=["stage=eval", "eval.out=s3://b/e.json"])
    job = next(d for d in docs if d["kind"] == "Job")
    assert trainer(job)["args"] == ["biggraph", "eval", "/etc/biggraph/config.yaml", "--json", "--out",
                                    "s3://b/e.json"]


@pytest.mark.parametrize(("sets", "message"), [
    (["stage=export"], "stage: export needs export.out"),
    (["stage=eval", "eval.out=x", "eval.candidates=every"], "/eval/candidates"),
    (["stage=archive", "archive.out=x", "archive.dtype=bf16"], "/archive/dtype"),
    (["stage=archive", "archive.out=x", "archive.tag=a b"], "/archive/tag"),
    (["stage=serve"], "/stage"),
])
def test_bad_stage_values_are_refused(tmp_path: Path, sets: list[str], message: str) -> None:
    args = ["template", "rel", str(CHART), "-f", str(CPU_VALUES)]
    for item in sets:
        args += ["--set", item]
    done = run_helm(tmp_path, *args)
    assert done.returncode != 0 and message in done.stderr, done.stderr
