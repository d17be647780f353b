"""The threaded committer's linger (issue 46, spec/protocol.yaml operation
``linger``, invariant ``idle_writes_land``): a save queues its writes
without waking the committer (new_step's kick is the busy engine's path),
so an engine that goes idle after its last step has no next kick. The
committer's own timed wait runs those writes once they waited a whole
linger: the manager becomes quiescent by itself, nothing held, every
in-flight gauge at zero.

The check polls a liveness property with a deadline far above the bound
(2 x linger plus the writes' own time): it fails only when the writes never
land, as they did before the linger (holders 1, tasks 1 forever).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from omni_prefix_cache import ModelCachePolicy, PrefixCacheConfig
from omni_prefix_cache.adapter import (
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWrite,
    PrefixCacheWriteLayout,
)
from omni_prefix_cache.interface import OmniPrefixCacheInvalidArgumentError
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.tools.simulate.probe import probe_leaks

BS, W = 4, 3
LINGER = 0.02
# Far above the bound (2 x LINGER plus a few row copies): a shared, loaded machine still lands well inside it.
SLACK_S = 10.0

# The stats() gauges of work in flight (docs/stats.md).
IN_FLIGHT = (
    "write_queue_depth_high",
    "write_queue_depth_low",
    "writes_claimed",
    "writes_blocked",
    "completions_undrained",
    "staging_holders_step",
    "staging_holders_task",
)


def in_flight(mgr: OmniPrefixCacheManager) -> dict[str, Any]:
    """What the manager still holds or has in flight (non-zero entries only)."""
    stats = mgr.stats()
    out: dict[str, Any] = {k: v for k, v in probe_leaks(mgr).items() if v}
    out.update((k, stats[k]) for k in IN_FLIGHT if stats[k])
    busy = {s: n for s, n in stats["tasks_by_state"].items() if n and s not in ("WRITTEN", "FAILED")}
    if busy:
        out["tasks_by_state"] = busy
    return out


def idle_writes_land(mgr: OmniPrefixCacheManager, within_s: float) -> float:
    """Invariant idle_writes_land on the runtime: with no further facade call
    but stats (which drains nothing a write left), the manager is quiescent
    within ``within_s``. Returns the seconds it took."""
    start = time.monotonic()
    while True:
        held = in_flight(mgr)
        if not held:
            return time.monotonic() - start
        assert time.monotonic() - start < within_s, (
            f"idle_writes_land: {within_s:g}s after the engine's last call the manager still holds {held} "
            f"(committer_linger_s={mgr.components.controller.config.committer_linger_s})"
        )
        time.sleep(LINGER / 4)


class Stage:
    """A threaded manager driven through the event API (no group view)."""

    def __init__(self, linger: float = LINGER) -> None:
        cfg = PrefixCacheConfig(num_blocks=16, block_size=BS, committer_linger_s=linger)
        self.m = OmniPrefixCacheManager(cfg, eager=False, committer="thread")
        # Immediate keys only: a running request's deferred write waits for its finish by design.
        self.m.register_policy(ModelCachePolicy(needs_full_hidden_states=True))
        self.blocks = {"a": [1, 2, 3], "b": [4, 5, 6]}
        self.seq = 0

    def step(self, events: list[PrefixCacheRequestEvent], writes: dict[str, tuple[int, int]]) -> Any:
        """new_step_starts, save_outputs and materialize of one step; returns the outputs."""
        self.seq += 1
        sched = tuple((r, e - s) for r, (s, e) in writes.items())
        self.m.new_step_starts(PrefixCacheStep(tuple(events), sched, self.seq))
        out, slots, rows, cursor = [], [], [], 0
        for rid, (s, e) in writes.items():
            out.append(PrefixCacheWrite(rid, cursor, cursor + e - s, s, e))
            cursor += e - s
            slots += [self.blocks[rid][p // BS] * BS + p % BS for p in range(s, e)]
            rows.append(torch.arange(s, e, dtype=torch.float32)[:, None].repeat(1, W) + (100 if rid == "b" else 0))
        hidden = torch.cat(rows)
        layout = PrefixCacheWriteLayout(tuple(out), cursor, torch.tensor(slots, dtype=torch.int64))
        sid = self.m.save_outputs(
            hidden,
            {"codes": hidden[:, :1] * 10},
            num_tokens_unpadded=cursor,
            num_tokens_padded=cursor,
            write_layout=layout,
        )
        return self.m.materialize(sid, list(writes))


@pytest.fixture
def stage() -> Iterator[Stage]:
    s = Stage()
    yield s
    s.m.shutdown()


def test_an_idle_engines_last_writes_land_without_a_following_step(stage: Stage) -> None:
    """Save, materialize, go idle: the step's immediate writes (a staging page
    held by its task) used to wait for a next new_step forever."""
    started = PrefixCacheRequestEvent("a", PrefixCacheEventKind.STARTED, scheduled_tokens=6)
    stage.step([started], {"a": (0, 6)})
    idle_writes_land(stage.m, LINGER * 2 + SLACK_S)
    # The rows are in the pool: a later hit on a's blocks reads them from there.
    rows = stage.m.components.pool.rows("__hidden_states__", torch.tensor([4, 5, 6, 7, 8, 9]))
    assert rows[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_a_busy_engines_writes_still_run_at_the_kick() -> None:
    """With a linger no wait of the committer runs out here, each step's
    writes are run by the next new_step's kick, as before the linger."""
    s = Stage(linger=3600.0)
    try:
        s.step([PrefixCacheRequestEvent("a", PrefixCacheEventKind.STARTED, scheduled_tokens=4)], {"a": (0, 4)})
        s.step([PrefixCacheRequestEvent("a", PrefixCacheEventKind.EXTENDED, scheduled_tokens=1)], {"a": (4, 5)})
        s.m.new_step_starts(PrefixCacheStep((), (), s.seq + 1))  # the kick: the second step's write runs now
        idle_writes_land(s.m, SLACK_S)
    finally:
        s.m.shutdown()


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "0.1"])
def test_a_linger_that_is_not_a_positive_number_of_seconds_is_refused(bad: Any) -> None:
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="committer_linger_s"):
        PrefixCacheConfig(num_blocks=4, block_size=BS, committer_linger_s=bad)
