"""The optimizers: dense Adagrad for relation parameters, PBG's row-wise Adagrad for embedding rows, or per-coordinate
("full") Adagrad for them with ``entity_optimizer: adagrad``.

All update shared-memory tensors in place (Hogwild workers share them); their state_dict layouts are
the ones PBG saves, so checkpoints load in either program. A table's ``optim_sum`` says which step it takes: one
sum per row (rows,) is PBG's RowAdagrad, one per coordinate (rows, dim) is Adagrad as Lacroix et al. and LibKGE run
it for ComplEx. A per-coordinate state is saved in PBG's RowAdagrad layout plus one key PBG ignores
(``entity_adagrad_state``), so PBG still loads the partition and can go on with its row-wise step.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from job.errors import CheckpointError
from job.model.scoring import Table
from job.native import kernels
from job.train.batch.rowops import positions, scratch

ADAGRAD_EPS = 1e-10


class RelationAdagrad:
    """Dense Adagrad over the model's shared parameters (relation operators, global embeddings).

    The sums live in shared memory so that every Hogwild worker accumulates into the
    same state; its ``state_dict`` has torch.optim.Adagrad's layout, as PBG saves it.
    """

    def __init__(self, params: list[Tensor], lr: float) -> None:
        self.params = params
        self.lr = lr  # the configured rate (what ``state_dict`` saves, as PBG does)
        # the learning-rate schedule's factor for the pass in flight (job/train/lr_schedule.py): set by the trainer
        # and, per bucket, by each Hogwild worker on its own instance; 1.0 steps at ``lr`` exactly
        self.scale = 1.0
        self.sums = [torch.zeros_like(p.detach()) for p in params]
        self.steps = torch.zeros(1, dtype=torch.float64)

    def share_memory(self) -> None:
        for s in self.sums:
            s.share_memory_()
        self.steps.share_memory_()

    @torch.no_grad()
    def step(self) -> None:
        """One Adagrad step of every parameter with a gradient (a batch's relation and global embeddings).

        Four multi-tensor (``_foreach``) ops for all of them: per parameter it was four ops each, a dozen tiny
        ops per batch."""
        self.steps += 1
        params, sums, grads = [], [], []
        for p, s in zip(self.params, self.sums):
            if p.grad is not None:
                params.append(p)
                sums.append(s)
                grads.append(p.grad)
        if not params:
            return
        torch._foreach_addcmul_(sums, grads, grads)
        scales = torch._foreach_sqrt(sums)
        torch._foreach_add_(scales, ADAGRAD_EPS)
        torch._foreach_addcdiv_(params, grads, scales, value=-self.lr * self.scale)
        for p in params:
            p.grad = None

    def state_dict(self) -> dict:
        step = float(self.steps.item())
        return {
            "state": {i: {"step": torch.tensor(step), "sum": s.clone()} for i, s in enumerate(self.sums)},
            "param_groups": [{
                "lr": self.lr, "lr_decay": 0, "weight_decay": 0, "initial_accumulator_value": 0, "eps": ADAGRAD_EPS,
                "foreach": None, "maximize": False, "differentiable": False, "fused": None,
                "params": list(range(len(self.sums))),
            }],
        }

    def load_state_dict(self, state: Optional[dict], where: str) -> None:
        if not state:
            return
        entries = state.get("state", {}) if isinstance(state, dict) else {}
        for i, s in enumerate(self.sums):
            entry = entries.get(i) or entries.get(str(i))
            if entry is None:
                continue
            value = torch.as_tensor(entry["sum"])
            if value.shape != s.shape:
                raise CheckpointError(f"{where}: optimizer state {i} has shape {tuple(value.shape)}, expected {tuple(s.shape)}")
            s.copy_(value)
            step = entry.get("step", 0)
            self.steps.fill_(float(step.item() if isinstance(step, Tensor) else step))


# the state entry's key holding per-coordinate sums, beside PBG's "sum" (which then holds their row means)
PER_COORDINATE_KEY = "sum_per_coordinate"


def row_adagrad_state(optim_sum: Tensor, lr: float, step: int = 0) -> dict:
    """PBG's RowAdagrad state_dict layout for one partition."""
    return {"state": {0: {"step": step, "sum": optim_sum}},
            "param_groups": [{"lr": lr, "lr_decay": 0, "weight_decay": 0, "params": [0]}]}


def entity_adagrad_state(optim_sum: Tensor, lr: float, step: int = 0) -> dict:
    """A partition's optimizer state as saved: PBG's RowAdagrad layout, for either kind of sums.

    Per-coordinate sums (rows x dim) go under ``PER_COORDINATE_KEY`` and "sum" gets their row means. That mean is
    exactly the row-wise sum the same gradients would have built (row-wise Adagrad adds mean(g^2) per step, the
    per-coordinate one g_j^2 to each coordinate), so PBG 1.0.0, whose ``Optimizer.load_state_dict`` keeps a key it
    does not use, resumes with its row-wise step as if it had trained the partition itself."""
    if optim_sum.dim() == 1:
        return row_adagrad_state(optim_sum, lr, step)
    state = row_adagrad_state(optim_sum.mean(1), lr, step)
    state["state"][0][PER_COORDINATE_KEY] = optim_sum
    return state


def sums_from_state(state: Optional[dict], count: int, dim: int, per_coordinate: bool) -> tuple[Optional[Tensor], int]:
    """The Adagrad sums of a saved partition of ``count`` rows (its ``step`` beside them), in the form the run
    steps with: (count,) row-wise, (count, dim) per coordinate; (None, 0) when the state is absent or unusable.

    Either kind loads into either optimizer: a row-wise run takes the row means PBG's "sum" holds; a
    per-coordinate run takes the saved per-coordinate sums when they agree with "sum" (PBG trained the
    partition since, or a row-wise run saved it: they do not) and otherwise starts every coordinate of a row from
    the row's sum, the sum of a row-wise run that would have stepped it by the same amount."""
    if not isinstance(state, dict):
        return None, 0
    entry = state.get("state", {}).get(0) if isinstance(state.get("state"), dict) else None
    if not isinstance(entry, dict) or "sum" not in entry:
        return None, 0
    row_sums = torch.as_tensor(entry["sum"], dtype=torch.float32)
    if row_sums.shape != (count,):
        return None, 0
    step = entry.get("step", 0)
    step = int(step.item() if isinstance(step, Tensor) else step)
    if not per_coordinate:
        return row_sums.clone(), step
    saved = entry.get(PER_COORDINATE_KEY)
    if saved is not None:
        full = torch.as_tensor(saved, dtype=torch.float32)
        if full.shape == (count, dim) and torch.allclose(full.mean(1), row_sums, rtol=1e-4, atol=1e-6):
            return full.clone(), step
    return row_sums.unsqueeze(1).expand(count, dim).clone(), step


def cat_grads(lhs_rows: Tensor, rhs_rows: Tensor) -> Optional[Tensor]:
    if lhs_rows.grad is None and rhs_rows.grad is None:
        return None
    lhs_grad = lhs_rows.grad if lhs_rows.grad is not None else torch.zeros_like(lhs_rows)
    rhs_grad = rhs_rows.grad if rhs_rows.grad is not None else torch.zeros_like(rhs_rows)
    return torch.cat((lhs_grad, rhs_grad))


@torch.no_grad()
def row_adagrad_repeated(table: Table, ids: Tensor, grad: Optional[Tensor], lr: float) -> None:
    """``row_adagrad`` for ids that may repeat: each distinct row gets one step with its summed gradient.

    Each occurrence finds a representative occurrence of its id (the one whose position survives in the
    scratch array), the gradients are summed there and read back by every occurrence, so all
    occurrences of a row compute the same new values and the duplicate writes agree. Nothing here
    depends on how many distinct rows there are: no host synchronisation.
    """
    if grad is None or table.optim_sum is None:
        return
    slots = scratch(table.weight.shape[0], ids.device)
    if kernels.row_adagrad(table.weight, table.optim_sum, [(ids, grad)], lr, ADAGRAD_EPS, slots):
        return
    slots.scatter_(0, ids, positions(0, ids.numel(), ids.device).to(torch.int32))
    representative = slots.index_select(0, ids).long()
    summed = torch.zeros_like(grad).index_add_(0, representative, grad).index_select(0, representative)
    optim_sum = table.optim_sum.index_select(0, ids).add_(_squares(summed, table.optim_sum))
    table.optim_sum.index_copy_(0, ids, optim_sum)
    step = _per_row(optim_sum.sqrt_().add_(ADAGRAD_EPS).reciprocal_().mul_(-lr))
    table.weight.index_copy_(0, ids, table.weight.index_select(0, ids).add_(summed.mul_(step)))


@torch.no_grad()
def row_adagrad_occurrences(table: Table, given: list[tuple[Tensor, Optional[Tensor]]], lr: float) -> None:
    """``row_adagrad`` for rows gathered once per occurrence, as (ids, gradient) lists of one table.

    An id may repeat within a list and across them (a row drawn twice, or on both sides of a batch). Each
    repeated occurrence's gradient is moved onto the id's representative occurrence and zeroed, so each
    distinct row gets one step with its summed gradient (a merged sparse gradient, as PBG steps it) and the
    zeroed occurrences change nothing. Only the repeats are touched: on a large table a few percent of the
    rows, where ``row_adagrad_repeated`` passes over every gradient three more times. Finding the repeats
    makes the host wait for their count: a CPU path (a GPU takes ``row_adagrad_repeated``).
    """
    sides: list[tuple[Tensor, Tensor]] = [(ids, grad) for ids, grad in given if grad is not None]
    if not sides or table.optim_sum is None:
        return
    device = table.weight.device
    slots = scratch(table.weight.shape[0], device)
    if kernels.row_adagrad(table.weight, table.optim_sum, sides, lr, ADAGRAD_EPS, slots):
        return
    ids = sides[0][0] if len(sides) == 1 else torch.cat([side_ids for side_ids, _ in sides])
    count = ids.numel()
    slots.scatter_(0, ids, torch.arange(count, dtype=torch.int32, device=device))
    representative = slots.index_select(0, ids).long()  # a representative is its own representative
    repeats = torch.nonzero(representative != positions(0, count, device)).flatten()
    if repeats.numel():
        targets = representative.index_select(0, repeats)
        offsets = [0]
        for side_ids, _ in sides:
            offsets.append(offsets[-1] + side_ids.numel())
        moved = []
        for (_, grad), begin, end in zip(sides, offsets, offsets[1:]):
            local = repeats[(repeats >= begin) & (repeats < end)] - begin
            moved.append(grad.index_select(0, local))
            grad.index_fill_(0, local, 0.0)
        moved_rows = moved[0] if len(moved) == 1 else torch.cat(moved)  # in the order of ``repeats``
        for (_, grad), begin, end in zip(sides, offsets, offsets[1:]):
            into = (targets >= begin) & (targets < end)
            grad.index_add_(0, targets[into] - begin, moved_rows[into])
    for side_ids, grad in sides:
        row_adagrad(table, side_ids, grad, lr)


def renorm_rows(weight: Tensor, ids: Tensor, max_norm: float) -> None:
    """Rescale rows above max_norm in place, as F.embedding(max_norm=...) does in PBG.

    ``ids`` may repeat (every occurrence then writes the same row). On the CPU only the rows that change are
    written back; a GPU would have to be waited for to learn which those are, so it rewrites them all.
    """
    rows = weight.index_select(0, ids)
    norms = rows.norm(2, dim=1)
    too_long = norms > max_norm
    if weight.device.type != "cpu":
        scale = torch.where(too_long, max_norm / (norms + 1e-7), torch.ones_like(norms))
        weight.index_copy_(0, ids, rows.mul_(scale.unsqueeze(1)))
    elif bool(too_long.any()):
        scale = (max_norm / (norms[too_long] + 1e-7)).unsqueeze(1)
        weight.index_copy_(0, ids[too_long], rows[too_long] * scale)


@torch.no_grad()
def row_adagrad(table: Table, uniq: Tensor, grad: Optional[Tensor], lr: float) -> None:
    """PBG's RowAdagrad on the unique rows of one batch: one sum per row, the mean of squared gradients (per
    coordinate: each coordinate's own sum of squared gradients, when the table's sums are per coordinate)."""
    if grad is None or table.optim_sum is None:
        return
    if uniq.device.type == "cpu" and kernels.row_adagrad(table.weight, table.optim_sum, [(uniq, grad)], lr,
                                                         ADAGRAD_EPS, scratch(table.weight.shape[0], uniq.device)):
        return
    table.optim_sum.index_add_(0, uniq, _squares(grad, table.optim_sum))
    # -lr / (sqrt(sum) + eps) per row (or coordinate), then one pass over the gradient
    step = table.optim_sum.index_select(0, uniq).sqrt_().add_(ADAGRAD_EPS).reciprocal_().mul_(-lr)
    table.weight.index_add_(0, uniq, grad.mul_(_per_row(step)))


def _squares(grad: Tensor, optim_sum: Tensor) -> Tensor:
    """What a step adds to the sums of its rows: the squared gradient per coordinate, or its mean per row (as a
    fused norm: half the time of grad.pow(2).mean(1))."""
    if optim_sum.dim() == 2:
        return grad.square()
    return torch.linalg.vector_norm(grad, dim=1).square_().div_(grad.shape[1])


def _per_row(step: Tensor) -> Tensor:
    """Step sizes shaped to multiply gradient rows: a row-wise one broadcast over its row."""
    return step.unsqueeze(1) if step.dim() == 1 else step
