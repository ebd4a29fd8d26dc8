"""Installing the process's log handler: human lines on a terminal, JSON lines for log collectors.

Only the command line configures logging (``biggraph -v``, ``--log-format``); library code just logs to the
``biggraph`` logger. The JSON format itself is ``job.monitoring.json_logs.JsonFormatter``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

from job.monitoring.json_logs import JsonFormatter


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (tests and progress bars swap it)."""

    def __init__(self) -> None:
        self._override: TextIO | None = None
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return self._override if self._override is not None else sys.stderr

    @stream.setter
    def stream(self, value: TextIO | None) -> None:
        # a progress bar may redirect us for a while; setting stderr back means "follow sys.stderr" again
        self._override = None if value is None or value is sys.stderr else value


def configure_logging(level: int = logging.INFO, log_format: str = "text") -> None:
    """Install our one handler on the root logger (replacing only a previous one of ours)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _StderrHandler):
            root.removeHandler(handler)
    handler = _StderrHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {prefix}%(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("botocore", "s3fs", "fsspec", "aiobotocore", "urllib3", "h5py", "werkzeug"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
