"""A lock-server bench run as a closed queue (issue #45): N trainers, each a bucket's requests (R) then its think
time (Z, the bucket's compute: ``--train-ms``), and the CPU that bounds how fast the group goes round. Used by
bench/lock_server_bench.py.

Why: with every trainer asking back to back, a round trip is what the queue makes it (Little's law,
R + Z = N / X), whatever one request costs; the meaningful figures are the round trip against the offered load and
the server's own part of it (bench/RESULTS.md, "The `next` round trip under load").
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any


def server_threads_cpu() -> dict[str, float]:
    """CPU seconds of this process's lock-server threads alive now, by thread name (``biggraph-*``: serving, reader,
    replier where there is one, committer, transfer waiters), from /proc: the same count on any checkout."""
    tick = os.sysconf("SC_CLK_TCK")
    by_name: dict[str, float] = {}
    for thread in threading.enumerate():
        if not thread.name.startswith("biggraph-") or thread.native_id is None:
            continue
        try:
            fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        by_name[thread.name] = by_name.get(thread.name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return by_name


def machine_busy() -> tuple[float, float]:
    """The machine's CPU seconds busy and elapsed, summed over its CPUs (/proc/stat: everything but idle and
    iowait), for the busy fraction of a window."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(fields) - fields[3] - fields[4]) / tick, sum(fields) / tick


class Sampler:
    """The machine's busy CPU and the lock server's threads' CPU, read every ``every_s`` from /proc with the time
    (``time.monotonic``, the trainers' clock): a window's CPU is read between the samples nearest its ends, not
    across the children's exit and the bench's own joins."""

    def __init__(self, every_s: float = 0.1) -> None:
        self.samples: list[tuple[float, float, float, float]] = []  # (when, machine busy, machine all, server)
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            busy, total = machine_busy()
            self.samples.append((time.monotonic(), busy, total, sum(server_threads_cpu().values())))
            if self._stop.wait(self._every_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> tuple[float, float, float]:
        """Machine busy CPU-s, machine elapsed CPU-s, server threads' CPU-s, from the last sample at or before
        ``start`` to the first at or after ``end``."""
        before = [s for s in self.samples if s[0] <= start] or self.samples[:1]
        after = [s for s in self.samples if s[0] >= end] or self.samples[-1:]
        a, b = before[-1], after[0]
        return b[1] - a[1], b[2] - a[2], b[3] - a[3]


def closed_queue(out: dict[str, Any], *, trainers: int, train_ms: float, trainers_cpu_s: float,
                 cpu: Sampler) -> dict[str, Any]:
    """The run as a closed queue (bench/RESULTS.md, "The `next` round trip under load"): N trainers, each a bucket's
    requests (R, the time outside its think time) then ``train_ms`` of think (Z). Little's law over the steady window
    says R + Z = N_in / X, with X the buckets per second and N_in the trainers in the system on average (N, less the
    ramp-down of those that finished early); the bottleneck bound says X <= 1 / D, with D the CPU a bucket needs from
    the most loaded resource: the lock server's threads (one GIL: at most one CPU) or this machine's CPUs (shared by
    the server and every trainer). Why: with requests back to back, a round trip is what the queue makes it, whatever
    one request costs."""
    results = [r for r in out.values() if "began" in r]
    start, end = min(r["began"] for r in results), max(r["ended"] for r in results)
    window = end - start
    trained = sum(r["trained"] for r in results)
    x = trained / window
    in_system = sum(r["ended"] - r["began"] for r in results) / window
    outside_think = sum(r["ended"] - r["began"] - r["thought_s"] for r in results) / max(trained, 1)
    think_s = sum(r["thought_s"] for r in results) / max(trained, 1)  # Z as thought (a spread start's wait included)
    machine_busy_s, machine_all_s, server_cpu_s = cpu.between(start, end)
    cpus = os.cpu_count() or 1
    server_d = server_cpu_s / max(trained, 1)
    machine_d = machine_busy_s / max(trained, 1)
    bound_x = min(1.0 / server_d, cpus / machine_d) if server_d > 0 and machine_d > 0 else float("nan")
    return {
        "trainers": trainers, "think_ms": train_ms, "think_ms_per_bucket": 1e3 * think_s, "window_s": window, "buckets": trained,
        "throughput_buckets_s": x, "trainers_in_system_mean": in_system,
        "r_ms_per_bucket": 1e3 * outside_think,  # measured: a bucket's requests and waits, think excluded
        "little_r_ms_nominal": 1e3 * (trainers / x - think_s),  # N / X - Z with N = --trainers
        "little_r_ms": 1e3 * (in_system / x - think_s),  # with the time-averaged N in the system
        "server_cpu_ms_per_bucket": 1e3 * server_d, "server_busy_fraction": server_cpu_s / window,
        "trainers_cpu_ms_per_bucket": 1e3 * trainers_cpu_s / max(trained, 1),
        "machine_cpu_ms_per_bucket": 1e3 * machine_d, "cpus": cpus,
        "machine_busy_fraction": machine_busy_s / max(machine_all_s, 1e-9),
        "bound_throughput_buckets_s": bound_x, "utilisation_of_bound": x / bound_x,
        # the asymptotic bound of a closed queue: R >= N x D_max - Z (D_max per bucket of the bottleneck)
        "bound_r_ms": 1e3 * (trainers / bound_x - think_s),
    }
