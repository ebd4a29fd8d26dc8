"""PBG's checkpoint format, on any storage URL.

Layout of ``checkpoint_path`` (identical to PBG 1.x, so each side reads the other's):

- ``embeddings_{type}_{part}.v{N}.h5``: dataset ``embeddings`` (count x dim, float32),
  optional ``optimizer/state_dict`` (a ``torch.save`` blob as a void-byte dataset),
  root attributes ``format_version`` = 1 plus metadata (``config/json``, ``iteration/*``).
- ``model.v{N}.h5``: group ``model`` with one dataset per shared parameter,
  ``model/relations/{idx}/operator/{side}/{param}`` and
  ``model/entities/{type}/global_embedding``, each with attribute ``state_dict_key``
  (the private name in the model's state dict); optimizer blob and metadata as above.
- ``config.json``, ``training_stats.json`` (JSON lines) and, written last,
  ``checkpoint_version.txt``: the commit marker. A version is complete exactly when
  this file names it, so files of version N+1 may exist half-written without harm.
- ``epoch_{E}/``: preserved snapshots (checkpoint_preservation_interval).

Optimizer blobs are only ever read with ``torch.load(weights_only=True)``: a checkpoint
directory is untrusted input.

On object stores (``s3://``...) the HDF5 files of a version are built locally and
uploaded in the background, several at a time; ``save_version`` waits for every upload
of the version to succeed before it writes the marker, so the marker is always the last
object written and no rename is needed. Each object appears whole (one PUT or one
completed multipart upload). A reader that finds a file of the version it was told
missing has lost a race with the deletion of that old version: it should read the
marker again (``read_committed`` does exactly that).

Every file this class writes has its size and CRC-32 recorded (``sums``); ``save_version``
writes them as ``checksums.v{N}.json`` before the marker, and every read of a version
verifies the file against that manifest (or against the record of the process that wrote
it, for files of the pass in progress). See :mod:`job.formats.checksums`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import h5py
import numpy as np

import storage_adapters as storage
from job.errors import CheckpointError, InputFormatError
from job.formats.checksums import Manifest, build_manifest, checksum_file, read_manifest, verify_local, write_manifest

FORMAT_VERSION_ATTR = "format_version"
FORMAT_VERSION = 1
STATE_DICT_KEY_ATTR = "state_dict_key"
EMBEDDING_DATASET = "embeddings"
MODEL_GROUP = "model"
OPTIMIZER_DATASET = "optimizer/state_dict"
VERSION_FILE = "checkpoint_version.txt"
CONFIG_FILE = "config.json"
STATS_FILE = "training_stats.json"

UPLOAD_THREADS = 8  # uploads of one version in flight at once
MAX_PENDING_UPLOADS = 16  # files built locally and not yet uploaded (bounds the local disk used)
_SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "credential", "signature", "sas")

T = TypeVar("T")

_PARTITION_RE = re.compile(r"^embeddings_(?P<type>.+)_(?P<part>\d+)\.v(?P<version>\d+)\.h5$")
_MODEL_RE = re.compile(r"^model\.v(?P<version>\d+)\.h5$")
_MANIFEST_RE = re.compile(r"^checksums\.v(?P<version>\d+)\.json$")

Entry = tuple[int, str]  # (size, crc32) of one file


class SumRegistry:
    """Size and checksum of the files this trainer wrote, by URL; the latest write of a URL wins.

    Distributed trainers replace it with one that also shares the records between ranks
    (a partition written by one rank is read and rewritten by others within a pass).
    """

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()

    def record(self, url: str, entry: Entry) -> None:
        with self._lock:
            self._entries[url] = entry

    def get(self, url: str) -> Entry | None:
        with self._lock:
            return self._entries.get(url)


class SharedSumRegistry(SumRegistry):
    """Records also kept in a key-value store every rank reaches (torch.distributed's store: ``set``,
    ``get``, ``check``), so that a rank reading or committing a file another rank wrote can verify it.

    A rank releases a partition only after its upload finished and its record was set, so a reader
    that got the partition's lock always finds the latest record. Records of a trainer killed
    earlier in the pass are absent: such files are read unverified and checksummed at the commit.
    """

    def __init__(self, store: Any, namespace: str) -> None:
        super().__init__()
        self.store = store
        self.namespace = namespace

    def _key(self, url: str) -> str:
        return f"biggraph/sums/{self.namespace}/{url}"

    def record(self, url: str, entry: Entry) -> None:
        super().record(url, entry)
        self.store.set(self._key(url), f"{entry[0]} {entry[1]}")

    def get(self, url: str) -> Entry | None:
        key = self._key(url)
        if self.store.check([key]):
            size, digest = self.store.get(key).decode().split()
            return int(size), digest
        return super().get(url)


def serialize_optimizer_state(state: dict[str, Any] | None) -> bytes | None:
    if state is None:
        return None
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def deserialize_optimizer_state(blob: bytes | None, where: str) -> dict[str, Any] | None:
    """Load an optimizer blob without executing anything it might contain."""
    if blob is None:
        return None
    import pickle

    import torch

    try:
        return torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, Exception) as err:  # noqa: BLE001 - untrusted bytes: any decode failure (IndexError...)
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputFormatError(
            where, f"optimizer state cannot be loaded safely ({first_line})", dataset=OPTIMIZER_DATASET,
            expected="a torch.save blob of tensors and plain values",
        ) from None


def redact_secrets(value: Any) -> Any:
    """``value`` with every credential-like entry of its mappings replaced by "***" (recursively)."""
    if isinstance(value, dict):
        return {
            k: ("***" if isinstance(k, str) and any(w in k.lower() for w in _SECRET_WORDS) and v not in (None, "")
                else redact_secrets(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact_secrets(v) for v in value]
    return value


def redact_config_json(text: str) -> str:
    """A config JSON with the credentials in ``storage_options`` hidden (never stored in a checkpoint)."""
    try:
        config = json.loads(text)
    except (TypeError, ValueError):
        return text
    if not isinstance(config, dict) or not config.get("storage_options"):
        return text
    config["storage_options"] = redact_secrets(config["storage_options"])
    return json.dumps(config, indent=4)


def _write_metadata(handle: h5py.File, metadata: dict[str, Any]) -> None:
    handle.attrs[FORMAT_VERSION_ATTR] = FORMAT_VERSION
    for key, value in metadata.items():
        if key == "config/json" and isinstance(value, str):
            value = redact_config_json(value)
        handle.attrs[key] = value if value is not None else ""


def _write_optimizer(handle: h5py.File, blob: bytes | None) -> None:
    if blob is not None:
        handle.create_dataset(OPTIMIZER_DATASET, data=np.frombuffer(blob, dtype=np.dtype("V1")))


def _read_optimizer(handle: h5py.File) -> bytes | None:
    if OPTIMIZER_DATASET not in handle:
        return None
    return handle[OPTIMIZER_DATASET][...].tobytes()


def _check_version_attr(handle: h5py.File, url: str) -> None:
    version = handle.attrs.get(FORMAT_VERSION_ATTR, None)
    if version is None or int(np.asarray(version).reshape(-1)[0]) != FORMAT_VERSION:
        shown = np.asarray(version).tolist()
        raise InputFormatError(url, f"format_version is {shown!r}", expected=f"format_version = {FORMAT_VERSION}")


class CheckpointStorage:
    """Reads and writes one checkpoint directory (local path or any URL)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/") if url not in ("/",) else url
        self._remote = not storage.is_local(self.url)
        self._pending: dict[str, Future] = {}
        self._pending_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self.sums = SumRegistry()
        self._manifests: dict[tuple[str, int], Manifest] = {}

    # background uploads (remote directories only) ------------------------------------------------
    @contextlib.contextmanager
    def _h5_writer(self, url: str) -> Iterator[str]:
        """A local path to build the HDF5 file in; it becomes ``url`` (locally at once, remotely in the background)."""
        if not self._remote:
            with storage.local_file_for_writing(url) as tmp:
                yield tmp
                entry = checksum_file(tmp)  # from the page cache, before the rename publishes it
            self.sums.record(url, entry)
            return
        self._wait(url)
        while True:  # the background swap thread writes too: look at the uploads under the lock
            with self._pending_lock:
                oldest = next(iter(self._pending)) if len(self._pending) >= MAX_PENDING_UPLOADS else None
            if oldest is None:
                break
            self._wait(oldest)
        tmpdir = storage.upload_staging_dir()
        tmp = os.path.join(tmpdir, url.rsplit("/", 1)[-1])
        try:
            yield tmp
        except BaseException:
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        self.sums.record(url, checksum_file(tmp))

        def upload() -> None:
            try:
                storage.put_file(tmp, url)
            finally:
                shutil.rmtree(tmpdir, ignore_errors=True)

        with self._pending_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=UPLOAD_THREADS, thread_name_prefix="biggraph-upload")
            self._pending[url] = self._executor.submit(storage.carry(upload))

    def _wait(self, url: str) -> None:
        """Wait for a background upload of ``url`` (if any); raise its error."""
        with self._pending_lock:
            future = self._pending.pop(url, None)
        if future is not None:
            future.result()

    def flush(self) -> None:
        """Wait for every background upload; raise the first error (after all have finished)."""
        with self._pending_lock:
            futures = list(self._pending.values())
            self._pending.clear()
        error: BaseException | None = None
        for future in futures:
            try:
                future.result()
            except BaseException as err:  # noqa: BLE001 - re-raised below
                error = error or err
        if error is not None:
            raise error

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

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

    def manifest_file(self, version: int, base: str | None = None) -> str:
        return storage.join(base or self.url, f"checksums.v{version}.json")

    def save_version(self, version: int) -> None:
        """Commit ``version``: wait until all its files are stored, write their checksum manifest, then the
        marker (the last object)."""
        self.flush()
        names = [n for n in storage.listdir(self.url) if _version_of(n, data_only=True) == version]
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
    ) -> None:
        url = self.partition_file(version, entity_type, partition, base)
        blob = serialize_optimizer_state(optimizer_state)
        with self._h5_writer(url) as tmp:
            with h5py.File(tmp, "w") as handle:
                _write_metadata(handle, metadata or {})
                handle.create_dataset(EMBEDDING_DATASET, data=np.ascontiguousarray(embeddings, dtype=np.float32))
                _write_optimizer(handle, blob)

    def load_entity_partition(
        self, version: int, entity_type: str, partition: int, base: str | None = None, out: np.ndarray | None = None
    ) -> tuple[np.ndarray, dict[str, Any] | None]:
        """Embeddings (float32, count x dim) and optimizer state; ``out`` receives them in place if given."""
        url = self.partition_file(version, entity_type, partition, base)
        self._wait(url)
        with _open_for_reading(url, self.expected_entry(version, url, base)) as handle:
            _check_version_attr(handle, url)
            if EMBEDDING_DATASET not in handle:
                raise InputFormatError(url, "missing", dataset=EMBEDDING_DATASET, expected="a 2-D float dataset")
            dataset = handle[EMBEDDING_DATASET]
            if not isinstance(dataset, h5py.Dataset):  # a damaged header can make it a group or a named type
                raise InputFormatError(url, f"is a {type(dataset).__name__}", dataset=EMBEDDING_DATASET, expected="a 2-D dataset")
            if dataset.ndim != 2:
                raise InputFormatError(url, f"has shape {dataset.shape}", dataset=EMBEDDING_DATASET, expected="2-D")
            if out is None:
                out = np.empty(dataset.shape, dtype=np.float32)
            elif out.shape != dataset.shape:
                raise InputFormatError(url, f"has shape {dataset.shape}", dataset=EMBEDDING_DATASET, expected=f"{out.shape}")
            if dataset.size:
                dataset.read_direct(out)
            blob = _read_optimizer(handle)
        return out, deserialize_optimizer_state(blob, url)

    def has_entity_partition(self, version: int, entity_type: str, partition: int, base: str | None = None) -> bool:
        """Whether the version holds this partition. A file its manifest lists counts even when it is gone:
        reading it then fails, instead of the caller silently starting that partition afresh."""
        url = self.partition_file(version, entity_type, partition, base)
        self._wait(url)
        return self.listed_in_manifest(version, url, base) or storage.exists(url)

    def open_partition(self, version: int, entity_type: str, partition: int) -> _open_for_reading:
        """An h5py handle on a partition file (for readers that take a sample of rows); the file is checked
        against its checksum when the block ends, so what was read is trusted only after it."""
        url = self.partition_file(version, entity_type, partition)
        self._wait(url)
        return _open_for_reading(url, self.expected_entry(version, url))

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
                _write_metadata(handle, metadata or {})
                group = handle.create_group(MODEL_GROUP, track_order=True)
                for public_name, (private_name, array) in state_dict.items():
                    dataset = group.create_dataset(public_name, data=np.asarray(array))
                    dataset.attrs[STATE_DICT_KEY_ATTR] = private_name
                _write_optimizer(handle, blob)

    def load_model(self, version: int) -> tuple[dict[str, np.ndarray], dict[str, Any] | None, dict[str, Any]]:
        """Public name -> array, the optimizer state and the root metadata attributes."""
        url = self.model_file(version)
        self._wait(url)
        params: dict[str, np.ndarray] = {}
        with _open_for_reading(url, self.expected_entry(version, url)) as handle:
            _check_version_attr(handle, url)
            if MODEL_GROUP in handle:

                def visit(name: str, obj: Any) -> None:
                    if isinstance(obj, h5py.Dataset):
                        params[name] = obj[...]

                handle[MODEL_GROUP].visititems(visit)
            blob = _read_optimizer(handle)
            metadata = {k: _attr_value(v) for k, v in handle.attrs.items()}
        return params, deserialize_optimizer_state(blob, url), metadata

    def has_model(self, version: int) -> bool:
        url = self.model_file(version)
        self._wait(url)
        return self.listed_in_manifest(version, url) or storage.exists(url)

    # config and stats ------------------------------------------------------------------------
    def save_config(self, config_json: str) -> None:
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
        """Append JSON lines; object stores cannot append, so the file is rewritten whole."""
        if not records:
            return
        new_text = "".join(json.dumps(r) + "\n" for r in records)
        url = self.stats_file()
        if storage.is_local(url):
            path = storage.local_path(url)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(new_text)
            return
        try:
            old = storage.read_text(url)
        except FileNotFoundError:
            old = ""
        storage.write_text(url, old + new_text)

    def trim_stats(self, committed: int) -> int:
        """Drop the stats lines of versions after ``committed`` (written just before a marker that never
        came); returns how many were dropped."""
        try:
            text = storage.read_text(self.stats_file())
        except FileNotFoundError:
            return 0
        records = self.load_stats()
        kept = [r for r in records if not isinstance(r.get("checkpoint_version"), int) or r["checkpoint_version"] <= committed]
        if len(kept) == len(records) and (not text or text.endswith("\n")):
            return 0  # (a line cut short by a kill is rewritten away: the next append would run into it)
        storage.write_text(self.stats_file(), "".join(json.dumps(r) + "\n" for r in kept))
        return len(records) - len(kept)

    def load_stats(self) -> list[dict[str, Any]]:
        try:
            text = storage.read_text(self.stats_file())
        except FileNotFoundError:
            return []
        records = []
        for line in text.splitlines():
            line = line.strip()
            if line:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash mid-append
        return records

    # housekeeping ---------------------------------------------------------------------------
    def list_versions(self) -> set[int]:
        """Versions with any file (data or manifest) in the directory."""
        return {v for name in storage.listdir(self.url) if (v := _version_of(name)) is not None}

    def drop_version(self, version: int, partitions: list[tuple[str, int]]) -> None:
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
            match = _MANIFEST_RE.match(name)
            if match and int(match.group("version")) > committed:
                storage.remove(storage.join(self.url, name))
                self._manifests.pop((self.url, int(match.group("version"))), None)

    def drop_older(self, committed: int, partitions: list[tuple[str, int]]) -> None:
        """Remove versions before the committed one (a kill between a commit and the deletion after it)."""
        for version in sorted(self.list_versions()):
            if version < committed:
                self.drop_version(version, partitions)

    def drop_uncommitted(self, committed: int, partitions: list[tuple[str, int]]) -> None:
        """Remove the leftovers of versions newer than the committed one (a crash mid-write)."""
        for version in sorted(self.list_versions()):
            if version > committed:
                self.drop_version(version, partitions)

    def preserve(self, version: int, epoch: int, partitions: list[tuple[str, int]]) -> None:
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
            list(pool.map(storage.carry(lambda pair: _copy(*pair)), pairs))
        storage.write_text(self.version_file(snapshot), f"{version}\n")


