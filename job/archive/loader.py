"""Reading a tag of a model archive: checks, then a torch-free :class:`~job.archive.model.ArchiveModel`.

Needs only numpy and flatbuffers (and the standard library). What ``load`` checks before it
returns, each failure an :class:`~job.archive.errors.ArchiveError` naming the member:

- tags.txt: present, valid names, no duplicates (case-insensitive); the tag asked for exists;
  no member lives under a folder that is not a listed tag;
- every member the tag uses (its own and those its params.txt/updater.txt refer to in other
  tags): present, stored uncompressed, not truncated, CRC-32 as recorded;
- graph.fb / trainingConfig.fb / NDArrays: the right file identifiers, walkable;
- every variable of graph.fb has exactly one params.txt entry and its array has the declared
  shape and dtype; entity counts agree with the tables and the names index.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

import flatbuffers

from job.archive import container
from job.archive.container import Ref, ZipReader
from job.archive.errors import ArchiveFormatError, DanglingReferenceError, ShapeMismatchError, TagError
from job.archive.fb import Graph as fb_graph
from job.archive.fb import TrainingConfig as fb_training
from job.archive.model import ArchiveModel
from job.archive.ndarray import DTYPE_NAMES, Decoded, decode

GRAPH_IDENTIFIER = b"BGGR"
TRAINING_IDENTIFIER = b"BGTC"
FORMAT_VERSION = 1


@dataclass
class EntityTypeInfo:
    name: str
    count: int
    partition_counts: list[int]
    dimension: int
    embeddings: list[str]
    global_embedding: Optional[str]
    names_blob: bytes
    names_generated: bool


@dataclass
class RelationInfo:
    name: str
    lhs: str
    rhs: str
    operator: str
    weight: float


@dataclass
class OperationInfo:
    name: str
    op_type: str
    inputs: list[str]
    args: dict[str, Any]


@dataclass
class GraphInfo:
    tag: str
    dimension: int
    comparator: str
    bias: bool
    dynamic_relations: bool
    entity_types: dict[str, EntityTypeInfo]
    relation_types: list[RelationInfo]
    dynamic_relation_names: list[str]
    variables: dict[str, tuple[int, tuple[int, ...]]]  # name -> (dtype code, shape)
    operations: list[OperationInfo] = field(default_factory=list)


def _s(value: Optional[bytes]) -> str:
    return value.decode("utf-8") if value is not None else ""


def _strings(obj: Any, length: str, getter: str) -> list[str]:
    return [_s(getattr(obj, getter)(i)) for i in range(getattr(obj, length)())]


def read_graph(buf: memoryview, archive: str, member: str) -> GraphInfo:
    if len(buf) < 8 or not flatbuffers.util.BufferHasIdentifier(buf, 0, GRAPH_IDENTIFIER):
        raise ArchiveFormatError(archive, "not a graph FlatBuffer (file identifier BGGR missing)", member)
    try:
        g = fb_graph.Graph.GetRootAs(buf, 0)
        if g.FormatVersion() != FORMAT_VERSION:
            raise ArchiveFormatError(archive, f"format_version {g.FormatVersion()} (this reader knows {FORMAT_VERSION})",
                                     member)
        entity_types: dict[str, EntityTypeInfo] = {}
        for i in range(g.EntityTypesLength()):
            e = g.EntityTypes(i)
            blob = e.NamesUtf8AsNumpy()
            entity_types[_s(e.Name())] = EntityTypeInfo(
                name=_s(e.Name()),
                count=e.Count(),
                partition_counts=[int(c) for c in e.PartitionCountsAsNumpy()] if not e.PartitionCountsIsNone() else [],
                dimension=e.Dimension(),
                embeddings=_strings(e, "EmbeddingsLength", "Embeddings"),
                global_embedding=_s(e.GlobalEmbedding()) or None,
                names_blob=blob.tobytes() if not isinstance(blob, int) else b"",
                names_generated=e.NamesGenerated(),
            )
        relations = []
        for i in range(g.RelationTypesLength()):
            r = g.RelationTypes(i)
            relations.append(RelationInfo(_s(r.Name()), _s(r.Lhs()), _s(r.Rhs()), _s(r.Operator()), r.Weight()))
        variables: dict[str, tuple[int, tuple[int, ...]]] = {}
        for i in range(g.VariablesLength()):
            v = g.Variables(i)
            shape = tuple(int(s) for s in v.ShapeAsNumpy()) if not v.ShapeIsNone() else ()
            variables[_s(v.Name())] = (v.Dtype(), shape)
        operations = []
        for i in range(g.OperationsLength()):
            op = g.Operations(i)
            args: dict[str, Any] = {}
            for names_len, name_get, value_get in (
                ("IArgNamesLength", "IArgNames", "IArgs"), ("TArgNamesLength", "TArgNames", "TArgs"),
                ("BArgNamesLength", "BArgNames", "BArgs"), ("DArgNamesLength", "DArgNames", "DArgs"),
            ):
                for j in range(getattr(op, names_len)()):
                    args[_s(getattr(op, name_get)(j))] = getattr(op, value_get)(j)
            operations.append(OperationInfo(_s(op.Name()), _s(op.OpType()), _strings(op, "InputsLength", "Inputs"), args))
        return GraphInfo(
            tag=_s(g.Tag()), dimension=g.Dimension(), comparator=_s(g.Comparator()), bias=g.Bias(),
            dynamic_relations=g.DynamicRelations(), entity_types=entity_types, relation_types=relations,
            dynamic_relation_names=_strings(g, "DynamicRelationNamesLength", "DynamicRelationNames"),
            variables=variables, operations=operations,
        )
    except ArchiveFormatError:
        raise
    except Exception as err:  # any failure to walk the buffer means the same thing
        raise ArchiveFormatError(archive, f"malformed graph FlatBuffer ({type(err).__name__}: {err})", member) from None


def read_training(buf: memoryview, archive: str, member: str) -> dict[str, Any]:
    if len(buf) < 8 or not flatbuffers.util.BufferHasIdentifier(buf, 0, TRAINING_IDENTIFIER):
        raise ArchiveFormatError(archive, "not a training-config FlatBuffer (file identifier BGTC missing)", member)
    try:
        t = fb_training.TrainingConfig.GetRootAs(buf, 0)
        stats = [json.loads(s) for s in _strings(t, "TrainingStatsJsonLength", "TrainingStatsJson")]
        return {
            "config": json.loads(_s(t.ConfigJson()) or "{}"),
            "checkpoint_path": _s(t.CheckpointPath()),
            "checkpoint_version": t.CheckpointVersion(),
            "training_stats": stats,
            "updater": _s(t.Updater()),
            "learning_rate": t.LearningRate(),
            "relation_learning_rate": t.RelationLearningRate(),
            "storage_dtype": _s(t.StorageDtype()),
            "created": _s(t.Created()),
            "biggraph_version": _s(t.BiggraphVersion()),
            "has_updater_state": t.HasUpdaterState(),
        }
    except Exception as err:
        raise ArchiveFormatError(archive, f"malformed training-config FlatBuffer ({type(err).__name__}: {err})",
                                 member) from None


class ArchiveReader:
    """An open archive: its tags and, per tag, the checked graph, params and updater state."""

    def __init__(self, path: str, verify_crc: bool = True) -> None:
        self.path = path
        self.verify_crc = verify_crc
        self.zip = ZipReader(path)
        if container.TAGS_FILE not in self.zip:
            self.zip.close()
            raise TagError(path, "missing (not a biggraph model archive?)", container.TAGS_FILE)
        try:
            self.tags = container.parse_tags(self.zip.text(container.TAGS_FILE), path)
            self._check_folders()
        except Exception:
            self.zip.close()
            raise

    def _check_folders(self) -> None:
        known = {t for t in self.tags}
        for name in self.zip.names():
            if name == container.TAGS_FILE:
                continue
            folder = name.split("/", 1)[0]
            if folder not in known or "/" not in name:
                if folder.casefold() in {t.casefold() for t in known}:
                    raise TagError(self.path, f"folder '{folder}' differs in case from its tag in tags.txt", name)
                raise TagError(self.path, f"belongs to no tag: '{folder}' is not listed in tags.txt", name)

    def member(self, name: str) -> memoryview:
        return self.zip.member(name, verify=self.verify_crc)

    def graph(self, tag: str) -> GraphInfo:
        member = f"{tag}/{container.GRAPH_FILE}"
        return read_graph(self.member(member), self.path, member)

    def training(self, tag: str) -> dict[str, Any]:
        member = f"{tag}/{container.TRAINING_FILE}"
        return read_training(self.member(member), self.path, member)

    def refs(self, tag: str, updater: bool = False) -> dict[str, list[Ref]]:
        member = f"{tag}/{container.UPDATER_FILE if updater else container.PARAMS_FILE}"
        if updater and member not in self.zip:
            return {}
        return container.parse_refs(self.zip_text(member), tag, self.tags, self.path, member, single=not updater)

    def zip_text(self, member: str) -> str:
        try:
            return bytes(self.member(member)).decode("utf-8")
        except UnicodeDecodeError:
            raise ArchiveFormatError(self.path, "not UTF-8 text", member) from None

    def array(self, ref: Ref, directory: str) -> tuple[str, Decoded]:
        member = ref.member(directory)
        if member not in self.zip:
            raise DanglingReferenceError(self.path, "missing: a params.txt/updater.txt entry refers to it", member)
        return member, decode(self.member(member), self.path, member)

    def load_tag(self, tag: str, with_updater: bool = False) -> tuple[GraphInfo, dict[str, Decoded], dict[str, Any],
                                                                      dict[str, list[Decoded]]]:
        graph = self.graph(tag)
        training = self.training(tag)
        params_member = f"{tag}/{container.PARAMS_FILE}"
        refs = self.refs(tag)
        missing = [v for v in graph.variables if v not in refs]
        if missing:
            raise DanglingReferenceError(self.path, f"has no entry for variable '{missing[0]}' of graph.fb", params_member)
        extra = [v for v in refs if v not in graph.variables]
        if extra:
            raise ArchiveFormatError(self.path, f"lists '{extra[0]}', which graph.fb does not declare", params_member)
        params: dict[str, Decoded] = {}
        for name, (dtype, shape) in graph.variables.items():
            member, decoded = self.array(refs[name][0], container.PARAMS_DIR)
            if decoded.shape != shape:
                raise ShapeMismatchError(self.path, f"variable '{name}' has shape {decoded.shape} but graph.fb declares "
                                                    f"{shape}", member)
            if decoded.dtype != dtype:
                raise ShapeMismatchError(self.path, f"variable '{name}' is {DTYPE_NAMES.get(decoded.dtype, decoded.dtype)} "
                                                    f"but graph.fb declares {DTYPE_NAMES.get(dtype, dtype)}", member)
            params[name] = decoded
        _check_graph(graph, self.path, f"{tag}/{container.GRAPH_FILE}")
        updater: dict[str, list[Decoded]] = {}
        if with_updater:
            updater_member = f"{tag}/{container.UPDATER_FILE}"
            for name, state_refs in self.refs(tag, updater=True).items():
                if name not in graph.variables:
                    raise DanglingReferenceError(self.path, f"names variable '{name}', which graph.fb does not declare",
                                                 updater_member)
                updater[name] = [self.array(r, container.UPDATER_DIR)[1] for r in state_refs]
        return graph, params, training, updater

    def close(self) -> None:
        self.zip.close()


def _check_graph(graph: GraphInfo, archive: str, member: str) -> None:
    for info in graph.entity_types.values():
        if sum(info.partition_counts) != info.count or len(info.embeddings) != len(info.partition_counts):
            raise ArchiveFormatError(archive, f"entity type '{info.name}': count {info.count} does not match partitions "
                                              f"{info.partition_counts} / tables {info.embeddings}", member)
        for part, (var, count) in enumerate(zip(info.embeddings, info.partition_counts)):
            if var not in graph.variables:
                raise DanglingReferenceError(archive, f"entity type '{info.name}' names undeclared variable '{var}'", member)
            shape = graph.variables[var][1]
            if shape != (count, info.dimension):
                raise ShapeMismatchError(archive, f"table '{var}' of partition {part} is declared {shape}, expected "
                                                  f"({count}, {info.dimension})", member)
        if info.global_embedding and info.global_embedding not in graph.variables:
            raise DanglingReferenceError(archive, f"entity type '{info.name}' names undeclared variable "
                                                  f"'{info.global_embedding}'", member)
    for rel in graph.relation_types:
        for side in (rel.lhs, rel.rhs):
            if side not in graph.entity_types:
                raise ArchiveFormatError(archive, f"relation '{rel.name}' names unknown entity type '{side}'", member)


def load(path: str, tag: Optional[str] = None, verify_crc: bool = True) -> Any:
    """Open ``tag`` (case-insensitive; the newest when None) of the archive at ``path`` as an ArchiveModel.

    fp32 tables are views of the memory-mapped file (no copy); fp16/int8 ones are decoded to
    float32 when first used. ``verify_crc`` checks the CRC-32 of every member the tag uses.
    """
    reader = ArchiveReader(path, verify_crc=verify_crc)
    try:
        chosen = container.find_tag(reader.tags, tag, path)
        graph, params, training, _ = reader.load_tag(chosen)
    except Exception:
        reader.close()
        raise
    return ArchiveModel(reader, chosen, graph, params, training)


def list_tags(path: str) -> list[str]:
    reader = ArchiveReader(path)
    try:
        return list(reader.tags)
    finally:
        reader.close()


def verify(path: str) -> dict[str, Any]:
    """Check every tag (CRC of every member, references, shapes, dtypes, updater state); a summary per tag."""
    reader = ArchiveReader(path, verify_crc=True)
    try:
        summary: dict[str, Any] = {}
        for tag in reader.tags:
            _, params, training, updater = reader.load_tag(tag, with_updater=True)
            summary[tag] = {
                "variables": len(params), "updater_variables": len(updater),
                "checkpoint_version": training["checkpoint_version"], "storage_dtype": training["storage_dtype"],
            }
        for name in reader.zip.names():  # members nobody refers to are still checked for corruption
            reader.member(name)
        return summary
    finally:
        reader.close()
