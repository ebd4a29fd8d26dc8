"""The record of a grow, and how its new input files become the input without a moment of inconsistency.

A grown model is two things that must change together: the checkpoint (version N -> N+1, more rows)
and the input (``entity_path`` counts and names, the edge files), which every later ``train``,
``eval`` or ``export`` reads beside the checkpoint. The checkpoint has an atomic commit (the version
marker), the input does not, so the input follows the checkpoint's commit, write-ahead style:

1. every new input file is written under a staging directory ``.grow-v{N+1}/`` inside the directory it
   will end up in (same filesystem, so publishing it locally is a rename);
2. the journal ``grow.v{N+1}.json`` is written into the checkpoint directory: which staged file
   replaces which input file, and what the continued training needs (where the new edges start in
   each bucket file);
3. the grown checkpoint version is committed (manifest, then ``checkpoint_version.txt``);
4. the staged files are moved over the input ("published") and the journal says so.

A crash before 3 leaves version N committed and the old input untouched: the leftovers (staging
directories, the journal, files of version N+1) are garbage that the next ``grow`` or ``train``
removes. A crash after 3 leaves version N+1 committed and the input partly published:
``finish_committed_grow``, which ``grow``, ``train``, ``eval`` and ``export`` call before reading
anything, completes the moves (each one idempotent). Readers therefore always see either the old
model with the old input or the grown model with the grown input.

A journal is read from the checkpoint directory, which may come from elsewhere: every read checks its shape
and confines it to the ``.grow-v{N}/`` staging directories of the caller's ``entity_path`` and ``edge_paths``
(``journal_checks``); the URLs moved and removed are rebuilt from those, never taken from the journal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import storage_adapters as storage
from job.checkpoint.journal_checks import GrowInputs, check_shape, confine, recorded_inputs
from job.errors import CheckpointError
from job.formats.checkpoint import CheckpointStorage
from job.formats.checksums import EDGE_MANIFEST
from job.formats.edges import forget_edge_manifest

logger = logging.getLogger("biggraph")

JOURNAL_RE = re.compile(r"^grow\.v(?P<version>\d+)\.json$")


def journal_file(checkpoint_path: str, version: int) -> str:
    return storage.join(checkpoint_path, f"grow.v{version}.json")


def staging_dir(directory: str, version: int) -> str:
    """Where the new files of ``directory`` wait until the grown version ``version`` is committed."""
    return storage.join(directory, f".grow-v{version}")


@dataclass
class GrowRecord:
    """What one grow did (the journal's content)."""

    version: int  # the grown checkpoint version
    from_version: int
    files: list[dict[str, Any]]  # the new edge files: url and size (a re-run with the same files resumes)
    options: dict[str, Any]  # the import options that read them
    moves: list[list[str]]  # [staged url, final url], in publishing order
    staging_dirs: list[str]
    config_json: str  # config.json of the grown checkpoint (PBG's keys), written when publishing
    # per edge path, per bucket (lhs-major): how many edges the bucket file held before this grow; the new
    # edges follow them
    boundaries: list[list[int]]
    new_entities: dict[str, int] = field(default_factory=dict)
    new_relations: list[str] = field(default_factory=list)
    new_edges: int = 0
    init: str = "neighbours"
    published: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, url: str, text: str, version: int | None = None) -> GrowRecord:
        """The journal at ``url`` (of ``version``, when known from its name), its shape checked (``journal_checks``).
        Its paths are still the journal's: ``confined`` before anything is moved or removed."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{url}: not a grow journal ({str(err).splitlines()[0]})") from None
        return cls(**check_shape(url, data, version))

    def confined(self, url: str, inputs: GrowInputs | None) -> GrowRecord:
        """This journal (read from ``url``) with its moves and staging directories rebuilt from ``inputs`` (default:
        the input locations it records), or a CheckpointError naming a path outside their ``.grow-v{N}/``."""
        moves, staging_dirs = confine(url, self.version, self.moves, self.staging_dirs,
                                      inputs or recorded_inputs(url, self.config_json))
        return dataclasses.replace(self, moves=moves, staging_dirs=staging_dirs)

    def same_input(self, files: list[dict[str, Any]], options: dict[str, Any]) -> bool:
        return self.files == files and self.options == options


def describe_files(urls: list[str]) -> list[dict[str, Any]]:
    """The identity of the new edge files as the journal keeps it."""
    return [{"url": url, "size": storage.size(url)} for url in urls]


def list_journals(checkpoint_path: str) -> dict[int, str]:
    """Version -> journal URL of every grow journal in the checkpoint directory."""
    out = {}
    for name in storage.listdir(checkpoint_path):
        match = JOURNAL_RE.match(name)
        if match:
            out[int(match.group("version"))] = storage.join(checkpoint_path, name)
    return out


def read_record(url: str) -> GrowRecord:
    """The journal at ``url``, its shape checked (``GrowRecord.from_json``)."""
    match = JOURNAL_RE.match(url.rsplit("/", 1)[-1])
    return GrowRecord.from_json(url, storage.read_text(url), int(match.group("version")) if match else None)


def write_record(checkpoint_path: str, record: GrowRecord) -> None:
    storage.write_text(journal_file(checkpoint_path, record.version), record.to_json())


def latest_record(checkpoint_path: str, committed: int) -> GrowRecord | None:
    """The journal of the last grow at or before the committed version (None when the model never grew)."""
    versions = [v for v in list_journals(checkpoint_path) if v <= committed]
    if not versions:
        return None
    return read_record(journal_file(checkpoint_path, max(versions)))


def _move(src: str, dst: str) -> None:
    """Move one staged file over its final name; a source already gone was moved by an earlier attempt."""
    try:
        storage.move(src, dst)  # remotely the copy is whole before the source goes: a re-run finds one or the other
    except FileNotFoundError:
        if not storage.exists(dst):
            raise CheckpointError(f"{src}: missing, and {dst} was never published (the grow's staged input was "
                                  "removed by hand?)") from None


def publish(checkpoint_path: str, record: GrowRecord) -> None:
    """Move the staged input of a committed grow into place (idempotent), then mark the journal published."""
    for src, dst in record.moves:
        _move(src, dst)
        if dst.endswith("/" + EDGE_MANIFEST):
            forget_edge_manifest(dst[: -len(EDGE_MANIFEST) - 1])  # remote manifests are cached per process
    CheckpointStorage(checkpoint_path).save_config(record.config_json)
    for directory in record.staging_dirs:
        with contextlib.suppress(Exception):
            storage.remove(directory)
    record.published = True
    write_record(checkpoint_path, record)
    logger.info("grow: published the input of checkpoint version %d", record.version)


def discard_uncommitted(checkpoint_path: str, committed: int, inputs: GrowInputs | None = None) -> None:
    """Remove the journals and staged input of grows that never committed (a crash before the marker); a journal
    that names anything but staging directories of ``inputs`` is refused (CheckpointError), nothing removed."""
    uncommitted = {v: url for v, url in list_journals(checkpoint_path).items() if v > committed}
    records = {v: read_record(url).confined(url, inputs) for v, url in uncommitted.items()}  # all before any removal
    for version, url in sorted(uncommitted.items()):
        for directory in records[version].staging_dirs:
            storage.remove(directory)
        storage.remove(url)
        logger.info("grow: removed the staged input of uncommitted version %d", version)


def finish_committed_grow(checkpoint_path: str, clean_uncommitted: bool = False, *,
                          inputs: GrowInputs | None = None) -> None:
    """Publish the input of the committed version if a grow committed it but stopped before publishing.

    Cheap when there is nothing to do (one listing of the checkpoint directory). Every reader of the
    checkpoint together with the input calls it first; writers (``train``, ``grow``) also remove what
    an uncommitted grow left (``clean_uncommitted``): readers must not, a grow may be running.

    ``inputs`` (``GrowInputs.of(config)``): the caller's input locations, the only ones a journal may touch.
    Without them a journal is held to the locations its own ``config_json`` records (still only ``.grow-v{N}/``
    staging directories and their files), so every command passes its config's.
    """
    journals = list_journals(checkpoint_path)
    if not journals:
        return
    committed = CheckpointStorage(checkpoint_path).load_version()
    done = [v for v in journals if v <= committed]
    if done:
        url = journals[max(done)]
        record = read_record(url)
        if not record.published:  # a published journal is only read (its boundaries): nothing it names is touched
            logger.info("grow: version %d was committed but its input not yet published: publishing it", record.version)
            publish(checkpoint_path, record.confined(url, inputs))
    if clean_uncommitted:
        discard_uncommitted(checkpoint_path, committed, inputs)
