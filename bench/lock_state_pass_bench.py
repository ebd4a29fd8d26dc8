"""``LockState`` alone driven as bench/lock_server_bench.py's trainers drive it (issue #45): each of ``--trainers``
ranks in turn asks ``next`` (finishing its bucket), ``reserve`` and ``release`` of the partitions it leaves, for
``--rounds`` rounds; prints the mean milliseconds of scheduling per bucket, best of ``--repeats``.

Why a mean per bucket beside ``--phases state``'s medians: a lock change reclassifies the 2P-1 buckets touching its
partition, and only some requests change a lock, so the median hides the cost that the serving thread pays per
bucket on average. Run it from any checkout (``PYTHONPATH=.``) to compare two versions of the scheduler:

    .venv/bin/python bench/lock_state_pass_bench.py --trainers 128 --partitions 256
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, os.getcwd())

from machine import matmul_rate  # noqa: E402

from job.train.distributed.lock_state import LockState  # noqa: E402
from job.types import Bucket  # noqa: E402


def bucket_keys(nparts: int) -> dict[Bucket, frozenset]:  # (as lock_server_bench.py's, which puts this checkout
    # first on the path: this bench measures whichever checkout it runs from)
    return {Bucket(a, b): frozenset({("node", a), ("node", b)}) for a in range(nparts) for b in range(nparts)}


def one_pass(trainers: int, nparts: int, rounds: int) -> tuple[float, int]:
    keys = bucket_keys(nparts)
    state = LockState(nparts, nparts, keys, world_size=trainers, version=1)
    rng = random.Random(0)
    current: dict[int, Optional[Bucket]] = {r: None for r in range(trainers)}
    held: dict[int, set] = {r: set() for r in range(trainers)}
    buckets = 0
    started = time.perf_counter()
    for _ in range(rounds):
        for rank in range(trainers):
            _, bucket = state.next_bucket(rank, held[rank], current[rank], rng)
            if bucket is None:
                continue
            leaving = held[rank] - set(keys[bucket])
            state.reserve(rank, rng, frozenset(leaving))
            if leaving:
                state.release(rank, sorted(leaving))
            held[rank], current[rank] = set(keys[bucket]), bucket
            buckets += 1
            state.drain_journal()
    return (time.perf_counter() - started) / max(buckets, 1) * 1e3, buckets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", type=int, default=128)
    parser.add_argument("--partitions", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps({"machine": {"matmul_gflops": round(matmul_rate(), 1), "load": os.getloadavg()}}), flush=True)
    runs = [one_pass(args.trainers, args.partitions, args.rounds) for _ in range(args.repeats)]
    print(json.dumps({"trainers": args.trainers, "partitions": args.partitions, "buckets": runs[0][1],
                      "ms_per_bucket_best": min(ms for ms, _ in runs), "ms_per_bucket": [ms for ms, _ in runs]}))


if __name__ == "__main__":
    main()
