"""How choice points are decided: bounded-exhaustive DFS, PCT priorities, replay.

A schedule is identified by its *deviations*: the choice points where the
chosen thread was not the default one (the running thread if it can go on,
else the lowest-numbered enabled thread). A replay token is a scenario name,
a mutant name and those deviations, so ``--replay`` re-runs exactly that
interleaving.
"""

from __future__ import annotations

import heapq
import random
from typing import Any

from omni_prefix_cache.testing.explore.scheduler import Decision, Scheduler

TOKEN_VERSION = "x1"


def make_token(scenario: str, mutant: str | None, decisions: list[Decision]) -> str:
    devs = ",".join(f"{d.index}:{d.chosen}" for d in decisions if d.chosen != d.default)
    return f"{TOKEN_VERSION}/{scenario}/{mutant or '-'}/{devs or '-'}"


def parse_token(token: str) -> tuple[str, str | None, dict[int, int]]:
    """``(scenario, mutant or None, {choice index: thread})``; ValueError if malformed."""
    parts = token.strip().split("/")
    if len(parts) != 4 or parts[0] != TOKEN_VERSION:
        raise ValueError(
            f"not an explore replay token: {token!r} (expected {TOKEN_VERSION}/SCENARIO/MUTANT/DEVIATIONS)"
        )
    _, scenario, mutant, devs = parts
    out: dict[int, int] = {}
    if devs != "-":
        for item in devs.split(","):
            index, _, thread = item.partition(":")
            if not index.isdigit() or not thread.isdigit():
                raise ValueError(f"bad deviation {item!r} in token {token!r}")
            out[int(index)] = int(thread)
    return scenario, (None if mutant == "-" else mutant), out


class Replay:
    """Follows a token's deviations; the default everywhere else."""

    def __init__(self, deviations: dict[int, int]) -> None:
        self.deviations = deviations
        self.diverged: list[int] = []

    def pick(self, sched: Scheduler, index: int, runnable: list[int], default: int, me_enabled: bool) -> int:
        want = self.deviations.get(index, default)
        if want not in runnable:
            self.diverged.append(index)
            return default
        return want


class Bounded:
    """Bounded-exhaustive search: every schedule with at most ``bound``
    deviations from the default scheduler (delay bounding; a deviation is a
    preemption, or a switch to another thread than the default one when the
    running thread blocks). Schedules run in order of how many deviations
    they have, then of how close together their last two are (a switch away
    and back soon after: the shape of most atomicity violations), so a budget
    cut keeps the likeliest ones. A choice point whose state signature was
    already reached with at least as much budget left is not branched again
    (its extensions are already queued): the state/partial-order pruning that
    makes the search terminate."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._queue: list[tuple[int, int, int, tuple[tuple[int, int], ...]]] = [(0, 0, 0, ())]
        self._seq = 1
        self.visited: dict[Any, int] = {}
        self._devs: dict[int, int] = {}
        self._level = 0
        self._last = -1
        self._pruning = False

    def next_schedule(self) -> bool:
        """Set up the next schedule; False when the bounded space is exhausted."""
        if not self._queue:
            return False
        level, _, _, devs = heapq.heappop(self._queue)
        self._devs = dict(devs)
        self._level = level
        self._last = devs[-1][0] if devs else -1
        self._pruning = False
        return True

    def pick(self, sched: Scheduler, index: int, runnable: list[int], default: int, me_enabled: bool) -> int:
        want = self._devs.get(index, default)
        chosen = want if want in runnable else default
        if index > self._last and self._level < self.bound and not self._pruning:
            left = self.bound - self._level
            sig = sched.last_sig
            if self.visited.get(sig, -1) >= left:
                self._pruning = True
            else:
                self.visited[sig] = left
                devs = tuple(sorted(self._devs.items()))
                gap = index - self._last if self._level else 0
                for alt in runnable:
                    if alt != default:
                        heapq.heappush(self._queue, (self._level + 1, gap, self._seq, (*devs, (index, alt))))
                        self._seq += 1
        return chosen


class Pct:
    """PCT (probabilistic concurrency testing): random thread priorities,
    the highest-priority enabled thread runs, and ``depth - 1`` random choice
    points demote the running thread below everyone. One instance per run."""

    def __init__(self, seed: int, depth: int, horizon: int) -> None:
        self.rng = random.Random(seed)
        self.prio: dict[int, float] = {}
        self.changes = set(self.rng.sample(range(max(horizon, depth)), max(0, depth - 1)))
        self.low = 0.0

    def pick(self, sched: Scheduler, index: int, runnable: list[int], default: int, me_enabled: bool) -> int:
        for t in runnable:
            if t not in self.prio:
                self.prio[t] = 1.0 + self.rng.random()
        best = max(runnable, key=self.prio.__getitem__)
        if index in self.changes:
            self.low -= 1.0
            self.prio[best] = self.low
            best = max(runnable, key=self.prio.__getitem__)
        return best
