"""The names of PBG's operators, comparators and losses, declared once and free of torch.

Three things need these names and must agree on them: the config (its choices and their
help text), the torch scoring model (``job.model.operators``, ``comparators``, ``losses``)
and the numpy serving twin of the archive (``job.archive.scoring``). The names live here,
apart from either implementation, because the config and the archive reader must not
import torch: ``import job.config`` and ``biggraph config-help`` start in a fraction of a
second, and ``job.archive.load`` runs where only numpy and flatbuffers are installed. Each
implementation registers against these declarations (``Registry(..., declared=...)``
refuses a name not declared here), and tests/test_model_registry.py checks that every
declared name has an implementation in both registries, so a name cannot be offered by the
config without a model behind it.

The order is PBG's and is the order shown to users.
"""

from __future__ import annotations

OPERATORS: tuple[str, ...] = ("none", "diagonal", "translation", "linear", "affine", "complex_diagonal")
COMPARATORS: tuple[str, ...] = ("dot", "cos", "l2", "squared_l2")
LOSS_FUNCTIONS: tuple[str, ...] = ("ranking", "logistic", "softmax")

__all__ = ["COMPARATORS", "LOSS_FUNCTIONS", "OPERATORS"]
