"""The closed sets of values some config keys take, in one place.

The schema's help strings, its checks and the tests all read these tuples. Operators, comparators and
loss functions are the model registries' declared names (``job.model.names``, torch-free): a new one is
declared there and registered by its implementation, never listed again here.
"""

from __future__ import annotations

import enum

from job.model.names import COMPARATORS, LOSS_FUNCTIONS, OPERATORS
from storage_adapters.session import EDGE_READ_MODES  # the storage layer's own list: it reads edges that way


class BucketOrder(str, enum.Enum):
    """Order in which the buckets of an edge chunk are trained (PBG's names)."""

    RANDOM = "random"
    AFFINITY = "affinity"
    INSIDE_OUT = "inside_out"
    OUTSIDE_IN = "outside_in"
    BUFFER = "buffer"  # ours: few partition swaps for a buffer of partition_buffer partitions


REGULARIZERS = ("N3", "N3_shared_relations", "DURA")
# the operators DURA is defined for: bilinear ones (an additive term has no duality to penalise)
DURA_OPERATORS = ("none", "diagonal", "complex_diagonal", "linear")
DEVICES = ("auto", "cpu", "cuda")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16", "auto")
GROW_INITS = ("random", "neighbours")
INIT_METHODS = ("normal", "xavier")
# the embeddings' optimizer: PBG's row-wise Adagrad (one sum per row) or Adagrad with a sum per coordinate
ENTITY_OPTIMIZERS = ("row_adagrad", "adagrad")
# which buckets of epoch 0 stagger their Hogwild workers by hogwild_delay (job/train/trainer.py)
HOGWILD_DELAY_SCOPES = ("first_visit", "epoch_0")
GROW_NUM_EPOCHS_DEFAULT = 5
# how held-out edges are ranked (job/eval_protocol.py): "pbg" is PBG 1.0's sampled protocol, exactly
EVAL_PROTOCOLS = ("auto", "all", "sampled", "pbg")

# every top-level key that takes one of a closed set of names: check_choices refuses the rest, and the chart's
# values.schema.json (job/config/json_schema.py) lists them as enums (compute_dtype may also be null)
KEY_CHOICES: dict[str, tuple[str, ...]] = {
    "comparator": COMPARATORS, "loss_fn": LOSS_FUNCTIONS, "regularizer": REGULARIZERS,
    "edge_read_mode": EDGE_READ_MODES, "device": DEVICES, "grow_init": GROW_INITS, "eval_protocol": EVAL_PROTOCOLS,
    "compute_dtype": COMPUTE_DTYPES, "init_method": INIT_METHODS, "hogwild_delay_scope": HOGWILD_DELAY_SCOPES,
    "entity_optimizer": ENTITY_OPTIMIZERS,
}

__all__ = ["COMPARATORS", "COMPUTE_DTYPES", "DEVICES", "DURA_OPERATORS", "EDGE_READ_MODES", "ENTITY_OPTIMIZERS",
           "EVAL_PROTOCOLS", "GROW_INITS", "GROW_NUM_EPOCHS_DEFAULT", "HOGWILD_DELAY_SCOPES", "INIT_METHODS", "KEY_CHOICES",
           "LOSS_FUNCTIONS", "OPERATORS", "REGULARIZERS", "BucketOrder"]
