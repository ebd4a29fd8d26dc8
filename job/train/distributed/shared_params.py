"""The shared parameters of a group: the tensors every trainer updates (relation operators, global embeddings,
unpartitioned tables, with their Adagrad sums), flattened into one vector that the lock server sums
(job/train/distributed/lock_server.py); their memory is counted by job/train/residency/budget.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from job.train.distributed.lock_client import LockClient


class SharedParameters:
    """The tensors every trainer updates, flattened for the server's push/pull.

    Memory (``CLIENT_VECTORS``): the values as last synced (``synced``, what the next change is measured from) and
    one transfer buffer, which holds the change on its way out and the sum on its way back (the transport sends
    from it and receives into it), so a sync allocates nothing of the vector's size."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.synced = torch.from_numpy(self.flatten())
        self.buffer = torch.empty_like(self.synced)

    def flatten(self) -> np.ndarray:
        """The values now, as a new vector (the server's starting vector)."""
        if not self.tensors:
            return np.zeros(0, dtype=np.float32)
        return torch.cat([t.detach().reshape(-1).float().cpu() for t in self.tensors]).numpy().copy()

    def change(self) -> torch.Tensor:
        """The change since the last sync, in the transfer buffer (valid until the next ``change``/``assign``)."""
        if self.tensors:
            torch.cat([t.detach().reshape(-1).float().cpu() for t in self.tensors], out=self.buffer)
        return self.buffer.sub_(self.synced)

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

    def sync(self, client: LockClient) -> None:
        """Outside a bucket: push the change, take the sum."""
        self.assign(client.sync(self.change()))


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
