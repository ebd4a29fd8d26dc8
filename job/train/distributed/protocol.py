"""The lock protocol, defined once: every message between a trainer's ``LockClient`` and rank 0's ``LockServer``.

Both ends import this module and nothing of each other. A request is one frozen dataclass per operation, in an
``Envelope`` saying who asks (rank, and channel: a second client of a rank gets its replies on a queue of its own)
and whether a shared-parameter change travels with it (``Payload``: how many values, under which transport tag; a
sparse one names its relation ``rows``, and ``Pull`` asks for rows: job/train/distributed/shared_rows.py). A
reply is one dataclass per answer; ``Refusal`` answers anything the server could not do, so that a client never
waits out its timeout on a request the server read.

On the wire a message is one JSON object (``{"op": ..., "rank": ..., "channel": ..., <the operation's fields>}``)
in the rendezvous store's queues. Decoding checks every field it reads: a malformed message raises
``ProtocolError`` naming the operation and the field, sent back as a ``Refusal`` when it can tell who asked.

Sealed (job/train/distributed/auth.py): every message carries an HMAC (``"mac"``) under the group's secret over its
content and its *scope* (the queue prefix, which names the round), every request a ``"seq"`` growing per rank and
channel. A request whose MAC fails is ``Unauthentic``: logged, never answered (the answer would land in the queue of
the rank the forger named). A reply's MAC also covers whom it answers (rank, channel, seq), so the client tells a
forged or replayed reply apart and waits on for the real one. Only here are MACs made and checked.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar, Union

from job.train.distributed import auth
from job.train.distributed.cut_wire import Cut, CutStep, decode_cut
from job.train.distributed.wire_fields import ProtocolError, Staged
from job.train.distributed.wire_fields import bucket as _decode_bucket
from job.train.distributed.wire_fields import integer as _int
from job.train.distributed.wire_fields import key_list as _key_list
from job.train.distributed.wire_fields import required as _required
from job.train.distributed.wire_fields import rows as _rows
from job.train.distributed.wire_fields import staged as _staged
from job.train.distributed.wire_fields import tagged as _tagged
from job.train.distributed.written_delta import WrittenDelta, decode_delta, decode_known, encode_delta, encode_known
from job.types import Bucket, PartitionKey

# the store queues live under a prefix of the group's round (``DistributedContext.key("lock")``), so that a request
# of an earlier round, or a server of one, never meets this round's
DEFAULT_PREFIX = "biggraph/lock"
SERVER_RANK = 0  # the rank whose process runs the lock server


def request_queue(prefix: str) -> str:
    return f"{prefix}/requests"


def response_queue(prefix: str, rank: int, channel: str = "") -> str:  # (a rank's, per channel)
    return f"{prefix}/response/{rank}{channel}"


class LockServerError(RuntimeError):
    """The lock server answered a request with an error (its message names the server's error), or did not answer."""


class RoundGone(LockServerError):
    """The request's round is over (fenced, declared dead, a newer round's snapshot) or gone (its store went away):
    ended from outside, reported with the failure budget's code (job/train/elastic/budget.py), not as a crash."""


# what a refusal's error says when the round ended from outside (the server names the exception it caught)
ROUND_OVER_MARKERS = ("RoundOver:", "StaleProgressWriter:", "its round is over", "is treated as gone")


def refusal(op: str, error: Any) -> LockServerError:
    """The exception for the server's refusal of ``op`` with ``error``: :class:`RoundGone` where the round ended."""
    text = f"lock server (rank 0) refused {op!r}: {error}"
    ended = any(marker in str(error) for marker in ROUND_OVER_MARKERS)
    return RoundGone(text) if ended else LockServerError(text)


class Unauthentic(ProtocolError):
    """A message whose MAC fails under the group's secret and scope (forged, another round's, another's reply)."""


# requests ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Next:
    """Finish ``finished`` (its stats ``record``; with a payload, the shared-parameter change it made) and ask for the
    next bucket. ``held``: the partitions this rank holds. ``leaving``: why this rank leaves (its SIGTERM): the round
    ends. ``gave_up``: it gave its bucket in flight up and leaves without writing what it holds."""

    held: frozenset[PartitionKey] = frozenset()
    finished: Optional[Bucket] = None
    record: Optional[dict[str, Any]] = None
    leaving: Optional[str] = None
    gave_up: bool = False
    # the payload is sparse: the whole values, then these relation rows' (job/train/distributed/shared_rows.py), and
    # no sum comes back (the trainer pulls the rows its next bucket reads); None: a whole change, the sum back
    rows: Optional[tuple[int, ...]] = None
    written_known: Optional[tuple[str, int]] = None  # the written partitions held: only the later ones come back
    op = "next"


@dataclass(frozen=True)
class Reserve:
    """This rank's next bucket, granted early while its current one trains. ``leaving``: partitions being written
    back in the background."""

    leaving: tuple[PartitionKey, ...] = ()
    written_known: Optional[tuple[str, int]] = None  # as ``Next``'s (job/train/distributed/written_delta.py)
    op = "reserve"


@dataclass(frozen=True)
class Release:
    """Give up the locks of ``keys`` (``written``: and record them as written, as one change)."""

    keys: tuple[PartitionKey, ...]
    written: bool = True
    kept: tuple[tuple[str, int, str], ...] = ()  # of keys, rows kept in memory: [type, partition, digest] (handoff.py)
    op = "release"


@dataclass(frozen=True)
class Written:
    """Record a write group (``keys`` and their ``staged`` files) as one change; the locks stay with the rank."""

    keys: tuple[PartitionKey, ...]
    staged: tuple[Staged, ...] = ()
    op = "written"


@dataclass(frozen=True)
class Sync:
    """Outside a bucket: add the payload's change to the shared parameters and answer with their sum."""

    op = "sync"


@dataclass(frozen=True)
class Status:
    """The scheduling state as JSON (tests and diagnostics)."""

    op = "status"


@dataclass(frozen=True)
class Stop:
    """Stop the server named ``server`` (the servers of a round's passes share its queue)."""

    server: str
    op = "stop"


@dataclass(frozen=True)
class Pull:
    """The current values of the shared parameters' whole part and of relation ``rows`` (ascending), sent after the
    reply under transport ``tag`` (a sparse payload, job/train/distributed/shared_rows.py): the rows a bucket reads."""

    rows: tuple[int, ...]
    tag: int
    op = "pull"


Request = Union[Next, Reserve, Release, Written, Sync, Status, Stop, Pull, Cut]  # Cut: cut_wire.py


@dataclass(frozen=True)
class Payload:
    """A shared-parameter change announced by a request: ``values`` float32 values, posted under transport ``tag``
    before the request was pushed (the server receives it before anything else, whatever it then decides)."""

    values: int
    tag: int


@dataclass(frozen=True)
class Envelope:
    """Who asks: ``rank`` and ``channel`` (where the reply goes), and the change travelling with the request."""

    rank: int
    channel: str = ""
    payload: Optional[Payload] = None
    seq: int = 0  # grows with each request of (rank, channel): a replayed request is refused


@dataclass(frozen=True)
class Incoming:
    """A request as read off the queue: who asks, and its operation's fields not yet decoded (``decode_request``
    checks them once the payload, if any, has arrived)."""

    envelope: Envelope
    op: str
    fields: Mapping[str, Any] = field(default_factory=dict)


# replies ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Granted:
    """The answer to ``next``: ``kind`` is ``bucket`` (train ``bucket``), ``wait``, ``done`` or ``ending`` (the round
    ends, ``why``: give back and exit); ``dirty``: the partitions written this pass."""

    kind: str
    bucket: Optional[Bucket] = None
    dirty: frozenset[PartitionKey] = frozenset()
    why: Optional[str] = None
    holders: tuple[tuple[str, int, int, str], ...] = ()  # where the bucket's rows are kept: [type, part, rank, digest]
    written: Optional[WrittenDelta] = None  # instead of ``dirty``: the written partitions the request did not know


@dataclass(frozen=True)
class Reserved:
    """The answer to ``reserve``: the bucket granted (None: not now), the partitions written this pass, ``holders``."""

    bucket: Optional[Bucket] = None
    dirty: frozenset[PartitionKey] = frozenset()
    holders: tuple[tuple[str, int, int, str], ...] = ()  # where the bucket's rows are kept: [type, part, rank, digest]
    written: Optional[WrittenDelta] = None  # instead of ``dirty``: the written partitions the request did not know


@dataclass(frozen=True)
class Done:
    """The answer to ``release``, ``written``, ``sync`` and ``pull`` (a sync's sum, a pull's rows follow over the
    transport)."""


@dataclass(frozen=True)
class State:
    """The answer to ``status``."""

    state: dict[str, Any]


@dataclass(frozen=True)
class Refusal:
    """The server could not do what was asked: ``error`` names its error."""

    error: str


Reply = Union[Granted, Reserved, Done, State, Refusal, CutStep]
R = TypeVar("R", Granted, Reserved, Done, State, CutStep)

# encoding ---------------------------------------------------------------------------------------------------------

def _keys(keys: Any) -> list[list[Any]]:
    return [[k[0], int(k[1])] for k in keys]


def _bucket(bucket: Optional[Bucket]) -> Optional[list[int]]:
    return [int(bucket.lhs), int(bucket.rhs)] if bucket is not None else None


def encode_request(envelope: Envelope, request: Request, *, scope: str) -> bytes:
    message: dict[str, Any] = {"op": request.op, "rank": envelope.rank, "channel": envelope.channel,
                               "seq": envelope.seq}
    if isinstance(request, Next):
        message.update(held=_keys(sorted(request.held)), finished=_bucket(request.finished), record=request.record)
        if request.leaving:
            message["leaving"] = request.leaving
        if request.gave_up:
            message["gave_up"] = True
        if request.rows is not None:
            message["rows"] = list(request.rows)
        message.update(encode_known(request.written_known))
    elif isinstance(request, Reserve):
        message.update(leaving=_keys(request.leaving), **encode_known(request.written_known))
    elif isinstance(request, Release):
        message.update(keys=_keys(request.keys), written=request.written)
        message.update({"kept": [list(k) for k in request.kept]} if request.kept else {})
    elif isinstance(request, Written):
        message.update(keys=_keys(request.keys), staged=[[s[0], int(s[1]), *s[2:]] for s in request.staged])
    elif isinstance(request, Stop):
        message["server"] = request.server
    elif isinstance(request, Pull):
        message.update(rows=list(request.rows), pull_tag=request.tag)
    elif isinstance(request, Cut):
        message.update(request.wire())
    if envelope.payload is not None:
        message.update(values=envelope.payload.values, tag=envelope.payload.tag)
    return seal(message, scope)


def seal(message: Mapping[str, Any], scope: str) -> bytes:
    """``message`` on the wire with its MAC over its content and ``scope`` (a request's: the queue prefix)."""
    body = {k: v for k, v in message.items() if k != "mac"}
    return pack({**body, "mac": auth.mac("lock", scope, json.dumps(body, sort_keys=True))})


def unseal(raw: bytes, scope: str) -> dict[str, Any]:
    """The message of ``raw`` once its MAC checks out under ``scope``: ``Unauthentic`` otherwise."""
    message = unpack(raw)
    body = {k: v for k, v in message.items() if k != "mac"}
    if not auth.verify(message.get("mac"), "lock", scope, json.dumps(body, sort_keys=True)):
        raise Unauthentic(f"a message whose MAC fails (forged, or of another round): {str(body)[:120]}")
    return body


def reply_scope(scope: str, rank: int, channel: str, seq: int) -> str:
    """What a reply's MAC covers besides its content: the request it answers."""
    return f"{scope}|reply|{rank}|{channel}|{seq}"


def encode_reply(reply: Reply, *, scope: str) -> bytes:
    """``reply`` sealed under ``scope`` (``reply_scope`` of the request it answers)."""
    if isinstance(reply, Refusal):
        return seal({"ok": False, "error": reply.error}, scope)
    holders = getattr(reply, "holders", ())  # (none without partition_handoff: the message as before)
    message: dict[str, Any] = {"ok": True, **({"holders": [list(h) for h in holders]} if holders else {})}
    if isinstance(reply, Granted):
        message.update(kind=reply.kind, bucket=_bucket(reply.bucket), **_written_of(reply))
        if reply.why is not None:
            message["why"] = reply.why
    elif isinstance(reply, Reserved):
        message.update(bucket=_bucket(reply.bucket), **_written_of(reply))
    elif isinstance(reply, State):
        message["state"] = reply.state
    elif isinstance(reply, CutStep):
        message.update(reply.wire())
    return seal(message, scope)


def _written_of(reply: Union[Granted, Reserved]) -> dict[str, Any]:
    return encode_delta(reply.written) if reply.written is not None else {"dirty": _keys(sorted(reply.dirty))}


def pack(message: Mapping[str, Any]) -> bytes:
    """One wire message (the tests push hand-made ones, as a misbehaving peer would)."""
    return json.dumps(message).encode()


def unpack(raw: bytes) -> dict[str, Any]:
    try:
        message = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ProtocolError(f"not a JSON message ({err})") from err
    if isinstance(message, dict):
        return message
    raise ProtocolError("the message is not a JSON object")


# decoding (the field checks: job/train/distributed/wire_fields.py) -------------------------------------------

def _next(fields: Mapping[str, Any]) -> Next:
    record = fields.get("record")
    if record is not None and not isinstance(record, dict):
        raise ProtocolError(f"'record' is not an object: {record!r}")
    leaving = fields.get("leaving")
    rows = fields.get("rows")
    return Next(held=frozenset(_key_list(fields.get("held", []), "'held'")),
                finished=_decode_bucket(fields.get("finished"), "'finished'"), record=record,
                leaving=str(leaving) if leaving else None, gave_up=bool(fields.get("gave_up", False)),
                rows=_rows(rows, "'rows'") if rows is not None else None, written_known=decode_known(fields))


def _pull(fields: Mapping[str, Any]) -> Pull:
    tag = _int(_required(fields, "pull_tag"), "'pull_tag'")
    if tag < 0:
        raise ProtocolError(f"'pull_tag' is negative: {tag}")
    return Pull(rows=_rows(_required(fields, "rows"), "'rows'"), tag=tag)


def _release(fields: Mapping[str, Any]) -> Release:
    return Release(keys=_key_list(_required(fields, "keys"), "'keys'"), written=bool(fields.get("written", True)),
                   kept=_tagged(fields.get("kept", []), "'kept'", 1))


def _written(fields: Mapping[str, Any]) -> Written:
    staged = fields.get("staged", [])
    if not isinstance(staged, list):
        raise ProtocolError(f"'staged' is not a list: {staged!r}")
    return Written(keys=_key_list(_required(fields, "keys"), "'keys'"), staged=tuple(_staged(s) for s in staged))


_DECODERS: dict[str, Callable[[Mapping[str, Any]], Request]] = {
    "next": _next,
    "reserve": lambda f: Reserve(leaving=_key_list(f.get("leaving", []), "'leaving'"), written_known=decode_known(f)),
    "release": _release,
    "written": _written,
    "sync": lambda f: Sync(),
    "status": lambda f: Status(),
    "stop": lambda f: Stop(server=str(_required(f, "server"))),
    "pull": _pull,
    "cut": decode_cut,
}


def read_incoming(raw: bytes, *, scope: str) -> Incoming:
    """Who asks and what, from a raw message: ``ProtocolError`` when it cannot be told (nobody to answer),
    ``Unauthentic`` when its MAC fails (not answered either)."""
    message = unseal(raw, scope)
    op = message.get("op")
    if not isinstance(op, str):
        raise ProtocolError(f"no operation: {message.get('op')!r}")
    if op == "stop":
        return Incoming(Envelope(rank=-1), op, message)
    try:
        rank = _int(message["rank"], "'rank'")
    except KeyError as err:
        raise ProtocolError(f"a {op!r} request without a rank") from err
    channel = message.get("channel", "")
    if not isinstance(channel, str):
        raise ProtocolError(f"a {op!r} request whose channel is {channel!r}")
    payload = None
    if message.get("values") is not None:
        values, tag = _int(message["values"], "'values'"), _int(message.get("tag"), "'tag'")
        if values < 0:
            raise ProtocolError(f"a {op!r} request announcing {values} values")
        payload = Payload(values, tag)
    seq = _int(message.get("seq", 0), "'seq'")
    return Incoming(Envelope(rank, channel, payload, seq), op, message)


def decode_request(incoming: Incoming) -> Request:
    """The typed request: ``ProtocolError`` names the operation and what is wrong with it."""
    decoder = _DECODERS.get(incoming.op)
    if decoder is None:
        raise ProtocolError(f"unknown request {incoming.op!r}")
    try:
        return decoder(incoming.fields)
    except ProtocolError as err:
        raise ProtocolError(f"malformed {incoming.op!r} request: {err}") from None


def decode_reply(raw: bytes, expected: type[R], op: str, *, scope: str) -> R:
    """The reply to a request of ``op`` (``scope``: ``reply_scope`` of that request): ``LockServerError`` for a
    refusal or a reply that is not ``expected``, ``Unauthentic`` for one that is not the server's answer to it."""
    message = unseal(raw, scope)
    try:
        if not message.get("ok", False):
            raise refusal(op, message.get("error"))
        if expected is Granted:
            reply: Any = Granted(kind=str(message["kind"]), bucket=_decode_bucket(message.get("bucket"), "'bucket'"),
                                 dirty=frozenset(_key_list(message.get("dirty", []), "'dirty'")),
                                 why=message.get("why"), holders=_tagged(message.get("holders", []), "'holders'", 2),
                                 written=decode_delta(message))
        elif expected is Reserved:
            reply = Reserved(bucket=_decode_bucket(message.get("bucket"), "'bucket'"),
                             dirty=frozenset(_key_list(message.get("dirty", []), "'dirty'")),
                             holders=_tagged(message.get("holders", []), "'holders'", 2), written=decode_delta(message))
        elif expected is State:
            reply = State(state=dict(message["state"]))
        elif expected is CutStep:
            reply = CutStep.from_wire(message)
        else:
            reply = Done()
    except (ProtocolError, KeyError, TypeError) as err:
        raise LockServerError(f"lock server (rank 0): an unreadable answer to {op!r} ({err})") from err
    return reply
