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


def configure_logging(level: int = logging.INFO, log_format: str = "text") -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
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
