"""The chart's Indexed Job in a cluster in a box (tests/cluster_box.py): pods in network namespaces, started with
what ``helm template`` renders, replaced when they die, added and removed when ``replicas`` changes.

Each test ends with the Job complete (every index's pod exited 0), the committed checkpoint at the final version
and loadable, and every bucket of every epoch trained. What each event cost (from the event to a bucket finished
by the group formed after it; buckets redone) is printed (``-s``) and recorded in docs/kubernetes.md.

Run: ``.venv/bin/python -m pytest -m slow tests/test_cluster_box.py -s`` (root, iproute2)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cluster_box import ClusterBox, RenderedJob, available
from helpers_distributed import buckets_per_epoch
from helpers_graphs import write_cycle_graph
from test_chart import render

from job.train.schedule.orders import all_buckets

needs_box = pytest.mark.skipif(available() is not None, reason=str(available()))

PARTITIONS = 4
BUCKETS = PARTITIONS * PARTITIONS
JOINED = re.compile(r"joined round (\w+)")


class Run:
    """A box training a tiny graph (200 entities, 400 edges, P=4) and what the test watches of it."""

    def __init__(self, box: ClusterBox, config: dict[str, Any]) -> None:
        self.box = box
        self.config = config
        self.checkpoint = config["checkpoint_path"]
        self.epochs = int(config["num_epochs"])
        self.costs: list[dict[str, Any]] = []

    def trained(self) -> tuple[int, int]:
        """(committed version, buckets done of the pass after it)."""
        from job.checkpoint.group_progress import current_state
        from job.formats.checkpoint import CheckpointStorage

        version = CheckpointStorage(self.checkpoint).load_version()
        try:
            state = current_state(self.checkpoint) or {}
        except Exception:  # caught between a compaction's writes; the next look sees it whole
            return version, 0
        done = len(state.get("done") or []) if state.get("version") == version + 1 else 0
        return version, done

    def until(self, what: str, predicate: Callable[[], bool], timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert self.box.failed_reason is None, f"{what}: the Job failed: {self.box.failed_reason}\n{self.box.tail()}"
            assert not self.box.complete, f"{what}: the Job completed first; give it more epochs"
            assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s\n{self.box.tail()}"
            time.sleep(0.02)

    def mid_pass(self, min_version: int) -> int:
        """Wait until a pass after committed version >= ``min_version`` has finished buckets; its committed version."""
        def ready() -> bool:
            version, done = self.trained()
            return version >= min_version and 0 < done < BUCKETS

        self.until(f"a pass after version {min_version} under way", ready)
        version = self.trained()[0]
        assert version < self.epochs - 2, "too close to the end; give it more epochs"
        return version

    def rounds(self) -> set[str]:
        return set(JOINED.findall(self.box.logs()))

    def recovered(self, label: str, since: float, rounds_before: set[str], world: int) -> None:
        """Wait until a group formed after the event (a round not in ``rounds_before``, of ``world`` ranks) has
        finished a bucket; record the time from ``since`` (the event)."""
        joined: dict[str, int] = {}

        def formed() -> bool:
            joined.clear()
            for round_id in JOINED.findall(self.box.logs()):
                if round_id not in rounds_before:
                    joined[round_id] = joined.get(round_id, 0) + 1
            return any(count >= world for count in joined.values())

        self.until(f"{label}: a group of {world} formed", formed)
        formed_at = time.monotonic()
        before = self.trained()
        self.until(f"{label}: training again", lambda: self.trained() != before)
        self.costs.append({"event": label, "to_new_group_s": round(formed_at - since, 1),
                           "to_training_s": round(time.monotonic() - since, 1)})

    def finish(self, timeout_s: float = 600.0) -> list[dict[str, Any]]:
        """The Job completes; the checkpoint is at the last version, loadable, every bucket of every epoch trained.
        Returns the pass summaries."""
        from job.checkpoint.manager import CheckpointManager
        from job.formats.checkpoint import CheckpointStorage

        self.box.wait(timeout_s)
        storage = CheckpointStorage(self.checkpoint)
        assert storage.load_version() == self.epochs
        committed = CheckpointManager.reader(self.checkpoint)
        assert committed.version == self.epochs
        model = committed.checkpoint.load_model(committed.version)
        assert model[0], "no model parameters"
        for part in range(PARTITIONS):
            embeddings, _ = committed.checkpoint.load_entity_partition(committed.version, "node", part)
            assert embeddings.shape[0] > 0 and np.isfinite(embeddings).all()
        records = storage.load_stats()
        summaries = [r for r in records if r.get("pass_summary")]
        assert [s["checkpoint_version"] for s in summaries] == list(range(1, self.epochs + 1))
        per_epoch = buckets_per_epoch(records)
        assert sorted(per_epoch) == list(range(self.epochs))
        for epoch, buckets in per_epoch.items():
            assert set(buckets) == set(all_buckets(PARTITIONS, PARTITIONS)), epoch
        redone = sum(s["buckets_redone"] for s in summaries)
        extra = sum(len(b) - BUCKETS for b in per_epoch.values())
        assert extra == 0, f"{extra} bucket records beyond one per bucket and epoch: a redone bucket's line kept"
        print(f"\n{self.box.job.name}: costs {self.costs}; buckets_redone {redone}, bucket records beyond one per "
              f"bucket and epoch {extra}; world sizes {[s['world_size'] for s in summaries]}")
        return summaries


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    """Builds boxes; each is torn down (processes, namespaces, links, hosts files) however the test ends."""
    boxes: list[ClusterBox] = []

    def make(replicas: int, min_replicas: int, epochs: int, initial: int | None = None,
             env: dict[str, str] | None = None) -> Run:
        root = tmp_path / f"box{len(boxes)}"
        config = write_cycle_graph(root / "graph", num_entities=200, num_partitions=PARTITIONS, num_relations=2,
                                   num_epochs=epochs, dimension=8)
        docs = render(root, release="box", extra={
            "replicas": replicas, "elastic": {"minReplicas": min_replicas}, "config": config,
            "torchrun": {"maxRestarts": 10, "rdzvConf": {"join_timeout": 120}},
        })
        # the image's prebuilt row kernels: one cache for every pod, built by the first
        box = ClusterBox(RenderedJob.from_docs(docs), root / "box", max_replicas=replicas, initial=initial,
                         extra_env={"BIGGRAPH_NATIVE_CACHE": str(tmp_path / "native"), **(env or {})})
        boxes.append(box)
        box.start()
        return Run(box, config)

    yield make
    errors = []
    for box in boxes:
        try:
            box.close()
        except Exception as err:
            errors.append(err)
    assert not errors, errors


@pytest.mark.slow
@needs_box
def test_a_replaced_pod_rejoins_and_the_job_completes(cluster: Callable[..., Run]) -> None:
    run = cluster(replicas=3, min_replicas=2, epochs=30)
    run.mid_pass(1)
    rounds = run.rounds()
    killed_at = time.monotonic()
    run.box.kill(2)
    run.recovered("pod 2 killed", killed_at, rounds, world=2)  # the survivors, or already with the replacement
    run.until("the replacement in the group", lambda: _in_group(run, 3, rounds))
    summaries = run.finish()
    assert summaries[-1]["world_size"] == 3  # the replacement trained in the group
    assert run.box.incarnations[2] == 2 and run.box.failures == {2: 1}
    # rank 0 found the killed pod through its liveness connection, dialled across the pods' network namespaces at
    # the address the pod reaches rank 0's store at (job/train/distributed/liveness.py); no pod failed to connect
    logs = run.box.logs()
    assert "liveness connection to rank 0 closed without a goodbye" in logs, run.box.tail()
    assert "cannot connect to rank 0's liveness listener" not in logs


def _in_group(run: Run, world: int, before: set[str]) -> bool:
    """A round of ``world`` ranks, not one of ``before``, that every rank joined ('rank r of n joined round')."""
    text = run.box.logs()
    counts: dict[str, set[str]] = {}
    for rank, size, round_id in re.findall(r"rank (\d+) of (\d+) joined round (\w+)", text):
        if int(size) == world and round_id not in before:
            counts.setdefault(round_id, set()).add(rank)
    return any(len(ranks) == world for ranks in counts.values())


@pytest.mark.slow
@needs_box
def test_scale_2_to_4_to_3_mid_pass(cluster: Callable[..., Run]) -> None:
    """Rendered with replicas 4 (``--nnodes=2:4``), started at 2 (the Job patched down), scaled to 4 mid-pass, then
    to 3 mid-pass: the torchrun maximum is the rendered ``replicas``, a Job's pod template cannot change."""
    run = cluster(replicas=4, min_replicas=2, epochs=40, initial=2)
    run.mid_pass(1)
    rounds = run.rounds()
    at = time.monotonic()
    run.box.scale(4)
    run.until("a group of 4", lambda: _in_group(run, 4, rounds))
    run.recovered("scale 2->4", at, rounds, world=4)
    run.mid_pass(run.trained()[0] + 1)  # a pass committed by the four
    rounds = run.rounds()
    at = time.monotonic()
    run.box.scale(3)
    run.recovered("scale 4->3", at, rounds, world=3)
    summaries = run.finish()
    sizes = [s["world_size"] for s in summaries]
    assert 2 in sizes and 4 in sizes and sizes[-1] == 3, sizes
    assert run.box.failures == {}, run.box.failures  # a scale change fails no pod
    # the deleted pod's agent says in one line why it stopped, with the signal's exit code: no traceback
    deleted = (run.box.root / "logs" / f"{run.box.hostname(3)}-0.log").read_text(errors="replace")
    assert "agent: stopped by SIGTERM, workers stopped (exit code 143)" in deleted, deleted[-3000:]
    assert "Traceback" not in deleted, deleted[-3000:]


