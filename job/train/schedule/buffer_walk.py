"""The walk behind ``bucket_order: buffer``: which partition to load next, and which to evict for it, so that
every pair of partitions (a bucket and its transpose) meets in a buffer of c = ``capacity`` partitions with few
loads; and ``lower_bound_loads``, the fewest loads any walk can take.

A walk is found once per (P, c) on labels 0..P-1 (cached); ``buckets.buffer_order`` gives the labels to the
partitions at random, the partitions already in memory taking the labels loaded first.

The greedy walk loads the partition that meets the most partitions it has not met yet, evicting one it has met
(else the one with the most pairs left: the last newcomer, not one of the partitions it met). From a full buffer
that is the group scheme: c - 1 partitions stay while every other one passes through the last slot, each load
meeting c - 1 new partners; when the group is done with, the next one fills the buffer, and those fillings waste
loads (a filling load meets mostly partitions it has met): about P/2 loads per pass.

``_refine`` changes the walk where that pays, by rollout (the "pilot method"): at each step the greedy move and
up to ``REFINE_WIDTH`` - 1 other moves meeting at most one new partner fewer are each followed by a greedy
finish, and the move whose finished walk loads least is taken. It keeps the greedy move on ties, so it never
loads more than the greedy walk; it stops trying once a finished walk reaches the lower bound, and starts no
step's rollouts after ``REFINE_BUDGET`` units of work (a started step finishes its few), so a walk is the same
on every machine (P = 64: a few seconds, once per process). Above ``REFINE_MAX_PARTS`` partitions it tries no
rollouts at all: the greedy walk alone costs ~P^3/c units there, and every trainer process finds its walk.

What it takes: the lower bound for c = 2, for c = 3 up to P = 32 and for c >= P/2 (checked up to P = 40); the
fewest loads there are on every grid where an exhaustive search finished (45 grids with P <= 13 and c >= 3,
among them P = 9, c = 4, P = 10, c = 4 and P = 11, c = 5, which need one load more than the bound; the tests
search the smaller ones); up to ~15% above the bound for c around P/3 (P = 24, c = 9: 45 against 39; P = 64,
c = 16: 162 against 143), where the bound is loose by an unknown part of that. tests/test_bucket_order.py
holds P = 8, 16, 32 within 10% of the bound.
"""

from __future__ import annotations

from functools import lru_cache

Step = tuple[int, int]  # (evicted label or -1 while the buffer fills, loaded label)

# rollout work spent refining one walk, in partitions scanned (a greedy step scans P): ~7 s of CPU at P = 64
REFINE_BUDGET = 10_000_000
REFINE_WIDTH = 6  # moves tried per step by rollout (the greedy one and the next best, up to labels)
REFINE_MAX_PARTS = 128  # above this many partitions the greedy walk is taken as it is


