"""The closed sets of values some config keys take, in one place.

The schema's help strings, its checks and the tests all read these tuples, so a new
operator, comparator or loss function is added here and nowhere else in the config.
"""

from __future__ import annotations

import enum


class BucketOrder(str, enum.Enum):
    """Order in which the buckets of an edge chunk are trained (PBG's names)."""

    RANDOM = "random"
    AFFINITY = "affinity"
    INSIDE_OUT = "inside_out"
    OUTSIDE_IN = "outside_in"
    BUFFER = "buffer"  # ours: few partition swaps for a buffer of partition_buffer partitions


OPERATORS = ("none", "diagonal", "translation", "linear", "affine", "complex_diagonal")
COMPARATORS = ("dot", "cos", "l2", "squared_l2")
LOSS_FUNCTIONS = ("ranking", "logistic", "softmax")
REGULARIZERS = ("N3",)
EDGE_READ_MODES = ("stage", "stream")
DEVICES = ("auto", "cpu", "cuda")
GROW_INITS = ("random", "neighbours")
GROW_NUM_EPOCHS_DEFAULT = 5
