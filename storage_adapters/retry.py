"""What the storage layer retries, what it refuses at once, and how it says so.

One HTTP request is botocore's to retry (``standard`` mode, see ``fs.storage_options_for``). Kept here is what no
library retries: a whole operation of several requests, or one whose body broke off after botocore handed it over
(``call_with_retry``, ``Backoff``), judged by what the libraries raise (``classify``: botocore's error code and
status, connection and timeout errors). Transient failures are retried with backoff for a bounded time, each retry
logged at WARNING on ``biggraph.storage`` (URL, operation, attempt n of m, error; never credentials). Permanent ones
(no such bucket, credentials or access refused) raise a ``StorageError`` naming the URL at once, and so does an
endpoint that cannot be reached (DNS, refused, TLS) until it has answered once in this process: a mistyped
``endpoint_url`` fails at its first request, a gateway restarting mid-run is retried. ``FileNotFoundError`` is an
answer, passed through.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import logging
import os
import random
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlsplit

from storage_adapters.errors import StorageError

logger = logging.getLogger("biggraph.storage")
T = TypeVar("T")
TRANSIENT, PERMANENT, NOT_FOUND, UNREACHABLE, OTHER = "transient", "permanent", "not_found", "unreachable", "other"

# Codes that no retry fixes ("401"/"403": a HEAD's refusal has no body, botocore names it by its status) and the
# throttling and timeout codes S3 sends with a 4xx status (any 5xx or 429 is transient by its status).
_PERMANENT_CODES = {"AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                    "InvalidToken", "NoSuchBucket", "AccountProblem", "InvalidBucketName", "403", "401"}
_TRANSIENT_CODES = {"RequestTimeout", "RequestTimeoutException", "Throttling", "ThrottlingException", "SlowDown",
                    "TooManyRequestsException", "RequestLimitExceeded", "OperationAborted"}
# s3fs' translations of 503/SlowDown (EBUSY) and 500 (EREMOTEIO), and network errnos without an OSError subclass
_TRANSIENT_ERRNOS = {errno.EBUSY, errno.EAGAIN, getattr(errno, "EREMOTEIO", errno.EIO), errno.ENETUNREACH,
                     errno.ENETDOWN, errno.EHOSTUNREACH}


@functools.cache
def _transient_types() -> tuple[type[BaseException], ...]:
    """Connection, timeout and body errors of the HTTP stacks under fsspec's backends (imported if installed)."""
    import http.client  # here, not at the top: with email and ssl ~9 ms of a process that never goes remote

    found: list[type[BaseException]] = [TimeoutError, ConnectionError, http.client.IncompleteRead]
    with contextlib.suppress(ImportError):
        from botocore import exceptions, parsers
        found += [exceptions.HTTPClientError, exceptions.ConnectionError, exceptions.IncompleteReadError,
                  parsers.ResponseParserError]
    with contextlib.suppress(ImportError):
        import aiohttp
        found += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    return tuple(found)


# The policy and the loop --------------------------------------------------------------------------------------


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
            spent, count, delay = spent + delay, count + 1, min(self.max_delay, delay * self.multiplier)
        return count


class Backoff:
    """One operation's place in a policy: failed attempts so far, the next pause, and whether one is left.
    ``restart`` begins the policy afresh (a resumed download that made progress). Default: the process's policy."""

    def __init__(self, policy: RetryPolicy | None = None) -> None:
        self.policy = policy or _policy
        self.limit = self.policy.attempts()
        self.restart()

    def restart(self) -> None:
        self.attempt, self.delay, self.since = 0, self.policy.first_delay, time.monotonic()

    def spent(self) -> float:
        return time.monotonic() - self.since

    def failed(self) -> float | None:
        """Count a failed attempt: the jittered pause before the next one, or None when no attempt is left."""
        self.attempt += 1
        if self.attempt >= self.limit or self.spent() + self.delay > self.policy.total_seconds:
            return None
        pause = self.delay * (0.5 + random.random() / 2)
        self.delay = min(self.policy.max_delay, self.delay * self.policy.multiplier)
        return pause


_policy = RetryPolicy()


def set_retry_policy(total_seconds: float | None = None, first_delay: float | None = None,
                     max_delay: float | None = None, max_attempts: int | None = None) -> RetryPolicy:
    """Change the process-wide policy (tests use short times; None keeps a value); returns the previous one."""
    global _policy
    changes = {name: value for name, value in locals().items() if value is not None}  # the arguments given
    previous, _policy = _policy, dataclasses.replace(_policy, **changes)
    return previous


