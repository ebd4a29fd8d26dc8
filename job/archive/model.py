"""A trained model read from an archive, scored with numpy exactly as ``job.model.scoring`` scores it.

Semantics (PBG's): the embedding of an entity is its table row plus its type's global
embedding (when the model has one); a relation's operator applies to the right-hand side;
the comparator (dot, cos, l2, squared_l2) first *prepares* both sides (cos normalises; with
``bias`` the first coordinate is kept aside and added to the score). So

    score(u, r, v) = comparator(prepare(u + g_lhs), prepare(op_r(v + g_rhs)))

With dynamic relations there is one operator parameter row per relation type, and the
score is the forward (right-hand side) direction of training: the rhs operator row ``r``.
"""

from __future__ import annotations

import importlib.util
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Optional, Union

import numpy as np

from job.archive.errors import ArchiveFormatError, QueryError
from job.archive.ndarray import Decoded
from job.archive.scoring import NumpyComparator, apply_operator

RelationKey = Union[str, int]


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores, best first (ties by lower index)."""
    k = min(k, scores.shape[-1])
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    if k < scores.shape[-1]:
        part = np.argpartition(-scores, k - 1)[:k]
    else:
        part = np.arange(scores.shape[-1])
    order = np.lexsort((part, -scores[part]))
    return part[order]


# the model -------------------------------------------------------------------------------------------


class ArchiveModel:
    """One tag of a model archive, ready for queries. Use as a context manager or call ``close()``."""

    def __init__(self, reader: Any, tag: str, graph: Any, params: dict[str, Decoded], training: dict[str, Any]) -> None:
        self._reader = reader
        self.path: str = reader.path
        self.tag = tag
        self.tags: list[str] = list(reader.tags)
        self.graph = graph
        self.training = training
        self.config: dict[str, Any] = training.get("config", {})
        self.checkpoint_version: int = training.get("checkpoint_version", 0)
        self.storage_dtype: str = training.get("storage_dtype", "")
        self.dimension: int = graph.dimension
        self.comparator = NumpyComparator(graph.comparator, graph.bias)
        self.dynamic = graph.dynamic_relations
        # both sides have an operator copy: dynamic relations, and static ones trained with reciprocal_relations
        self.reciprocal = bool(self.dynamic or self.config.get("reciprocal_relations", False))
        self._decoded = params
        self._float: dict[str, np.ndarray] = {}
        self._names: dict[str, list[str]] = {}
        self._index: dict[str, dict[str, int]] = {}
        self._tables: dict[str, np.ndarray] = {}
        self._candidates: OrderedDict[tuple[Any, ...], tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._faiss: dict[tuple[Any, ...], Any] = {}
        # relation types a query may name: (name, config relation index, dynamic row or None)
        self._relations: list[tuple[str, int, Optional[int]]] = []
        if self.dynamic:
            names = graph.dynamic_relation_names
            self._relations = [(name, 0, row) for row, name in enumerate(names)]
        else:
            self._relations = [(rel.name, idx, None) for idx, rel in enumerate(graph.relation_types)]

    # structure ------------------------------------------------------------------------------------
    @property
    def entity_types(self) -> list[str]:
        return list(self.graph.entity_types)

    @property
    def relation_names(self) -> list[str]:
        return [name for name, _, _ in self._relations]

    def entity_count(self, entity_type: str) -> int:
        return self._type_info(entity_type).count

    def entity_names(self, entity_type: str) -> list[str]:
        """Names in row order (partition 0's rows, then partition 1's, ...)."""
        if entity_type not in self._names:
            info = self._type_info(entity_type)
            names = info.names_blob.decode("utf-8").split("\0") if info.count else []
            if len(names) != info.count:
                raise ArchiveFormatError(self.path, f"entity type '{entity_type}': names index holds {len(names)} names, "
                                                    f"expected {info.count}", f"{self.tag}/graph.fb")
            self._names[entity_type] = names
        return self._names[entity_type]

    def _type_info(self, entity_type: str) -> Any:
        info = self.graph.entity_types.get(entity_type)
        if info is None:
            raise QueryError(f"unknown entity type '{entity_type}' (types: {', '.join(self.graph.entity_types)})")
        return info

    def _row_of(self, entity_type: str) -> dict[str, int]:
        if entity_type not in self._index:
            self._index[entity_type] = {name: i for i, name in enumerate(self.entity_names(entity_type))}
        return self._index[entity_type]

    def locate(self, entity_name: str, entity_type: Optional[str] = None) -> tuple[str, int]:
        """(entity type, row) of a name; the type may be left out when only one type has that name."""
        if entity_type is not None:
            row = self._row_of(entity_type).get(entity_name)
            if row is None:
                raise QueryError(f"unknown entity '{entity_name}' of type '{entity_type}'")
            return entity_type, row
        found = [(t, self._row_of(t)[entity_name]) for t in self.graph.entity_types if entity_name in self._row_of(t)]
        if not found:
            raise QueryError(f"unknown entity '{entity_name}' (in no entity type of tag '{self.tag}')")
        if len(found) > 1:
            raise QueryError(f"entity '{entity_name}' exists in types {', '.join(t for t, _ in found)}: give entity_type")
        return found[0]

    def _relation(self, relation: RelationKey) -> tuple[str, int, Optional[int]]:
        if isinstance(relation, (int, np.integer)) and not isinstance(relation, bool):
            if not 0 <= int(relation) < len(self._relations):
                raise QueryError(f"relation index {relation} out of range (0..{len(self._relations) - 1})")
            return self._relations[int(relation)]
        for entry in self._relations:
            if entry[0] == relation:
                return entry
        shown = ", ".join(self.relation_names[:20]) + (", ..." if len(self._relations) > 20 else "")
        raise QueryError(f"unknown relation '{relation}' (relations: {shown})")

    # arrays ------------------------------------------------------------------------------------------
    def param(self, name: str) -> np.ndarray:
        """A variable as float32 (a read-only view of the file for fp32 tags)."""
        if name not in self._float:
            if name not in self._decoded:
                raise QueryError(f"no variable '{name}' in tag '{self.tag}'")
            self._float[name] = self._decoded[name].to_float32()
        return self._float[name]

    def table(self, entity_type: str) -> np.ndarray:
        """All rows of a type (count, dim) as float32, partitions in order; without the global embedding."""
        if entity_type not in self._tables:
            info = self._type_info(entity_type)
            parts = [self.param(v) for v in info.embeddings]
            self._tables[entity_type] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        return self._tables[entity_type]

    def _rows(self, entity_type: str, rows: Any) -> np.ndarray:
        x = self.table(entity_type)[rows]
        info = self._type_info(entity_type)
        if info.global_embedding:
            x = x + self.param(info.global_embedding)
        return x

    def _operator(self, rel_idx: int, side: str) -> tuple[str, dict[str, np.ndarray]]:
        kind = self.graph.relation_types[rel_idx].operator if (side == "rhs" or self.reciprocal) else "none"
        prefix = f"relations/{rel_idx}/operator/{side}/"
        params = {name[len(prefix):]: self.param(name) for name in self._decoded if name.startswith(prefix)}
        return kind, params

    def _transformed(self, x: np.ndarray, rel_idx: int, row: Optional[int], side: str) -> np.ndarray:
        kind, params = self._operator(rel_idx, side)
        return apply_operator(kind, params, x, row)

    def prepared(self, entity_type: str, relation: Optional[RelationKey] = None, side: str = "rhs") -> np.ndarray:
        """Every entity of a type as the comparator sees it: prepare(op(x + g)), op of ``relation``'s ``side`` if given.

        A few of these are cached, since nearest-neighbour queries reuse them.
        """
        return self._prepared_entry(entity_type, relation, side)[1]

    def _prepared_entry(self, entity_type: str, relation: Optional[RelationKey], side: str) -> tuple[Any, np.ndarray, np.ndarray]:
        rel_idx: Optional[int] = None
        row: Optional[int] = None
        if relation is not None:
            _, rel_idx, row = self._relation(relation)
        key = (entity_type, rel_idx, row, side)
        if key not in self._candidates:
            x = self._rows(entity_type, slice(None))
            if rel_idx is not None:
                x = self._transformed(x, rel_idx, row, side)
            vecs = np.ascontiguousarray(self.comparator.prepare(x), dtype=np.float32)
            sq = (vecs[:, 1:] ** 2).sum(-1) if self.comparator.bias else (vecs**2).sum(-1)
            self._candidates[key] = (vecs, sq)
            while len(self._candidates) > 8:
                dropped, _ = self._candidates.popitem(last=False)
                self._faiss.pop(dropped, None)
        else:
            self._candidates.move_to_end(key)
        vecs, sq = self._candidates[key]
        return key, vecs, sq

    # queries --------------------------------------------------------------------------------------------
    def embedding(self, entity_name: str, entity_type: Optional[str] = None, with_global: bool = True) -> np.ndarray:
        """The entity's embedding (float32 copy): its table row plus the type's global embedding unless disabled."""
        entity_type, row = self.locate(entity_name, entity_type)
        if with_global:
            return np.array(self._rows(entity_type, row), dtype=np.float32)
        return np.array(self.table(entity_type)[row], dtype=np.float32)

    def score(self, lhs: Union[str, Sequence[str]], relation: RelationKey, rhs: Union[str, Sequence[str]]) -> Any:
        """Score of (lhs, relation, rhs); with sequences of names (same length) an array of scores."""
        name, rel_idx, row = self._relation(relation)
        rel = self.graph.relation_types[rel_idx]
        scalar = isinstance(lhs, str) and isinstance(rhs, str)
        lhs_names = [lhs] if isinstance(lhs, str) else list(lhs)
        rhs_names = [rhs] if isinstance(rhs, str) else list(rhs)
        if len(lhs_names) != len(rhs_names):
            if len(lhs_names) == 1:
                lhs_names = lhs_names * len(rhs_names)
            elif len(rhs_names) == 1:
                rhs_names = rhs_names * len(lhs_names)
            else:
                raise QueryError(f"score: {len(lhs_names)} lhs names but {len(rhs_names)} rhs names")
        lhs_rows = np.array([self.locate(n, rel.lhs)[1] for n in lhs_names], dtype=np.int64)
        rhs_rows = np.array([self.locate(n, rel.rhs)[1] for n in rhs_names], dtype=np.int64)
        u = self.comparator.prepare(self._rows(rel.lhs, lhs_rows))
        v = self.comparator.prepare(self._transformed(self._rows(rel.rhs, rhs_rows), rel_idx, row, "rhs"))
        scores = self.comparator.pos(u, v).astype(np.float32)
        return float(scores[0]) if scalar else scores

    def nearest(self, entity_name: str, k: int = 10, relation: Optional[RelationKey] = None,
                entity_type: Optional[str] = None, backend: str = "auto") -> list[tuple[str, float]]:
        """The k best (name, score) pairs, best first.

        Without ``relation``: the entities of the same type closest to this one by the model's
        comparator (on prepared embeddings, global embedding included), itself left out. With
        ``relation``: the right-hand side entities v that best complete (entity, relation, v),
        i.e. the top of ``score(entity, relation, v)`` over every v. Exact; ``backend`` "faiss"
        (or "auto" when faiss is installed and the type has over 100,000 entities) uses a flat
        faiss index for dot/cos/l2/squared_l2 without bias, the same ranking up to float rounding.
        """
        if k < 1:
            raise QueryError(f"k must be at least 1, got {k}")
        if relation is None:
            entity_type, row = self.locate(entity_name, entity_type)
            cand_type = entity_type
            entry = self._prepared_entry(entity_type, None, "rhs")
            anchor = entry[1][row:row + 1]
            exclude: Optional[int] = row
        else:
            _, rel_idx, _ = self._relation(relation)
            rel = self.graph.relation_types[rel_idx]
            if entity_type is None and entity_name not in self._row_of(rel.lhs):
                lhs_type, row = self.locate(entity_name)  # unknown everywhere, or of another type
            else:
                lhs_type, row = self.locate(entity_name, entity_type or rel.lhs)
            if lhs_type != rel.lhs:
                raise QueryError(f"relation '{relation}' takes lhs entities of type '{rel.lhs}', not '{lhs_type}'")
            cand_type = rel.rhs
            entry = self._prepared_entry(rel.rhs, relation, "rhs")
            anchor = self.comparator.prepare(self._rows(lhs_type, np.array([row])))
            exclude = None
        names = self.entity_names(cand_type)
        want = k + (1 if exclude is not None else 0)
        index, scores = self._search(anchor, entry, want, backend)
        out = [(names[i], float(s)) for i, s in zip(index, scores) if i != exclude]
        return out[:k]

    def _search(self, anchor: np.ndarray, entry: tuple[Any, np.ndarray, np.ndarray], want: int,
                backend: str) -> tuple[np.ndarray, np.ndarray]:
        if backend not in ("auto", "numpy", "faiss"):
            raise QueryError(f"unknown backend '{backend}' (auto, numpy or faiss)")
        key, cands, y_sq = entry
        use_faiss = backend == "faiss" or (backend == "auto" and len(cands) > 100_000 and _faiss_available())
        if use_faiss and not self.comparator.bias:
            if key not in self._faiss:
                self._faiss[key] = _faiss_index(self.comparator, cands)
            return _faiss_search(self._faiss[key], self.comparator, anchor, want)
        scores = self.comparator.pairwise(anchor, cands, y_sq)[0]
        best = top_k(scores, want)
        return best, scores[best]

    def close(self) -> None:
        self._float.clear()
        self._tables.clear()
        self._candidates.clear()
        self._faiss.clear()
        self._decoded = {}
        self._reader.close()

    def __enter__(self) -> ArchiveModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ArchiveModel({self.path!r}, tag={self.tag!r}, dtype={self.storage_dtype}, "
                f"types={self.entity_types}, relations={len(self._relations)})")


def _faiss_available() -> bool:
    return importlib.util.find_spec("faiss") is not None


def _faiss_index(comparator: NumpyComparator, cands: np.ndarray) -> Any:
    import faiss  # optional

    dim = cands.shape[1]
    index = faiss.IndexFlatIP(dim) if comparator.spec.dot_product else faiss.IndexFlatL2(dim)
    index.add(np.ascontiguousarray(cands, dtype=np.float32))
    return index


def _faiss_search(index: Any, comparator: NumpyComparator, anchor: np.ndarray,
                  want: int) -> tuple[np.ndarray, np.ndarray]:
    distances, ids = index.search(np.ascontiguousarray(anchor, dtype=np.float32), min(want, index.ntotal))
    scores = distances[0]
    if not comparator.spec.dot_product:  # an L2 index returns squared distances
        scores = comparator.spec.from_squared_distance(scores)
    keep = ids[0] >= 0
    return ids[0][keep].astype(np.int64), scores[keep].astype(np.float32)
