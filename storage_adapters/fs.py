"""URL schemes, the fsspec filesystem of a URL and its options, and the one way a remote call is made
(retried, :mod:`storage_adapters.retry`). See :mod:`storage_adapters` for the rules."""

from __future__ import annotations

import os
from typing import Any

from storage_adapters.errors import StorageError
from storage_adapters.retry import call_with_retry, instrument_s3
from storage_adapters.session import current


def _default_file_mode() -> int:
    """The mode a plain ``open()`` would give a new file under the current umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


FILE_MODE = _default_file_mode()

# Scheme spellings that share another's storage_options mapping (fsspec knows the schemes themselves).
_ALIASES = {"s3a": "s3", "gcs": "gs", "abfss": "abfs"}
# Object stores: no directories, the first path component is a bucket/container that must exist.
OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"}
S3_SCHEMES = {"s3", "s3a"}
_LOCAL_SCHEMES = ("", "file", "local")


def _per_scheme(options: dict[str, Any]) -> bool:
    """Whether ``options`` is one mapping per scheme ({"s3": {...}, "gs": {...}}) rather than one for all."""
    from fsspec.registry import known_implementations

    return bool(options) and all(isinstance(v, dict) and (k in known_implementations or k in _ALIASES)
                                 for k, v in options.items())


# storage_options keys that biggraph reads itself and never passes to the filesystem (see ``biggraph_option``)
BIGGRAPH_OPTIONS = ("conditional_writes",)


def storage_options_for(url: str) -> dict[str, Any]:
    """The keyword arguments for the fsspec filesystem of ``url`` (a copy; do not log it)."""
    options = _options_with_ours(url)
    for name in BIGGRAPH_OPTIONS:
        options.pop(name, None)
    return options


def biggraph_option(url: str, name: str, default: str) -> str:
    """One of biggraph's own ``BIGGRAPH_OPTIONS`` for ``url``, given in storage_options beside the filesystem's."""
    return str(_options_with_ours(url).get(name, default))


def _options_with_ours(url: str) -> dict[str, Any]:
    scheme = scheme_of(url)
    if scheme in _LOCAL_SCHEMES or scheme == "memory":
        options: dict[str, Any] = {}
    else:
        raw = dict(current().settings.options)
        if _per_scheme(raw):
            options = dict(raw.get(scheme) or raw.get(_ALIASES.get(scheme, ""), {}))
        else:
            options = raw
    if scheme in ("s3", "s3a"):
        # Another process (a reader, a second worker) may change the bucket at any time: never trust a cached listing.
        options.setdefault("use_listings_cache", False)
        # botocore's "standard" retry mode (throttling and transient errors with backoff and a retry quota) unless the
        # options or AWS_RETRY_MODE choose one: its "legacy" default retries fewer errors, without jitter
        config = dict(options.get("config_kwargs") or {})
        retries = dict(config.get("retries") or {})
        if "mode" not in retries and not os.environ.get("AWS_RETRY_MODE"):
            options["config_kwargs"] = {**config, "retries": {**retries, "mode": "standard"}}
    return options


def scheme_of(url: str) -> str:
    """The URL scheme, or "" for a plain path."""
    head, sep, _ = url.partition("://")
    if not sep or "/" in head:
        return ""
    return head.lower()


def is_local(url: str) -> bool:
    return scheme_of(url) in _LOCAL_SCHEMES


def renames_into_place(url: str) -> bool:
    """Whether a file for ``url`` is written next to it and renamed into place (a filesystem: the write is durable
    when the rename is), rather than built in a local staging file and uploaded, which a writer may leave to the
    background (an object store). The formats ask this capability, not which backend it is."""
    return is_local(url)


def local_path(url: str) -> str:
    """The OS path of a local URL."""
    if not is_local(url):
        raise ValueError(f"{url} is not a local path")
    if scheme_of(url):
        return url.split("://", 1)[1]
    return url


def local_path_if_local(url: str) -> str | None:
    """The OS path of a local URL, None for any other (for callers that can use a path when there is one)."""
    return local_path(url) if is_local(url) else None


def join(base: str, *parts: str) -> str:
    """Join URL components with '/' (keeps the scheme and never normalises '//')."""
    out = base
    for part in parts:
        if not out.endswith("/"):
            out += "/"
        out += part.lstrip("/")
    return out


def get_filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem for ``url`` and the path within it."""
    import fsspec  # lazy: slow to import, and parse_config, --help and local-only paths need none of it

    scheme = scheme_of(url)
    if is_local(url):
        return fsspec.filesystem("file"), os.path.abspath(local_path(url))
    try:
        cls = fsspec.get_filesystem_class(scheme)  # its ImportError says what to install ("Install s3fs to ...")
    except (ImportError, ValueError) as err:
        from fsspec.registry import known_implementations  # an alias (abfss) says what its scheme's package is

        known = known_implementations.get(_ALIASES.get(scheme, scheme), {})
        package = str(known.get("class", "fsspec")).split(".")[0]
        hint = f" (pip install {package})" if package != "fsspec" else ""
        raise StorageError(f"{url}: no filesystem backend for scheme '{scheme}://': "
                           f"{known.get('err') or _first_line(err)}{hint}") from None
    options = storage_options_for(url)
    if scheme in ("s3", "s3a"):
        # A filesystem of the storage layer's own (``session=None`` is s3fs' default: same behaviour, another key in
        # fsspec's instance cache): instrument_s3 changes how it retries, which must not reach code that opens URLs
        # through fsspec directly (the importer's input files, a user's own code) and relies on s3fs' defaults.
        options.setdefault("session", None)
    try:
        fs = cls(**options)
    except ImportError as err:
        raise StorageError(f"{url}: the backend for '{scheme}://' cannot be loaded: {_first_line(err)}") from None
    except TypeError as err:
        # the message names the offending key, never its value
        raise StorageError(f"{url}: config key 'storage_options' not accepted by {cls.__name__}: {err}") from None
    if scheme in ("s3", "s3a"):
        try:
            instrument_s3(fs)  # creates the botocore client: no request is sent, so any failure is configuration
        except Exception as err:  # e.g. "Invalid endpoint: minio:9000" (no http://), unknown profile
            raise StorageError(f"{url}: cannot set up the S3 client from storage_options: {_first_line(err)}") from None
    return fs, fs._strip_protocol(url)


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err).strip() else type(err).__name__


def call(url: str, operation: str, func: Any) -> Any:
    """Run one storage operation: local ones once (permission errors named), remote ones retried."""
    if is_local(url):
        try:
            return func()
        except PermissionError as err:
            raise StorageError(f"{url}: {operation} failed: permission denied ({err.strerror})") from None
    return call_with_retry(url, operation, func)
