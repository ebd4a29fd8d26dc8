"""Adding a tag to a model archive from a committed checkpoint (``biggraph archive``).

The archive is rewritten whole into a temporary file beside it and renamed over it at the
end, so a crash never leaves a half-written archive; members of earlier tags are copied
byte for byte (CRC-checked on the way). Arrays are deduplicated by content: a parameter
whose encoded NDArray equals a file already in the archive becomes a reference
(``<tag>/N`` in params.txt), which is how an fp16 or int8 tag shares the fp32 relation
operators and global embeddings of an fp32 tag of the same checkpoint version (those stay
fp32 in every tag: they are small and every score goes through them).

This module reads checkpoints (h5py) and, for ``--updater``, optimizer blobs (torch); the
loader never imports it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import flatbuffers
import numpy as np

import storage_adapters as storage
from job import __version__
from job.archive import container, ndarray
from job.archive.container import Ref, ZipWriter
from job.archive.errors import ArchiveError, TagError
from job.archive.fb import EntityType as fb_entity
from job.archive.fb import Graph as fb_graph
from job.archive.fb import Operation as fb_operation
from job.archive.fb import RelationType as fb_relation
from job.archive.fb import TrainingConfig as fb_training
from job.archive.fb import Variable as fb_variable
from job.archive.loader import FORMAT_VERSION, GRAPH_IDENTIFIER, TRAINING_IDENTIFIER, ArchiveReader
from job.config import ConfigSchema
from job.errors import CheckpointError
from job.session import storage_scoped

logger = logging.getLogger("biggraph.archive")

DTYPES = tuple(ndarray.STORAGE_DTYPES)
_RELATION_PARAM_RE = re.compile(r"^relations/(?P<idx>\d+)/operator/(?P<side>lhs|rhs)/(?P<param>[^/]+)$")
_GLOBAL_RE = re.compile(r"^entities/(?P<type>.+)/global_embedding$")


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


def find_checkpoint_version(config: ConfigSchema, version: Optional[int]) -> tuple[Any, int]:
    """The CheckpointStorage holding ``version`` (the latest committed one when None): the checkpoint
    directory itself or one of its preserved ``epoch_{E}/`` snapshots."""
    from job.formats.checkpoint import CheckpointStorage

    main = CheckpointStorage(config.checkpoint_path)
    latest = main.load_version()
    if version is None:
        if latest == 0:
            raise CheckpointError(f"{config.checkpoint_path}: no committed checkpoint (checkpoint_version.txt missing)")
        return main, latest
    if version < 1:
        raise CheckpointError(f"--version must be positive, got {version}")
    if main.has_model(version) and version <= latest:
        return main, version
    found: list[int] = []
    try:
        entries = storage.listdir(config.checkpoint_path)
    except FileNotFoundError:
        entries = []
    for entry in sorted(entries):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if not re.fullmatch(r"epoch_\d+", name):
            continue
        snapshot = CheckpointStorage(storage.join(config.checkpoint_path, name))
        snap_version = snapshot.load_version()
        found.append(snap_version)
        if snap_version == version and snapshot.has_model(version):
            return snapshot, version
    known = sorted({v for v in found if v} | ({latest} if latest else set()))
    raise CheckpointError(f"{config.checkpoint_path}: no committed checkpoint version {version} (available: "
                          f"{', '.join(map(str, known)) or 'none'}; older versions survive only in epoch_*/ snapshots, "
                          "see checkpoint_preservation_interval)")


def _entity_names(config: ConfigSchema, entity_type: str, partition: int, count: int) -> tuple[list[str], bool]:
    from job.formats import entities

    if not entities.has_entity_names(config.entity_path, entity_type, partition):
        return [f"{entity_type}_{partition}_{offset}" for offset in range(count)], True
    names = entities.read_entity_names(config.entity_path, entity_type, partition)
    if len(names) != count:
        raise CheckpointError(f"{entities.names_file(config.entity_path, entity_type, partition)}: {len(names)} names "
                              f"but the partition has {count} entities")
    return names, False


def _dynamic_names(config: ConfigSchema) -> list[str]:
    from job.formats import entities

    count = entities.read_dynamic_rel_count(config.entity_path)
    if storage.exists(entities.dynamic_rel_names_file(config.entity_path)):
        names = entities.read_dynamic_rel_names(config.entity_path)
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


@storage_scoped
def add_tag(config: ConfigSchema, out: str, tag: Optional[str] = None, dtype: str = "fp32",
            version: Optional[int] = None, include_updater: bool = False) -> TagSummary:
    """Add checkpoint ``version`` of ``config`` as tag ``tag`` (default ``v{version}-{dtype}``) to the archive ``out``."""
    if dtype not in DTYPES:
        raise ArchiveError(out, f"unknown dtype '{dtype}' (expected one of {', '.join(DTYPES)})")
    if not storage.is_local(out):
        raise ArchiveError(out, "archives are written to local paths (copy the file to object storage afterwards)")
    out = storage.local_path(out)
    checkpoint, version = find_checkpoint_version(config, version)
    tag = container.check_tag_name(tag or f"v{version}-{dtype}", out, member=None)

    existing: Optional[ArchiveReader] = ArchiveReader(out) if os.path.exists(out) else None
    tags = list(existing.tags) if existing is not None else []
    for old in tags:
        if old.casefold() == tag.casefold():
            existing.close()  # type: ignore[union-attr]
            raise TagError(out, f"tag '{tag}' is already in the archive (as '{old}'; tags are case-insensitive)",
                           container.TAGS_FILE)
    tmp = f"{out}.tmp-{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    try:
        with ZipWriter(tmp) as writer:
            known_params: dict[str, Ref] = {}
            known_updater: dict[str, Ref] = {}
            if existing is not None:
                _copy_members(existing, writer, known_params, known_updater)
            summary = _write_tag(config, checkpoint, version, tag, dtype, include_updater, writer, known_params,
                                 known_updater, out)
            summary.tags = tags + [tag]
            writer.write(container.TAGS_FILE, "".join(t + "\n" for t in summary.tags).encode("utf-8"))
        if existing is not None:
            existing.close()
            existing = None
        os.replace(tmp, out)
    except BaseException:
        if existing is not None:
            existing.close()
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    summary.archive_bytes = os.path.getsize(out)
    return summary


def _copy_members(existing: ArchiveReader, writer: ZipWriter, known_params: dict[str, Ref],
                  known_updater: dict[str, Ref]) -> None:
    member_re = re.compile(r"^(?P<tag>[^/]+)/(?P<dir>params|updater)/(?P<idx>\d+)\.fb$")
    for name in existing.zip.names():
        if name == container.TAGS_FILE:
            continue
        data = existing.member(name)  # CRC-checked
        info = existing.zip.infos[name]
        writer.write(name, data, date_time=info.date_time)
        match = member_re.match(name)
        if match:
            known = known_params if match["dir"] == container.PARAMS_DIR else known_updater
            known.setdefault(hashlib.sha256(data).hexdigest(), Ref(match["tag"], int(match["idx"])))


def _write_tag(config: ConfigSchema, checkpoint: Any, version: int, tag: str, dtype: str, include_updater: bool,
               writer: ZipWriter, known_params: dict[str, Ref], known_updater: dict[str, Ref], out: str) -> TagSummary:
    from job.formats import entities as entity_format

    summary = TagSummary(out, tag, dtype, version, [])
    params = _ArrayStore(tag, container.PARAMS_DIR, writer, known_params)
    updater = _ArrayStore(tag, container.UPDATER_DIR, writer, known_updater)
    param_refs: dict[str, list[Ref]] = {}
    updater_refs: dict[str, list[Ref]] = {}
    variables: list[tuple[str, int, tuple[int, ...]]] = []

    def add_param(name: str, array: np.ndarray, storage_dtype: str) -> None:
        _check_variable_name(name)
        data = ndarray.encode(array, storage_dtype, name)
        ref = params.put(data)
        param_refs[name] = [ref]
        code = ndarray.STORAGE_DTYPES[storage_dtype]
        variables.append((name, code, tuple(np.shape(array))))
        if ref.tag != tag:
            summary.shared[name] = ref.member(container.PARAMS_DIR)

    def add_state(name: str, array: Optional[np.ndarray]) -> None:
        if array is None:
            return
        updater_refs[name] = [updater.put(ndarray.encode(np.asarray(array, dtype=np.float32), "fp32", name))]

    # entity tables, one partition at a time
    entity_types: list[dict[str, Any]] = []
    for entity_type, schema in config.entities.items():
        counts = entity_format.read_entity_counts(config.entity_path, entity_type, schema.num_partitions)
        names: list[str] = []
        generated = False
        tables = []
        for part, count in enumerate(counts):
            array, state = checkpoint.load_entity_partition(version, entity_type, part)
            if array.shape != (count, config.entity_dimension(entity_type)):
                raise CheckpointError(f"{checkpoint.partition_file(version, entity_type, part)}: shape {array.shape}, "
                                      f"expected ({count}, {config.entity_dimension(entity_type)}) from the entity counts")
            var = embedding_variable(entity_type, part)
            add_param(var, array, dtype)
            tables.append(var)
            if include_updater:
                add_state(var, _row_sums(state, count))
            part_names, part_generated = _entity_names(config, entity_type, part, count)
            names.extend(part_names)
            generated = generated or part_generated
        if any("\0" in n for n in names):
            raise ArchiveError(out, f"entity type '{entity_type}': a name holds a NUL character")
        entity_types.append({
            "name": entity_type, "count": sum(counts), "partition_counts": counts,
            "dimension": config.entity_dimension(entity_type), "embeddings": tables, "names": names,
            "generated": generated, "global": None,
        })

    # shared parameters of model.h5: relation operators and global embeddings, always fp32
    model_params, model_optim, _ = checkpoint.load_model(version)
    by_type = {e["name"]: e for e in entity_types}
    for name in sorted(model_params, key=_param_order):
        value = np.asarray(model_params[name])
        match_global = _GLOBAL_RE.match(name)
        if match_global:
            if match_global["type"] not in by_type:
                raise CheckpointError(f"{checkpoint.model_file(version)}: global embedding of unknown type "
                                      f"'{match_global['type']}'")
            by_type[match_global["type"]]["global"] = name
        elif not _RELATION_PARAM_RE.match(name):
            raise CheckpointError(f"{checkpoint.model_file(version)}: unexpected model parameter 'model/{name}'")
        add_param(name, value, "fp32")
    if include_updater and model_optim:
        for name, state in _model_sums(config, model_optim, model_params).items():
            add_state(name, state)

    dynamic_names = _dynamic_names(config) if config.dynamic_relations else []
    graph = _graph_flatbuffer(config, tag, entity_types, variables, dynamic_names, param_refs)
    writer.write(f"{tag}/{container.GRAPH_FILE}", graph)
    writer.write(f"{tag}/{container.PARAMS_FILE}", container.format_refs(param_refs, tag).encode("utf-8"))
    training = _training_flatbuffer(config, checkpoint, version, dtype, include_updater and bool(updater_refs))
    writer.write(f"{tag}/{container.TRAINING_FILE}", training)
    extra = len(graph) + len(training)
    if include_updater:
        text = container.format_refs(updater_refs, tag).encode("utf-8")
        writer.write(f"{tag}/{container.UPDATER_FILE}", text)
        extra += len(text)
    summary.variables = len(variables)
    summary.files_written = params.files_written + updater.files_written
    summary.tag_bytes = params.bytes_written + updater.bytes_written + extra
    return summary


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
    from job.model.scoring import Model

    num_dynamic = 0
    if config.dynamic_relations:
        from job.formats import entities

        num_dynamic = entities.read_dynamic_rel_count(config.entity_path)
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


# FlatBuffers ------------------------------------------------------------------------------------------


def _strings(builder: flatbuffers.Builder, values: list[str]) -> int:
    offsets = [builder.CreateString(v) for v in values]
    builder.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        builder.PrependUOffsetTRelative(off)
    return builder.EndVector()


def _tables(builder: flatbuffers.Builder, offsets: list[int]) -> int:
    builder.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        builder.PrependUOffsetTRelative(off)
    return builder.EndVector()


def _operation(builder: flatbuffers.Builder, name: str, op_type: str, inputs: list[str], outputs: list[str],
               i_args: dict[str, int], b_args: dict[str, bool]) -> int:
    name_off, type_off = builder.CreateString(name), builder.CreateString(op_type)
    inputs_off, outputs_off = _strings(builder, inputs), _strings(builder, outputs)
    i_names = _strings(builder, list(i_args))
    i_values = builder.CreateNumpyVector(np.asarray(list(i_args.values()), dtype="<i8"))
    b_names = _strings(builder, list(b_args))
    b_values = builder.CreateNumpyVector(np.asarray(list(b_args.values()), dtype=np.bool_))
    fb_operation.Start(builder)
    fb_operation.AddName(builder, name_off)
    fb_operation.AddOpType(builder, type_off)
    fb_operation.AddInputs(builder, inputs_off)
    fb_operation.AddOutputs(builder, outputs_off)
    fb_operation.AddIArgNames(builder, i_names)
    fb_operation.AddIArgs(builder, i_values)
    fb_operation.AddBArgNames(builder, b_names)
    fb_operation.AddBArgs(builder, b_values)
    return fb_operation.End(builder)


def _graph_flatbuffer(config: ConfigSchema, tag: str, entity_types: list[dict[str, Any]],
                      variables: list[tuple[str, int, tuple[int, ...]]], dynamic_names: list[str],
                      param_refs: dict[str, list[Ref]]) -> bytes:
    names_bytes = sum(len(n.encode("utf-8")) + 1 for e in entity_types for n in e["names"])
    builder = flatbuffers.Builder(1024 + 2 * names_bytes + 256 * len(variables))
    entity_offsets = []
    for e in entity_types:
        name = builder.CreateString(e["name"])
        counts = builder.CreateNumpyVector(np.asarray(e["partition_counts"], dtype="<i8"))
        tables = _strings(builder, e["embeddings"])
        global_off = builder.CreateString(e["global"]) if e["global"] else None
        blob = builder.CreateNumpyVector(np.frombuffer("\0".join(e["names"]).encode("utf-8"), dtype=np.uint8))
        fb_entity.Start(builder)
        fb_entity.AddName(builder, name)
        fb_entity.AddCount(builder, e["count"])
        fb_entity.AddPartitionCounts(builder, counts)
        fb_entity.AddDimension(builder, e["dimension"])
        fb_entity.AddEmbeddings(builder, tables)
        if global_off is not None:
            fb_entity.AddGlobalEmbedding(builder, global_off)
        fb_entity.AddNamesUtf8(builder, blob)
        fb_entity.AddNamesGenerated(builder, e["generated"])
        entity_offsets.append(fb_entity.End(builder))
    relation_offsets = []
    for rel in config.relations:
        strings = [builder.CreateString(s) for s in (rel.name, rel.lhs, rel.rhs, rel.operator)]
        fb_relation.Start(builder)
        fb_relation.AddName(builder, strings[0])
        fb_relation.AddLhs(builder, strings[1])
        fb_relation.AddRhs(builder, strings[2])
        fb_relation.AddOperator(builder, strings[3])
        fb_relation.AddWeight(builder, float(rel.weight))
        relation_offsets.append(fb_relation.End(builder))
    variable_offsets = []
    for name, code, shape in variables:
        name_off = builder.CreateString(name)
        shape_off = builder.CreateNumpyVector(np.asarray(shape, dtype="<i8"))
        fb_variable.Start(builder)
        fb_variable.AddName(builder, name_off)
        fb_variable.AddDtype(builder, code)
        fb_variable.AddShape(builder, shape_off)
        variable_offsets.append(fb_variable.End(builder))
    # the scoring graph as operations: one per relation operator side, then the comparator
    operations = []
    dynamic = bool(config.dynamic_relations)
    for idx, rel in enumerate(config.relations):
        for side in ("lhs", "rhs"):
            kind = rel.operator if (side == "rhs" or dynamic) else "none"
            prefix = f"relations/{idx}/operator/{side}/"
            inputs = [v for v, _, _ in variables if v.startswith(prefix)]
            operations.append(_operation(
                builder, f"relations/{idx}/operator/{side}", kind, [f"{side}_embedding"] + inputs,
                [f"relations/{idx}/{side}_transformed"], {"relation": idx, "num_dynamic_relations": len(dynamic_names)},
                {"dynamic": dynamic},
            ))
    operations.append(_operation(builder, "comparator", config.comparator, ["lhs_prepared", "rhs_prepared"], ["score"],
                                 {"dimension": config.dimension}, {"bias": bool(config.bias),
                                                                   "global_emb": bool(config.global_emb)}))
    entity_vec = _tables(builder, entity_offsets)
    relation_vec = _tables(builder, relation_offsets)
    dynamic_vec = _strings(builder, dynamic_names)
    variable_vec = _tables(builder, variable_offsets)
    operation_vec = _tables(builder, operations)
    tag_off = builder.CreateString(tag)
    comparator_off = builder.CreateString(config.comparator)
    fb_graph.Start(builder)
    fb_graph.AddFormatVersion(builder, FORMAT_VERSION)
    fb_graph.AddTag(builder, tag_off)
    fb_graph.AddDimension(builder, config.dimension)
    fb_graph.AddComparator(builder, comparator_off)
    fb_graph.AddBias(builder, bool(config.bias))
    fb_graph.AddDynamicRelations(builder, dynamic)
    fb_graph.AddEntityTypes(builder, entity_vec)
    fb_graph.AddRelationTypes(builder, relation_vec)
    fb_graph.AddDynamicRelationNames(builder, dynamic_vec)
    fb_graph.AddVariables(builder, variable_vec)
    fb_graph.AddOperations(builder, operation_vec)
    builder.Finish(fb_graph.End(builder), file_identifier=GRAPH_IDENTIFIER)
    return bytes(builder.Output())


def _training_flatbuffer(config: ConfigSchema, checkpoint: Any, version: int, dtype: str, has_updater: bool) -> bytes:
    stats = [json.dumps(record, sort_keys=True) for record in checkpoint.load_stats()]
    builder = flatbuffers.Builder(1024 + sum(len(s) for s in stats) * 2)
    config_off = builder.CreateString(config.to_json())
    path_off = builder.CreateString(checkpoint.url)
    stats_off = _strings(builder, stats)
    updater_off = builder.CreateString("row_adagrad (embeddings), adagrad (relation parameters)")
    dtype_off = builder.CreateString(dtype)
    created_off = builder.CreateString(datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    version_off = builder.CreateString(__version__)
    fb_training.Start(builder)
    fb_training.AddConfigJson(builder, config_off)
    fb_training.AddCheckpointPath(builder, path_off)
    fb_training.AddCheckpointVersion(builder, version)
    fb_training.AddTrainingStatsJson(builder, stats_off)
    fb_training.AddUpdater(builder, updater_off)
    fb_training.AddLearningRate(builder, float(config.lr))
    fb_training.AddRelationLearningRate(builder, float(config.relation_lr or config.lr))
    fb_training.AddStorageDtype(builder, dtype_off)
    fb_training.AddCreated(builder, created_off)
    fb_training.AddBiggraphVersion(builder, version_off)
    fb_training.AddHasUpdaterState(builder, has_updater)
    builder.Finish(fb_training.End(builder), file_identifier=TRAINING_IDENTIFIER)
    return bytes(builder.Output())

