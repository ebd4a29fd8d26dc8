"""One side (lhs or rhs) of a batch as the scoring code receives it.

The scoring functions took each side's rows, positives' positions, negatives' positions and negatives switch as
separate positional parameters, a left one and a right one each: a swapped pair went unnoticed (both are
tensors of the same shape on a square graph). They take ``lhs: Side, rhs: Side`` now.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import Tensor


@dataclass(frozen=True)
class Side:
    """A side's gathered rows and where its positives and uniform negatives sit among them.

    Built once per batch per side (never per row). The relation's operator on this side and the entity type's
    global embedding are the model's own (``Model`` reads them from the relation), so they are not here.
    """

    rows: Tensor  # (U x d): the rows the batch gathered from this side's table (both sides: the same tensor
    # when they share one gather); with ``all_negs`` the whole partition in id order
    inv: Tensor  # (B,): each positive's row in ``rows``
    neg_inv: Optional[Tensor] = None  # (chunks x N): the uniform negatives' rows in ``rows``; None: none drawn
    negs_disabled: bool = False  # ``disable_lhs_negs`` / ``disable_rhs_negs``: this side is never corrupted

    def with_rows(self, rows: Tensor) -> Side:
        """The same positions over ``rows`` (the side's rows after a global embedding, the comparator's preparation
        or an operator: one row for each of ``self.rows``)."""
        return Side(rows, self.inv, self.neg_inv, self.negs_disabled)
