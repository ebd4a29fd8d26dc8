"""What bench/chaos_bench.py measures, apart from the chaos itself: committed versions verified as they appear, the
pods' logs read as they grow (the moments each group formed and trained), the committed stats' buckets, the shared
update counter (bench/chaos_hooks/sitecustomize.py) and the filtered MRR.

Everything here reads the checkpoint through the project's own readers, from outside the pods, while they train: a
version dropped under a reader (its successor committed meanwhile) is told apart from one that fails to verify by
reading the marker again."""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from fault_bench import load_version_files  # noqa: E402 - a sibling bench module, not a package

from job.formats.checkpoint import CheckpointStorage

ROOT = Path(__file__).resolve().parent.parent

JOINED = re.compile(r"rank (\d+) of (\d+) joined round (\w+)")
RANK0 = re.compile(r"rank 0 of \d+ joined round (\w+) of run \S+ \(pid (\d+)")
PROGRESS = re.compile(r"INFO (?:\[rank \d+\] )?progress: ")


@dataclass(frozen=True)
class Expected:
    """What a committed version must hold: the graph's shape and the counter relation's index."""

    config: dict[str, Any]
    counts: list[int]  # entities per partition
    counter_relation: int  # the relation's index, or with ``dynamic`` its row in the one operator's table
    dynamic: bool = False

    @property
    def partitions(self) -> int:
        return len(self.counts)


def verify_version(checkpoint: str, version: int, expected: Expected) -> list[float]:
    """Load every file of committed ``version`` (bench/fault_bench.py's ``load_version_files``: of the version named,
    not of whatever the marker says by then): each partition with its shape and optimizer state, the model
    with its pass; every read is checked against the version's checksums by ``CheckpointStorage``. Returns the counter
    relation's vector (element 0: buckets; 1 + l: buckets of lhs partition l); raises on any problem."""
    params = load_version_files(CheckpointStorage(checkpoint), version, expected.counts, expected.config["dimension"])
    index = expected.counter_relation
    if expected.dynamic:
        [key] = [k for k in params if re.search(r"(^|/)0/", k) and "rhs" in k and "translations" in k]
        return [float(x) for x in params[key][index][: 1 + expected.partitions]]
    [key] = [k for k in params if re.search(rf"(^|/){index}/", k) and "rhs" in k and "translation" in k]
    return [float(x) for x in params[key][: 1 + expected.partitions]]


def counter_shortfall(values: list[float], version: int, partitions: int) -> tuple[float, float]:
    """(updates lost, updates doubled) in a version, from its counter: each bucket of each of its ``version`` passes
    adds 1 to element 0 and 1 to element 1 + lhs; any element below or above what that gives is a lost or doubled
    update (the larger of element 0's and the per-partition elements' verdicts)."""
    lost_total = max(0.0, version * partitions * partitions - values[0])
    doubled_total = max(0.0, values[0] - version * partitions * partitions)
    per_part = [v - version * partitions for v in values[1:]]
    lost = max(lost_total, sum(-d for d in per_part if d < 0))
    doubled = max(doubled_total, sum(d for d in per_part if d > 0))
    return lost, doubled


@dataclass
class VersionWatcher:
    """Verifies every committed version as soon as the marker names it (every partition and the model read through
    ``CheckpointStorage``, each file against the version's checksums; the counter read), from a thread."""

    checkpoint: str
    expected: Expected
    every_s: float = 1.0
    verified: dict[int, dict[str, Any]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    superseded: list[int] = field(default_factory=list)  # dropped (successor committed) before a read finished
    marker_went_back: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="version-watcher", daemon=True)
        self.highest = 0

    def start(self) -> VersionWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def marker(self) -> int:
        return CheckpointStorage(self.checkpoint).load_version()

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                version = self.marker()
            except Exception:  # noqa: BLE001 - an observation; the marker is read whole on the next look
                continue
            if version < self.highest:
                self.marker_went_back.append(f"marker {version} after {self.highest}")
            if version > self.highest:
                self.highest = version
                self.check(version)

    def check(self, version: int) -> None:
        """Verify ``version``; a failure counts only if the marker still names it afterwards (else superseded)."""
        if version in self.verified or version == 0:
            return
        started = time.monotonic()
        try:
            values = verify_version(self.checkpoint, version, self.expected)
        except Exception as err:  # noqa: BLE001 - every failure to load is what the bench counts
            try:
                still = self.marker() == version
            except Exception:  # noqa: BLE001
                still = True
            if still:
                self.failures.append(f"v{version}: {type(err).__name__}: {err}")
            else:
                self.superseded.append(version)
            return
        lost, doubled = counter_shortfall(values, version, self.expected.partitions)
        self.verified[version] = {"counter": values[0], "lost": lost, "doubled": doubled,
                                  "seconds": round(time.monotonic() - started, 2)}
        print(f"chaos: v{version} verified in {time.monotonic() - started:.1f} s; counter {values[0]:g} "
              f"(lost {lost:g}, doubled {doubled:g})", flush=True)