def call_with_retry(url: str, operation: str, func: Callable[[], T], policy: RetryPolicy | None = None,
                    sleep: Callable[[float], None] = time.sleep) -> T:
    """Run ``func``; retry transient failures while ``policy`` allows. Permanent failures, unreachable endpoints
    and exhausted retries become ``StorageError`` naming ``url``; other exceptions pass through unchanged."""
    backoff = Backoff(policy)
    while True:
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
            pause = backoff.failed()
            if pause is None:
                raise StorageError(f"{url}: {operation} still failing after {backoff.attempt} attempts in "
                                   f"{backoff.spent():.1f} s: {describe(err)}") from None
            logger.warning("%s: %s failed on attempt %d of %d (%s: %s); retrying in %.2f s", url, operation,
                           backoff.attempt, backoff.limit, type(err).__name__, describe(err), pause)
            sleep(pause)
        else:
            note_answered(url)
            return result


# Endpoints that have answered ---------------------------------------------------------------------------------
# "Connection refused" at a run's first request is a wrong host or port; after answers it is a gateway restarting.
# S3 requests record their endpoint's host:port (the botocore hook sees every response); other backends count a
# URL scheme as answered once a call succeeded.

_answered: set[str] = set()  # "host:port" or "scheme=s3"; one set operation at a time, so no lock


def _host_key(url: str) -> str | None:
    """"host:port" of an http(s) URL (the default port filled in), or None."""
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    except ValueError:
        return None
    return f"{parts.hostname.lower()}:{port}" if parts.hostname else None


def _scheme_key(url: str) -> str:
    head, sep, _ = url.partition("://")
    return f"scheme={head.lower() if sep and '/' not in head else ''}"


def endpoint_text(url: str) -> str:
    """scheme://host:port of a request URL: no user info, path or query ever reaches a message."""
    parts = urlsplit(url)
    host = parts.hostname or "?"
    port = ""
    with contextlib.suppress(ValueError):
        port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{f'[{host}]' if ':' in host else host}{port}"


def note_answered(url: str | None = None, request_url: str | None = None) -> None:
    """Remember that the endpoint of ``request_url`` (an HTTP request's URL) or the scheme of ``url`` answered."""
    keys = [_host_key(request_url) if request_url else None, _scheme_key(url) if url is not None else None]
    _answered.update([key for key in keys if key])


def forget_endpoints() -> None:
    """Forget which endpoints have answered (tests: a port number may be reused by the next test)."""
    _answered.clear()


# Classification -------------------------------------------------------------------------------------------------


def causes(err: BaseException) -> Iterator[BaseException]:
    """``err`` and what it wraps, outermost first: ``__cause__``, ``__context__``, botocore's ``kwargs['error']``
    and aiohttp's ``os_error`` (bounded: chains can be cyclic)."""
    queue, seen = [err], set[int]()
    while queue and len(seen) < 20:
        current = queue.pop(0)
        if id(current) not in seen:
            seen.add(id(current))
            yield current
            kwargs = getattr(current, "kwargs", None)
            wrapped = kwargs.get("error") if isinstance(kwargs, dict) else None
            queue += [inner for inner in (wrapped, getattr(current, "os_error", None), current.__cause__,
                                          current.__context__) if isinstance(inner, BaseException)]


class ConnectFailure(NamedTuple):
    """A request that never reached an HTTP server: why ("dns", "refused", "tls", "certificate"), and where."""

    kind: str
    endpoint: str | None  # scheme://host:port (botocore) or host:port (aiohttp), None if unknown
    host_key: str | None  # "host:port" when botocore named the request URL
    detail: str


_KIND_RANK = {"certificate": 4, "tls": 3, "dns": 2, "refused": 1}  # the most specific kind in a chain wins


@functools.cache
def _connect_kinds() -> tuple[tuple[str, type[BaseException]], ...]:
    """The OS's errors, which botocore and aiohttp keep in the chain of their own (``causes``); most specific
    first. Imported on the first failure to look at: ssl is of no use to a process that stays local."""
    import socket
    import ssl

    return (("certificate", ssl.SSLCertVerificationError), ("tls", ssl.SSLError), ("dns", socket.gaierror),
            ("refused", ConnectionRefusedError))


def _connect_kind(exc: BaseException) -> str | None:
    if isinstance(exc, OSError) and exc.errno == errno.ECONNREFUSED:
        return "refused"  # aiohttp's ClientConnectorError carries the errno without being a ConnectionRefusedError
    return next((kind for kind, cls in _connect_kinds() if isinstance(exc, cls)), None)


