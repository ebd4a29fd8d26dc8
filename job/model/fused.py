"""Negative scoring and its loss, differentiated by hand.

Scoring a side of a batch is a handful of chunked matrix products (positives against the
chunk's other positives and against the sampled negatives), a concatenation, a mask and a
loss over the (B x K) score matrix. Autograd records every one of those steps and replays
them backwards with an allocation and a pass over memory per step; on graphs where each
batch touches thousands of distinct rows that bookkeeping was half of the batch time
(bench/RESULTS.md). Here the forward pass runs without autograd, the gradient of the loss
with respect to the scores has a closed form for each of PBG's losses (``job.model.fused_losses``),
and the gradients with respect to the rows are the transposed matrix products. They are handed back to
autograd through one node, so the operators, comparator preparation and global embeddings
around it stay differentiated as before.

Two shortcuts keep the passes over memory down: a positive's score is the diagonal of its
chunk's batch-negative product (which the mask discards anyway), so its gradient rides in
the same backward product; and the statistics (violators) are counted on the score matrix
while it is still in cache.

Used when training with the ``dot`` or ``cos`` comparator (both score prepared vectors by a
dot product) and no bias; anything else takes the autograd path in ``job.model.scoring``.
Both sides of a static relation are scored together by ``job.model.fused_pair``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from job.model.comparators import COMPARATORS
from job.model.fused_losses import BLOCKWISE_LOSSES, Block, blockwise_loss
from job.native import kernels


class _AttachGradients(torch.autograd.Function):
    """A precomputed loss whose gradients with respect to its inputs are already known."""

    @staticmethod
    def forward(ctx: Any, loss: Tensor, grads: tuple[Tensor, ...], *inputs: Tensor) -> Tensor:
        ctx.grads = grads
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        # the gradient is the relation's weight, nearly always 1: multiplying by it would be one more pass over
        # every row gradient (checked only on the CPU, where reading the value waits for no device)
        unit = grad.device.type == "cpu" and bool(grad == 1)
        # let go of them: a leaf takes a gradient nobody else holds as its .grad; one still held here would be
        # copied (a pass over ~17 MB per side of a large-table batch)
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError("fused scoring: its gradients were handed over by an earlier backward (retain_graph "
                               "is not supported on the fused path)")
        return (None, None, *(d if unit else d.mul_(grad) for d in grads))


def attach_gradients(loss: Tensor, inputs: Sequence[Tensor], grads: Sequence[Tensor]) -> Tensor:
    """``loss`` as a node of the autograd graph whose backward hands ``grads[i]`` (times its own gradient) to
    ``inputs[i]``. Each gradient tensor is handed over, not copied: pass none of them twice."""
    return _AttachGradients.apply(loss, tuple(grads), *inputs)


def fused_supported(comparator: str, bias: bool, loss_fn: str) -> bool:
    """Whether training with these settings can take the hand-differentiated path."""
    return COMPARATORS.get(comparator).dot_product and not bias and loss_fn in BLOCKWISE_LOSSES


@dataclass
class ScoringSetup:
    """What every side of a batch shares."""

    loss_fn: str
    margin: float
    num_batch_negs: int
    masked_score: float
    # the native kernel for a side's loss where it serves (``KernelOptions.native_loss``); False: the torch form
    native_loss: bool
    # the dtype of the scores' matrix products (bfloat16, float16); None: the embeddings' own
    compute_dtype: Optional[torch.dtype] = None

    def low(self, x: Tensor) -> Tensor:
        """``x`` in the products' precision (itself when that is its own)."""
        return x if self.compute_dtype is None else x.to(self.compute_dtype)


@dataclass
class SideResult:
    loss: Tensor  # 0-dim, no gradient attached yet
    pos: Tensor  # (B,)
    num_neg: int
    violators: Tensor | float  # weighted count of negatives scoring above their positive (0-dim tensor)
    # gradients with respect to the (padded) anchor and positive rows; None where nothing flowed
    d_anchor: Optional[Tensor]  # (padded, d)
    d_positives: Optional[Tensor]  # (padded, d)
    # with ``defer_batch``: the gradient of the (chunks x chunk x chunk) batch product, positives on its diagonal
    d_batch: Optional[Tensor] = None
    # with a separate ``uniform_anchor`` / a ``shift``: their gradients, (padded, d) / (padded,)
    d_uniform_anchor: Optional[Tensor] = None
    d_shift: Optional[Tensor] = None


