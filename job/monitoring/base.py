"""The reporter interface the training loop calls, and the fan-out that keeps one broken sink from mattering."""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

logger = logging.getLogger("biggraph")

# ranking metrics of ``eval_stats_*`` that the sinks forward when present
RANKING_METRICS = ("mrr", "hits@1", "hits@10", "hits@50", "auc", "mean_rank")


class Reporter:
    """Does nothing; subclasses show progress or ship metrics."""

    def on_bucket(self, record: dict[str, Any]) -> None:
        pass

    def on_pass(self, summary: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class MultiReporter(Reporter):
    """Fans the hooks out; one failing sink never stops the others, nor training."""

    def __init__(self, reporters: list[Reporter]) -> None:
        self.reporters = reporters

    def _each(self, method: str, *args: Any) -> None:
        for reporter in self.reporters:
            try:
                getattr(reporter, method)(*args)
            except Exception as err:  # reporting must never fail training
                logger.warning("%s.%s failed: %s", type(reporter).__name__, method, err)

    def on_bucket(self, record: dict[str, Any]) -> None:
        self._each("on_bucket", record)

    def on_pass(self, summary: dict[str, Any]) -> None:
        self._each("on_pass", summary)

    def close(self) -> None:
        self._each("close")


def metric(record: dict[str, Any], *path: str) -> Optional[float]:
    """The finite number at ``record[path[0]][path[1]]...``, or None (records may lack any field)."""
    value: Any = record
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
