"""Opening a committed checkpoint version: the one way every reader (eval, export, archive, report) does it.

A checkpoint directory holds one committed version (``checkpoint_version.txt``, written last); older versions
survive only in the ``epoch_{E}/`` snapshots that ``checkpoint_preservation_interval`` keeps. ``version=None``
means the committed one; ``version=N`` means N, found in the directory or in a snapshot. Every reader gives the
same two errors: nothing committed yet, or no such version (listing the ones there are).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import storage_adapters as storage
from job.errors import CheckpointError
from job.formats.checkpoint import CheckpointStorage

_SNAPSHOT = re.compile(r"epoch_\d+")


@dataclass(frozen=True)
class Committed:
    """``version`` of the checkpoint at ``url``, read through ``checkpoint`` (the directory or a snapshot of it)."""

    url: str
    checkpoint: CheckpointStorage
    version: int
    latest: int  # the directory's committed version


def no_checkpoint_error(url: str) -> CheckpointError:
    return CheckpointError(f"{url}: no committed checkpoint yet (checkpoint_version.txt missing): train first, or "
                           "point checkpoint_path at a checkpoint directory")


def open_committed(url: str, version: int | None = None) -> Committed:
    """The committed ``version`` (default: the latest) of the checkpoint directory ``url``."""
    main = CheckpointStorage(url)
    latest = main.load_version()
    if latest == 0:
        raise no_checkpoint_error(url)
    if version is None or version == latest:
        return Committed(url, main, latest, latest)
    if version < 1:
        raise CheckpointError(f"{url}: checkpoint versions start at 1, got {version}")
    if version < latest and main.has_model(version):  # a directory that keeps old versions (PBG may leave them)
        return Committed(url, main, version, latest)
    found = {latest}
    for snapshot in _snapshots(url):
        snapshot_version = snapshot.load_version()
        if snapshot_version == version and snapshot.has_model(version):
            return Committed(url, snapshot, version, latest)
        found.add(snapshot_version)
    available = ", ".join(str(v) for v in sorted(found - {0}))
    raise CheckpointError(f"{url}: no committed checkpoint version {version} (available: {available}; older versions "
                          "survive only in epoch_*/ snapshots, see checkpoint_preservation_interval)")


def _snapshots(url: str) -> list[CheckpointStorage]:
    try:
        entries = storage.listdir(url)
    except FileNotFoundError:
        return []
    return [CheckpointStorage(storage.join(url, name)) for name in sorted(entries) if _SNAPSHOT.fullmatch(name)]
