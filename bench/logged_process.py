"""A process whose output the bench reads as it comes: every line timestamped on arrival and copied to a log file.

The benches that time a group's events (bench/elastic_bench.py, bench/group_startup_bench.py) need when a line
appeared, not only that it did: a reader thread stamps each line with ``time.monotonic()``."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional


class LoggedProcess:
    """``command`` started in a session of its own (so that its tree can be killed together), stdout and stderr
    read line by line into ``lines`` as ``(monotonic time, line)`` and written to ``log_path``."""

    def __init__(self, command: list[str], cwd: Path, env: dict[str, str], log_path: Path) -> None:
        self.command = command
        self.lines: list[tuple[float, str]] = []
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            self.log.write(line)
        self.log.close()

    def first_match(self, pattern: re.Pattern[str], after: float = 0.0) -> Optional[tuple[float, re.Match[str]]]:
        """The first line at or after ``after`` that ``pattern`` matches: its time and the match."""
        for stamp, line in list(self.lines):
            if stamp >= after:
                match = pattern.search(line)
                if match:
                    return stamp, match
        return None
