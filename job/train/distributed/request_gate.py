"""What the lock server lets in (issue 44): requests whose MAC checks out under the round's scope, from a rank of
the group, never seen before (each ``(rank, channel)`` numbers its requests). Everything else is dropped unanswered
(an answer would land in the queue of the rank a forger named) and logged, the first few of each kind and then one
line every thousand, so that a flood neither fills the log nor goes unseen.

Run on the server's reader thread (``screen``, in the queue's order), not on its serving thread: checking a MAC
means encoding the message again, and with its typed decoding that is ~0.35 ms for a ``next`` naming 400 relation
rows, the serving thread's largest cost per request after the scheduling itself (issue #45, bench/RESULTS.md "The
lock server's serving thread"). The serving thread then only judges and answers.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

from job.train.distributed import protocol
from job.train.distributed.protocol import Incoming, ProtocolError, Request, Unauthentic

logger = logging.getLogger("biggraph")

LOGGED_FIRST = 5  # of each kind of dropped request, the first ones logged; then every LOG_EVERY-th
LOG_EVERY = 1000


class RequestGate:
    """The lock server's door: ``screen`` one raw message (its own stop, a request let in, or nothing)."""

    def __init__(self, scope: str, world_size: Optional[int]) -> None:
        """``world_size``: the group's size (None: ranks are only checked to be >= 0)."""
        self.scope = scope
        self.world_size = world_size
        self.dropped: dict[str, int] = {}  # kind -> how many (the hostile-peer tests read it)
        self._last_seq: dict[tuple[int, str], int] = {}

    def screen(self, raw: bytes, server_id: str) -> tuple[str, Optional[Incoming], Union[Request, ProtocolError, None]]:
        """One message off the queue: ``("stop", ...)`` for this server's own stop, ``("skip", ...)`` for an earlier
        server's stop (which ended between two requests and never read it) or a dropped request (a forged stop
        included: it stops nothing), else ``("request", incoming, typed)``, ``typed`` being the request decoded or the
        ``ProtocolError`` its fields raise (refused once its payload, if any, has arrived)."""
        try:
            incoming = protocol.read_incoming(raw, scope=self.scope)
        except Unauthentic as err:
            return "skip", self._drop("unauthentic", err), None
        except ProtocolError as err:
            return "skip", self._drop("unreadable", err), None
        if incoming.op == "stop":
            return ("stop" if incoming.fields.get("server") == server_id else "skip"), None, None
        if self._admit(incoming) is None:
            return "skip", None, None
        try:
            return "request", incoming, protocol.decode_request(incoming)
        except ProtocolError as err:
            return "request", incoming, err

    def _admit(self, incoming: Incoming) -> Optional[Incoming]:
        envelope = incoming.envelope
        if envelope.rank < 0 or (self.world_size is not None and envelope.rank >= self.world_size):
            return self._drop("outside the group", f"a {incoming.op!r} request from rank {envelope.rank}, outside the "
                                                   f"group of {self.world_size}")
        key = (envelope.rank, envelope.channel)
        if envelope.seq <= self._last_seq.get(key, 0):
            return self._drop("replayed", f"rank {envelope.rank}'s {incoming.op!r} request number {envelope.seq} came "
                                          f"again (the last was {self._last_seq[key] if key in self._last_seq else 0})")
        self._last_seq[key] = envelope.seq
        return incoming

    def _drop(self, kind: str, why: Any) -> Optional[Incoming]:
        count = self.dropped[kind] = self.dropped.get(kind, 0) + 1
        if count <= LOGGED_FIRST or count % LOG_EVERY == 0:
            logger.error("lock server: a request dropped unanswered (%s, %d so far): %s", kind, count, why)
        return None  # what ``_admit`` returns for it
