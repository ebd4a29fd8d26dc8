"""The group's secret and the MACs that make its messages authentic (issue 44).

Everything the group exchanges travels through torch's c10d TCPStore and plain TCP sockets, which authenticate no
one: any client that reaches rank 0's store could push a lock-protocol request under any rank (a ``release`` that
frees another rank's partition, a ``written`` that marks unsaved buckets saved), set ``dead/<rank>`` to fence a live
rank, or open a liveness connection that, when it closes, declares a rank dead. So each of those carries an
HMAC-SHA256 under a per-release secret that only the Job's pods hold (the chart's Secret, mounted as
``BIGGRAPH_GROUP_SECRET``; or a file named by ``BIGGRAPH_GROUP_SECRET_FILE``), over its content and its round, and
the receiver refuses what fails it. Insiders are trusted: every pod of the job holds the one secret. What the store
itself still allows is in docs/security.md.

Without a secret (a local run, a test, a job submitted without one) the MACs are computed under an empty key: the
protocol is the same, but anyone can forge it; ``secret()`` warns once where a torchrun group runs that way.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from typing import Optional

logger = logging.getLogger("biggraph")

SECRET_ENV = "BIGGRAPH_GROUP_SECRET"
SECRET_FILE_ENV = "BIGGRAPH_GROUP_SECRET_FILE"
_MIN_SECRET_BYTES = 16

_cached: Optional[bytes] = None
_warned = False


def load_secret(env: Optional[dict[str, str]] = None) -> bytes:
    """The group's secret from ``BIGGRAPH_GROUP_SECRET`` or the file ``BIGGRAPH_GROUP_SECRET_FILE`` names (b"" when
    neither is set). A secret shorter than 16 bytes is refused: it could be guessed."""
    from job.errors import UserError

    source = os.environ if env is None else env
    value = source.get(SECRET_ENV, "")
    where = SECRET_ENV
    if not value and source.get(SECRET_FILE_ENV):
        where = source[SECRET_FILE_ENV]
        try:
            with open(where, encoding="utf-8") as handle:
                value = handle.read().strip()
        except OSError as err:
            raise UserError(f"{SECRET_FILE_ENV}={where}: cannot read the group's secret ({err.strerror})") from None
    if value and len(value.encode()) < _MIN_SECRET_BYTES:
        raise UserError(f"{where}: the group's secret has {len(value.encode())} bytes; at least {_MIN_SECRET_BYTES} "
                        "are needed (the chart makes 32 random characters)")
    return value.encode()


def secret() -> bytes:
    """This process's secret (read once). Warns once when a torchrun group runs without one."""
    global _cached, _warned
    if _cached is None:
        _cached = load_secret()
        if not _cached and "TORCHELASTIC_RUN_ID" in os.environ and not _warned:
            _warned = True
            logger.warning("no %s: the group's messages are not authenticated, and any client of rank 0's store can "
                           "forge them (docs/security.md)", SECRET_ENV)
    return _cached


def mac(*parts: str | bytes | memoryview, key: Optional[bytes] = None) -> str:
    """The hex HMAC-SHA256 of ``parts`` (each length-prefixed, so that no two sequences of parts collide) under
    ``key`` (default: this process's secret)."""
    digest = hmac.new(secret() if key is None else key, digestmod=hashlib.sha256)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()


def verify(expected_mac: object, *parts: str | bytes | memoryview, key: Optional[bytes] = None) -> bool:
    """Whether ``expected_mac`` is the MAC of ``parts`` (compared in constant time)."""
    return isinstance(expected_mac, str) and hmac.compare_digest(expected_mac, mac(*parts, key=key))


def reset_for_tests(value: Optional[bytes] = None) -> None:
    """Forget the cached secret (``value``: use this one instead of the environment's)."""
    global _cached
    _cached = value
