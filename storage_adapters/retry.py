"""Transient, permanent or unreachable? Retrying storage calls, saying so, and knowing when not to.

Object stores fail in three ways. *Transient* failures (timeouts, dropped connections,
HTTP 5xx, throttling such as S3's ``SlowDown``) go away if the same request is sent
again a little later: botocore retries each HTTP request a few times, and what still
escapes is retried here with exponential backoff and jitter, for at most
``total_seconds`` and ``max_attempts`` in all. *Permanent* failures (no such bucket,
access denied, bad credentials) never go away, so they are raised at once as a
``StorageError`` naming the URL. *Unreachable* endpoints (a host name that does not
resolve, a TLS handshake that fails, a port where nothing listens) are permanent too,
but only until the endpoint has answered once: a mistyped ``endpoint_url`` fails at its
first request instead of after minutes of silent retries, while a gateway that restarts
in the middle of a run (refused or reset connections after earlier answers) is transient.
``FileNotFoundError`` for a missing key is none of these: it is an answer, and it is
passed through untouched because callers test for it.

Every retry, at either layer, is logged at WARNING on ``biggraph.storage`` as it happens:
the operation, the URL, attempt n of m, and the error (never headers or credentials).
Between the two, s3fs has a silent retry loop of its own; ``instrument_s3`` turns it off for
the storage layer's filesystems, so that the layers that remain are the two that log.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from storage_adapters.classify import (
    NOT_FOUND,
    OTHER,
    PERMANENT,
    TRANSIENT,
    UNREACHABLE,
    ConnectFailure,
    classify,
    connection_failure,
    describe,
    permanent_reason,
    unreachable_reason,
)
from storage_adapters.endpoints import (
    endpoint_text,
    forget_endpoints,
    note_answered,
)
from storage_adapters.errors import StorageError

__all__ = [  # the classification and endpoint names are re-exported: callers and tests use them from here
    "NOT_FOUND", "OTHER", "PERMANENT", "TRANSIENT", "UNREACHABLE", "ConnectFailure", "RetryPolicy", "call_with_retry",
    "classify", "connection_failure", "describe", "forget_endpoints", "get_retry_policy", "instrument_s3",
    "note_answered", "set_retry_policy", "unreachable_reason",
]

logger = logging.getLogger("biggraph.storage")

T = TypeVar("T")


@dataclass
class RetryPolicy:
    """Backoff parameters. One call gets at most ``max_attempts`` attempts (``None``: as many as the nominal
    delays fit in ``total_seconds``) and at most ``total_seconds`` of time, retries included."""

    total_seconds: float = float(os.environ.get("BIGGRAPH_STORAGE_RETRY_SECONDS", "120"))
    first_delay: float = 0.2
    max_delay: float = 10.0
    multiplier: float = 2.0
    max_attempts: int | None = None

    def attempts(self) -> int:
        """The most attempts one call gets: the m of "attempt n of m" (17 with the defaults)."""
        if self.max_attempts is not None:
            return max(1, self.max_attempts)
        count, spent, delay = 1, 0.0, self.first_delay
        while spent + delay <= self.total_seconds and count < 10_000:
            spent += delay
            count += 1
            delay = min(self.max_delay, delay * self.multiplier)
        return count


_policy = RetryPolicy()
_policy_lock = threading.Lock()


def set_retry_policy(total_seconds: float | None = None, first_delay: float | None = None,
                     max_delay: float | None = None, max_attempts: int | None = None) -> RetryPolicy:
    """Change the process-wide policy (tests use short times); returns the previous one."""
    global _policy
    with _policy_lock:
        previous = _policy
        _policy = RetryPolicy(
            total_seconds=previous.total_seconds if total_seconds is None else total_seconds,
            first_delay=previous.first_delay if first_delay is None else first_delay,
            max_delay=previous.max_delay if max_delay is None else max_delay,
            multiplier=previous.multiplier,
            max_attempts=previous.max_attempts if max_attempts is None else max_attempts,
        )
        return previous


def get_retry_policy() -> RetryPolicy:
    return _policy


def call_with_retry(url: str, operation: str, func: Callable[[], T], policy: RetryPolicy | None = None,
                    sleep: Callable[[float], None] = time.sleep) -> T:
    """Run ``func``; retry transient failures until ``policy`` allows no more attempts or time.

    Each retry is logged (URL, operation, attempt n of m, error). Permanent failures, unreachable endpoints
    and exhausted retries become ``StorageError`` naming ``url``; ``FileNotFoundError`` and other exceptions
    pass through unchanged.
    """
    policy = policy or _policy
    limit = policy.attempts()
    started = time.monotonic()
    delay = policy.first_delay
    attempt = 0
    while True:
        attempt += 1
        try:
            result = func()
        except StorageError:
            raise
        except Exception as err:  # classified below
            kind = classify(err, url)
            if kind == UNREACHABLE:
                raise StorageError(f"{url}: {operation} failed: {unreachable_reason(err, url)}") from None
            if kind in (PERMANENT, NOT_FOUND):
                note_answered(url)  # a refusal or "no such key" is an answer: the endpoint is there
            if kind == PERMANENT:
                raise StorageError(f"{url}: {operation} failed: {permanent_reason(err)}") from None
            if kind != TRANSIENT:
                raise
            spent = time.monotonic() - started
            if attempt >= limit or spent + delay > policy.total_seconds:
                raise StorageError(
                    f"{url}: {operation} still failing after {attempt} attempts in {spent:.1f} s: {describe(err)}"
                ) from None
            pause = delay * (0.5 + random.random() / 2)
            logger.warning("%s: %s failed on attempt %d of %d (%s: %s); retrying in %.2f s",
                           url, operation, attempt, limit, type(err).__name__, describe(err), pause)
            sleep(pause)
            delay = min(policy.max_delay, delay * policy.multiplier)
        else:
            note_answered(url)
            return result


# The layers beneath: s3fs and botocore -----------------------------------------------------------------------
#
# An s3fs call is: our loop above -> s3fs' own loop (``S3FileSystem.retries``, 5 tries of "retryable" errors,
# logged at DEBUG only) -> botocore's per-request retries (3 attempts in "standard" mode, the storage layer's
# default since fs.storage_options_for sets it; 5 in "legacy"; connection errors included) -> aiohttp. With a
# mistyped endpoint every one of our attempts hid five botocore attempts and their backoff: ten seconds of silence
# each. ``instrument_s3`` leaves two layers, both of which speak: botocore's (each retry logged through its event
# hooks, none at all for an unreachable endpoint) and ours. Below botocore, aiohttp re-sends an idempotent request
# once, at once, when its connection dropped mid-request (RFC 9112); it has no hook to say so, adds no wait, and
# never re-sends on DNS, refused or TLS failures. Only the storage layer's own filesystems are instrumented (see
# ``get_filesystem``): code that reads through fsspec directly keeps the libraries' defaults.

_REASON_KEY = "biggraph_retry_reason"  # where the hooks leave the last failure in botocore's request context
_instrumented: weakref.WeakSet[Any] = weakref.WeakSet()


def _without_query(url: str) -> str:
    """A request URL without user info or query (query strings can carry presigned credentials)."""
    parts = urlsplit(url)
    return f"{endpoint_text(url)}{parts.path}"


def _on_needs_retry(request_dict: dict[str, Any] | None = None, response: Any = None,
                    caught_exception: BaseException | None = None, operation: Any = None, **_: Any) -> bool | None:
    """botocore asks after every attempt whether to retry; registered first, so a non-None answer wins.

    None leaves the decision to botocore's own handlers (and the region redirector). False stops the retrying:
    aiobotocore treats False as "no retry" (plain botocore would sleep 0 s and retry, which is why this hook is
    installed on s3fs' aiobotocore clients only).
    """
    request_dict = request_dict or {}
    context = request_dict.get("context")
    request_url = request_dict.get("url") or ""
    if response is not None:
        note_answered(request_url=request_url)
        http_response, parsed = response
        status = getattr(http_response, "status_code", None)
        code = ((parsed or {}).get("Error") or {}).get("Code") if isinstance(parsed, dict) else None
        if isinstance(context, dict) and status is not None and status >= 300:
            context[_REASON_KEY] = f"{code} (HTTP {status})" if code else f"HTTP {status}"
        if status is not None and status >= 500 and getattr(operation, "name", None) == "CompleteMultipartUpload":
            return False  # a gateway's 5xx may front a server still assembling: storage_adapters.multipart decides
        return None
    if caught_exception is None:
        return None
    if unreachable_reason(caught_exception) is not None:
        return False
    if getattr(operation, "name", None) == "CompleteMultipartUpload":
        # no answer to a completion: the server may still be assembling the object, and a second request
        # would race it; storage_adapters.multipart looks at the object instead
        return False
    if isinstance(context, dict):
        context[_REASON_KEY] = f"{type(caught_exception).__name__}: {describe(caught_exception)}"
    return None


def _on_request_created(request: Any = None, operation_name: str = "", **_: Any) -> None:
    """botocore builds the request anew for every attempt: from the second on, say that it is a retry."""
    context = getattr(request, "context", None)
    if not isinstance(context, dict):
        return
    attempt = int((context.get("retries") or {}).get("attempt", 1))
    if attempt <= 1:
        return
    # botocore's retry checker put its limit in the context ("max") when it decided on this retry
    logger.warning("%s: %s failed on attempt %d of %s (%s); botocore retries it",
                   _without_query(str(getattr(request, "url", ""))), operation_name or "request", attempt - 1,
                   context["retries"].get("max", "?"), context.get(_REASON_KEY, "unknown error"))


def instrument_s3(fs: Any) -> None:
    """Make the layers under an s3fs filesystem behave: s3fs' silent retry loop off (ours, which logs, covers
    the same errors), botocore's retries logged and never spent on an endpoint that cannot be reached.

    Idempotent; cheap enough to call for every use of a cached filesystem (s3fs may replace its client).
    """
    fs.retries = 1  # S3FileSystem.retries: tries per call in s3fs' _error_wrapper; 1 = no s3fs-level retry
    client = fs.s3
    try:
        if client in _instrumented:
            return
    except TypeError:  # not weak-referenceable: register again (botocore ignores a repeated unique_id)
        pass
    events = client.meta.events
    events.register_first("needs-retry.s3", _on_needs_retry, unique_id="biggraph-needs-retry")
    events.register("request-created.s3", _on_request_created, unique_id="biggraph-request-created")
    try:
        _instrumented.add(client)
    except TypeError:
        pass