def connection_failure(err: BaseException) -> ConnectFailure | None:
    """What kept a request from reaching a server (DNS, refused, TLS), or None for any other error."""
    kind, detail, endpoint, key = None, "", None, None
    for exc in causes(err):
        found = _connect_kind(exc)
        if found and (kind is None or _KIND_RANK[found] > _KIND_RANK[kind]):
            kind = found
        if found and isinstance(exc, OSError) and exc.strerror:
            detail = exc.strerror  # the innermost OS/SSL wording ("Name or service not known")
        elif found and not detail:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        kwargs = getattr(exc, "kwargs", None)
        if endpoint is None and isinstance(kwargs, dict) and isinstance(kwargs.get("endpoint_url"), str):
            endpoint, key = endpoint_text(kwargs["endpoint_url"]), _host_key(kwargs["endpoint_url"])
        elif endpoint is None and (host := getattr(exc, "host", None)) and hasattr(exc, "os_error"):  # aiohttp's
            endpoint = f"{host}:{getattr(exc, 'port', '?')}"
    return None if kind is None else ConnectFailure(kind, endpoint, key, detail[:200])


_WHERE = "storage_options endpoint_url, or AWS_ENDPOINT_URL_S3"
_HINTS = {"dns": f"check the host name of the endpoint ({_WHERE})",
          "refused": f"check the port of the endpoint ({_WHERE}) and that the server is running",
          "tls": f"an http:// server given as https://? ({_WHERE})",
          "certificate": "give the CA bundle with storage_options client_kwargs.verify, or fix the host name"}


def unreachable_reason(err: BaseException, url: str | None = None) -> str | None:
    """Why ``err`` is a failure to connect that retrying cannot fix, or None if it is not one: any failure to
    connect before the endpoint (or, without one known, the URL's scheme) has answered in this process; an
    unverifiable certificate always."""
    failure = connection_failure(err)
    if failure is None:
        return None
    if failure.kind != "certificate":
        key = failure.host_key or (_scheme_key(url) if url is not None else None)
        if key in _answered:
            return None
    where = f"the storage endpoint {failure.endpoint}" if failure.endpoint else "the storage endpoint"
    what = {"dns": f"cannot resolve the host of {where} (DNS: {failure.detail})",
            "refused": f"{where} refused the connection (nothing listens on that port)",
            "tls": f"the TLS handshake with {where} failed ({failure.detail})",
            "certificate": f"the TLS certificate of {where} cannot be verified ({failure.detail})"}[failure.kind]
    return f"{what}; not retried: {_HINTS[failure.kind]}"


def client_error_info(err: BaseException) -> tuple[str | None, int | None]:
    """(``response['Error']['Code']``, HTTP status) of a botocore ClientError on ``err`` or its causes."""
    for current in causes(err):
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return (str(code) if code is not None else None), (int(status) if status is not None else None)
    return None, None


def classify(err: BaseException, url: str | None = None) -> str:
    """UNREACHABLE, TRANSIENT, PERMANENT, NOT_FOUND or OTHER (a bug or a format problem: not ours to judge).
    ``url`` lets backends without the botocore hook tell a first request from a later one."""
    if unreachable_reason(err, url) is not None:
        return UNREACHABLE
    code, status = client_error_info(err)
    if code in _PERMANENT_CODES:
        return PERMANENT
    if code in _TRANSIENT_CODES or (status is not None and (status >= 500 or status == 429)):
        return TRANSIENT
    if isinstance(err, FileNotFoundError):
        return NOT_FOUND
    if isinstance(err, PermissionError):
        return PERMANENT
    if isinstance(err, _transient_types()) or (isinstance(err, OSError) and (
            err.errno in _TRANSIENT_ERRNOS or "Connection reset" in str(err))):
        return TRANSIENT
    return OTHER


_FAILURE_WORDS = {"dns": "cannot resolve the host", "refused": "connection refused", "tls": "TLS handshake failed",
                  "certificate": "TLS certificate not verified"}


def describe(err: BaseException) -> str:
    """A short one-line reason (never includes request headers or credentials)."""
    failure = connection_failure(err)
    if failure is not None:  # botocore says only "Could not connect to the endpoint URL": the cause is deeper
        text = f"{_FAILURE_WORDS[failure.kind]} ({failure.endpoint or 'endpoint unknown'})"
        return text if failure.kind == "refused" or not failure.detail else f"{text}: {failure.detail}"
    code, status = client_error_info(err)
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = text[:200] + "..." if len(text) > 200 else text
    text = text if not code or code in text else f"{code}: {text}"
    return text if not status or str(status) in text else f"{text} (HTTP {status})"


