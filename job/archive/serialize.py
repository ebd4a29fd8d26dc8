"""FlatBuffers encoding of a tag's ``graph.fb`` and ``trainingConfig.fb`` (the writing side of loader.read_graph).

Kept apart from :mod:`job.archive.writer` (which reads the checkpoint and lays out the zip) so each
stays small; like the writer, only ``biggraph archive`` imports it, never the torch-free loader.

``graph.fb`` is written as a head built in memory and a tail streamed: each entity type's names index (its
``names_utf8`` vector, as large as the type) never goes through the builder. FlatBuffers are built back to front, and
a uoffset only points forward, so vectors can sit after everything that refers to them: the head is a finished
buffer whose ``names_utf8`` fields point past its own end, at ``[u32 length][bytes][pad to 4]`` entries laid one after
another behind it (``GraphMember``). The head's length is a multiple of its largest alignment (``Finish`` pads it so),
so every object in it keeps its alignment, and the entries behind it are 4-aligned as a vector's length must be. A
reader sees an ordinary buffer (job/archive/loader.py is unchanged; archives written before read as before).
"""

from __future__ import annotations

import datetime
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import flatbuffers
import numpy as np

from job import __version__
from job.archive.fb import EntityType as fb_entity
from job.archive.fb import Graph as fb_graph
from job.archive.fb import Operation as fb_operation
from job.archive.fb import RelationType as fb_relation
from job.archive.fb import TrainingConfig as fb_training
from job.archive.fb import Variable as fb_variable
from job.archive.loader import FORMAT_VERSION, GRAPH_IDENTIFIER, TRAINING_IDENTIFIER
from job.archive.names import NamesIndex
from job.config import ConfigSchema

# (name, dtype code, shape) of each variable of a tag, in graph.fb order
Variable = tuple[str, int, tuple[int, ...]]
_NAMES_SLOT = 6  # EntityType.names_utf8 (job/archive/schema/graph.fbs); fb_entity.AddNamesUtf8 writes this slot


def _entry_size(names: NamesIndex) -> int:
    """Bytes of a names vector behind the head: its length, its bytes, padding to the next 4-byte boundary."""
    return 4 + names.size + (-names.size) % 4


@dataclass
class GraphMember:
    """A tag's ``graph.fb``: ``head`` (everything but the names indexes), then each type's names vector."""

    head: bytes
    names: list[NamesIndex]

    @property
    def size(self) -> int:
        return len(self.head) + sum(_entry_size(n) for n in self.names)

    def chunks(self) -> Iterator[bytes]:
        yield self.head
        for names in self.names:
            yield struct.pack("<I", names.size)
            yield from names.chunks()
            yield b"\0" * ((-names.size) % 4)


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


def _entity_type_offsets(builder: flatbuffers.Builder, entity_types: list[dict[str, Any]]) -> list[int]:
    names_at, behind = [], 0  # where each type's names vector starts behind the head
    for e in entity_types:
        names_at.append(behind)
        behind += _entry_size(e["names"])
    offsets: list[int] = []
    for index, e in enumerate(entity_types):
        name = builder.CreateString(e["name"])
        counts = builder.CreateNumpyVector(np.asarray(e["partition_counts"], dtype="<i8"))
        tables = _strings(builder, e["embeddings"])
        global_off = builder.CreateString(e["global"]) if e["global"] else None
        fb_entity.Start(builder)
        fb_entity.AddName(builder, name)
        fb_entity.AddCount(builder, e["count"])
        fb_entity.AddPartitionCounts(builder, counts)
        fb_entity.AddDimension(builder, e["dimension"])
        fb_entity.AddEmbeddings(builder, tables)
        if global_off is not None:
            fb_entity.AddGlobalEmbedding(builder, global_off)
        # its names vector lies behind the head (see the module docstring): an offset from the buffer's end,
        # negative, set without AddNamesUtf8, which drops a field whose value is 0 (the first type's)
        builder.PrependUOffsetTRelative(-names_at[index])
        builder.Slot(_NAMES_SLOT)
        fb_entity.AddNamesGenerated(builder, e["names"].generated)
        offsets.append(fb_entity.End(builder))
    return offsets


