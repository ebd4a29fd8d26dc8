"""Chaos on the cluster in a box: an out-of-core P=16 graph with its data and checkpoint on S3 (moto), trained by the
chart's Indexed Job (tests/cluster_box.py) at 4-8 pods while seeded random events hit it, and what they cost.

The graph is generated (``--entities`` in communities of 20, ten relations each mapping a community to another
one, so that embeddings can learn something and a filtered MRR means something; plus one relation without edges
that counts shared updates, bench/chaos_hooks/sitecustomize.py), split into train and test TSV files and imported by
``biggraph import`` straight onto a moto S3 server. The chart is rendered by ``helm template`` with the checkpoint on
S3 (``s3.endpointUrl`` = the box's host address, ``s3.existingSecret`` for the credentials), ``replicas`` =
``--pods-max`` (torchrun's ``--nnodes=2:max``), started at ``--pods-min`` pods. Each pod keeps at most
``partition_buffer`` = 3 of the 16 partitions: every bucket switch swaps partitions through S3.

Once the group trains, ``--events`` events follow, each after a seeded random gap (``--gap``): kill-and-replace of
any running index (index 0 hosts the rendezvous: every pod goes), a scale to another size within
``--pods-min..--pods-max``, a freeze (SIGSTOP of every process of a pod) of a random length on both sides of the
6 s dead-peer timeout, then a thaw, or a freeze of rank 0's trainer alone (``rank0``: its pod and agent live on; held
until a group formed without it, then thawed). ``--no-events``: the same run without events (the MRR baseline).
A kill is a lost node's: the pod carries DisruptionTarget, which the chart's podFailurePolicy ignores.

The Job runs with the chart's shipped failure budget (issue 44): ``torchrun.maxRestarts`` 3 and
``backoffLimitPerIndex`` 3 as rendered for Kubernetes 1.35, the podFailurePolicy's Ignore rules applied by the box.

Measured:
- committed versions that fail to load or verify: every version is read as soon as the marker names it (every
  partition and the model, each file against the version's checksums) and once more at the end;
- buckets trained other than once per epoch in the committed stats (missing, repeated or stray records);
- shared updates lost: the counter relation's vector in each committed version against the buckets it commits;
- time from each kill to training again: from the pods' logs, read as they grow, until a trainer of a group formed
  after the kill finishes its first bucket (median, worst; also for scale changes, freezes and rank-0 freezes:
  ``rank0_freeze_to_training``);
- buckets redone (the committed pass summaries' ``buckets_redone``) per lost pod;
- the final filtered MRR (``biggraph eval --candidates all``, train and test filtered).

    sudo .venv/bin/python bench/chaos_bench.py --events 10 --epochs 3 --json bench/out/chaos-debug.json
    sudo .venv/bin/python bench/chaos_bench.py --events 100 --epochs 12 --seed 1 --json bench/out/chaos.json
    sudo .venv/bin/python bench/chaos_bench.py --no-events --epochs 12 --seed 1 --json bench/out/chaos-base.json
    sudo .venv/bin/python bench/chaos_bench.py --events 100 --epochs 12 --seed 1 --config partition_handoff=true

Needs root and iproute2 (the box), helm (tests/test_chart.py finds it) and moto_server in the venv.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT / "tests"))

from chaos_checks import (  # noqa: E402
    Expected,
    LogTail,
    VersionWatcher,
    copy_for_eval,
    eval_command,
    filtered_mrr,
    stats_buckets,
    summarize_seconds,
    verify_version,
)
from chaos_events import WEIGHTS, Chaos, ChaosPlan  # noqa: E402
from cluster_box import ClusterBox, RenderedJob, available, free_subnet  # noqa: E402
from machine import matmul_rate  # noqa: E402
from storage_bench import start_fake_s3  # noqa: E402
from test_chart import render  # noqa: E402

import storage_adapters as storage  # noqa: E402
from job.formats.entities import read_dynamic_rel_names, read_entity_counts  # noqa: E402

PARTITIONS = 16
RELATIONS = 10
COUNTER = "chaos_counter"
DYNAMIC_VARIANTS = 400  # --dynamic-relations: 4,000 relation names, ~940 edges a bucket touch ~840 of their rows
BUCKET = "chaos"
SECRET = "chaos-s3"
CREDENTIAL = "bench"  # moto takes any


@dataclass(frozen=True)
class GraphShape:
    entities: int
    edges: int
    test_fraction: float
    seed: int
    counter_in_test: bool = False  # --dynamic-relations: 4,000 relation names, the counter named by one test edge


def write_graph(work: Path, shape: GraphShape) -> tuple[Path, Path]:
    """Train and test TSV files (lhs, relation, rhs names). Entity e is in community e % C (communities of 20);
    relation r sends a community to its image under a fixed random permutation, so an rhs is one of 20."""
    rng = np.random.default_rng(shape.seed)
    communities = max(1, shape.entities // 20)
    perms = np.stack([rng.permutation(communities) for _ in range(RELATIONS)])
    lhs = rng.integers(0, shape.entities, shape.edges)
    rel = rng.integers(0, RELATIONS, shape.edges)
    rhs = perms[rel, lhs % communities] + communities * rng.integers(0, shape.entities // communities, shape.edges)
    names = [f"r{r}" for r in rel.tolist()]
    if shape.counter_in_test:  # many relation names (each a variant of one of the ten), so a bucket touches few rows
        names = [f"{n}_{v}" for n, v in zip(names, rng.integers(0, DYNAMIC_VARIANTS, shape.edges).tolist())]
    rows = [f"e{a}\t{n}\te{b}" for a, n, b in zip(lhs.tolist(), names, rhs.tolist())]
    test = int(len(rows) * shape.test_fraction)
    train_file, test_file = work / "train.tsv", work / "test.tsv"
    if shape.counter_in_test:  # the counter's name for the dynamic relations' dictionary, no training edge
        rows.insert(0, f"e0\t{COUNTER}\te1")
        test += 1
    train_file.write_text("\n".join(rows[test:]) + "\n")
    test_file.write_text("\n".join(rows[:test]) + "\n")
    return train_file, test_file


def training_config(args: argparse.Namespace, data: str, checkpoint: str) -> dict[str, Any]:
    """The training config: P=16, a partition buffer of 3 per pod (out of core), one Hogwild worker per pod (2 vCPUs
    under 4-8 pods), the counter relation last."""
    relations = [{"name": f"r{i}", "lhs": "node", "rhs": "node", "operator": "complex_diagonal"}
                 for i in range(RELATIONS)]
    relations.append({"name": COUNTER, "lhs": "node", "rhs": "node", "operator": "translation"})
    dynamic = {}
    if args.dynamic_relations:  # one operator for every relation, a row each: the sparse shared exchange's case
        relations = [{"name": "all", "lhs": "node", "rhs": "node", "operator": "translation"}]
        dynamic = {"dynamic_relations": True, "global_emb": False}
    return {
        "entity_path": f"{data}/entities", "edge_paths": [f"{data}/train"], "checkpoint_path": checkpoint,
        "entities": {"node": {"num_partitions": PARTITIONS}}, "relations": relations,
        "dimension": args.dimension, "comparator": "dot", "loss_fn": "softmax", "num_epochs": args.epochs,
        "num_batch_negs": 50, "num_uniform_negs": 50, "batch_size": 500, "lr": 0.1, "eval_fraction": 0.0,
        "workers": 1, "partition_buffer": 3, "seed": args.seed,
        "num_edge_chunks": 1,  # said, not found out: counting would ask S3 for the size of 256 files per restart
        **dynamic, **dict(parse_setting(item) for item in args.config),
    }


def parse_setting(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of ``--config``: the value read as JSON (``true``, ``3``, ``"x"``), else as a plain string."""
    key, _, text = item.partition("=")
    try:
        return key, json.loads(text)
    except json.JSONDecodeError:
        return key, text


