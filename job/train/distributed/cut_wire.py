"""The messages of a cut (``write_behind_buckets``, job/train/distributed/cuts.py): the ``cut`` request and its
``CutStep`` answer, with their wire form. Apart from protocol.py (which imports them into its unions and decoders)
so that the lock protocol's own module stays within its size and a merge of either stays small.

A rank whose ``next`` was answered ``cut`` asks ``cut`` until it is told a step: ``wait`` (ask again: some rank still
trains, or has not staged or moved yet), ``stage`` (write ``keys`` under staged names, then ask ``cut`` with
``staged``), ``move`` (the cut is recorded: move the staged files to their PBG names, then ask ``cut`` with
``moved``), ``go`` (the cut is over, or this rank's part of one taken in the background is: ask ``next``) or
``ending`` (the round ends: exit without writing anything). In a cut taken in the background a rank's ``stage`` may be
answered ``go`` (not recorded yet: it trains on) and a later ``next`` of it ``cut`` again, whose first step is then
its ``move``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from job.train.distributed.wire_fields import ProtocolError, Staged
from job.train.distributed.wire_fields import key_list as _key_list
from job.train.distributed.wire_fields import staged as _staged
from job.types import PartitionKey

STEPS = ("wait", "stage", "move", "go", "ending")


@dataclass(frozen=True)
class Cut:
    """A rank's turn in a cut: ask what to do (no field), report its ``staged`` files (the keys it was told to
    stage, each ``[type, partition, staged name, size, crc32]``), or say it ``moved`` them to their PBG names."""

    staged: Optional[tuple[Staged, ...]] = None
    moved: bool = False
    op = "cut"

    def wire(self) -> dict[str, Any]:
        message: dict[str, Any] = {"moved": True} if self.moved else {}
        if self.staged is not None:
            message["staged"] = [[s[0], int(s[1]), *s[2:]] for s in self.staged]
        return message


def decode_cut(fields: Mapping[str, Any]) -> Cut:
    staged = fields.get("staged")
    if staged is not None and not isinstance(staged, list):
        raise ProtocolError(f"'staged' is not a list: {staged!r}")
    moved = fields.get("moved", False)
    if not isinstance(moved, bool):
        raise ProtocolError(f"'moved' is not a boolean: {moved!r}")
    return Cut(staged=tuple(_staged(s) for s in staged) if staged is not None else None, moved=moved)


@dataclass(frozen=True)
class CutStep:
    """The answer to ``cut``: the ``step`` to take (``STEPS``, see the module docstring) and, for ``stage``, the
    ``keys`` to stage; ``why`` the round ends (``ending``); ``behind``: a turn in a cut taken in the background
    (job/train/distributed/cut_behind.py) whose ``stage`` leaves the rank its reservation (it trains that next)."""

    step: str
    keys: tuple[PartitionKey, ...] = ()
    why: Optional[str] = None
    behind: bool = False

    def wire(self) -> dict[str, Any]:
        message: dict[str, Any] = {"step": self.step, "keys": [[k[0], int(k[1])] for k in self.keys]}
        if self.why is not None:
            message["why"] = self.why
        if self.behind:
            message["behind"] = True
        return message

    @classmethod
    def from_wire(cls, message: Mapping[str, Any]) -> CutStep:
        step = message.get("step")
        if step not in STEPS:
            raise ProtocolError(f"'step' is not one of {STEPS}: {step!r}")
        why = message.get("why")
        behind = message.get("behind", False)
        if not isinstance(behind, bool):
            raise ProtocolError(f"'behind' is not a boolean: {behind!r}")
        return cls(step=str(step), keys=_key_list(message.get("keys", []), "'keys'"),
                   why=str(why) if why is not None else None, behind=behind)
