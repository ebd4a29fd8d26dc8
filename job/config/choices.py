"""The closed sets of values some config keys take, in one place.

The schema's help strings, its checks and the tests all read these tuples. Operators, comparators and
loss functions are the model registries' declared names (``job.model.names``, torch-free): a new one is
declared there and registered by its implementation, never listed again here.
"""

from __future__ import annotations

import enum

from job.model.names import COMPARATORS, LOSS_FUNCTIONS, OPERATORS


class BucketOrder(str, enum.Enum):
    """Order in which the buckets of an edge chunk are trained (PBG's names)."""

    RANDOM = "random"
    AFFINITY = "affinity"
    INSIDE_OUT = "inside_out"
    OUTSIDE_IN = "outside_in"
    BUFFER = "buffer"  # ours: few partition swaps for a buffer of partition_buffer partitions


REGULARIZERS = ("N3",)
EDGE_READ_MODES = ("stage", "stream")
DEVICES = ("auto", "cpu", "cuda")
GROW_INITS = ("random", "neighbours")
GROW_NUM_EPOCHS_DEFAULT = 5

__all__ = ["COMPARATORS", "DEVICES", "EDGE_READ_MODES", "GROW_INITS", "GROW_NUM_EPOCHS_DEFAULT", "LOSS_FUNCTIONS",
           "OPERATORS", "REGULARIZERS", "BucketOrder"]