def score_side(setup: ScoringSetup, a: Tensor, positives: Tensor, cand: Tensor, *, neg_inv: Optional[Tensor],
               d_cand: Tensor, batch_product: Optional[Tensor] = None, defer_batch: bool = False,
               uniform_anchor: Optional[Tensor] = None, shift: Optional[Tensor] = None,
               negatives_at: Optional[int] = None) -> SideResult:
    """One side's loss and gradients, all without autograd.

    ``a`` (B x d): the other side's prepared positives (the anchor); ``positives`` (B x d): this side's;
    ``cand`` (U x d): this side's prepared unique rows, ``neg_inv`` (chunks x N) the uniform negatives'
    rows in it. The negatives' gradient is added to ``d_cand``; the anchor's and positives' are returned.
    ``batch_product`` (chunks x chunk x chunk, contiguous, overwritten) is the anchors-by-positives
    product when the caller has it; ``defer_batch`` returns its gradient instead of multiplying it out.
    ``uniform_anchor`` (B x d) scores the uniform negatives in place of ``a`` and ``shift`` (B,) is added
    to those scores (``job.model.adjoint``: the operator moved from the negatives onto the anchors).
    ``negatives_at``: the uniform negatives are ``cand``'s rows from there on, in draw order (``neg_inv`` is
    that range, see ``negatives_in_place``): they are scored where they lie and their gradients *written*
    to ``d_cand``'s rows there, whose contents are ignored (the caller need not zero them).

    With a reduced ``compute_dtype`` the rows come in that dtype (``ScoringSetup.low``): every product
    runs in it, its result is taken to ``d_cand``'s dtype (float32) for the masks and the loss, and the
    score gradients go back down for the transposed products, whose results come up again before any sum.
    """
    num_pos = a.shape[0]
    num_uniform = neg_inv.shape[1] if neg_inv is not None and neg_inv.numel() else 0
    acc = d_cand.dtype
    if setup.num_batch_negs == 0 and num_uniform == 0:
        a_acc, p_acc = a.to(acc), positives.to(acc)
        pos = (a_acc * p_acc).sum(1)
        loss, d_pos, _, _ = blockwise_loss(setup.loss_fn, setup.margin, pos, [], 1, num_pos)
        d_pos = d_pos.unsqueeze(1)
        return SideResult(loss, pos, 0, 0.0, p_acc * d_pos, a_acc * d_pos)
    side = _Chunks.of(setup, a, positives, cand, neg_inv, num_uniform, uniform_anchor, negatives_at)
    if negatives_at is not None and side.neg_start is None and neg_inv is not None:
        d_cand[negatives_at : negatives_at + neg_inv.numel()].zero_()  # scored the usual way: added to, not written
    batch: Optional[Tensor] = None
    pos_padded: Optional[Tensor] = None
    if setup.num_batch_negs > 0:
        batch = batch_product if batch_product is not None else torch.bmm(side.a, side.p.transpose(1, 2)).to(acc)
    else:
        pos_padded = (side.a.to(acc) * side.p.to(acc)).sum(2).view(side.padded)
    uniform: Optional[Block] = None
    if num_uniform:
        uniform = _uniform_block(side, cand, acc)
        if shift is not None:
            uniform[0].add_(chunk_rows(shift.to(acc).unsqueeze(1), side.chunk).view(side.padded, 1))
    num_neg = (side.chunk if setup.num_batch_negs > 0 else 0) + num_uniform
    loss, pos_padded, d_pos, d_blocks, violators = _side_loss(setup, side, batch, uniform, pos_padded, num_neg,
                                                              num_pos)
    d_shift = d_blocks[-1].sum(1) if num_uniform and shift is not None else None  # before it becomes d rows
    d_a, d_p, d_batch, d_u = _row_gradients(setup, side, cand, d_pos, d_blocks, d_cand, defer_batch)
    dim = a.shape[1]
    return SideResult(loss, pos_padded[:num_pos], num_neg, violators,
                      None if d_a is None else d_a.view(side.padded, dim),
                      None if d_p is None else d_p.view(side.padded, dim), d_batch,
                      None if d_u is None else d_u.view(side.padded, dim), d_shift)


