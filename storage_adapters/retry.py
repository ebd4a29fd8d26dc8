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

import errno
import logging
import os
import random
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

logger = logging.getLogger("biggraph.storage")

T = TypeVar("T")

TRANSIENT = "transient"
PERMANENT = "permanent"
NOT_FOUND = "not_found"
UNREACHABLE = "unreachable"
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


# Which endpoints have answered --------------------------------------------------------------------------------
#
# "Connection refused" means two different things: at the first request of a run it is a wrong host or port
# (retrying for minutes only hides the typo), after earlier answers it is a gateway restarting (retrying is
# the fix). So the process remembers which endpoints have sent an HTTP response. For S3 the botocore hook
# below records the endpoint's host and port from every response; other backends (no hook) count a URL
# scheme as answered once a call through ``call_with_retry`` has succeeded.

_state_lock = threading.Lock()
_answered_hosts: set[str] = set()
_answered_schemes: set[str] = set()
_unreachable_reasons: list[str] = []  # why requests were not retried, oldest first (see ``unreachable_since``)


def forget_endpoints() -> None:
    """Forget which endpoints have answered (tests: a port number may be reused by the next test)."""
    with _state_lock:
        _answered_hosts.clear()
        _answered_schemes.clear()
        _unreachable_reasons.clear()


def _scheme(url: str) -> str:
    head, sep, _ = url.partition("://")
    return head.lower() if sep and "/" not in head else ""


def _host_key(url: str) -> str | None:
    """"host:port" of an http(s) URL (the default port filled in), or None."""
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    except ValueError:
        return None
    return f"{parts.hostname.lower()}:{port}" if parts.hostname else None


def _endpoint_text(url: str) -> str:
    """scheme://host:port of a request URL: no user info, path or query ever reaches a message."""
    parts = urlsplit(url)
    host = parts.hostname or "?"
    host = f"[{host}]" if ":" in host else host
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        port = ""
    return f"{parts.scheme}://{host}{port}"


def note_answered(url: str | None = None, request_url: str | None = None) -> None:
    """Remember that the endpoint of ``request_url`` (an HTTP request's URL) or the scheme of ``url`` answered."""
    key = _host_key(request_url) if request_url else None
    with _state_lock:
        if key is not None:
            _answered_hosts.add(key)
        if url is not None:
            _answered_schemes.add(_scheme(url))


def unreachable_marker() -> int:
    """A position in the record of unreachable endpoints, for ``unreachable_since``."""
    with _state_lock:
        return len(_unreachable_reasons)


def unreachable_since(marker: int) -> str | None:
    """The latest reason a request was not retried after ``marker``, if any.

    For callees that turn every failure into an answer (s3fs' ``exists`` on a bucket returns False whatever
    went wrong), so that "the bucket does not exist" is not said of a bucket nobody could ask about.
    """
    with _state_lock:
        return _unreachable_reasons[-1] if len(_unreachable_reasons) > marker else None


# Failures to connect ------------------------------------------------------------------------------------------


@dataclass
class ConnectFailure:
    """A request that never reached an HTTP server: why, and where it was going."""

    kind: str  # "dns", "refused", "tls" or "certificate"
    endpoint: str | None  # scheme://host:port (botocore) or host:port (aiohttp), None if unknown
    host_key: str | None  # "host:port" when botocore named the request URL (S3: the hook knows these)
    detail: str


def _causes(err: BaseException) -> Iterator[BaseException]:
    """``err`` and what it wraps, outermost first: ``__cause__``, ``__context__``, botocore's ``kwargs['error']``
    and aiohttp's ``os_error`` (bounded: chains can be cyclic)."""
    queue: list[BaseException] = [err]
    seen: set[int] = set()
    while queue and len(seen) < 20:
        current = queue.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        kwargs = getattr(current, "kwargs", None)
        wrapped = kwargs.get("error") if isinstance(kwargs, dict) else None
        for inner in (wrapped, getattr(current, "os_error", None), current.__cause__, current.__context__):
            if isinstance(inner, BaseException):
                queue.append(inner)


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


# The most specific kind wins when a chain holds several (a certificate error is also an SSL error).
_KIND_RANK = {"certificate": 4, "tls": 3, "dns": 2, "refused": 1}


