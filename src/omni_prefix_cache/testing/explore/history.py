"""Free-running stress with a history checker.

Real threads at full speed (the threaded committer, the prefetch executor,
one engine thread and several materialize threads) drive one manager; every
facade call's invocation and response is recorded in a history, which is
then checked for linearizability against a sequential reference model of
the step ledger (Wing & Gong search with memoization, as in Knossos or
porcupine; the history is partitioned by step id, porcupine's
P-compositionality, which keeps each search small and bounded).

The model: ``save`` opens a fresh step id whose rows are those the engine
computed; ``materialize`` of an open step returns exactly those rows and
consumes it; ``discard`` consumes it; consuming a step twice is refused.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omni_prefix_cache.interface import HIDDEN_KEY, OmniPrefixCacheUnmatchError, PrefixCacheConfig


@dataclass(frozen=True)
class Op:
    """One facade call: ``inv`` / ``res`` are ticks of one global clock."""

    thread: str
    name: str  # "save", "materialize" or "discard"
    key: int  # the step id
    value: Hashable  # save: digest of the engine's rows; materialize: digest served or "refused"
    inv: int
    res: int


class Recorder:
    """Stamps invocations and responses on one clock (a lock-protected counter)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clock = itertools.count()
        self.ops: list[Op] = []

    def tick(self) -> int:
        with self._lock:
            return next(self._clock)

    def add(self, op: Op) -> None:
        with self._lock:
            self.ops.append(op)


# ---------------------------------------------------------------- model and checker

# The sequential model of one step id: state is "none" (not saved), ("open", digest) or "consumed".
State = Hashable


def step_model(state: State, op: Op) -> tuple[bool, State]:
    """Apply ``op`` to the sequential step ledger: (result allowed, next state)."""
    if op.name == "save":
        return state == "none", ("open", op.value)
    if op.name == "discard":
        return isinstance(state, tuple), "consumed"
    if op.name == "materialize":
        if isinstance(state, tuple):
            return op.value == state[1], "consumed"
        return op.value == "refused", state
    raise ValueError(f"unknown op {op.name!r}")


def linearizable(
    ops: Sequence[Op], model: Callable[[State, Op], tuple[bool, State]] = step_model, init: State = "none"
) -> bool:
    """Is there a total order of ``ops``, respecting real time (an op that
    responded before another was invoked comes first), that ``model``
    accepts? Wing & Gong's search, memoized on (linearized set, state)."""
    n = len(ops)
    if n > 20:
        raise ValueError(f"history partition of {n} ops is past the checker's bound (20)")
    seen: set[tuple[int, State]] = set()

    def search(done: int, state: State) -> bool:
        if done == (1 << n) - 1:
            return True
        if (done, state) in seen:
            return False
        seen.add((done, state))
        pending = [i for i in range(n) if not done >> i & 1]
        earliest_res = min(ops[i].res for i in pending)
        for i in pending:
            if ops[i].inv > earliest_res:
                continue  # some pending op responded before this one was invoked
            ok, nxt = model(state, ops[i])
            if ok and search(done | 1 << i, nxt):
                return True
        return False

    return search(0, init)


def check_history(ops: Sequence[Op]) -> list[int]:
    """Step ids whose partition of the history is not linearizable."""
    by_key: dict[int, list[Op]] = {}
    for op in ops:
        by_key.setdefault(op.key, []).append(op)
    return sorted(key for key, part in by_key.items() if not linearizable(part))


# ---------------------------------------------------------------- the stress run


def _digest(rows: dict[str, dict[str, torch.Tensor]]) -> Hashable:
    return tuple(
        (rid, key, tuple(t.flatten().tolist())) for rid in sorted(rows) for key, t in sorted(rows[rid].items())
    )


@dataclass
class StressResult:
    ops: int
    steps: int
    bad_keys: list[int]
    errors: list[str]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.bad_keys and not self.errors


