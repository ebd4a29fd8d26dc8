"""``biggraph convert-legacy``: turn pre-1.0 PBG inputs and checkpoints into the v1 format.

Legacy layout (spec: pbg-data-model-and-legacy-format.rst) and what each becomes:

- ``entity_count_{type}_{part}.pt`` (a ``torch.save``'d int) -> ``entity_count_{type}_{part}.txt``.
  Count files are 0-based like v1; with ``--count-base auto`` a type that has a ``_1``
  file but no ``_0`` file is taken as 1-based and shifted down (logged).
  ``dynamic_rel_count.pt`` -> ``dynamic_rel_count.txt``; ``entity_names_*.json`` and
  ``dynamic_rel_names.json`` are copied (renumbered with the counts).
- ``edges_{l}_{r}.h5``: same datasets; legacy files lack the ``format_version``
  attribute, which the copy gets (= 1). Other attributes and datasets (``lhsd_*``) are kept.
- checkpoints: ``CHECKPOINT_VERSION`` (the latest version N), ``METADATA_1.pt.N`` (a
  5-tuple: config dict, two ints, model state dict, optimizer state) and
  ``{type}_{part}.pt.N`` with a **1-based** partition (a 2-tuple: embeddings, possibly an
  ``nn.Parameter``, and their optimizer state). Without ``CHECKPOINT_VERSION`` the files
  may carry no suffix (an initial-embeddings directory) and METADATA may be absent.
  These become a v1 checkpoint of version N (1 when unversioned) written through
  ``CheckpointStorage``: ``embeddings_{type}_{part-1}.vN.h5``, ``model.vN.h5`` (state-dict
  names mapped as PBG's MODEL_STATE_DICT_MAPPINGS: ``{side}_operators.{idx}.{param}`` ->
  ``relations/{idx}/operator/{side}/{param}``, ``global_embs.emb_{type}`` ->
  ``entities/{type}/global_embedding``), ``config.json`` and, last, ``checkpoint_version.txt``.

The legacy config dict: mixedCase keys become snake_case (as PBG 1.0's own loader does),
``outdir`` becomes ``checkpoint_path`` and ``loadPath`` ``init_path``; keys unknown to the v1
schema are dropped (logged). ``entity_path``/``edge_paths``/``checkpoint_path`` are pointed at
the converted directories when those are converted in the same run. If the result is still
not a valid config, the mapped dict is written as is (with a warning); ``--config`` supplies
a v1 config to use instead. The two METADATA ints (whose packing of epoch/edge path/chunk
is unspecified) are kept as the ``legacy/metadata_int_1``/``legacy/metadata_int_2`` attributes.

SECURITY: every ``.pt`` file is untrusted and is loaded only with
``torch.load(weights_only=True)``: tensors (``nn.Parameter`` included), numbers, strings and
containers. Anything else (a custom class, a ``__reduce__`` calling a function) is refused
with an error naming the file; there is no fallback to full unpickling.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import storage_adapters as storage
from job.errors import InputFormatError, UserError

if TYPE_CHECKING:
    import numpy as np

    from job.config import ConfigSchema

logger = logging.getLogger("biggraph.legacy")

_COUNT_RE = re.compile(r"^entity_count_(?P<type>.+)_(?P<part>\d+)\.pt$")
_NAMES_RE = re.compile(r"^entity_names_(?P<type>.+)_(?P<part>\d+)\.json$")
_EDGE_RE = re.compile(r"^edges_(?P<lhs>\d+)_(?P<rhs>\d+)\.h5$")
_VERSION_SUFFIX_RE = re.compile(r"^(?P<stem>.+\.pt)\.(?P<version>\d+)$")
_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")
METADATA_STEM = "METADATA_1.pt"
LEGACY_VERSION_FILE = "CHECKPOINT_VERSION"

# PBG's MODEL_STATE_DICT_MAPPINGS (checkpoint_manager.py): private state-dict key -> public dataset name.
_STATE_DICT_MAPPINGS = (
    (re.compile(r"^(?P<side>[^./]+)_operators\.(?P<idx>[^./]+)\.(?P<param>[^./]+)$"), "relations/{idx}/operator/{side}/{param}"),
    (re.compile(r"^global_embs\.emb_(?P<type>[^./]+)$"), "entities/{type}/global_embedding"),
)

# Legacy config keys whose snake_case form is not the v1 name.
_RENAMED_KEYS = {"outdir": "checkpoint_path", "load_path": "init_path"}


class LegacyFormatError(InputFormatError):
    """A legacy file is unreadable, unsafe or not what the legacy format says it is."""


# Loading .pt files safely ------------------------------------------------------------------------


def safe_torch_load(url: str) -> Any:
    """``torch.load(weights_only=True)`` of a URL, with one-line errors naming the file.

    Never falls back to unrestricted unpickling: a legacy file that needs it is refused.
    """
    import pickle
    import warnings
    import zipfile

    import torch

    try:
        with storage.local_copy_for_reading(url) as path, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "pickle protocol 4" notices from the weights-only unpickler
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise LegacyFormatError(url, "missing", expected="a torch.save file") from None
    except pickle.UnpicklingError as err:
        text = str(err)
        match = _GLOBAL_RE.search(text)
        if match is None and "Unsupported operand" in text:
            raise LegacyFormatError(
                url, "not a readable torch.save file (not a pickle the weights-only loader knows)", expected="a torch.save file"
            ) from None
        what = f"it references '{match.group(1)}'" if match else "it holds objects other than tensors and plain values"
        raise LegacyFormatError(
            url,
            f"refused to load: {what}, and biggraph loads .pt files only with torch.load(weights_only=True) "
            "because unpickling arbitrary objects can run code",
            expected="tensors, numbers, strings and containers of them",
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError, zipfile.BadZipFile, AttributeError, ImportError) as err:
        problem = f"not a readable torch.save file ({_first_line(err)})"
        raise LegacyFormatError(url, problem, expected="a torch.save file") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:160] if text else type(err).__name__


def _as_count(value: Any, url: str) -> int:
    """A legacy count: a torch.save'd int (or a one-element integer tensor)."""
    import torch

    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() and value.dtype != torch.bool:
        value = int(value.item())
    if not isinstance(value, int) or isinstance(value, bool):
        raise LegacyFormatError(url, f"holds a {type(value).__name__}", expected="a torch.save'd non-negative integer")
    if value < 0:
        raise LegacyFormatError(url, f"negative count {value}", expected="a torch.save'd non-negative integer")
    return value


