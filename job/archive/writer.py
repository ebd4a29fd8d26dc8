"""Adding a tag to a model archive from a committed checkpoint (``biggraph archive``).

The archive is rebuilt whole in a local temporary file and committed at the end with
``storage.local_file_for_writing`` (a rename beside a local archive, one upload to an object
store), so a reader never sees a half-written archive and a failure loses nothing already
committed; an existing remote archive is downloaded first. Members of earlier tags are copied
byte for byte (CRC-checked on the way). Arrays are deduplicated by content: a parameter whose
encoded NDArray equals a file already in the archive becomes a reference (``<tag>/N`` in
params.txt), which is how an fp16 or int8 tag shares the fp32 relation operators and global
embeddings of an fp32 tag of the same checkpoint version (those stay fp32 in every tag: they
are small and every score goes through them).

An entity type's names are never held in memory (job/archive/names.py): they are spooled to a local
temporary file and copied into graph.fb behind the rest of it (serialize.GraphMember).

This module reads checkpoints (h5py) and, for ``--updater``, optimizer blobs (torch); the
loader never imports it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

import storage_adapters as storage
from job.archive import container, ndarray
from job.archive.container import Ref, ZipWriter
from job.archive.errors import ArchiveError, TagError
from job.archive.loader import ArchiveReader
from job.archive.names import NamesIndex, spool_names
from job.archive.serialize import Variable, graph_member, training_flatbuffer
from job.checkpoint import CheckpointManager
from job.checkpoint.journal_checks import GrowInputs
from job.config import ConfigSchema
from job.errors import CheckpointError
from job.formats import entities as entity_format
from job.formats.checkpoint import CheckpointStorage
from job.model.scoring import Model
from job.session import storage_scoped

logger = logging.getLogger("biggraph.archive")

DTYPES = tuple(ndarray.STORAGE_DTYPES)
_RELATION_PARAM_RE = re.compile(r"^relations/(?P<idx>\d+)/operator/(?P<side>lhs|rhs)/(?P<param>[^/]+)$")
_GLOBAL_RE = re.compile(r"^entities/(?P<type>.+)/global_embedding$")
_ARRAY_MEMBER_RE = re.compile(r"^(?P<tag>[^/]+)/(?P<dir>params|updater)/(?P<idx>\d+)\.fb$")


@dataclass
class TagSummary:
    archive: str
    tag: str
    dtype: str
    checkpoint_version: int
    tags: list[str]
    variables: int = 0
    files_written: int = 0
    shared: dict[str, str] = field(default_factory=dict)  # variable -> member it refers to in another tag
    tag_bytes: int = 0  # bytes of the members this tag added
    archive_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def embedding_variable(entity_type: str, partition: int) -> str:
    return f"embeddings/{entity_type}/{partition}"


@storage_scoped
def add_tag(config: ConfigSchema, out: str, tag: Optional[str] = None, dtype: str = "fp32",
            version: Optional[int] = None, include_updater: bool = False) -> TagSummary:
    """Add checkpoint ``version`` of ``config`` as tag ``tag`` (default ``v{version}-{dtype}``) to the archive ``out``.

    ``out`` is a path or any storage URL (``s3://bucket/model.zip``), created if missing.
    """
    if dtype not in DTYPES:
        raise ArchiveError(out, f"unknown dtype '{dtype}' (expected one of {', '.join(DTYPES)})")
    if storage.is_local(out):
        out = storage.local_path(out)
    else:
        storage.makedirs(_parent_of(out))  # an object store checks its bucket here, before any work
    committed = CheckpointManager.reader(config.checkpoint_path, version, GrowInputs.of(config))
    checkpoint, version = committed.checkpoint, committed.version
    tag = container.check_tag_name(tag or f"v{version}-{dtype}", out, member=None)
    with _existing_archive(out) as existing:
        tags = list(existing.tags) if existing is not None else []
        for old in tags:
            if old.casefold() == tag.casefold():
                raise TagError(out, f"tag '{tag}' is already in the archive (as '{old}'; tags are case-insensitive)",
                               container.TAGS_FILE)
        with storage.local_file_for_writing(out) as tmp:
            with ZipWriter(tmp) as writer:
                known_params: dict[str, Ref] = {}
                known_updater: dict[str, Ref] = {}
                if existing is not None:
                    _copy_members(existing, writer, known_params, known_updater)
                    existing.close()  # every member copied: the old file is no longer needed
                summary = _write_tag(config, checkpoint, version, tag=tag, dtype=dtype,
                                     include_updater=include_updater, writer=writer,
                                     known_params=known_params, known_updater=known_updater, out=out)
                summary.tags = tags + [tag]
                writer.write(container.TAGS_FILE, "".join(t + "\n" for t in summary.tags).encode("utf-8"))
            summary.archive_bytes = os.path.getsize(tmp)
    return summary


def _parent_of(url: str) -> str:
    """The remote "directory" (on an object store: the bucket and prefix) that will hold ``url``."""
    return url.rstrip("/").rsplit("/", 1)[0]


@contextlib.contextmanager
def _existing_archive(out: str) -> Iterator[Optional[ArchiveReader]]:
    """The archive already at ``out`` (the reader downloads a remote one), or None when there is none yet."""
    if not storage.exists(out):
        yield None
        return
    reader = ArchiveReader(out)
    try:
        yield reader
    finally:
        reader.close()


def _copy_members(existing: ArchiveReader, writer: ZipWriter, known_params: dict[str, Ref],
                  known_updater: dict[str, Ref]) -> None:
    for name in existing.zip.names():
        if name == container.TAGS_FILE:
            continue
        data = existing.member(name)  # CRC-checked
        info = existing.zip.infos[name]
        writer.write(name, data, date_time=info.date_time)
        match = _ARRAY_MEMBER_RE.match(name)
        if match:
            known = known_params if match["dir"] == container.PARAMS_DIR else known_updater
            known.setdefault(hashlib.sha256(data).hexdigest(), Ref(match["tag"], int(match["idx"])))


# One tag's members ---------------------------------------------------------------------------------------


def _dynamic_names(config: ConfigSchema) -> list[str]:
    count = entity_format.read_dynamic_rel_count(config.entity_path)
    if storage.exists(entity_format.dynamic_rel_names_file(config.entity_path)):
        names = entity_format.read_dynamic_rel_names(config.entity_path)
        if len(names) == count:
            return names
        logger.warning("dynamic_rel_names.json has %d names but dynamic_rel_count.txt says %d: names generated",
                       len(names), count)
    return [f"rel_{i}" for i in range(count)]


def _check_variable_name(name: str) -> None:
    if not name or any(c.isspace() for c in name):
        raise ArchiveError("<archive>", f"variable name '{name}' is empty or holds whitespace (entity type names used "
                                        "in an archive may not contain spaces)")


class _ArrayStore:
    """Assigns params/N.fb (or updater/N.fb) files, reusing any identical file already in the archive."""

    def __init__(self, tag: str, directory: str, writer: ZipWriter, known: dict[str, Ref]) -> None:
        self.tag = tag
        self.directory = directory
        self.writer = writer
        self.known = known  # sha256 of an NDArray member -> where it lives
        self.next_index = 0
        self.bytes_written = 0
        self.files_written = 0

    def put(self, data: bytes) -> Ref:
        digest = hashlib.sha256(data).hexdigest()
        ref = self.known.get(digest)
        if ref is not None:
            return ref
        ref = Ref(self.tag, self.next_index)
        self.next_index += 1
        self.writer.write(ref.member(self.directory), data)
        self.known[digest] = ref
        self.bytes_written += len(data)
        self.files_written += 1
        return ref


class _TagContents:
    """What one tag holds so far: its variables, their params.txt / updater.txt references, the summary."""

    def __init__(self, summary: TagSummary, writer: ZipWriter, known_params: dict[str, Ref],
                 known_updater: dict[str, Ref]) -> None:
        self.summary = summary
        self.params = _ArrayStore(summary.tag, container.PARAMS_DIR, writer, known_params)
        self.updater = _ArrayStore(summary.tag, container.UPDATER_DIR, writer, known_updater)
        self.param_refs: dict[str, list[Ref]] = {}
        self.updater_refs: dict[str, list[Ref]] = {}
        self.variables: list[Variable] = []

    def add_param(self, name: str, array: np.ndarray, storage_dtype: str) -> None:
        _check_variable_name(name)
        ref = self.params.put(ndarray.encode(array, storage_dtype, name))
        self.param_refs[name] = [ref]
        self.variables.append((name, ndarray.STORAGE_DTYPES[storage_dtype], tuple(np.shape(array))))
        if ref.tag != self.summary.tag:
            self.summary.shared[name] = ref.member(container.PARAMS_DIR)

    def add_state(self, name: str, array: Optional[np.ndarray]) -> None:
        if array is None:
            return
        data = ndarray.encode(np.asarray(array, dtype=np.float32), "fp32", name)
        self.updater_refs[name] = [self.updater.put(data)]


def _write_tag(config: ConfigSchema, checkpoint: CheckpointStorage, version: int, *, tag: str, dtype: str,
               include_updater: bool, writer: ZipWriter, known_params: dict[str, Ref], known_updater: dict[str, Ref],
               out: str) -> TagSummary:
    contents = _TagContents(TagSummary(out, tag, dtype, version, []), writer, known_params, known_updater)
    entity_types: list[dict[str, Any]] = []
    try:
        for entity_type in config.entities:
            entity_types.append(_add_entity_type(config, checkpoint, version, entity_type, dtype, include_updater,
                                                 contents, out))
        _add_model_params(config, checkpoint, version, include_updater, contents, entity_types)
        dynamic_names = _dynamic_names(config) if config.dynamic_relations else []
        graph = graph_member(config, tag, entity_types, contents.variables, dynamic_names)
        writer.write_chunks(f"{tag}/{container.GRAPH_FILE}", graph.size, graph.chunks())
    finally:
        for entry in entity_types:
            entry["names"].close()
    writer.write(f"{tag}/{container.PARAMS_FILE}", container.format_refs(contents.param_refs, tag).encode("utf-8"))
    training = training_flatbuffer(config, checkpoint, version, dtype, include_updater and bool(contents.updater_refs))
    writer.write(f"{tag}/{container.TRAINING_FILE}", training)
    extra = graph.size + len(training)
    if include_updater:
        text = container.format_refs(contents.updater_refs, tag).encode("utf-8")
        writer.write(f"{tag}/{container.UPDATER_FILE}", text)
        extra += len(text)
    summary = contents.summary
    summary.variables = len(contents.variables)
    summary.files_written = contents.params.files_written + contents.updater.files_written
    summary.tag_bytes = contents.params.bytes_written + contents.updater.bytes_written + extra
    return summary


def _add_entity_type(config: ConfigSchema, checkpoint: CheckpointStorage, version: int, entity_type: str, dtype: str,
                     include_updater: bool, contents: _TagContents, out: str) -> dict[str, Any]:
    """Adds the embedding tables of one entity type, a partition at a time; its graph.fb entry."""
    dimension = config.entity_dimension(entity_type)
    counts = entity_format.read_entity_counts(config.entity_path, entity_type,
                                              config.entities[entity_type].num_partitions)
    tables = []
    for part, count in enumerate(counts):
        array, state = checkpoint.load_entity_partition(version, entity_type, part)
        if array.shape != (count, dimension):
            raise CheckpointError(f"{checkpoint.partition_file(version, entity_type, part)}: shape {array.shape}, "
                                  f"expected ({count}, {dimension}) from the entity counts")
        var = embedding_variable(entity_type, part)
        contents.add_param(var, array, dtype)
        tables.append(var)
        if include_updater:
            contents.add_state(var, _row_sums(state, count))
    # the type's names, streamed to a local spool (never a list of them: a type may have a hundred million)
    names: NamesIndex = spool_names(config.entity_path, entity_type, counts, archive=out)
    return {"name": entity_type, "count": sum(counts), "partition_counts": counts, "dimension": dimension,
            "embeddings": tables, "names": names, "global": None}


def _add_model_params(config: ConfigSchema, checkpoint: CheckpointStorage, version: int, include_updater: bool,
                      contents: _TagContents, entity_types: list[dict[str, Any]]) -> None:
    """Adds the shared parameters of model.h5 (relation operators, global embeddings), always fp32."""
    model_params, model_optim, _ = checkpoint.load_model(version)
    by_type = {e["name"]: e for e in entity_types}
    for name in sorted(model_params, key=_param_order):
        match_global = _GLOBAL_RE.match(name)
        if match_global:
            if match_global["type"] not in by_type:
                raise CheckpointError(f"{checkpoint.model_file(version)}: global embedding of unknown type "
                                      f"'{match_global['type']}'")
            by_type[match_global["type"]]["global"] = name
        elif not _RELATION_PARAM_RE.match(name):
            raise CheckpointError(f"{checkpoint.model_file(version)}: unexpected model parameter 'model/{name}'")
        contents.add_param(name, np.asarray(model_params[name]), "fp32")
    if include_updater and model_optim:
        for name, state in _model_sums(config, model_optim, model_params).items():
            contents.add_state(name, state)


def _param_order(name: str) -> tuple[int, int, str]:
    match = _RELATION_PARAM_RE.match(name)
    if match:
        return (0, int(match["idx"]), name)
    return (1, 0, name)


def _row_sums(state: Optional[dict], count: int) -> Optional[np.ndarray]:
    """The row-wise Adagrad sums of a partition's optimizer state (PBG's RowAdagrad layout), if present."""
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
        return None
    entry = state["state"].get(0)
    if not isinstance(entry, dict) or "sum" not in entry:
        return None
    value = np.asarray(entry["sum"], dtype=np.float32)
    return value if value.shape == (count,) else None


def _model_sums(config: ConfigSchema, optim: dict, model_params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Adagrad sums of the relation parameters by public name (the optimizer indexes them in Model.parameters() order)."""
    num_dynamic = entity_format.read_dynamic_rel_count(config.entity_path) if config.dynamic_relations else 0
    order = list(Model(config, num_dynamic).public_state_dict())
    out: dict[str, np.ndarray] = {}
    for index, entry in (optim.get("state") or {}).items():
        if not isinstance(entry, dict) or "sum" not in entry or not 0 <= int(index) < len(order):
            continue
        name = order[int(index)]
        value = np.asarray(entry["sum"], dtype=np.float32)
        if name in model_params and value.shape == np.shape(model_params[name]):
            out[name] = value
    return out
