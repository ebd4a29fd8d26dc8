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

``DURA``: the weighted duality-induced regulariser of Zhang, Cai, Zhang and Wang, "Duality-Induced Regularizer for
Tensor Factorization Based Knowledge Graph Completion" (NeurIPS 2020), in the form their ComplEx results on WN18RR
(MRR 0.491, Hits@10 0.571) were trained with (``DURA_W`` of their code). A bilinear model scores a query
(q, r) against a target t as <L_r q, t> = <q, L_r^T t>; DURA penalises both sides of that duality, per query:

    0.5 * (||q||^2 + ||t||^2) + 1.5 * (||L_r q||^2 + ||L_r^T t||^2)

For ComplEx (``complex_diagonal``: L_r q = q∘r, a complex product, and L_r^T t = t∘conj(r)) the paper writes it
with the moduli of the complex coordinates, |q_i|^2 |r_i|^2 and |t_i|^2 |r_i|^2: the squared Euclidean norm of a
[real | imag] row is exactly the sum of its coordinates' squared moduli, so one formula serves the complex and
the real operators (``diagonal``: DistMult/CP, ``linear``: RESCAL, whose DURA the paper also gives; ``none``:
r = 1). Operators with an additive term (``translation``, ``affine``) are not bilinear and have no such duality:
the config refuses them (``job.config.checks``), as it refuses comparators other than ``dot``.

Queries: with reciprocal scoring (``reciprocal_relations`` or dynamic relations) an edge (u, r, v) makes two,
(u, g_r) for v and (v, h_r) for u, each penalised with its own operator; PBG's static scoring c(u, f_r(v)) scores
the edge once, and it is penalised once, through f_r. The paper's code divides its penalty by the number of
queries in the batch because its loss is the batch's mean; ours is the batch's sum (one softmax term per query),
so the penalty is summed over the queries and ``regularization_coef`` is on the scale of the paper's ``reg``.
Their 0.1 (WN18RR) collapses every embedding to 0 here within an epoch, 0.03 trains: DURA is quadratic, and our
operators start at the identity (the paper's near 0), so the products pull ~4x harder at first
(docs/quality-preset.md).
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


# DURA_W's weights (Zhang et al.'s code): the entities' own norms against the products with the relation
DURA_ENTITY_WEIGHT = 0.5
DURA_PRODUCT_WEIGHT = 1.5


def dura_penalty(rhs_operator: Operator, lhs_operator: Optional[Operator], rel: Optional[Tensor], lhs: Tensor,
                 rhs: Tensor) -> Tensor:
    """The ``DURA`` sum of a batch (before ``regularization_coef``), over its queries (see the module docstring).

    ``lhs`` / ``rhs``: the positives' rows before any operator, one per edge; ``rhs_operator``: h_r (PBG's f_r),
    whose queries are the rhs rows ranking lhs candidates; ``lhs_operator``: g_r, whose queries are the lhs rows
    ranking rhs candidates, or None when scoring is not reciprocal (the lhs operator is then PBG's parameterless
    placeholder and makes no query); ``rel``: each edge's relation type when the operators are dynamic.
    """
    directions = [(rhs_operator, rhs, lhs)]
    if lhs_operator is not None:
        directions.append((lhs_operator, lhs, rhs))
    total = lhs.new_zeros(())
    for operator, query, target in directions:
        rows_rel = rel if operator.dynamic else None
        own = query.square().sum() + target.square().sum()
        products = operator.linear(query, rows_rel).square().sum() + operator.adjoint(target, rows_rel).square().sum()
        total = total + DURA_ENTITY_WEIGHT * own + DURA_PRODUCT_WEIGHT * products
    return total