@pytest.mark.slow
@needs_box
def test_the_rendezvous_host_pod_killed_and_replaced(cluster: Callable[..., Run]) -> None:
    """Index 0 hosts torchrun's c10d store: every agent exits when it dies, the Job replaces every pod, and the new
    pods resume the pass from the lock server's progress (same Job uid: same run)."""
    run = cluster(replicas=3, min_replicas=2, epochs=30)
    run.mid_pass(1)
    rounds = run.rounds()
    at = time.monotonic()
    run.box.kill(0)
    run.recovered("pod 0 killed", at, rounds, world=3)
    summaries = run.finish()
    assert summaries[-1]["world_size"] == 3
    assert run.box.failures.get(0) == 1
    assert "resuming pass" in run.box.logs()


@pytest.mark.slow
@needs_box
def test_a_pod_frozen_past_the_heartbeat_timeout_then_resumed(cluster: Callable[..., Run]) -> None:
    """SIGSTOP of a pod (not the store host) past rank 0's peer timeout: the others re-form without it and train;
    thawed, it finds its group gone, and its pod rejoins (or is replaced) and the Job completes."""
    run = cluster(replicas=3, min_replicas=2, epochs=40)
    run.mid_pass(1)
    rounds = run.rounds()
    at = time.monotonic()
    run.box.freeze(2)
    run.recovered("pod 2 frozen", at, rounds, world=2)
    rounds = run.rounds()
    at = time.monotonic()
    run.box.thaw(2)
    run.until("the thawed pod back in a group of 3", lambda: _in_group(run, 3, rounds))
    run.recovered("pod 2 thawed", at, rounds, world=3)
    summaries = run.finish()
    assert summaries[-1]["world_size"] == 3


