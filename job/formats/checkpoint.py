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
"""

from __future__ import annotations

import io
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import h5py
import numpy as np

import storage_adapters as storage
from job.errors import CheckpointError, InputFormatError

FORMAT_VERSION_ATTR = "format_version"
FORMAT_VERSION = 1
STATE_DICT_KEY_ATTR = "state_dict_key"
EMBEDDING_DATASET = "embeddings"
MODEL_GROUP = "model"
OPTIMIZER_DATASET = "optimizer/state_dict"
VERSION_FILE = "checkpoint_version.txt"
CONFIG_FILE = "config.json"
STATS_FILE = "training_stats.json"

_PARTITION_RE = re.compile(r"^embeddings_(?P<type>.+)_(?P<part>\d+)\.v(?P<version>\d+)\.h5$")
_MODEL_RE = re.compile(r"^model\.v(?P<version>\d+)\.h5$")


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
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputFormatError(
            where, f"optimizer state cannot be loaded safely ({first_line})", dataset=OPTIMIZER_DATASET,
            expected="a torch.save blob of tensors and plain values",
        ) from None


def _write_metadata(handle: h5py.File, metadata: dict[str, Any]) -> None:
    handle.attrs[FORMAT_VERSION_ATTR] = FORMAT_VERSION
    for key, value in metadata.items():
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
            return 0
        try:
            version = int(text)
        except ValueError:
            raise CheckpointError(f"{url}: not an integer: '{text[:40]}' (expected the checkpoint version)") from None
        if version < 0:
            raise CheckpointError(f"{url}: negative version {version}")
        return version

    def save_version(self, version: int) -> None:
        """Commit ``version``: everything it needs must already be written."""
        storage.write_text(self.version_file(), f"{version}\n")

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
        with storage.local_file_for_writing(url) as tmp:
            with h5py.File(tmp, "w") as handle:
                _write_metadata(handle, metadata or {})
                handle.create_dataset(EMBEDDING_DATASET, data=np.ascontiguousarray(embeddings, dtype=np.float32))
                _write_optimizer(handle, blob)

    def load_entity_partition(
        self, version: int, entity_type: str, partition: int, base: str | None = None, out: np.ndarray | None = None
    ) -> tuple[np.ndarray, dict[str, Any] | None]:
        """Embeddings (float32, count x dim) and optimizer state; ``out`` receives them in place if given."""
        url = self.partition_file(version, entity_type, partition, base)
        with _open_for_reading(url) as handle:
            _check_version_attr(handle, url)
            if EMBEDDING_DATASET not in handle:
                raise InputFormatError(url, "missing", dataset=EMBEDDING_DATASET, expected="a 2-D float dataset")
            dataset = handle[EMBEDDING_DATASET]
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
        return storage.exists(self.partition_file(version, entity_type, partition, base))

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
        with storage.local_file_for_writing(url) as tmp:
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
        params: dict[str, np.ndarray] = {}
        with _open_for_reading(url) as handle:
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
        return storage.exists(self.model_file(version))

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
            import os

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
        versions = set()
        for name in storage.listdir(self.url):
            match = _PARTITION_RE.match(name) or _MODEL_RE.match(name)
            if match:
                versions.add(int(match.group("version")))
        return versions

    def drop_version(self, version: int, partitions: list[tuple[str, int]]) -> None:
        urls = [self.partition_file(version, t, p) for t, p in partitions] + [self.model_file(version)]
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(storage.remove, urls))

    def drop_uncommitted(self, committed: int, partitions: list[tuple[str, int]]) -> None:
        """Remove the leftovers of versions newer than the committed one (a crash mid-write)."""
        for version in sorted(self.list_versions()):
            if version > committed:
                self.drop_version(version, partitions)

    def preserve(self, version: int, epoch: int, partitions: list[tuple[str, int]]) -> None:
        """Copy a committed version into ``epoch_{epoch}/`` with its own version marker."""
        snapshot = self.snapshot_dir(epoch)
        storage.makedirs(snapshot)
        pairs = [(self.partition_file(version, t, p), self.partition_file(version, t, p, snapshot)) for t, p in partitions]
        pairs.append((self.model_file(version), self.model_file(version, snapshot)))
        pairs.append((self.config_file(), storage.join(snapshot, CONFIG_FILE)))
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda pair: _copy(*pair), pairs))
        storage.write_text(self.version_file(snapshot), f"{version}\n")


def _copy(src: str, dst: str) -> None:
    if storage.is_local(src) and storage.is_local(dst):
        import os
        import shutil

        dst_path = storage.local_path(dst)
        try:
            os.link(storage.local_path(src), dst_path)  # same data, no copy; the original is never modified
        except OSError:
            shutil.copyfile(storage.local_path(src), dst_path)
        return
    storage.write_bytes(dst, storage.read_bytes(src))


def _attr_value(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        return value.item()
    return value


class _open_for_reading:
    """Context manager: an h5py handle on a checkpoint file at any URL."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._stack: Any = None

    def __enter__(self) -> h5py.File:
        import contextlib

        self._stack = contextlib.ExitStack()
        try:
            path = self._stack.enter_context(storage.local_copy_for_reading(self.url))
        except FileNotFoundError:
            self._stack.close()
            raise CheckpointError(f"{self.url}: missing (expected a checkpoint file)") from None
        try:
            return self._stack.enter_context(h5py.File(path, "r"))
        except FileNotFoundError:
            self._stack.close()
            raise CheckpointError(f"{self.url}: missing (expected a checkpoint file)") from None
        except OSError as err:
            self._stack.close()
            raise InputFormatError(self.url, f"not a readable HDF5 file ({err})", expected="an HDF5 checkpoint file") from None

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()
