"""A job's storage settings come from its config: ``storage_options``, ``edge_read_mode``.

Library entry points that take a ``config`` are decorated with :func:`storage_scoped`: the call runs inside
``storage_adapters.using(settings_of(config))``, so every file it reads or writes uses that config's endpoint,
credentials and edge read mode - whichever command or script called it, and without a process-wide setting that
a second job in the same process would overwrite (see :mod:`storage_adapters.session`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from storage_adapters import StorageSettings, using

F = TypeVar("F", bound=Callable[..., Any])


def settings_of(config: Any) -> StorageSettings:
    """The storage settings of a ``ConfigSchema`` (or of a config mapping, as ``config.json`` holds it)."""
    if isinstance(config, Mapping):
        options, mode = config.get("storage_options") or {}, config.get("edge_read_mode") or "stage"
    else:
        options, mode = config.storage_options or {}, config.edge_read_mode
    return StorageSettings(options=dict(options), edge_read_mode=mode)


def storage_scoped(func: F) -> F:
    """Run ``func`` with the storage settings of its ``config`` argument (unchanged when it has none)."""
    signature = inspect.signature(func)
    if "config" not in signature.parameters:
        raise TypeError(f"{func.__qualname__} has no 'config' parameter to take storage settings from")

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        config = signature.bind_partial(*args, **kwargs).arguments.get("config")
        if config is None:
            return func(*args, **kwargs)
        with using(settings_of(config)):
            return func(*args, **kwargs)

    return run  # type: ignore[return-value]
