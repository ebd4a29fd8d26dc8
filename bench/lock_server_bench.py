"""What the lock server costs per bucket at 8, 32 and 128 pods (issue #30), measured on its real parts.

A real ``LockServer`` with its real ``ProgressLog`` (fsynced files under ``--work``) on a real TCPStore, and N
simulated trainers issuing the request sequence of a pass as ``LockServerScheduler`` does: ``next`` carrying the
finished bucket's shared-parameter change (and taking the sum), ``reserve`` (``prefetch_partitions``), and
``release`` of the partitions the new bucket does not use (on the writer's channel). The shared vector has
Freebase86m's relation parameters by default: 14,824 relations x 200 floats (ComplEx, d=100), 11.9 MB, carried
over real gloo transports (``TensorTransport.over_store``, one rank per trainer).

Trainers are processes, not threads of one interpreter: rank 0's trainer runs in the server's process (as in a
pod), the others in child processes of up to ``--per-process`` trainer threads each, so the server's thread
shares its GIL only with its own helpers and rank 0's trainer (as in a real pod), not with N clients. Trainers do
no training by default (``--train-ms 0``): requests back to back, the server saturated, so that its time per
request and its throughput show. gloo connects every pair at the start, as in a pod group (its lazy mode,
``TORCH_GLOO_LAZY_INIT``, failed point-to-point sends with "Connect timeout" in torch 2.13).

Phases: ``state`` (``LockState`` alone: its scheduling logic's cost, which grows with P), ``progress``
(``ProgressLog.append`` per record, with and without the vector), ``transfer`` (one trainer's ``sync`` round trip
with the vector and without), then one scale run per ``--trainers`` figure. Prints JSON lines;
bench/RESULTS.md has the figures and the paper model built on them.

    .venv/bin/python bench/lock_server_bench.py --trainers 8,32,128 --work /tmp/lsb
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from closed_queue import Sampler, closed_queue, server_threads_cpu  # noqa: E402
from next_breakdown import breakdown  # noqa: E402
from torch.distributed import PrefixStore, TCPStore  # noqa: E402

from job.checkpoint.group_progress import ProgressLog  # noqa: E402
from job.train.distributed.lock_client import LockClient  # noqa: E402
from job.train.distributed.lock_server import LockServer  # noqa: E402
from job.train.distributed.lock_state import LockState  # noqa: E402
from job.train.distributed.shared_rows import RowLayout  # noqa: E402
from job.train.distributed.transport import TensorTransport  # noqa: E402
from job.types import Bucket  # noqa: E402

FREEBASE_RELATION_VALUES = 14_824 * 200  # ComplEx d=100: a real and an imaginary diagonal per relation
ROW = 200  # values of one relation's row
TIMEOUT_S = 600.0
PREFIX = "bench/lock"


def bucket_keys(nparts: int) -> dict[Bucket, frozenset]:
    return {Bucket(a, b): frozenset({("node", a), ("node", b)}) for a in range(nparts) for b in range(nparts)}


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values) * 1e3
    return {"n": len(values), "p50_ms": float(np.percentile(a, 50)), "p90_ms": float(np.percentile(a, 90)),
            "p99_ms": float(np.percentile(a, 99)), "max_ms": float(a.max()), "mean_ms": float(a.mean())}


# a trainer: the request sequence of LockServerScheduler, timed ----------------------------------------------------


def layout_of(values: int) -> RowLayout:
    """Freebase86m's rows as the model flattens them: each relation's ``ROW // 2`` parameters in one segment, their
    Adagrad sums in another (``shared_state``)."""
    rows = values // ROW
    return RowLayout.of(values, rows, [(0, ROW // 2), (rows * ROW // 2, ROW // 2)])


def bucket_rows(rng: np.random.Generator, weights: Optional[np.ndarray], edges: int, touched: int,
                rows: int) -> np.ndarray:
    """The relation rows a bucket uses, ascending: those of ``edges`` edges drawn from ``weights`` (a skewed
    distribution over the relations), or ``touched`` rows drawn uniformly."""
    if weights is not None:
        return np.unique(rng.choice(rows, size=edges, p=weights))
    return np.sort(rng.choice(rows, size=min(touched, rows), replace=False))


def run_trainer(store: Any, rank: int, transport: TensorTransport, values: int, nparts: int, buckets: int,
                train_s: float, touched: int, out: dict[str, Any], sparse: bool = False, edges: int = 0,
                zipf: float = 1.5, *, spread: bool = False, world: int = 1) -> None:
    """Train at least ``buckets`` buckets as ``LockServerScheduler`` asks for them (no training: ``train_s`` of
    sleep), each finished with a change of its rows (``bucket_rows``) that the sum then replaces. A trainer that has
    trained its ``buckets`` goes on until all ``world`` trainers have (the store's ``bench/finished`` count): a real
    trainer asks until its pass ends, and one that stopped alone would keep its last bucket in flight, its
    partitions' locks and its reservation, which no request of the protocol hands back while the round stands, so
    the others would starve (``--buckets`` above 3 stalled at 16 trainers / P=32: the leavers held every
    partition). ``sparse``: the change
    carries only those rows and the next bucket's rows are pulled (job/train/distributed/shared_rows.py);
    ``edges`` > 0: a bucket's rows are those of ``edges`` edges whose relations follow a Zipf law of ``zipf``;
    ``spread``: each think drawn uniformly from 0.5-1.5 x ``train_s``, and the first request after a uniform
    0-``train_s`` (pods whose buckets take different times, not all asking in the same instant every ``train_s``)."""
    keys = bucket_keys(nparts)
    client = LockClient(store, rank, timeout_s=TIMEOUT_S, prefix=PREFIX, transport=transport)
    writer = LockClient(store, rank, timeout_s=TIMEOUT_S, channel="/writer", prefix=PREFIX)
    buffer = torch.zeros(values)
    rng = np.random.default_rng(rank)
    layout = layout_of(values)
    weights = None
    if edges > 0:
        weights = 1.0 / np.arange(1, layout.rows + 1) ** zipf
        weights /= weights.sum()
    latency: dict[str, list[float]] = {"next": [], "reserve": [], "release": [], "pull": [], "next_and_pull": [],
                                       "next_first": [], "next_later": []}
    traced: list[list[Any]] = []  # per next: [rank, seq, asked, answered, first] (next_breakdown.py)
    moved: list[int] = []  # shared-parameter bytes of each bucket granted: its pull, then its change (and sum)
    complete: list[int] = []  # ... of the buckets whose change has left
    used: list[int] = []  # relation rows per bucket
    current: Optional[Bucket] = None
    held: set = set()
    rows = bucket_rows(rng, weights, edges, touched, layout.rows)
    trained = waits = 0
    counted = False  # whether this trainer's ``buckets`` are counted in ``bench/finished``
    # every trainer set up (its store connections, its rows) before any asks: a trainer's start-up is not in another's
    # round trip (the first `next`s still come all at once, as a group's start: ``next_first``)
    store.add("bench/ready", 1)
    store.wait(["bench/steady"])
    # the closed queue's terms (bench/RESULTS.md, "The `next` round trip under load"): when this trainer was in the
    # system, and its own CPU (this thread's; the gloo sends run on it)
    began, cpu_began = time.monotonic(), time.thread_time()
    thought = 0.0
    if spread and train_s:
        thought += rng.uniform(0.0, train_s)
        time.sleep(thought)
    while True:
        if trained >= buckets:  # its share trained: on only while another has not trained its own
            if not counted:
                store.add("bench/finished", 1)
                counted = True
            if int(store.add("bench/finished", 0)) >= world:
                break
        sent = rows if current is not None else None
        if sparse and sent is not None:
            change: Optional[torch.Tensor] = torch.full((layout.count(sent.size),), 1e-6)
        elif sent is not None:
            buffer.zero_()
            for offset, width in layout.segments:
                buffer[offset:offset + layout.rows * width].view(layout.rows, width)[torch.from_numpy(sent)] = 1e-6
            change = buffer
        else:
            change = None
        started, asked = time.perf_counter(), time.monotonic()
        kind, bucket, _, _ = client.finish_and_next(held, current, None, change,
                                                    rows=sent.tolist() if sparse and sent is not None else None)
        latency["next"].append(time.perf_counter() - started)
        traced.append([rank, client.seq, asked, time.monotonic(), len(latency["next"]) == 1])
        # the first: every trainer asks at the same moment (the start's burst); the later ones: the steady state
        latency["next_first" if len(latency["next"]) == 1 else "next_later"].append(latency["next"][-1])
        if change is not None and moved:  # the finished bucket's change (and a dense one's sum back)
            moved[-1] += change.numel() * 4 * (1 if sparse else 2)
            complete.append(moved[-1])
        current = bucket
        if kind == "done":  # the whole pass trained: every other trainer hears the same
            break
        if bucket is None:  # nothing open now: give everything back and ask again, as the scheduler does
            waits += 1
            if held:
                started = time.perf_counter()
                writer.release(sorted(held))
                latency["release"].append(time.perf_counter() - started)
                held = set()
            time.sleep(0.02)
            continue
        rows = bucket_rows(rng, weights, edges, touched, layout.rows)  # the edges of the bucket granted, read
        used.append(int(rows.size))
        if sparse:  # its rows' values, before it trains
            into = torch.empty(layout.count(rows.size))
            pulled = time.perf_counter()
            client.pull(rows.tolist(), into)
            latency["pull"].append(time.perf_counter() - pulled)
            moved.append(into.numel() * 4)
        else:
            moved.append(0)
        latency["next_and_pull"].append(time.perf_counter() - started)
        leaving = held - keys[bucket]
        started = time.perf_counter()
        client.reserve(sorted(leaving))
        latency["reserve"].append(time.perf_counter() - started)
        if leaving:
            started = time.perf_counter()
            writer.release(sorted(leaving))
            latency["release"].append(time.perf_counter() - started)
        held = set(keys[bucket])
        trained += 1
        if train_s:
            think = train_s * (rng.uniform(0.5, 1.5) if spread else 1.0)
            thought += think
            time.sleep(think)
    out[str(rank)] = {"latency": latency, "trained": trained, "waits": waits, "moved": complete, "rows": used,
                      "traced": traced, "began": began, "ended": time.monotonic(),
                      "thought_s": thought, "cpu_s": time.thread_time() - cpu_began}


def join_transport(store: Any, rank: int, world: int, made: dict[int, TensorTransport]) -> None:
    made[rank] = TensorTransport.over_store(PrefixStore("bench/transport", store.clone()), rank, world, TIMEOUT_S)


def child_main(args: argparse.Namespace) -> None:
    """One child process: trainer threads for ranks ``--ranks`` (first,last), results as one JSON line."""
    store = TCPStore("127.0.0.1", args.port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    first, last = (int(x) for x in args.ranks.split(","))
    ranks = list(range(first, last + 1))
    made: dict[int, TensorTransport] = {}
    joins = [threading.Thread(target=join_transport, args=(store, r, args.world, made)) for r in ranks]
    for t in joins:
        t.start()
    for t in joins:
        t.join()
    store.add("bench/joined", len(ranks))
    store.wait(["bench/go"])
    out: dict[str, Any] = {}
    threads = [threading.Thread(target=run_trainer, args=(store.clone(), r, made[r], args.values, args.partitions,
                                                          args.buckets, float(args.train_ms) / 1e3, args.touched_rows, out,
                                                          args.shared == "sparse", args.bucket_edges, args.zipf),
                                kwargs={"spread": args.think == "spread", "world": args.world})
               for r in ranks]
    for t in threads:
        t.start()
    store.wait(["bench/steady"])  # every trainer set up: the CPU from here is the steady state's
    cpu_began = time.process_time()
    for t in threads:
        t.join()
    out["process"] = {"cpu_s": time.process_time() - cpu_began}  # the trainers' and their gloo threads' CPU
    print(json.dumps(out), flush=True)


# the scale run: server + rank 0's trainer here, the other trainers in child processes ------------------------------


def scale_run(args: argparse.Namespace, trainers: int, nparts: int, work: Path, train_ms: float) -> dict[str, Any]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S))
    port = store.port
    children = []
    for first in range(1, trainers, args.per_process):
        last = min(first + args.per_process - 1, trainers - 1)
        children.append(subprocess.Popen(
            [sys.executable, __file__, "--child", "--port", str(port), "--ranks", f"{first},{last}", "--world",
             str(trainers), "--values", str(args.values), "--partitions", str(nparts), "--buckets",
             str(args.buckets), "--train-ms", str(train_ms), "--touched-rows", str(args.touched_rows),
             "--shared", args.shared, "--bucket-edges", str(args.bucket_edges), "--zipf", str(args.zipf),
             "--think", args.think],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))))
    made: dict[int, TensorTransport] = {}
    join_transport(store, 0, trainers, made)
    while int(store.add("bench/joined", 0)) < trainers - 1:
        time.sleep(0.05)
    state = LockState(nparts, nparts, bucket_keys(nparts), world_size=trainers, version=1)
    log_dir = work / f"progress-{trainers}"
    log = ProgressLog(str(log_dir), "bench", 1)
    shared = np.zeros(args.values, np.float32)
    log.start(state.to_json(), shared)
    server = LockServer(store, state, log, shared, 0, made[0], prefix=PREFIX, layout=layout_of(args.values),
                        **({"trace": True} if args.breakdown else {}))
    out: dict[str, Any] = {}
    started = time.perf_counter()
    store.set("bench/go", "1")
    own = threading.Thread(target=run_trainer, args=(store.clone(), 0, made[0], args.values, nparts, args.buckets,
                                                     train_ms / 1e3, args.touched_rows, out,
                                                     args.shared == "sparse", args.bucket_edges, args.zipf),
                           kwargs={"spread": args.think == "spread", "world": trainers})
    own.start()
    while int(store.add("bench/ready", 0)) < trainers:
        time.sleep(0.01)
    sampler = Sampler()
    store.set("bench/steady", "1")
    steady = time.perf_counter()
    trainers_cpu = 0.0
    for child in children:
        stdout, stderr = child.communicate(timeout=3600)
        if child.returncode != 0:
            raise RuntimeError(f"a trainer process failed: {stderr[-3000:]}")
        got = json.loads(stdout.strip().splitlines()[-1])
        trainers_cpu += got.pop("process")["cpu_s"]
        out.update(got)
    own.join()
    ended = time.perf_counter()
    sampler.stop()
    wall = ended - started
    stats = server.stats()
    threads_cpu = server_threads_cpu()
    trainers_cpu += out["0"]["cpu_s"]
    server.stop()
    where = breakdown([t for r in out.values() for t in r.get("traced", [])], server.traces.take()) \
        if args.breakdown else None
    latency: dict[str, list[float]] = {"next": [], "reserve": [], "release": [], "pull": [], "next_and_pull": [],
                                       "next_first": [], "next_later": []}
    for result in out.values():
        for op, values in result["latency"].items():
            latency[op].extend(values)
    moved = [b for r in out.values() for b in r["moved"]]
    used = [n for r in out.values() for n in r["rows"]]
    requests = sum(op["count"] for op in stats["ops"].values())
    trained = sum(r["trained"] for r in out.values())
    committer = stats.get("committer", {})
    return {
        "phase": "scale", "trainers": trainers, "partitions": nparts, "buckets_per_pass": nparts * nparts,
        "values": args.values, "wall_s": wall, "wall_after_setup_s": ended - steady,
        "buckets_trained": sum(r["trained"] for r in out.values()),
        "waits": sum(r["waits"] for r in out.values()), "requests": requests,
        "server_busy_s": stats["busy_s"], "server_busy_fraction": stats["busy_s"] / wall,
        "server_us_per_request": 1e6 * stats["busy_s"] / max(requests, 1),
        "server_ms_per_op": {op: 1e3 * v["seconds"] / max(v["count"], 1) for op, v in stats["ops"].items()},
        "progress_ms_per_append": 1e3 * stats["progress_s"] / max(stats["appends"], 1),
        "appends": stats["appends"], "shared_appends": stats["shared_appends"],
        "copy_ms_per_sum": 1e3 * stats["copy_s"] / max(stats["ops"].get("next", {"count": 1})["count"], 1),
        "latency": {op: percentiles(values) for op, values in latency.items()},
        # the figure: the serving thread's time per bucket (its next + reserve + release), and beside it
        # the committer thread's (the vector's arithmetic and the progress writes, job/train/distributed/commits.py)
        "serving_ms_per_bucket": 1e3 * stats["busy_s"] / max(trained, 1),
        "serving_cpu_ms_per_bucket": 1e3 * stats.get("cpu_s", float("nan")) / max(trained, 1),
        # with the GIL, what bounds the server's throughput on a pod of many cores is every one of its threads'
        # Python: the serving thread, the reader (MAC and decoding), the replier (encoding and MAC), the committer
        "reader_cpu_ms_per_bucket": 1e3 * stats.get("reader_cpu_s", float("nan")) / max(trained, 1),
        "replier_cpu_ms_per_bucket": 1e3 * stats.get("replier_cpu_s", float("nan")) / max(trained, 1),
        "server_threads_cpu_ms_per_bucket": 1e3 * (stats.get("cpu_s", 0.0) + stats.get("reader_cpu_s", 0.0)
                                                   + stats.get("replier_cpu_s", 0.0) + committer.get("cpu_s", 0.0))
        / max(trained, 1),
        # a `next` asked while every other pod asks too queues behind them: its round trip is at least M x s_b
        "model_next_p99_ms": trainers * 1e3 * stats.get("cpu_s", float("nan")) / max(trained, 1),
        "committer_cpu_ms_per_bucket": 1e3 * committer.get("cpu_s", float("nan")) / max(trained, 1),
        "committer_ms_per_bucket": 1e3 * committer.get("busy_s", 0.0) / max(trained, 1),
        "threads_cpu_ms_per_bucket": {name: 1e3 * s / max(trained, 1) for name, s in sorted(threads_cpu.items())},
        "all_threads_cpu_ms_per_bucket": 1e3 * sum(threads_cpu.values()) / max(trained, 1),
        "committer": committer, "commits_per_batch": committer.get("commits", 0) / max(committer.get("batches", 0), 1),
        "pending_spilled": stats.get("pending_spilled", 0), "shared": args.shared,
        "shared_bytes_per_bucket": float(np.mean(moved)) if moved else 0.0,
        "rows_per_bucket": {"mean": float(np.mean(used)) if used else 0.0, "max": max(used, default=0)},
        # where a later `next`'s round trip went, stage by stage (next_breakdown.py)
        "next_breakdown": where,
        "queue": closed_queue(out, trainers=trainers, train_ms=train_ms, trainers_cpu_s=trainers_cpu, cpu=sampler),
    }


# the progress log and one trainer's transfers, alone --------------------------------------------------------------


def progress_phase(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``ProgressLog.append`` as the server calls it: a record of a ``next`` (finish + start) alone, and one that
    saves a bucket (the record and the stored vector)."""
    nparts = 16
    state = LockState(nparts, nparts, bucket_keys(nparts), world_size=8, version=1)
    log = ProgressLog(str(work / "progress-alone"), "bench", 1)
    vector = np.zeros(args.values, np.float32)
    log.start(state.to_json(), vector)
    records = [{"e": "finish", "rank": 3, "bucket": [2, 5], "keys": [["node", 2], ["node", 5]]},
               {"e": "stop", "rank": 3}, {"e": "start", "rank": 3, "bucket": [2, 7]}]
    small, large = [], []
    for _ in range(args.progress_repeats):
        started = time.perf_counter()
        log.append(records)
        small.append(time.perf_counter() - started)
    for _ in range(max(args.progress_repeats // 5, 3)):
        started = time.perf_counter()
        log.append([{"e": "written", "rank": 3, "keys": [["node", 5]]}], shared=vector)
        large.append(time.perf_counter() - started)
    return {"phase": "progress", "where": str(work), "record": percentiles(small),
            "record_with_vector": percentiles(large), "vector_mb": vector.nbytes / 1e6}


def transfer_phase(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One trainer (a child process) syncing ``--transfer-repeats`` times, with the vector and with an empty one."""
    results = {}
    for values in (args.values, 0):
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S))
        child = subprocess.Popen(
            [sys.executable, __file__, "--sync-child", "--port", str(store.port), "--values", str(values),
             "--transfer-repeats", str(args.transfer_repeats)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent)))
        made: dict[int, TensorTransport] = {}
        join_transport(store, 0, 2, made)
        server = LockServer(store, LockState(2, 2, bucket_keys(2), world_size=2), ProgressLog(
            str(work / "progress-sync"), "bench", 1), np.zeros(values, np.float32), 0, made[0], prefix=PREFIX)
        stdout, stderr = child.communicate(timeout=600)
        if child.returncode != 0:
            raise RuntimeError(stderr[-3000:])
        stats = server.stats()
        server.stop()
        results[str(values)] = {"round_trip": percentiles(json.loads(stdout.strip().splitlines()[-1])),
                                "server_ms_per_sync": 1e3 * stats["ops"]["sync"]["seconds"] / stats["ops"]["sync"]["count"],
                                "copy_ms": 1e3 * stats["copy_s"] / stats["ops"]["sync"]["count"]}
    return {"phase": "transfer", "values": args.values, "mb": 4 * args.values / 1e6, "by_values": results}


def sync_child(args: argparse.Namespace) -> None:
    store = TCPStore("127.0.0.1", args.port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    made: dict[int, TensorTransport] = {}
    join_transport(store, 1, 2, made)
    client = LockClient(store, 1, timeout_s=TIMEOUT_S, prefix=PREFIX, transport=made[1])
    change = torch.zeros(args.values)
    client.sync(change)  # warm-up: the pair's connection
    times = []
    for _ in range(args.transfer_repeats):
        started = time.perf_counter()
        client.sync(change)
        times.append(time.perf_counter() - started)
    print(json.dumps(times), flush=True)


def progress_pass_phase(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """The progress a whole pass writes, in bytes: ``LockState`` driven through every bucket by ``--trainers`` ranks
    as the server sees them (each ``next`` with its stats line, a write group's ``written`` record naming staged
    files, a ``release``), one progress write per request and a compaction whenever the log says so (``compact``
    where the log has it, else a new snapshot of the whole state, as before issue #45). No transport, no vector:
    the bytes the records and compactions write, counted at the storage layer, per P."""
    import random

    import storage_adapters

    counts = [int(n) for n in args.trainers.split(",")]
    parts = [int(p) for p in args.partitions.split(",")] if args.partitions else [2 * n for n in counts]
    rows = []
    written = {"bytes": 0, "writes": 0}
    real_text, real_bytes = storage_adapters.write_text, storage_adapters.write_bytes

    def text(url: str, data: str) -> None:
        written["bytes"] += len(data.encode())
        written["writes"] += 1
        real_text(url, data)

    storage_adapters.write_text = text  # type: ignore[assignment]
    try:
        for trainers, nparts in zip(counts, parts):
            keys = bucket_keys(nparts)
            state = LockState(nparts, nparts, keys, world_size=trainers, version=1)
            log = ProgressLog(str(work / f"progress-pass-{nparts}"), "bench", 1)
            log.start(state.to_json())
            written.update(bytes=0, writes=0)
            rng = random.Random(0)
            current: dict[int, Optional[Bucket]] = {rank: None for rank in range(trainers)}
            started = time.perf_counter()
            compactions = records = 0
            while not state.finished():
                progressed = False
                for rank in range(trainers):
                    finished = current[rank]
                    held = set(keys[finished]) if finished is not None else set()
                    if finished is not None:
                        state.add_record({"epoch_idx": 0, "edge_path_idx": 0, "lhs_partition": finished.lhs,
                                          "rhs_partition": finished.rhs, "index": 1, "stats": {
                                              "count": 5000, "metrics": {"loss": 1.2345678, "reg": 0.0123456,
                                                                         "violators_lhs": 12.5, "violators_rhs": 11.25,
                                                                         "pos_rank": 3.5, "mrr": 0.5, "r1": 0.25,
                                                                         "r10": 0.75, "r50": 0.875, "auc": 0.9}}})
                    kind, bucket = state.next_bucket(rank, held, finished, rng)
                    current[rank] = bucket
                    for request in ("next", "written", "release"):
                        if request == "written" and finished is not None:
                            state.record_written(rank, sorted(held), [
                                [t, p, f".tmp-staged-{rng.getrandbits(48):012x}-embeddings_{t}_{p}.v1.h5"]
                                for t, p in sorted(held)])
                        elif request == "release" and finished is not None:
                            state.release(rank, sorted(held - (set(keys[bucket]) if bucket else set())), written=False)
                        changes = state.drain_journal()
                        if changes:
                            records += 1
                            if log.append(changes):
                                compactions += 1
                                if hasattr(log, "compact"):
                                    log.compact()
                                else:  # the code before issue #45: a snapshot of the whole state
                                    log.start(state.to_json())
                    progressed |= bucket is not None or finished is not None
                if not progressed:
                    break
            rows.append({"phase": "progress-pass", "trainers": trainers, "partitions": nparts,
                         "buckets": nparts * nparts, "records": records, "compactions": compactions,
                         "bytes_written": written["bytes"], "bytes_per_bucket": written["bytes"] / (nparts * nparts),
                         "objects_written": written["writes"], "seconds": time.perf_counter() - started})
    finally:
        storage_adapters.write_text = real_text  # type: ignore[assignment]
        storage_adapters.write_bytes = real_bytes  # type: ignore[assignment]
    return rows


def state_phase(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``LockState`` alone (the scheduling logic the server runs under its lock, without transport or progress):
    ms per ``next_bucket`` / ``reserve`` / ``release`` with every trainer holding a bucket, per (trainers, P)."""
    import random

    rows = []
    counts = [int(n) for n in args.trainers.split(",")]
    parts = [int(p) for p in args.partitions.split(",")] if args.partitions else [2 * n for n in counts]
    for trainers, nparts in zip(counts, parts):
        keys = bucket_keys(nparts)
        state = LockState(nparts, nparts, keys, world_size=trainers, version=1)
        rng = random.Random(0)
        current: dict[int, Optional[Bucket]] = {rank: None for rank in range(trainers)}
        timings: dict[str, list[float]] = {"next": [], "reserve": [], "release": []}
        for _ in range(3):
            for rank in range(trainers):
                held = set(keys[current[rank]]) if current[rank] is not None else set()
                started = time.perf_counter()
                _, bucket = state.next_bucket(rank, held, current[rank], rng)
                timings["next"].append(time.perf_counter() - started)
                leaving = held - set(keys[bucket]) if bucket is not None else held
                started = time.perf_counter()
                state.reserve(rank, rng, frozenset(leaving))
                timings["reserve"].append(time.perf_counter() - started)
                started = time.perf_counter()
                state.release(rank, sorted(leaving))
                timings["release"].append(time.perf_counter() - started)
                state.drain_journal()
                current[rank] = bucket
        rows.append({"phase": "state", "trainers": trainers, "partitions": nparts,
                     "ms": {op: 1e3 * float(np.median(v)) for op, v in timings.items()}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", default="8,32,128")
    parser.add_argument("--partitions", default="", help="per trainers figure (comma list); default 2 x trainers")
    parser.add_argument("--values", type=int, default=FREEBASE_RELATION_VALUES)
    parser.add_argument("--buckets", type=int, default=4,
                        help="buckets each trainer trains at least in a scale run (each goes on until all have: as "
                        "in a pass, no trainer stops while the others train)")
    parser.add_argument("--train-ms", default="0",
                        help="think time per bucket (its compute), ms; a comma list: one scale run each (a load sweep)")
    parser.add_argument("--touched-rows", type=int, default=300,
                        help=f"relation rows ({ROW} values) each bucket uses, drawn uniformly (without --bucket-edges)")
    parser.add_argument("--shared", choices=("dense", "sparse"), default="dense",
                        help="dense: the whole vector both ways per next; sparse: the rows changed, then a pull")
    parser.add_argument("--bucket-edges", type=int, default=0,
                        help="> 0: a bucket's rows are the relations of this many edges drawn from a Zipf law")
    parser.add_argument("--zipf", type=float, default=1.5, help="the Zipf exponent of the relations' frequencies")
    parser.add_argument("--think", choices=("fixed", "spread"), default="fixed",
                        help="fixed: every bucket thinks --train-ms; spread: 0.5-1.5 x, and the first request after "
                             "0-1 x (no lock-step)")
    parser.add_argument("--per-process", type=int, default=16)
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                        help="no stamps of each request (a server without request_trace.py: an older checkout)")
    parser.add_argument("--progress-repeats", type=int, default=50)
    parser.add_argument("--transfer-repeats", type=int, default=20)
    parser.add_argument("--phases", default="progress,transfer,scale")
    parser.add_argument("--work", default="/tmp/lock_server_bench")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sync-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--ranks", default="", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.partitions = int(args.partitions)
        child_main(args)
        return
    if args.sync_child:
        sync_child(args)
        return
    from machine import matmul_rate

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    print(json.dumps({"machine": {"matmul_gflops": round(matmul_rate(), 1), "load": os.getloadavg(),
                                  "cpus": os.cpu_count()}}), flush=True)
    phases = args.phases.split(",")
    if "state" in phases:
        for row in state_phase(args):
            print(json.dumps(row), flush=True)
    if "progress" in phases:
        print(json.dumps(progress_phase(args, work)), flush=True)
    if "progress-pass" in phases:
        for row in progress_pass_phase(args, work):
            print(json.dumps(row), flush=True)
    if "transfer" in phases:
        print(json.dumps(transfer_phase(args, work)), flush=True)
    if "scale" in phases:
        counts = [int(n) for n in args.trainers.split(",")]
        parts = [int(p) for p in args.partitions.split(",")] if args.partitions else [2 * n for n in counts]
        for trainers, nparts in zip(counts, parts):
            for train_ms in (float(t) for t in args.train_ms.split(",")):
                print(json.dumps(scale_run(args, trainers, nparts, work, train_ms)), flush=True)
    print(json.dumps({"machine_after": {"load": os.getloadavg()}}), flush=True)


if __name__ == "__main__":
    main()
