"""N3, the regulariser of PBG's ``regularizer: N3`` (``regularization_coef`` > 0): Lacroix et al., "Canonical
Tensor Decomposition for Knowledge Base Completion" (ICML 2018), as PBG implements it after 1.0
(``torchbiggraph/regularizers.py``).

``N3``: the sum of the cubed magnitudes of the factors of a batch's positive edges: both entities' rows
and the relation's parameters, once per edge (a dynamic relation's row per edge; a static relation's
parameters times the number of edges). With ``complex_diagonal`` a factor's coordinates are complex
numbers ([real | imag] halves) and a coordinate's magnitude is its modulus, as in the paper's ComplEx-N3;
with every other operator it is the absolute value. The cube of the modulus is taken as
``(re^2 + im^2)^1.5``, smooth at 0 where the modulus itself has no gradient.

``N3_shared_relations`` (biggraph's form before issue #33): the cubed absolute
values of every coordinate of the positives' rows, once per edge, plus those of every parameter of the
relation's operators once per batch. The operators start at the identity (modulus 1 in every coordinate, where
the paper starts every factor near 0): counted once per edge their penalty outweighs the loss at the start
and on WN18RR it held the valid MRR to 0.07 after an epoch at 0.1, against 0.20 this way (bench/RESULTS.md).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from job.model.operators import Operator


def cubed_magnitudes(x: Tensor, complex_pairs: bool) -> Tensor:
    """The sum over ``x``'s last dimension of |coordinate|^3 (complex coordinates: [real | imag] halves)."""
    if complex_pairs:
        half = x.shape[-1] // 2
        return (x[..., :half].square() + x[..., half:].square()).pow(1.5).sum()
    return x.abs().pow(3).sum()


def n3_penalty(operators: list[Operator], rel: Optional[Tensor], lhs: Tensor, rhs: Tensor, num_pos: int,
               kind: str = "N3") -> Tensor:
    """The ``kind`` sum of a batch (before ``regularization_coef``): ``lhs`` and ``rhs`` are the positives' rows
    (one per edge), ``operators`` the relation's operators the batch went through, ``rel`` each edge's relation
    type when they are dynamic."""
    if kind == "N3_shared_relations":
        total = cubed_magnitudes(lhs, False) + cubed_magnitudes(rhs, False)
        for operator in operators:
            for name in operator.param_names:
                total = total + cubed_magnitudes(getattr(operator, name), False)
        return total
    complex_pairs = any(op.kind == "complex_diagonal" for op in operators)
    total = cubed_magnitudes(lhs, complex_pairs) + cubed_magnitudes(rhs, complex_pairs)
    for operator in operators:
        params = [getattr(operator, name) for name in operator.param_names]
        if not params:
            continue
        if operator.kind == "complex_diagonal":
            real, imag = params  # (one row per relation type when dynamic)
            both = torch.cat((real, imag), dim=-1)
            factor = both.index_select(0, rel) if operator.dynamic and rel is not None else both
            penalty = cubed_magnitudes(factor, True)
        else:
            penalty = sum((cubed_magnitudes(p.index_select(0, rel) if operator.dynamic and rel is not None else p,
                                            False) for p in params), lhs.new_zeros(()))
        total = total + (penalty if operator.dynamic else penalty * num_pos)
    return total
