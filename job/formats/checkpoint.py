"""PBG's checkpoint format, on any storage URL.

Layout of ``checkpoint_path`` (identical to PBG 1.x, so each side reads the other's):

- ``embeddings_{type}_{part}.v{N}.h5``: dataset ``embeddings`` (count x dim, float32), optional
  ``optimizer/state_dict`` (a ``torch.save`` blob as a void-byte dataset), root attributes ``format_version`` = 1 plus
  metadata (``config/json``, ``iteration/*``).
- ``model.v{N}.h5``: group ``model`` with one dataset per shared parameter,
  ``model/relations/{idx}/operator/{side}/{param}`` and ``model/entities/{type}/global_embedding``, each with
  attribute ``state_dict_key`` (the private name in the model's state dict); optimizer blob and metadata as above.
- ``config.json``, ``training_stats.json`` (JSON lines) and, written last, ``checkpoint_version.txt``: the commit
  marker. A version is complete exactly when this file names it, so files of version N+1 may exist half-written
  without harm.
- ``epoch_{E}/``: preserved snapshots (checkpoint_preservation_interval).
- ``best_version.txt`` (biggraph's, only with ``validation_edge_paths``): the version that scored best on the
  validation edges; its files stay in the directory beside the latest version's (PBG reads the latest and ignores
  them).
- ``input_check.json`` (biggraph's): the last input check that passed, with the digest of the config it checked and
  the listing of the input it read (PBG ignores it).

Optimizer blobs are only ever read with ``torch.load(weights_only=True)``: a checkpoint directory is untrusted input.

How a version is committed on object stores and how every file is verified: docs/design/checkpoints.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import h5py
import numpy as np

import storage_adapters as storage
from job.errors import CheckpointError
from job.formats.checkpoint_io import (
    BEST_FILE,
    CONFIG_FILE,
    EMBEDDING_DATASET,
    FORMAT_VERSION,
    FORMAT_VERSION_ATTR,
    INPUT_CHECK_FILE,
    MANIFEST_RE,
    MODEL_GROUP,
    STATE_DICT_KEY_ATTR,
    STATS_FILE,
    VERSION_FILE,
    attr_value,
    check_version_attr,
    copy_file,
    open_for_reading,
    read_embeddings,
    read_model_params,
    read_optimizer,
    version_of,
    write_metadata,
    write_optimizer,
)
from job.formats.checksums import Manifest, build_manifest, checksum_file, read_manifest, write_manifest
from job.formats.optimizer_state import OPTIMIZER_DATASET, deserialize_optimizer_state, serialize_optimizer_state
from job.formats.redaction import redact_config_json, redact_secrets
from job.formats.stats import append_stats, load_stats, trim_stats
from job.formats.sums import Entry, SharedSumRegistry, SumRegistry
from job.formats.uploads import MAX_PENDING_UPLOADS, UPLOAD_THREADS, UploadQueue
from job.types import PartitionKey

# the names callers import from here (the format's pieces live in the modules above)
__all__ = [
    "BEST_FILE", "CONFIG_FILE", "EMBEDDING_DATASET", "FORMAT_VERSION", "FORMAT_VERSION_ATTR", "MAX_PENDING_UPLOADS",
    "MODEL_GROUP", "OPTIMIZER_DATASET", "STATE_DICT_KEY_ATTR", "STATS_FILE", "UPLOAD_THREADS", "VERSION_FILE",
    "CheckpointStorage", "Entry", "SharedSumRegistry", "SumRegistry", "deserialize_optimizer_state", "redact_config_json",
    "redact_secrets", "serialize_optimizer_state",
]

T = TypeVar("T")


class CheckpointStorage:
    """Reads and writes one checkpoint directory (local path or any URL)."""

    def __init__(self, url: str, guard: Callable[[], None] | None = None) -> None:
        self.url = url.rstrip("/") if url not in ("/",) else url
        # called before every file this object writes: the checkpoint manager's ownership check (a writer that
        # lost the directory to another run raises instead of writing over that run's files)
        self.guard = guard or (lambda: None)
        self._remote = not storage.renames_into_place(self.url)  # object stores: uploads in the background
        self._uploads = UploadQueue()
        self.sums = SumRegistry()
        self._manifests: dict[PartitionKey, Manifest] = {}

    # background uploads (remote directories only) ------------------------------------------------
    @contextlib.contextmanager
    def _h5_writer(self, url: str) -> Iterator[str]:
        """A local path to build the HDF5 file in; it becomes ``url`` (locally at once, remotely in the background)."""
        self.guard()
        if not self._remote:
            with storage.local_file_for_writing(url) as tmp:
                yield tmp
                entry = checksum_file(tmp)  # from the page cache, before the rename publishes it
                self.guard()  # again right before the rename: the writer may have been stopped while it built the file
            self.sums.record(url, entry)
            return
        self._wait(url)
        self._uploads.make_room()
        tmpdir = storage.upload_staging_dir()
        tmp = os.path.join(tmpdir, url.rsplit("/", 1)[-1])
        try:
            yield tmp
        except BaseException:
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        self.sums.record(url, checksum_file(tmp))
        self.guard()  # again before the upload publishes it

        def upload() -> None:
            try:
                storage.put_file(tmp, url)
            finally:
                shutil.rmtree(tmpdir, ignore_errors=True)

        self._uploads.submit(url, upload)

    def _wait(self, url: str) -> None:
        """Wait for a background upload of ``url`` (if any); raise its error."""
        self._uploads.wait(url)

    def flush(self) -> None:
        """Wait for every background upload; raise the first error (after all have finished)."""
        self._uploads.flush()

    def close(self) -> None:
        """Wait for the uploads (raising the first error) and stop their threads."""
        self._uploads.close()

    # names ---------------------------------------------------------------------------
    def version_file(self, base: str | None = None) -> str:
        return storage.join(base or self.url, VERSION_FILE)

    def config_file(self) -> str:
        return storage.join(self.url, CONFIG_FILE)

    def stats_file(self) -> str:
        return storage.join(self.url, STATS_FILE)

    def partition_file(self, version: int, entity_type: str, partition: int, base: str | None = None) -> str:
        return storage.join(base or self.url, f"embeddings_{entity_type}_{partition}.v{version}.h5")

    def model_file(self, version: int, base: str | None = None) -> str:
        return storage.join(base or self.url, f"model.v{version}.h5")

    def snapshot_dir(self, epoch: int) -> str:
        return storage.join(self.url, f"epoch_{epoch}")

    # version marker ----------------------------------------------------------------------
    def prepare(self) -> None:
        storage.makedirs(self.url)

    def load_version(self) -> int:
        """The last committed version, 0 when there is none yet."""
        url = self.version_file()
        try:
            text = storage.read_text(url).strip()
        except FileNotFoundError:
            return 0
        if not text:
            versions = self.list_versions()
            if versions:  # PBG rewrites the marker in place: a crash there leaves it empty, not absent
                raise CheckpointError(
                    f"{url}: empty, although versions {sorted(versions)} are in the directory (a writer was killed "
                    f"while writing the marker); write the last complete version into it (e.g. {max(versions)}) "
                    "rather than start over: nothing was deleted"
                )
            return 0
        try:
            version = int(text)
        except ValueError:
            raise CheckpointError(f"{url}: not an integer: '{text[:40]}' (expected the checkpoint version)") from None
        if version < 0:
            raise CheckpointError(f"{url}: negative version {version}")
        return version

    def best_file(self) -> str:
        return storage.join(self.url, BEST_FILE)

    def load_best(self) -> int | None:
        """The version ``best_version.txt`` names (None: no such file, or not a version)."""
        try:
            text = storage.read_text(self.best_file()).strip()
        except FileNotFoundError:
            return None
        return int(text) if text.isdigit() and int(text) > 0 else None

    def save_best(self, version: int) -> None:
        self.guard()
        storage.write_text(self.best_file(), f"{version}\n")

    def remove_best(self) -> None:
        self.guard()
        storage.remove(self.best_file())

    def load_input_check(self) -> dict[str, Any] | None:
        """The recorded input check (None: none, or not one this format wrote: a reader checks what it reads)."""
        try:
            data = json.loads(storage.read_text(storage.join(self.url, INPUT_CHECK_FILE)))
        except (FileNotFoundError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        return data if isinstance(data, dict) else None

    def save_input_check(self, record: dict[str, Any]) -> None:
        self.guard()
        storage.write_text(storage.join(self.url, INPUT_CHECK_FILE), json.dumps(record))

    def manifest_file(self, version: int, base: str | None = None) -> str:
        return storage.join(base or self.url, f"checksums.v{version}.json")

    def save_version(self, version: int) -> None:
        """Commit ``version``: wait until all its files are stored, write their checksum manifest, then the
        marker (the last object)."""
        self.flush()
        self.guard()
        names = [n for n in storage.listdir(self.url) if version_of(n, data_only=True) == version]
        known = {n: e for n in names if (e := self.sums.get(storage.join(self.url, n))) is not None}
        manifest = build_manifest(self.url, names, known, version)  # files of other writers are read back
        write_manifest(self.manifest_file(version), manifest)
        self._manifests[(self.url, version)] = manifest
        storage.write_text(self.version_file(), f"{version}\n")

    def manifest(self, version: int, base: str | None = None) -> Manifest | None:
        """The checksum manifest of a committed version (None: written by PBG or an older biggraph)."""
        key = (base or self.url, version)
        found = self._manifests.get(key)
        if found is None:
            found = read_manifest(self.manifest_file(version, base))
            if found is not None:
                self._manifests[key] = found
        return found

    def expected_entry(self, version: int, url: str, base: str | None = None) -> Entry | None:
        """What ``url`` (a file of ``version``) must hold: this trainer's own record of writing it, else the
        version's manifest; None when neither exists (nothing to verify against)."""
        entry = self.sums.get(url)
        if entry is not None:
            return entry
        manifest = self.manifest(version, base)
        if manifest is None:
            return None
        name = url.rsplit("/", 1)[-1]
        if name not in manifest.files:
            raise CheckpointError(f"{url}: not listed in {self.manifest_file(version, base)} (expected every file of "
                                  f"version {version} there; the checkpoint directory was changed after the commit, "
                                  "e.g. by PBG: delete that manifest if another tool wrote this version)")
        return manifest.files[name]

    def listed_in_manifest(self, version: int, url: str, base: str | None = None) -> bool:
        manifest = self.manifest(version, base)
        return manifest is not None and url.rsplit("/", 1)[-1] in manifest.files

    def read_committed(self, read: Callable[[int], T], attempts: int = 5) -> T:
        """``read(version)`` on the committed version, again on the new one if a writer moved on meanwhile.

        A concurrent trainer deletes version N-1 right after committing N; a reader that read
        the marker just before may then miss a file of N-1. That is the only way a committed
        version's file can be missing, so it is retried; any other error is raised.
        """
        for attempt in range(attempts):
            version = self.load_version()
            try:
                return read(version)
            except (CheckpointError, FileNotFoundError):
                if attempt == attempts - 1 or self.load_version() == version:
                    raise
        raise AssertionError("unreachable")

    # embeddings --------------------------------------------------------------------------
    def save_entity_partition(
        self,
        version: int,
        entity_type: str,
        partition: int,
        embeddings: np.ndarray,
        optimizer_state: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        base: str | None = None,
        name: str | None = None,
    ) -> None:
        """``name``: a file name in the directory to write under instead of the PBG name (a distributed trainer's
        staged write, moved to the PBG name later: job/checkpoint/write_groups.py)."""
        url = storage.join(base or self.url, name) if name else self.partition_file(version, entity_type, partition, base)
        blob = serialize_optimizer_state(optimizer_state)
        with self._h5_writer(url) as tmp:
            with h5py.File(tmp, "w") as handle:
                write_metadata(handle, metadata or {})
                handle.create_dataset(EMBEDDING_DATASET, data=np.ascontiguousarray(embeddings, dtype=np.float32))
                write_optimizer(handle, blob)

    def load_entity_partition(
        self, version: int, entity_type: str, partition: int, base: str | None = None, out: np.ndarray | None = None
    ) -> tuple[np.ndarray, dict[str, Any] | None]:
        """Embeddings (float32, count x dim) and optimizer state; ``out`` receives them in place if given."""
        url = self.partition_file(version, entity_type, partition, base)
        self._wait(url)
        with open_for_reading(url, self.expected_entry(version, url, base)) as handle:
            check_version_attr(handle, url)
            out = read_embeddings(handle, url, out)
            blob = read_optimizer(handle)
        return out, deserialize_optimizer_state(blob, url)

    def has_entity_partition(self, version: int, entity_type: str, partition: int, base: str | None = None) -> bool:
        """Whether the version holds this partition. A file its manifest lists counts even when it is gone:
        reading it then fails, instead of the caller silently starting that partition afresh."""
        url = self.partition_file(version, entity_type, partition, base)
        self._wait(url)
        return self.listed_in_manifest(version, url, base) or storage.exists(url)

    def open_partition(self, version: int, entity_type: str, partition: int) -> open_for_reading:
        """An h5py handle on a partition file (for readers that take a sample of rows); the file is checked
        against its checksum when the block ends, so what was read is trusted only after it."""
        url = self.partition_file(version, entity_type, partition)
        self._wait(url)
        return open_for_reading(url, self.expected_entry(version, url))

    # model ---------------------------------------------------------------------------------
    def save_model(
        self,
        version: int,
        state_dict: dict[str, tuple[str, np.ndarray]],
        optimizer_state: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        """``state_dict`` maps public names (relations/0/operator/rhs/real) to (private name, array)."""
        url = self.model_file(version)
        blob = serialize_optimizer_state(optimizer_state)
        with self._h5_writer(url) as tmp:
            with h5py.File(tmp, "w") as handle:
                write_metadata(handle, metadata or {})
                group = handle.create_group(MODEL_GROUP, track_order=True)
                for public_name, (private_name, array) in state_dict.items():
                    dataset = group.create_dataset(public_name, data=np.asarray(array))
                    dataset.attrs[STATE_DICT_KEY_ATTR] = private_name
                write_optimizer(handle, blob)

    def load_model(self, version: int) -> tuple[dict[str, np.ndarray], dict[str, Any] | None, dict[str, Any]]:
        """Public name -> array, the optimizer state and the root metadata attributes."""
        url = self.model_file(version)
        self._wait(url)
        with open_for_reading(url, self.expected_entry(version, url)) as handle:
            check_version_attr(handle, url)
            params = read_model_params(handle)
            blob = read_optimizer(handle)
            metadata = {k: attr_value(v) for k, v in handle.attrs.items()}
        return params, deserialize_optimizer_state(blob, url), metadata

    def load_model_metadata(self, version: int) -> dict[str, Any]:
        """The root metadata attributes of ``model.v{version}.h5`` alone (``config/json``, ``iteration/*``): what a
        reader that only asks which pass wrote the version needs, without the parameters or the optimizer blob (no
        torch). The file is still checked against the version's manifest."""
        url = self.model_file(version)
        self._wait(url)
        with open_for_reading(url, self.expected_entry(version, url)) as handle:
            check_version_attr(handle, url)
            return {k: attr_value(v) for k, v in handle.attrs.items()}

    def has_model(self, version: int) -> bool:
        url = self.model_file(version)
        self._wait(url)
        return self.listed_in_manifest(version, url) or storage.exists(url)

    # config and stats ------------------------------------------------------------------------
    def save_config(self, config_json: str) -> None:
        self.guard()
        storage.write_text(self.config_file(), config_json)

    def load_config_dict(self) -> dict[str, Any]:
        url = self.config_file()
        try:
            return json.loads(storage.read_text(url))
        except FileNotFoundError:
            raise CheckpointError(f"{url}: missing (expected the config.json of a checkpoint directory)") from None
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{url}: invalid JSON at line {err.lineno}") from None

    def append_stats(self, records: list[dict[str, Any]]) -> None:
        """Append JSON lines to ``training_stats.json`` (see :mod:`job.formats.stats`)."""
        append_stats(self.stats_file(), records)

    def trim_stats(self, committed: int) -> int:
        """Drop the stats lines of versions after ``committed`` (written just before a marker that never
        came); returns how many were dropped."""
        return trim_stats(self.stats_file(), committed)

    def load_stats(self) -> list[dict[str, Any]]:
        """The stats records (a line cut short by a crash is skipped)."""
        return load_stats(self.stats_file())

    # housekeeping ---------------------------------------------------------------------------
    def list_versions(self) -> set[int]:
        """Versions with any file (data or manifest) in the directory."""
        return {v for name in storage.listdir(self.url) if (v := version_of(name)) is not None}

    def drop_version(self, version: int, partitions: list[PartitionKey]) -> None:
        # the manifest first: a crash half-way leaves files without a manifest (garbage), never a manifest
        # whose files are half gone
        storage.remove(self.manifest_file(version))
        self._manifests.pop((self.url, version), None)
        urls = [self.partition_file(version, t, p) for t, p in partitions] + [self.model_file(version)]
        self.flush()
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(storage.carry(storage.remove), urls))

    def drop_uncommitted_manifests(self, committed: int) -> None:
        """Remove manifests of versions after the committed one (a crash between manifest and marker): the
        pass that redoes that version must not be checked against them."""
        for name in storage.listdir(self.url):
            match = MANIFEST_RE.match(name)
            if match and int(match.group("version")) > committed:
                storage.remove(storage.join(self.url, name))
                self._manifests.pop((self.url, int(match.group("version"))), None)

    def drop_older(self, committed: int, partitions: list[PartitionKey], keep: int | None = None) -> None:
        """Remove versions before the committed one (a kill between a commit and the deletion after it), except
        ``keep`` (the best version)."""
        for version in sorted(self.list_versions()):
            if version < committed and version != keep:
                self.drop_version(version, partitions)

    def drop_uncommitted(self, committed: int, partitions: list[PartitionKey]) -> None:
        """Remove the leftovers of versions newer than the committed one (a crash mid-write)."""
        for version in sorted(self.list_versions()):
            if version > committed:
                self.drop_version(version, partitions)

    def preserve(self, version: int, epoch: int, partitions: list[PartitionKey]) -> None:
        """Copy a committed version into ``epoch_{epoch}/`` with its own version marker."""
        snapshot = self.snapshot_dir(epoch)
        self.flush()
        storage.makedirs(snapshot)
        pairs = [(self.partition_file(version, t, p), self.partition_file(version, t, p, snapshot)) for t, p in partitions]
        pairs.append((self.model_file(version), self.model_file(version, snapshot)))
        pairs.append((self.config_file(), storage.join(snapshot, CONFIG_FILE)))
        if self.manifest(version) is not None:
            pairs.append((self.manifest_file(version), self.manifest_file(version, snapshot)))
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(storage.carry(lambda pair: copy_file(*pair)), pairs))
        storage.write_text(self.version_file(snapshot), f"{version}\n")
