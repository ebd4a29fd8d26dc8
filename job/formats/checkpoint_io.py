"""The HDF5 side of PBG's checkpoint format: file names, attributes, and a verified read of one file.

:class:`job.formats.checkpoint.CheckpointStorage` puts these together into a checkpoint directory; the
layout is described there.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import h5py
import numpy as np

import storage_adapters as storage
from job.errors import CheckpointError, InputFormatError
from job.formats.checksums import verify_local
from job.formats.edges import HDF5_READ_ERRORS, short_error
from job.formats.optimizer_state import OPTIMIZER_DATASET
from job.formats.redaction import redact_config_json
from job.formats.sums import Entry

FORMAT_VERSION_ATTR = "format_version"
FORMAT_VERSION = 1
STATE_DICT_KEY_ATTR = "state_dict_key"
EMBEDDING_DATASET = "embeddings"
MODEL_GROUP = "model"
VERSION_FILE = "checkpoint_version.txt"
CONFIG_FILE = "config.json"
STATS_FILE = "training_stats.json"
# the version that scored best on the validation edges, kept beside the latest (validation_edge_paths)
BEST_FILE = "best_version.txt"
# the last input check that passed, for the run's config and the input as it was then listed (job/train/input_check.py)
INPUT_CHECK_FILE = "input_check.json"

_PARTITION_RE = re.compile(r"^embeddings_(?P<type>.+)_(?P<part>\d+)\.v(?P<version>\d+)\.h5$")
_MODEL_RE = re.compile(r"^model\.v(?P<version>\d+)\.h5$")
MANIFEST_RE = re.compile(r"^checksums\.v(?P<version>\d+)\.json$")


def version_of(name: str, data_only: bool = False) -> int | None:
    """The version a checkpoint file name belongs to (None for other files)."""
    match = _PARTITION_RE.match(name) or _MODEL_RE.match(name) or (None if data_only else MANIFEST_RE.match(name))
    return int(match.group("version")) if match else None


def write_metadata(handle: h5py.File, metadata: dict[str, Any]) -> None:
    """The root attributes: the format version, then ``metadata`` (a stored config has its secrets hidden)."""
    handle.attrs[FORMAT_VERSION_ATTR] = FORMAT_VERSION
    for key, value in metadata.items():
        if key == "config/json" and isinstance(value, str):
            value = redact_config_json(value)
        handle.attrs[key] = value if value is not None else ""


def write_optimizer(handle: h5py.File, blob: bytes | None) -> None:
    """Store an optimizer blob as a void-byte dataset, as PBG does."""
    if blob is not None:
        handle.create_dataset(OPTIMIZER_DATASET, data=np.frombuffer(blob, dtype=np.dtype("V1")))


def read_optimizer(handle: h5py.File) -> bytes | None:
    if OPTIMIZER_DATASET not in handle:
        return None
    return handle[OPTIMIZER_DATASET][...].tobytes()


def check_version_attr(handle: h5py.File, url: str) -> None:
    """Refuse a file of another format version (its layout could differ silently)."""
    version = handle.attrs.get(FORMAT_VERSION_ATTR, None)
    if version is None or int(np.asarray(version).reshape(-1)[0]) != FORMAT_VERSION:
        shown = np.asarray(version).tolist()
        raise InputFormatError(url, f"format_version is {shown!r}", expected=f"format_version = {FORMAT_VERSION}")


def attr_value(value: Any) -> Any:
    """An HDF5 attribute as a plain Python value (bytes decoded, numpy scalars unwrapped)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        return value.item()
    return value


def read_embeddings(handle: h5py.File, url: str, out: np.ndarray | None) -> np.ndarray:
    """The ``embeddings`` dataset (float32, count x dim), into ``out`` if given (its shape must match)."""
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
    return out


def read_model_params(handle: h5py.File) -> dict[str, np.ndarray]:
    """Every dataset under the ``model`` group, by its public name (relations/0/operator/rhs/real...)."""
    params: dict[str, np.ndarray] = {}
    if MODEL_GROUP in handle:

        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset):
                params[name] = obj[...]

        handle[MODEL_GROUP].visititems(visit)
    return params


def copy_file(src: str, dst: str) -> None:
    """Copy one checkpoint file: a hard link locally (checkpoint files are never modified in place), a server-side
    copy within one object store."""
    storage.copy(src, dst, link=True)


class open_for_reading:  # lower case: used like a function,: ``with open_for_reading(url) as handle``
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
        if isinstance(exc, HDF5_READ_ERRORS):  # h5py's errors from reading a damaged file
            raise InputFormatError(self.url, f"damaged HDF5 file ({short_error(exc)})",
                                   expected="an HDF5 checkpoint file") from None
