"""A legacy PBG checkpoint directory -> a v1 checkpoint.

Legacy: ``CHECKPOINT_VERSION`` (the latest version N), ``METADATA_1.pt.N`` (a 5-tuple: config
dict, two ints, model state dict, optimizer state) and ``{type}_{part}.pt.N`` with a **1-based**
partition (a 2-tuple: embeddings, possibly an ``nn.Parameter``, and their optimizer state).
Without ``CHECKPOINT_VERSION`` the files may carry no suffix (an initial-embeddings directory)
and METADATA may be absent. These become a v1 checkpoint of version N (1 when unversioned)
written through ``CheckpointStorage``: ``embeddings_{type}_{part-1}.vN.h5``, ``model.vN.h5``
(state-dict names mapped by ``map_state_dict_key``), ``config.json`` and, last, the version file.

If the mapped legacy config is not a valid v1 config it is written as is (with a warning); a v1
``config`` given by the caller wins. The two METADATA ints (whose packing of epoch/edge
path/chunk is unspecified) are kept as the ``legacy/metadata_int_1``/``_2`` attributes.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import storage_adapters as storage
from job.checkpoint import CheckpointManager, ModelState
from job.config import ConfigError, ConfigSchema, parse_config
from job.data.legacy.config_map import map_legacy_config, map_state_dict_key
from job.data.legacy.inputs import partition_shift
from job.data.legacy.loading import LegacyFormatError, safe_torch_load, to_numpy
from job.errors import UserError

logger = logging.getLogger("biggraph.legacy")

_VERSION_SUFFIX_RE = re.compile(r"^(?P<stem>.+\.pt)\.(?P<version>\d+)$")
METADATA_STEM = "METADATA_1.pt"
LEGACY_VERSION_FILE = "CHECKPOINT_VERSION"


def _find_version(old: str, names: list[str], requested: int | None) -> int | None:
    """The legacy version to convert: --version, CHECKPOINT_VERSION, the newest suffix, or None (unsuffixed)."""
    if requested is not None:
        return requested
    if LEGACY_VERSION_FILE in names:
        url = storage.join(old, LEGACY_VERSION_FILE)
        text = storage.read_text(url).strip()
        try:
            return int(text)
        except ValueError:
            raise LegacyFormatError(url, f"not an integer: '{text[:40]}'", expected="the checkpoint version") from None
    suffixes = {int(m.group("version")) for m in map(_VERSION_SUFFIX_RE.match, names) if m}
    return max(suffixes) if suffixes else None


@dataclass
class _Metadata:
    """What ``METADATA_1.pt`` holds, checked and converted (all empty when the file is absent)."""

    raw_config: Any = None
    model_state: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict)  # public name -> (private, values)
    model_optimizer: Any = None
    attrs: dict[str, Any] = field(default_factory=dict)


def _read_metadata(url: str, attrs: dict[str, Any]) -> _Metadata:
    """The 5-tuple (config, int, int, model state dict, optimizer state) of a legacy METADATA file."""
    metadata = safe_torch_load(url)
    if not isinstance(metadata, (tuple, list)) or len(metadata) != 5:
        size = f"{len(metadata)} elements" if isinstance(metadata, (tuple, list)) else f"a {type(metadata).__name__}"
        raise LegacyFormatError(
            url, f"holds {size}", expected="a 5-tuple (config dict, int, int, model state dict, optimizer state)",
        )
    raw_config, first, second, state_dict, model_optimizer = metadata
    result = _Metadata(raw_config, {}, model_optimizer, attrs)
    for index, value in ((1, first), (2, second)):
        if not isinstance(value, int):
            raise LegacyFormatError(url, f"element {index} is a {type(value).__name__}", expected="an int")
        attrs[f"legacy/metadata_int_{index}"] = value
    if not isinstance(state_dict, dict):
        raise LegacyFormatError(url, f"element 3 is a {type(state_dict).__name__}", expected="a model state dict")
    for private, tensor in state_dict.items():
        try:
            public = map_state_dict_key(str(private))
        except UserError as err:
            raise LegacyFormatError(url, str(err)) from None
        result.model_state[public] = (str(private), to_numpy(tensor, url, f"state dict entry '{private}'"))
    if model_optimizer is not None and not isinstance(model_optimizer, dict):
        raise LegacyFormatError(
            url, f"element 4 is a {type(model_optimizer).__name__}", expected="an optimizer state dict or None"
        )
    return result


def _resolve_config(
    old: str, config: ConfigSchema | None, raw_config: Any, path_rewrites: dict[str, Any] | None
) -> tuple[ConfigSchema | None, str | None, str | None]:
    """The config to store: ``config`` if given, else the legacy one mapped (and its paths rewritten).

    Returns it (None when only an invalid mapped dict is left), its PBG-style JSON for ``config.json``
    and the full JSON for the files' ``config/json`` attribute.
    """
    config_json: str | None = None
    full_json: str | None = None
    if config is None and raw_config is not None:
        mapped, notes = map_legacy_config(raw_config)
        for note in notes:
            logger.info("legacy config: %s", note)
        for key, value in (path_rewrites or {}).items():
            if key == "edge_paths" and isinstance(mapped.get("edge_paths"), list):
                mapped["edge_paths"] = [value.get(p, p) for p in mapped["edge_paths"]]
            elif key != "edge_paths":
                mapped[key] = value
        try:
            config = parse_config(mapped)
        except ConfigError as err:
            logger.warning("legacy config of %s is not a valid v1 config (%s): config.json keeps it as mapped", old, err)
            config_json = full_json = json.dumps(mapped, indent=4, default=str)
    if config is not None:
        full_json = config.to_json()
        config_json = getattr(config, "to_pbg_json", config.to_json)()
    return config, config_json, full_json


def _partition_files(old: str, names: list[str], suffix: str, config: ConfigSchema | None) -> dict[str, dict[int, str]]:
    """The embedding files ``{type}_{part}.pt{suffix}`` of the directory, by type and (legacy) partition."""
    known_types = set(config.entities) if config is not None else None
    part_re = re.compile(r"^(?P<type>.+)_(?P<part>\d+)\.pt" + re.escape(suffix) + "$")
    by_type: dict[str, dict[int, str]] = {}
    for name in names:
        match = part_re.match(name)
        if not match or name.startswith("METADATA_") or name.startswith("entity_count_"):
            continue
        if known_types is not None and match.group("type") not in known_types:
            logger.warning("%s: entity type '%s' is not in the config: skipped", storage.join(old, name), match.group("type"))
            continue
        by_type.setdefault(match.group("type"), {})[int(match.group("part"))] = name
    if not by_type:
        raise UserError(f"{old}: no {{type}}_{{part}}.pt{suffix} embedding files (expected a legacy checkpoint)")
    return by_type


def _load_partition(url: str) -> tuple[np.ndarray, dict[str, Any] | None]:
    """A legacy ``{type}_{part}.pt``: (embeddings, optimizer state), or a bare embeddings tensor."""
    value = safe_torch_load(url)
    optimizer = None
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise LegacyFormatError(url, f"holds {len(value)} elements", expected="(embeddings, optimizer state)")
        value, optimizer = value
    embeddings = to_numpy(value, url, "the embeddings")
    if embeddings.ndim != 2 or embeddings.dtype.kind != "f":
        raise LegacyFormatError(
            url, f"embeddings have shape {embeddings.shape} and dtype {embeddings.dtype}", expected="a 2-D float tensor"
        )
    if optimizer is not None and not isinstance(optimizer, dict):
        raise LegacyFormatError(url, f"optimizer state is a {type(optimizer).__name__}", expected="a state dict or None")
    return embeddings, optimizer


@dataclass
class _Target:
    """Where and how the partitions are written."""

    storage: Any  # CheckpointStorage
    version: int
    attrs: dict[str, Any]
    shifts: dict[str, int]  # per entity type: what to subtract from a legacy partition number (0-based v1 ones)
    expected_counts: dict[str, list[int]] | None


def _write_partitions(
    old: str, by_type: dict[str, dict[int, str]], config: ConfigSchema | None, target: _Target
) -> None:
    """Every legacy embedding file, renumbered 0-based, as a v1 partition (checked against the counts)."""
    for entity_type, files in sorted(by_type.items()):
        shift = target.shifts[entity_type]
        if config is not None and len(files) != config.entities[entity_type].num_partitions:
            raise UserError(
                f"{old}: {len(files)} embedding files for entity type '{entity_type}', but the config gives it "
                f"{config.entities[entity_type].num_partitions} partitions"
            )
        for part in sorted(files):
            url = storage.join(old, files[part])
            embeddings, optimizer = _load_partition(url)
            v1_part = part - shift
            counts = (target.expected_counts or {}).get(entity_type)
            if counts is not None and v1_part < len(counts) and counts[v1_part] != embeddings.shape[0]:
                raise LegacyFormatError(
                    url, f"has {embeddings.shape[0]} embeddings",
                    expected=f"{counts[v1_part]}, the entity count of '{entity_type}' partition {v1_part}",
                )
            target.storage.save_entity_partition(
                target.version, entity_type, v1_part, embeddings, optimizer, metadata=target.attrs
            )


def convert_checkpoint(
    old: str,
    new: str,
    *,
    version: int | None = None,
    config: ConfigSchema | None = None,
    partition_base: str = "auto",
    path_rewrites: dict[str, Any] | None = None,
    expected_counts: dict[str, list[int]] | None = None,
) -> int:
    """Convert one legacy checkpoint directory into a v1 one; returns the v1 version written.

    ``path_rewrites``: config keys to point at converted inputs (``edge_paths`` maps old paths to new).
    """
    if not storage.isdir(old):
        raise UserError(f"{old}: directory not found (expected a legacy checkpoint directory)")
    names = storage.listdir(old)
    legacy_version = _find_version(old, names, version)
    suffix = "" if legacy_version is None else f".{legacy_version}"
    out_version = legacy_version if legacy_version and legacy_version > 0 else 1
    attrs: dict[str, Any] = {"legacy/source": old}
    if METADATA_STEM + suffix in names:
        metadata = _read_metadata(storage.join(old, METADATA_STEM + suffix), attrs)
    else:
        logger.warning("%s: no %s: converting embeddings only (no relation parameters, no config)", old, METADATA_STEM + suffix)
        metadata = _Metadata(attrs=attrs)
    config, config_json, full_json = _resolve_config(old, config, metadata.raw_config, path_rewrites)
    if full_json is not None:
        attrs["config/json"] = full_json
    by_type = _partition_files(old, names, suffix, config)
    shifts = {t: partition_shift(t, set(files), partition_base, "checkpoint files", 1) for t, files in sorted(by_type.items())}
    keys = [(t, part - shifts[t]) for t, files in sorted(by_type.items()) for part in sorted(files)]
    # a writer like any other: the directory taken, the version checked whole and committed durably
    manager = CheckpointManager(new, keys)
    try:
        manager.open()
        manager.add_metadata_provider(lambda: attrs)
        _write_partitions(old, by_type, config, _Target(manager.storage, out_version, attrs, shifts, expected_counts))
        manager.write_model(out_version, ModelState(metadata.model_state, metadata.model_optimizer))
        if config_json is not None:
            manager.storage.save_config(config_json)
        manager.commit(out_version)  # the commit marker: last
    finally:
        manager.close()
    logger.info(
        "converted legacy checkpoint %s (version %s) to %s version %d: %d partitions, %d model parameters",
        old, legacy_version if legacy_version is not None else "unversioned", new, out_version,
        sum(len(f) for f in by_type.values()), len(metadata.model_state),
    )
    return out_version
