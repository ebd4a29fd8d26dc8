"""Model archives: one zip, many tagged versions of a trained model (FlatBuffers inside), served without torch.

``from job.archive import load`` needs only numpy and flatbuffers: this package's reading side
(container, ndarray, loader, model and the generated ``fb`` code) never imports torch or h5py.
Writing a tag from a checkpoint (``job.archive.writer``, ``biggraph archive``) does, and is
imported only when used. The format is described in docs/archive.md and schema/*.fbs.
"""

from __future__ import annotations

from typing import Any

from job.archive.errors import (
    ArchiveError,
    ArchiveFormatError,
    ArchiveIntegrityError,
    DanglingReferenceError,
    QueryError,
    ShapeMismatchError,
    TagError,
)
from job.archive.loader import list_tags, load, verify
from job.archive.model import ArchiveModel

__all__ = [
    "ArchiveError",
    "ArchiveFormatError",
    "ArchiveIntegrityError",
    "ArchiveModel",
    "DanglingReferenceError",
    "QueryError",
    "ShapeMismatchError",
    "TagError",
    "add_tag",
    "list_tags",
    "load",
    "verify",
]


def __getattr__(name: str) -> Any:
    if name == "add_tag":  # the writer reads checkpoints (h5py, torch): imported on first use only
        from job.archive.writer import add_tag

        return add_tag
    raise AttributeError(f"module 'job.archive' has no attribute '{name}'")
