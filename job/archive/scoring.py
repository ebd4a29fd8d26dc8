"""The numpy twin of ``job.model``'s operators and comparators, for serving archives without torch.

Each operator and comparator is registered under the same name as its torch counterpart, in
registries declared over the same names (``job.model.names``); tests/test_model_registry.py holds
the two registries to the same name sets, and tests/test_archive.py holds their scores to the
trainer's. Only ``job.model.names`` and ``job.model.registry`` are shared: both are pure Python,
so this module needs numpy alone. Losses have no twin: an archive is only ever scored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import numpy as np

from job.model import names
from job.model.registry import Registry

Getter = Callable[[str], np.ndarray]  # a parameter by its static name (a dynamic relation's row already chosen)
NumpyOperator = Callable[[np.ndarray, Getter], np.ndarray]

NUMPY_OPERATORS: Registry[NumpyOperator] = Registry("operator", names.OPERATORS)


def apply_operator(kind: str, params: dict[str, np.ndarray], x: np.ndarray, row: Optional[int] = None) -> np.ndarray:
    """``Operator.forward`` for rows ``x`` (..., dim); ``row`` selects a dynamic relation's parameters."""

    def get(name: str) -> np.ndarray:
        if row is None:
            return params[name]
        return params[name + "s"][row] if name + "s" in params else params[name][row]

    return NUMPY_OPERATORS.get(kind)(x, get)


@NUMPY_OPERATORS.register("none")
def _none(x: np.ndarray, get: Getter) -> np.ndarray:
    return x


@NUMPY_OPERATORS.register("diagonal")
def _diagonal(x: np.ndarray, get: Getter) -> np.ndarray:
    return x * get("diagonal")


@NUMPY_OPERATORS.register("translation")
def _translation(x: np.ndarray, get: Getter) -> np.ndarray:
    return x + get("translation")


@NUMPY_OPERATORS.register("linear")
def _linear(x: np.ndarray, get: Getter) -> np.ndarray:
    return x @ get("linear_transformation").T


@NUMPY_OPERATORS.register("affine")
def _affine(x: np.ndarray, get: Getter) -> np.ndarray:
    return _linear(x, get) + get("translation")


@NUMPY_OPERATORS.register("complex_diagonal")
def _complex_diagonal(x: np.ndarray, get: Getter) -> np.ndarray:
    half = x.shape[-1] // 2
    real_b, imag_b = get("real"), get("imag")
    real_a, imag_a = x[..., :half], x[..., half:]
    return np.concatenate((real_a * real_b - imag_a * imag_b, real_a * imag_b + imag_a * real_b), axis=-1)


class NumpyComparatorKind:
    """One kind of comparator on vectors without the bias coordinate (``job.model.comparators``' twin)."""

    # scores prepared vectors by a dot product (faiss: an inner-product index); else by a squared distance
    dot_product = True

    @staticmethod
    def prepare(x: np.ndarray) -> np.ndarray:
        return x

    @staticmethod
    def from_squared_distance(squared: np.ndarray) -> np.ndarray:
        """The score of a pair at this squared distance (distance comparators only)."""
        raise NotImplementedError


NUMPY_COMPARATORS: Registry[type[NumpyComparatorKind]] = Registry("comparator", names.COMPARATORS)


@NUMPY_COMPARATORS.register("dot")
class _Dot(NumpyComparatorKind):
    pass


@NUMPY_COMPARATORS.register("cos")
class _Cos(NumpyComparatorKind):
    @staticmethod
    def prepare(x: np.ndarray) -> np.ndarray:
        norm = np.sqrt((x * x).sum(-1, keepdims=True))
        return x * np.reciprocal(np.maximum(norm, np.float32(1e-30)))


@NUMPY_COMPARATORS.register("squared_l2")
class _SquaredL2(NumpyComparatorKind):
    dot_product = False

    @staticmethod
    def from_squared_distance(squared: np.ndarray) -> np.ndarray:
        return -squared


@NUMPY_COMPARATORS.register("l2")
class _L2(NumpyComparatorKind):
    dot_product = False

    @staticmethod
    def from_squared_distance(squared: np.ndarray) -> np.ndarray:
        return -np.sqrt(np.maximum(squared, np.float32(1e-30)))


class NumpyComparator:
    """``job.model.comparators.Comparator`` in numpy: a registered kind plus PBG's ``bias`` coordinate."""

    def __init__(self, kind: str, bias: bool) -> None:
        self.spec = NUMPY_COMPARATORS.get(kind)
        self.kind = kind
        self.bias = bias

    def prepare(self, x: np.ndarray) -> np.ndarray:
        if self.bias:
            return np.concatenate((x[..., :1], self.spec.prepare(x[..., 1:])), axis=-1)
        return self.spec.prepare(x)

    def pos(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Scores of matching rows of x and y."""
        if self.bias:
            return self._pos(x[..., 1:], y[..., 1:]) + x[..., 0] + y[..., 0]
        return self._pos(x, y)

    def _pos(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        if self.spec.dot_product:
            return (x * y).sum(-1)
        return self.spec.from_squared_distance(((x - y) ** 2).sum(-1))

    def pairwise(self, x: np.ndarray, y: np.ndarray, y_sq: Optional[np.ndarray] = None) -> np.ndarray:
        """All scores of rows x (A, d) against rows y (B, d): (A, B); ``y_sq``: the rows' squared norms if known."""
        if self.bias:
            scores = self._pairwise(x[..., 1:], y[..., 1:], y_sq)
            return scores + x[..., 0][..., None] + y[..., 0][None, :]
        return self._pairwise(x, y, y_sq)

    def _pairwise(self, x: np.ndarray, y: np.ndarray, y_sq: Optional[np.ndarray]) -> np.ndarray:
        dots = x @ y.T
        if self.spec.dot_product:
            return dots
        if y_sq is None:
            y_sq = (y * y).sum(-1)
        return self.spec.from_squared_distance(np.maximum((x * x).sum(-1)[:, None] + y_sq[None, :] - 2 * dots,
                                                          np.float32(0)))
