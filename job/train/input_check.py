"""A run's input, checked and read once per group: the verdict of ``validate_cheap`` and the facts every trainer
needs before its first bucket (entity counts, the dynamic relation count, the number of edge chunks).

Alone, a trainer checks and reads them itself. In a torchrun group rank 0 does, and hands the verdict and the facts
to the others through the round's store (``input-check``), so the group asks storage once instead of once per rank:
on an object store the check is ~3 requests per bucket file (P=16: ~800), counting edge chunks a request per bucket
file more, and every trainer of a group re-formed after a lost pod used to repeat them all at once (the chaos bench:
6-8 trainers starting together on 2 vCPUs with their S3 server; bench/RESULTS.md, "A group's start-up").

A refusal reaches every rank: rank 0 raises its own error, and the others raise ``InputRefused`` with rank 0's
message (which names the file) and its exit code (2 for bad input, as ``biggraph train`` alone), so that every pod's
log says why and none of them trains. A crash of rank 0's check (not an input problem) is handed on as a crash.
The verdict lives under the round's keys. A group formed again (a new round, after a lost pod) does not check again
an input it already passed: the checking rank lists the input (``storage.tree_listing``: a request per 1,000 objects
on S3, against ~3 per bucket file for the check, P^2 files) and, when the listing (sizes and change tags: ETags on
S3, modification times locally) and the training config's digest are those of the last check that passed
(``input_check.json`` in the checkpoint directory, written by the checkpoint manager with the next commit), takes
that check's facts. An input changed or fixed in between lists differently and is checked again; a refusal is never
remembered.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional, Protocol

import storage_adapters as storage
from job.config import ConfigSchema
from job.errors import UserError
from job.formats import entities as entity_format
from job.formats.validate import validate_cheap
from job.train.distributed.group import DistributedContext, config_digest
from job.train.inputs import chunks_for
from storage_adapters.errors import StorageError

KEY = "input-check"  # the round's store key of rank 0's verdict
CHECKING_RANK = 0  # the messages name it: "rank 0's input check"
RECORD_FORMAT = 1

logger = logging.getLogger("biggraph")


class CheckRecords(Protocol):
    """Where the last passing check is kept (``CheckpointManager``: ``input_check.json``)."""

    def input_check(self) -> Optional[dict[str, Any]]: ...

    def record_input_check(self, record: dict[str, Any]) -> None: ...  # kept from the next commit on


@dataclass(frozen=True)
class InputFacts:
    """What every trainer reads from the input before its first bucket."""

    entity_counts: dict[str, list[int]]
    num_dynamic_rels: int  # 0 without dynamic_relations
    num_chunks: int


class InputRefused(UserError):
    """Rank 0's input check refused the input: its message, with its exit code, on a rank that did not check."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def read_facts(config: ConfigSchema) -> InputFacts:
    """Check the input (``validate_cheap``: the first problem raised) and take what training needs from what the
    check read: the entity counts and the largest bucket file's edges (which size the edge chunks), so that none of
    it is read twice (counting the chunks alone asked for the size of every bucket file: P^2 requests on S3)."""
    report = validate_cheap(config)
    counts: dict[str, list[int]] = {}
    for entity_type, per_part in report.entity_counts.items():
        # the check raised on any count it could not read
        counts[entity_type] = [int(c) for c in per_part if c is not None]
    largest = max((report.largest_edge_file.get(path, 0) for path in config.edge_paths), default=0)
    return InputFacts(
        entity_counts=counts,
        num_dynamic_rels=entity_format.read_dynamic_rel_count(config.entity_path) if config.dynamic_relations else 0,
        num_chunks=chunks_for(config, largest),
    )


def input_listing(config: ConfigSchema) -> Optional[str]:
    """A digest of every input file the check reads, as listed now (name, size, change tag); None when the storage
    cannot tell a changed file from its listing."""
    digest = hashlib.sha256()
    paths = [("entity_path", config.entity_path), *(("edge_paths", p) for p in config.edge_paths),
             *(("validation_edge_paths", p) for p in config.validation_edge_paths),
             *(("validation_filter_paths", p) for p in config.validation_filter_paths)]
    for key, url in paths:
        listing = storage.tree_listing(url)
        if listing is None:
            return None
        digest.update(json.dumps([key, url, listing]).encode())
    return digest.hexdigest()


def _facts_of(data: Any) -> InputFacts:
    """``InputFacts`` from their JSON form (a store value or a record): KeyError/TypeError/ValueError if malformed."""
    return InputFacts(entity_counts={str(t): [int(c) for c in counts] for t, counts in data["entity_counts"].items()},
                      num_dynamic_rels=int(data["num_dynamic_rels"]), num_chunks=int(data["num_chunks"]))


def facts_once(config: ConfigSchema, records: Optional[CheckRecords]) -> InputFacts:
    """``read_facts``, unless ``records`` hold a passing check of this config and of the input as it lists now."""
    if records is None:
        return read_facts(config)
    listing = input_listing(config)
    config_id = config_digest(config.to_json(exclude=("storage_options",)))
    record = records.input_check()
    if listing is not None and record is not None and record.get("format") == RECORD_FORMAT \
            and record.get("config") == config_id and record.get("input") == listing:
        try:
            facts = _facts_of(record["facts"])
        except (KeyError, TypeError, ValueError, AttributeError):
            logger.warning("input_check.json of %s is malformed: the input is checked again", config.checkpoint_path)
        else:
            logger.info("input unchanged since its last check passed (same files, sizes and change tags): not "
                        "checked again")
            return facts
    facts = read_facts(config)
    if listing is not None:
        records.record_input_check({"format": RECORD_FORMAT, "config": config_id, "input": listing,
                                    "facts": asdict(facts)})
    return facts


def checked_input(config: ConfigSchema, dist: Optional[DistributedContext],
                  records: Optional[CheckRecords] = None) -> InputFacts:
    """The input's facts once it passed the check: read here alone or on rank 0 (which publishes them), taken from
    rank 0 on every other rank of a group. Raises the check's error on every rank when the input is refused.
    ``records``: where a passing check is kept for the next start (see the module docstring)."""
    if dist is None:
        return facts_once(config, records)
    key = dist.key(KEY)
    if dist.rank == CHECKING_RANK:
        try:
            facts = facts_once(config, records)
        except (UserError, StorageError) as err:
            dist.store.set(key, json.dumps({"refused": str(err), "exit_code": err.exit_code}))
            raise
        except BaseException as err:
            dist.store.set(key, json.dumps({"crashed": f"{type(err).__name__}: {err}"}))
            raise
        dist.store.set(key, json.dumps({"facts": asdict(facts)}))
        return facts
    return _verdict(json.loads(_wait_for(dist, key)))


def _verdict(message: dict[str, Any]) -> InputFacts:
    if "refused" in message:
        raise InputRefused(f"{message['refused']} (found by rank 0's input check)", int(message["exit_code"]))
    if "crashed" in message:
        raise RuntimeError(f"rank 0's input check failed: {message['crashed']}")
    return _facts_of(message["facts"])


def _wait_for(dist: DistributedContext, key: str) -> bytes:
    """The value of ``key`` once rank 0 has set it. No deadline of its own: rank 0's check takes what the input's
    size and storage make it (validation edges are scanned whole); should rank 0 die, its store goes with it and
    the store call raises."""
    while not dist.store.check([key]):
        dist.check_peers()
        time.sleep(0.05)
    value: bytes = dist.store.get(key)
    return value
