"""PBG's comparators in torch, one registered class per name of ``job.model.names.COMPARATORS``.

A comparator kind *prepares* vectors (``cos`` normalises them) and scores prepared vectors either
by their dot product or as a function of their squared distance (``l2``, ``squared_l2``).
``Comparator`` turns a kind into scores of matching rows (``pos``) or of all pairs (``pairwise``,
batched: C x P x d against C x N x d), with PBG's ``bias`` option on top of any kind: the first
coordinate is kept out of the comparison and added to the score. The numpy twin used to serve
archives, registered under the same names, is ``job.archive.scoring``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from job.model import names
from job.model.registry import Registry


class ComparatorKind:
    """One kind of comparator, on vectors without the bias coordinate."""

    # scores prepared vectors by a plain dot product (then the fused, hand-differentiated path applies);
    # otherwise by ``from_squared_distance``
    dot_product = True

    @staticmethod
    def prepare(x: Tensor) -> Tensor:
        return x

    @staticmethod
    def from_squared_distance(squared: Tensor) -> Tensor:
        """The score of a pair at this squared distance (distance comparators only)."""
        raise NotImplementedError


COMPARATORS: Registry[type[ComparatorKind]] = Registry("comparator", names.COMPARATORS)


@COMPARATORS.register("dot")
class DotComparator(ComparatorKind):
    pass


@COMPARATORS.register("cos")
class CosComparator(ComparatorKind):
    """The dot product of vectors scaled to unit length when prepared."""

    @staticmethod
    def prepare(x: Tensor) -> Tensor:
        return x * x.norm(2, dim=-1, keepdim=True).clamp_min(1e-30).reciprocal()


@COMPARATORS.register("squared_l2")
class SquaredL2Comparator(ComparatorKind):
    dot_product = False

    @staticmethod
    def from_squared_distance(squared: Tensor) -> Tensor:
        return -squared


@COMPARATORS.register("l2")
class L2Comparator(ComparatorKind):
    """Minus the Euclidean distance (clamped away from 0, where the square root has no gradient)."""

    dot_product = False

    @staticmethod
    def from_squared_distance(squared: Tensor) -> Tensor:
        return -squared.clamp_min(1e-30).sqrt()


class Comparator:
    """Scores pairs of prepared vectors. ``pairwise`` is the batched all-pairs form (C x P x d, C x N x d)."""

    def __init__(self, kind: str, bias: bool) -> None:
        self.kind = kind
        self.bias = bias
        self.spec = COMPARATORS.get(kind)

    def prepare(self, x: Tensor) -> Tensor:
        if self.bias:
            return torch.cat((x[..., :1], self.spec.prepare(x[..., 1:])), dim=-1)
        return self.spec.prepare(x)

    def pos(self, x: Tensor, y: Tensor) -> Tensor:
        if self.bias:
            return self._pos(x[..., 1:], y[..., 1:]) + x[..., 0] + y[..., 0]
        return self._pos(x, y)

    def _pos(self, x: Tensor, y: Tensor) -> Tensor:
        if self.spec.dot_product:
            return (x * y).sum(-1)
        return self.spec.from_squared_distance((x - y).pow(2).sum(-1))

    def pairwise(self, x: Tensor, y: Tensor, compute_dtype: Optional[torch.dtype] = None) -> Tensor:
        """All-pairs scores; ``compute_dtype`` runs the matrix product in that precision (the result, and the
        gradients autograd takes back through the casts, are in ``x``'s dtype)."""
        if self.bias:
            scores = self._pairwise(x[..., 1:], y[..., 1:], compute_dtype)
            return scores + x[..., 0].unsqueeze(-1) + y[..., 0].unsqueeze(-2)
        return self._pairwise(x, y, compute_dtype)

    def _pairwise(self, x: Tensor, y: Tensor, compute_dtype: Optional[torch.dtype]) -> Tensor:
        if compute_dtype is None or compute_dtype == x.dtype:
            dots = torch.matmul(x, y.transpose(-1, -2))
        else:
            dots = torch.matmul(x.to(compute_dtype), y.to(compute_dtype).transpose(-1, -2)).to(x.dtype)
        if self.spec.dot_product:
            return dots
        squared = (x.pow(2).sum(-1).unsqueeze(-1) + y.pow(2).sum(-1).unsqueeze(-2) - 2 * dots).clamp_min(0)
        return self.spec.from_squared_distance(squared)