def stress(duration_s: float, *, materializers: int = 2, seed: int = 0) -> StressResult:
    """Run the engine and ``materializers`` threads against a threaded manager
    for ``duration_s``; check the history."""
    from omni_prefix_cache.manager import OmniPrefixCacheManager
    from omni_prefix_cache.testing.explore.scenarios import BS, Engine, Req, View

    rng = random.Random(seed)
    config = PrefixCacheConfig(num_blocks=12, block_size=BS, staging_depth=4)
    view = View()
    mgr = OmniPrefixCacheManager(config, view, eager=False, committer="thread")
    engine = Engine(mgr, view, (HIDDEN_KEY, "m"))
    rec = Recorder()
    jobs: list[tuple[int, Any]] = []
    cond = threading.Condition()
    stop = threading.Event()
    errors: list[str] = []

    def consume(name: str) -> None:
        while True:
            with cond:
                cond.wait_for(lambda: jobs or stop.is_set())
                if not jobs:
                    return
                sid, expected = jobs.pop(0)
                cond.notify_all()  # the engine waits for the backlog to shrink
            discard = rng.random() < 0.15
            inv = rec.tick()
            if discard:
                mgr.discard_step(sid)
                rec.add(Op(name, "discard", sid, None, inv, rec.tick()))
                continue
            try:
                got = mgr.materialize(sid, list(expected))
                value: Hashable = _digest(
                    {
                        rid: {
                            key: (got.hidden_states or {})[rid] if key == HIDDEN_KEY else got.mm_outputs[key][rid]
                            for key in per_key
                        }
                        for rid, per_key in expected.items()
                    }
                )
            except OmniPrefixCacheUnmatchError as exc:
                value = "refused"
                errors.append(f"{name}: materialize(step {sid}) refused: {exc}")
            rec.add(Op(name, "materialize", sid, value, inv, rec.tick()))

    threads = [threading.Thread(target=consume, args=(f"materialize-{i}",)) for i in range(materializers)]
    for t in threads:
        t.start()
    start = time.monotonic()
    steps = 0
    base = 0
    previous: tuple[str, ...] = ()
    try:
        while time.monotonic() - start < duration_s:
            # One round on blocks [base, base+3): a computes two blocks, b hits them,
            # then both finish and c reuses the first block while b's step may be unconsumed.
            b0, b1, b2 = base, base + 1, base + 2
            a, b, c = f"a{steps}", f"b{steps}", f"c{steps}"
            for reqs, finished in (
                ({a: Req([b0, b1], 0, 4)}, previous),
                ({b: Req([b0, b1, b2], 4, 1, hit=4)}, ()),
                ({c: Req([b0], 0, 2)}, (a, b)),
            ):
                inv = rec.tick()
                sid, expected = engine.run(reqs, finished=finished)
                rec.add(Op("engine", "save", sid, _digest(expected), inv, rec.tick()))
                with cond:
                    jobs.append((sid, expected))
                    cond.notify()
                steps += 1
            previous = (c,)  # finishes with the next round's first step
            base = (base + 3) % 12
            with cond:  # keep the staging pages from running out: wait for the consumers to catch up
                cond.wait_for(lambda: len(jobs) < 2, timeout=30)
    finally:
        stop.set()
        with cond:
            cond.notify_all()
        for t in threads:
            t.join(60)
        mgr.shutdown()
    bad = check_history(rec.ops)
    return StressResult(len(rec.ops), steps, bad, errors, time.monotonic() - start)


def main(argv: Sequence[str] | None = None) -> int:
    """``make stress``: run, check, print operations checked; exit 1 on a violation."""
    import argparse

    parser = argparse.ArgumentParser(description="free-running stress of a threaded manager, history-checked")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds to run")
    parser.add_argument("--materializers", type=int, default=3, help="materialize threads (2-4)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = stress(args.duration, materializers=args.materializers, seed=args.seed)
    print(
        f"stress: {result.seconds:.1f}s, {result.steps} steps, {result.ops} operations checked "
        f"(engine + {args.materializers} materialize threads + committer + prefetch), "
        f"non-linearizable steps: {result.bad_keys or 'none'}, refusals: {len(result.errors)}"
    )
    for line in result.errors[:5]:
        print(f"  {line}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
