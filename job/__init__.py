"""biggraph: PyTorch-BigGraph-compatible graph embedding training, built for object storage and Kubernetes.

The Python API - what every ``biggraph`` command calls, one function per step::

    import job

    config = job.load_config("config.yaml", ["num_epochs=5"])     # or job.parse_config({...})
    job.import_edges(config, ["edges.tsv"], job.ImportOptions(lhs_col=0, rel_col=1, rhs_col=2))
    job.validate(config)                                          # -> ValidationReport (.problems)
    job.train(config)                                             # -> summary dict
    job.evaluate(config, candidates="all")                        # -> metrics dict (mrr, hits@10, ...)
    job.export(config, "embeddings/", fmt="npy")                  # -> ExportSummary
    job.archive(config, "model.zip", tag="v1")                    # one tagged version in a model archive
    job.report("checkpoints/", "report.html")                     # -> ReportData
    job.grow(config, ["new_edges.tsv"], job.ImportOptions(...))   # -> GrowSummary

Every function takes the config (storage options travel with it: no process-wide setting) and raises
``job.UserError`` (or ``storage_adapters.StorageError``) for anything the user can fix. They work from a script
without a ``__main__`` guard, from ``python - <<EOF`` and from a notebook.

The names are resolved on first use (PEP 562): ``import job`` stays cheap, so ``biggraph --help`` and
``config-help`` answer without loading torch. Three of them share their name with a subpackage (``job.train``,
``job.archive``, ``job.report``): importing that subpackage must not replace the function on
``job`` (Python binds a loaded submodule as an attribute of its parent), so the module ignores exactly those
bindings; the subpackages stay importable as usual (``from job.train import trainer``).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from job.archive.writer import add_tag as archive
    from job.config import ConfigSchema, load_config, parse_config
    from job.data.export import export_checkpoint as export
    from job.data.importing import ImportOptions, import_edges
    from job.data.legacy import convert_legacy
    from job.errors import UserError
    from job.evaluation import evaluate as evaluate
    from job.formats.validate import run_validation as validate
    from job.growing import grow
    from job.report import write_report as report
    from job.train import train

__version__ = "0.1.0"

# public name -> (module, attribute)
_API: dict[str, tuple[str, str]] = {
    "load_config": ("job.config", "load_config"),
    "parse_config": ("job.config", "parse_config"),
    "ConfigSchema": ("job.config", "ConfigSchema"),
    "ImportOptions": ("job.data.importing", "ImportOptions"),
    "import_edges": ("job.data.importing", "import_edges"),
    "validate": ("job.formats.validate", "run_validation"),
    "train": ("job.train", "train"),
    "evaluate": ("job.evaluation", "evaluate"),
    "export": ("job.data.export", "export_checkpoint"),
    "archive": ("job.archive.writer", "add_tag"),
    "report": ("job.report", "write_report"),
    "grow": ("job.growing", "grow"),
    "convert_legacy": ("job.data.legacy", "convert_legacy"),
    "UserError": ("job.errors", "UserError"),
}

__all__ = [  # the keys of _API (tests/test_api.py holds them equal), spelled out for linters and type checkers
    "__version__", "load_config", "parse_config", "ConfigSchema", "ImportOptions", "import_edges", "validate", "train",
    "evaluate", "export", "archive", "report", "grow", "convert_legacy", "UserError",
]


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _API[name]
    except KeyError:
        raise AttributeError(f"module 'job' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


class _ApiModule(types.ModuleType):
    """``job`` itself: a loaded subpackage never hides the API function of the same name."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _API and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _ApiModule