# Entity counts ------------------------------------------------------------------------------------------


def _partition_shift(entity_type: str, parts: set[int], base: str, what: str, default_base: int) -> int:
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
    from job.formats.entities import count_file, dynamic_rel_count_file, names_file, write_count_file

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
        shift = shifts[entity_type] = _partition_shift(entity_type, set(files), count_base, "count files", 0)
        counts = []
        for part in sorted(files):
            url = storage.join(old, files[part])
            count = _as_count(safe_torch_load(url), url)
            write_count_file(count_file(new, entity_type, part - shift), count)
            counts.append(count)
        result.counts[entity_type] = counts
    if "dynamic_rel_count.pt" in names:
        url = storage.join(old, "dynamic_rel_count.pt")
        result.dynamic_rel_count = _as_count(safe_torch_load(url), url)
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


# Edges ---------------------------------------------------------------------------------------------------


def _check_legacy_edges(path: str, url: str) -> None:
    """The structure both formats share; an existing format_version must already be 1."""
    import h5py
    import numpy as np

    from job.formats.edges import EDGE_DATASETS, FORMAT_VERSION_ATTR

    try:
        handle = h5py.File(path, "r")
    except OSError as err:
        raise LegacyFormatError(url, f"not a readable HDF5 file ({_first_line(err)})", expected="an HDF5 edge file") from None
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
    import numpy as np

    try:
        return int(np.asarray(value).reshape(-1)[0]) == 1
    except (TypeError, ValueError, IndexError):
        return False


def _set_format_version(path: str) -> None:
    import h5py

    from job.formats.edges import FORMAT_VERSION, FORMAT_VERSION_ATTR

    with h5py.File(path, "r+") as handle:
        handle.attrs[FORMAT_VERSION_ATTR] = FORMAT_VERSION


