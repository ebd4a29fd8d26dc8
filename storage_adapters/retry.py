"""Transient or permanent? Retrying storage calls with backoff and a bounded total time.

Object stores fail in two ways. *Transient* failures (timeouts, dropped connections,
HTTP 5xx, throttling such as S3's ``SlowDown``) go away if the same request is sent
again a little later; s3fs and botocore already retry a few of them, and what still
escapes is retried here with exponential backoff and jitter, for at most
``total_seconds`` in all. *Permanent* failures (no such bucket, access denied, bad
credentials) never go away, so they are raised at once as a ``StorageError`` naming
the URL. ``FileNotFoundError`` for a missing key is neither: it is an answer, and it
is passed through untouched because callers test for it.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

logger = logging.getLogger("biggraph.storage")

T = TypeVar("T")

TRANSIENT = "transient"
PERMANENT = "permanent"
NOT_FOUND = "not_found"
OTHER = "other"

# errno values that mean "try again" (EREMOTEIO is s3fs' translation of HTTP 500, EBUSY of 503/SlowDown)
_TRANSIENT_ERRNOS = {
    errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE, errno.EBUSY,
    errno.EAGAIN, errno.ENETUNREACH, errno.ENETDOWN, errno.EHOSTUNREACH, getattr(errno, "EREMOTEIO", errno.EIO),
}
_TRANSIENT_CODES = {
    "InternalError", "ServiceUnavailable", "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
    "RequestTimeoutException", "TooManyRequestsException", "ProvisionedThroughputExceededException",
    "RequestLimitExceeded", "BandwidthLimitExceeded", "OperationAborted", "500", "502", "503", "504", "429",
}
_PERMANENT_CODES = {
    "AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
    "InvalidToken", "NoSuchBucket", "AccountProblem", "InvalidBucketName", "403", "401",
}
# Exception class names (from botocore, aiohttp, urllib3, fsspec) that are transient whatever their message.
_TRANSIENT_NAMES = {
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
    "ResponseStreamingError", "IncompleteReadError", "HTTPClientError", "ProxyConnectionError",
    "ServerDisconnectedError", "ClientPayloadError", "ClientOSError", "ClientConnectionError",
    "ServerTimeoutError", "ClientConnectorError", "FSTimeoutError", "IncompleteRead", "ProtocolError",
    "ResponseParserError", "ConnectionError", "AWSConnectionError", "ContentLengthError",
}


@dataclass
class RetryPolicy:
    """Backoff parameters; ``total_seconds`` bounds the time spent on one call, retries included."""

    total_seconds: float = float(os.environ.get("BIGGRAPH_STORAGE_RETRY_SECONDS", "120"))
    first_delay: float = 0.2
    max_delay: float = 10.0
    multiplier: float = 2.0


_policy = RetryPolicy()
_policy_lock = threading.Lock()


def set_retry_policy(total_seconds: float | None = None, first_delay: float | None = None,
                     max_delay: float | None = None) -> RetryPolicy:
    """Change the process-wide policy (tests use short times); returns the previous one."""
    global _policy
    with _policy_lock:
        previous = _policy
        _policy = RetryPolicy(
            total_seconds=previous.total_seconds if total_seconds is None else total_seconds,
            first_delay=previous.first_delay if first_delay is None else first_delay,
            max_delay=previous.max_delay if max_delay is None else max_delay,
        )
        return previous


def get_retry_policy() -> RetryPolicy:
    return _policy


def _client_error_info(err: BaseException) -> tuple[str | None, int | None]:
    """(error code, HTTP status) of a botocore ClientError found on ``err`` or its causes."""
    seen = 0
    current: BaseException | None = err
    while current is not None and seen < 5:
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return (str(code) if code is not None else None), (int(status) if status is not None else None)
        current = current.__cause__ or current.__context__
        seen += 1
    return None, None


def classify(err: BaseException) -> str:
    """TRANSIENT, PERMANENT, NOT_FOUND or OTHER (a bug or a format problem: not ours to judge)."""
    code, status = _client_error_info(err)
    if code in _PERMANENT_CODES:
        return PERMANENT
    if code in _TRANSIENT_CODES or (status is not None and (status >= 500 or status == 429)):
        return TRANSIENT
    if isinstance(err, FileNotFoundError):
        return NOT_FOUND
    if isinstance(err, PermissionError):
        return PERMANENT
    if isinstance(err, (TimeoutError, ConnectionError)):
        return TRANSIENT
    for cls in type(err).__mro__:
        if cls.__name__ in _TRANSIENT_NAMES and cls.__module__.split(".")[0] in (
            "botocore", "aiohttp", "urllib3", "fsspec", "s3fs", "http", "requests", "aiobotocore", "gcsfs", "adlfs",
        ):
            return TRANSIENT
    if isinstance(err, OSError) and err.errno in _TRANSIENT_ERRNOS:
        return TRANSIENT
    if isinstance(err, OSError) and "Connection reset" in str(err):
        return TRANSIENT
    return OTHER


def describe(err: BaseException) -> str:
    """A short one-line reason (never includes request headers or credentials)."""
    code, status = _client_error_info(err)
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if len(text) > 200:
        text = text[:200] + "..."
    if code and code not in text:
        text = f"{code}: {text}"
    if status and str(status) not in text:
        text += f" (HTTP {status})"
    return text


def call_with_retry(url: str, operation: str, func: Callable[[], T], policy: RetryPolicy | None = None,
                    sleep: Callable[[float], None] = time.sleep) -> T:
    """Run ``func``; retry transient failures until ``policy.total_seconds`` are spent.

    Permanent failures and exhausted retries become ``StorageError`` naming ``url``;
    ``FileNotFoundError`` and other exceptions pass through unchanged.
    """
    from storage_adapters import StorageError

    policy = policy or _policy
    started = time.monotonic()
    delay = policy.first_delay
    attempt = 0
    while True:
        attempt += 1
        try:
            return func()
        except StorageError:
            raise
        except Exception as err:  # noqa: BLE001 - classified below
            kind = classify(err)
            if kind == PERMANENT:
                raise StorageError(f"{url}: {operation} failed: {_permanent_reason(err)}") from None
            if kind != TRANSIENT:
                raise
            spent = time.monotonic() - started
            if spent + delay > policy.total_seconds:
                raise StorageError(
                    f"{url}: {operation} still failing after {attempt} attempts in {spent:.1f} s: {describe(err)}"
                ) from None
            logger.warning("%s: %s failed (%s); retry %d in %.1f s", url, operation, describe(err), attempt, delay)
            sleep(delay * (0.5 + random.random() / 2))
            delay = min(policy.max_delay, delay * policy.multiplier)


def _permanent_reason(err: BaseException) -> str:
    code, _ = _client_error_info(err)
    if code == "NoSuchBucket":
        return "the bucket does not exist"
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"):
        return f"the credentials were refused ({code}); check AWS_* variables, the profile or the role"
    if isinstance(err, PermissionError) or code in ("AccessDenied", "403", "AllAccessDisabled"):
        return f"access denied ({describe(err)})"
    return describe(err)
