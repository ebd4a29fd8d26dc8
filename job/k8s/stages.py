"""``biggraph submit CONFIG --stages import,train,eval,export,archive``: the stages of one release, one Job each,
each created once the one before it completed.

Why one Job per stage rather than one Job (or one pod template) for all: the stages have different shapes. Import
runs N pods with no rendezvous, training N torchrun nodes, eval/export/archive one pod; a Job has one pod template
and one completion count. Kueue admits a Job as one workload, so each stage is admitted for what it needs (the
quota of N trainers is not held while one pod archives), and queues again between stages like any other Job. Each
stage's Job keeps its own failure condition and retry budget (``podFailurePolicy``: a bad input, exit 2, fails its
stage at once), which is what the one line of a failed stage names.

The stages' objects are rendered as the chart's release ``NAME`` (the label ``cancel NAME`` deletes by) with the Job
named ``NAME-STAGE``; ``status NAME`` and ``logs NAME`` follow the stage that is running (``current_stage_job``).

The order is driven from the submitting process: it creates a stage's Job, polls it until it completes, then
renders and creates the next. A stage whose output is already committed (``job.k8s.committed``) is skipped, so a
resubmit after a failure (or after the submitting process went away) goes on from the first stage not done; a
finished Job of an earlier attempt under the same name is deleted first, and a running one is followed, not
duplicated.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from job.errors import UserError
from job.k8s.cluster import RELEASE_KINDS, Cluster, ClusterAccess
from job.k8s.committed import committed_output
from job.k8s.jobs import Prepared, SubmitOptions, create, job_name, job_state, pod_summary, prepare

STAGES = ("import", "train", "eval", "export", "archive")
ROOM = 1 + max(len(stage) for stage in STAGES)  # "-archive" after the release's name
WAITING = ("Pending", "Queued", "Running", "Suspended", "Failing")


class StageFailed(UserError):
    """A stage's Job failed: its one line names the stage and the cause; the stages after it were not run."""

    exit_code = 1


@dataclass(frozen=True)
class StageOutcome:
    stage: str
    job: str
    result: str  # "skipped", "complete" (or "dry run")
    detail: str = ""


def parse_stages(text: str) -> tuple[str, ...]:
    """``import,train,eval``: known stages, each once, in the pipeline's order."""
    stages = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in stages if s not in STAGES]
    if not stages or unknown:
        raise UserError(f"--stages {text}: {'unknown stage ' + ', '.join(unknown) if unknown else 'no stage'} "
                        f"(stages: {','.join(STAGES)})")
    if len(set(stages)) != len(stages) or list(stages) != sorted(stages, key=STAGES.index):
        raise UserError(f"--stages {text}: each stage once, in the order {','.join(STAGES)}")
    return stages


def stage_job_name(release: str, stage: str) -> str:
    return f"{release}-{stage}"


def run_stages(config_path: str, stages: tuple[str, ...], options: SubmitOptions, access: ClusterAccess, *,
               report: Callable[[str], None], poll_seconds: float = 10.0) -> list[StageOutcome]:
    """Run ``stages`` in order as Jobs of one release (see the module docstring); ``report`` gets one line per event.

    A failed stage raises ``StageFailed`` (exit code 1), one line naming the stage, its Job and the cause.
    """
    if any(item.split("=", 1)[0].strip() in ("stage", "fullnameOverride") for item in options.render.set):
        raise UserError("--stages sets each Job's stage and name: leave stage and fullnameOverride out of --set")
    release = job_name(options.name, config_path, room=ROOM)
    outcomes = []
    for position, stage in enumerate(stages):
        name = stage_job_name(release, stage)
        render = dataclasses.replace(options.render, stage=stage, job_name=name)
        prepared = prepare(config_path, dataclasses.replace(options, name=release, render=render), access)
        if any(obj["kind"] == "PersistentVolumeClaim" for obj in prepared.submission.objects):
            # the chart names its own claim after the Job: each stage would get an empty volume of its own
            raise UserError("--stages with persistence.enabled needs persistence.existingClaim: the stages share "
                            "their data through one claim (or use object storage URLs)")
        if prepared.cluster is None:  # a dry run: every stage's manifests, nothing checked on storage
            outcomes.append(StageOutcome(stage, name, "dry run"))
            report_objects(prepared, report)
            continue
        done = committed_output(stage, prepared.submission.job, config_path)
        if done:
            report(f"stage {stage}: skipped, its output is committed ({done})")
            outcomes.append(StageOutcome(stage, name, "skipped", done))
            continue
        cluster = prepared.cluster
        if not _adopt_running(cluster, prepared, stage, report):
            create(prepared)
            pods = prepared.submission.job["spec"]["parallelism"]
            report(f"stage {stage}: submitted job {name} ({pods} pod(s)) to namespace {cluster.namespace}")
        _wait(cluster, name, stage, rest=stages[position + 1:], poll_seconds=poll_seconds)
        report(f"stage {stage}: complete")
        outcomes.append(StageOutcome(stage, name, "complete"))
    return outcomes


