"""``CheckpointManager``: the one owner of a checkpoint directory's life.

Everything that decides what a checkpoint directory holds goes through here, in one order:

- :meth:`open` (a writer's start): take the directory (:mod:`job.checkpoint.owner`: one writer at a time), finish
  the publication of a grow that committed (:mod:`job.checkpoint.journal`), read the committed version, then remove
  what killed runs left (temporary files, manifests and files of versions after the marker, versions before it, stats
  lines past it). In a torchrun group rank 0 does this while the others wait (the group is one writer).
- :meth:`write_model`, then :meth:`commit` (a writer's commit): the model file with the metadata of every provider,
  the pass's stats lines, then the version is checked complete (every partition of every entity type and the model
  are stored), made durable (files and directory fsynced where the storage has them), the ownership checked, the
  manifest and the marker written (the commit point), the directory fsynced again; then retention (a snapshot kept
  every ``checkpoint_preservation_interval`` epochs, the previous version dropped unless it is the best one).
- :meth:`record` and :meth:`keep_best` (validation during training, after a commit): the committed version's
  validation line appended to the stats, then ``best_version.txt`` made to name it when it scored best, and the
  previous best's files dropped. The best version's files stay in the directory beside the latest (no copy;
  PBG reads the latest and ignores them) until a better one replaces it; :meth:`open` keeps it too.
- :meth:`reader` (eval, export, archive, report): finish a committed grow, then open the committed version (or one
  kept in ``epoch_*/``, or the best one) through :func:`job.formats.committed.open_committed`;
  :meth:`version_named` turns ``best`` into the version ``best_version.txt`` names.

Partition files themselves are written during a pass by the partition store through :attr:`storage` (the
``CheckpointStorage`` of the format), with :meth:`metadata` as their metadata; only the commit makes them part of a
version. The storage protocol below (``CheckpointStorage``) knows files and formats, not policy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import numpy as np

import storage_adapters as storage
from job.checkpoint.group_progress import Progress
from job.checkpoint.journal import finish_committed_grow
from job.checkpoint.journal_checks import GrowInputs
from job.checkpoint.owner import Ownership, OwnerWatch, claim, unclaim, watch_owner
from job.checkpoint.recovery import recover_pass
from job.errors import CheckpointError
from job.formats.checkpoint import CheckpointStorage, SumRegistry
from job.formats.checkpoint_io import version_of
from job.formats.committed import Committed, open_committed
from job.types import PartitionKey

logger = logging.getLogger("biggraph")

MetadataProvider = Callable[[], dict[str, Any]]


class Group(Protocol):
    """What the manager needs of a torchrun group: who it is, a barrier, and where ranks share file records."""

    rank: int
    run_id: str  # the job the group trains for: the group is one writer (the owner record's run id)

    def barrier(self, name: str) -> None: ...

    def shared_sums(self) -> SumRegistry: ...


@dataclass(frozen=True)
class ModelState:
    """The shared parameters of a version: public name -> (private name, array), and their optimizer state."""

    params: dict[str, tuple[str, np.ndarray]]
    optimizer: Optional[dict[str, Any]]


class CheckpointManager:
    """Opens, commits and retires the versions of one checkpoint directory; see the module docstring."""

    def __init__(self, url: str, partitions: Sequence[PartitionKey], inputs: Optional[GrowInputs] = None,
                 take_over: bool = False, fence: Optional[Callable[[], None]] = None) -> None:
        self.storage = CheckpointStorage(url, guard=self._guard)
        self.url = self.storage.url
        self.partitions = list(partitions)
        # the config's entity_path / edge_paths: the only places a grow journal may touch (None: those the journal's
        # own config records)
        self.inputs = inputs
        self.take_over = take_over
        self.version = 0
        self.best: Optional[int] = None  # the version best_version.txt names (validation_edge_paths), kept
        self._owner: Optional[Ownership] = None
        self._watch: Optional[OwnerWatch] = None  # a rank other than 0: its group's record, read (``watch_owner``)
        self._providers: list[MetadataProvider] = []
        self._input_check: Optional[dict[str, Any]] = None  # a passing input check, written with the next commit
        # (rank 0) the group progress of the pass this run resumes, found at ``open`` (job/checkpoint/recovery.py)
        self.resumed: Optional[Progress] = None
        # a torchrun rank's round check (``DistributedContext.fence``): a rank whose group went on without it
        # raises instead of writing
        self._fence: Callable[[], None] = fence or (lambda: None)

    def _guard(self) -> None:
        self._fence()
        if self._owner is not None:
            self._owner.guard()
        if self._watch is not None:
            self._watch.guard()

    # metadata ------------------------------------------------------------------------------------
    def add_metadata_provider(self, provider: MetadataProvider) -> None:
        """``provider()`` is merged into the metadata of every file written after this call (later ones win)."""
        self._providers.append(provider)

    def metadata(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for provider in self._providers:
            merged.update(provider())
        return merged

    # opening -------------------------------------------------------------------------------------
    def open(self, group: Optional[Group] = None) -> int:
        """Take the directory and clean it for a run; returns the committed version.

        The files written after that version are kept only where they belong to a pass that this run resumes (its
        torchrun group's lock server persisted its progress: ``resumed``, job/checkpoint/recovery.py); otherwise
        they are garbage."""
        try:
            return self._open(group)
        except BaseException:
            self.close()  # a run refused or failing here leaves the directory as it found it (no owner record)
            raise

    def _open(self, group: Optional[Group]) -> int:
        rank = group.rank if group is not None else 0
        if rank == 0:
            self.storage.prepare()  # the directory made (on an object store: its bucket checked, named if missing)
            self._owner = claim(self.url, self.take_over, run_id=group.run_id if group is not None else None)
            finish_committed_grow(self.url, clean_uncommitted=True, inputs=self.inputs)
        if group is not None:
            group.barrier("prepared")
            if rank != 0:  # every writer checks the owner record before it writes, not rank 0 alone
                self._watch = watch_owner(self.url, group.run_id)
        version = self.storage.load_version()
        if group is not None:
            # a partition written by one rank is read by others: they verify it against the writer's record
            self.storage.sums = group.shared_sums()
        if rank == 0:
            self.resumed = recover_pass(self.url, version, group.run_id if group is not None else None,
                                        guard=self.storage.guard)  # round and owner first
            self._clean(version, keep_uncommitted=self.resumed is not None)
        if group is not None:
            group.barrier("cleaned")
        self.version = version
        self.best = self.storage.load_best()
        return version

    def _clean(self, version: int, keep_uncommitted: bool) -> None:
        for path in storage.remove_stale_upload_dirs():
            logger.info("removed %s (left by a trainer that was killed during an upload)", path)
        for name in storage.listdir(self.url):
            if name.startswith(".tmp-"):  # a killed writer's file under its temporary name: never part of a version
                storage.remove(storage.join(self.url, name))
        self.storage.drop_uncommitted_manifests(version)
        best = self.storage.load_best()
        if best is not None and (best > version or not self.storage.has_model(best)):
            logger.warning("%s names version %d, which is not in the directory (committed: %d): removed",
                           self.storage.best_file(), best, version)
            self.storage.remove_best()
            best = None
        # a kill between a commit and the clean-up after it leaves the previous version's files and, before the
        # marker, the stats lines of a version that never committed; the best version stays
        self.storage.drop_older(version, self.partitions, keep=best)
        self.storage.trim_stats(version)
        if not keep_uncommitted:
            self.storage.drop_uncommitted(version, self.partitions)

    # committing ----------------------------------------------------------------------------------
    def write_model(self, version: int, state: ModelState) -> None:
        self.storage.save_model(version, state.params, state.optimizer, self.metadata())

    def commit(self, version: int, stats: Sequence[dict[str, Any]] = (), snapshot_epoch: Optional[int] = None,
               drop_previous: bool = True) -> None:
        """Make ``version`` (whose files are written) the committed one; see the module docstring for the order."""
        if version <= self.version:
            raise CheckpointError(f"{self.url}: cannot commit version {version} over committed version {self.version}")
        self._guard()  # before the stats lines too: they go into the directory's one training_stats.json
        if stats:
            self.storage.append_stats(list(stats))
        self.storage.flush()
        self._check_complete(version)
        storage.sync_directory(self.url)  # the renames of the version's files, before the marker names them
        if self._owner is not None:
            self._owner.check()
        self.storage.save_version(version)  # manifest, then the marker: the commit point
        storage.sync_directory(self.url)
        previous, self.version = self.version, version
        if snapshot_epoch is not None:
            self.storage.preserve(version, snapshot_epoch, self.partitions)
        if drop_previous and previous > 0 and previous != self.best:
            self.storage.drop_version(previous, self.partitions)
        if self._input_check is not None:  # not part of any version: after the commit point
            self.storage.save_input_check(self._input_check)
            self._input_check = None

    def record(self, stats: Sequence[dict[str, Any]]) -> None:
        """Append stats lines about the committed version (its validation, scored after the commit)."""
        self._guard()
        self.storage.append_stats(list(stats))

    def input_check(self) -> Optional[dict[str, Any]]:
        """The last input check that passed for this directory's runs (``input_check.json``), as
        job/train/input_check.py recorded it: that module judges whether it still holds."""
        return self.storage.load_input_check()

    def record_input_check(self, record: dict[str, Any]) -> None:
        """Keep a passing input check for the next start of a writer here (a group formed again after a lost pod),
        written with the next commit: a run that commits nothing (refused later, say, on a damaged partition) leaves
        the directory as it found it."""
        self._input_check = record

    def keep_best(self, version: int) -> None:
        """Keep the committed ``version`` as the best one: ``best_version.txt`` names it first, then the previous
        best's files are dropped (a kill in between leaves files that :meth:`open` drops)."""
        if version != self.version:
            raise CheckpointError(f"{self.url}: only the committed version ({self.version}) can become the best one, "
                                  f"not {version}")
        previous, self.best = self.best, version
        self.storage.save_best(version)
        if previous is not None and previous not in (version, self.version):
            self.storage.drop_version(previous, self.partitions)

    def _check_complete(self, version: int) -> None:
        """Every partition of every entity type and the model are stored: a version that lacks one is never
        committed (a reader would otherwise start that partition afresh, or fail)."""
        present = {name for name in storage.listdir(self.url) if version_of(name, data_only=True) == version}
        wanted = [self.storage.partition_file(version, t, p) for t, p in self.partitions]
        wanted.append(self.storage.model_file(version))
        missing = [url for url in wanted if url.rsplit("/", 1)[-1] not in present]
        if missing:
            shown = ", ".join(u.rsplit("/", 1)[-1] for u in missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise CheckpointError(f"{self.url}: version {version} is incomplete ({len(missing)} files missing: {shown}); "
                                  f"not committed, version {self.version} stays the committed one")

    def forget_best(self) -> None:
        """A grow changed the entity set: a best version from before it has other entity counts and cannot be read
        with the grown config, so its pointer and its files go (validation keeps a new best from then on)."""
        if self.best is None:
            return
        best, self.best = self.best, None
        self.storage.remove_best()
        if best != self.version:
            self.storage.drop_version(best, self.partitions)

    # reading -------------------------------------------------------------------------------------
    @staticmethod
    def reader(url: str, version: Optional[int] = None, inputs: Optional[GrowInputs] = None) -> Committed:
        """The committed ``version`` (default: the latest) for a reader; a grow that committed but was stopped
        before publishing its input is finished first, so the reader sees the input that belongs to it (``inputs``:
        the reader's config's; without a config, the journal is held to the locations its own config records)."""
        committed = open_committed(url, version)  # first: its errors name the marker (nothing committed, no such
        finish_committed_grow(url, inputs=inputs)  # version, an endpoint that cannot be reached)
        return committed

    @staticmethod
    def version_named(url: str, name: str | int | None) -> Optional[int]:
        """A version a user named: a number, None (the latest), or ``best`` (the one best_version.txt names)."""
        if name is None or isinstance(name, int):
            return name
        if name != "best":
            raise CheckpointError(f"{url}: version '{name}' is neither a number nor 'best'")
        best = CheckpointStorage(url).load_best()
        if best is None:
            raise CheckpointError(f"{url}: no best version recorded (best_version.txt is written by training with "
                                  "validation_edge_paths)")
        return best

    # the end ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for uploads (raising the first error), stop their threads, and give the directory up."""
        try:
            self.storage.close()
        finally:
            if self._owner is not None:
                owner, self._owner = self._owner, None
                unclaim(owner)
