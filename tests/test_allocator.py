"""``keep_freed_memory``: glibc's malloc tuned in training processes, off by an environment switch."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = "from job.train.batch.allocator import keep_freed_memory as k; print(k(), k())"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's (Linux)")
def test_malloc_tuning_takes_effect_once_and_can_be_switched_off() -> None:
    on = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True).stdout.split()
    off = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True,
                         env={"BIGGRAPH_KEEP_FREED_MEMORY": "0", "PATH": "/usr/bin:/bin"}).stdout.split()
    assert on == ["True", "True"]  # glibc accepts both thresholds; a second call is a no-op with the same answer
    assert off == ["False", "False"]
