"""Where the lock server's ``next`` round trip goes (issue #45): the client's own readings (when it asked, when it
had its answer) joined with the server's stamps of the same request (job/train/distributed/request_trace.py), by
(rank, channel, seq). Used by bench/lock_server_bench.py.

Every reading is ``time.monotonic()``, one clock for every process of the machine on Linux, so the stages of one
request add up to its round trip. A stage is named after the stamp it ends at:

- ``to_reader``: the client's request pushed into the store's queue until the reader took it (the queue behind
  other ranks' requests, and the client's own encoding and push);
- ``reader``: the reader's MAC and decoding;
- ``inbox``: waiting in the serving thread's inbox;
- ``change_in``: its change's transfer (waiting for a buffer, then the bytes);
- ``decide``: the serving thread's decision;
- ``commit_queue``: waiting for the committer to take it up (the batch before being written);
- ``vector``: the batch's vector work;
- ``fsync``: the batch's progress write (on the reply's path only when the reply waited for it);
- ``to_serving``: back in the serving thread's inbox until it answered;
- ``replier``: the replier's queue, sealing and push;
- ``client``: from the push until the client had its answer (waking, reading and checking the reply).

The same round trip in three parts, queueing against service: ``before_server`` (to_reader), ``server`` (the
reader taking it to its reply pushed: the server's own part, its waits for a buffer or a batch included) and
``after_server`` (client).
"""

from __future__ import annotations

from typing import Any

import numpy as np

PATH = ("start", "popped", "inbox", "taken", "judged", "submitted", "commit_start", "added", "durable", "answered",
        "pushed", "got")
STAGE = {"popped": "to_reader", "inbox": "reader", "taken": "inbox", "judged": "change_in", "submitted": "decide",
         "commit_start": "commit_queue", "added": "vector", "durable": "fsync", "answered": "to_serving",
         "pushed": "replier", "got": "client"}


def stages(marks: dict[str, float]) -> tuple[dict[str, float], bool]:
    """One request's stages in seconds along its reply's path, and whether its reply left before its record was
    stored (then ``fsync`` is off the path and not among them)."""
    early = "durable" in marks and "answered" in marks and marks["durable"] > marks["answered"]
    out: dict[str, float] = {}
    previous = None
    for name in PATH:
        if name not in marks or (early and name == "durable"):
            continue
        if previous is not None:
            out[STAGE[name]] = marks[name] - marks[previous]
        previous = name
    return out, early


def breakdown(client: list[list[Any]], server: list[tuple[str, int, str, int, dict[str, float]]]) -> dict[str, Any]:
    """``client``: ``[rank, seq, started, got, first]`` per ``next``; ``server``: the server's traces. For the
    ``next``s after each rank's first (the steady state): each stage's p50 and p99, the mean of each stage over the
    slowest 1% of round trips (what the p99 is made of) and over the middle ones (p45-p55), and how many replies
    left before their record was stored (with the progress write's time after the reply, off its path)."""
    traced = {(rank, seq): marks for op, rank, channel, seq, marks in server if op == "next" and channel == ""}
    rows = []
    for rank, seq, started, got, first in client:
        marks = traced.get((rank, seq))
        if marks is None or first:
            continue
        rows.append((got - started, dict(marks, start=started, got=got)))
    if not rows:
        return {"n": 0}
    totals = np.asarray([t for t, _ in rows])
    order = np.argsort(totals)
    per = [stages(m) for _, m in rows]
    names = [STAGE[n] for n in PATH[1:]]

    def mean_of(indices: np.ndarray) -> dict[str, float]:
        return {n: round(1e3 * float(np.mean([per[i][0].get(n, 0.0) for i in indices])), 2) for n in names}

    slowest = order[int(len(order) * 0.99):] if len(order) >= 100 else order[-1:]
    middle = order[int(len(order) * 0.45):max(int(len(order) * 0.55), int(len(order) * 0.45) + 1)]
    fsync_after = [m["durable"] - m["answered"] for (_, m), (_, early) in zip(rows, per) if early]
    # queueing against service: before the reader took it (the client's push and the queue of other ranks' requests,
    # and waiting for a CPU), the server's own part (reader taking it to its reply pushed), after (the client waking)
    parts = {"before_server": [m["popped"] - m["start"] for _, m in rows],
             "server": [m.get("pushed", m["got"]) - m["popped"] for _, m in rows],
             "after_server": [m["got"] - m.get("pushed", m["got"]) for _, m in rows]}
    return {
        "split_p50_ms": {k: round(1e3 * float(np.percentile(v, 50)), 1) for k, v in parts.items()},
        "split_p99_ms": {k: round(1e3 * float(np.percentile(v, 99)), 1) for k, v in parts.items()},
        "split_slowest_1pct_mean_ms": {k: round(1e3 * float(np.mean([v[i] for i in slowest])), 1)
                                       for k, v in parts.items()},
        "n": len(rows), "p50_ms": round(1e3 * float(np.percentile(totals, 50)), 1),
        "p99_ms": round(1e3 * float(np.percentile(totals, 99)), 1),
        "stage_p50_ms": {n: round(1e3 * float(np.percentile([s.get(n, 0.0) for s, _ in per], 50)), 2) for n in names},
        "stage_p99_ms": {n: round(1e3 * float(np.percentile([s.get(n, 0.0) for s, _ in per], 99)), 2) for n in names},
        "slowest_1pct_mean_ms": mean_of(slowest), "middle_mean_ms": mean_of(middle),
        "replied_before_durable": len(fsync_after),
        "durable_after_reply_ms": {"p50": round(1e3 * float(np.percentile(fsync_after, 50)), 1),
                                   "p99": round(1e3 * float(np.percentile(fsync_after, 99)), 1)}
        if fsync_after else {},
    }
