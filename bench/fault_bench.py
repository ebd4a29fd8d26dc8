"""Faults at scale: SIGKILL ``biggraph train`` at random moments, resume, and check every committed version.

A generated graph (one entity type in ``--partitions`` partitions, so every bucket change swaps a
partition through checkpoint storage) is trained for ``--passes`` short passes. In a loop the bench
starts ``python -m job train -v CONFIG`` in its own session, SIGKILLs the whole process group at a
seeded random moment and checks, before starting the next trainer:

- the version named by ``checkpoint_version.txt`` loads whole through the project's own readers
  (``CheckpointStorage.load_entity_partition`` for every partition, with the expected shape and
  an optimizer state; ``load_model`` with ``iteration/epoch_idx == version - 1``): an *unloadable
  version* otherwise;
- the version never goes below the highest one seen committed so far, including versions the
  bench saw in ``checkpoint_version.txt`` while the trainer was still running: a *lost commit*
  otherwise.

When a checkpoint reaches ``--passes`` (the round's trainer finishes by itself, or a kill lands
after the last commit) the round ends: one more run must exit 0 with nothing to do, the committed
version must equal ``--passes``, no other version's files may remain and ``training_stats.json``
must name every pass once with each of its buckets once. The next round starts on a fresh
checkpoint, until ``--kills`` kills per backend are done.

Where the kills land (how they are biased). Each kill draws one of three modes:

- ``uniform``: a delay uniform in [0.3 s, --max-delay] after the trainer starts (start-up, resume,
  training, swaps and commits alike, in proportion to the time they take);
- ``after-bucket``: wait for the k-th ``bucket ...`` debug line of this run (k uniform in 1..2P^2),
  then 0-30 ms: the trainer has just finished a bucket and is swapping partitions for the next one
  (writing the partition it leaves into the next version and reading the new one) or, after a
  pass's last bucket, writing and committing the version;
- ``file-write``: wait until the trainer starts writing its j-th checkpoint file of this run
  (j uniform in 1..8), then 0-10 ms. Locally that is a ``.tmp-*`` file in the checkpoint
  directory (h5 partition/model files and the marker are written under a temporary name, then
  renamed); on S3 a ``biggraph-upload-<pid>-*`` staging directory in the trainer's TMPDIR (the
  file is built there, then uploaded in a background thread while training goes on).

At the moment of each kill the bench records what was in flight (a partition or model file being
written, an S3 upload, a bucket finished less than 30 ms before) and reports those counts.

Buckets redone: the trainer's ``-v`` log prints one line per finished bucket with its pass index and
partitions; a (pass, lhs, rhs) bucket that finished more than once over all runs of a round was
redone (its pass was lost to a kill before its commit). training_stats.json holds committed
passes only, so it must show each bucket once (checked at the end of each round).

    .venv/bin/python bench/fault_bench.py --kills 100 --backend both --seed 1
    .venv/bin/python bench/fault_bench.py --kills 10 --backend s3 --json bench/out/fault_s3.json

S3 runs against a moto server started as a subprocess on 127.0.0.1 (as bench/storage_bench.py
does); the trainers reach it through ``storage_options.endpoint_url`` in the config and harmless
AWS_* test credentials. Kills count outcomes, not speed: a busy machine is fine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import storage_bench  # noqa: E402
from train_bench import generated_config, write_generated_graph  # noqa: E402

import storage_adapters as storage  # noqa: E402
from job.formats.checkpoint import CheckpointStorage  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
BUCKET_LINE = re.compile(r"DEBUG (?:\[rank \d+\] )?bucket \(\d+, \d+\): (\{.*\})\s*$")
MODES = ("uniform", "after-bucket", "file-write")
COMMIT_LABEL = "<30 ms after a pass's last bucket (commit)"
AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
    # no real profile or endpoint may leak in: everything goes to the moto server
    "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


# moto ------------------------------------------------------------------------------------------


_PROCESS_SCOPE = contextlib.ExitStack()  # storage settings of this bench process (closed at exit)

def start_moto() -> tuple[subprocess.Popen, str]:
    """bench/storage_bench.py's moto server, with this bench's credentials (the trainers get them too)."""
    proc, endpoint = storage_bench.start_moto()
    os.environ.update(AWS_TEST_ENV)
    return proc, endpoint


# one trainer run --------------------------------------------------------------------------------


class Trainer:
    """``python -m job train -v`` in its own session; its output read line by line as it comes (timestamped)."""

    def __init__(self, config_path: Path, log_path: Path, env: dict[str, str], stale: frozenset = frozenset()) -> None:
        self.stale = stale  # temporary files of killed predecessors, present before this trainer started
        self.log = log_path.open("a")
        self.proc = subprocess.Popen(
            [PYTHON, "-m", "job", "-v", "train", str(config_path)], cwd=ROOT, env=env, start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        )
        self.started = time.monotonic()
        self.buckets: list[tuple[float, dict[str, Any]]] = []  # (monotonic time, record) per finished bucket
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
            match = BUCKET_LINE.search(line)
            if match:
                try:
                    self.buckets.append((time.monotonic(), json.loads(match.group(1))))
                except json.JSONDecodeError:
                    pass

    def running(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the trainer and anything it started
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.finish()

    def finish(self) -> int:
        code = self.proc.wait()
        self.reader.join(timeout=30)
        self.log.close()
        return code


# what is in flight -------------------------------------------------------------------------------


@dataclass
class Backend:
    name: str
    checkpoint_url: str
    tmpdir: Path  # the trainers' TMPDIR (S3 staging directories appear here)
    local_dir: Optional[Path]  # the checkpoint directory when it is local

    def writes_in_flight(self, pid: int, stale: frozenset = frozenset()) -> list[str]:
        """Checkpoint files being written right now by process ``pid``: local ``.tmp-*`` names (except ``stale``
        ones, left by an earlier killed trainer until this one's start-up removes them), or the files in ``pid``'s
        S3 staging directories."""
        found = []
        if self.local_dir is not None:
            try:
                names = os.listdir(self.local_dir)
            except FileNotFoundError:
                return []
            for name in names:
                if name.startswith(".tmp-") and name not in stale:
                    found.append(name)
            return found
        prefix = f"{storage.UPLOAD_DIR_PREFIX}{pid}-"
        try:
            names = os.listdir(self.tmpdir)
        except FileNotFoundError:
            return []
        for name in names:
            if name.startswith(prefix):
                try:
                    inner = os.listdir(self.tmpdir / name)
                except FileNotFoundError:
                    continue
                found.extend(inner or [name])
        return found

    def read_marker(self) -> int:
        """checkpoint_version.txt as it is now (0 when absent); a half-read or raced read gives -1."""
        try:
            return CheckpointStorage(self.checkpoint_url).load_version()
        except Exception:  # an observation only; the checks after the kill are strict
            return -1


def classify(writes: list[str], trainer: Trainer, now: float, nparts: int) -> list[str]:
    """Labels for the moment of a kill (several may apply)."""
    labels = []
    if any("embeddings_" in w for w in writes):
        labels.append("partition file write/upload")
    if any("model." in w for w in writes):
        labels.append("model file write/upload (commit)")
    if any("checkpoint_version" in w for w in writes):
        labels.append("marker write")
    if writes and not any(("embeddings_" in w or "model." in w or "checkpoint_version" in w) for w in writes):
        labels.append("other file write (marker, config.json)")
    per_pass = nparts * nparts
    if not trainer.buckets:
        labels.append("before the first bucket of the run")
    elif now - trainer.buckets[-1][0] < 0.03:
        if trainer.buckets[-1][1]["index"] % per_pass == per_pass - 1:
            labels.append(COMMIT_LABEL)
        else:
            labels.append("<30 ms after a bucket (partition swap)")
    if not labels:
        labels.append("training a bucket")
    return labels


# checks ---------------------------------------------------------------------------------------


def check_loadable(checkpoint_url: str, config: dict[str, Any], counts: list[int]) -> int:
    """Load every file of the committed version; return it (raise on any problem)."""
    ckpt = CheckpointStorage(checkpoint_url)
    version = ckpt.load_version()
    if version == 0:
        return 0
    load_version_files(ckpt, version, counts, config["dimension"])
    return version


def load_version_files(ckpt: CheckpointStorage, version: int, counts: list[int], dimension: int) -> dict[str, Any]:
    """Load every file of ``version`` ("node" partitions of ``counts`` rows, the model of its pass), each read checked
    against the version's checksums; return the model's parameters (raise on any problem)."""
    for part, count in enumerate(counts):
        embeddings, state = ckpt.load_entity_partition(version, "node", part)
        if embeddings.shape != (count, dimension):
            raise AssertionError(f"v{version} partition {part}: shape {embeddings.shape}, expected ({count}, {dimension})")
        if not state or "sum" not in state["state"][0]:
            raise AssertionError(f"v{version} partition {part}: no optimizer state")
    params, optim_state, metadata = ckpt.load_model(version)
    if metadata.get("iteration/epoch_idx") != version - 1:
        raise AssertionError(f"v{version} model: iteration/epoch_idx = {metadata.get('iteration/epoch_idx')}")
    if not params or optim_state is None:
        raise AssertionError(f"v{version} model: {len(params)} parameters, optimizer state {optim_state is not None}")
    return params


def check_finished(backend: Backend, passes: int, nparts: int) -> list[str]:
    """Problems with a finished round's checkpoint (empty when it is as it should be)."""
    problems = []
    ckpt = CheckpointStorage(backend.checkpoint_url)
    if ckpt.load_version() != passes:
        problems.append(f"final version {ckpt.load_version()} != {passes}")
    if ckpt.list_versions() != {passes}:
        problems.append(f"versions left in storage: {sorted(ckpt.list_versions())}")
    leftovers = [n for n in storage.listdir(backend.checkpoint_url) if n.startswith(".tmp-")]
    if leftovers:
        problems.append(f"temporary files left: {leftovers}")
    records = ckpt.load_stats()
    summaries = Counter(r["index"] for r in records if r.get("pass_summary"))
    if sorted(summaries) != list(range(passes)) or set(summaries.values()) != {1}:
        missing = sorted(set(range(passes)) - set(summaries))
        twice = sorted(i for i, n in summaries.items() if n > 1)
        problems.append(f"training_stats.json pass summaries: missing {missing}, repeated {twice}")
    buckets = Counter((r["epoch_idx"], r["lhs_partition"], r["rhs_partition"]) for r in records if "lhs_partition" in r)
    per_pass = Counter(epoch for epoch, _, _ in buckets)
    incomplete = sorted(e for e in range(passes) if per_pass.get(e, 0) != nparts * nparts)
    if incomplete or any(n != 1 for n in buckets.values()):
        problems.append(f"training_stats.json buckets: passes without all {nparts * nparts} buckets {incomplete[:10]}, "
                        f"repeated {sum(1 for n in buckets.values() if n > 1)}")
    return problems


# the loop -------------------------------------------------------------------------------------


@dataclass
class Tally:
    backend: str
    kills: int = 0
    rounds: int = 0
    unloadable: int = 0
    lost_commits: int = 0
    finish_problems: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    modes: Counter = field(default_factory=Counter)
    moments: Counter = field(default_factory=Counter)
    buckets_redone: int = 0
    buckets_trained: int = 0
    passes_committed: int = 0
    kills_with_progress: int = 0  # kills after which the committed version had moved on since the previous one
    self_finished_runs: int = 0
    swap_times: list = field(default_factory=list)
    seconds: float = 0.0

    def row(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "kills": self.kills, "rounds": self.rounds, "passes_committed": self.passes_committed,
            "unloadable_versions": self.unloadable, "lost_commits": self.lost_commits,
            "buckets_trained": self.buckets_trained, "buckets_redone": self.buckets_redone,
            "buckets_redone_per_kill": round(self.buckets_redone / self.kills, 2) if self.kills else 0.0,
            "kills_by_mode": dict(self.modes), "kill_moments": dict(self.moments),
            "kills_after_which_version_moved": self.kills_with_progress, "runs_that_finished_unkilled": self.self_finished_runs,
            "round_end_problems": self.finish_problems, "errors": self.errors, "seconds": round(self.seconds, 1),
            "median_swap_ms": round(1000 * sorted(self.swap_times)[len(self.swap_times) // 2], 1) if self.swap_times else None,
        }


def wait_kill_moment(mode: str, trainer: Trainer, backend: Backend, rng: random.Random, args: argparse.Namespace,
                     nparts: int) -> Optional[str]:
    """Wait until the moment chosen by ``mode``; None when the trainer exited first."""
    if mode == "uniform":
        deadline = trainer.started + rng.uniform(0.3, args.max_delay)
        while time.monotonic() < deadline:
            if not trainer.running():
                return None
            time.sleep(0.005)
        return mode
    if mode == "after-bucket":
        per_pass = nparts * nparts
        target = rng.randint(1, 2 * per_pass)
        if rng.random() < 1 / 3:
            # (the run resumes at a pass boundary) its first or second pass's last bucket: the commit follows
            target = per_pass * rng.randint(1, 2)
        delay = rng.uniform(0.0, 0.03)
        while len(trainer.buckets) < target:
            if not trainer.running():
                return None
            time.sleep(0.0005)
        time.sleep(max(0.0, trainer.buckets[target - 1][0] + delay - time.monotonic()))
        return mode
    # file-write: the j-th new checkpoint file this run writes (polled fast: small files take a few ms)
    target = rng.randint(1, 8)
    delay = rng.uniform(0.0, 0.01)
    seen: set[str] = set()
    while True:
        if not trainer.running():
            return None
        for name in backend.writes_in_flight(trainer.proc.pid, trainer.stale):
            if name not in seen:
                seen.add(name)
        if len(seen) >= target:
            break
        time.sleep(0.0005)
    time.sleep(delay)
    return mode


def run_backend(name: str, args: argparse.Namespace, graph: Path, work: Path, rng: random.Random,
                endpoint: Optional[str]) -> Tally:
    tally = Tally(name)
    started = time.monotonic()
    nparts = args.partitions
    counts = [int((graph / "data" / f"entity_count_node_{p}.txt").read_text()) for p in range(nparts)]
    tmpdir = work / f"{name}-tmp"
    tmpdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmpdir), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if endpoint is not None:
        env.update(AWS_TEST_ENV)
        # for the rest of this bench process: check_loadable reads the checkpoints through the storage layer
        _PROCESS_SCOPE.enter_context(storage.using(storage.StorageSettings(options={"endpoint_url": endpoint})))
        import s3fs

        bucket = f"fault-{uuid.uuid4().hex[:10]}"
        s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True).mkdir(bucket)
    while tally.kills < args.kills:
        tally.rounds += 1
        round_id = tally.rounds
        config = generated_config(graph, nparts, 1, args.dimension, f"{name}_{round_id}")
        config.update(num_epochs=args.passes, num_uniform_negs=20, num_batch_negs=20, seed=round_id,
                      bucket_order=args.bucket_order)
        if endpoint is not None:
            config["checkpoint_path"] = f"s3://{bucket}/round{round_id}/checkpoints"
            config["storage_options"] = {"endpoint_url": endpoint}
            backend = Backend(name, config["checkpoint_path"], tmpdir, None)
        else:
            backend = Backend(name, config["checkpoint_path"], tmpdir, Path(config["checkpoint_path"]))
        config_path = work / f"{name}_round{round_id}.json"
        config_path.write_text(json.dumps(config))
        log_path = work / f"{name}_round{round_id}.log"
        highest = 0  # the highest version ever seen committed in this round
        after_previous_kill = 0
        trained: Counter = Counter()  # (pass index, lhs, rhs) -> times a bucket finished
        while True:
            trainer = Trainer(config_path, log_path, env, frozenset(backend.writes_in_flight(-1)))
            mode = rng.choice(MODES)
            moment = wait_kill_moment(mode, trainer, backend, rng, args, nparts)
            # versions the running trainer committed count too: a later kill must not take them back
            marker = backend.read_marker()
            if moment is None:
                code = trainer.finish()
                tally.self_finished_runs += 1
                if code != 0:
                    tally.errors.append(f"round {round_id}: a trainer exited {code} by itself (see {log_path})")
            else:
                writes = backend.writes_in_flight(trainer.proc.pid, trainer.stale)
                labels = classify(writes, trainer, time.monotonic(), nparts)
                trainer.kill()
                tally.kills += 1
                tally.modes[mode] += 1
                for label in labels:
                    tally.moments[label] += 1
            for _, record in trainer.buckets:
                trained[(record["index"] // (nparts * nparts), record["lhs_partition"], record["rhs_partition"])] += 1
                if record.get("swap_time") is not None and record.get("index", 0) % (nparts * nparts):
                    tally.swap_times.append(float(record["swap_time"]))
            highest = max(highest, marker)
            try:
                version = check_loadable(backend.checkpoint_url, config, counts)
            except Exception as err:  # every failure to load is what this bench counts
                tally.unloadable += 1
                tally.errors.append(f"round {round_id} kill {tally.kills}: committed version does not load: "
                                    f"{type(err).__name__}: {err}")
                version = CheckpointStorage(backend.checkpoint_url).load_version()
            if version < highest:
                tally.lost_commits += 1
                tally.errors.append(f"round {round_id} kill {tally.kills}: version {version} < {highest} seen committed")
            if moment is not None:
                tally.kills_with_progress += version > after_previous_kill
                after_previous_kill = version
                print(f"[{name}] kill {tally.kills:3d} round {round_id} mode {mode:12s} after "
                      f"{time.monotonic() - trainer.started:5.2f} s, buckets this run {len(trainer.buckets):3d}, "
                      f"committed v{version}, at: {', '.join(labels)}", flush=True)
            highest = max(highest, version)
            if version >= args.passes or moment is None or tally.kills >= args.kills:
                break
        # round end: run to completion (or confirm the finished run has nothing left to do)
        final = Trainer(config_path, log_path, env)
        code = final.finish()
        for _, record in final.buckets:
            trained[(record["index"] // (nparts * nparts), record["lhs_partition"], record["rhs_partition"])] += 1
        if code != 0:
            tally.errors.append(f"round {round_id}: final run exited {code} (see {log_path})")
        try:
            if check_loadable(backend.checkpoint_url, config, counts) != args.passes:
                tally.finish_problems.append(f"round {round_id}: not finished")
        except Exception as err:
            tally.unloadable += 1
            tally.errors.append(f"round {round_id}: final version does not load: {type(err).__name__}: {err}")
        problems = check_finished(backend, args.passes, nparts)
        tally.finish_problems.extend(f"round {round_id}: {p}" for p in problems)
        tally.passes_committed += args.passes
        tally.buckets_trained += sum(trained.values())
        tally.buckets_redone += sum(n - 1 for n in trained.values() if n > 1)
        missing = args.passes * nparts * nparts - len(trained)
        if missing:
            tally.errors.append(f"round {round_id}: {missing} buckets never seen finishing in the logs")
        print(f"[{name}] round {round_id} done: v{args.passes}, {sum(trained.values())} buckets trained, "
              f"{sum(n - 1 for n in trained.values() if n > 1)} redone, problems: {problems or 'none'}", flush=True)
        if not args.keep:
            if endpoint is None:
                shutil.rmtree(config["checkpoint_path"], ignore_errors=True)
    tally.seconds = time.monotonic() - started
    return tally


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n| backend | kills | rounds (passes) | unloadable versions | lost commits | buckets trained | buckets redone "
          "(per kill) | kills during a partition file write/upload | during a model file write/upload | "
          "<30 ms after a bucket (swap) | <30 ms after a pass's last bucket (commit) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m = r["kill_moments"]
        print(f"| {r['backend']} | {r['kills']} | {r['rounds']} ({r['passes_committed']}) | {r['unloadable_versions']} | "
              f"{r['lost_commits']} | {r['buckets_trained']} | {r['buckets_redone']} ({r['buckets_redone_per_kill']}) | "
              f"{m.get('partition file write/upload', 0)} | {m.get('model file write/upload (commit)', 0)} | "
              f"{m.get('<30 ms after a bucket (partition swap)', 0)} | "
              f"{m.get(COMMIT_LABEL, 0)} |")
    for r in rows:
        print(f"{r['backend']}: kills by mode {r['kills_by_mode']}; moments {r['kill_moments']}; "
              f"median partition swap {r['median_swap_ms']} ms; {r['seconds']:.0f} s")
        for problem in r["round_end_problems"] + r["errors"]:
            print(f"  PROBLEM {r['backend']}: {problem}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=100, help="SIGKILLs per backend (default 100)")
    parser.add_argument("--backend", choices=("local", "s3", "both"), default="both")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--passes", type=int, default=12, help="passes (epochs) per round (default 12)")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--entities", type=int, default=100_000)
    parser.add_argument("--edges", type=int, default=48_000)
    parser.add_argument("--dimension", type=int, default=48)
    parser.add_argument("--bucket-order", default="affinity")
    parser.add_argument("--max-delay", type=float, default=6.0, help="uniform mode: latest kill, s after start")
    parser.add_argument("--work", default=None, help="scratch directory (default: a new temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints of finished rounds")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.partitions < 2:
        parser.error("--partitions must be >= 2 (partition swaps are the point)")

    work = Path(args.work or tempfile.mkdtemp(prefix="biggraph-fault-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    graph = work / "graph"
    shutil.rmtree(graph, ignore_errors=True)
    graph.mkdir(parents=True)
    write_generated_graph(graph, args.entities, args.edges, args.partitions, seed=args.seed)
    rng = random.Random(args.seed)
    backends = ["local", "s3"] if args.backend == "both" else [args.backend]
    rows = []
    for name in backends:
        moto: Optional[subprocess.Popen] = None
        endpoint = None
        if name == "s3":
            moto, endpoint = start_moto()
        try:
            rows.append(run_backend(name, args, graph, work, rng, endpoint).row())
        finally:
            if moto is not None:
                moto.terminate()
                moto.wait(timeout=30)
    print_table(rows)
    result = {"command": " ".join(sys.argv), "args": vars(args), "load_avg": os.getloadavg(), "backends": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    bad = sum(r["unloadable_versions"] + r["lost_commits"] + len(r["round_end_problems"]) + len(r["errors"]) for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
