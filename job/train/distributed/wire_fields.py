"""The field checks of the lock protocol's decoding (job/train/distributed/protocol.py): each reads one field of a
JSON message and raises ``ProtocolError`` naming the field and what is wrong, so that a malformed request is
answered with a ``Refusal`` instead of failing somewhere inside the server. Apart from protocol.py to keep each
module within its size."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from job.types import Bucket, PartitionKey

# a staged file of a write group: (entity type, partition, its staged name), then its size and CRC-32 when the
# writer knows them (job/checkpoint/write_groups.py: the commit after a restart reads nothing it already knows)
Staged = tuple[Any, ...]

# the most relation rows one request may name (Freebase86m has 14,824 relation types; a bucket names the ones it
# used): bounds what the server decodes and checks before it knows the layout
MAX_ROWS = 1 << 20


class ProtocolError(ValueError):
    """A message that does not follow the protocol: not JSON, an unknown operation, a missing or mistyped field."""


def integer(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{what} is not an integer: {value!r}")
    return value


def partition_key(value: Any, what: str) -> PartitionKey:
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not isinstance(value[0], str):
        raise ProtocolError(f"{what} is not a partition [entity type, partition]: {value!r}")
    return value[0], integer(value[1], what)


def key_list(value: Any, what: str) -> tuple[PartitionKey, ...]:
    if not isinstance(value, list):
        raise ProtocolError(f"{what} is not a list: {value!r}")
    return tuple(partition_key(k, what) for k in value)


def bucket(value: Any, what: str) -> Optional[Bucket]:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ProtocolError(f"{what} is not a bucket [lhs, rhs]: {value!r}")
    return Bucket(integer(value[0], what), integer(value[1], what))


def staged(value: Any) -> Staged:
    if not isinstance(value, (list, tuple)) or len(value) not in (3, 5) or not isinstance(value[0], str) \
            or not isinstance(value[2], str) or (len(value) == 5 and not isinstance(value[4], str)):
        raise ProtocolError(f"'staged' holds {value!r}, not [entity type, partition, name] or [entity type, "
                            "partition, name, size, crc32]")
    if len(value) == 5:
        size = integer(value[3], "'staged' size")
        if size < 0:
            raise ProtocolError(f"'staged' holds {value!r}: a negative size")
        return value[0], integer(value[1], "'staged'"), value[2], size, value[4]
    return value[0], integer(value[1], "'staged'"), value[2]


def required(fields: Mapping[str, Any], name: str) -> Any:
    if name not in fields:
        raise ProtocolError(f"KeyError: no {name!r}")
    return fields[name]


def tagged(value: Any, what: str, ints: int) -> tuple[Any, ...]:  # ``kept`` (``ints``: 1), ``holders`` (2)
    if type(value) is not list or any(type(e) is not list or [*map(type, e)] != [str, *[int] * ints, str] for e in value):
        raise ProtocolError(f"{what} is not a list of [type, partition, ..., digest]: {value!r}")
    return tuple(tuple(e) for e in value)


def rows(value: Any, what: str) -> tuple[int, ...]:
    """Relation ids: a list of non-negative integers, strictly ascending (each row once), at most ``MAX_ROWS``;
    whether they are rows of the shared parameters is the server's check (it knows their layout)."""
    if type(value) is not list or len(value) > MAX_ROWS or any(type(r) is not int or r < 0 for r in value):
        raise ProtocolError(f"{what} is not a list of at most {MAX_ROWS} relation ids (non-negative integers): "
                            f"{str(value)[:80]}")
    if any(b <= a for a, b in zip(value, value[1:])):
        raise ProtocolError(f"{what} is not strictly ascending: {str(value)[:80]}")
    return tuple(value)
