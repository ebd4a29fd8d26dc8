"""Soak: train for a long time and watch the trainer's process tree for leaks (memory, file descriptors, threads).

Trains ``biggraph train`` on a generated graph (bench/train_bench.py's ``write_generated_graph`` /
``generated_config``) with many epochs and several edge chunks per epoch, so a checkpoint is
committed every pass; every ``--every`` seconds it samples, summed over the trainer and all its
children (Hogwild workers): RSS (psutil), open file descriptors (``/proc/PID/fd``) and threads
(``/proc/PID/task``). After ``--minutes`` it stops the trainer (SIGTERM, as Kubernetes does, then SIGKILL) and reports
first / after-warm-up / last / max of each, the drift (last - after warm-up) and a least-squares
slope per hour over the post-warm-up samples. Warm-up ends at the first sample taken after the
first committed checkpoint (by then every buffer, pool and upload thread exists).

    .venv/bin/python bench/soak_bench.py --minutes 30
    .venv/bin/python bench/soak_bench.py --minutes 10 --json bench/out/soak.json

Not a test: it takes as long as asked. Run it on an otherwise idle machine (check ``uptime``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_bench import generated_config, write_generated_graph  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
METRICS = ("rss_mib", "fds", "threads", "processes")


def _count(path: str) -> int:
    try:
        return len(os.listdir(path))
    except (FileNotFoundError, PermissionError, ProcessLookupError):
        return 0


def sample_tree(pid: int) -> dict[str, float] | None:
    """RSS (MiB), open fds, threads and process count of ``pid`` and all its descendants; None once it is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return None
    rss = fds = threads = alive = 0
    for proc in procs:
        try:
            rss += proc.memory_info().rss
        except psutil.Error:
            continue
        alive += 1
        fds += _count(f"/proc/{proc.pid}/fd")
        threads += _count(f"/proc/{proc.pid}/task")
    return {"rss_mib": rss / 2**20, "fds": fds, "threads": threads, "processes": alive}


def committed_version(checkpoint: Path) -> int:
    try:
        return int((checkpoint / "checkpoint_version.txt").read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def summarize(samples: list[dict[str, Any]], warm_index: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    warm = samples[warm_index:]
    hours = np.array([s["t"] for s in warm]) / 3600.0
    for metric in METRICS:
        values = np.array([s[metric] for s in samples], dtype=float)
        post = np.array([s[metric] for s in warm], dtype=float)
        slope = float(np.polyfit(hours, post, 1)[0]) if len(post) >= 3 and np.ptp(hours) > 0 else 0.0
        out[metric] = {
            "first": round(float(values[0]), 1), "after_warmup": round(float(post[0]), 1),
            "last": round(float(values[-1]), 1), "max": round(float(values.max()), 1),
            "min_after_warmup": round(float(post.min()), 1), "drift": round(float(post[-1] - post[0]), 1),
            "slope_per_hour": round(slope, 2),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="how long to train (default 30)")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples (default 10)")
    parser.add_argument("--entities", type=int, default=2_000_000)
    parser.add_argument("--edges", type=int, default=6_000_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--dimension", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--edge-chunks", type=int, default=2, help="num_edge_chunks: a checkpoint after every chunk pass")
    parser.add_argument("--work", default=str(ROOT / "bench" / "out" / "soak"), help="scratch directory (deleted first)")
    parser.add_argument("--json", default=None, help="also write the samples and summary here")
    args = parser.parse_args()

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.perf_counter()
    write_generated_graph(work, args.entities, args.edges, args.partitions)
    print(f"soak: generated {args.entities:,} entities / {args.edges:,} edges in {time.perf_counter() - started:.0f} s",
          flush=True)
    config = generated_config(work, args.partitions, args.workers, args.dimension, "soak")
    config.update(num_epochs=100_000, num_edge_chunks=args.edge_chunks)
    config_path = work / "config.json"
    config_path.write_text(json.dumps(config))
    checkpoint = Path(config["checkpoint_path"])
    log = (work / "train.log").open("w")
    proc = subprocess.Popen([PYTHON, "-m", "job", "train", str(config_path)], stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT, start_new_session=True)
    samples: list[dict[str, Any]] = []
    warm_index: int | None = None
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            sample = sample_tree(proc.pid)
            if sample is not None:
                version = committed_version(checkpoint)
                sample.update(t=round(time.monotonic() - t0, 1), checkpoint_version=version)
                samples.append(sample)
                if warm_index is None and version >= 1:
                    warm_index = len(samples) - 1
                print(f"soak: t={sample['t']:7.0f} s  v{version:<4d} rss={sample['rss_mib']:8.1f} MiB  "
                      f"fds={sample['fds']:4.0f}  threads={sample['threads']:4.0f}  procs={sample['processes']:.0f}",
                      flush=True)
            time.sleep(max(0.0, min(args.every, deadline - time.monotonic())))
    finally:
        exited_early = proc.poll() is not None
        if not exited_early:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
    if exited_early:
        print((work / "train.log").read_text()[-3000:])
        print(f"soak: the trainer exited by itself with code {proc.returncode} after {samples[-1]['t'] if samples else 0} s")
        return 1
    if not samples:
        print("soak: no samples taken")
        return 1
    summary = summarize(samples, warm_index if warm_index is not None else 0)
    result = {
        "minutes": args.minutes, "samples": len(samples), "every_s": args.every,
        "checkpoints_committed": committed_version(checkpoint), "warmup_ends_s": samples[warm_index or 0]["t"],
        "graph": {"entities": args.entities, "edges": args.edges, "partitions": args.partitions,
                  "dimension": args.dimension, "workers": args.workers, "num_edge_chunks": args.edge_chunks},
        "summary": summary,
    }
    print(json.dumps(result, indent=1))
    print("\n| metric (trainer tree) | first | after warm-up | last | max | drift after warm-up | slope/hour |")
    print("|---|---|---|---|---|---|---|")
    for metric in METRICS:
        s = summary[metric]
        print(f"| {metric} | {s['first']:g} | {s['after_warmup']:g} | {s['last']:g} | {s['max']:g} | {s['drift']:+g} | "
              f"{s['slope_per_hour']:+g} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({**result, "series": samples}, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