def report_objects(prepared: Prepared, report: Callable[[str], None]) -> None:
    import yaml

    report(yaml.safe_dump_all(prepared.submission.objects, sort_keys=False).rstrip("\n"))
    report("---")


def _adopt_running(cluster: Cluster, prepared: Prepared, stage: str, report: Callable[[str], None]) -> bool:
    """A Job of this stage left by an earlier attempt: followed when still running (True), else deleted with the
    stage's other objects so that the stage is created anew (False)."""
    name = prepared.submission.job["metadata"]["name"]
    existing = cluster.find_job(name)
    if existing is None:
        return False
    state = job_state(existing)
    if state in WAITING:
        report(f"stage {stage}: job {name} of an earlier submission is {state.lower()}: following it")
        return True
    for obj in reversed(prepared.submission.objects):  # what `cancel` deletes (RELEASE_KINDS), never a claim
        if (obj["apiVersion"], obj["kind"]) in RELEASE_KINDS:
            cluster.delete(obj["apiVersion"], obj["kind"], obj["metadata"]["name"])
    report(f"stage {stage}: deleted job {name} of an earlier submission ({state.lower()}) to run the stage again")
    return False


def _wait(cluster: Cluster, name: str, stage: str, *, rest: tuple[str, ...], poll_seconds: float) -> None:
    not_run = f"; not run: {', '.join(rest)}" if rest else ""
    while True:
        job = cluster.find_job(name)
        if job is None:
            raise StageFailed(f"stage {stage}: job {name} was deleted (biggraph cancel?){not_run}")
        state = job_state(job)
        if state == "Complete":
            return
        if state == "Failed":
            raise StageFailed(f"stage {stage} failed (job {name}): {failure_cause(cluster, job)}{not_run}")
        time.sleep(poll_seconds)


def failure_cause(cluster: Cluster, job: Any) -> str:
    """The Job's Failed condition (reason: message) and the exit code of its last failed pod, on one line."""
    parts = []
    for condition in (job.status.conditions or []) if job.status else []:
        if condition.type == "Failed" and condition.status == "True":
            parts.append(": ".join(p for p in (condition.reason, condition.message) if p))
    exits = [(p["name"], p["detail"]) for p in map(pod_summary, cluster.job_pods(job.metadata.name))
             if p["detail"].startswith("exit ") and not p["detail"].startswith("exit 0")]
    if exits:
        pod, detail = exits[-1]
        parts.append(f"pod {pod}: {detail}")
    return " ".join("; ".join(parts).split()) or "the Job failed (no condition or pod exit code recorded)"


def current_stage_job(cluster: Cluster, release: str) -> str | None:
    """The Job of a staged release that ``status`` and ``logs`` follow: the first stage not complete (the one
    running, or the one that failed), else the last; None when ``release`` has no stage Jobs."""
    found = [(stage, cluster.find_job(stage_job_name(release, stage))) for stage in STAGES]
    jobs = [(stage, job) for stage, job in found if job is not None]
    if not jobs:
        return None
    for stage, job in jobs:
        if job_state(job) != "Complete":
            return stage_job_name(release, stage)
    return stage_job_name(release, jobs[-1][0])