@dataclass
class LogTail:
    """The pods' logs read as they grow (every 0.1 s), each line timestamped on arrival (the log's own stamps have
    whole seconds): when each rank joined which round, and when a trainer finished its first bucket of a round (its
    first ``progress:`` line: a fresh worker process prints one on its first bucket)."""

    logs: Path
    joins: list[tuple[float, str, int, str]] = field(default_factory=list)  # (time, round, world size, log)
    trains: list[tuple[float, Optional[str], str]] = field(default_factory=list)  # (time, round, log)
    rank0: list[tuple[float, str, int, str]] = field(default_factory=list)  # (time, round, rank 0's pid, log)
    tracebacks: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}
        self._round: dict[Path, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="log-tail", daemon=True)

    def start(self) -> LogTail:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.poll()

    def _follow(self) -> None:
        while not self._stop.wait(0.1):
            self.poll()

    def poll(self) -> None:
        now = time.monotonic()
        for path in sorted(self.logs.glob("*.log")):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as handle:
                handle.seek(offset)
                data = handle.read()
            if not data:
                continue
            self._offsets[path] = offset + len(data)
            text = self._partial.pop(path, "") + data.decode(errors="replace")
            lines = text.split("\n")
            if lines[-1]:
                self._partial[path] = lines[-1]
            for line in lines[:-1]:
                self._line(now, path, line)

    def _line(self, now: float, path: Path, line: str) -> None:
        joined = JOINED.search(line)
        if joined:
            self._round[path] = joined.group(3)
            self.joins.append((now, joined.group(3), int(joined.group(2)), path.name))
            rank0 = RANK0.search(line)
            if rank0:
                self.rank0.append((now, rank0.group(1), int(rank0.group(2)), path.name))
        elif PROGRESS.search(line):
            self.trains.append((now, self._round.get(path), path.name))
        elif line.startswith("Traceback"):
            self.tracebacks[path.name] += 1

    def rounds(self) -> dict[str, tuple[float, int]]:
        """Each round's first join time and world size."""
        found: dict[str, tuple[float, int]] = {}
        for at, round_id, world, _ in self.joins:
            if round_id not in found:
                found[round_id] = (at, world)
        return found

    def training_again(self, since: float) -> Optional[float]:
        """Seconds from ``since`` until a trainer of a round formed after it finished a bucket; None if none did."""
        fresh = {r for r, (at, _) in self.rounds().items() if at > since}
        times = [at for at, round_id, _ in self.trains if at > since and round_id in fresh]
        return min(times) - since if times else None

    def current_rank0(self) -> Optional[tuple[int, str]]:
        """(pid, log file name) of the rank 0 of the latest round that any rank joined; None before any."""
        if not self.rank0 or not self.joins:
            return None
        latest_round = max(self.joins)[1]
        found = [(pid, log) for _, round_id, pid, log in self.rank0 if round_id == latest_round]
        return found[-1] if found else None

    def new_group(self, since: float) -> Optional[float]:
        """Seconds from ``since`` until a round formed after it (its first rank joined); None if none did."""
        times = [at for at, _ in self.rounds().values() if at > since]
        return min(times) - since if times else None


def stats_buckets(checkpoint: str, epochs: int, partitions: int) -> dict[str, Any]:
    """The committed stats: buckets trained other than once per epoch, buckets redone, world sizes."""
    records = CheckpointStorage(checkpoint).load_stats()
    per_bucket = Counter((r["epoch_idx"], r["lhs_partition"], r["rhs_partition"]) for r in records
                         if "lhs_partition" in r)
    expected = {(e, lhs, rhs) for e in range(epochs) for lhs in range(partitions) for rhs in range(partitions)}
    missing = len(expected - set(per_bucket))
    repeated = sum(n - 1 for n in per_bucket.values() if n > 1)
    stray = sum(n for b, n in per_bucket.items() if b not in expected)
    summaries = [r for r in records if r.get("pass_summary")]
    return {"buckets_not_once": missing + repeated + stray, "missing": missing, "repeated": repeated, "stray": stray,
            "buckets_redone": sum(int(s.get("buckets_redone", 0)) for s in summaries),
            "redone_per_pass": [int(s.get("buckets_redone", 0)) for s in summaries],
            "world_sizes": [s.get("world_size") for s in summaries],
            "passes": [s.get("checkpoint_version") for s in summaries]}


def copy_for_eval(config: dict[str, Any], data: str, work: Path) -> Path:
    """A local copy of the data and the committed checkpoint under WORK/eval-copy, and the config that evaluates it
    (WORK/eval-config.json, paths relative to WORK so that the folder can be moved, e.g. to a faster machine).

    Why a copy: ranking against every entity reads each of the 16 partitions for each of the 256 buckets (the
    reader keeps 4), which from moto under this machine's load took longer than training; the committed files and
    their checksums are the same, and the moto server ends with the bench."""
    import s3fs

    local = work / "eval-copy"
    shutil.rmtree(local, ignore_errors=True)
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.get(data.removeprefix("s3://"), str(local / "data"), recursive=True)
    fs.get(config["checkpoint_path"].removeprefix("s3://"), str(local / "checkpoints"), recursive=True)
    config = dict(config, entity_path="eval-copy/data/entities", edge_paths=["eval-copy/data/test"],
                  checkpoint_path="eval-copy/checkpoints")
    eval_config = work / "eval-config.json"
    eval_config.write_text(json.dumps(config))
    return eval_config


def eval_command(python: str = sys.executable) -> list[str]:
    """``biggraph eval`` of a copy made by ``copy_for_eval``, run from its WORK: the committed version on the test
    split against every entity, train and test edges filtered."""
    return [python, "-m", "job", "eval", "eval-config.json", "--candidates", "all", "--json",
            "--filter", "eval-copy/data/train", "--filter", "eval-copy/data/test"]


def filtered_mrr(config: dict[str, Any], data: str, work: Path) -> dict[str, Any]:
    """The filtered MRR of the committed version (``copy_for_eval`` then ``eval_command``)."""
    copy_for_eval(config, data, work)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(eval_command(), cwd=work, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"biggraph eval exited {done.returncode}: {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def summarize_seconds(values: list[float]) -> dict[str, Any]:
    """Median and worst of a list of seconds (None when empty)."""
    if not values:
        return {"n": 0, "median_s": None, "worst_s": None}
    return {"n": len(values), "median_s": round(statistics.median(values), 1), "worst_s": round(max(values), 1)}
