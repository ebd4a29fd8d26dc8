"""Optimizer state in a checkpoint file: a ``torch.save`` blob, read only with ``torch.load(weights_only=True)``
because a checkpoint directory is untrusted input."""

from __future__ import annotations

import io
import pickle
from typing import Any

from job.errors import InputFormatError

OPTIMIZER_DATASET = "optimizer/state_dict"


def serialize_optimizer_state(state: dict[str, Any] | None) -> bytes | None:
    """The blob stored in ``optimizer/state_dict`` (None: no optimizer state to store)."""
    if state is None:
        return None
    import torch  # heavy: loaded only when there is optimizer state (report, k8s status and validate never need it)

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def deserialize_optimizer_state(blob: bytes | None, where: str) -> dict[str, Any] | None:
    """Load an optimizer blob without executing anything it might contain."""
    if blob is None:
        return None
    import torch  # heavy: loaded only when there is optimizer state (see serialize_optimizer_state)

    try:
        return torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, Exception) as err:  # untrusted bytes: any decode failure (IndexError...)
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputFormatError(
            where, f"optimizer state cannot be loaded safely ({first_line})", dataset=OPTIMIZER_DATASET,
            expected="a torch.save blob of tensors and plain values",
        ) from None
