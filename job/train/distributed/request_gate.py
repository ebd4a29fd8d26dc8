"""What the lock server lets in (issue 44): requests whose MAC checks out under the round's scope, from a rank of
the group, never seen before (each ``(rank, channel)`` numbers its requests). Everything else is dropped unanswered
(an answer would land in the queue of the rank a forger named) and logged, the first few of each kind and then one
line every thousand, so that a flood neither fills the log nor goes unseen.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from job.train.distributed import protocol
from job.train.distributed.protocol import Incoming, ProtocolError, Unauthentic

logger = logging.getLogger("biggraph")

LOGGED_FIRST = 5  # of each kind of dropped request, the first ones logged; then every LOG_EVERY-th
LOG_EVERY = 1000


class RequestGate:
    """The lock server's door: ``admit`` one raw request (None: dropped), ``is_stop`` for its own stop message."""

    def __init__(self, scope: str, world_size: Optional[int]) -> None:
        """``world_size``: the group's size (None: ranks are only checked to be >= 0)."""
        self.scope = scope
        self.world_size = world_size
        self.dropped: dict[str, int] = {}  # kind -> how many (the hostile-peer tests read it)
        self._last_seq: dict[tuple[int, str], int] = {}

    def admit(self, raw: bytes) -> Optional[Incoming]:
        try:
            incoming = protocol.read_incoming(raw, scope=self.scope)
        except Unauthentic as err:
            return self._drop("unauthentic", err)
        except ProtocolError as err:
            return self._drop("unreadable", err)
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

    def is_stop(self, raw: bytes, server_id: str) -> Optional[bool]:
        """True: this server's own stop; False: another server's (of an earlier pass); None: not a stop (or not an
        authentic one: a forged stop stops nothing)."""
        try:
            header: dict[str, Any] = protocol.unseal(raw, self.scope)
        except ProtocolError:
            return None
        if header.get("op") != "stop":
            return None
        return header.get("server") == server_id

    def _drop(self, kind: str, why: Any) -> Optional[Incoming]:
        count = self.dropped[kind] = self.dropped.get(kind, 0) + 1
        if count <= LOGGED_FIRST or count % LOG_EVERY == 0:
            logger.error("lock server: a request dropped unanswered (%s, %d so far): %s", kind, count, why)
        return None  # what ``admit`` returns for it