def connection_failure(err: BaseException) -> ConnectFailure | None:
    """What kept a request from reaching a server (DNS, refused, TLS), or None for any other error."""
    kind: str | None = None
    detail = ""
    endpoint: str | None = None
    host_key: str | None = None
    for exc in _causes(err):
        names = _names(exc)
        found: str | None = None
        if isinstance(exc, ssl.SSLCertVerificationError) or "ClientConnectorCertificateError" in names:
            found = "certificate"
        elif isinstance(exc, ssl.SSLError) or "ClientSSLError" in names or (
                "SSLError" in names and type(exc).__module__.startswith("botocore")):
            found = "tls"
        elif isinstance(exc, socket.gaierror) or "ClientConnectorDNSError" in names:
            found = "dns"
        elif isinstance(exc, ConnectionRefusedError) or (isinstance(exc, OSError) and exc.errno == errno.ECONNREFUSED):
            found = "refused"
        if found and (kind is None or _KIND_RANK[found] > _KIND_RANK[kind]):
            kind = found
        if found and isinstance(exc, OSError) and exc.strerror:
            detail = exc.strerror  # the innermost OS/SSL wording ("Name or service not known")
        elif found and not detail:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        kwargs = getattr(exc, "kwargs", None)
        if endpoint is None and isinstance(kwargs, dict) and isinstance(kwargs.get("endpoint_url"), str):
            endpoint = _endpoint_text(kwargs["endpoint_url"])
            host_key = _host_key(kwargs["endpoint_url"])
        elif endpoint is None and "ClientConnectorError" in names and getattr(exc, "host", None):
            endpoint = f"{exc.host}:{getattr(exc, 'port', '?')}"
    if kind is None:
        return None
    return ConnectFailure(kind, endpoint, host_key, detail[:200])


_HINTS = {
    "dns": "check the host name of the endpoint (storage_options endpoint_url, or AWS_ENDPOINT_URL_S3)",
    "refused": "check the port of the endpoint (storage_options endpoint_url, or AWS_ENDPOINT_URL_S3) "
               "and that the server is running",
    "tls": "an http:// server given as https://? (storage_options endpoint_url, or AWS_ENDPOINT_URL_S3)",
    "certificate": "give the CA bundle with storage_options client_kwargs.verify, or fix the host name",
}


def _describe_failure(failure: ConnectFailure) -> str:
    where = f"the storage endpoint {failure.endpoint}" if failure.endpoint else "the storage endpoint"
    what = {
        "dns": f"cannot resolve the host of {where} (DNS: {failure.detail})",
        "refused": f"{where} refused the connection (nothing listens on that port)",
        "tls": f"the TLS handshake with {where} failed ({failure.detail})",
        "certificate": f"the TLS certificate of {where} cannot be verified ({failure.detail})",
    }[failure.kind]
    return f"{what}; not retried: {_HINTS[failure.kind]}"


def unreachable_reason(err: BaseException, url: str | None = None) -> str | None:
    """Why ``err`` is a failure to connect that retrying cannot fix, or None if it is not one.

    Before an endpoint has answered once in this process, every failure to connect is a configuration
    problem: a host that does not resolve, a port where nothing listens, a TLS handshake that fails. After it,
    the same failures are the hiccups of a run under way (a gateway restarting, a resolver timing out) and are
    transient; only an unverifiable certificate never is.
    """
    failure = connection_failure(err)
    if failure is None:
        return None
    if failure.kind != "certificate":
        with _state_lock:
            if failure.host_key is not None:
                answered = failure.host_key in _answered_hosts
            else:
                answered = url is not None and _scheme(url) in _answered_schemes
        if answered:
            return None
    return _describe_failure(failure)


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


def classify(err: BaseException, url: str | None = None) -> str:
    """UNREACHABLE, TRANSIENT, PERMANENT, NOT_FOUND or OTHER (a bug or a format problem: not ours to judge).

    ``url`` (the URL being worked on) lets backends without the botocore hook tell a first request from a
    later one (see ``unreachable_reason``).
    """
    if unreachable_reason(err, url) is not None:
        return UNREACHABLE
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


_FAILURE_WORDS = {"dns": "cannot resolve the host", "refused": "connection refused", "tls": "TLS handshake failed",
                  "certificate": "TLS certificate not verified"}