@dataclass
class _Chunks:
    """One side's rows cut into chunks, and where its uniform negatives are."""

    a: Tensor  # anchors (chunks x chunk x d), zero-padded
    p: Tensor  # positives, the same way
    chunk: int
    num_chunks: int
    padded: int
    num_uniform: int
    neg_rows: Optional[Tensor]  # (chunks x N): rows of the candidates, or None without uniform negatives
    weighted: bool  # fewer distinct candidate rows than draws: each row scored once, weighted by its draws
    u: Tensor  # the uniform negatives' anchors, chunked as ``a`` (``a`` itself unless given apart)
    neg_vecs: Optional[Tensor] = None  # (chunks x N x d) once gathered (unweighted uniform negatives only)
    neg_start: Optional[int] = None  # the negatives are the candidates' rows from here on, in draw order

    @staticmethod
    def of(setup: ScoringSetup, a: Tensor, positives: Tensor, cand: Tensor, neg_inv: Optional[Tensor],
           num_uniform: int, uniform_anchor: Optional[Tensor] = None, neg_start: Optional[int] = None) -> _Chunks:
        chunk = setup.num_batch_negs if setup.num_batch_negs > 0 else num_uniform
        a_chunks, p_chunks = chunk_rows(a, chunk), chunk_rows(positives, chunk)
        num_chunks = a_chunks.shape[0]
        neg_rows = neg_inv[:num_chunks] if num_uniform and neg_inv is not None else None
        u_chunks = a_chunks if uniform_anchor is None or not num_uniform else chunk_rows(uniform_anchor, chunk)
        weighted = 0 < cand.shape[0] < num_uniform
        in_place = not weighted and neg_rows is not None and neg_inv is not None and neg_rows.numel() == neg_inv.numel()
        return _Chunks(a_chunks, p_chunks, chunk, num_chunks, num_chunks * chunk, num_uniform, neg_rows,
                       weighted, u_chunks, neg_start=neg_start if in_place else None)


def _side_loss(setup: ScoringSetup, side: _Chunks, batch: Optional[Tensor], uniform: Optional[Block],
               pos_padded: Optional[Tensor], num_neg: int,
               num_pos: int) -> tuple[Tensor, Tensor, Tensor, list[Tensor], Tensor | float]:
    """The loss of a side's blocks: (loss, positives' scores, their gradient, the blocks' gradients, violators);
    the batch block's gradient holds the positives' on its diagonal.

    ``batch``: the unmasked batch product (positives on its diagonal) or None, then ``pos_padded`` holds the
    positives' scores. The native kernel (``job.native.kernels.side_loss``) does it in one pass per row where it
    serves (softmax and ranking, unweighted negatives, CPU float32/float64) and ``setup.native_loss`` asks for it;
    otherwise the torch form masks the batch block and runs ``blockwise_loss``. Both leave the gradients in the
    blocks.
    """
    if setup.native_loss and (uniform is None or uniform[1] is None):
        done = kernels.side_loss(setup.loss_fn, setup.margin, batch, None if uniform is None else uniform[0],
                                 pos_padded, num_pos)
        if done is not None:
            grads = [block.view(side.padded, -1) for block in (batch, None if uniform is None else uniform[0])
                     if block is not None]
            return (torch.tensor(done.loss, dtype=done.pos.dtype), done.pos, done.d_pos, grads, done.violators)
    blocks: list[Block] = []
    if batch is not None:
        pos_padded = _batch_block(setup, side, batch, num_pos)
        blocks.append((batch.view(side.padded, side.chunk), None))
    if uniform is not None:
        blocks.append(uniform)
    assert pos_padded is not None
    loss, d_pos, d_blocks, violators = blockwise_loss(setup.loss_fn, setup.margin, pos_padded, blocks, num_neg,
                                                      num_pos)
    if batch is not None:  # the positives' gradient on the diagonal, where the kernel leaves it too
        batch.diagonal(dim1=1, dim2=2).copy_(d_pos.view(side.num_chunks, side.chunk))
    return loss, pos_padded, d_pos, d_blocks, violators


def _batch_block(setup: ScoringSetup, side: _Chunks, batch: Tensor, num_pos: int) -> Tensor:
    """Mask the batch negatives' product in place; return the positives' scores (padded) taken from it."""
    # a positive's score is its own entry of the batch product: the diagonal that is masked out
    pos_padded = batch.diagonal(dim1=1, dim2=2).reshape(side.padded).clone()
    batch.diagonal(dim1=1, dim2=2).fill_(setup.masked_score)
    if side.padded != num_pos:
        batch[-1, :, side.chunk - (side.padded - num_pos) :] = setup.masked_score
    return pos_padded


