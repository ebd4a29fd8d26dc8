"""JSON-lines log records (``--log-format json``): what log collectors read, progress numbers included as fields.

It lives with the monitoring code because the progress reporters ask whether it is in use (they then log
lines instead of drawing a bar); installing it on the root logger is the command line's job
(``job.cli.logging_setup``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, rank under torchrun, and ``extra={"fields": ...}``."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
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


def json_logging() -> bool:
    """Whether a root handler writes JSON lines (then a live progress bar would corrupt them)."""
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)