@pytest.mark.slow
@needs_box
def test_a_pod_added_after_the_rendezvous_host_was_frozen_joins_the_group(cluster: Callable[..., Run]) -> None:
    """Index 0 runs torchrun's c10d store and rank 0: frozen for 15 s (past the 6 s peer timeout) and thawed, then
    the Job scaled up: the added pod is admitted into a group of 3 and the Job completes (a chaos pilot once saw an
    added pod wait 300 s after such a freeze)."""
    run = cluster(replicas=3, min_replicas=2, epochs=200, initial=2)
    run.mid_pass(1)
    rounds = run.rounds()
    run.box.freeze(0)
    time.sleep(15)
    run.box.thaw(0)
    at = time.monotonic()
    run.box.scale(3)
    run.until("the added pod in a group of 3", lambda: _in_group(run, 3, rounds))
    run.recovered("pod 0 frozen 15 s, then scale 2->3", at, rounds, world=3)
    summaries = run.finish()
    assert summaries[-1]["world_size"] == 3


@pytest.mark.slow
@needs_box
@pytest.mark.parametrize("hold_at", ["train", "write"])
def test_a_pod_frozen_between_training_a_bucket_and_writing_it_back(cluster: Callable[..., Run], tmp_path: Path,
                                                                     hold_at: str) -> None:
    """The dangerous moments of a stall: pod 2's trainer has trained a bucket (its rows in memory, not yet written
    back; ``train``) or is about to write a partition back (``write``) when the pod is frozen. The others re-form
    without it, redo what it held and commit the pass. Thawed then, the stale trainer must not write its rows over
    the committed version's partition files: it finds its round over (``RoundOver``: its store is gone, rank 0
    declared it dead) before it writes, or its next lock-server request fails first."""
    hold = tmp_path / "hold"
    run = cluster(replicas=3, min_replicas=2, epochs=40, env={
        "BIGGRAPH_BOX_HOLD_FILE": str(hold), "BIGGRAPH_BOX_HOLD_INDEX": "2", "BIGGRAPH_BOX_HOLD_AT": hold_at,
        "PYTHONPATH": f"{Path(__file__).parent / 'box_hooks'}:{Path(__file__).parent.parent}"})
    run.mid_pass(1)
    hold.touch()
    run.until("pod 2 holding a trained bucket", (tmp_path / "hold.held").exists)
    run.box.freeze(2)
    hold.unlink()  # the stopped trainer goes on to its write-back the moment it is thawed
    frozen_in = run.trained()[0] + 1  # the pass whose bucket the frozen trainer holds
    rounds = run.rounds()
    at = time.monotonic()
    run.recovered("pod 2 frozen holding a bucket", at, rounds, world=2)
    run.until(f"pass {frozen_in} committed without pod 2", lambda: run.trained()[0] >= frozen_in)
    committed = run.trained()[0]
    run.box.thaw(2)
    # thawed, the stale trainer either runs into its fence first (it exits 1), or its agent, dropped from the
    # rendezvous while frozen, stops it to rejoin (job/train/elastic/agent.py: SIGTERM from torchrun, before it writes)
    run.until("the thawed trainer gone", lambda: _stale_trainer_gone(
        (run.box.root / "logs" / "box-biggraph-2-0.log").read_text(errors="replace")))
    summaries = run.finish()
    log = (run.box.root / "logs" / "box-biggraph-2-0.log").read_text(errors="replace")
    print(f"committed at the thaw: {committed}; the thawed trainer's last words:\n"
          + "\n".join(line for line in log.splitlines() if "Error" in line or "round" in line)[-3000:])
    assert summaries[-1]["world_size"] == 3
    # nothing written by the stale trainer survives as a file of an older version (had it written after the others
    # retired that version) or as a damaged file of the committed one (read back above against the checksums)
    left = sorted(p.name for p in Path(run.checkpoint).iterdir() if re.search(r"\.v\d+\.", p.name)
                  and f".v{run.epochs}." not in p.name)
    assert not left, left
    if hold_at == "write" and not _stopped_by_its_agent(log):
        # its write-back was fenced off (before the fence: a committed file overwritten, "damaged")
        assert "of the group is over" in log, log[-3000:]