def convert_edges(old: str, new: str) -> int:
    """Copy every bucket file of ``old`` to ``new`` with ``format_version`` = 1; ``new == old`` edits in place."""
    import shutil

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


# Config -------------------------------------------------------------------------------------------------------


def _snake(key: str) -> str:
    """PBG 1.0's own legacy rule (schema.mixed_case_to_lowercase): every capital becomes _lowercase."""
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in key)


def map_legacy_config(raw: Any) -> tuple[dict[str, Any], list[str]]:
    """Legacy config dict -> v1 keys, and notes about what was renamed or dropped."""
    import dataclasses

    from job.config import ConfigSchema, EntitySchema, RelationSchema

    if not isinstance(raw, dict):
        return {}, [f"the legacy config is a {type(raw).__name__}, not a dict: dropped"]
    notes: list[str] = []

    def convert(mapping: dict[str, Any], cls: type, where: str) -> dict[str, Any]:
        known = {f.name for f in dataclasses.fields(cls)}
        out: dict[str, Any] = {}
        for key, value in mapping.items():
            new_key = _snake(str(key))
            new_key = _RENAMED_KEYS.get(new_key, new_key) if cls is ConfigSchema else new_key
            if new_key not in known:
                notes.append(f"dropped legacy key '{where}{key}' (no v1 equivalent)")
                continue
            if new_key != key:
                notes.append(f"renamed '{where}{key}' to '{where}{new_key}'")
            out[new_key] = value
        return out

    config = convert(raw, ConfigSchema, "")
    if isinstance(config.get("entities"), dict):
        config["entities"] = {
            name: convert(entity, EntitySchema, f"entities.{name}.") if isinstance(entity, dict) else entity
            for name, entity in config["entities"].items()
        }
    if isinstance(config.get("relations"), list):
        config["relations"] = [
            convert(rel, RelationSchema, f"relations[{i}].") if isinstance(rel, dict) else rel
            for i, rel in enumerate(config["relations"])
        ]
    if isinstance(config.get("edge_paths"), str):
        config["edge_paths"] = [config["edge_paths"]]
    return config, notes


# Checkpoints ----------------------------------------------------------------------------------------------------


def map_state_dict_key(private: str) -> str:
    """A legacy model state-dict key -> the v1 public dataset name (PBG's mapping)."""
    for pattern, public in _STATE_DICT_MAPPINGS:
        match = pattern.match(private)
        if match:
            return public.format(**match.groupdict())
    raise UserError(
        f"model state dict key '{private}' has no v1 name "
        "(expected {side}_operators.{idx}.{param} or global_embs.emb_{type})"
    )


def _to_numpy(value: Any, url: str, what: str) -> np.ndarray:
    import torch

    if not isinstance(value, torch.Tensor):
        raise LegacyFormatError(url, f"{what} is a {type(value).__name__}", expected="a tensor")
    return value.detach().cpu().numpy()


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


