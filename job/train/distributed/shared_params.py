"""The shared parameters of a group: the tensors every trainer updates (relation operators, global embeddings,
unpartitioned tables, with their Adagrad sums), flattened into one vector that the lock server sums
(job/train/distributed/lock_server.py); their memory is counted by job/train/residency/budget.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch

from job.train.distributed.lock_client import LockClient
from job.train.distributed.shard_routing import ShardedRows
from job.train.distributed.shared_rows import RowLayout


class SharedParameters:
    """The tensors every trainer updates, flattened for the server's push/pull.

    Dense (a model without relation rows, a bucket that changed or reads most of them): the change since the last
    sync goes out whole and the group's sum comes back whole (``change``, ``assign``). Sparse (``layout``:
    job/train/distributed/shared_rows.py): a bucket's change carries only the rows whose values differ from
    ``synced`` (``outgoing``), which then count as synced; before the next bucket trains, the rows its edges name
    are pulled (``take_rows``). A row it does not read may stay stale: nothing reads it, and its value there
    changes nothing the group sums, since a change is measured from ``synced`` row by row (what this trainer made
    of it since it last gave or took it), so every change still reaches the server once.

    Memory (``CLIENT_VECTORS``): the values as last synced (``synced``, what the next change is measured from),
    one transfer buffer, which holds the values now, the change on its way out and the sum on its way back (the
    transport sends from it and receives into it), and a sparse payload (at most half a vector, ``worth``)."""

    def __init__(self, tensors: list[torch.Tensor], layout: Optional[RowLayout] = None) -> None:
        self.tensors = tensors
        self.synced = torch.from_numpy(self.flatten())
        self.buffer = torch.empty_like(self.synced)
        self.layout = layout if layout is not None else RowLayout.dense(self.synced.numel())
        if self.layout.size != self.synced.numel():
            raise ValueError(f"a row layout of {self.layout.size} values for {self.synced.numel()} shared values")
        self.fresh = True  # every value as the group's at the last whole sync (no pull needed)
        # ``shared_shards``: the rows other ranks serve go to them and come from them (shard_routing.py); every push
        # and pull is then sparse, however many rows it names (rank 0's copy of those rows is not the group's)
        self.shards: Optional[ShardedRows] = None
        self._sent: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # a sparse change's positions and values
        # each tensor: whether it is relation-indexed (its segment's width, else 0) and where its whole values are
        widths = dict(self.layout.segments)
        self._parts: list[tuple[torch.Tensor, int, int]] = []
        offset = whole = 0
        for tensor in tensors:
            width = widths.get(offset, 0)
            self._parts.append((tensor, width, whole))
            whole += 0 if width else tensor.numel()
            offset += tensor.numel()

    def flatten(self) -> np.ndarray:
        """The values now, as a new vector (the server's starting vector)."""
        if not self.tensors:
            return np.zeros(0, dtype=np.float32)
        return torch.cat([t.detach().reshape(-1).float().cpu() for t in self.tensors]).numpy().copy()

    def _current(self) -> torch.Tensor:
        """The values now, in the transfer buffer."""
        if self.tensors:
            torch.cat([t.detach().reshape(-1).float().cpu() for t in self.tensors], out=self.buffer)
        return self.buffer

    def change(self) -> torch.Tensor:
        """The change since the last sync, in the transfer buffer (valid until the next ``change``/``assign``)."""
        return self._current().sub_(self.synced)

    def outgoing(self) -> tuple[torch.Tensor, Optional[np.ndarray]]:
        """A bucket's change to push: (its values, the relation rows they cover, ascending), sparse when few rows
        differ from ``synced`` (``RowLayout.worth``), else (the whole change, None). ``taken`` once pushed."""
        if self.layout.rows == 0:
            return self.change(), None
        current = self._current()
        rows = self.layout.differing(current.numpy(), self.synced.numpy())
        if not self.layout.worth(rows.size) and self.shards is None:
            return current.sub_(self.synced), None
        positions = torch.from_numpy(self.layout.positions(rows))
        values = current[positions]
        self._sent = (positions, values)
        return values - self.synced[positions], rows

    def taken(self, pushed: Optional[torch.Tensor]) -> None:
        """The server took the change of ``outgoing``: a whole one's sum came back as ``pushed`` (taken as the
        values), a sparse one's values count as synced from now on."""
        if self._sent is not None:
            positions, values = self._sent
            self.synced[positions] = values
            self._sent = None
            self.fresh = False
        elif pushed is not None:
            self.assign(pushed)

    def no_change(self) -> torch.Tensor:
        """A zero change in the transfer buffer: to take the group's values without giving any."""
        return self.buffer.zero_()

    def assign(self, flat: torch.Tensor) -> None:
        """Take ``flat`` (the group's sum) as the values and as the point the next change is measured from."""
        offset = 0
        with torch.no_grad():
            for tensor in self.tensors:
                n = tensor.numel()
                tensor.copy_(flat[offset:offset + n].view_as(tensor))
                offset += n
        self.synced.copy_(flat)
        self.fresh = True

    def take_rows(self, rows: np.ndarray, values: torch.Tensor) -> None:
        """Take a pull's ``values`` (the whole part, then ``rows``' values: ``RowLayout.positions``) as the values of
        those positions and as synced there; the other rows keep what they hold."""
        whole = self.layout.whole_values
        by_row = values[whole:].view(rows.size, self.layout.row_values)
        index = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        column = 0
        with torch.no_grad():
            for tensor, width, at in self._parts:
                if width:
                    target = tensor.view(self.layout.rows, width)
                    target.index_copy_(0, index.to(tensor.device),
                                       by_row[:, column:column + width].to(tensor.device, tensor.dtype))
                    column += width
                else:
                    tensor.copy_(values[at:at + tensor.numel()].view_as(tensor))
        self.synced[torch.from_numpy(self.layout.positions(rows))] = values

    def pull(self, client: LockClient, relations: torch.Tensor) -> None:
        """Before a bucket trains (``relations``: the relation ids its edges name): take the group's values of the
        rows it reads, unless every value is fresh already; a pull of most rows is a whole sync."""
        if self.fresh or self.layout.rows == 0:
            return
        rows = np.unique(relations.detach().cpu().numpy()).astype(np.int64)
        if self.shards is not None:
            self.take_rows(rows, self.shards.pull(client, rows))
        elif self.layout.worth(rows.size):
            self.take_rows(rows, client.pull(rows.tolist(), torch.empty(self.layout.count(rows.size))))
        else:
            self.sync(client)

    def sync(self, client: LockClient) -> None:
        """Outside a bucket: push the change, take the sum. With shards, the change of the rows other ranks serve goes
        to them, the rest to rank 0 (those rows zeroed), and the sum's values of those rows come from them."""
        if self.shards is None:
            self.assign(client.sync(self.change()))
            return
        current = self._current()
        self.shards.push_outside(current.numpy(), self.synced.numpy())
        change = current.sub_(self.synced)
        self.shards.zero_others(change.numpy())
        if not bool(change.any()):  # (a pass's end: every bucket's change went with its ``next``) nothing for rank 0
            self.gather_all(client)
            return
        summed = client.sync(change)
        self.shards.fill(summed.numpy())
        self.assign(summed)

    def gather_all(self, client: LockClient) -> None:
        """With shards: take every value from the rank that serves it (rank 0 sends the whole part and its rows
        alone, a sparse pull, instead of the whole vector to every rank)."""
        assert self.shards is not None
        rows = np.arange(self.layout.rows, dtype=np.int64)
        self.take_rows(rows, self.shards.pull(client, rows))
        self.fresh = True

    def settle(self, served: torch.Tensor) -> torch.Tensor:
        """Rank 0 at a pass's end: take its server's ``served`` values, with the rows other ranks serve from them;
        returns the values taken."""
        if self.shards is not None:
            served = served.clone()
            self.shards.fill(served.numpy())
        self.assign(served)
        return served


def relation_indexed(model: torch.nn.Module, rows: int) -> list[bool]:
    """For each of ``model``'s parameters, whether it holds one row per relation type (a dynamic operator's, ``rows``
    of them): the rows a sparse push and pull may carry alone (job/train/distributed/shared_rows.py)."""
    return [rows > 0 and name.split(".")[0] in ("lhs_operators", "rhs_operators") and p.dim() >= 1
            and p.shape[0] == rows for name, p in model.named_parameters()]


def shared_state(parameters: list[torch.Tensor], parameter_sums: list[torch.Tensor],
                 tables: Sequence[Any]) -> list[torch.Tensor]:
    """What every trainer shares: the model's parameters (relation operators, global embeddings) with their dense
    Adagrad sums, and each unpartitioned table's rows with its row-wise Adagrad sums.

    Why the sums too: Adagrad's sums add up as the parameters' changes do (each step adds its squared gradient), so
    the server sums them like any change, and every trainer then steps with the group's sums, as Hogwild workers
    of one process share theirs. Kept per trainer instead, each would step as if it alone trained the relations
    (larger steps than one process takes), and a restart would resume them from the committed version, dropping
    the sums of every bucket saved since; in the vector, the persisted progress carries them (the invariant of
    docs/design/distributed.md, "Shared parameters across a restart")."""
    tensors = list(parameters) + list(parameter_sums)
    for table in tables:
        tensors.append(table.weight)
        if table.optim_sum is not None:
            tensors.append(table.optim_sum)
    return tensors


def group_shared(model: torch.nn.Module, parameter_sums: list[torch.Tensor], tables: Sequence[Any],
                 num_dynamic_rels: int) -> tuple[SharedParameters, RowLayout]:
    """The group's shared parameters of ``model`` (``shared_state``) with their row layout: the dynamic operators'
    parameters and their Adagrad sums (the same shapes, in the same order) go by relation row, the rest whole."""
    tensors = shared_state(list(model.parameters()), parameter_sums, tables)
    by_row = relation_indexed(model, num_dynamic_rels)
    layout = RowLayout.of_tensors(tensors, by_row + by_row + [False] * (len(tensors) - 2 * len(by_row)),
                                  num_dynamic_rels)
    return SharedParameters(tensors, layout), layout