def _relation_type_offsets(builder: flatbuffers.Builder, config: ConfigSchema) -> list[int]:
    offsets = []
    for rel in config.relations:
        strings = [builder.CreateString(s) for s in (rel.name, rel.lhs, rel.rhs, rel.operator)]
        fb_relation.Start(builder)
        fb_relation.AddName(builder, strings[0])
        fb_relation.AddLhs(builder, strings[1])
        fb_relation.AddRhs(builder, strings[2])
        fb_relation.AddOperator(builder, strings[3])
        fb_relation.AddWeight(builder, float(rel.weight))
        offsets.append(fb_relation.End(builder))
    return offsets


def _variable_offsets(builder: flatbuffers.Builder, variables: list[Variable]) -> list[int]:
    offsets = []
    for name, code, shape in variables:
        name_off = builder.CreateString(name)
        shape_off = builder.CreateNumpyVector(np.asarray(shape, dtype="<i8"))
        fb_variable.Start(builder)
        fb_variable.AddName(builder, name_off)
        fb_variable.AddDtype(builder, code)
        fb_variable.AddShape(builder, shape_off)
        offsets.append(fb_variable.End(builder))
    return offsets


def _operation_offsets(builder: flatbuffers.Builder, config: ConfigSchema, variables: list[Variable],
                       num_dynamic: int) -> list[int]:
    """The scoring graph as operations: one per relation operator side, then the comparator."""
    operations = []
    dynamic = bool(config.dynamic_relations)
    for idx, rel in enumerate(config.relations):
        for side in ("lhs", "rhs"):
            kind = rel.operator if (side == "rhs" or dynamic or config.reciprocal_relations) else "none"
            prefix = f"relations/{idx}/operator/{side}/"
            inputs = [v for v, _, _ in variables if v.startswith(prefix)]
            operations.append(_operation(
                builder, f"relations/{idx}/operator/{side}", kind, [f"{side}_embedding"] + inputs,
                [f"relations/{idx}/{side}_transformed"], {"relation": idx, "num_dynamic_relations": num_dynamic},
                {"dynamic": dynamic},
            ))
    operations.append(_operation(builder, "comparator", config.comparator, ["lhs_prepared", "rhs_prepared"], ["score"],
                                 {"dimension": config.dimension}, {"bias": bool(config.bias),
                                                                   "global_emb": bool(config.global_emb)}))
    return operations


def graph_member(config: ConfigSchema, tag: str, entity_types: list[dict[str, Any]], variables: list[Variable],
                 dynamic_names: list[str]) -> GraphMember:
    """The ``graph.fb`` of a tag: entity and relation types (``names``: each type's spooled ``NamesIndex``), variables
    (name, dtype, shape) and the scoring ops."""
    builder = flatbuffers.Builder(4096 + 256 * len(variables) + 64 * len(dynamic_names))
    entity_vec = _tables(builder, _entity_type_offsets(builder, entity_types))
    relation_vec = _tables(builder, _relation_type_offsets(builder, config))
    variable_vec = _tables(builder, _variable_offsets(builder, variables))
    operation_vec = _tables(builder, _operation_offsets(builder, config, variables, len(dynamic_names)))
    dynamic_vec = _strings(builder, dynamic_names)
    tag_off = builder.CreateString(tag)
    comparator_off = builder.CreateString(config.comparator)
    fb_graph.Start(builder)
    fb_graph.AddFormatVersion(builder, FORMAT_VERSION)
    fb_graph.AddTag(builder, tag_off)
    fb_graph.AddDimension(builder, config.dimension)
    fb_graph.AddComparator(builder, comparator_off)
    fb_graph.AddBias(builder, bool(config.bias))
    fb_graph.AddDynamicRelations(builder, bool(config.dynamic_relations))
    fb_graph.AddEntityTypes(builder, entity_vec)
    fb_graph.AddRelationTypes(builder, relation_vec)
    fb_graph.AddDynamicRelationNames(builder, dynamic_vec)
    fb_graph.AddVariables(builder, variable_vec)
    fb_graph.AddOperations(builder, operation_vec)
    builder.Finish(fb_graph.End(builder), file_identifier=GRAPH_IDENTIFIER)
    return GraphMember(bytes(builder.Output()), [e["names"] for e in entity_types])


def training_flatbuffer(config: ConfigSchema, checkpoint: Any, version: int, dtype: str, has_updater: bool) -> bytes:
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