def permanent_reason(err: BaseException) -> str:
    """Why a permanent failure will not go away, in the user's terms (bucket, credentials, access)."""
    code, _ = client_error_info(err)
    if code == "NoSuchBucket":
        return "the bucket does not exist"
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"):
        return f"the credentials were refused ({code}); check AWS_* variables, the profile or the role"
    # s3fs turns several refusals into PermissionError (405 MethodNotAllowed: a multipart upload already completed
    # or dropped): only an access code, or none at all, is "access denied"
    if code in ("AccessDenied", "403", "AllAccessDisabled") or (isinstance(err, PermissionError) and not code):
        return f"access denied ({describe(err)})"
    return describe(err)


# botocore's own retries: said, and never spent on an unreachable endpoint or a completion ---------------------
# Under an s3fs call: s3fs' loop (5 silent tries; ``instrument_s3`` sets 1) -> botocore's per-request retries
# -> aiohttp, which re-sends an idempotent request once, at once, when its connection dropped mid-request (no
# hook, no wait, never on DNS, refused or TLS). Only the storage layer's own filesystems are instrumented.

_REASON_KEY = "biggraph_retry_reason"  # where the hooks leave the last failure in botocore's request context
_instrumented: weakref.WeakSet[Any] = weakref.WeakSet()


def _on_needs_retry(request_dict: dict[str, Any] | None = None, response: Any = None,
                    caught_exception: BaseException | None = None, operation: Any = None, **_: Any) -> bool | None:
    """botocore asks after every attempt whether to retry; registered first, so a non-None answer wins. None
    leaves it to botocore; False stops it (aiobotocore's meaning: why the hook is on s3fs' clients only)."""
    context = (request_dict or {}).get("context")
    completion = getattr(operation, "name", None) == "CompleteMultipartUpload"  # storage_adapters.multipart decides
    if response is not None:
        note_answered(request_url=(request_dict or {}).get("url") or "")
        http_response, parsed = response
        status = getattr(http_response, "status_code", None)
        code = ((parsed or {}).get("Error") or {}).get("Code") if isinstance(parsed, dict) else None
        if isinstance(context, dict) and status is not None and status >= 300:
            context[_REASON_KEY] = f"{code} (HTTP {status})" if code else f"HTTP {status}"
        return False if completion and status is not None and status >= 500 else None
    if caught_exception is None:
        return None
    if completion or unreachable_reason(caught_exception) is not None:
        return False  # a completion may still be assembling on the server: a second request would race it
    if isinstance(context, dict):
        context[_REASON_KEY] = f"{type(caught_exception).__name__}: {describe(caught_exception)}"
    return None


def _on_request_created(request: Any = None, operation_name: str = "", **_: Any) -> None:
    """botocore builds the request anew for every attempt: from the second on, say that it is a retry."""
    context = getattr(request, "context", None)
    if not isinstance(context, dict) or int((context.get("retries") or {}).get("attempt", 1)) <= 1:
        return
    url = str(getattr(request, "url", ""))  # without user info or query (a query can carry presigned credentials)
    logger.warning("%s: %s failed on attempt %d of %s (%s); botocore retries it",
                   f"{endpoint_text(url)}{urlsplit(url).path}", operation_name or "request",
                   int(context["retries"]["attempt"]) - 1, context["retries"].get("max", "?"),
                   context.get(_REASON_KEY, "unknown error"))


def instrument_s3(fs: Any) -> None:
    """s3fs' silent retry loop off (``call_with_retry`` covers what it did, and says so); botocore's retries logged
    and never spent on an unreachable endpoint. Idempotent: called for every use of a cached filesystem."""
    fs.retries = 1  # S3FileSystem.retries: tries per call in s3fs' _error_wrapper
    client = fs.s3
    with contextlib.suppress(TypeError):  # not weak-referenceable: register again (botocore ignores a repeated id)
        if client in _instrumented:
            return
    client.meta.events.register_first("needs-retry.s3", _on_needs_retry, unique_id="biggraph-needs-retry")
    client.meta.events.register("request-created.s3", _on_request_created, unique_id="biggraph-request-created")
    with contextlib.suppress(TypeError):
        _instrumented.add(client)
