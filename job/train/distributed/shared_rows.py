"""Which values of the shared vector belong to which relation: ``RowLayout``, what lets a bucket's change carry only
the rows it touched and a trainer pull only the rows its next bucket reads (issue #45).

Why by relation: with ``dynamic_relations`` every operator parameter and its Adagrad sums hold one row per relation
type (Freebase86m: 14,824), and a bucket of a few thousand edges uses a few hundred of them. A dense push and pull
moved the whole vector (11.86 MB) both ways per bucket; the rows a bucket used are ~2% of it.

The layout: ``segments`` are the relation-indexed tensors, each ``(offset, width)`` in the flat vector (relation r's
values of it are ``[offset + r * width, offset + (r + 1) * width)``); every other value (static operators, global
embeddings, unpartitioned tables) is *whole* and always travels. A sparse payload is the whole values in vector
order, then for each row named (ascending) its values of each segment in turn. Both ends build the same layout
from the same tensors (rank 0's server from its own trainer's), so only row ids go on the wire.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

# a sparse push or pull is used while it moves at most this fraction of the vector's values (beyond, the dense
# round trip of before is as cheap and takes one request, not two); ``BIGGRAPH_SHARED_SPARSE_AT_MOST`` sets another
# (0: always dense; 1: sparse whenever the model has relation rows, as the real-group test runs it)
SPARSE_AT_MOST = 0.5
SPARSE_AT_MOST_ENV = "BIGGRAPH_SHARED_SPARSE_AT_MOST"


def sparse_at_most() -> float:
    """``SPARSE_AT_MOST``, or the fraction in ``BIGGRAPH_SHARED_SPARSE_AT_MOST`` (a number in [0, 1])."""
    text = os.environ.get(SPARSE_AT_MOST_ENV, "").strip()
    if not text:
        return SPARSE_AT_MOST
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{SPARSE_AT_MOST_ENV}={text!r}: not a fraction of the shared vector in [0, 1]")
    return value


@dataclass(frozen=True)
class RowLayout:
    """The relation-indexed parts of a shared vector of ``size`` values (see the module docstring)."""

    size: int
    rows: int = 0  # relation types (0: nothing indexed, every push and pull is dense)
    segments: tuple[tuple[int, int], ...] = ()
    _whole: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), compare=False, repr=False)
    at_most: float = field(default_factory=sparse_at_most, compare=False)  # (``SPARSE_AT_MOST``)

    @classmethod
    def of(cls, size: int, rows: int, segments: Sequence[tuple[int, int]]) -> RowLayout:
        """A layout, checked: segments inside the vector, not overlapping."""
        mask = np.ones(size, dtype=bool)
        for offset, width in segments:
            if rows <= 0 or width <= 0 or offset < 0 or offset + rows * width > size \
                    or not mask[offset:offset + rows * width].all():
                raise ValueError(f"a relation-indexed segment ({offset}, {width}) x {rows} rows does not fit a "
                                 f"shared vector of {size} values")
            mask[offset:offset + rows * width] = False
        return cls(size, rows if segments else 0, tuple(segments), np.flatnonzero(mask).astype(np.int64))

    @classmethod
    def dense(cls, size: int) -> RowLayout:
        return cls.of(size, 0, ())

    @classmethod
    def of_tensors(cls, tensors: Sequence[torch.Tensor], indexed: Sequence[bool], rows: int) -> RowLayout:
        """The layout of ``tensors`` flattened in order, ``indexed[i]`` saying whether tensor i has one row per
        relation (its first dimension: ``rows``)."""
        segments, offset = [], 0
        for tensor, by_row in zip(tensors, indexed):
            if by_row and rows > 0 and tensor.dim() >= 1 and tensor.shape[0] == rows:
                segments.append((offset, tensor.numel() // rows))
            offset += tensor.numel()
        return cls.of(offset, rows, segments)

    @property
    def row_values(self) -> int:
        """Values of one relation's row, all segments together."""
        return sum(width for _, width in self.segments)

    @property
    def whole_values(self) -> int:
        return int(self._whole.size)

    def count(self, rows: int) -> int:
        """Values of a sparse payload naming ``rows`` rows."""
        return self.whole_values + rows * self.row_values

    def worth(self, rows: int) -> bool:
        """Whether a sparse payload of ``rows`` rows is worth a request of its own (see ``SPARSE_AT_MOST``)."""
        return self.rows > 0 and self.count(rows) <= self.at_most * self.size

    def check(self, rows: np.ndarray, values: Optional[int] = None) -> np.ndarray:
        """``rows`` as int64 if they are ascending, distinct and relation ids of this layout, and (``values``) a
        payload of that many values carries exactly them; ``ValueError`` naming what is wrong otherwise."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.rows == 0:
            raise ValueError("rows named, but these shared parameters have no relation-indexed rows")
        if rows.ndim != 1 or (rows.size and (rows[0] < 0 or rows[-1] >= self.rows or (np.diff(rows) <= 0).any())):
            raise ValueError(f"rows must be ascending distinct relation ids in [0, {self.rows}); got "
                             f"{rows.size} rows from {rows[:1].tolist()} to {rows[-1:].tolist()}")
        if values is not None and values != self.count(rows.size):
            raise ValueError(f"a payload of {values} values for {rows.size} rows (they hold {self.count(rows.size)})")
        return rows

    def positions(self, rows: np.ndarray) -> np.ndarray:
        """The flat positions of a sparse payload naming ``rows`` (checked), in payload order."""
        rows = np.asarray(rows, dtype=np.int64)
        if not self.segments:
            return self._whole
        parts = [offset + rows[:, None] * width + np.arange(width)[None, :] for offset, width in self.segments]
        return np.concatenate([self._whole, np.concatenate(parts, axis=1).reshape(-1)])

    def gather(self, vector: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
        """``vector``'s values of a sparse payload naming ``rows`` (checked) into ``out``, row by row through each
        segment's (rows, width) view: no flat position is built (2k rows: 0.1 ms, where positions and a take of
        them cost 1 ms)."""
        whole = self.whole_values
        np.take(vector, self._whole, out=out[:whole])
        by_row = out[whole:].reshape(rows.size, self.row_values)
        column = 0
        for offset, width in self.segments:
            by_row[:, column:column + width] = vector[offset:offset + self.rows * width].reshape(self.rows, width)[rows]
            column += width

    def scatter_add(self, vector: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
        """Add a sparse payload's ``values`` (naming ``rows``, checked: distinct) into ``vector``."""
        whole = self.whole_values
        vector[self._whole] += values[:whole]
        by_row = values[whole:].reshape(rows.size, self.row_values)
        column = 0
        for offset, width in self.segments:
            vector[offset:offset + self.rows * width].reshape(self.rows, width)[rows] += by_row[:, column:column + width]
            column += width

    def differing(self, now: np.ndarray, before: np.ndarray) -> np.ndarray:
        """The rows where ``now`` (a whole vector) differs from ``before`` in any value, ascending: a trainer's
        changed rows since it last synced them, found without computing the change of the whole vector."""
        touched = np.zeros(self.rows, dtype=bool)
        for offset, width in self.segments:
            span = slice(offset, offset + self.rows * width)
            touched |= (now[span] != before[span]).reshape(self.rows, width).any(axis=1)
        return np.flatnonzero(touched)
