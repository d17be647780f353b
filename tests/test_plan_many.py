"""Batched hit planning (``HitPlanner.plan_many``, ``HitReads.plan_many``)
plans the same reads, with the same failures and the same job order, as
planning hit by hit (``HitPlanner.plan``), whatever the slots' states.

Two planners read one occupancy table (planning never changes it), each with
its own read registry; one plans hit by hit, the other in one batch. The
tables are drawn at random: every slot ABSENT, IN_TRANSIT (owned by an
immediate, a deferred, a failed or an unknown write) or COMMITTED, with
random versions, for the hidden key and an mm key."""

from __future__ import annotations

import random
import threading
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.interface import HIDDEN_KEY, ModelCachePolicy, PrefixCacheConfig, WriteSchedule
from omni_prefix_cache.reads.hit_planner import HitPlanner
from omni_prefix_cache.reads.planned_read import HitReads, PlannedRead
from omni_prefix_cache.steps.slot_occupancy import SlotOccupancy, SlotState
from omni_prefix_cache.steps.step_record import Hit
from omni_prefix_cache.writes.write_task import TaskState

BS = 4
BLOCKS = 16
WIDTH = {HIDDEN_KEY: 8, "mm_a": 3}


class Tasks:
    """The task registry as planning sees it: ``get`` by tid."""

    def __init__(self, rng: random.Random) -> None:
        self.tasks: dict[int, Any] = {}
        for tid in range(1, 7):
            schedule = WriteSchedule.JOIN_NEXT_STEP if tid % 2 else WriteSchedule.JOIN_ON_FINISH
            state = TaskState.FAILED if rng.random() < 0.15 else TaskState.QUEUED
            # A deferred owner's rows: chunk tid % 3, row = slot + tid (what a read pins).
            rows = {slot: (tid % 3, slot + tid) for slot in range(BLOCKS * BS)}
            self.tasks[tid] = SimpleNamespace(tid=tid, schedule=schedule, state=state, slot_to_row=lambda r=rows: r)

    def get(self, tid: int) -> Any:
        return self.tasks.get(tid)  # tid 7 is unknown


def tables(rng: random.Random, p_committed: float) -> tuple[PrefixBlockPool, SlotOccupancy]:
    config = PrefixCacheConfig(num_blocks=BLOCKS, block_size=BS)
    pool = PrefixBlockPool(config)
    occupancy = SlotOccupancy(BLOCKS * BS)
    for key in (HIDDEN_KEY, "mm_a"):
        pool.ensure_key(key, torch.float32, WIDTH[key])
        table = occupancy.add_key(key)
        for slot in range(BLOCKS * BS):
            r = rng.random()
            if r < p_committed:
                table.state[slot] = int(SlotState.COMMITTED)
            elif r < p_committed + (1 - p_committed) / 2:
                table.state[slot] = int(SlotState.IN_TRANSIT)
                table.tids[slot] = rng.randint(1, 7)
            table.slot_version[slot] = rng.randint(0, 3)
    return pool, occupancy


def planner(pool: PrefixBlockPool, occupancy: SlotOccupancy, tasks: Tasks) -> HitPlanner:
    reads = HitReads(pool, None, tasks, None, occupancy, threading.Lock())  # type: ignore[arg-type]
    policy = ModelCachePolicy(needs_full_hidden_states=True)
    config = PrefixCacheConfig(num_blocks=BLOCKS, block_size=BS)
    return HitPlanner(config, occupancy, reads, None, {}, lambda: policy, lambda: False)  # type: ignore[arg-type]


def hits(rng: random.Random, hp: HitPlanner) -> list[Hit]:
    out = []
    for i in range(rng.randint(0, 6)):
        blocks = [rng.randrange(BLOCKS) for _ in range(rng.randint(0, 3))]
        hit = Hit(
            req_id=f"r{i}",
            hit_start=0,
            hit_end=len(blocks) * BS,
            block_ids=blocks,
            slots=hp.block_slots(blocks),
            num_scheduled=1,
        )
        if blocks and rng.random() < 0.2:  # a key planned already (at new_step_starts)
            done: Future[torch.Tensor] = Future()
            done.set_result(torch.zeros(1))
            hit.futures[HIDDEN_KEY] = done
        out.append(hit)
    return out


def copy_hits(src: list[Hit]) -> list[Hit]:
    return [
        Hit(h.req_id, h.hit_start, h.hit_end, list(h.block_ids), None, h.slots, h.num_scheduled, dict(h.futures))
        for h in src
    ]


def read_view(ref: PlannedRead) -> tuple[Any, ...]:
    return (
        ref.req_id,
        ref.key,
        ref.slots.tolist(),
        ref.planned_version.tolist(),
        list(ref.join_tids),
        [(s.task.tid, s.positions.tolist(), s.slots.tolist(), s.rows) for s in ref.staged_list],
        sorted((slot, row.tolist()) for slot, row in ref.preserved.items()),
        ref.state,
    )


def outcome(hit: Hit) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, fut in hit.futures.items():
        exc = fut.exception() if fut.done() else None
        out[key] = ("failed", str(exc)) if exc is not None else ("future", fut.done())
    for key, ref in hit.refs.items():
        out[f"ref {key}"] = read_view(ref)
    return out


@pytest.mark.parametrize("seed", range(60))
def test_plan_many_plans_what_planning_hit_by_hit_plans(seed: int) -> None:
    rng = random.Random(seed)
    tasks = Tasks(rng)
    pool, occupancy = tables(rng, p_committed=rng.choice([1.0, 0.9, 0.5]))
    one_by_one, batched = planner(pool, occupancy, tasks), planner(pool, occupancy, tasks)
    at_save = rng.random() < 0.5
    a = hits(rng, one_by_one)
    b = copy_hits(a)
    jobs_a = [job for hit in a for job in one_by_one.plan(hit, at_save=at_save)]
    jobs_b = batched.plan_many(b, at_save=at_save)
    assert [(h.req_id, k, read_view(r)) for h, k, r in jobs_b] == [(h.req_id, k, read_view(r)) for h, k, r in jobs_a]
    assert [outcome(h) for h in b] == [outcome(h) for h in a]
    assert sorted(map(read_view, batched._reads.pending)) == sorted(map(read_view, one_by_one._reads.pending))


def test_a_refused_read_leaves_the_others_of_its_batch_planned() -> None:
    rng = random.Random(0)
    tasks = Tasks(rng)
    pool, occupancy = tables(rng, p_committed=1.0)
    occupancy.state[HIDDEN_KEY][0:BS] = int(SlotState.ABSENT)  # block 0's hidden rows never written
    hp = planner(pool, occupancy, tasks)
    batch = [Hit(f"r{i}", 0, BS, [i], None, hp.block_slots([i]), 1) for i in range(3)]
    jobs = hp.plan_many(batch, at_save=True)
    assert [(h.req_id, k) for h, k, _ in jobs] == [
        ("r0", "mm_a"),
        ("r1", HIDDEN_KEY),
        ("r1", "mm_a"),
        ("r2", HIDDEN_KEY),
        ("r2", "mm_a"),
    ]
    error = batch[0].futures[HIDDEN_KEY].exception()
    assert error is not None and "never written" in str(error) and "'r0'" in str(error)
    assert len(hp._reads.pending) == 5