def _stopped_by_its_agent(log: str) -> bool:
    """The thawed pod's agent stopped its workers to rejoin: dropped from the rendezvous (job/train/elastic/agent.py's
    readmission), or seeing the others form a round without it (torchrun's nodes waiting)."""
    return "closing signal SIGTERM" in log and ("dropped from the rendezvous" in log or "waiting to join" in log)


def _stale_trainer_gone(log: str) -> bool:
    """The thawed trainer ended: fenced (exit 1), its round found over (75/76: it exits to rejoin; nothing it held is
    written once the round is over, which the test's checks of the files hold), or stopped by its agent."""
    return any(f"exitcode: {code}" in log for code in (1, 75, 76)) or _stopped_by_its_agent(log)


@pytest.mark.slow
@needs_box
@pytest.mark.parametrize("back", ["thawed", "replaced"])
def test_a_pod_back_after_the_others_finished_exits_0_and_the_job_completes(cluster: Callable[..., Run],
                                                                            back: str) -> None:
    """Pod 2 frozen mid-run; the others train on without it to the last epoch and exit 0, the rendezvous host (index
    0) with them. Then pod 2 comes back: thawed (its agent fails to rendezvous, and asked again, the entrypoint finds
    training complete) or, killed, replaced by a fresh pod (the entrypoint finds it complete before torchrun). Either
    way its index exits 0 and the Job completes, instead of the index running out of retries."""
    run = cluster(replicas=3, min_replicas=2, epochs=8)
    run.mid_pass(1)
    rounds = run.rounds()
    at = time.monotonic()
    run.box.freeze(2)
    run.recovered("pod 2 frozen", at, rounds, world=2)
    run.until("the other pods finished", lambda: run.box.succeeded == {0, 1}, timeout_s=600)
    assert run.trained()[0] == run.epochs
    at = time.monotonic()
    if back == "thawed":
        run.box.thaw(2)
    else:
        run.box.kill(2)
    summaries = run.finish()
    print(f"pod 2 {back}: its index complete after {time.monotonic() - at:.1f} s")
    assert summaries[-1]["world_size"] == 2
    last = run.box.root / "logs" / f"box-biggraph-2-{run.box.incarnations[2] - 1}.log"
    said = [line for line in last.read_text(errors="replace").splitlines() if "reason=complete" in line]
    assert len(said) == 1 and f"checkpoint version {run.epochs} in " in said[0], last.read_text()[-3000:]
    if back == "thawed":
        assert "(after torchrun exited" in said[0] and run.box.failures == {}, run.box.failures
    else:
        assert "(start)" in said[0] and run.box.failures == {2: 1}, run.box.failures
        lines = last.read_text(errors="replace").splitlines()
        # the fresh pod's whole log: the entrypoint's start line, the preflight's, the one line saying why it exits
        assert all(line.startswith("preflight:") or "biggraph-entrypoint:" in line for line in lines), lines


