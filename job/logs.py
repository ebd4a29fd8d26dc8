"""Logging set-up: human lines on a terminal, JSON lines for log collectors (``--log-format json``)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        rank = os.environ.get("RANK")
        if rank is not None:
            payload["rank"] = int(rank)
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            for key, value in extra.items():
                payload.setdefault(key, value)  # never overwrite the record's own time/level/message
        return json.dumps(payload)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (tests and progress bars swap it)."""

    def __init__(self) -> None:
        self._override = None
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return self._override if self._override is not None else sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001
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
