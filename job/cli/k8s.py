"""Kubernetes subcommands: ``submit``, ``status``, ``logs``, ``cancel`` (and ``preflight``, run inside pods).

The arguments and the printing; what they do is :mod:`job.k8s`. ``preflight``'s name and flags are
called by charts/biggraph and k8s/base: keep them. ``submit`` renders the chart with helm (needed on PATH or
``--helm``) and creates what it renders through the Kubernetes API (:func:`job.k8s.jobs.submit`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml

from job.config import load_config
from job.k8s.cluster import ClusterAccess
from job.k8s.jobs import Submission, SubmitOptions, cancel_job, follow_log, job_status, read_logs, submit
from job.k8s.names import QUEUE_LABEL
from job.k8s.preflight import check_storage
from job.k8s.render import RenderOptions
from job.k8s.sizing import check_config_fits, pod_sizes_from_env, quantity


def register(subparsers: Any) -> None:
    _register_submit(subparsers)

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

    cancel = subparsers.add_parser("cancel", help="delete a Kubernetes job and every object of its release (by label); "
                                   "checkpoints and volume claims are kept")
    cancel.add_argument("job", help="job name")
    _cluster_arguments(cancel)
    cancel.set_defaults(func=_cancel)

    preflight = subparsers.add_parser("preflight", help="check a config (and its storage) before training; used in pods")
    preflight.add_argument("config", help="training config")
    preflight.add_argument("--check-storage", action="store_true", help="entity_path, edge_paths and checkpoint_path exist")
    preflight.add_argument("--check-write", action="store_true", help="write and remove a probe under checkpoint_path")
    preflight.set_defaults(func=_preflight)


def _register_submit(subparsers: Any) -> None:
    submit_parser = subparsers.add_parser("submit", help="train on Kubernetes: render the Helm chart and create the Job")
    add = submit_parser.add_argument
    add("config", help="training config (.py, .yaml or .json); it becomes the Job's ConfigMap")
    add("--name", help="job name (default: biggraph-<config name>-<random>)")
    add("--replicas", type=int, help="pods (torchrun nodes)")
    add("--image", help="trainer image, REPO[:TAG]")
    add("--queue", help="Kueue LocalQueue: the Job is created suspended and starts once Kueue admits it")
    add("--kube-version", metavar="X.Y",
        help="render for this Kubernetes version (default: the cluster's; with --dry-run and no "
             "cluster: helm's default)")
    add("-f", "--values", action="append", default=[], metavar="FILE", help="Helm values file (repeatable)")
    add("--set", action="append", default=[], metavar="KEY=VALUE", help="Helm value (repeatable)")
    add("--dry-run", action="store_true", help="print the manifests instead of creating them")
    add("--helm", help="helm binary (default: `helm` on PATH; submit renders the chart with it)")
    add("--chart", help="chart directory (default: $BIGGRAPH_CHART, else the chart installed with biggraph)")
    add("--stages", metavar="STAGE,...",
        help="run these stages in order, one Job each (import,train,eval,export,archive or some of them, in that "
             "order), each created once the one before completed; a stage whose output is committed is skipped. "
             "The command waits for the last stage")
    add("--poll-seconds", type=float, default=10.0, help="with --stages: how often a stage's Job is checked (default 10)")
    _cluster_arguments(submit_parser)
    submit_parser.set_defaults(func=_submit)


def _cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--namespace", help="namespace (default: the kubeconfig context's, else 'default')")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, or in-cluster)")
    parser.add_argument("--context", help="kubeconfig context")


def _access(args: argparse.Namespace) -> ClusterAccess:
    return ClusterAccess(namespace=args.namespace, kubeconfig=args.kubeconfig, context=args.context)


def _submit(args: argparse.Namespace) -> int:
    render = RenderOptions(replicas=args.replicas, image=args.image, queue=args.queue,
                           values=tuple(args.values), set=tuple(args.set))
    options = SubmitOptions(render=render, name=args.name, kube_version=args.kube_version, dry_run=args.dry_run,
                            helm=args.helm, chart=args.chart)
    if args.stages:
        from job.k8s.stages import parse_stages, run_stages

        run_stages(args.config, parse_stages(args.stages), options, _access(args), poll_seconds=args.poll_seconds,
                   report=lambda line: print(line, flush=True))
        return 0
    submission = submit(args.config, options, _access(args))
    if not submission.created:
        sys.stdout.write(yaml.safe_dump_all(submission.objects, sort_keys=False))
        return 0
    _print_submitted(submission)
    return 0


def _print_submitted(submission: Submission) -> None:
    job, name, namespace = submission.job, submission.name, submission.namespace
    print(f"submitted job {job['metadata']['name']} to namespace {namespace}: {job['spec']['parallelism']} pod(s), "
          f"checkpoints to {submission.checkpoint_path}")
    queue = (job["metadata"].get("labels") or {}).get(QUEUE_LABEL)
    if queue:
        print(f"  queued in Kueue LocalQueue {queue}: the pods start once it is admitted")
    print(f"  biggraph status {name} -n {namespace}    biggraph logs {name} -n {namespace} --follow")


def _status(args: argparse.Namespace) -> int:
    report = job_status(args.job, _access(args))
    if args.json:
        print(json.dumps(report))
        return 0
    queue = report.get("queue")
    stage = f" stage {report['stage']} (job {report['job']})" if "stage" in report else ""
    print(f"job {args.job}{stage} ({report['namespace']}): {report['state']}; {report['replicas']} replica(s): "
          f"{report['active']} active, {report['succeeded']} succeeded, {report['failed']} failed"
          + (f"; Kueue LocalQueue {queue}" if queue else ""))
    for pod in report["pods"]:
        extra = f", {pod['detail']}" if pod["detail"] else ""
        print(f"  [{pod['index']}] {pod['name']}: {pod['phase']}{extra}, restarts {pod['restarts']}"
              + (f", node {pod['node']}" if pod["node"] else ""))
    _print_progress(report["progress"])
    return 0


def _print_progress(progress: dict[str, Any]) -> None:
    if not progress.get("available"):
        print(f"progress: unavailable ({progress.get('reason')})")
        return
    line = f"progress: checkpoint version {progress['version']} in {progress['checkpoint_path']}"
    if "last_pass" in progress:
        loss = progress["last_pass"]["loss"]
        line += f"; last pass: epoch {progress['last_pass']['epoch']}/{progress['num_epochs']}"
        line += f", loss {loss:.4f}" if isinstance(loss, (int, float)) else ""
    print(line)
    for worker, where in sorted(progress["workers"].items()):
        print(f"  worker {worker}: epoch {where['epoch']}/{progress['num_epochs']}, bucket ({where['bucket'][0]}, "
              f"{where['bucket'][1]}), {where['edges_per_sec']:.0f} edges/s")


def _logs(args: argparse.Namespace) -> int:
    if args.follow:
        index = 0 if args.index is None else args.index
        for chunk in follow_log(args.job, _access(args), index=index, tail=args.tail):
            sys.stdout.write(chunk)
            sys.stdout.flush()
        return 0
    logs = read_logs(args.job, _access(args), index=args.index, tail=args.tail)
    for log in logs:
        prefix = f"[{log.index}] " if len(logs) > 1 else ""
        for line in log.text.splitlines():
            print(f"{prefix}{line}")
    return 0


def _cancel(args: argparse.Namespace) -> int:
    namespace, removed = cancel_job(args.job, _access(args))
    print(f"cancelled: deleted {', '.join(removed)} in namespace {namespace} (pods are deleted in the background; "
          "checkpoints are kept)")
    return 0


def _preflight(args: argparse.Namespace) -> int:
    config = load_config(args.config, [])
    print(f"preflight: {args.config}: config ok ({len(config.entities)} entity type(s), {len(config.relations)} "
          f"relation type(s), checkpoint_path {config.checkpoint_path})")
    sizes = pod_sizes_from_env()
    if sizes != type(sizes)():  # in a pod of the chart: its memory limit, /dev/shm and /tmp hold what training uses
        needs = check_config_fits(config, sizes, "preflight")
        print("preflight: pod sizes ok: " + ", ".join(
            f"{what} {quantity(need)} of {quantity(have)}" for what, need, have in (
                ("memory_budget", needs.memory_budget, sizes.memory_limit), ("/dev/shm", needs.shm, sizes.shm),
                ("/tmp", needs.tmp, sizes.tmp)) if need is not None and have is not None) or "nothing to check")
    if args.check_storage or args.check_write:
        check_storage(config, write=args.check_write, report=print)
    return 0
