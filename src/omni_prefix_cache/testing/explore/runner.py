"""Run scenarios under the controlled scheduler: explore, replay, report."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from omni_prefix_cache.device import sync
from omni_prefix_cache.testing.explore.interrupt import INTERRUPT_SCENARIOS
from omni_prefix_cache.testing.explore.scenarios import SCENARIOS as BASE_SCENARIOS
from omni_prefix_cache.testing.explore.scenarios import Scenario
from omni_prefix_cache.testing.explore.scheduler import Chooser, Failure, Scheduler
from omni_prefix_cache.testing.explore.strategies import Bounded, Pct, Replay, make_token, parse_token

# Real seconds one schedule may take before it counts as a hang (a thread
# blocked on something the scheduler does not control).
RUN_TIMEOUT_S = 60.0
MAX_STEPS = 20_000

# Every scenario the explorer runs, by name.
SCENARIOS: dict[str, Scenario] = {**BASE_SCENARIOS, **INTERRUPT_SCENARIOS}


@dataclass
class Found:
    token: str
    failure: Failure
    trace: str

    def describe(self) -> str:
        lines = [
            f"  {self.failure.message.splitlines()[0][:300]}",
            f"  counts as: {self.failure.reason}  (thread {self.failure.thread})",
        ]
        if self.failure.details:
            lines += ["  " + ln for ln in self.failure.details.rstrip().splitlines()[-8:]]
        lines += ["  last sync points (thread, operation@where):", self.trace]
        lines.append(f"  replay: omni-prefix-cache explore --replay {self.token}")
        return "\n".join(lines)


@dataclass
class Report:
    scenario: str
    strategy: str
    bound: int
    schedules: int = 0
    states: int = 0
    choice_points: int = 0
    exhausted: bool = False
    elapsed_s: float = 0.0
    found: list[Found] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "strategy": self.strategy,
            "preemption_bound": self.bound,
            "schedules": self.schedules,
            "distinct_states": self.states,
            "exhausted": self.exhausted,
            "elapsed_s": round(self.elapsed_s, 2),
            "found": len(self.found),
            "failures": [
                {"token": f.token, "message": f.failure.message, "reason": f.failure.reason} for f in self.found
            ],
        }

    def line(self) -> str:
        bound = f"preemption bound {self.bound}" if self.strategy == "dfs" else f"pct depth {self.bound}"
        done = "exhausted" if self.exhausted else "budget reached"
        return (
            f"{self.scenario:15s} {self.strategy}: {self.schedules} schedules, {bound}, {self.states} distinct states, "
            f"{done}, {self.elapsed_s:.1f}s, found: {len(self.found)}"
        )


@contextlib.contextmanager
def quiet_runtime() -> Iterator[None]:
    """The runtime logs failures it handles (injected ones, shutdown); keep them off the report."""
    log = logging.getLogger("omni_prefix_cache")
    level = log.level
    log.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        log.setLevel(level)


def run_schedule(scenario: Scenario, chooser: Chooser, states: set[Any] | None = None) -> Scheduler:
    """Run ``scenario`` once under ``chooser``; the scheduler holds the outcome."""
    sched = Scheduler(chooser, max_steps=MAX_STEPS)
    sched.states = states
    with sync.installed(**sched.factories()):
        sched.start_root("engine", lambda: scenario.main(sched))
        if not sched.finished.wait(RUN_TIMEOUT_S):
            sched.fail(Failure("hang", "?", f"a schedule ran past {RUN_TIMEOUT_S:g}s", sched.trace()))
            sched.finished.wait(5.0)
    return sched


def _mutated(mutant: str | None) -> contextlib.AbstractContextManager[Any]:
    if mutant is None:
        return contextlib.nullcontext()
    from omni_prefix_cache.testing.mutant_catalogue import applied

    return applied(mutant)


def explore(
    scenario: str,
    *,
    strategy: str = "dfs",
    bound: int = 2,
    budget: int = 2000,
    seed: int = 0,
    mutant: str | None = None,
    stop_at_first: bool = True,
    time_budget_s: float | None = None,
) -> Report:
    """Explore ``scenario``: ``dfs`` (every schedule with at most ``bound``
    preemptions, pruned by state) or ``pct`` (``budget`` random priority
    schedules of depth ``bound``). Stops at ``budget`` schedules, at
    ``time_budget_s``, or at the first failure when ``stop_at_first``."""
    sc = SCENARIOS[scenario]
    report = Report(scenario, strategy, bound)
    states: set[Any] = set()
    start = time.monotonic()
    dfs = Bounded(bound) if strategy == "dfs" else None
    horizon = 50
    with quiet_runtime(), _mutated(mutant):
        while report.schedules < budget:
            if time_budget_s is not None and time.monotonic() - start > time_budget_s:
                break
            chooser: Chooser
            if dfs is not None:
                if not dfs.next_schedule():
                    report.exhausted = True
                    break
                chooser = dfs
            else:
                chooser = Pct(seed * 1_000_003 + report.schedules, bound, horizon)
            sched = run_schedule(sc, chooser, states)
            report.schedules += 1
            report.choice_points = max(report.choice_points, len(sched.decisions))
            horizon = max(horizon, len(sched.decisions))
            if sched.failure is not None:
                report.found.append(Found(make_token(scenario, mutant, sched.decisions), sched.failure, sched.trace()))
                if stop_at_first:
                    break
    report.states = len(states)
    report.elapsed_s = time.monotonic() - start
    return report


def replay(token: str) -> tuple[Scheduler, list[int]]:
    """Re-run the schedule a token names: the scheduler (with its failure,
    if any) and the choice points where the run diverged from the token."""
    scenario, mutant, deviations = parse_token(token)
    if scenario not in SCENARIOS:
        raise ValueError(f"token names an unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    chooser = Replay(deviations)
    with quiet_runtime(), _mutated(mutant):
        sched = run_schedule(SCENARIOS[scenario], chooser)
    return sched, chooser.diverged
