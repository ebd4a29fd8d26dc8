"""Where a trainer's start-up goes: seconds from the process's start to each phase, up to its first bucket.

A replaced pod trains again only once its trainer is through its start-up, and in a torchrun group every trainer of a
new round starts again at once (bench/RESULTS.md, the chaos bench: a median of 37 s from a round forming to a
trainer ready, 6-8 trainers starting together on 2 vCPUs). One INFO line per trainer, after its first bucket, says
where those seconds went (``start-up: ...``), so that an operator reading a slow recovery sees which phase to look
at (docs/troubleshooting.md) and the bench (bench/group_startup_bench.py) can split it without a profiler.

The clock starts with the process (Linux: its start time in ``/proc/self/stat``; elsewhere the import of this module),
so the first phase holds the interpreter's start and the imports before any of our code ran. Torch-free: the command
line marks its own phases (``mark_early``) before it imports the trainer.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

logger = logging.getLogger("biggraph")


def process_age() -> Optional[float]:
    """Seconds since this process started (None where ``/proc`` cannot tell: then the clock starts at import)."""
    try:
        with open("/proc/self/stat") as stat:
            # the command name (field 2) may hold spaces: the fields after it start behind its closing parenthesis
            fields = stat.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as uptime:
            since_boot = float(uptime.read().split()[0])
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of the whole line: start time after boot
    except (OSError, ValueError, IndexError):
        return None
    age = since_boot - started
    return age if age >= 0 else None


_age = process_age()
PROCESS_START = time.monotonic() - (_age if _age is not None else 0.0)
_early: list[tuple[str, float]] = []  # phases marked before a trainer existed (the command line's)
_spare: Optional[str] = None  # how this process started as a warm spare (job/train/elastic/spare.py), for the start-up line


def handed_off(imports: float, waited: float) -> None:
    """This process is a warm spare that just became a trainer (job/train/elastic/spare.py): its clock starts now, since the
    interpreter and its imports (``imports`` seconds) ran while the rendezvous formed, and it then ``waited``."""
    global PROCESS_START, _spare
    PROCESS_START = time.monotonic()
    _spare = f"a warm spare: its imports took {imports:.2f} s during the rendezvous, then it waited {waited:.2f} s"


def warm_spare() -> Optional[str]:
    """How this process started as a warm spare (None: it started as itself)."""
    return _spare


def mark_early(phase: str) -> None:
    """End ``phase`` now, before the trainer exists (``biggraph train`` marks the config read); the next trainer of
    this process takes it over."""
    _early.append((phase, time.monotonic()))


class StartupClock:
    """A trainer's phases (each one's end, on the monotonic clock) from the process's start; ``report`` logs them
    once. A process that builds several trainers (tests, the Python API) counts everything before the second one
    in its first phase."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = list(_early)
        _early.clear()
        self.reported = False

    def mark(self, phase: str) -> None:
        """End ``phase`` now (the next one starts); nothing once reported (the passes after the first)."""
        if self.reported:
            return
        self.marks.append((phase, time.monotonic()))

    def phases(self) -> list[tuple[str, float]]:
        """(phase, seconds it took), in order."""
        out, last = [], PROCESS_START
        for phase, stamp in self.marks:
            out.append((phase, max(0.0, stamp - last)))
            last = stamp
        return out

    def total(self) -> float:
        """Seconds from the process's start to the last mark."""
        return (self.marks[-1][1] - PROCESS_START) if self.marks else 0.0

    def report(self, what: str) -> None:
        """Log the phases once (``what``: where the clock stops, e.g. ``the first bucket trained``)."""
        if self.reported:
            return
        self.reported = True
        detail = ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in self.phases())
        fields = {"fields": {"startup_seconds": round(self.total(), 3),
                             "startup_phases": {p: round(s, 3) for p, s in self.phases()},
                             "warm_spare": _spare is not None}}
        if _spare:
            logger.info("start-up: %s %.2f s after its hand-off (%s); %s", what, self.total(), detail, _spare,
                        extra=fields)
        else:
            logger.info("start-up: %s %.2f s after the process started (%s)", what, self.total(), detail, extra=fields)
