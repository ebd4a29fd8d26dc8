"""Start worker processes without re-running the user's ``__main__``.

The Hogwild workers are ``spawn``ed (safe beside the threads torch and fsspec start). A spawned child normally
re-imports the parent's main module first - so that functions defined there can be unpickled - which breaks the
places users call the Python API from: a script without an ``if __name__ == "__main__"`` guard runs itself again
in every worker (and multiprocessing refuses to start), ``python - <<EOF`` fails with ``FileNotFoundError:
'<stdin>'``. Our workers need nothing from ``__main__`` (their target and arguments live in ``job``), so while they
start the parent shows multiprocessing an empty main module, exactly as a notebook's kernel does.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Iterator

_lock = threading.Lock()


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Within the block, processes started with the ``spawn`` method do not import the caller's ``__main__``."""
    with _lock:
        real = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            if real is not None:
                sys.modules["__main__"] = real
