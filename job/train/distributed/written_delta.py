"""The partitions written this pass, sent to each client once: a ``next`` or ``reserve`` reply carries only those its
client has not seen yet (issue #45).

Why: every ``next`` and ``reserve`` reply used to list every partition written this pass (the trainer reads a
partition from the next version once it is there). At P=256 that list grows to 256 keys, and sorting it, encoding
it for the reply's MAC and again for the wire cost ~0.9 ms a reply on the lock server's one serving thread, two
replies a bucket: as much as the rest of the bucket's scheduling (bench/RESULTS.md, "The lock server's serving
thread"). The written partitions only grow within a pass, so the server keeps them in the order it first saw them
(``WrittenLog``) and a request says how many of them its client holds (``known``: the log's ``epoch``, the server's
own id, and a count); the reply carries the ones after that count. A client whose epoch is not the server's (a new
pass, a restarted rank 0), or that claims more than there are, gets the whole list from the start, so a claim can
never make a client miss a partition, only cost it a longer reply. ``WrittenView`` is the client's side.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from job.train.distributed.wire_fields import ProtocolError
from job.train.distributed.wire_fields import key_list as _key_list
from job.types import PartitionKey


@dataclass(frozen=True)
class WrittenDelta:
    """The written partitions from position ``start`` of the server's log of ``epoch`` on."""

    epoch: str
    start: int
    keys: tuple[PartitionKey, ...]


class WrittenLog:
    """The server's side: the partitions written this pass, in the order first seen (``catch_up`` with the state's
    set before each reply; the set only grows within a pass)."""

    def __init__(self, epoch: str) -> None:
        self.epoch = epoch
        self.keys: list[PartitionKey] = []
        self._seen: set[PartitionKey] = set()

    def catch_up(self, written: Collection[PartitionKey]) -> None:
        if len(written) != len(self._seen):  # (O(1) while nothing new was written)
            new = sorted(k for k in written if k not in self._seen)
            self.keys.extend(new)
            self._seen.update(new)

    def since(self, known: Optional[tuple[str, int]]) -> WrittenDelta:
        """What a client that holds ``known`` (epoch, count) lacks: from its count on if that is ours, else all."""
        start = known[1] if known is not None and known[0] == self.epoch and 0 <= known[1] <= len(self.keys) else 0
        return WrittenDelta(self.epoch, start, tuple(self.keys[start:]))


class WrittenView:
    """The client's side: the written partitions as the server's replies told them, and what to claim (``known``)."""

    def __init__(self) -> None:
        self.epoch = ""
        self.keys: list[PartitionKey] = []

    @property
    def known(self) -> tuple[str, int]:
        return self.epoch, len(self.keys)

    def merge(self, delta: WrittenDelta) -> frozenset[PartitionKey]:
        """Take a reply's delta in; the partitions written this pass (all of them). A delta that starts past what
        this client holds (no correct server sends one) raises ``ProtocolError``."""
        if delta.epoch != self.epoch or delta.start == 0:
            self.epoch, self.keys = delta.epoch, []
        if delta.start > len(self.keys):
            raise ProtocolError(f"written partitions from position {delta.start}, but {len(self.keys)} are known")
        del self.keys[delta.start:]
        self.keys.extend(delta.keys)
        return frozenset(self.keys)


def encode_known(known: Optional[tuple[str, int]]) -> dict[str, Any]:
    return {"written_known": [known[0], int(known[1])]} if known is not None else {}


def decode_known(fields: Any) -> Optional[tuple[str, int]]:
    """A request's ``written_known`` ([epoch, count]); absent: None (the whole list is sent, as to older clients)."""
    value = fields.get("written_known")
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str)
            or type(value[1]) is not int or value[1] < 0):
        raise ProtocolError(f"'written_known' is not [epoch, count >= 0]: {value!r}")
    return value[0], value[1]


def encode_delta(delta: WrittenDelta) -> dict[str, Any]:
    return {"written": {"epoch": delta.epoch, "from": delta.start, "keys": [[k[0], int(k[1])] for k in delta.keys]}}


def decode_delta(message: Any) -> Optional[WrittenDelta]:
    value = message.get("written")
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("epoch"), str) or type(value.get("from")) is not int \
            or value["from"] < 0:
        raise ProtocolError(f"'written' is not {{epoch, from >= 0, keys}}: {str(value)[:120]}")
    keys: Sequence[PartitionKey] = _key_list(value.get("keys", []), "'written' keys")
    return WrittenDelta(value["epoch"], value["from"], tuple(keys))