class _Walk:
    """Buffer contents and the pairs not met yet, with each partition's count of unmet partners in memory."""

    __slots__ = ("nparts", "capacity", "held", "held_mask", "unmet", "pairs_left", "left", "in_memory", "steps",
                 "loads")

    def __init__(self, nparts: int, capacity: int) -> None:
        self.nparts, self.capacity = nparts, capacity
        everyone = (1 << nparts) - 1
        self.unmet = [everyone] * nparts  # bit y of unmet[x]: bucket (x, y) not trained yet (bit x: (x, x))
        self.pairs_left = [nparts] * nparts  # popcount(unmet[x])
        self.left = nparts * nparts
        self.held: list[int] = []
        self.held_mask = 0
        self.in_memory = [0] * nparts  # popcount(unmet[x] & held_mask)
        self.steps: list[Step] = []  # kept by the walk itself, not by its rollouts
        self.loads = 0
        for label in range(min(capacity, nparts)):
            self.apply(-1, label)

    def copy(self) -> _Walk:
        other = _Walk.__new__(_Walk)
        other.nparts, other.capacity = self.nparts, self.capacity
        other.held, other.held_mask = list(self.held), self.held_mask
        other.unmet, other.pairs_left = list(self.unmet), list(self.pairs_left)
        other.left, other.in_memory = self.left, list(self.in_memory)
        other.steps, other.loads = [], self.loads
        return other

    def apply(self, evicted: int, loaded: int) -> None:
        unmet, in_memory, pairs_left = self.unmet, self.in_memory, self.pairs_left
        if evicted >= 0:
            self.held.remove(evicted)
            self.held_mask &= ~(1 << evicted)
            for y in _bits(unmet[evicted]):
                in_memory[y] -= 1
        self.held.append(loaded)
        self.held_mask |= 1 << loaded
        for y in _bits(unmet[loaded]):
            in_memory[y] += 1
        for y in _bits(unmet[loaded] & self.held_mask):  # the newcomer meets what is in memory (itself too)
            unmet[loaded] &= ~(1 << y)
            unmet[y] &= ~(1 << loaded)
            in_memory[y] -= 1
            pairs_left[y] -= 1
            if y != loaded:
                in_memory[loaded] -= 1
                pairs_left[loaded] -= 1
            self.left -= 1 if y == loaded else 2
        self.steps.append((evicted, loaded))
        self.loads += 1

    def evictable(self) -> list[int]:
        """Partitions a load may evict, most pairs left first: -1 while the buffer fills; only a partition done
        with (every pair met) while one is in memory, since keeping it helps nothing."""
        if len(self.held) < self.capacity:
            return [-1]
        done = [p for p in self.held if not self.pairs_left[p]]
        return sorted(done[:1] or self.held, key=lambda p: -self.pairs_left[p])

    def greedy_move(self) -> Step:
        """The load meeting the most new partners, evicting a partition it has met if any (it loses nothing),
        else the one with the most pairs left; ties: the partition with the most pairs left, the lowest label."""
        unmet, pairs_left, in_memory, held_mask = self.unmet, self.pairs_left, self.in_memory, self.held_mask
        evictable = self.evictable()
        first = evictable[0]
        evictable_mask = sum(1 << e for e in evictable if e >= 0)
        scale = self.nparts + 2
        best_score, best = -1, (first, -1)
        for x in range(self.nparts):
            if held_mask >> x & 1 or not pairs_left[x]:
                continue
            mask = unmet[x]
            met = evictable_mask & ~mask
            if first < 0:
                victim, lost = first, 0
            elif not met:
                victim, lost = first, 1
            elif met >> first & 1:
                victim, lost = first, 0
            else:
                victim, lost = next(e for e in evictable if met >> e & 1), 0
            gain = in_memory[x] + (mask >> x & 1) - lost
            score = ((gain * scale + (pairs_left[victim] if victim >= 0 else 0)) * scale + pairs_left[x]) * scale \
                + scale - 1 - x
            if score > best_score:
                best_score, best = score, (victim, x)
        return best

    def gain(self, evicted: int, loaded: int) -> int:
        """New pairs the move trains (the load with itself included)."""
        mask = self.unmet[loaded]
        return self.in_memory[loaded] + (mask >> loaded & 1) - (evicted >= 0 and mask >> evicted & 1)

    def moves(self) -> list[tuple[int, Step]]:
        """Every move as (new pairs, move), most new pairs first."""
        evictable = self.evictable()
        out = [(self.gain(e, x), (e, x)) for x in range(self.nparts)
               if not self.held_mask >> x & 1 and self.pairs_left[x] for e in evictable]
        out.sort(key=lambda m: -m[0])
        return out

    def interchangeable(self, a: int, b: int) -> bool:
        """Swapping the labels a and b (both in memory or both not) maps the state onto itself."""
        ua, ub = self.unmet[a], self.unmet[b]
        others = ~((1 << a) | (1 << b))
        return ua & others == ub & others and (ua >> a & 1) == (ub >> b & 1)

    def finish_greedily(self, budget: list[int]) -> int:
        """Complete the walk with greedy moves; returns its loads (budget[0] counts down the steps taken)."""
        while self.left:
            self.apply(*self.greedy_move())
            budget[0] -= self.nparts
        return self.loads


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def lower_bound_loads(nparts: int, capacity: int, resident: int = 0) -> int:
    """The fewest partition loads that train every bucket of a square grid of P = ``nparts`` partitions with
    c = ``capacity`` of them in memory, r = ``resident`` of them there already (those are not loaded).

    Any walk can be made lazy, evicting only to make room for a load, without loading more (keep what the walk
    evicted early until a load needs its slot), so the buffer is full at every eviction. For c < P:

    - every partition is loaded once at least: P - r loads;
    - the partitions loaded only once meet every other partition during their one stay, so those stays overlap
      pairwise, hence (intervals) all at one moment: at most c of them. The other P - c are loaded again;
    - rank the partitions by their first arrival: the j-th meets at most min(j - 1, c - 1) partitions on
      arriving, so first arrivals meet at most C(c, 2) + (P - c)(c - 1) of the C(P, 2) pairs and the other
      C(P - c + 1, 2) pairs meet at a reload. A reloaded partition left a full buffer, so it had met c - 1
      others already: a reload meets at most min(c - 1, P - c) partitions for the first time.

    Hence P - r + max(P - c, ceil(C(P - c + 1, 2) / min(c - 1, P - c))); for c >= P, P - r. The old count
    (first c loads meet C(c, 2) pairs, each later load c - 1) is the second term without the max and the min,
    which is loose for c above ~(P + 3)/3 (P = 16, c = 8: 22, where 24 are needed). The fewest loads equal it on every
    grid with P <= 8 that was searched (tests/test_bucket_order.py: all but c = 2 above P = 5, (6, 2) checked once:
    16, and (8, 3), whose searches take minutes) and on c >= P/2 (the walk takes it); it is one
    short on P = 9, c = 4, P = 10, c = 4 and P = 11, c = 5.
    """
    if capacity < 2:
        raise ValueError("a bucket needs two partitions in memory: capacity >= 2")
    resident = min(resident, capacity, nparts)
    if capacity >= nparts:
        return nparts - resident
    pairs_at_reloads = (nparts - capacity + 1) * (nparts - capacity) // 2
    per_reload = min(capacity - 1, nparts - capacity)
    return nparts - resident + max(nparts - capacity, -(-pairs_at_reloads // per_reload))


@lru_cache(maxsize=64)
def walk(nparts: int, capacity: int) -> tuple[Step, ...]:
    """The steps of a walk over labels 0..P-1: the first ``min(capacity, P)`` steps fill the buffer with labels
    0.. (evicted = -1), each later step evicts one label and loads another. Cached: every pass reuses it; the
    greedy walk as it is where it takes the lower bound (no rollouts)."""
    if capacity < 2:
        raise ValueError("a bucket needs two partitions in memory: capacity >= 2")
    greedy = _Walk(nparts, capacity)
    floor = lower_bound_loads(nparts, capacity)
    if greedy.finish_greedily([0]) == floor or nparts > REFINE_MAX_PARTS:
        return tuple(greedy.steps)
    state = _Walk(nparts, capacity)
    _refine(state, [REFINE_BUDGET], floor)
    return tuple(state.steps)


def _refine(state: _Walk, budget: list[int], floor: int) -> None:
    """Walk to the end, each step trying the greedy move and a few others by rollout while the budget lasts
    and the best walk found loads more than ``floor`` (the lower bound: then the greedy finishes it)."""
    fewest = -1
    while state.left:
        best = state.greedy_move()
        if budget[0] <= 0 or fewest == floor:
            state.apply(*best)
            continue
        least = state.gain(*best) - 1
        candidates = [best]
        for gain, (evicted, loaded) in state.moves():
            if gain < least or len(candidates) >= REFINE_WIDTH:
                break
            if any(evicted == e and state.interchangeable(loaded, x)
                   or loaded == x and evicted >= 0 and e >= 0 and state.interchangeable(evicted, e)
                   for e, x in candidates):
                continue  # the same move up to labels
            candidates.append((evicted, loaded))
        if len(candidates) == 1:
            state.apply(*best)
            continue
        chosen, fewest = best, -1
        for move in candidates:
            trial = state.copy()
            trial.apply(*move)
            loads = trial.finish_greedily(budget)
            if fewest < 0 or loads < fewest:
                chosen, fewest = move, loads
        state.apply(*chosen)
