"""Cuts by time (``write_behind_seconds``, job/train/distributed/cuts.py ``Cuts.cadence``): with writes behind a lost
pod costs the group's work since the last cut, so a cut is also due once that many seconds passed since the last one
began, whichever of it and ``write_behind_buckets`` comes first. The lock server's real ``LockState`` and ``Cuts``
(no processes: what the trainers' requests would ask, in order), with a clock the test moves."""

from __future__ import annotations

import random

import pytest
from test_config import minimal

from job.config import parse_config
from job.errors import ConfigError
from job.train.distributed.cuts import Cuts
from job.train.distributed.lock_state import LockState
from job.train.schedule.orders import all_buckets
from job.types import Bucket


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def group(every: int, every_s: float, background: bool = True) -> tuple[LockState, Cuts, Clock]:
    keys = {b: frozenset({("node", b.lhs), ("node", b.rhs)}) for b in all_buckets(4, 4)}
    clock = Clock()
    cuts = Cuts(every, background=background)
    cuts.cadence(every_s, clock=clock)
    return LockState(4, 4, keys, world_size=2), cuts, clock


def train(state: LockState, cuts: Cuts, rank: int, finished: Bucket | None, rng: random.Random) -> tuple[bool, Bucket]:
    """``rank`` finishes ``finished``: whether its ``next`` is answered ``cut``, else the bucket it is granted."""
    if cuts.due(state, rank, finished, live=range(2)):
        return True, finished  # type: ignore[return-value]
    kind, bucket = state.next_bucket(rank, set(), finished, rng)
    assert kind == "bucket" and bucket is not None, kind
    return False, bucket


@pytest.mark.parametrize("every", [-1, 100])
def test_a_cut_in_the_background_is_due_once_the_seconds_passed_since_the_last_began(every: int) -> None:
    state, cuts, clock = group(every, 60.0)
    rng = random.Random(0)
    _, bucket = train(state, cuts, 0, None, rng)
    for second in (10.0, 30.0, 59.0):  # buckets end before the minute: no cut (-1 or 100 buckets: none by count)
        clock.now = second
        cut, bucket = train(state, cuts, 0, bucket, rng)
        assert not cut and cuts.behind is None
    clock.now = 60.0
    cut, _ = train(state, cuts, 0, bucket, rng)
    assert cut and cuts.behind is not None and not cuts.active  # in the background: the group trains on
    assert cuts.since == 60.0  # the next one counts from this one's start


def test_without_seconds_only_the_buckets_or_the_pass_end_make_a_cut() -> None:
    state, cuts, clock = group(-1, 0.0)
    rng = random.Random(1)
    _, bucket = train(state, cuts, 0, None, rng)
    for step in range(1, 8):
        clock.now = 1e6 * step  # however long: -1 cuts only at the pass's end
        cut, bucket = train(state, cuts, 0, bucket, rng)
        assert not cut and cuts.behind is None


def test_stopping_the_group_the_seconds_call_a_cut_of_the_whole_group() -> None:
    state, cuts, clock = group(-1, 5.0, background=False)
    rng = random.Random(2)
    _, bucket = train(state, cuts, 0, None, rng)
    clock.now = 5.0
    cut, _ = train(state, cuts, 0, bucket, rng)
    assert cut and cuts.active and cuts.phase == "drain" and cuts.behind is None


def test_write_behind_seconds_is_checked() -> None:
    config = parse_config({**minimal(), "write_behind_buckets": -1, "write_behind_seconds": 600})
    assert config.write_behind_seconds == 600
    assert parse_config(minimal()).write_behind_seconds == 0  # the default: by buckets alone
    with pytest.raises(ConfigError, match="only with write_behind_buckets N > 0 or -1; got 600 with "
                                          "write_behind_buckets 0"):
        parse_config({**minimal(), "write_behind_seconds": 600})
    with pytest.raises(ConfigError, match="seconds between cuts, >= 0"):
        parse_config({**minimal(), "write_behind_buckets": -1, "write_behind_seconds": -1})
    with pytest.raises(ValueError, match="write_behind_seconds -1"):
        Cuts(-1).cadence(-1)