def convert_checkpoint(
    old: str,
    new: str,
    *,
    version: int | None = None,
    config: ConfigSchema | None = None,
    partition_base: str = "auto",
    path_rewrites: dict[str, str] | None = None,
    expected_counts: dict[str, list[int]] | None = None,
) -> int:
    """Convert one legacy checkpoint directory into a v1 one; returns the v1 version written."""
    from job.config import ConfigError, parse_config
    from job.formats.checkpoint import CheckpointStorage

    if not storage.isdir(old):
        raise UserError(f"{old}: directory not found (expected a legacy checkpoint directory)")
    names = storage.listdir(old)
    legacy_version = _find_version(old, names, version)
    suffix = "" if legacy_version is None else f".{legacy_version}"
    out_version = legacy_version if legacy_version and legacy_version > 0 else 1

    # METADATA: config, two ints, model state dict, optimizer state.
    metadata_url = storage.join(old, METADATA_STEM + suffix)
    raw_config: Any = None
    model_state: dict[str, tuple[str, np.ndarray]] = {}
    model_optimizer: Any = None
    attrs: dict[str, Any] = {"legacy/source": old}
    if METADATA_STEM + suffix in names:
        metadata = safe_torch_load(metadata_url)
        if not isinstance(metadata, (tuple, list)) or len(metadata) != 5:
            size = f"{len(metadata)} elements" if isinstance(metadata, (tuple, list)) else f"a {type(metadata).__name__}"
            raise LegacyFormatError(
                metadata_url, f"holds {size}",
                expected="a 5-tuple (config dict, int, int, model state dict, optimizer state)",
            )
        raw_config, first, second, state_dict, model_optimizer = metadata
        for index, value in ((1, first), (2, second)):
            if not isinstance(value, int):
                raise LegacyFormatError(metadata_url, f"element {index} is a {type(value).__name__}", expected="an int")
            attrs[f"legacy/metadata_int_{index}"] = value
        if not isinstance(state_dict, dict):
            raise LegacyFormatError(metadata_url, f"element 3 is a {type(state_dict).__name__}", expected="a model state dict")
        for private, tensor in state_dict.items():
            try:
                public = map_state_dict_key(str(private))
            except UserError as err:
                raise LegacyFormatError(metadata_url, str(err)) from None
            model_state[public] = (str(private), _to_numpy(tensor, metadata_url, f"state dict entry '{private}'"))
        if model_optimizer is not None and not isinstance(model_optimizer, dict):
            raise LegacyFormatError(
                metadata_url, f"element 4 is a {type(model_optimizer).__name__}", expected="an optimizer state dict or None"
            )
    else:
        logger.warning("%s: no %s: converting embeddings only (no relation parameters, no config)", old, METADATA_STEM + suffix)

    # Config: --config wins; else the legacy dict, mapped.
    config_json: str | None = None
    full_json: str | None = None
    if config is None and raw_config is not None:
        mapped, notes = map_legacy_config(raw_config)
        for note in notes:
            logger.info("legacy config: %s", note)
        for key, value in (path_rewrites or {}).items():
            if key == "edge_paths" and isinstance(mapped.get("edge_paths"), list):
                mapped["edge_paths"] = [path_rewrites["edge_paths"].get(p, p) for p in mapped["edge_paths"]]  # type: ignore[union-attr]
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
    if full_json is not None:
        attrs["config/json"] = full_json

    # Embeddings: {type}_{part}.pt{suffix}, 1-based partitions.
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

    target = CheckpointStorage(new)
    target.prepare()
    for entity_type, files in sorted(by_type.items()):
        shift = _partition_shift(entity_type, set(files), partition_base, "checkpoint files", 1)
        if config is not None and len(files) != config.entities[entity_type].num_partitions:
            raise UserError(
                f"{old}: {len(files)} embedding files for entity type '{entity_type}', but the config gives it "
                f"{config.entities[entity_type].num_partitions} partitions"
            )
        for part in sorted(files):
            url = storage.join(old, files[part])
            embeddings, optimizer = _load_partition(url)
            v1_part = part - shift
            counts = (expected_counts or {}).get(entity_type)
            if counts is not None and v1_part < len(counts) and counts[v1_part] != embeddings.shape[0]:
                raise LegacyFormatError(
                    url, f"has {embeddings.shape[0]} embeddings",
                    expected=f"{counts[v1_part]}, the entity count of '{entity_type}' partition {v1_part}",
                )
            target.save_entity_partition(out_version, entity_type, v1_part, embeddings, optimizer, metadata=attrs)
    target.save_model(out_version, model_state, model_optimizer, metadata=attrs)
    if config_json is not None:
        target.save_config(config_json)
    target.save_version(out_version)  # the commit marker: last
    logger.info(
        "converted legacy checkpoint %s (version %s) to %s version %d: %d partitions, %d model parameters",
        old, legacy_version if legacy_version is not None else "unversioned", new, out_version,
        sum(len(f) for f in by_type.values()), len(model_state),
    )
    return out_version


