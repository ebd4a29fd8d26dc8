"""Which storage endpoints have answered in this process.

"Connection refused" means two different things: at the first request of a run it is a wrong host or port
(retrying for minutes only hides the typo), after earlier answers it is a gateway restarting (retrying is
the fix). So the process remembers which endpoints have sent an HTTP response. For S3 the botocore hook
(:mod:`storage_adapters.retry`) records the endpoint's host and port from every response; other backends
(no hook) count a URL scheme as answered once a call through ``call_with_retry`` has succeeded.
"""

from __future__ import annotations

import threading
from urllib.parse import urlsplit

_state_lock = threading.Lock()
_answered_hosts: set[str] = set()
_answered_schemes: set[str] = set()


def forget_endpoints() -> None:
    """Forget which endpoints have answered (tests: a port number may be reused by the next test)."""
    with _state_lock:
        _answered_hosts.clear()
        _answered_schemes.clear()


def _scheme(url: str) -> str:
    """The scheme of a URL ("" for a plain path); storage_adapters.fs has its own, but importing it would cycle."""
    head, sep, _ = url.partition("://")
    return head.lower() if sep and "/" not in head else ""


def host_key(url: str) -> str | None:
    """"host:port" of an http(s) URL (the default port filled in), or None."""
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    except ValueError:
        return None
    return f"{parts.hostname.lower()}:{port}" if parts.hostname else None


def endpoint_text(url: str) -> str:
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
    key = host_key(request_url) if request_url else None
    with _state_lock:
        if key is not None:
            _answered_hosts.add(key)
        if url is not None:
            _answered_schemes.add(_scheme(url))


def has_answered(key: str | None, url: str | None) -> bool:
    """Whether the endpoint ``key`` ("host:port"), or else the scheme of ``url``, has answered in this process."""
    with _state_lock:
        if key is not None:
            return key in _answered_hosts
        return url is not None and _scheme(url) in _answered_schemes