@needs_box
def test_the_box_runs_pods_as_the_job_controller_does(tmp_path: Path) -> None:
    """The supervisor alone, with a pod that prints what it sees and sleeps: its hostname and the Service's names,
    its env; a killed pod replaced at the same address; a frozen pod's processes stopped; scale; all torn down."""
    import os
    import signal
    import subprocess

    script = ('echo "host=$(hostname) idx=$JOB_COMPLETION_INDEX pod=$POD_NAME uid=$BIGGRAPH_RUN_ID"; '
              'getent hosts job-0.svc job-1.svc.default.svc.cluster.local; exec sleep 600')
    job = RenderedJob("job", "svc", ["/bin/sh", "-c", script], [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "BIGGRAPH_RUN_ID", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.labels['batch.kubernetes.io/controller-uid']"}}},
        {"name": "HOME", "value": "/tmp"}], {"config.yaml": "{}"}, 2, "4Gi", ignores_disruptions=True)
    box = ClusterBox(job, tmp_path / "box", max_replicas=3, job_uid="uid-1", grace_period_s=2)
    try:
        box.start()
        logs = tmp_path / "box" / "logs"

        def until(what: str, predicate: Callable[[], bool]) -> None:
            deadline = time.monotonic() + 60
            while not predicate():
                assert time.monotonic() < deadline, what + "\n" + box.tail()
                time.sleep(0.05)

        until("both pods up", lambda: all("job-1.svc" in p.read_text() for p in logs.glob("*.log"))
              and len(list(logs.glob("*.log"))) == 2)
        first = (logs / "job-1-0.log").read_text()
        assert "host=job-1 idx=1 pod=job-1-0 uid=uid-1" in first
        assert f"{box.address(0)}  " in first and f"{box.address(1)}  " in first
        members = box.members(1)
        assert members and all(os.stat(f"/proc/{pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino
                               for pid in members)
        box.freeze(1)
        state = subprocess.run(["ps", "-o", "stat=", "-p", ",".join(map(str, box.members(1)))],
                               capture_output=True, text=True).stdout.split()
        assert state and all(s.startswith("T") for s in state), state
        box.thaw(1)
        box.kill(1)
        until("pod 1 replaced", lambda: (logs / "job-1-1.log").exists()
              and "host=job-1 idx=1 pod=job-1-1" in (logs / "job-1-1.log").read_text())
        assert box.failures == {1: 1} and box.incarnations[1] == 2
        box.kill(1, disruption=True)  # a lost node's pod (DisruptionTarget): replaced, not counted (the Ignore rule)
        until("pod 1 replaced again", lambda: (logs / "job-1-2.log").exists()
              and "host=job-1 idx=1 pod=job-1-2" in (logs / "job-1-2.log").read_text())
        assert box.failures == {1: 1} and box.incarnations[1] == 3
        box.scale(3)
        until("pod 2 added", lambda: (logs / "job-2-0.log").exists() and "idx=2" in (logs / "job-2-0.log").read_text())
        box.scale(1)
        assert not box.members(1) and not box.members(2)
        assert box.failures == {1: 1}  # deletions are not failures
        for pid in box.members(0):
            os.kill(pid, signal.SIGTERM)  # sleep ends: the pod exits 143, and is replaced
        until("pod 0 replaced", lambda: (logs / "job-0-1.log").exists())
        assert not box.complete
    finally:
        box.close()
    leftovers = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert box.tag not in leftovers
    assert not list(Path("/etc/netns").glob(f"{box.tag}*"))
    assert box.tag not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout


@needs_box
def test_a_pod_reaches_the_host_address_and_reads_its_secret(tmp_path: Path) -> None:
    """What a pod needs of a server outside the box (a fake S3 for the checkpoint: bench/chaos_bench.py): the host's
    address on the bridge, chosen before the box is built (``subnet``), answers; a ``secretKeyRef`` env entry (the
    chart's ``s3.existingSecret``) gets the value the box was given; ``running`` lists the pod."""
    import socket
    import threading

    from cluster_box import free_subnet

    subnet = free_subnet()
    script = ('echo "key=$AWS_ACCESS_KEY_ID"; exec python -c "import socket, sys, time\n'
              'for _ in range(200):\n'
              '    try:\n'
              '        s = socket.create_connection((sys.argv[1], int(sys.argv[2])), 2); break\n'
              '    except OSError: time.sleep(0.05)\n'
              'print(s.recv(100).decode(), flush=True); time.sleep(600)" "$HOST" "$PORT"')
    job = RenderedJob("job", "svc", ["/bin/sh", "-c", script], [
        {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {"name": "s3", "key": "AWS_ACCESS_KEY_ID"}}},
        {"name": "HOST", "value": f"{subnet}.1"}], {"config.yaml": "{}"}, 1, "4Gi")
    box = ClusterBox(job, tmp_path / "box", max_replicas=1, subnet=subnet, grace_period_s=2,
                     secrets={"s3": {"AWS_ACCESS_KEY_ID": "key-1"}})
    assert box.host_address == f"{subnet}.1" and box.address(0).startswith(subnet + ".")
    server = socket.socket()
    try:
        server.bind(("0.0.0.0", 0))
        server.listen(1)
        box.extra_env["PORT"] = str(server.getsockname()[1])
        box.start()
        accepted: list[str] = []

        def serve() -> None:
            conn, peer = server.accept()
            accepted.append(peer[0])
            conn.sendall(b"hello from the host")
            conn.close()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        thread.join(timeout=60)
        log = tmp_path / "box" / "logs" / "job-0-0.log"
        deadline = time.monotonic() + 30
        while "hello from the host" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        text = log.read_text()
        assert "key=key-1" in text and "hello from the host" in text, text
        assert accepted == [box.address(0)]  # the pod dialled from its own address, through the bridge
        assert box.running() == [0]
    finally:
        server.close()
        box.close()
    assert box.running() == []
