"""PBG's relation operators in torch, one registered class per name of ``job.model.names.OPERATORS``.

An operator kind says which parameters it has (PBG's names, so that state dicts and checkpoints
are interchangeable with PBG's) and how it transforms rows given them. ``Operator`` is the
``nn.Module`` holding one relation's parameters, or every dynamic relation's (one row per
relation type). The numpy twin used to serve archives is ``job.archive.scoring``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from job.model import names
from job.model.registry import Registry
from job.native import kernels

Getter = Callable[[str], Tensor]  # a parameter by its static name, already gathered per row when dynamic
Table = Callable[[str], Tensor]  # a parameter by its static name, whole (one row per relation type when dynamic)


class OperatorKind:
    """One kind of operator: its parameters' initial values (the identity, as in PBG) and its forward."""

    # PBG names a dynamic operator's parameters in the plural ("diagonals"); complex_diagonal's keep their name
    plural_when_dynamic = True

    @staticmethod
    def initial(dim: int) -> dict[str, Tensor]:
        """Initial values for one relation, in registration order (the order of the state dict)."""
        return {}

    @staticmethod
    def check(dim: int) -> None:
        """Raise ValueError when the operator cannot work in ``dim`` dimensions."""

    # f(x) = L x + t with t this parameter (static name), or None: no additive term
    additive: Optional[str] = None

    @staticmethod
    def apply(x: Tensor, get: Getter, dynamic: bool) -> Tensor:
        raise NotImplementedError

    @staticmethod
    def linear(x: Tensor, get: Getter, dynamic: bool) -> Tensor:
        """``L x``: ``apply`` without the additive term. Training with the dot comparator moves ``L`` onto
        the anchors as its ``adjoint`` (``job.model.fused_pair``) and takes gradients back through this."""
        raise NotImplementedError

    @staticmethod
    def adjoint(y: Tensor, table: Table, rel: Optional[Tensor], inverse: bool) -> Tensor:
        """Where a row x should be for ``apply(x)`` to match ``y``.

        ``biggraph grow`` places a new entity from its trained neighbours with it (``job.growing.rows``):
        the adjoint of the operator's linear part for the dot-product comparators (it maximises
        ``<apply(x), y>`` for a given norm of x), the inverse with ``inverse`` for the distance ones (it
        makes the distance zero). ``table`` gives whole parameters, since a per-relation inverse is
        cheaper than one per row; ``rel`` is the relation of each row when dynamic, else None.
        """
        raise NotImplementedError


def _pick(table: Tensor, rel: Optional[Tensor]) -> Tensor:
    """One relation's parameter (static), or each row's relation's (``rel`` given)."""
    return rows(table, rel) if rel is not None else table


OPERATORS: Registry[type[OperatorKind]] = Registry("operator", names.OPERATORS)


@OPERATORS.register("none")
class NoOperator(OperatorKind):
    @staticmethod
    def apply(x: Tensor, get: Getter, dynamic: bool) -> Tensor:
        return x

    @staticmethod
    def linear(x: Tensor, get: Getter, dynamic: bool) -> Tensor:
        return x

    @staticmethod
    def adjoint(y: Tensor, table: Table, rel: Optional[Tensor], inverse: bool) -> Tensor:
        return y


@OPERATORS.register("diagonal")
class DiagonalOperator(OperatorKind):
    @staticmethod
    def initial(dim: int) -> dict[str, Tensor]:
        return {"diagonal": torch.ones(dim)}

    @staticmethod
    def apply(x: Tensor, get: Getter, dynamic: bool) -> Tensor:
        return x * get("diagonal")

    @staticmethod
    def linear(x: Tensor, get: Getter, dynamic: bool) -> Tensor:
        return x * get("diagonal")

    @staticmethod
    def adjoint(y: Tensor, table: Table, rel: Optional[Tensor], inverse: bool) -> Tensor:
        d = _pick(table("diagonal"), rel)
        if not inverse:
            return y * d
        usable = d.abs() > 1e-6  # a zero coordinate has no pre-image: leave it at zero
        return torch.where(usable, y / torch.where(usable, d, torch.ones_like(d)), torch.zeros_like(y))


@OPERATORS.register("translation")
class TranslationOperator(OperatorKind):
    additive = "translation"

    @staticmethod
    def initial(dim: int) -> dict[str, Tensor]:
        return {"translation": torch.zeros(dim)}

    @staticmethod
    def apply(x: Tensor, get: Getter, dynamic: bool) -> Tensor:
        return x + get("translation")

    @staticmethod
    def linear(x: Tensor, get: Getter, dynamic: bool) -> Tensor:
        return x

    @staticmethod
    def adjoint(y: Tensor, table: Table, rel: Optional[Tensor], inverse: bool) -> Tensor:
        return y - _pick(table("translation"), rel) if inverse else y  # the linear part is the identity


