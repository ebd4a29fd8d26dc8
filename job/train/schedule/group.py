"""The bucket scheduler and the parameter sync of a torchrun group: the interfaces of job/train/schedule/interfaces.py (which
says what they are for, and how prefetch and pass results work in both modes) served by the lock server on rank 0.

- ``LockServerScheduler`` asks the lock server (job/train/distributed/lock_server.py) for one bucket at a time, reserves the
  next one early for prefetch, writes partitions back in write groups (job/checkpoint/write_groups.py), and ends a
  round by draining (finish the bucket, write back, then exit) or by giving a bucket up that cannot end before
  the drain deadline (job/train/schedule/clock.py); rank 0 also keeps every rank's bucket records (across a group
  restart) and commits.
- ``SharedSync``: relation parameters, global embeddings and unpartitioned tables pushed and pulled through the
  lock server at every bucket boundary (the request through the store, the vectors point-to-point with rank 0:
  job/train/distributed/transport.py); with dynamic relations a bucket pushes only the relation rows it changed and
  pulls only those its edges name (job/train/distributed/shared_rows.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Optional

import numpy as np

from job.checkpoint.group_progress import Progress, ProgressLog, remove_progress, resumable
from job.checkpoint.write_groups import WriteGroup, known_sums
from job.config import ConfigSchema
from job.formats.checkpoint import CheckpointStorage
from job.train.distributed.group import DistributedContext, RoundEnding, wait_all
from job.train.distributed.handoff import PartitionHandoff
from job.train.distributed.holders import Holders
from job.train.distributed.lock_client import LockClient
from job.train.distributed.lock_server import LockServer
from job.train.distributed.lock_state import LockState
from job.train.distributed.shard_routing import GroupShards, shardable
from job.train.distributed.shared_params import SharedParameters
from job.train.distributed.shared_rows import RowLayout
from job.train.elastic.budget import note_progress
from job.train.residency.budget import pinned_partitions
from job.train.residency.partitions import PartitionStore
from job.train.schedule.behind import BehindWrites, CutCounts
from job.train.schedule.clock import BucketClock
from job.train.schedule.interfaces import BucketScheduler, PassGather
from job.train.schedule.orders import all_buckets
from job.types import Bucket, PartitionKey

logger = logging.getLogger("biggraph")


def bucket_locks(config: ConfigSchema, nparts_lhs: int, nparts_rhs: int) -> dict[Bucket, frozenset]:
    """The partitioned (type, partition) keys each bucket locks."""
    out = {}
    for bucket in all_buckets(nparts_lhs, nparts_rhs):
        keys = set()
        for relation in config.relations:
            if config.entities[relation.lhs].num_partitions > 1:
                keys.add((relation.lhs, bucket.lhs))
            if config.entities[relation.rhs].num_partitions > 1:
                keys.add((relation.rhs, bucket.rhs))
        out[bucket] = frozenset(keys)
    return out


WRITER_TIMEOUT_S = 120.0  # a release takes milliseconds; a silent server means the group is being re-formed


class LockServerScheduler(BucketScheduler):
    """Buckets from the lock server on rank 0: the current one, and with ``prefetch_partitions`` the next one
    reserved early (see the module docstring)."""

    delays_hogwild = False

    def __init__(self, ctx: DistributedContext, config: ConfigSchema, store: PartitionStore,
                 checkpoint: CheckpointStorage, nparts: tuple[int, int], progress: Optional[Progress],
                 shared_values: Callable[[], np.ndarray], layout: Optional[RowLayout] = None) -> None:
        self.ctx = ctx
        self.config = config
        self.store = store
        self.checkpoint = checkpoint
        self.nparts = nparts
        self.progress = progress  # the interrupted pass's state, for the first pass after a restart
        self.shared_values = shared_values
        self.layout = layout  # which shared values are relation rows (sparse changes and pulls)
        self.commits = ctx.rank == 0
        self.bucket_keys = bucket_locks(config, *nparts)
        if ctx.transport is None:
            raise ValueError("a lock-server scheduler needs the group's tensor transport (init_distributed makes it)")
        self.transport = ctx.transport
        self.client = LockClient(ctx.store, ctx.rank, prefix=ctx.key("lock"), transport=self.transport)
        self.server: Optional[LockServer] = None
        self.current: Optional[Bucket] = None
        self.ahead: Optional[Bucket] = None  # the next bucket, reserved for this rank (prefetch_partitions)
        self.releases: list[Future[None]] = []  # background write groups (each frees its partitions once published)
        self._writer_client: Optional[LockClient] = None  # the background thread's own channel to the server
        # the shared parameters whose change since their last sync goes with the next ``next`` (``SharedSync``)
        self.carry: Optional[SharedParameters] = None
        self.pass_tag = ""  # names this pass's barriers and keys within the round (``ctx.key``)
        self.clock = BucketClock()  # this rank's bucket times: whether one in flight can end before the drain's deadline
        self._ending_since: Optional[float] = None  # when this rank first saw its round end (``_stop_due``)
        self._written_seen: Optional[int] = None  # partitions written this pass, at the first reply (progress)
        # partition_handoff: published partitions kept in memory for their next holder (job/train/distributed/handoff.py)
        self.handoff = store.peers = PartitionHandoff.of_group(ctx, config, store.capacity) \
            if config.partition_handoff else None
        self._holders: Optional[Holders] = None  # rank 0: the last committed pass's, still true of what it committed
        # write_behind_buckets: partitions handed on unwritten, stored at cuts of the group (job/train/schedule/behind.py)
        self.behind = BehindWrites(self.client, store, checkpoint, self.handoff) \
            if config.write_behind_buckets and self.handoff is not None else None
        # shared_shards: the relation rows other ranks serve go to them (job/train/distributed/shard_routing.py)
        self.shards = GroupShards(ctx, shardable(layout)) if config.shared_shards and ctx.world_size > 1 else None

    def start_pass(self, pass_index: int, seed_base: int, version: int) -> None:
        if self.pass_tag:  # this process saw a pass commit: the round made progress
            note_progress()
        self.pass_tag = str(pass_index)
        self._written_seen = None
        self.current = None
        self.ahead = None
        if self.handoff is not None:  # writes behind: the commit stored every row kept (or newer ones)
            self.handoff.new_pass(behind=self.behind is not None)
        if self.behind is not None:
            self.behind.counts = CutCounts()  # (this pass's, for its log line)
        if self.commits:
            state = LockState(*self.nparts, self.bucket_keys,
                              tree_init_order=self.config.distributed_tree_init_order and version == 0,
                              version=version + 1, world_size=self.ctx.world_size)
            shared = self.shared_values()
            progress = resumable(self.progress, version + 1, tuple(shared.shape))  # refused if the vector differs
            if progress is not None:
                if progress.shared is not None:
                    shared = progress.shared  # with the shared updates of every bucket done so far
                state.restore(progress.state)
                for record in progress.records:
                    state.apply(record)
                by_rank = state.forget_rank_locks()
                # what the records say each file made current holds: the commit reads none of them back
                known_sums(self.checkpoint, version + 1, progress.staged())
                logger.info(
                    "resuming pass %d: %d of %d buckets already done, %d to redo (by rank of the round that ended: "
                    "%s)", pass_index + 1, len(state.done), state.total, state.redone,
                    json.dumps({str(rank): count for rank, count in sorted(by_rank.items())}))
            self.progress = None
            # the pass's snapshot (for a resumed pass: the compaction of what it resumed), then a record per change
            log = ProgressLog(self.config.checkpoint_path, self.ctx.run_id, version + 1, fence=self.ctx.fence)
            log.start(state.to_json(), shared)
            self.server = LockServer(self.ctx.store, state, log, shared, seed_base, self.transport,
                                     prefix=self.ctx.key("lock"), ending=self.ctx.ending, lost=self.ctx.lost_ranks,
                                     world_size=self.ctx.world_size, layout=self.layout,
                                     write_behind=self.config.write_behind_buckets if self.behind else 0,
                                     shard_save=self.shards.saver(self.pass_tag) if self.shards else None)
            if self.server.cuts is not None and self.handoff is not None:  # an orderly end's window; memory_budget
                self.server.cuts.bound(window_s=self.ctx.drain_timeout_s, pinned_limit=pinned_partitions(
                    self.config, self.store.capacity))
                self.server.cuts.cadence(self.config.write_behind_seconds)  # seconds between cuts, if any
            self.server.holders.adopt(self._holders)  # partitions kept at the last commit: its files hold their rows
        wait_all(self.ctx, f"pass-start-{self.pass_tag}")
        if self.shards is not None:  # each shard starts from rank 0's vector, before anyone pushes to it
            self.shards.start_pass(self.pass_tag, self.client)
            wait_all(self.ctx, f"pass-shards-{self.pass_tag}")

    def next_bucket(self, finished: Optional[dict[str, Any]]) -> Optional[Bucket]:
        waits = 0
        while True:
            self.store.stats.blocked_seconds += self._settle_releases()
            carry, self.carry = self.carry, None
            # rank 0's server knows its own process's reasons (``DistributedContext.ending``); another rank tells it
            leaving = self.ctx.ending() if not self.commits else None
            if finished is not None:
                self.clock.finish(time.monotonic())
                note_progress()  # this round made progress (the failure budget: job/train/elastic/budget.py)
            held = self.store.resident_partitioned()
            change, rows = carry.outgoing() if carry is not None else (None, None)  # sparse: the rows it changed
            if rows is not None and change is not None and self.shards is not None:  # theirs acknowledged first
                change, rows = self.shards.rows.push(self.current, change, rows)
            kind, bucket, dirty, shared = self.client.finish_and_next(held, self.current, finished, change,
                                                                      leaving=leaving,
                                                                      rows=None if rows is None else rows.tolist())
            if self.handoff is not None and bucket is not None:
                self.handoff.hint(self.bucket_keys[bucket] - held, self.client.last_holders)
            if carry is not None:
                carry.taken(shared)
            self.current, finished = None, None
            self.store.set_written(dirty)
            if self._written_seen is not None and len(dirty) > self._written_seen:
                note_progress()  # others saved partitions in this round: it is productive, though this rank waits
            self._written_seen = len(dirty) if self._written_seen is None else max(self._written_seen, len(dirty))
            if kind == "done":
                return None
            if kind == "ending":
                self._end_round(str(self.client.last_why or "the round ends"))
            if kind == "cut" and self.behind is not None:  # every rank stores what it holds, then training goes on
                why = self.behind.cut(deadline=self._own_deadline)
                if why is not None:
                    self._end_round(why)
                if not self.behind.kept_reservation:  # (a cut taken in the background leaves it: its next bucket)
                    self.ahead = None
                continue
            if kind == "wait" or bucket is None:
                # give our partitions back so that nobody waits on us, then ask again
                self.store.stats.blocked_seconds += self._give_back()
                waits += 1
                time.sleep(min(0.05 * waits, 0.5))
                continue
            self.current = bucket
            self.ahead = None
            self._switch_to(bucket)
            self.clock.start(time.monotonic())
            return bucket

    def _switch_to(self, bucket: Bucket) -> None:
        """Let go of what ``bucket`` does not use: the partitions leaving and the ones kept are written as one
        group (``PartitionStore.write_group``, job/checkpoint/write_groups.py), so that the finished bucket is saved by
        one record of the server or not at all. With ``prefetch_partitions`` the group is written on the
        background thread, which commits it through the rank's second client (``_commit_group``), and the next
        bucket is reserved at once, naming the partitions leaving, so that the reservation weighs this rank's
        locks as they will be while it trains. The reserved bucket's partitions are read from the sources the
        server knows now plus the ones leaving (locked for this rank until published, so nobody else writes
        them; the same thread reads them after their group). Without it the group is written now (PBG's way)."""
        if self.behind is not None:  # written behind: released unwritten, rows kept (job/train/schedule/behind.py)
            started = time.perf_counter()
            self.behind.release(set(self.bucket_keys[bucket]))
            self.store.stats.blocked_seconds += time.perf_counter() - started
            if self.config.prefetch_partitions:
                self.ahead, dirty = self.client.reserve(())
                self.store.set_written(dirty)
                if self.handoff is not None and self.ahead is not None:
                    self.handoff.hint(self.bucket_keys[self.ahead] - self.store.resident_partitioned(),
                                      self.client.last_holders)
            return
        started = time.perf_counter()
        behind = self.config.prefetch_partitions
        client = self._writer() if behind else self.client
        leaving, pending = self.store.write_group(set(self.bucket_keys[bucket]),
                                                  lambda group: self._commit_group(client, group), behind)
        if pending is not None:
            self.releases.append(pending)
        self.store.stats.blocked_seconds += time.perf_counter() - started
        if behind:
            self.ahead, dirty = self.client.reserve(leaving)
            self.store.set_written(set(dirty) | set(leaving))
            if self.handoff is not None and self.ahead is not None:
                # (the leaving ones are this rank's own group's: ``_commit_group`` keeps them)
                self.handoff.hint(self.bucket_keys[self.ahead] - set(leaving), self.client.last_holders)

    def _writer(self) -> LockClient:
        """The rank's second client, for the background thread (its replies come on their own queue)."""
        if self._writer_client is None:
            # a bounded wait: a process leaving after a peer died joins this thread first, and a release
            # answered by no server must not hold that exit for the main client's 10 minutes
            self._writer_client = LockClient(self.ctx.store, self.ctx.rank, timeout_s=WRITER_TIMEOUT_S,
                                             channel="/writer", prefix=self.ctx.key("lock"))
        return self._writer_client

    def _commit_group(self, client: LockClient, group: WriteGroup) -> None:
        """Once the group's staged files are written: wait for their uploads, have the server record the group
        (one record: its buckets saved), move the files to their PBG names, then free the leaving ones' locks."""
        self.checkpoint.flush()
        client.written(group.keys, group.staged(self.checkpoint))  # with each file's size and CRC-32
        self.store.publish(group)
        # partition_handoff: the rows just published stay in memory for the partition's next holder
        kept = self.handoff.keep_group(group, self.store.steps) if self.handoff is not None else []
        client.release(group.leaving, written=False, kept=kept)

    def _settle_releases(self) -> float:
        """Wait for the background releases (normally long done: they had a bucket to finish), so that the
        server's record of written partitions is whole; a failed write raises here. Returns the seconds waited."""
        started = time.perf_counter()
        releases, self.releases = self.releases, []
        for release in releases:
            release.result()
        return time.perf_counter() - started

    def upcoming(self) -> tuple[Sequence[Bucket], Sequence[set[PartitionKey]]]:
        if self.ahead is None:
            return (), ()
        return (self.ahead,), (set(self.bucket_keys[self.ahead]),)

    def release(self, keys: list[PartitionKey]) -> None:
        """Give back tables the buffer wrote out on its own (an unpartitioned type no bucket uses: partitioned ones
        leave in write groups, ``_switch_to``) once their files are stored: on object stores uploads run in the
        background, and the next holder must read what was written, not an older file or none."""
        self.checkpoint.flush()
        self.client.release(keys)

    def end_buckets(self) -> None:
        """After the last bucket: write back and release every partition (this rank's share of the commit)."""
        self.store.stats.commit_seconds += self._give_back()

    def _give_back(self) -> float:
        """Write back (as one group) and release every partition this rank holds; returns the seconds it took."""
        started = time.perf_counter()
        self._settle_releases()
        if self.behind is not None:
            self.behind.release(set())
        else:
            self.store.write_group(set(), lambda group: self._commit_group(self.client, group), behind=False)
        return time.perf_counter() - started

    def _end_round(self, why: str) -> None:
        """The round ends (a peer lost, a SIGTERM) and this rank's bucket is finished (the server recorded it done):
        give back what it holds exactly as at a pass's end (one write group, its ``written`` record, the moves, the
        release), so that only the lost rank's buckets are redone; on rank 0 keep serving until every live rank has
        given back or the drain deadline passes; then raise :class:`RoundEnding` (exit non-zero: torchrun starts
        this worker into the next round). A partly trained bucket is never written (its partitions would hold
        part of its update): this runs only between buckets."""
        logger.warning("rank %d: the round ends (%s): giving back what this rank holds, then exiting",
                       self.ctx.rank, why)
        if self.behind is None:
            self.store.stats.commit_seconds += self._give_back()
        else:  # written behind: nothing since the last cut can be saved now; the locks go back unwritten
            self.behind.give_up()
        self._drain()
        raise RoundEnding(f"rank {self.ctx.rank}: the round ended ({why}) and this rank gave back what it held; "
                          "exiting so that torchrun re-forms the group")

    def _own_deadline(self) -> Optional[float]:
        """This process's drain deadline (monotonic) once it was asked to stop (its SIGTERM; on rank 0 also a peer
        lost), counted from when it first saw that; None while it stands."""
        if self.ctx.ending() is None:
            return None
        if self._ending_since is None:
            self._ending_since = time.monotonic()
        return self._ending_since + self.ctx.drain_timeout_s

    def stop_check(self) -> Optional[Callable[[], bool]]:
        return self._stop_due

    def _round_ending(self) -> Optional[str]:
        """Why this round ends as this process knows it: on rank 0 its server's view (its own process's reasons and
        another rank's word that it leaves), elsewhere this process's own (its SIGTERM); None while it stands."""
        return self.server.round_ending() if self.server is not None else self.ctx.ending()

    def _stop_due(self) -> bool:
        """Whether to give up the bucket in training: its round ends (as this process knows: a SIGTERM, and on
        rank 0 a peer lost, or another rank's word that it leaves) and it cannot end by the drain's deadline, counted
        from when this rank first saw the end (job/train/schedule/clock.py). Cheap while the round stands: polled
        between batches."""
        if self._round_ending() is None:
            return False
        now = time.monotonic()
        if self._ending_since is None:
            self._ending_since = now
        return not self.clock.ends_by(self._ending_since + self.ctx.drain_timeout_s, now)

    def abandon(self, why: str) -> None:
        """The bucket in training was given up (its round ends and it could not end in time): its partitions hold
        part of its update, so they are not written. Wait for the write groups already on their way (the buckets
        done before it), tell the server the bucket is not finished and that this rank gave up (so that rank 0 does
        not wait for it: a bucket done before it whose rows were still only in memory, no partition having left at
        the switch, is redone with it, as after a kill), and hand its locks back unwritten (the next holder reads
        the files as they were before it); on rank 0 serve the others' give-back as at any round's end; then raise
        :class:`RoundEnding`."""
        bucket, self.current = self.current, None
        self.clock.drop()
        self.carry = None  # its shared-parameter change is part of the given-up update
        ending = self._round_ending() or why
        logger.warning("rank %d: the round ends (%s) and bucket %s cannot finish before the drain deadline: given "
                       "up (%s), its partitions not written", self.ctx.rank, ending, bucket, why)
        try:
            self._settle_releases()
        except Exception as err:  # noqa: BLE001 - the round ends anyway: those buckets are redone
            logger.warning("rank %d: a write group in flight failed while giving up (%s)", self.ctx.rank, err)
        try:
            # ``next`` finishing nothing: the server ends the bucket in flight undone (redone by the next round)
            self.client.finish_and_next(set(), None, None, None, leaving=ending, gave_up=True)
            if bucket is not None:
                self.client.release(sorted(self.bucket_keys[bucket]), written=False)
        except Exception as err:  # noqa: BLE001 - rank 0 gone already: the next round redoes the bucket anyway
            logger.warning("rank %d: could not hand the given-up bucket back (%s)", self.ctx.rank, err)
        self._drain()
        raise RoundEnding(f"rank {self.ctx.rank}: the round ended and its bucket in flight was given up; exiting so "
                          "that torchrun re-forms the group")

    def _drain(self) -> None:
        """Rank 0: serve on until every live rank has given back (``LockServer.settled``) or the drain deadline
        (``DistributedContext.drain_timeout_s``) passes, not waiting for a rank whose bucket cannot end by then;
        a rank that does not make it is redone, as before."""
        if self.server is None:
            return
        deadline = time.monotonic() + self.ctx.drain_timeout_s
        while not self.server.settled(deadline):
            if time.monotonic() > deadline:
                logger.warning("rank 0: not every live rank gave back within %.0f s; their buckets will be redone",
                               self.ctx.drain_timeout_s)
                break
            time.sleep(0.05)
        else:
            logger.info("rank 0: every live rank gave back what it held")
        # its threads out of the store's client before the process exits (one inside it aborts the process)
        self.server.stop()
        self.server = None

    def gather(self, own_io: dict[str, Any]) -> Optional[PassGather]:
        if self.handoff is not None:
            logger.info("rank %d: partition hand-off this pass: %s", self.ctx.rank, json.dumps(
                {**self.handoff.stats.as_record(), **(self.behind.counts.as_record() if self.behind else {}),
                 **({"shard_bytes": self.shards.bytes_through()} if self.shards is not None else {}),
                 "shared_link_bytes": self.transport.bytes_sent + self.transport.bytes_received + (
                     self.shards.bytes_through() if self.shards is not None else 0)}))
        self.ctx.store.set(self.ctx.key(f"pass-io/{self.pass_tag}/{self.ctx.rank}"), json.dumps(own_io))
        try:
            wait_all(self.ctx, f"pass-written-{self.pass_tag}")
        except RoundEnding:  # this rank gave back already (``end_buckets``); rank 0 lets the others do the same
            self._drain()
            raise
        if self.server is None:
            return None
        self.store.set_written(self.server.state.dirty)
        records = self.server.take_records()
        others = [json.loads(self.ctx.store.get(self.ctx.key(f"pass-io/{self.pass_tag}/{rank}")))
                  for rank in range(1, self.ctx.world_size)]
        self.server.stop()
        stats = self.server.stats()
        logger.info("lock server: %d requests served in %.2f s of its thread (%.2f s of CPU); its committer %.2f s "
                    "(%.2f s of CPU, %.2f s writing %d progress objects); requests by kind %s",
                    sum(op["count"] for op in stats["ops"].values()), stats["busy_s"], stats["cpu_s"],
                    stats["committer"]["busy_s"], stats["committer"]["cpu_s"], stats["progress_s"], stats["appends"],
                    json.dumps({name: op["count"] for name, op in sorted(stats["ops"].items())}))
        return PassGather(records=records, others_io=others, world_size=self.ctx.world_size,
                          restart_count=self.ctx.restart_count, buckets_redone=self.server.state.redone)

    def publish(self, result: dict[str, Any]) -> dict[str, Any]:
        """Rank 0 (which committed) stores its pass result before the barrier; every rank reads that one."""
        key = self.ctx.key(f"pass-result/{self.pass_tag}")
        if self.server is not None:
            remove_progress(self.config.checkpoint_path)  # the compaction at the commit: nothing left to resume
            self.ctx.store.set(key, json.dumps(result))
            self._holders, self.server = self.server.holders, None
        wait_all(self.ctx, f"pass-committed-{self.pass_tag}")
        published: dict[str, Any] = json.loads(self.ctx.store.get(key))
        return published
