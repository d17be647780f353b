"""The host tier's exhaustive check: every sequence of the tier's entry points,
within small bounds, on the real ``HostTier`` (spec/host_tier.yaml).

The world: ``hashes`` block hashes, each with two blocks of its own (a rebind
moves between them), room for ``room`` entries' rows (a fill past it is kept
as a surplus), fills that the world serves or fails at any point. The actions are the tier's entry points as the
manager calls them: ``bind``, ``reuse`` of one block, ``settle`` after a fill
served or failed, ``restore`` of a held hash, ``release``. A state is what
the adapter observes (entry states, blocks, fills, rows, bytes); states are
searched breadth first, each reached by replaying its shortest path on a fresh
tier, and the spec's named invariants (``HostTierAdapter.invariants``) are
checked in each. Every state can settle: releasing every hash empties the tier.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError
from omni_prefix_cache.testing.adapters.host_tier import HostTierAdapter, TierSystem, tier_hash, tier_rows
from omni_prefix_cache.testing.stateful import Discrepancy
from omni_prefix_cache.tier.metadata import TierBind

Action = tuple[str, int, int]  # (entry point, hash handle, block or served flag)


@dataclass(frozen=True)
class TierCheckResult:
    states: int
    transitions: int
    depth: int
    elapsed_s: float
    violation: str | None = None  # "<invariant>: <message> after <path>"

    def report(self) -> str:
        head = f"host tier: states explored: {self.states}, transitions: {self.transitions}, max depth: {self.depth}"
        tail = f", elapsed: {self.elapsed_s:.1f}s"
        return head + tail + ("" if self.violation is None else f"\nVIOLATION {self.violation}")


def _actions(hashes: int) -> list[Action]:
    out: list[Action] = []
    for h in range(hashes):
        out += [("bind", h, 2 * h), ("bind", h, 2 * h + 1), ("reuse", h, 2 * h), ("reuse", h, 2 * h + 1)]
        out += [("settle", h, 1), ("settle", h, 0), ("restore", h, 100), ("release", h, 0)]
    return out


def _apply(system: TierSystem, action: Action) -> None:
    """One entry point; a refusal the tier raises (a restore of a hash it does not hold) changes nothing."""
    kind, h, arg = action
    tier = system.tier
    if kind == "bind":
        tier.bind([TierBind(tier_hash(h), arg)])
    elif kind == "reuse":
        tier.reuse([arg])
    elif kind == "settle":
        fut = system.filler.fills.get(tier_hash(h))
        entry = tier.entries.get(tier_hash(h))
        if fut is None or entry is None or entry.fill is not fut or fut.done():
            return
        if arg:
            fut.set_result(tier_rows(system.value()))
        else:
            fut.set_exception(OmniPrefixCacheUnmatchError("read failed"))
        tier.settle()
    elif kind == "restore":
        entry = tier.entries.get(tier_hash(h))
        if entry is None or entry.rows is None:
            return  # a load of what the tier does not hold raises; the manager tests cover it
        tier.restore(f"r{h}", tier_hash(h), arg)
    elif kind == "release":
        tier.release([tier_hash(h)])


def _key(adapter: HostTierAdapter, system: TierSystem, hashes: int) -> tuple[Any, ...]:
    obs = adapter.observe(system, list(range(hashes)))
    obs.pop(("restored",))  # a log, not state
    # Rows are compared by presence: their values are fresh per fill.
    flat = tuple(sorted((repr(k), v is not None if repr(k).startswith("('rows'") else v) for k, v in obs.items()))
    return tuple(adapter.read_state(system, h) for h in range(hashes)) + flat


def check_tier(hashes: int = 3, room: int = 2, max_depth: int = 8, *, raise_violation: bool = False) -> TierCheckResult:
    """Search every state reachable within ``max_depth`` actions; stop at the
    first invariant broken. With ``raise_violation`` the broken invariant
    raises (an AssertionError naming it, from its own check) instead."""
    adapter = HostTierAdapter(max_entries=room)
    invariants: dict[str, Callable[[Any], None]] = dict(adapter.invariants())
    actions = _actions(hashes)
    start = time.perf_counter()

    def replay(path: tuple[Action, ...]) -> TierSystem:
        system = adapter.new_system()
        for a in path:
            _apply(system, a)
        return system

    def broken(system: TierSystem) -> str | None:
        shim = SimpleNamespace(system=system, model=SimpleNamespace(states=dict.fromkeys(range(hashes), "")))
        for name, check in invariants.items():
            try:
                check(shim)
            except Discrepancy as exc:
                if raise_violation:
                    raise AssertionError(f"host tier invariant {name}: {exc}") from exc
                return f"{name}: {exc}"
        return None

    # A fill that does not fit is logged by the tier; the search makes thousands.
    quiet = logging.getLogger("omni_prefix_cache.tier.store")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        return _search(adapter, actions, hashes, max_depth, replay, broken, start)
    finally:
        quiet.setLevel(level)


def _search(
    adapter: HostTierAdapter,
    actions: list[Action],
    hashes: int,
    max_depth: int,
    replay: Callable[[tuple[Action, ...]], TierSystem],
    broken: Callable[[TierSystem], str | None],
    start: float,
) -> TierCheckResult:
    root: tuple[Action, ...] = ()
    seen = {_key(adapter, replay(root), hashes)}
    queue: deque[tuple[Action, ...]] = deque([root])
    transitions = depth = 0
    while queue:
        path = queue.popleft()
        if len(path) >= max_depth:
            continue
        for action in actions:
            system = replay(path + (action,))
            transitions += 1
            why = broken(system)
            if why is not None:
                return TierCheckResult(
                    len(seen), transitions, len(path) + 1, time.perf_counter() - start, f"{why} after {[*path, action]}"
                )
            key = _key(adapter, system, hashes)
            if key not in seen:
                seen.add(key)
                depth = max(depth, len(path) + 1)
                queue.append(path + (action,))
            # Every state can settle: releasing every hash leaves the tier empty.
            for h in range(hashes):
                _apply(system, ("release", h, 0))
            why = broken(system)
            if why is not None:
                elapsed = time.perf_counter() - start
                return TierCheckResult(
                    len(seen),
                    transitions,
                    len(path) + 1,
                    elapsed,
                    f"{why} after {[*path, action]} and releasing every hash",
                )
            if system.tier.entries or system.tier.bound or system.tier.held_bytes or system.tier.surplus_bytes:
                return TierCheckResult(
                    len(seen),
                    transitions,
                    len(path) + 1,
                    time.perf_counter() - start,
                    f"settle: releasing every hash left {system.tier.entries} after {[*path, action]}",
                )
    return TierCheckResult(len(seen), transitions, depth, time.perf_counter() - start)