def _uniform_block(side: _Chunks, cand: Tensor, acc: torch.dtype) -> Block:
    """Scores (in ``acc``) of the uniform negatives: each candidate row once, weighted by its draws, or each draw."""
    assert side.neg_rows is not None
    if side.weighted:
        uniform = torch.matmul(side.u, cand.t()).to(acc)  # (chunks, chunk, U)
        draws = torch.zeros((side.num_chunks, cand.shape[0]), dtype=acc, device=side.u.device)
        draws.scatter_add_(1, side.neg_rows, torch.ones_like(side.neg_rows, dtype=acc))
        # each chunk's counts, repeated for its rows
        weight = draws.unsqueeze(1).expand(side.num_chunks, side.chunk, cand.shape[0]).reshape(side.padded, -1)
        return uniform.view(side.padded, cand.shape[0]), weight
    if side.neg_start is not None:
        side.neg_vecs = _in_place(cand, side).view(side.num_chunks, side.num_uniform, -1)
    else:
        side.neg_vecs = cand.index_select(0, side.neg_rows.reshape(-1)).view(side.num_chunks, side.num_uniform, -1)
    return torch.bmm(side.u, side.neg_vecs.transpose(1, 2)).view(side.padded, side.num_uniform).to(acc), None


def _row_gradients(setup: ScoringSetup, side: _Chunks, cand: Tensor, d_pos: Tensor, d_blocks: list[Tensor],
                   d_cand: Tensor, defer_batch: bool) -> tuple[Optional[Tensor], ...]:
    """The score gradients taken back to the anchor and positive rows (chunked) and added to ``d_cand``.

    Returns (d anchors, d positives, d batch product when deferred, d uniform anchors when apart from the
    anchors), in ``d_cand``'s dtype.
    """
    acc = d_cand.dtype
    d_a: Optional[Tensor] = None
    d_p: Optional[Tensor] = None
    d_batch: Optional[Tensor] = None
    if setup.num_batch_negs > 0:
        # masked entries have zero gradient; the positives' is on the diagonal (``_side_loss``)
        d_batch = d_blocks[0].view(side.num_chunks, side.chunk, side.chunk)
        if not defer_batch:
            d_batch_low = d_batch.to(side.a.dtype)
            d_a = torch.bmm(d_batch_low, side.p).to(acc)
            d_p = torch.bmm(d_batch_low.transpose(1, 2), side.a).to(acc)
            d_batch = None
    else:
        d_pos_chunks = d_pos.view(side.num_chunks, side.chunk, 1)
        d_a = side.p.to(acc) * d_pos_chunks
        d_p = side.a.to(acc) * d_pos_chunks
    if not side.num_uniform:
        return d_a, d_p, d_batch, None
    if side.u is side.a:
        return _uniform_gradients(side, cand, d_blocks[-1], d_cand, d_a), d_p, d_batch, None
    return d_a, d_p, d_batch, _uniform_gradients(side, cand, d_blocks[-1], d_cand, None)


def _uniform_gradients(side: _Chunks, cand: Tensor, d_block: Tensor, d_cand: Tensor,
                       into: Optional[Tensor]) -> Tensor:
    """The uniform block's gradient taken to its anchors (added to ``into`` when given) and to ``d_cand``."""
    assert side.neg_rows is not None
    acc = d_cand.dtype
    dim = cand.shape[1]
    d_uniform = d_block.view(side.num_chunks, side.chunk, -1).to(side.u.dtype)
    if side.weighted:
        uniform_part = torch.matmul(d_uniform, cand).to(acc)
        d_u = uniform_part if into is None else into.add_(uniform_part)
        u_rows = side.u.reshape(side.padded, dim)
        if u_rows.dtype == acc:
            d_cand.addmm_(d_block.t(), u_rows)
        else:
            d_cand.add_(torch.mm(d_uniform.view(side.padded, -1).t(), u_rows).to(acc))
        return d_u
    assert side.neg_vecs is not None
    if into is None:
        d_u = torch.bmm(d_uniform, side.neg_vecs).to(acc)
    elif into.dtype == d_uniform.dtype:
        d_u = into.baddbmm_(d_uniform, side.neg_vecs)
    else:
        d_u = into.add_(torch.bmm(d_uniform, side.neg_vecs).to(acc))
    if side.neg_start is not None:
        d_neg = _in_place(d_cand, side).view(side.num_chunks, side.num_uniform, dim)
        if d_uniform.dtype == acc:
            torch.bmm(d_uniform.transpose(1, 2), side.u, out=d_neg)
        else:
            d_neg.copy_(torch.bmm(d_uniform.transpose(1, 2), side.u))
        return d_u
    d_neg = torch.bmm(d_uniform.transpose(1, 2), side.u).to(acc)
    d_cand.index_add_(0, side.neg_rows.reshape(-1), d_neg.view(-1, dim))
    return d_u


