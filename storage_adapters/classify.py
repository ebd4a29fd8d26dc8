"""What kind of failure a storage error is: transient, permanent, not found, unreachable or other.

See :mod:`storage_adapters.retry` for what each kind means and how it is handled.
"""

from __future__ import annotations

import errno
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass

from storage_adapters.endpoints import endpoint_text, has_answered
from storage_adapters.endpoints import host_key as endpoint_host_key  # "host_key" is a local name below

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


# Failures to connect ------------------------------------------------------------------------------------------


@dataclass
class ConnectFailure:
    """A request that never reached an HTTP server: why, and where it was going."""

    kind: str  # "dns", "refused", "tls" or "certificate"
    endpoint: str | None  # scheme://host:port (botocore) or host:port (aiohttp), None if unknown
    host_key: str | None  # "host:port" when botocore named the request URL (S3: the hook knows these)
    detail: str


def causes(err: BaseException) -> Iterator[BaseException]:
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
    for exc in causes(err):
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
        host = getattr(exc, "host", None)  # aiohttp's ClientConnectorError
        if endpoint is None and isinstance(kwargs, dict) and isinstance(kwargs.get("endpoint_url"), str):
            endpoint = endpoint_text(kwargs["endpoint_url"])
            host_key = endpoint_host_key(kwargs["endpoint_url"])
        elif endpoint is None and "ClientConnectorError" in names and host:
            endpoint = f"{host}:{getattr(exc, 'port', '?')}"
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
    if failure.kind != "certificate" and has_answered(failure.host_key, url):
        return None
    return _describe_failure(failure)


def client_error_info(err: BaseException) -> tuple[str | None, int | None]:
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
    code, status = client_error_info(err)
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
    code, status = client_error_info(err)
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if len(text) > 200:
        text = text[:200] + "..."
    if code and code not in text:
        text = f"{code}: {text}"
    if status and str(status) not in text:
        text += f" (HTTP {status})"
    return text


def permanent_reason(err: BaseException) -> str:
    """Why a permanent failure will not go away, in the user's terms (bucket, credentials, access)."""
    code, _ = client_error_info(err)
    if code == "NoSuchBucket":
        return "the bucket does not exist"
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"):
        return f"the credentials were refused ({code}); check AWS_* variables, the profile or the role"
    # s3fs turns several refusals into PermissionError (MethodNotAllowed: a multipart upload the server already
    # completed or dropped, retried after a timeout): only an access code, or none at all, is "access denied"
    if code in ("AccessDenied", "403", "AllAccessDisabled") or (isinstance(err, PermissionError) and not code):
        return f"access denied ({describe(err)})"
    return describe(err)