def _version_of(name: str, data_only: bool = False) -> int | None:
    """The version a checkpoint file name belongs to (None for other files)."""
    match = _PARTITION_RE.match(name) or _MODEL_RE.match(name) or (None if data_only else _MANIFEST_RE.match(name))
    return int(match.group("version")) if match else None


def _copy(src: str, dst: str) -> None:
    if storage.is_local(src) and storage.is_local(dst):
        dst_path = storage.local_path(dst)
        try:
            os.link(storage.local_path(src), dst_path)  # same data, no copy; the original is never modified
        except OSError:
            shutil.copyfile(storage.local_path(src), dst_path)
        return
    if storage.scheme_of(src) == storage.scheme_of(dst) and storage.scheme_of(src) in ("s3", "s3a", "gs", "gcs"):
        storage.copy(src, dst)  # server-side copy: no bytes through this machine
        return
    with storage.local_copy_for_reading(src) as local:
        if storage.is_local(dst):
            shutil.copyfile(local, storage.local_path(dst))
        else:
            storage.put_file(local, dst)


def _attr_value(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        return value.item()
    return value


class _open_for_reading:
    """Context manager: an h5py handle on a checkpoint file at any URL, checked against ``expected``
    (size, crc32) when given.

    The check runs when the block ends, before anything read is returned: h5py's read leaves the file in
    the page cache, so the checksum costs a pass over memory instead of a second pass over the disk
    (bench/checksum_bench.py). A file HDF5 cannot even parse is checked first, so its error says
    "damaged" with the checksum rather than whatever HDF5 tripped on.
    """

    def __init__(self, url: str, expected: Entry | None = None) -> None:
        self.url = url
        self.expected = expected
        self._stack: Any = None
        self._path = ""

    def _verify(self) -> None:
        if self.expected is not None:
            verify_local(self.url, self._path, self.expected)

    def __enter__(self) -> h5py.File:
        self._stack = contextlib.ExitStack()
        try:
            self._path = self._stack.enter_context(storage.local_copy_for_reading(self.url))
        except FileNotFoundError:
            self._stack.close()
            raise CheckpointError(f"{self.url}: missing (expected a checkpoint file)") from None
        try:
            return self._stack.enter_context(h5py.File(self._path, "r"))
        except FileNotFoundError:
            self._stack.close()
            raise CheckpointError(f"{self.url}: missing (expected a checkpoint file)") from None
        except OSError as err:
            try:
                self._verify()
            finally:
                self._stack.close()
            raise InputFormatError(self.url, f"not a readable HDF5 file ({err})", expected="an HDF5 checkpoint file") from None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self._verify()  # also after a failed read: a mismatch explains it best
        finally:
            self._stack.close()
        from job.formats.edges import HDF5_READ_ERRORS, _short

        if isinstance(exc, HDF5_READ_ERRORS):  # h5py's errors from reading a damaged file
            raise InputFormatError(self.url, f"damaged HDF5 file ({_short(exc)})", expected="an HDF5 checkpoint file") from None