def describe(err: BaseException) -> str:
    """A short one-line reason (never includes request headers or credentials)."""
    failure = connection_failure(err)
    if failure is not None:
        # botocore says only "Could not connect to the endpoint URL"; the cause is further down the chain
        text = f"{_FAILURE_WORDS[failure.kind]} ({failure.endpoint or 'endpoint unknown'})"
        return text if failure.kind == "refused" or not failure.detail else f"{text}: {failure.detail}"
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
    """Run ``func``; retry transient failures until ``policy`` allows no more attempts or time.

    Each retry is logged (URL, operation, attempt n of m, error). Permanent failures, unreachable endpoints
    and exhausted retries become ``StorageError`` naming ``url``; ``FileNotFoundError`` and other exceptions
    pass through unchanged.
    """
    from storage_adapters import StorageError

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
        except Exception as err:  # noqa: BLE001 - classified below
            kind = classify(err, url)
            if kind == UNREACHABLE:
                raise StorageError(f"{url}: {operation} failed: {unreachable_reason(err, url)}") from None
            if kind in (PERMANENT, NOT_FOUND):
                note_answered(url)  # a refusal or "no such key" is an answer: the endpoint is there
            if kind == PERMANENT:
                raise StorageError(f"{url}: {operation} failed: {_permanent_reason(err)}") from None
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


def _permanent_reason(err: BaseException) -> str:
    code, _ = _client_error_info(err)
    if code == "NoSuchBucket":
        return "the bucket does not exist"
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"):
        return f"the credentials were refused ({code}); check AWS_* variables, the profile or the role"
    if isinstance(err, PermissionError) or code in ("AccessDenied", "403", "AllAccessDisabled"):
        return f"access denied ({describe(err)})"
    return describe(err)


# The layers beneath: s3fs and botocore -----------------------------------------------------------------------
#
# An s3fs call is: our loop above -> s3fs' own loop (``S3FileSystem.retries``, 5 tries of "retryable" errors,
# logged at DEBUG only) -> botocore's per-request retries (5 attempts in "legacy" mode, 3 in "standard";
# connection errors included) -> aiohttp. With a mistyped endpoint every one of our attempts hid five
# botocore attempts and their backoff: ten seconds of silence each. ``instrument_s3`` leaves two layers, both
# of which speak: botocore's (each retry logged through its event hooks, none at all for an unreachable
# endpoint) and ours. Below botocore, aiohttp re-sends an idempotent request once, at once, when its connection
# dropped mid-request (RFC 9112); it has no hook to say so, adds no wait, and never re-sends on DNS, refused or
# TLS failures. Only the storage layer's own filesystems are instrumented (see ``get_filesystem``): code that
# reads through fsspec directly keeps the libraries' defaults.

_BOTOCORE_DEFAULT_ATTEMPTS = {"legacy": 5, "standard": 3, "adaptive": 3}
_REASON_KEY = "biggraph_retry_reason"  # where the hooks leave the last failure in botocore's request context
_instrumented: weakref.WeakSet[Any] = weakref.WeakSet()


def _without_query(url: str) -> str:
    """A request URL without user info or query (query strings can carry presigned credentials)."""
    parts = urlsplit(url)
    return f"{_endpoint_text(url)}{parts.path}"


def _botocore_attempts(context: dict[str, Any]) -> int:
    """The m of botocore's "attempt n of m": the client's total_max_attempts, else its retry mode's default."""
    retries = getattr(context.get("client_config"), "retries", None) or {}
    if retries.get("total_max_attempts"):
        return int(retries["total_max_attempts"])
    mode = retries.get("mode") or os.environ.get("AWS_RETRY_MODE") or "legacy"
    return _BOTOCORE_DEFAULT_ATTEMPTS.get(mode, 3)


def _on_needs_retry(request_dict: dict[str, Any] | None = None, response: Any = None,
                    caught_exception: BaseException | None = None, **_: Any) -> bool | None:
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
        return None
    if caught_exception is None:
        return None
    reason = unreachable_reason(caught_exception)
    if reason is not None:
        with _state_lock:
            _unreachable_reasons.append(reason)
            del _unreachable_reasons[:-100]
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
    logger.warning("%s: %s failed on attempt %d of %d (%s); botocore retries it",
                   _without_query(str(getattr(request, "url", ""))), operation_name or "request", attempt - 1,
                   _botocore_attempts(context), context.get(_REASON_KEY, "unknown error"))


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
