"""The events of bench/chaos_bench.py: seeded random kills, scale changes, freezes of a pod and freezes of rank 0's
trainer alone, on a running ``ClusterBox``.

One event at a time, each after a random gap: a freeze holds the loop until its thaw, a scale-down until the
deleted pods are gone (the kubelet's grace period), so that each event's cost can be read from the logs afterwards
(``recoveries``), flagged when the next event came before the group trained again."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

from chaos_checks import LogTail
from cluster_box import ClusterBox

PEER_TIMEOUT_S = 6.0  # job/train/distributed/group.py's DEFAULT_PEER_TIMEOUT_S: a freeze past it loses the pod
# rank0: SIGSTOP of the torchrun rank 0's trainer process alone (its agent and pod live on, as when only the trainer
# starves): the others must notice (the liveness pings) and re-form without it (issue 44)
WEIGHTS = {"kill": 0.4, "scale": 0.2, "freeze": 0.2, "rank0": 0.2}
RANK0_HOLD_S = 120.0  # a frozen rank 0 is thawed once a new group formed, or after this (then it is a failure)


@dataclass(frozen=True)
class ChaosPlan:
    events: int
    pods_min: int
    pods_max: int
    gap: tuple[float, float]  # seconds between events, uniform
    seed: int
    freeze: tuple[float, float] = (1.0, 3 * PEER_TIMEOUT_S)  # a freeze's length, uniform: under and past the timeout
    minutes: Optional[float] = None  # no new event after this many minutes from the first
    kinds: tuple[str, ...] = tuple(WEIGHTS)  # the kinds drawn (their WEIGHTS among them)


class Chaos:
    """Injects ``plan.events`` events into ``box`` (until the Job completes or fails); ``log`` has one entry each."""

    def __init__(self, box: ClusterBox, plan: ChaosPlan, tail: Optional[LogTail] = None) -> None:
        self.box = box
        self.tail = tail  # the pods' logs: which process is rank 0 (the ``rank0`` kind needs it)
        self.plan = plan
        self.rng = random.Random(plan.seed)
        self.log: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    def _over(self) -> bool:
        return self.box.complete or self.box.failed_reason is not None

    def _sleep(self, seconds: float) -> bool:
        """Sleep, unless the Job ends first (then False)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self._over():
                return False
            time.sleep(0.1)
        return True

    def run(self) -> None:
        deadline = None if self.plan.minutes is None else self.t0 + 60 * self.plan.minutes
        while len(self.log) < self.plan.events:
            if not self._sleep(self.rng.uniform(*self.plan.gap)):
                print(f"chaos: the Job ended after {len(self.log)} events", flush=True)
                return
            if deadline is not None and time.monotonic() > deadline:
                print(f"chaos: --minutes {self.plan.minutes:g} are over after {len(self.log)} events", flush=True)
                return
            kinds = [kind for kind in WEIGHTS if kind in self.plan.kinds]
            kind = self.rng.choices(kinds, weights=[WEIGHTS[kind] for kind in kinds])[0]
            entry = self._event(kind)
            if entry is not None:
                self.log.append(entry)
                print(f"chaos: event {len(self.log):3d} at {entry['at']:7.1f} s: {entry['kind']} {entry['detail']}",
                      flush=True)

    def _event(self, kind: str) -> Optional[dict[str, Any]]:
        running = self.box.running()
        if not running:
            return None  # every pod between incarnations: draw again after the next gap
        at = time.monotonic()
        entry: dict[str, Any] = {"kind": kind, "monotonic": at, "at": round(at - self.t0, 1), "pods": len(running)}
        if kind == "kill":
            index = self.rng.choice(running)
            self.box.kill(index, disruption=True)  # a lost node (spot reclaim, drain): the pod has DisruptionTarget
            # index 0 hosts the rendezvous store: every agent fails with it, every pod is replaced
            entry.update(index=index, detail=f"index {index}", pods_lost=len(running) if index == 0 else 1)
        elif kind == "scale":
            current = self.box.completions
            target = self.rng.choice([n for n in range(self.plan.pods_min, self.plan.pods_max + 1) if n != current])
            self.box.scale(target)
            entry.update(index=-1, detail=f"{current}->{target}", pods_lost=max(0, current - target))
        elif kind == "rank0":
            if not self._freeze_rank0(entry, running):
                return None
        else:
            index = self.rng.choice(running)
            length = self.rng.uniform(*self.plan.freeze)
            self.box.freeze(index)
            time.sleep(length)
            self.box.thaw(index)
            entry.update(index=index, detail=f"index {index} for {length:.1f} s", length_s=round(length, 1),
                         pods_lost=1 if length > PEER_TIMEOUT_S else 0)
        entry["done"] = time.monotonic()
        return entry

    def _freeze_rank0(self, entry: dict[str, Any], running: list[int]) -> bool:
        """SIGSTOP rank 0's trainer (found by its ``joined round ... (pid N`` line), hold it until a group formed
        after the freeze (or ``RANK0_HOLD_S``), then SIGCONT it: by then its agent has normally killed it. False when
        rank 0 cannot be found in a running pod (the event is drawn again after the next gap)."""
        found = self.tail.current_rank0() if self.tail is not None else None
        if found is None:
            return False
        pid, log = found
        pods = {pod.log.name: index for index, pod in self.box.pods.items()}
        index = pods.get(log)
        if index is None or index not in running:
            return False
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return False
        self.box.event("freeze-rank0", index, f"pid {pid}")
        frozen = time.monotonic()
        assert self.tail is not None
        while self.tail.new_group(frozen) is None and time.monotonic() - frozen < RANK0_HOLD_S and not self._over():
            time.sleep(0.05)
        held = time.monotonic() - frozen
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        entry.update(index=index, detail=f"rank 0 (index {index}, pid {pid}) held {held:.1f} s", length_s=round(held, 1),
                     pods_lost=0)
        return True

    def kinds(self) -> dict[str, int]:
        return dict(Counter(e["kind"] for e in self.log))

    def recoveries(self, tail: LogTail) -> list[dict[str, Any]]:
        """Per event: seconds until a trainer of a group formed after it finished a bucket (None: none formed before
        the next event, e.g. a freeze under the timeout), seconds until that group formed (``to_new_group``: its
        first join; the rest is the trainers' start-up), and whether the next event came first (``overlapped``)."""
        out = []
        for i, entry in enumerate(self.log):
            seconds = tail.training_again(entry["monotonic"])
            group = tail.new_group(entry["monotonic"])
            following = self.log[i + 1]["monotonic"] if i + 1 < len(self.log) else None
            overlapped = seconds is not None and following is not None and entry["monotonic"] + seconds > following
            out.append({"kind": entry["kind"], "detail": entry["detail"], "at": entry["at"],
                        "seconds": None if seconds is None else round(seconds, 1),
                        "to_new_group": None if group is None or seconds is None or group > seconds else round(group, 1),
                        "overlapped": overlapped})
        return out
