"""Tests change storage settings mid-test with ``use_storage(...)``; the autouse fixture in conftest.py undoes it.

Production code scopes settings with ``with storage_adapters.using(...)`` around a job; a test often wants the
same for "the rest of this test" (after starting a server, between two phases), which this gives without
indenting the whole test body. Fields not given keep the value in force.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import storage_adapters as storage

_stacks: list[contextlib.ExitStack] = []
_KEEP: Any = object()


@contextlib.contextmanager
def scope_for_test() -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        _stacks.append(stack)
        try:
            yield
        finally:
            _stacks.pop()


def use_storage(options: Mapping[str, Any] | None = _KEEP, *, edge_read_mode: str | None = None,
                cache_dir: str | None = None, cache_bytes: int | None = None) -> storage.StorageSession:
    """Storage settings for the rest of the running test (a new session: a fresh stage cache too)."""
    now = storage.current().settings
    settings = storage.StorageSettings(
        options=now.options if options is _KEEP else (options or {}),
        edge_read_mode=edge_read_mode or now.edge_read_mode,
        cache_dir=cache_dir,
        cache_bytes=cache_bytes,
    )
    return _stacks[-1].enter_context(storage.using(settings))