def _load_partition(url: str) -> tuple[np.ndarray, dict[str, Any] | None]:
    """A legacy ``{type}_{part}.pt``: (embeddings, optimizer state), or a bare embeddings tensor."""
    value = safe_torch_load(url)
    optimizer = None
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise LegacyFormatError(url, f"holds {len(value)} elements", expected="(embeddings, optimizer state)")
        value, optimizer = value
    embeddings = _to_numpy(value, url, "the embeddings")
    if embeddings.ndim != 2 or embeddings.dtype.kind != "f":
        raise LegacyFormatError(
            url, f"embeddings have shape {embeddings.shape} and dtype {embeddings.dtype}", expected="a 2-D float tensor"
        )
    if optimizer is not None and not isinstance(optimizer, dict):
        raise LegacyFormatError(url, f"optimizer state is a {type(optimizer).__name__}", expected="a state dict or None")
    return embeddings, optimizer


# CLI -----------------------------------------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "convert-legacy",
        help="convert pre-1.0 PBG inputs (.pt counts, edges without format_version) and checkpoints to v1",
        description=(
            "Convert legacy PBG files to the v1 format. Any combination of entity path, edge paths and "
            "checkpoint may be given; .pt files are loaded with torch.load(weights_only=True) only."
        ),
    )
    parser.add_argument("--entity-path", metavar="OLD", help="legacy entity path (entity_count_{type}_{part}.pt)")
    parser.add_argument("--out", metavar="NEW", help="where the v1 entity counts go (with --entity-path)")
    parser.add_argument("--count-base", choices=("auto", "0", "1"), default="auto",
                        help="partition numbering of legacy count files (auto: 0-based unless only _1.. exist)")
    parser.add_argument("--edge-path", metavar="OLD", action="append", default=[],
                        help="legacy edge directory; repeatable, paired in order with --edge-out")
    parser.add_argument("--edge-out", metavar="NEW", action="append", default=[],
                        help="where its v1 copy goes (the same path as --edge-path edits the files in place)")
    parser.add_argument("--checkpoint", metavar="OLD", help="legacy checkpoint directory (METADATA_1.pt, {type}_{part}.pt)")
    parser.add_argument("--checkpoint-out", metavar="NEW", help="where the v1 checkpoint goes (with --checkpoint)")
    parser.add_argument("--version", type=int, default=None,
                        help="legacy checkpoint version to convert (default: CHECKPOINT_VERSION, else the newest)")
    parser.add_argument("--checkpoint-base", choices=("auto", "0", "1"), default="auto",
                        help="partition numbering of legacy checkpoint files (the format says 1-based)")
    parser.add_argument("--config", default=None,
                        help="a v1 config to store in the converted checkpoint instead of the mapped legacy one")
    parser.set_defaults(func=_convert_command)


def _convert_command(args: argparse.Namespace) -> int:
    if not (args.entity_path or args.edge_path or args.checkpoint):
        raise UserError("nothing to convert: give --entity-path, --edge-path and/or --checkpoint")
    if bool(args.entity_path) != bool(args.out):
        raise UserError("--entity-path and --out go together")
    if len(args.edge_path) != len(args.edge_out):
        raise UserError(f"--edge-path given {len(args.edge_path)} times but --edge-out {len(args.edge_out)} times (pair them)")
    if bool(args.checkpoint) != bool(args.checkpoint_out):
        raise UserError("--checkpoint and --checkpoint-out go together")
    if args.version is not None and not args.checkpoint:
        raise UserError("--version applies to --checkpoint")
    config = None
    if args.config:
        from job.config import load_config

        config = load_config(args.config)
    entities = None
    if args.entity_path:
        entities = convert_entities(args.entity_path, args.out, args.count_base)
        print(f"entity counts: {sum(len(c) for c in entities.counts.values())} files -> {args.out}")
    for old, new in zip(args.edge_path, args.edge_out, strict=True):
        count = convert_edges(old, new)
        print(f"edges: {count} files -> {new}")
    if args.checkpoint:
        rewrites: dict[str, Any] = {"checkpoint_path": args.checkpoint_out}
        if args.out:
            rewrites["entity_path"] = args.out
        if args.edge_path:
            rewrites["edge_paths"] = dict(zip(args.edge_path, args.edge_out, strict=True))
        version = convert_checkpoint(
            args.checkpoint, args.checkpoint_out, version=args.version, config=config,
            partition_base=args.checkpoint_base, path_rewrites=rewrites,
            expected_counts=entities.counts if entities else None,
        )
        print(f"checkpoint: version {version} -> {args.checkpoint_out}")
    return 0