@OPERATORS.register("linear")
class LinearOperator(OperatorKind):
    @staticmethod
    def initial(dim: int) -> dict[str, Tensor]:
        return {"linear_transformation": torch.eye(dim)}

    @staticmethod
    def apply(x: Tensor, get: Getter, dynamic: bool) -> Tensor:
        matrix = get("linear_transformation")
        if dynamic:  # one matrix per row
            return torch.matmul(matrix, x.unsqueeze(-1)).squeeze(-1)
        return x @ matrix.t()

    @staticmethod
    def linear(x: Tensor, get: Getter, dynamic: bool) -> Tensor:
        return LinearOperator.apply(x, get, dynamic)

    @staticmethod
    def adjoint(y: Tensor, table: Table, rel: Optional[Tensor], inverse: bool) -> Tensor:
        matrices = table("linear_transformation")
        maps = torch.linalg.pinv(matrices) if inverse else matrices.transpose(-1, -2)
        if rel is not None:
            return torch.matmul(rows(maps, rel), y.unsqueeze(-1)).squeeze(-1)
        return y @ maps.t()


@OPERATORS.register("affine")
class AffineOperator(OperatorKind):
    additive = "translation"

    @staticmethod
    def initial(dim: int) -> dict[str, Tensor]:
        return {"linear_transformation": torch.eye(dim), "translation": torch.zeros(dim)}

    @staticmethod
    def apply(x: Tensor, get: Getter, dynamic: bool) -> Tensor:
        return LinearOperator.apply(x, get, dynamic) + get("translation")

    @staticmethod
    def linear(x: Tensor, get: Getter, dynamic: bool) -> Tensor:
        return LinearOperator.apply(x, get, dynamic)

    @staticmethod
    def adjoint(y: Tensor, table: Table, rel: Optional[Tensor], inverse: bool) -> Tensor:
        z = y - _pick(table("translation"), rel) if inverse else y
        return LinearOperator.adjoint(z, table, rel, inverse)