def _in_place(rows: Tensor, side: _Chunks) -> Tensor:
    """The rows of ``side``'s in-place negatives (``neg_start`` onwards, one per draw)."""
    assert side.neg_start is not None
    return rows[side.neg_start : side.neg_start + side.num_chunks * side.num_uniform]


def negatives_in_place(neg_inv: Optional[Tensor], num_rows: int) -> Optional[int]:
    """Where the uniform negatives start among ``num_rows`` candidate rows when they lie there one row per
    draw, in draw order (every occurrence gathered: ``job.train.batch.rowops.select_rows``); None when they do not.

    Read from the indices themselves (a CPU pass over 20,000 ints), so no caller has to vouch for a layout.
    On a GPU reading them would wait for the device: there the negatives are always gathered.
    """
    if neg_inv is None or neg_inv.device.type != "cpu" or not neg_inv.numel():
        return None
    start = int(neg_inv.reshape(-1)[0])
    stop = start + neg_inv.numel()
    if stop > num_rows or not torch.equal(neg_inv.reshape(-1), _counting(stop)[start:stop]):
        return None
    return start


_COUNTING: list[Tensor] = [torch.arange(0)]


def _counting(stop: int) -> Tensor:
    """0, 1, ..., stop - 1 (int64, CPU) from a cache that grows: ``negatives_in_place`` compares against it
    four times a batch, and a fresh ``arange`` each time was an allocation and a pass of its own."""
    cached = _COUNTING[0]
    if cached.shape[0] < stop:
        cached = _COUNTING[0] = torch.arange(max(stop, 2 * cached.shape[0]))
    return cached[:stop]


class _ChunkRows:
    """Rows (B x d) as (chunks x chunk x d), zero-padded to whole chunks."""

    @staticmethod
    def padded(num_rows: int, chunk: int) -> int:
        return (num_rows + chunk - 1) // chunk * chunk

    def __call__(self, rows: Tensor, chunk: int) -> Tensor:
        padded = self.padded(rows.shape[0], chunk)
        if padded != rows.shape[0]:
            rows = torch.cat((rows, rows.new_zeros((padded - rows.shape[0], rows.shape[1]))))
        return rows.view(padded // chunk, chunk, rows.shape[1])


chunk_rows = _ChunkRows()


def fused_side(setup: ScoringSetup, anchor: Tensor, candidates: Tensor, own: Tensor,
               neg_inv: Optional[Tensor]) -> tuple[Tensor, SideResult]:
    """One side whose anchor is its own tensor (dynamic relations transform each positive separately)."""
    num_pos = anchor.shape[0]
    with torch.no_grad():
        cand = candidates.detach()
        start = negatives_in_place(neg_inv, cand.shape[0])
        if start is None:
            d_cand = torch.zeros_like(cand)
        else:  # the negatives' rows are written by score_side: only the others need zeros
            assert neg_inv is not None
            d_cand = torch.empty_like(cand)
            d_cand[:start].zero_()
            d_cand[start + neg_inv.numel() :].zero_()
        cand_low = setup.low(cand)
        result = score_side(setup, setup.low(anchor.detach()), cand_low.index_select(0, own), cand_low,
                            neg_inv=neg_inv, d_cand=d_cand,
                            negatives_at=start)
        d_cand.index_add_(0, own, flowed(result.d_positives, "positives")[:num_pos])
        d_anchor = flowed(result.d_anchor, "anchor")[:num_pos].contiguous()
    loss = attach_gradients(result.loss, (anchor, candidates), (d_anchor, d_cand))
    return loss, result


def flowed(grad: Optional[Tensor], what: str) -> Tensor:
    """A gradient ``score_side`` must have returned (its absence is a bug in the scoring code, not bad input)."""
    if grad is None:
        raise RuntimeError(f"fused scoring: no gradient for the {what} (score_side returned None)")
    return grad
