"""biggraph: PyTorch-BigGraph-compatible graph embedding training, built for object storage and Kubernetes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from job.config import ConfigSchema
    from job.data.importing import ImportOptions
    from job.growing import GrowSummary

__version__ = "0.1.0"


def grow(config: ConfigSchema, files: list[str], options: ImportOptions, **kwargs: Any) -> GrowSummary:
    """Grow a trained model with new edges (``biggraph grow``); see :func:`job.growing.grow`.

    Defined here, importing lazily, so that ``import job`` stays as light as the command line needs.
    """
    from job.growing import grow as _grow

    return _grow(config, files, options, **kwargs)