@OPERATORS.register("complex_diagonal")
class ComplexDiagonalOperator(OperatorKind):
    """(a + ib)(c + id) with rows laid out as [real | imag]."""

    plural_when_dynamic = False

    @staticmethod
    def initial(dim: int) -> dict[str, Tensor]:
        return {"real": torch.ones(dim // 2), "imag": torch.zeros(dim // 2)}

    @staticmethod
    def check(dim: int) -> None:
        if dim % 2:
            raise ValueError("complex_diagonal needs an even dimension")

    @staticmethod
    def apply(x: Tensor, get: Getter, dynamic: bool) -> Tensor:
        return _ComplexDiagonal.apply(x, get("real"), get("imag"))

    @staticmethod
    def linear(x: Tensor, get: Getter, dynamic: bool) -> Tensor:
        return _ComplexDiagonal.apply(x, get("real"), get("imag"))

    @staticmethod
    def adjoint(y: Tensor, table: Table, rel: Optional[Tensor], inverse: bool) -> Tensor:
        real, imag = _pick(table("real"), rel), _pick(table("imag"), rel)
        if not inverse:
            return _ComplexDiagonal.apply(y, real, imag, True)  # times the conjugate
        half = y.shape[-1] // 2
        y_re, y_im = y[..., :half], y[..., half:]
        out = torch.cat((y_re * real + y_im * imag, y_im * real - y_re * imag), dim=-1)  # times the conjugate
        modulus = (real * real + imag * imag).clamp_min(1e-12)
        return out / torch.cat((modulus, modulus), dim=-1)


class Operator(nn.Module):
    """A relation operator; ``num_operations`` > 0 makes it dynamic (one set of parameters per relation)."""

    def __init__(self, kind: str, dim: int, num_operations: int = 0) -> None:
        super().__init__()
        self.kind = kind
        self.dim = dim
        self.dynamic = num_operations > 0
        self.spec = OPERATORS.get(kind)
        self.spec.check(dim)
        self._suffix = "s" if self.dynamic and self.spec.plural_when_dynamic else ""
        lead = (num_operations,) if self.dynamic else ()
        self.param_names: list[str] = []
        for name, value in self.spec.initial(dim).items():
            self.register_parameter(name + self._suffix, nn.Parameter(value.expand(lead + value.shape).clone()))
            self.param_names.append(name + self._suffix)

    def _get(self, name: str, rel: Optional[Tensor]) -> Tensor:
        """The parameter ``name`` (its static name), one row per entry of ``rel`` when dynamic."""
        param = getattr(self, name + self._suffix)
        if not self.dynamic:
            return param
        if rel is None:
            raise ValueError(f"dynamic operator '{name}': the relation of each row (rel) is required")
        return rows(param, rel)

    def forward(self, x: Tensor, rel: Optional[Tensor] = None) -> Tensor:
        """Apply to rows ``x`` (..., dim); ``rel`` gives the relation of each row when dynamic."""
        return self.spec.apply(x, lambda name: self._get(name, rel), self.dynamic)

    def forward_dropped(self, x: Tensor, rel: Optional[Tensor], p: float) -> Tensor:
        """``forward`` with dropout (probability ``p``) on every parameter, an independent mask per row of ``x``.

        ``embedding_dropout`` (LibKGE's relation dropout): each query embeds its relation with its own mask,
        so a static relation's parameters are expanded to one copy per row first and the operator is applied
        the per-row (dynamic) way. A linear operator's copies are d x d per row: the cost is the user's choice.
        """
        count = x.shape[0]

        def get(name: str) -> Tensor:
            param = self._get(name, rel)
            if not self.dynamic:
                param = param.expand((count,) + tuple(param.shape))
            return F.dropout(param, p)

        return self.spec.apply(x, get, True)

    def linear(self, x: Tensor, rel: Optional[Tensor] = None) -> Tensor:
        """The operator's linear part ``L x`` (``forward`` without the translation)."""
        return self.spec.linear(x, lambda name: self._get(name, rel), self.dynamic)

    def additive(self, rel: Optional[Tensor] = None) -> Optional[Tensor]:
        """The additive term ``t`` of ``forward(x) = L x + t`` (per row when dynamic), or None."""
        return None if self.spec.additive is None else self._get(self.spec.additive, rel)

    def adjoint(self, y: Tensor, rel: Optional[Tensor] = None, inverse: bool = False) -> Tensor:
        """Where rows x should be for ``self(x, rel)`` to match rows ``y``: the adjoint of the linear part, or with
        ``inverse`` the inverse (see ``OperatorKind.adjoint``)."""
        return self.spec.adjoint(y, lambda name: getattr(self, name + self._suffix), rel if self.dynamic else None,
                                 inverse)


def rows(table: Tensor, index: Tensor) -> Tensor:
    """``table[index]`` through index_select: its backward is an index_add, not the much slower
    accumulating index_put that advanced indexing differentiates to on the CPU."""
    flat = table.index_select(0, index.reshape(-1))
    return flat.view(tuple(index.shape) + tuple(table.shape[1:]))


class _ComplexDiagonal(torch.autograd.Function):
    """Complex multiplication of each row by (real + i imag), or by its conjugate, differentiated by hand.

    One C pass forward and one backward where the native kernels take the tensors
    (``job.native.kernels.complex_diagonal``: CPU, float32/float64, contiguous). Otherwise written into the
    two halves of one output with fused multiply-adds: autograd's version (swap the halves, two broadcast
    products, a sum) made five full passes forward and more backward, and the swap's backward is an
    index_add; on thousands of rows per batch this was the most expensive elementwise step of a batch.
    ``real``/``imag`` are (h,) for a static relation or (rows, h) when each row has its own relation.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, real: Tensor, imag: Tensor, conjugate: bool = False) -> Tensor:
        ctx.save_for_backward(x, real, imag)
        ctx.conjugate = conjugate
        done = kernels.complex_diagonal(x, real, imag, conjugate)
        if done is not None:
            return done
        if conjugate:
            imag = imag.neg()
        half = x.shape[-1] // 2
        x_re, x_im = x[..., :half], x[..., half:]
        out = torch.empty_like(x)
        torch.mul(x_re, real, out=out[..., :half])
        out[..., :half].addcmul_(x_im, imag, value=-1)
        torch.mul(x_re, imag, out=out[..., half:])
        out[..., half:].addcmul_(x_im, real)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        x, real, imag = ctx.saved_tensors
        done = kernels.complex_diagonal_backward(x, real, imag, grad, ctx.conjugate)
        if done is not None:
            return (*done, None)
        if ctx.conjugate:
            imag = imag.neg()
        half = x.shape[-1] // 2
        x_re, x_im = x[..., :half], x[..., half:]
        g_re, g_im = grad[..., :half], grad[..., half:]
        d_x = torch.empty_like(x)
        torch.mul(g_re, real, out=d_x[..., :half])
        d_x[..., :half].addcmul_(g_im, imag)
        torch.mul(g_im, real, out=d_x[..., half:])
        d_x[..., half:].addcmul_(g_re, imag, value=-1)
        # d real = g_re x_re + g_im x_im ; d imag = g_im x_re - g_re x_im, summed over rows for a static relation
        products = (grad * x).view(x.shape[:-1] + (2, half))
        d_imag = g_im * x_re
        d_imag.addcmul_(g_re, x_im, value=-1)
        if real.dim() == 1:
            d_real = products.reshape(-1, 2, half).sum((0, 1))
            d_imag = d_imag.reshape(-1, half).sum(0)
        else:
            d_real = products.sum(-2)
        return d_x, d_real, d_imag.neg_() if ctx.conjugate else d_imag, None
