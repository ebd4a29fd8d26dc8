"""What a restarted group's rank 0 spends on storage before it serves: the interrupted pass's progress read back, the
recorded write groups rolled forward, the progress compacted into a new snapshot (issue #30, time to training again).

The chaos bench (bench/RESULTS.md, "Chaos re-measured") showed a resumed round's `checkpoint open` at 12 s against
1.7 s for a fresh one and its `pass start` at 6.9 s against 0.3 s, with the checkpoint on S3 (moto): a pass's
progress is hundreds of small record objects, and they were read, checked and removed one request at a time.

Each run, in a child process importing the ``--checkout`` under test, on a moto S3 server: first (untimed) a pass's
progress as that checkout's lock server leaves it (``ProgressLog``: a snapshot, then per bucket one record finishing
it with its stats line and the shared vector, and one ``written`` record naming a write group of 2 staged files, all
moved but the last ``--unmoved`` groups'; a new snapshot whenever ``append`` asks for one), then, timed:
``read_progress``, ``roll_forward`` and ``ProgressLog.start`` (the resumed pass's compaction). Checkouts alternate
within each repeat, each on fresh objects.

    PYTHONPATH=. .venv/bin/python bench/resume_io_bench.py --checkout /work/wt-base --checkout . --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CHILD = r"""
import json, sys, time, uuid
import numpy as np
import storage_adapters as storage
from job.checkpoint.group_progress import ProgressLog, read_progress
from job.checkpoint.write_groups import roll_forward, staged_name
root, version, run, buckets, unmoved = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])

# the pass as this checkout's lock server leaves it (untimed): its records, and its compactions if it makes any
# (``append``'s result asks for one, as LockServer._persist does)
log = ProgressLog(root, run, version)
shared = np.zeros(4096, dtype=np.float32)
writing = time.perf_counter()
log.start({}, shared)
compactions = 0
for i in range(buckets):
    lhs, rhs = divmod(i % 256, 16)
    due = log.append([{"e": "finish", "rank": i % 4, "bucket": [lhs, rhs], "keys": [["node", lhs], ["node", rhs]]},
                      {"e": "record", "record": {"lhs_partition": lhs, "rhs_partition": rhs, "loss": 1.0}},
                      {"e": "start", "rank": i % 4, "bucket": [rhs, lhs]}], shared)
    if due:
        log.start({}, shared); compactions += 1
    token = uuid.uuid4().hex[:12]
    staged = [["node", part, staged_name(("node", part), version, token)] for part in (lhs, rhs)]
    if i >= buckets - unmoved:
        for _, _, name in staged:
            storage.write_bytes(storage.join(root, name), b"x" * 1024)
    due = log.append([{"e": "written", "rank": i % 4, "keys": [["node", lhs], ["node", rhs]], "staged": staged}])
    if due:
        log.start({}, shared); compactions += 1

writing = time.perf_counter() - writing
times = {}
t = time.perf_counter()
progress = read_progress(root, version - 1, run)
times["read_progress"] = time.perf_counter() - t
assert progress is not None, "no progress read"
t = time.perf_counter()
recorded = progress.staged() if callable(getattr(progress, "staged", None)) else progress.records
moved = roll_forward(root, version, recorded)
times["roll_forward"] = time.perf_counter() - t
t = time.perf_counter()
log = ProgressLog(root, run, version)
log.start(progress.state, progress.shared)
times["compaction"] = time.perf_counter() - t
left = storage.listdir(storage.join(root, "distributed_progress.log"))
print(json.dumps({"times": times, "pass_written_s": round(writing, 2), "events_replayed": len(progress.records),
                  "compactions_mid_pass": compactions,
                  "moved": moved, "log_objects_left": len(left)}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", action="append", required=True, help="a source tree to time (repeatable)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--buckets", type=int, default=200, help="buckets done in the interrupted pass")
    parser.add_argument("--unmoved", type=int, default=2, help="write groups recorded but not yet published")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    import s3fs
    from machine import matmul_rate
    from storage_bench import start_moto

    import storage_adapters as storage

    facts_before = {"matmul_gflops": round(matmul_rate(), 1), "load": round(os.getloadavg()[0], 2)}
    print(f"machine: float32 matmul {facts_before['matmul_gflops']} GFLOP/s, load {facts_before['load']}")
    moto, endpoint = start_moto()
    env = dict(os.environ, AWS_ENDPOINT_URL=endpoint)
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True).mkdir("resume-bench")
    results: list[dict] = []
    try:
        for repeat in range(args.repeats):
            for checkout in args.checkout:
                root = f"s3://resume-bench/{uuid.uuid4().hex[:8]}/checkpoints"
                run, version = "bench-run", 5
                storage.makedirs(root)
                started = time.perf_counter()
                out = subprocess.run([sys.executable, "-c", CHILD, root, str(version), run, str(args.buckets),
                                      str(args.unmoved)], check=True,
                                     capture_output=True, text=True, cwd=checkout,
                                     env=dict(env, PYTHONPATH=str(Path(checkout).resolve())))
                line = json.loads(out.stdout.strip().splitlines()[-1])
                line.update(checkout=checkout, repeat=repeat, wall_s=round(time.perf_counter() - started, 2))
                line["times"] = {k: round(v, 3) for k, v in line["times"].items()}
                results.append(line)
                print(json.dumps(line), flush=True)
    finally:
        moto.terminate()
        moto.wait(timeout=30)
    facts_after = {"matmul_gflops": round(matmul_rate(), 1), "load": round(os.getloadavg()[0], 2)}
    print(f"machine after: float32 matmul {facts_after['matmul_gflops']} GFLOP/s, load {facts_after['load']}")
    summary = {"before": facts_before, "after": facts_after, "runs": results}
    for checkout in args.checkout:
        runs = [r for r in results if r["checkout"] == checkout]
        total = sorted(sum(r["times"].values()) for r in runs)
        print(f"{checkout}: storage before serving, median {total[len(total) // 2]:.2f} s "
              f"(runs {', '.join(f'{t:.2f}' for t in total)})")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
