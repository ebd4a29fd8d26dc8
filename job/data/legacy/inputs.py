"""Legacy entity paths (``.pt`` counts) and edge paths (no ``format_version``) -> v1.

- ``entity_count_{type}_{part}.pt`` (a ``torch.save``'d int) -> ``entity_count_{type}_{part}.txt``.
  Count files are 0-based like v1; with ``count_base="auto"`` a type that has a ``_1`` file but no
  ``_0`` file is taken as 1-based and shifted down (logged). ``dynamic_rel_count.pt`` ->
  ``dynamic_rel_count.txt``; ``entity_names_*.json`` and ``dynamic_rel_names.json`` are copied
  (renumbered with the counts).
- ``edges_{l}_{r}.h5``: same datasets; legacy files lack the ``format_version`` attribute, which the
  copy gets (= 1). Other attributes and datasets (``lhsd_*``) are kept.

h5py (and ``job.formats.edges``, which imports it) is imported when edges are converted: the
command line imports this package to build its parser.
"""

from __future__ import annotations

import logging
import re
import shutil
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

import storage_adapters as storage
from job.data.legacy.loading import LegacyFormatError, as_count, first_line, safe_torch_load
from job.errors import UserError
from job.formats.edges import EDGE_DATASETS, FORMAT_VERSION, FORMAT_VERSION_ATTR
from job.formats.entities import count_file, dynamic_rel_count_file, names_file, write_count_file

logger = logging.getLogger("biggraph.legacy")

_COUNT_RE = re.compile(r"^entity_count_(?P<type>.+)_(?P<part>\d+)\.pt$")
_NAMES_RE = re.compile(r"^entity_names_(?P<type>.+)_(?P<part>\d+)\.json$")
_EDGE_RE = re.compile(r"^edges_(?P<lhs>\d+)_(?P<rhs>\d+)\.h5$")


def partition_shift(entity_type: str, parts: set[int], base: str, what: str, default_base: int) -> int:
    """How much to subtract from file partition numbers to get 0-based ones (checking they are contiguous)."""
    if base == "auto":
        if default_base == 0:
            start = 1 if 0 not in parts and 1 in parts else 0
        else:
            start = 0 if 0 in parts else 1
        if start != default_base:
            logger.warning("%s of entity type '%s' look %d-based (partitions %s): numbering them from 0", what, entity_type,
                           start, ",".join(map(str, sorted(parts))))
    else:
        start = int(base)
    expected = set(range(start, start + len(parts)))
    if parts != expected:
        missing = sorted(expected - parts)
        raise UserError(
            f"{what} of entity type '{entity_type}': partitions {','.join(map(str, sorted(parts)))} are not contiguous from "
            f"{start}" + (f" (missing {','.join(map(str, missing))})" if missing else "")
        )
    return start


@dataclass
class EntityConversion:
    """What convert_entities wrote: counts by type (0-based partitions) and the dynamic relation count."""

    counts: dict[str, list[int]] = field(default_factory=dict)
    dynamic_rel_count: int | None = None


def convert_entities(old: str, new: str, count_base: str = "auto") -> EntityConversion:
    """Legacy ``.pt`` counts (and names) in ``old`` -> v1 text counts in ``new``."""
    if not storage.isdir(old):
        raise UserError(f"{old}: directory not found (expected a legacy entity path of entity_count_{{type}}_{{part}}.pt files)")
    names = storage.listdir(old)
    by_type: dict[str, dict[int, str]] = {}
    for name in names:
        match = _COUNT_RE.match(name)
        if match:
            by_type.setdefault(match.group("type"), {})[int(match.group("part"))] = name
    if not by_type:
        raise UserError(f"{old}: no entity_count_{{type}}_{{part}}.pt files (expected a legacy entity path)")
    result = EntityConversion()
    storage.makedirs(new)
    shifts: dict[str, int] = {}
    for entity_type, files in sorted(by_type.items()):
        shift = shifts[entity_type] = partition_shift(entity_type, set(files), count_base, "count files", 0)
        counts = []
        for part in sorted(files):
            url = storage.join(old, files[part])
            count = as_count(safe_torch_load(url), url)
            write_count_file(count_file(new, entity_type, part - shift), count)
            counts.append(count)
        result.counts[entity_type] = counts
    if "dynamic_rel_count.pt" in names:
        url = storage.join(old, "dynamic_rel_count.pt")
        result.dynamic_rel_count = as_count(safe_torch_load(url), url)
        write_count_file(dynamic_rel_count_file(new), result.dynamic_rel_count)
    for name in names:
        match = _NAMES_RE.match(name)
        if match and match.group("type") in shifts:
            part = int(match.group("part")) - shifts[match.group("type")]
            storage.write_bytes(names_file(new, match.group("type"), part), storage.read_bytes(storage.join(old, name)))
        elif name == "dynamic_rel_names.json":
            storage.write_bytes(storage.join(new, name), storage.read_bytes(storage.join(old, name)))
    total = sum(len(c) for c in result.counts.values())
    logger.info("converted %d entity count files of %d types from %s to %s", total, len(result.counts), old, new)
    return result


def _check_legacy_edges(path: str, url: str) -> None:
    """The structure both formats share; an existing format_version must already be 1."""

    try:
        handle = h5py.File(path, "r")
    except OSError as err:
        raise LegacyFormatError(url, f"not a readable HDF5 file ({first_line(err)})", expected="an HDF5 edge file") from None
    with handle:
        version = handle.attrs.get(FORMAT_VERSION_ATTR, None)
        if version is not None and not _is_version_one(version):
            shown = np.asarray(version).tolist()
            raise LegacyFormatError(url, f"format_version is {shown!r}", expected="no format_version (legacy) or 1")
        lengths = set()
        for name in EDGE_DATASETS:
            dataset = handle.get(name)
            if not isinstance(dataset, h5py.Dataset) or dataset.ndim != 1 or dataset.dtype.kind not in "iu":
                problem = "missing" if dataset is None else "not a 1-D integer dataset"
                raise LegacyFormatError(url, problem, dataset=name, expected="a 1-D integer dataset")
            lengths.add(dataset.shape[0])
        if len(lengths) != 1:
            raise LegacyFormatError(url, "datasets differ in length", expected="rel, lhs and rhs of equal length")


def _is_version_one(value: Any) -> bool:
    try:
        return int(np.asarray(value).reshape(-1)[0]) == 1
    except (TypeError, ValueError, IndexError):
        return False


def _set_format_version(path: str) -> None:

    with h5py.File(path, "r+") as handle:
        handle.attrs[FORMAT_VERSION_ATTR] = FORMAT_VERSION


def convert_edges(old: str, new: str) -> int:
    """Copy every bucket file of ``old`` to ``new`` with ``format_version`` = 1; ``new == old`` edits in place."""
    names = [n for n in storage.listdir(old) if _EDGE_RE.match(n)]
    if not names:
        raise UserError(f"{old}: no edges_{{lhs}}_{{rhs}}.h5 files (expected a legacy edge path)")
    in_place = old.rstrip("/") == new.rstrip("/")
    storage.makedirs(new)
    for name in names:
        src = storage.join(old, name)
        with storage.local_copy_for_reading(src) as path:
            _check_legacy_edges(path, src)
            if in_place and storage.is_local(src):
                _set_format_version(path)
                continue
            with storage.local_file_for_writing(storage.join(new, name)) as tmp:
                shutil.copyfile(path, tmp)
                _set_format_version(tmp)
    logger.info("converted %d edge files from %s to %s%s", len(names), old, new, " (in place)" if in_place else "")
    return len(names)