def import_graph(work: Path, config: dict[str, Any], files: tuple[Path, Path], data: str) -> None:
    """``biggraph import`` of both splits onto S3 (the train split's directory is the config's edge path)."""
    import_config = dict(config, edge_paths=[f"{data}/train", f"{data}/test"])
    path = work / "import-config.json"
    path.write_text(json.dumps(import_config))
    done = subprocess.run([sys.executable, "-m", "job", "import", str(path), *map(str, files), "-l", "0", "-r", "2",
                           "--rel-col", "1"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"biggraph import exited {done.returncode}: {done.stderr[-2000:]}")


def build_box(args: argparse.Namespace, work: Path, config: dict[str, Any], port: int,
              expected: Expected) -> ClusterBox:
    """The chart rendered for the run, and its box (not started)."""
    subnet = free_subnet()
    endpoint = f"http://{subnet}.1:{port}"  # the box's host address (ClusterBox.host_address)
    # the chart's shipped failure budget (torchrun.maxRestarts, backoffLimitPerIndex, the podFailurePolicy), rendered
    # for a cluster that has per-index retries (Kubernetes >= 1.33)
    docs = render(work, release="chaos", kube="1.35", extra={
        "replicas": args.pods_max, "elastic": {"minReplicas": 2}, "config": config,
        "s3": {"existingSecret": SECRET, "endpointUrl": endpoint, "region": "us-east-1"},
        "env": [{"name": "AWS_EC2_METADATA_DISABLED", "value": "true"},
                *({"name": name, "value": value} for name, value in (item.split("=", 1) for item in args.env))],
    })
    hooks = BENCH / "chaos_hooks"
    [job] = [d for d in docs if d["kind"] == "Job"]
    box = ClusterBox(RenderedJob.from_docs(docs), work / "box", max_replicas=args.pods_max, initial=args.pods_min,
                     subnet=subnet, backoff_limit_per_index=int(job["spec"]["backoffLimitPerIndex"]),
                     secrets={SECRET: {"AWS_ACCESS_KEY_ID": CREDENTIAL, "AWS_SECRET_ACCESS_KEY": CREDENTIAL}},
                     extra_env={"BIGGRAPH_NATIVE_CACHE": str(work / "native"), "PYTHONPATH": f"{hooks}:{ROOT}",
                                "BIGGRAPH_CHAOS_COUNTER": str(expected.counter_relation),
                                "BIGGRAPH_CHAOS_COUNTER_DYNAMIC": "1" if expected.dynamic else "0"})
    assert box.host_address == f"{subnet}.1"
    return box


def wait_training(box: ClusterBox, tail: LogTail, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not tail.trains:
        if box.failed_reason is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the group never trained: {box.failed_reason}\n{box.tail()}")
        time.sleep(0.2)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    machine = {"load_at_start": os.getloadavg(), "matmul_gflops_at_start": round(matmul_rate(), 1)}
    moto, endpoint = start_fake_s3([str(Path(sys.executable).parent / "moto_server"), "-H", "0.0.0.0", "-p"],
                                   CREDENTIAL)
    os.environ["AWS_ENDPOINT_URL"] = endpoint  # this process's reads and the import; the pods get the box's address
    box: Optional[ClusterBox] = None
    try:
        import s3fs

        s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True).mkdir(BUCKET)
        data = f"s3://{BUCKET}/data"
        checkpoint = f"s3://{BUCKET}/{'baseline' if args.no_events else 'chaos'}/checkpoints"
        config = training_config(args, data, checkpoint)
        started = time.monotonic()
        files = write_graph(work, GraphShape(args.entities, args.edges, 0.01, args.seed,
                                             counter_in_test=args.dynamic_relations))
        import_graph(work, config, files, data)
        print(f"chaos: graph generated and imported onto S3 in {time.monotonic() - started:.0f} s", flush=True)
        counts = read_entity_counts(config["entity_path"], "node", PARTITIONS)
        if args.dynamic_relations:  # the counter is a row of the one operator's table
            expected = Expected(config, counts, read_dynamic_rel_names(config["entity_path"]).index(COUNTER),
                                dynamic=True)
        else:
            expected = Expected(config, counts, RELATIONS)
        box = build_box(args, work, config, int(endpoint.rsplit(":", 1)[1]), expected)
        tail = LogTail(box.root / "logs")
        watcher = VersionWatcher(checkpoint, expected)
        box.start()
        tail.start()
        watcher.start()
        t0 = time.monotonic()
        wait_training(box, tail, 900)
        print(f"chaos: training after {time.monotonic() - t0:.0f} s", flush=True)
        chaos = Chaos(box, ChaosPlan(args.events, args.pods_min, args.pods_max, tuple(args.gap), args.seed,
                                       minutes=args.minutes, kinds=tuple(args.kinds)), tail=tail)
        if not args.no_events:
            chaos.run()
        incomplete = None
        try:
            box.wait(args.timeout_min * 60)
        except AssertionError as err:  # the figures so far are still reported (stats of the passes committed)
            incomplete = str(err).splitlines()[0]
            print(f"chaos: {incomplete}", flush=True)
        seconds = time.monotonic() - t0
        watcher.stop()
        tail.stop()
        final = watcher.marker()
        final_problem = None
        try:
            values = verify_version(checkpoint, final, expected)
        except Exception as err:  # noqa: BLE001 - counted
            final_problem, values = f"v{final}: {type(err).__name__}: {err}", [float("nan")]
        stats = stats_buckets(checkpoint, args.epochs, PARTITIONS)
        machine.update(load_at_end=os.getloadavg(), matmul_gflops_at_end=round(matmul_rate(), 1))
        result = {**report(args, chaos, tail, watcher, stats, {}, final, values, final_problem, seconds),
                  "machine": machine, "job_incomplete": incomplete}
        if args.json:  # what the events cost is kept even if the evaluation fails
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        if args.copy_for_eval:
            copy_for_eval(config, data, work)
            print(f"chaos: the committed result is in {work}/eval-copy; score it from {work} with "
                  f"{' '.join(eval_command('python3'))}", flush=True)
        elif not args.no_eval:
            result["mrr"] = filtered_mrr(config, data, work)
        return result
    finally:
        if box is not None:
            box.close()
        moto.terminate()
        moto.wait(timeout=30)


def report(args: argparse.Namespace, chaos: Chaos, tail: LogTail, watcher: VersionWatcher, stats: dict[str, Any],
           mrr: dict[str, Any], final: int, values: list[float], final_problem: Optional[str],
           seconds: float) -> dict[str, Any]:
    from chaos_checks import counter_shortfall

    lost, doubled = (counter_shortfall(values, final, PARTITIONS) if final_problem is None else (None, None))
    recoveries = chaos.recoveries(tail)
    pods_lost = sum(e["pods_lost"] for e in chaos.log)
    failures = list(watcher.failures) + ([final_problem] if final_problem else [])
    return {
        "command": " ".join(sys.argv), "args": vars(args), "seconds": round(seconds, 1), "load_avg": os.getloadavg(),
        "final_version": final, "events": len(chaos.log), "events_by_kind": chaos.kinds(),
        "versions_verified": sorted(watcher.verified), "versions_superseded_before_read": watcher.superseded,
        "versions_failing": failures, "marker_went_back": watcher.marker_went_back,
        "buckets": stats, "shared_updates_lost": lost, "shared_updates_doubled": doubled,
        "counter_per_version": {v: r["counter"] for v, r in sorted(watcher.verified.items())},
        "lost_per_version": {v: r["lost"] for v, r in sorted(watcher.verified.items()) if r["lost"] or r["doubled"]},
        "kill_to_training": summarize_seconds([r["seconds"] for r in recoveries if r["kind"] == "kill"
                                               and r["seconds"] is not None]),
        "kill_to_training_clean": summarize_seconds([r["seconds"] for r in recoveries if r["kind"] == "kill"
                                                     and r["seconds"] is not None and not r["overlapped"]]),
        "scale_to_training": summarize_seconds([r["seconds"] for r in recoveries if r["kind"] == "scale"
                                                and r["seconds"] is not None]),
        "kill_to_new_group": summarize_seconds([r["to_new_group"] for r in recoveries if r["kind"] == "kill"
                                                and r["to_new_group"] is not None]),
        "freeze_to_training": summarize_seconds([r["seconds"] for r in recoveries if r["kind"] == "freeze"
                                                 and r["seconds"] is not None]),
        "rank0_freeze_to_training": summarize_seconds([r["seconds"] for r in recoveries if r["kind"] == "rank0"
                                                       and r["seconds"] is not None]),
        "rank0_freeze_to_training_clean": summarize_seconds([r["seconds"] for r in recoveries if r["kind"] == "rank0"
                                                             and r["seconds"] is not None and not r["overlapped"]]),
        "rank0_freezes_not_recovered": sum(1 for r in recoveries if r["kind"] == "rank0" and r["seconds"] is None),
        "pods_lost": pods_lost, "rounds": len(tail.rounds()),
        "buckets_redone_per_lost_pod": round(stats["buckets_redone"] / pods_lost, 2) if pods_lost else None,
        "buckets_redone_per_round": round(stats["buckets_redone"] / max(1, len(tail.rounds()) - 1), 2),
        "mrr": mrr, "tracebacks_in_logs": sum(tail.tracebacks.values()), "event_log": chaos.log,
        "recoveries": recoveries,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=100, help="random events to inject (default 100)")
    parser.add_argument("--no-events", action="store_true", help="the same run without events (the MRR baseline)")
    parser.add_argument("--pods-min", type=int, default=4, help="fewest pods (start and scale floor; default 4)")
    parser.add_argument("--pods-max", type=int, default=8, help="most pods (the rendered replicas; default 8)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1, help="the graph's, the training's and the events' seed")
    parser.add_argument("--entities", type=int, default=20_000)
    parser.add_argument("--edges", type=int, default=240_000)
    parser.add_argument("--dimension", type=int, default=32)
    parser.add_argument("--gap", type=float, nargs=2, default=(5.0, 45.0), metavar=("MIN", "MAX"),
                        help="seconds between events, uniform (default 5 45)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="no new event after this many minutes from the first gap (default: no bound)")
    parser.add_argument("--kinds", nargs="+", choices=sorted(WEIGHTS), default=sorted(WEIGHTS),
                        help="the kinds of event drawn (default: all; e.g. `--kinds kill` to time recoveries)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for every pod, through the chart's `env` (repeatable; e.g. "
                             "BIGGRAPH_WARM_SPARES=0)")
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                        help="a training config key over the bench's own, the value as JSON (repeatable; e.g. "
                             "partition_handoff=true)")
    parser.add_argument("--dynamic-relations", action="store_true",
                        help="one translation operator for every relation, a row each (dynamic_relations), so that "
                             "buckets exchange only the shared rows they touch (the sparse exchange); the counter is "
                             "its own row, named by one test edge and by no training edge")
    parser.add_argument("--no-eval", action="store_true",
                        help="skip the final filtered MRR (all candidates: ~17 min on 2 vCPUs after a 30-pass run)")
    parser.add_argument("--copy-for-eval", action="store_true",
                        help="instead of the MRR, copy the data and the committed checkpoint to WORK/eval-copy with "
                             "WORK/eval-config.json, to score later or on a faster machine (needs --work)")
    parser.add_argument("--timeout-min", type=float, default=150.0, help="give up on the Job after this (default 150)")
    parser.add_argument("--work", default=None, help="scratch directory (default: a new temporary one, removed)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    reason = available()
    if reason is not None:
        parser.error(f"the cluster box cannot run here: {reason}")
    if args.copy_for_eval and not args.work:
        parser.error("--copy-for-eval needs --work (the copy stays there)")
    if any("=" not in item for item in args.env + args.config):
        parser.error("--env and --config take NAME=VALUE")
    if not 2 <= args.pods_min <= args.pods_max:
        parser.error("--pods-min must be at least 2 and at most --pods-max")
    if args.edges < 10 * PARTITIONS * PARTITIONS or args.entities < 20 * PARTITIONS:
        parser.error("--edges and --entities are too small for 16 partitions")
    # a SIGTERM (a session's end, a timeout) still tears the box down: the pods live in namespaces of their own
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    work = Path(args.work or tempfile.mkdtemp(prefix="biggraph-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    with storage.using(storage.StorageSettings()):
        result = run(args, work)
    text = json.dumps(result, indent=1, default=str)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
    print_summary(result)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    bad = len(result["versions_failing"]) + result["buckets"]["buckets_not_once"] + (result["shared_updates_lost"] or 0)
    return 1 if bad else 0


def print_summary(r: dict[str, Any]) -> None:
    print(f"\nchaos: {r['events']} events {r['events_by_kind']} in {r['seconds']:.0f} s; machine {r['machine']}")
    superseded = len(r["versions_superseded_before_read"])
    print(f"  versions verified {len(r['versions_verified'])} (superseded before read {superseded}), "
          f"failing {len(r['versions_failing'])}: {r['versions_failing'][:5]}")
    print(f"  buckets not once per epoch {r['buckets']['buckets_not_once']} ({r['buckets']['missing']} missing, "
          f"{r['buckets']['repeated']} repeated, {r['buckets']['stray']} stray)")
    print(f"  shared updates lost {r['shared_updates_lost']}, doubled {r['shared_updates_doubled']}")
    print(f"  kill -> training: {r['kill_to_training']} (no other event in between: {r['kill_to_training_clean']})")
    print(f"  kill -> new group: {r['kill_to_new_group']}")
    print(f"  scale -> training: {r['scale_to_training']}; freeze -> training: {r['freeze_to_training']}")
    print(f"  rank-0 freeze -> training: {r['rank0_freeze_to_training']} (no other event in between: "
          f"{r['rank0_freeze_to_training_clean']}; not recovered: {r['rank0_freezes_not_recovered']})")
    print(f"  buckets redone {r['buckets']['buckets_redone']}, pods lost {r['pods_lost']} "
          f"({r['buckets_redone_per_lost_pod']} per lost pod), rounds {r['rounds']} "
          f"({r['buckets_redone_per_round']} per re-formation)")
    print(f"  filtered MRR {r['mrr'].get('mrr', r['mrr'])}; tracebacks in the pods' logs {r['tracebacks_in_logs']}")


if __name__ == "__main__":
    sys.exit(main())
