"""Whether a config's training is already complete: its checkpoint's committed version is the config's last pass.

Why it exists: a pod of the chart's Indexed Job that comes back after the others finished (replaced after a failure,
thawed after a freeze) can never rendezvous, since the rendezvous host (index 0) exited 0 with the rest; its torchrun
agent fails, the pod is replaced, and its index runs out of retries, so the Job fails although its checkpoint holds
the final version. The pod's entrypoint (docker/entrypoint.sh, through ``biggraph completed``) asks this before it
starts torchrun, and again when its agent fails (the last commit may land while it waits in the rendezvous), and
exits 0 when the answer is yes.

"Complete" is kept narrow on purpose: the answer is yes only when this very config's training committed its last
pass, so that a pod never skips training a run of its config would do. The committed version ``V`` must be

- written by a ``train`` of this config: the ``config/json`` metadata of ``model.v{V}.h5`` is this config (as the
  trainer stores it: without ``storage_options``). A stale checkpoint of another config on the same
  ``checkpoint_path`` (other epochs, other edges, another model) is not this config's, even at a higher version;
- the last pass of the config: its ``iteration/*`` metadata names the last chunk of the last edge path of epoch
  ``num_epochs``;
- numbered as a plain ``train`` numbers it, from version 0: ``V == num_epochs * edge paths * chunks``. A grow
  commits a version of its own and trains passes numbered after it, so a grown checkpoint never matches; one with a
  grow journal (``grow.v{N}.json``) is refused outright, its versions continue another run.

What makes the config's runs one run (the owner record's run id, the progress snapshot's binding) does not enter:
a resubmitted Job (another uid) of the same config finds the same checkpoint complete, as its trainer would. A run
that early stopping ended (``validation_edge_paths``; its validation lines in training_stats.json say so, as
``job.checkpoint.validation_history`` reads them) is complete at the version it stopped at.
Nothing is written: the check is a reader's, run by pods that are not the writer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from job.checkpoint.journal import list_journals
from job.checkpoint.validation_history import stopped_early_at
from job.config import ConfigSchema
from job.errors import CheckpointError
from job.formats.checkpoint import CheckpointStorage
from job.formats.committed import open_committed
from job.session import storage_scoped
from storage_adapters.errors import StorageError


@dataclass(frozen=True)
class Completion:
    """The answer: ``complete``, the committed ``version`` (0: none), and one line saying why."""

    complete: bool
    version: int
    message: str


@dataclass(frozen=True)
class FinalPass:
    """Where a config's last pass is, read from the metadata of the version it committed."""

    epochs: int
    edge_paths: int
    chunks: int

    @property
    def version(self) -> int:
        """The version a ``train`` of the config commits with its last pass (passes are numbered from version 0)."""
        return self.epochs * self.edge_paths * self.chunks

    def describe(self) -> str:
        return (f"epoch {self.epochs}/{self.epochs}, edge path {self.edge_paths}/{self.edge_paths}, "
                f"chunk {self.chunks}/{self.chunks}")


def trained_config_json(config: ConfigSchema) -> dict[str, Any]:
    """The config as the trainer stores it in every file's ``config/json`` (job/train/trainer.py): without
    ``storage_options``, which may hold credentials."""
    return dict(json.loads(config.to_json(exclude=("storage_options",))))


@storage_scoped
def training_complete(config: ConfigSchema) -> Completion:
    """Whether ``config``'s checkpoint holds its final version (see the module docstring). A checkpoint that cannot
    be read (none yet, a damaged file, an unreachable store) is not complete: the trainer then reports it."""
    url = config.checkpoint_path
    try:
        return _judge(config, url)
    except (CheckpointError, StorageError, OSError) as err:
        return Completion(False, 0, f"training not complete: {str(err).splitlines()[0] if str(err) else err!r}")


def _judge(config: ConfigSchema, url: str) -> Completion:
    if CheckpointStorage(url).load_version() == 0:
        return Completion(False, 0, f"training not complete: no version committed in {url} yet")
    committed = open_committed(url)
    version = committed.version

    def incomplete(why: str) -> Completion:
        return Completion(False, version, f"training not complete: checkpoint version {version} in {url} {why}")

    grown = sorted(list_journals(url))
    if grown:
        return incomplete(f"was grown (the grow journals of versions {', '.join(map(str, grown))}): its versions "
                          "continue another run")
    metadata = committed.checkpoint.load_model_metadata(version)
    differing = _differing_keys(metadata.get("config/json"), trained_config_json(config))
    if differing:
        return incomplete(f"was not written by this config (the config/json of its model file differs: {differing})")
    keys = ("num_epochs", "epoch_idx", "num_edge_paths", "edge_path_idx", "num_edge_chunks", "edge_chunk_idx")
    found = {key: _int(metadata.get(f"iteration/{key}")) for key in keys}
    if any(value is None for value in found.values()):
        return incomplete("has no pass metadata (iteration/*): not written by a biggraph train")
    at = {key: value for key, value in found.items() if value is not None}
    final = FinalPass(config.num_epochs, len(config.edge_paths), at["num_edge_chunks"])
    if (patience := stopped_early_at(config, committed.checkpoint.load_stats(), version)) is not None:
        return Completion(True, version, f"training already complete: early stopping ended it at checkpoint version "
                                         f"{version} in {url} (best validation MRR {patience.best_mrr:.4f}, version "
                                         f"{patience.best_version}); nothing to train")
    if (at["num_epochs"], at["epoch_idx"] + 1, at["num_edge_paths"], at["edge_path_idx"] + 1, at["edge_chunk_idx"] + 1) \
            != (final.epochs, final.epochs, final.edge_paths, final.edge_paths, final.chunks):
        return incomplete(f"is the pass of epoch {at['epoch_idx'] + 1}/{at['num_epochs']}, edge path "
                          f"{at['edge_path_idx'] + 1}/{at['num_edge_paths']}, chunk {at['edge_chunk_idx'] + 1}/"
                          f"{final.chunks}, not the last of {final.epochs} epoch(s)")
    if version != final.version:
        return incomplete(f"is not numbered as this config's last pass (version {final.version}: "
                          f"{final.epochs} epoch(s) x {final.edge_paths} edge path(s) x {final.chunks} chunk(s))")
    return Completion(True, version, f"training already complete: checkpoint version {version} in {url} is this "
                                     f"config's last pass ({final.describe()}); nothing to train")


def _differing_keys(stored: Any, ours: dict[str, Any]) -> str:
    """The top-level keys in which the stored config JSON differs from ``ours`` ("" when it is the same)."""
    try:
        theirs = json.loads(stored) if isinstance(stored, str) else None
    except json.JSONDecodeError:
        theirs = None
    if not isinstance(theirs, dict):
        return "none stored"
    keys = sorted(k for k in set(theirs) | set(ours) if theirs.get(k, ...) != ours.get(k, ...))
    return ", ".join(keys[:5]) + (" ..." if len(keys) > 5 else "")


def _int(value: Any) -> Optional[int]:
    """An ``iteration/*`` attribute as an int (h5py gives numpy integers); None when absent or not an integer."""
    if value is None or isinstance(value, (bool, str, bytes)):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
