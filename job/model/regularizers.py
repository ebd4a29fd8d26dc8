"""N3, the regulariser of PBG's ``regularizer: N3`` (``regularization_coef`` > 0): Lacroix et al., "Canonical
Tensor Decomposition for Knowledge Base Completion" (ICML 2018), as PBG implements it after 1.0
(``torchbiggraph/regularizers.py``).

The penalty is the sum of the cubed magnitudes of the factors of a batch's positive edges: both entities'
rows and the relation's parameters, once per edge (a dynamic relation's row per edge; a static relation's
parameters times the number of edges). With ``complex_diagonal`` a factor's coordinates are complex
numbers ([real | imag] halves) and a coordinate's magnitude is its modulus, as in the paper's ComplEx-N3;
with every other operator it is the absolute value. The cube of the modulus is taken as
``(re^2 + im^2)^1.5``, smooth at 0 where the modulus itself has no gradient.
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


def n3_penalty(operators: list[Operator], rel: Optional[Tensor], lhs: Tensor, rhs: Tensor, num_pos: int) -> Tensor:
    """The N3 sum of a batch (before ``regularization_coef``): ``lhs`` and ``rhs`` are the positives' rows (one
    per edge), ``operators`` the relation's operators the batch went through, ``rel`` each edge's relation
    type when they are dynamic."""
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
