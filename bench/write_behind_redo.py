"""What ``write_behind_buckets`` trades (issue 45): partition writes per epoch against buckets redone per lost pod.

    flock /work/bench.lock .venv/bin/python bench/write_behind_redo.py --pods 16 --partitions 32 --every 0,8,32,128,-1
    .venv/bin/python bench/write_behind_redo.py --pods 16 --partitions 32 --every -1 --every-s 8,16,32

``--every-s`` adds ``write_behind_seconds``: a cut also once that much simulated time passed since the last one
began, in units of the mean bucket (a bucket lasts 0.5-1.5 units; an epoch of B buckets on M pods ~B/M units).

No processes, no storage: the lock server's real decisions (``LockState``, and for writes behind the real ``Cuts``
and ``Holders``) driven as trainers drive them, M pods finishing buckets of random lengths (uniform 0.5-1.5) in
time order. Today's mode (0): at a switch that lets a partition go the pod writes its write group (the partitions
leaving and kept) and records it; writes behind: the partitions leaving are released unwritten with their rows kept,
and a cut (every N buckets done, and at the pass's end) writes each partition trained since the last one once. The
cuts every N buckets are taken in the background (job/train/distributed/cut_behind.py: each pod's turn at once, at
its next bucket end, the others training on) unless ``--stop-the-group`` (every pod waits at the cut).

At every bucket's end the bench asks what a loss of each pod would cost now, as the restart counts it
(``LockState.forget_rank_locks``): today, the lost pod's bucket in flight and its done-but-unsaved buckets (the
survivors drain and save theirs); written behind, every bucket in flight and every bucket done since the last cut
(nothing unsaved can be saved once a holder is gone). Reported per epoch: partition writes (and as multiples of
one checkpoint's P partitions), and buckets redone per lost pod (mean over the sampled moments, and the worst).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from job.train.distributed.cut_wire import Cut  # noqa: E402
from job.train.distributed.cuts import Cuts  # noqa: E402
from job.train.distributed.holders import Holders  # noqa: E402
from job.train.distributed.lock_state import LockState  # noqa: E402
from job.train.schedule.orders import all_buckets  # noqa: E402


def turn(cuts: Cuts, state: LockState, holders: Holders, rank: int, pods: int) -> int:
    """``rank``'s turn in the cut taken in the background (job/train/distributed/cut_behind.py), at once: its stage
    or its move; returns the partitions it staged."""
    staged: list[list[Any]] = []
    step = cuts.answer(state, holders, rank, Cut(), range(pods))
    if step.step == "stage":
        staged = [[k[0], k[1], f".tmp-staged-x-{k[0]}_{k[1]}", 1, "0"] for k in step.keys]
        step = cuts.answer(state, holders, rank, Cut(staged=tuple(staged)), range(pods))
    if step.step == "move":
        cuts.answer(state, holders, rank, Cut(moved=True), range(pods))
    return len(staged)


def epoch(pods: int, partitions: int, every: int, seed: int, background: bool = True,
          every_s: float = 0.0) -> dict[str, Any]:
    keys = {b: frozenset({("node", b.lhs), ("node", b.rhs)}) for b in all_buckets(partitions, partitions)}
    state = LockState(partitions, partitions, keys, world_size=pods)
    holders = Holders(keys, gone=lambda: ())
    cuts = Cuts(every, background=background) if every else None
    simulated = [0.0]  # the simulated time now: the cuts' clock
    if cuts is not None:
        cuts.cadence(every_s, clock=lambda: simulated[0])
    rng, order = random.Random(seed), random.Random(seed + 1)
    held: dict[int, set] = {rank: set() for rank in range(pods)}
    writes, redo, cut_now = 0, [], False
    clock: list[tuple[float, int]] = [(order.random() * 1e-3, rank) for rank in range(pods)]
    heapq.heapify(clock)
    current: dict[int, Any] = {}
    while clock:
        now, rank = heapq.heappop(clock)
        simulated[0] = now
        finished = current.pop(rank, None)
        if finished is not None:  # the moment a bucket ends: what a loss of each pod would redo now
            for lost in range(pods):
                if cuts is None:
                    redo.append(int(lost in state.in_flight) + len(state.unsaved.get(lost, {})))
                else:
                    redo.append(len(state.in_flight) + len(state.unsaved_buckets()))
        if cuts is not None and cuts.due(state, rank, finished, live=range(pods)):
            if cuts.reserving(rank):  # a turn in a cut taken in the background: at once, then it asks again
                state.stop(rank, finished, keep_reserved=True)
                writes += turn(cuts, state, holders, rank, pods)
                heapq.heappush(clock, (now, rank))
                continue
            state.stop(rank, finished)
            cut_now = True
            if not state.in_flight:  # every pod has reached the cut: it stages, records and moves (no time here)
                while cuts.behind is not None:  # the one in the background ends first
                    for other in range(pods):
                        if cuts.behind is not None and cuts.behind.owes(other):
                            writes += turn(cuts, state, holders, other, pods)
                step = cuts.answer(state, holders, 0, Cut(), range(pods))
                for other in range(pods):
                    step = cuts.answer(state, holders, other, Cut(), range(pods))
                    if step.step == "go":  # (the last cut's ``go`` it had not heard yet: ``Cuts.over``)
                        step = cuts.answer(state, holders, other, Cut(), range(pods))
                    staged = [[k[0], k[1], f".tmp-staged-x-{k[0]}_{k[1]}", 1, "0"] for k in step.keys]
                    writes += len(staged)
                    cuts.answer(state, holders, other, Cut(staged=tuple(staged)), range(pods))
                for other in range(pods):
                    cuts.answer(state, holders, other, Cut(moved=True), range(pods))
                cut_now = False
                for other in range(pods):
                    heapq.heappush(clock, (now, other))
            continue
        if cut_now:
            continue
        kind, bucket = state.next_bucket(rank, held[rank], finished, rng)
        if kind == "done":
            continue
        keep = set(keys[bucket]) if bucket is not None else set()
        leaving = held[rank] - keep
        if leaving:
            if cuts is None:  # today's write group: leaving and kept, one record, then the release
                writes += len(held[rank])
                state.record_written(rank, sorted(held[rank]))
                holders.written(held[rank])
                state.release(rank, sorted(leaving), written=False)
            else:  # released unwritten, its rows kept
                state.release(rank, sorted(leaving), written=False)
                holders.released(rank, leaving, [(k[0], k[1], "d") for k in leaving], written=False)
        held[rank] = keep
        if bucket is None:  # wait: ask again a little later
            heapq.heappush(clock, (now + 0.05, rank))
            continue
        current[rank] = bucket
        heapq.heappush(clock, (now + 0.5 + order.random(), rank))
    if cuts is None:  # the pass's end: every pod writes what it still holds
        writes += sum(len(h) for h in held.values())
    return {"writes": writes, "redo_mean": statistics.fmean(redo), "redo_max": max(redo),
            "cuts": cuts.stats.cuts if cuts is not None else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=16)
    parser.add_argument("--partitions", type=int, default=32)
    parser.add_argument("--every", default="0,8,32,128,-1", help="write_behind_buckets values (0: today's mode)")
    parser.add_argument("--every-s", default="0",
                        help="write_behind_seconds values, in mean bucket times (0: cuts by buckets alone); with "
                             "each --every other than 0")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--stop-the-group", action="store_true",
                        help="take the cuts every N buckets with the group stopped (before issue 45's cuts in the "
                             "background)")
    args = parser.parse_args()
    settings = [(int(e), float(s) if int(e) else 0.0) for e in args.every.split(",")
                for s in (args.every_s.split(",") if int(e) else ["0"])]
    for every, every_s in settings:
        runs = [epoch(args.pods, args.partitions, every, seed, background=not args.stop_the_group, every_s=every_s)
                for seed in range(args.epochs)]
        writes = statistics.fmean(r["writes"] for r in runs)
        print(json.dumps({
            "pods": args.pods, "partitions": args.partitions, "buckets": args.partitions ** 2,
            "write_behind_buckets": every, "write_behind_seconds": every_s,
            "cuts_in_background": not args.stop_the_group and (every > 0 or every_s > 0),
            "cuts_per_epoch": statistics.fmean(r["cuts"] for r in runs),
            "partition_writes_per_epoch": round(writes, 1), "checkpoints_written": round(writes / args.partitions, 2),
            "buckets_redone_per_lost_pod_mean": round(statistics.fmean(r["redo_mean"] for r in runs), 2),
            "buckets_redone_per_lost_pod_worst": max(r["redo_max"] for r in runs)}), flush=True)


if __name__ == "__main__":
    main()
